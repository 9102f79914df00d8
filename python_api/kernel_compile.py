"""Compiling the DSL kernels (compile_cache.py keeps and looks them up).

Kernels are compiled against symbolic tensors: batch, sequence lengths and
head counts are runtime values, so a new problem size reuses the compiled
kernel. The compiled function is called through TVM-FFI with torch tensors
directly, on the current stream.

On a machine without a GPU the kernels are compiled for sm_90a to PTX and
cubin: `CUTE_DSL_ARCH=sm_90a` is set here when no CUDA device is visible, and
every compile also names the target (`--gpu-arch`), since the DSL reads the
variable once, at its first use, which may come before this module's import.
Imported only to compile: a process whose kernels all come from the kernel
store never imports the DSL.
"""

from __future__ import annotations

import os
import time

import torch

from .compile_cache import CPU_TARGET_ARCH, CompiledAppend, CompiledBackward, CompiledKernel


def _ensure_arch_env() -> None:
    # Without a GPU the DSL would default to another architecture and reject
    # warpgroup instructions. The variable only helps a DSL that has not read
    # it yet (it caches the first read); _compile names the target as well.
    if "CUTE_DSL_ARCH" not in os.environ and not torch.cuda.is_available():
        os.environ["CUTE_DSL_ARCH"] = CPU_TARGET_ARCH


_ensure_arch_env()

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from .kernels.bwd_pre_post import (BackwardPostprocess, BackwardPreprocess,  # noqa: E402
                                       GroupSum)
from .kernels.bwd_sm90 import FlashAttentionBackwardSm90  # noqa: E402
from .kernels.bwd_config import BwdConfig  # noqa: E402
from .kernels.config import PLAIN_FEATURES, Features, FwdConfig  # noqa: E402
from .kernels.fwd_sm90 import FlashAttentionForwardSm90  # noqa: E402
from .kernels.cache_append import CacheAppend  # noqa: E402
from .kernels.row_gaps import RowGaps  # noqa: E402
from .kernels.split_combine import SplitCombine  # noqa: E402

TORCH_TO_CUTE = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
                 torch.float8_e4m3fn: cutlass.Float8E4M3FN}
_ALIGN_ELEMS = 8  # 16-byte TMA alignment for 16-bit elements


def _sym():
    return cute.sym_int()


def _fake_bshd(dtype, batch, seqlen, heads, head_dim, align_elems: int = _ALIGN_ELEMS):
    """(batch, seq, heads, head_dim) with head_dim contiguous, strides symbolic
    multiples of align_elems (16 bytes: 8 16-bit elements, 4 fp32)."""
    stride = (cute.sym_int64(divisibility=align_elems), cute.sym_int64(divisibility=align_elems),
              cute.sym_int64(divisibility=align_elems), 1)
    return cute.runtime.make_fake_tensor(dtype, (batch, seqlen, heads, head_dim), stride=stride,
                                         assumed_align=16)


def _fake_rows(dtype, batch, heads, length, divisibility: int = 1, align: int = 4):
    """(batch, heads, length) with the last dim contiguous: LSE, D, the dQ accumulator."""
    stride = (cute.sym_int64(divisibility=divisibility), cute.sym_int64(divisibility=divisibility),
              1)
    return cute.runtime.make_fake_tensor(dtype, (batch, heads, length), stride=stride,
                                         assumed_align=align)


def _target_option() -> str:
    """The compile option naming sm_90a where no GPU is visible, else "":
    `import cutlass` before this module (fa4's import does it) fixes the DSL's
    target at its CPU default, sm_100a, whatever the variable says later."""
    return "" if torch.cuda.is_available() else f" --gpu-arch {CPU_TARGET_ARCH}"


def _score_args() -> tuple:
    """Stand-ins for the runtime window (left, right) and scale / softcap,
    which every forward and backward main kernel takes (the scalars launch_plan passes)."""
    return cutlass.Int32(0), cutlass.Int32(0), cutlass.Float32(0.0)


def _seqlen_tensors() -> list:
    """cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k: int32 (1, 1, n), which
    every main kernel takes and only varlen kernels read (varlen.Seqlens)."""
    return [_fake_rows(cutlass.Int32, _sym(), _sym(), _sym()) for _ in range(4)]


