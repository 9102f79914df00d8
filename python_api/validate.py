"""Input checks for the public functions and the ops.

Every error names the argument, what was expected and what came. They run on
the host before anything is launched, so a bad call never reaches a kernel.
"""

from __future__ import annotations

import math

import torch

from .kernels.config import (HEAD_DIM_MULTIPLE, SUPPORTED_HEAD_DIMS,
                             kernel_head_dim)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def describe(t) -> str:
    """What an argument is, for an error message: a tensor's shape, dtype and
    device, or another object's type."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_argument_types(q, k, v, softmax_scale=None) -> None:
    """The checks the torch dispatcher would otherwise answer with its own
    message; cheap enough for the public function to run before the op."""
    check_tensor_types(("q", "k", "v"), q, k, v)
    check_scale_type(softmax_scale)


def check_scale_type(softmax_scale) -> None:
    """None or a number (its value: check_softmax_scale)."""
    if softmax_scale is not None and (isinstance(softmax_scale, bool)
                                      or not isinstance(softmax_scale, (int, float))):
        raise TypeError(f"softmax_scale: expected a float or None, "
                        f"got {type(softmax_scale).__name__}")


def check_softmax_scale(softmax_scale) -> None:
    """None, or a finite positive number."""
    check_scale_type(softmax_scale)
    if softmax_scale is not None and not (0.0 < softmax_scale < math.inf):
        raise ValueError(f"softmax_scale: expected a finite positive float, got "
                         f"{softmax_scale}")


def check_tensor_types(names: tuple, *values, optional: bool = False) -> None:
    """Each value a tensor (or None, where optional), the first failing one
    named from `names`: the checks the torch dispatcher would otherwise
    answer with its schema. On every call of the public functions, so a
    valid call takes one loop and no per-call containers."""
    for t in values:  # None first: isinstance(None, torch.Tensor) is slow (a metaclass)
        if not (optional and t is None) and not isinstance(t, torch.Tensor):
            break
    else:
        return
    for name, t in zip(names, values):
        if not (optional and t is None) and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor{' or None' if optional else ''}, "
                            f"got {type(t).__name__}")


def check_head_dims(head_dim: int, head_dim_v: int, q_name: str = "q",
                    v_name: str = "v") -> None:
    """q's head dim one the kernels run (as it is or zero-padded), v's one of
    them no larger than q's."""
    if kernel_head_dim(head_dim) is None:
        raise ValueError(f"{q_name}: expected headdim a multiple of {HEAD_DIM_MULTIPLE} up to "
                         f"{SUPPORTED_HEAD_DIMS[-1]} ({', '.join(map(str, SUPPORTED_HEAD_DIMS))} "
                         f"run as they are, the others zero-padded to the next of those), "
                         f"got {head_dim}")
    if kernel_head_dim(head_dim_v) is None or head_dim_v > head_dim:
        raise ValueError(f"{v_name}: expected headdim a multiple of {HEAD_DIM_MULTIPLE} no "
                         f"larger than that of q ({head_dim}), got {head_dim_v}")


def check_attention_inputs(q, k, v, softmax_scale=None) -> None:
    """Validate (batch, seqlen, nheads, headdim) q, k, v for the forward; v's
    headdim may be smaller than that of q and k."""
    check_argument_types(q, k, v, softmax_scale)
    check_attention_tensors(q, k, v, softmax_scale)


def check_attention_tensors(q, k, v, softmax_scale=None) -> None:
    """check_attention_inputs for arguments whose types are already checked."""
    if not _attention_tensors_ok(q, k, v, softmax_scale):
        _explain_attention_tensors(q, k, v, softmax_scale)


def _attention_tensors_ok(q, k, v, softmax_scale) -> bool:
    # Every call of the ops runs the checks, and a compiled training step
    # without a CUDA graph is paced by its host: this one expression accepts a
    # valid call in ~1 us, where the checks that name the culprit take ~6 us.
    # It must reject whatever _explain_attention_tensors rejects (the
    # bad-input tests go through both); rejecting more only costs time (an
    # empty tensor of any strides takes the slow path, which accepts it).
    qs, ks, vs = q.shape, k.shape, v.shape
    dtype = q.dtype
    return (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and ks[:3] == vs[:3]
            and qs[2] > 0 and ks[2] > 0  # batch and lengths may be 0, heads not
            and dtype in SUPPORTED_DTYPES and k.dtype == dtype and v.dtype == dtype
            and qs[3] in SUPPORTED_HEAD_DIMS and ks[3] == qs[3] and ks[0] == qs[0]
            and vs[3] in SUPPORTED_HEAD_DIMS and vs[3] <= qs[3]
            and qs[2] % ks[2] == 0
            and q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1
            and q.device == k.device == v.device
            and (softmax_scale is None or 0.0 < softmax_scale < math.inf))


