"""Which compiled kernel variant serves a problem: the device checked, the
config chosen (cute_kernels/config.py), the kernels from compile_cache.py.
Shared by the op's Python path (ops.py) and the C++ host layer's planner
(native.py)."""

from __future__ import annotations

import functools

import torch

from .kernels.config import (PLAIN_FEATURES, FwdConfig, Features, fp8_config_for_problem,
                             fwd_config_for_problem)
from .kernels.bwd_config import BwdConfig, bwd_config_for_problem
from .validate import check_cuda_device


@functools.lru_cache(maxsize=None)  # asked on every forward and backward call
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _checked_device(device_index: int) -> None:
    check_cuda_device(torch.device("cuda", device_index))


def _device_index(t: torch.Tensor) -> int:
    """The tensor's CUDA device, checked once per device to be an sm_90 GPU."""
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    _checked_device(index)
    return index


_compile_cache = None


def _kernels():
    """compile_cache, imported at the first kernel call (the CPU and fake
    paths never need it) and then held: an import statement costs ~2 us on
    every call."""
    global _compile_cache
    if _compile_cache is None:
        from . import compile_cache
        _compile_cache = compile_cache
    return _compile_cache


def fwd_kernel_for(q: torch.Tensor, v: torch.Tensor, causal: bool,
                   config: FwdConfig | None = None, features: Features = PLAIN_FEATURES,
                   out_dtype: torch.dtype | None = None, window: tuple = (-1, -1)):
    """(compiled forward, its config, device index) for a problem: the device
    checked, `config` or the per-problem default. The op's Python path
    asks it per call, the C++ host layer's planner (native.py) once per problem.
    out_dtype: the output's, for e4m3 inputs; window: a local kernel's
    (scores.resolve's)."""
    device_index = _device_index(q)
    head_dim, head_dim_v = q.shape[3], v.shape[3]
    if config is None:
        config = (fp8_config_for_problem(head_dim, causal, features, v.shape[1])
                  if out_dtype is not None
                  else fwd_config_for_problem(head_dim, causal, head_dim_v, features,
                                              q.shape[1], v.shape[1], q.shape[0] * q.shape[2],
                                              num_sms(device_index), window))
    return (_kernels().get_fwd(q.dtype, head_dim, causal, config, head_dim_v, features,
                               out_dtype), config, device_index)


def bwd_kernels_for(q: torch.Tensor, k: torch.Tensor, causal: bool, deterministic: bool,
                    has_grad_lse: bool, config: BwdConfig | None = None,
                    features: Features = PLAIN_FEATURES, head_dim_v: int | None = None):
    """(compiled backward launches, their config, device index) for a
    problem, as fwd_kernel_for; head_dim_v: v's (None: q's)."""
    device_index = _device_index(q)
    batch, _, heads, head_dim = q.shape
    config = config or bwd_config_for_problem(head_dim, causal, deterministic, batch,
                                              k.shape[1], heads, k.shape[2],
                                              num_sms(device_index), features, head_dim_v)
    return (_kernels().get_bwd(q.dtype, head_dim, causal, config, has_grad_lse, features,
                               head_dim_v), config, device_index)