def _sink_tensor():
    """The learnable sinks, fp32 (1, 1, h), which every forward main kernel
    and backward preprocess takes and only sink kernels read."""
    return _fake_rows(cutlass.Float32, _sym(), _sym(), _sym())


def _descale_tensors() -> list:
    """The descales of e4m3 q, k and v, fp32 (1, b, h_kv) each with any
    strides (fp8_operands.Descales), which every forward main kernel takes
    and only e4m3 kernels read."""
    batch, heads_kv = _sym(), _sym()
    return [cute.runtime.make_fake_tensor(
        cutlass.Float32, (1, batch, heads_kv), stride=tuple(cute.sym_int64() for _ in range(3)),
        assumed_align=4) for _ in "qkv"]


def _block_sparse_tensor():
    """A block-sparse kernel's tile lists, int32 (b or 1, (h or 1) · tiles,
    words), rows of 16-byte multiples (kernels/block_sparse.py), which every
    forward and backward main kernel takes and only block_sparse kernels read."""
    return _fake_rows(cutlass.Int32, _sym(), _sym(), _sym(), divisibility=4, align=16)


def _compile(kernel, *args, dump_dir: str | None = None):
    options = "--enable-tvm-ffi" + _target_option()
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *args, stream, options=options)


def compile_fwd(dtype: torch.dtype, head_dim: int, causal: bool, config: FwdConfig,
                dump_dir: str | None = None, head_dim_v: int | None = None,
                features: Features = PLAIN_FEATURES,
                out_dtype: torch.dtype | None = None) -> CompiledKernel:
    """The forward of q, k, v of `dtype` (bf16, fp16, or e4m3 with O of
    `out_dtype`, bf16 or fp16)."""
    cute_dtype = TORCH_TO_CUTE[dtype]
    cute_out = TORCH_TO_CUTE[out_dtype or dtype]
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    kernel = FlashAttentionForwardSm90(cute_dtype, head_dim, causal, config, head_dim_v, features,
                                       out_dtype=cute_out)
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = _sym(), _sym(), _sym(), _sym(), _sym()
    # 16-byte strides: 8 16-bit or 16 one-byte elements
    align = 16 // (dtype.itemsize or 1)
    q = _fake_bshd(cute_dtype, batch, seqlen_q, heads_q, head_dim, align)
    k = _fake_bshd(cute_dtype, batch, seqlen_k, heads_kv, head_dim, align)
    v = _fake_bshd(cute_dtype, batch, seqlen_k, heads_kv, head_dim_v, align)
    o = _fake_bshd(cute_out, batch, seqlen_q, heads_q, head_dim_v)
    lse = _fake_rows(cutlass.Float32, batch, heads_q, seqlen_q)
    counters = _fake_rows(cutlass.Int32, _sym(), _sym(), _sym())  # (1, 1, n)
    combine = None
    if features.split_kv:  # fp32 O and LSE per key range, in O's and LSE's order
        parts_batch = _sym()
        partials = _fake_bshd(cutlass.Float32, parts_batch, seqlen_q, heads_q, head_dim_v, 4)
        lse = _fake_rows(cutlass.Float32, parts_batch, heads_q, seqlen_q)
    else:
        partials = _fake_rows(cutlass.Float32, _sym(), _sym(), _sym())  # tail_split.py
    if features.heads_in_rows:  # q and O (1, b · s_q, h, d), LSE (parts · b, h, s_q)
        lse = _fake_rows(cutlass.Float32, _sym(), heads_q, _sym())
    start = time.perf_counter()
    page_table = _fake_rows(cutlass.Int32, _sym(), _sym(), _sym())  # (1, b, max_pages)
    if features.paged_kv:  # the caches (num_pages, page_size, h_kv, d)
        pages, page_size = _sym(), _sym()
        k = _fake_bshd(cute_dtype, pages, page_size, heads_kv, head_dim)
        v = _fake_bshd(cute_dtype, pages, page_size, heads_kv, head_dim_v)
    fn = _compile(kernel, q, k, v, o, lse, counters, partials, *_seqlen_tensors(),
                  _sink_tensor(), page_table, *_descale_tensors(), _block_sparse_tensor(),
                  cutlass.Float32(1.0),
                  cutlass.Int32(1),
                  cutlass.Int32(0),
                  cutlass.Int32(1),
                  *_score_args(), cutlass.Int32(0), dump_dir=dump_dir)
    if features.split_kv:
        combine = _compile_combine(cute_out, head_dim_v,
                                   dump_dir and os.path.join(dump_dir, "combine"))
    return CompiledKernel(fn, time.perf_counter() - start, combine=combine)


