"""Compiled kernels by their static key: in memory for the process, on disk
across processes (kernel_store.py), compiled (kernel_compile.py) only when
neither has them.

Keys: (kernel, dtype, head_dim, [head_dim_v,] causal, features, config[, has_grad_lse]), and
("cache_append", dtype, head_dim, head_dim_v) for the KV-cache append; batch,
sequence lengths and head counts are runtime values of the compiled kernels.
This module does not import the DSL: loading every kernel from the store
costs milliseconds, where importing the DSL alone costs about a second.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

from . import kernel_store
from .kernels.bwd_config import BwdConfig
from .kernels.config import PLAIN_FEATURES, Features, FwdConfig

# The kernels' target where no GPU is visible to detect one from.
CPU_TARGET_ARCH = "sm_90a"


@dataclass
class CompiledKernel:
    # the TVM-FFI callable: fn(q, k, v, out, lse, counters, partials, cu_seqlens_q,
    # cu_seqlens_k, seqused_q, seqused_k, sinks, page_table, scale_log2, num_sms, full_tiles,
    # tail_parts, window_left, window_right, pre_tanh, seqused) (fwd_sm90.py's __call__)
    fn: object
    compile_seconds: float  # compiling, or loading from the kernel store
    from_disk: bool = False
    # a split_kv forward's merge: combine(o_partials, lse_partials, out, lse)
    # (cute_kernels/split_combine.py); None for the others
    combine: object | None = None

    def launches(self) -> dict:
        launches = {"fwd": self.fn}
        if self.combine is not None:
            launches["combine"] = self.combine
        return launches

    @classmethod
    def from_launches(cls, launches: dict, seconds: float, from_disk: bool) -> CompiledKernel:
        return cls(launches["fwd"], seconds, from_disk, launches.get("combine"))


def fwd_key(dtype: torch.dtype, head_dim: int, causal: bool, config: FwdConfig,
            head_dim_v: int, features: Features = PLAIN_FEATURES,
            out_dtype: torch.dtype | None = None) -> tuple:
    # FwdConfig is frozen, so hashable: the key costs no copying on the hot path.
    key = ("fwd_sm90", dtype, head_dim, head_dim_v, bool(causal), features, config)
    # e4m3 inputs: the output's dtype too (16-bit kernels' keys stay as they were)
    return key if out_dtype is None else key + (out_dtype,)


@dataclass
class CompiledBackward:
    """The launches of one backward, in order:
    preprocess(o, do, lse, dlse, lse2, dsum, dq_accum, semaphore)
    main(q, k, v, do, lse2, dsum, dq_accum, dk, dv, semaphore, scale_log2, scale, num_sms,
         window_left, window_right, pre_tanh)
    postprocess(dq_accum, dq, semaphore, scale)  (None where the main kernel writes dQ:
                                                  BwdConfig.convert_dq)
    group_sum(dk_partials, dv_partials, dk, dv)   (split_gqa configs only, else None)
    row_gaps(dq, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqused,
             ctas_per_gap)                        (packed batches only, else None)"""
    preprocess: object
    main: object
    postprocess: object | None
    group_sum: object | None
    compile_seconds: float  # compiling, or loading from the kernel store
    from_disk: bool = False
    row_gaps: object | None = None

    def __post_init__(self):
        # in the order of the launch plan's kernel indices (csrc/launch_plan.h)
        self.launch_list = list(self.launches().values())

    def launches(self) -> dict:
        names = ("preprocess", "main", "postprocess", "group_sum", "row_gaps")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @classmethod
    def from_launches(cls, launches: dict, seconds: float, from_disk: bool) -> CompiledBackward:
        return cls(launches["preprocess"], launches["main"], launches.get("postprocess"),
                   launches.get("group_sum"), seconds, from_disk, launches.get("row_gaps"))


@dataclass
class CompiledAppend:
    # append(k, v, k_cache, v_cache, page_table, cache_seqlens, lengths)
    # (cute_kernels/cache_append.py)
    fn: object
    compile_seconds: float  # compiling, or loading from the kernel store
    from_disk: bool = False

    def launches(self) -> dict:
        return {"append": self.fn}

    @classmethod
    def from_launches(cls, launches: dict, seconds: float, from_disk: bool) -> CompiledAppend:
        return cls(launches["append"], seconds, from_disk)


def bwd_key(dtype: torch.dtype, head_dim: int, causal: bool, config: BwdConfig,
            has_grad_lse: bool, features: Features = PLAIN_FEATURES,
            head_dim_v: int | None = None) -> tuple:
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    return ("bwd_sm90", dtype, head_dim, head_dim_v, bool(causal), features, config,
            bool(has_grad_lse))


def compile_fwd(dtype: torch.dtype, head_dim: int, causal: bool, config: FwdConfig,
                dump_dir: str | None = None, head_dim_v: int | None = None,
                features: Features = PLAIN_FEATURES,
                out_dtype: torch.dtype | None = None) -> CompiledKernel:
    """Compile the forward kernel now (no cache); dump_dir keeps its PTX and
    cubin; head_dim_v is that of v and o (None: head_dim); out_dtype that of
    o for e4m3 inputs."""
    from . import kernel_compile

    return kernel_compile.compile_fwd(dtype, head_dim, causal, config, dump_dir, head_dim_v,
                                      features, out_dtype)


def compile_bwd(dtype: torch.dtype, head_dim: int, causal: bool, config: BwdConfig,
                has_grad_lse: bool = False, dump_dir: str | None = None,
                features: Features = PLAIN_FEATURES,
                head_dim_v: int | None = None) -> CompiledBackward:
    """Compile the backward's kernels now (no cache); dump_dir keeps PTX and
    cubins; head_dim_v is that of v, o and dO (None: head_dim)."""
    from . import kernel_compile

    return kernel_compile.compile_bwd(dtype, head_dim, causal, config, has_grad_lse, dump_dir,
                                      features, head_dim_v)


def compile_append(dtype: torch.dtype, head_dim: int, head_dim_v: int,
                   dump_dir: str | None = None) -> CompiledAppend:
    """Compile the KV-cache append kernel now (no cache)."""
    from . import kernel_compile

    return kernel_compile.compile_append(dtype, head_dim, head_dim_v, dump_dir)


_cache: dict[tuple, object] = {}
_lock = threading.Lock()


def _cached(key: tuple, kind, compile_variant, *args):
    """The kernel of `key`: from memory, else from the kernel store, else
    compile_variant(*args) (then stored). No closures: the op's Python path
    looks its kernel up here on every call."""
    kernel = _cache.get(key)
    if kernel is None:
        with _lock:
            kernel = _cache.get(key)
            if kernel is None:
                kernel = _cache[key] = _stored(key, kind, compile_variant, args)
    return kernel


def target_arch() -> str:
    """The architecture the kernels are built for: the current GPU's, else sm_90a."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}a"
    return os.environ.get("CUTE_DSL_ARCH", CPU_TARGET_ARCH)