def _rows_contiguous(t: torch.Tensor) -> bool:
    """The last dimension (headdim) has stride 1 (an empty tensor's strides
    are whatever made it: nothing is read)."""
    return t.stride(-1) == 1 or t.numel() == 0


def check_tensor_layout(name: str, t: torch.Tensor) -> None:
    """What every op asks of q, k and v each, whatever their dtype: 4-D
    (batch, seqlen, nheads, headdim), a head, headdim contiguous."""
    if t.dim() != 4:
        raise ValueError(f"{name}: expected a 4-D tensor (batch, seqlen, nheads, headdim), "
                         f"got {t.dim()}-D with {describe(t)}")
    if t.shape[2] == 0:
        raise ValueError(f"{name}: expected at least one head, got {describe(t)}")
    if not _rows_contiguous(t):
        raise ValueError(f"{name}: expected the last dimension (headdim) to be contiguous "
                         f"(stride 1), got strides {tuple(t.stride())}")


def check_one_device(q, k, v) -> None:
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: expected one device, got q {q.device}, k {k.device}, "
                         f"v {v.device}")


def check_kv_shapes(q, k, v) -> None:
    """k and v of one (batch, seqlen, nheads), q's batch, nheads_kv dividing
    nheads_q (GQA/MQA)."""
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k, v: expected equal (batch, seqlen, nheads), got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected batch {q.shape[0]} (that of q), got {k.shape[0]}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"k: expected nheads_kv to divide nheads_q = {q.shape[2]} "
                         f"(GQA/MQA), got nheads_kv = {k.shape[2]}")


def _explain_attention_tensors(q, k, v, softmax_scale) -> None:
    """Raise the error that names what is wrong; return if nothing is."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: expected dtype torch.bfloat16 or torch.float16, "
                            f"got {t.dtype}")
        check_tensor_layout(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}")
    check_one_device(q, k, v)
    head_dim = q.shape[3]
    check_head_dims(head_dim, v.shape[3])
    if k.shape[3] != head_dim:
        raise ValueError(f"k: expected headdim {head_dim} (that of q), got {k.shape[3]}")
    check_kv_shapes(q, k, v)
    check_softmax_scale(softmax_scale)


def check_backward_inputs(grad_out, q, k, v, out, lse, softmax_scale, grad_lse=None) -> None:
    """Validate the arguments of cute_fa::bwd (autograd passes them right; a
    direct caller may not)."""
    if not _backward_inputs_ok(grad_out, q, k, v, out, lse, softmax_scale, grad_lse):
        _explain_backward_inputs(grad_out, q, k, v, out, lse, softmax_scale, grad_lse)


def _backward_inputs_ok(grad_out, q, k, v, out, lse, softmax_scale, grad_lse) -> bool:
    # The fast acceptance of _attention_tensors_ok, for the backward's arguments.
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)
            and isinstance(grad_out, tensor) and isinstance(out, tensor)
            and isinstance(lse, tensor) and (grad_lse is None or isinstance(grad_lse, tensor))
            and isinstance(softmax_scale, float)
            and _attention_tensors_ok(q, k, v, softmax_scale)):
        return False
    qs, dtype, device = q.shape, q.dtype, q.device
    stats_shape = (qs[0], qs[2], qs[1])
    out_shape = (qs[0], qs[1], qs[2], v.shape[3])
    return (grad_out.shape == out_shape and out.shape == out_shape
            and grad_out.dtype == dtype and out.dtype == dtype
            and grad_out.device == device and out.device == device
            and grad_out.stride(3) == 1 and out.stride(3) == 1
            and lse.shape == stats_shape and lse.dtype == torch.float32 and lse.device == device
            and (grad_lse is None or (grad_lse.shape == stats_shape
                                      and grad_lse.dtype == torch.float32
                                      and grad_lse.device == device)))


def _explain_backward_inputs(grad_out, q, k, v, out, lse, softmax_scale, grad_lse) -> None:
    """Raise the error that names what is wrong; return if nothing is."""
    check_attention_inputs(q, k, v, softmax_scale)
    out_shape = (*q.shape[:3], v.shape[3])
    for name, t in (("grad_out", grad_out), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.shape != out_shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected shape {out_shape}, dtype {q.dtype}, "
                             f"device {q.device} (q's, with v's headdim), got {describe(t)}")
        if not _rows_contiguous(t):
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
                             f"torch.float32, device {q.device}, got {describe(t)}")


def check_cuda_device(device: torch.device) -> None:
    """The DSL kernels are built for sm_90a (Hopper) only."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"cute_fa: device {device} ({name}, compute capability {major}.{minor}) is not "
            f"supported; the CUDA kernels need an sm_90 GPU (H100/H200/H800/H20). "
            f"Move the tensors to the CPU for the reference implementation.")
