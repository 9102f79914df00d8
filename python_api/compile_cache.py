"""JIT compilation of the DSL kernels, cached by their static key.

Kernels are compiled once per (kernel, dtype, head_dim, causal, config) against
symbolic tensors: batch, sequence lengths and head counts are runtime values,
so a new problem size reuses the compiled kernel. The compiled function is
called through TVM-FFI with torch tensors directly, on the current stream.

On a machine without a GPU, `CUTE_DSL_ARCH=sm_90a` (set here when no CUDA
device is visible) lets the DSL compile Hopper kernels to PTX and cubin.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch


def _ensure_arch_env() -> None:
    # Must precede the first `import cutlass`: without a GPU the DSL would
    # default to another architecture and reject warpgroup instructions.
    if "CUTE_DSL_ARCH" not in os.environ and not torch.cuda.is_available():
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"


_ensure_arch_env()

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from cute_kernels.config import FwdConfig  # noqa: E402
from cute_kernels.fwd_sm90 import FlashAttentionForwardSm90  # noqa: E402

TORCH_TO_CUTE = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
_ALIGN_ELEMS = 8  # 16-byte TMA alignment for 16-bit elements


def _sym():
    return cute.sym_int()


def _fake_bshd(dtype, batch, seqlen, heads, head_dim):
    """(batch, seq, heads, head_dim) with head_dim contiguous, strides symbolic."""
    stride = (cute.sym_int64(divisibility=_ALIGN_ELEMS), cute.sym_int64(divisibility=_ALIGN_ELEMS),
              cute.sym_int64(divisibility=_ALIGN_ELEMS), 1)
    return cute.runtime.make_fake_tensor(dtype, (batch, seqlen, heads, head_dim), stride=stride,
                                         assumed_align=16)


@dataclass
class CompiledKernel:
    fn: object  # the TVM-FFI callable: fn(q, k, v, out, lse, scale_log2, num_sms)
    compile_seconds: float


def fwd_key(dtype: torch.dtype, head_dim: int, causal: bool, config: FwdConfig) -> tuple:
    # FwdConfig is frozen, so hashable: the key costs no copying on the hot path.
    return ("fwd_sm90", dtype, head_dim, bool(causal), config)


def compile_fwd(dtype: torch.dtype, head_dim: int, causal: bool, config: FwdConfig,
                dump_dir: str | None = None) -> CompiledKernel:
    cute_dtype = TORCH_TO_CUTE[dtype]
    kernel = FlashAttentionForwardSm90(cute_dtype, head_dim, causal, config)
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = _sym(), _sym(), _sym(), _sym(), _sym()
    q = _fake_bshd(cute_dtype, batch, seqlen_q, heads_q, head_dim)
    k = _fake_bshd(cute_dtype, batch, seqlen_k, heads_kv, head_dim)
    v = _fake_bshd(cute_dtype, batch, seqlen_k, heads_kv, head_dim)
    o = _fake_bshd(cute_dtype, batch, seqlen_q, heads_q, head_dim)
    lse = cute.runtime.make_fake_tensor(
        cutlass.Float32, (batch, heads_q, seqlen_q),
        stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    options = "--enable-tvm-ffi"
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    start = time.perf_counter()
    fn = cute.compile(kernel, q, k, v, o, lse, cutlass.Float32(1.0), cutlass.Int32(1), stream,
                      options=options)
    return CompiledKernel(fn, time.perf_counter() - start)


_cache: dict[tuple, CompiledKernel] = {}
_lock = threading.Lock()


def get_fwd(dtype: torch.dtype, head_dim: int, causal: bool, config: FwdConfig) -> CompiledKernel:
    key = fwd_key(dtype, head_dim, causal, config)
    kernel = _cache.get(key)
    if kernel is None:
        with _lock:
            kernel = _cache.get(key)
            if kernel is None:
                kernel = compile_fwd(dtype, head_dim, causal, config)
                _cache[key] = kernel
    return kernel