def _stored(key: tuple, kind, compile_variant, args: tuple):
    """A kind (CompiledKernel, CompiledBackward or CompiledAppend) from the
    kernel store when it holds the key, else compiled and stored
    (kernel_store.py)."""
    start = time.perf_counter()
    launches, from_disk = kernel_store.load_or_build(
        key, target_arch(), lambda: compile_variant(*args).launches())
    return kind.from_launches(launches, time.perf_counter() - start, from_disk)


def get_fwd(dtype: torch.dtype, head_dim: int, causal: bool, config: FwdConfig,
            head_dim_v: int | None = None, features: Features = PLAIN_FEATURES,
            out_dtype: torch.dtype | None = None) -> CompiledKernel:
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    return _cached(fwd_key(dtype, head_dim, causal, config, head_dim_v, features, out_dtype),
                   CompiledKernel, compile_fwd, dtype, head_dim, causal, config, None,
                   head_dim_v, features, out_dtype)


def get_bwd(dtype: torch.dtype, head_dim: int, causal: bool, config: BwdConfig,
            has_grad_lse: bool, features: Features = PLAIN_FEATURES,
            head_dim_v: int | None = None) -> CompiledBackward:
    return _cached(bwd_key(dtype, head_dim, causal, config, has_grad_lse, features, head_dim_v),
                   CompiledBackward, compile_bwd, dtype, head_dim, causal, config,
                   has_grad_lse, None, features, head_dim_v)


def get_append(dtype: torch.dtype, head_dim: int, head_dim_v: int) -> CompiledAppend:
    return _cached(("cache_append", dtype, head_dim, head_dim_v), CompiledAppend,
                   compile_append, dtype, head_dim, head_dim_v)