def _compile_combine(cute_dtype, head_dim_v: int, dump_dir: str | None):
    """split_combine.SplitCombine over symbolic shapes: partials O (parts, b,
    s_q, h, d_v) and LSE (parts, b, h, s_q) with any strides, d_v contiguous."""
    parts, batch, seqlen_q, heads = _sym(), _sym(), _sym(), _sym()
    o_part = cute.runtime.make_fake_tensor(
        cutlass.Float32, (parts, batch, seqlen_q, heads, head_dim_v),
        stride=tuple(cute.sym_int64(divisibility=4) for _ in range(4)) + (1,), assumed_align=16)
    lse_part = cute.runtime.make_fake_tensor(
        cutlass.Float32, (parts, batch, heads, seqlen_q),
        stride=tuple(cute.sym_int64() for _ in range(4)), assumed_align=4)
    out = _fake_bshd(cute_dtype, batch, seqlen_q, heads, head_dim_v)
    lse = cute.runtime.make_fake_tensor(cutlass.Float32, (batch, heads, seqlen_q),
                                        stride=tuple(cute.sym_int64() for _ in range(3)),
                                        assumed_align=4)
    return _compile(SplitCombine(cute_dtype, head_dim_v), o_part, lse_part, out, lse,
                    dump_dir=dump_dir)


def compile_append(dtype: torch.dtype, head_dim: int, head_dim_v: int,
                   dump_dir: str | None = None) -> CompiledAppend:
    """cache_append.CacheAppend over symbolic shapes: new k, v (b, s_new,
    h_kv, d / d_v) and the caches as pages (pages, page_size, h_kv, d / d_v),
    16-byte strides; page table (b, max_pages) and lengths int32, any
    strides."""
    cute_dtype = TORCH_TO_CUTE[dtype]
    align = 16 // dtype.itemsize
    batch, new, heads_kv, pages, page_size = _sym(), _sym(), _sym(), _sym(), _sym()
    k = _fake_bshd(cute_dtype, batch, new, heads_kv, head_dim, align)
    v = _fake_bshd(cute_dtype, batch, new, heads_kv, head_dim_v, align)
    k_cache = _fake_bshd(cute_dtype, pages, page_size, heads_kv, head_dim, align)
    v_cache = _fake_bshd(cute_dtype, pages, page_size, heads_kv, head_dim_v, align)
    table = cute.runtime.make_fake_tensor(cutlass.Int32, (batch, _sym()),
                                          stride=(cute.sym_int64(), cute.sym_int64()),
                                          assumed_align=4)
    seqlens, lengths = (cute.runtime.make_fake_tensor(cutlass.Int32, (batch,),
                                                      stride=(cute.sym_int64(),),
                                                      assumed_align=4) for _ in range(2))
    start = time.perf_counter()
    fn = _compile(CacheAppend(cute_dtype, head_dim, head_dim_v), k, v, k_cache, v_cache, table,
                  seqlens, lengths, dump_dir=dump_dir)
    return CompiledAppend(fn, time.perf_counter() - start)


