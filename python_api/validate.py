"""Input checks for the public functions and the ops.

Every error names the argument, what was expected and what came. They run on
the host before anything is launched, so a bad call never reaches a kernel.
"""

from __future__ import annotations

import math

import torch

from cute_kernels.config import SUPPORTED_HEAD_DIMS

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_argument_types(q, k, v, softmax_scale=None) -> None:
    """The checks the torch dispatcher would otherwise answer with its own
    message; cheap enough for the public function to run before the op."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool)
                                      or not isinstance(softmax_scale, (int, float))):
        raise TypeError(f"softmax_scale: expected a float or None, "
                        f"got {type(softmax_scale).__name__}")


def check_attention_inputs(q, k, v, softmax_scale=None) -> None:
    """Validate (batch, seqlen, nheads, headdim) q, k, v for the forward."""
    check_argument_types(q, k, v, softmax_scale)
    check_attention_tensors(q, k, v, softmax_scale)


def check_attention_tensors(q, k, v, softmax_scale=None) -> None:
    """check_attention_inputs for arguments whose types are already checked."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor (batch, seqlen, nheads, headdim), "
                             f"got {t.dim()}-D with {_describe(t)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: expected dtype torch.bfloat16 or torch.float16, "
                            f"got {t.dtype}")
        if t.numel() == 0:
            raise ValueError(f"{name}: expected a non-empty tensor, got {_describe(t)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected the last dimension (headdim) to be contiguous "
                             f"(stride 1), got strides {tuple(t.stride())}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: expected one device, got q {q.device}, k {k.device}, "
                         f"v {v.device}")
    head_dim = q.shape[3]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: expected headdim in {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if k.shape != v.shape:
        raise ValueError(f"k, v: expected equal shapes, got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k: expected headdim {head_dim} (that of q), got {k.shape[3]}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected batch {q.shape[0]} (that of q), got {k.shape[0]}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"k: expected nheads_kv to divide nheads_q = {q.shape[2]} "
                         f"(GQA/MQA), got nheads_kv = {k.shape[2]}")
    if softmax_scale is not None:
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale: expected a finite positive float, "
                             f"got {softmax_scale}")


def check_backward_inputs(grad_out, q, k, v, out, lse, softmax_scale, grad_lse=None) -> None:
    """Validate the arguments of cute_fa::bwd (autograd passes them right; a
    direct caller may not)."""
    check_attention_inputs(q, k, v, softmax_scale)
    for name, t in (("grad_out", grad_out), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected shape {tuple(q.shape)}, dtype {q.dtype}, "
                             f"device {q.device} (those of q), got {_describe(t)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected the last dimension to be contiguous, "
                             f"got strides {tuple(t.stride())}")
    batch, seqlen_q, heads, _ = q.shape
    stats = [("lse", lse)] + ([("grad_lse", grad_lse)] if grad_lse is not None else [])
    for name, t in stats:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != (batch, heads, seqlen_q) or t.dtype != torch.float32 \
                or t.device != q.device:
            raise ValueError(f"{name}: expected shape {(batch, heads, seqlen_q)}, dtype "
                             f"torch.float32, device {q.device}, got {_describe(t)}")


def check_cuda_device(device: torch.device) -> None:
    """The DSL kernels are built for sm_90a (Hopper) only."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"cute_fa: device {device} ({name}, compute capability {major}.{minor}) is not "
            f"supported; the CUDA kernels need an sm_90 GPU (H100/H200/H800/H20). "
            f"Move the tensors to the CPU for the reference implementation.")