def compile_bwd(dtype: torch.dtype, head_dim: int, causal: bool, config: BwdConfig,
                has_grad_lse: bool = False, dump_dir: str | None = None,
                features: Features = PLAIN_FEATURES,
                head_dim_v: int | None = None) -> CompiledBackward:
    """head_dim: q's and k's; head_dim_v: v's, o's and dO's (None: the same)."""
    cute_dtype = TORCH_TO_CUTE[dtype]
    f32 = cutlass.Float32
    dv_dim = head_dim if head_dim_v is None else head_dim_v
    main = FlashAttentionBackwardSm90(cute_dtype, head_dim, causal, config, dv_dim,
                                      features=features)
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = _sym(), _sym(), _sym(), _sym(), _sym()
    padded_q = cute.sym_int(divisibility=config.tile_m)
    accum_len = cute.sym_int(divisibility=config.tile_m * head_dim)
    q = _fake_bshd(cute_dtype, batch, seqlen_q, heads_q, head_dim)
    o, do = (_fake_bshd(cute_dtype, batch, seqlen_q, heads_q, dv_dim) for _ in range(2))
    k = _fake_bshd(cute_dtype, batch, seqlen_k, heads_kv, head_dim)
    v = _fake_bshd(cute_dtype, batch, seqlen_k, heads_kv, dv_dim)
    grad_type, grad_heads = (f32, heads_q) if config.split_gqa else (cute_dtype, heads_kv)
    # split_gqa: fp32 partials per query head
    dk = _fake_bshd(grad_type, batch, seqlen_k, grad_heads, head_dim)
    dv = _fake_bshd(grad_type, batch, seqlen_k, grad_heads, dv_dim)
    lse2, dsum = (_fake_rows(f32, batch, heads_q, padded_q, config.tile_m, 16) for _ in range(2))
    dq_accum = _fake_rows(f32, batch, heads_q, accum_len, config.tile_m * head_dim, 16)
    semaphore = _fake_rows(cutlass.Int32, _sym(), _sym(), _sym())  # tiny unless deterministic
    lse, dlse = (_fake_rows(f32, batch, heads_q, seqlen_q) for _ in range(2))
    dq = _fake_bshd(cute_dtype, batch, seqlen_q, heads_q, head_dim)
    seqlen_tensors = _seqlen_tensors()
    start = time.perf_counter()
    fns = (
        _compile(BackwardPreprocess(cute_dtype, head_dim, has_grad_lse, config,
                                    features.varlen, features.sink),
                 o, do, lse, dlse, lse2, dsum, dq_accum, dq, semaphore, seqlen_tensors[0],
                 seqlen_tensors[2], _sink_tensor(), _fake_rows(f32, _sym(), _sym(), _sym()),
                 cutlass.Int32(0), cutlass.Int32(1),
                 dump_dir=dump_dir and os.path.join(dump_dir, "preprocess")),
        _compile(main, q, k, v, do, lse2, dsum, dq_accum, dq, dk, dv, semaphore, *seqlen_tensors,
                 _block_sparse_tensor(), f32(1.0), f32(1.0), cutlass.Int32(1), *_score_args(),
                 cutlass.Int32(0),
                 dump_dir=dump_dir and os.path.join(dump_dir, "main")),
        # with convert_dq the main kernel writes dQ
        None if config.convert_dq else _compile(
            BackwardPostprocess(cute_dtype, head_dim, config, features.varlen), dq_accum,
            dq, semaphore, seqlen_tensors[0], seqlen_tensors[2], f32(1.0), cutlass.Int32(0),
            cutlass.Int32(1), dump_dir=dump_dir and os.path.join(dump_dir, "postprocess")),
    )
    group_sum = None
    if config.split_gqa:
        dk16 = _fake_bshd(cute_dtype, batch, seqlen_k, heads_kv, head_dim)
        dv16 = _fake_bshd(cute_dtype, batch, seqlen_k, heads_kv, dv_dim)
        group_sum = _compile(GroupSum(cute_dtype, head_dim, dv_dim), dk, dv, dk16, dv16,
                             dump_dir=dump_dir and os.path.join(dump_dir, "group_sum"))
    row_gaps = None
    if features.varlen:
        row_gaps = _compile(RowGaps(cute_dtype, head_dim, dv_dim), dq, dk, dv, *seqlen_tensors,
                            cutlass.Int32(0), cutlass.Int32(1),
                            dump_dir=dump_dir and os.path.join(dump_dir, "row_gaps"))
    return CompiledBackward(*fns, group_sum, compile_seconds=time.perf_counter() - start,
                            row_gaps=row_gaps)
