"""The e4m3 forward op:
`cute_fa::fwd_fp8(q, k, v, q_descale=None, k_descale=None, v_descale=None,
 softmax_scale=None, causal=False, out_dtype=None) -> (out, lse)`.

q, k, v are torch.float8_e4m3fn (batch, seqlen, nheads, d) with fp32
descales (batch, nheads_kv), x ≈ x8 · descale (fp8.py; None: 1); out is
bf16 (or `out_dtype`: bf16 or fp16), lse fp32 (batch, nheads, seqlen_q),
both of the dequantized inputs' attention.
- CUDA (sm_90): the forward kernel with e4m3 operands (FP8 WGMMA for
  Q·Kᵀ and P·V, V transposed in shared memory: cute_kernels/fp8_operands.py),
  by its launch plan; descales folded into the score scale and the output;
- CPU: the reference math on the dequantized inputs;
- fake: shapes only. Inside an NVTX range named like fwd's, dtype e4m3.
There is no backward (FlashAttention-3 has none for FP8 either): a gradient
through it raises, rather than being dropped.
"""

from __future__ import annotations

import math

import torch

from . import launch_plan
from . import nvtx as nvtx_ranges
from .kernels.config import FP8_HEAD_DIMS
from .ops import _lib, keyless_lse, register_kernels, tma_ready
from .reference import attention_reference, resolve_scale
from .scores import resolve
from .validate import (check_argument_types, check_kv_shapes, check_one_device,
                       check_tensor_layout, describe)
from .variants import fwd_kernel_for, num_sms

E4M3 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16)
E4M3_OUT = torch.bfloat16  # the output of e4m3 inputs unless asked otherwise

_lib.define("fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor? q_descale=None, "
            "Tensor? k_descale=None, Tensor? v_descale=None, float? softmax_scale=None, "
            "bool causal=False, ScalarType? out_dtype=None) -> (Tensor, Tensor)")


# every 8-bit float dtype: a call with any of them goes to fwd_fp8, whose
# checks name the one it takes
FP8_DTYPES = frozenset((torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                        torch.float8_e5m2fnuz))


def check_fp8_inputs(q, k, v, q_descale, k_descale, v_descale, softmax_scale,
                     out_dtype) -> None:
    """The arguments of fwd_fp8; every error names the argument."""
    check_argument_types(q, k, v, softmax_scale)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != E4M3:
            raise TypeError(f"{name}: expected dtype torch.float8_e4m3fn for the FP8 forward "
                            f"(q, k and v all e4m3; e5m2 is not supported), got {t.dtype}")
        check_tensor_layout(name, t)
    check_one_device(q, k, v)
    head_dim = q.shape[3]
    if head_dim not in FP8_HEAD_DIMS:
        raise ValueError(f"q: expected headdim one of {FP8_HEAD_DIMS} for the FP8 forward, "
                         f"got {head_dim}")
    if k.shape[3] != head_dim or v.shape[3] != head_dim:
        raise ValueError(f"k, v: expected headdim {head_dim} (that of q) for the FP8 forward, "
                         f"got k {k.shape[3]}, v {v.shape[3]}")
    check_kv_shapes(q, k, v)
    check_descales(q, k.shape[2], q_descale, k_descale, v_descale)
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected None (bf16), torch.bfloat16 or torch.float16, "
                        f"got {out_dtype}")
    if softmax_scale is not None and (not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale: expected a finite positive float, got {softmax_scale}")


def check_descales(q, heads_kv: int, q_descale, k_descale, v_descale) -> None:
    """Each descale None or fp32 (batch, nheads_kv) on q's device."""
    expected = (q.shape[0], heads_kv)
    for name, d in (("q_descale", q_descale), ("k_descale", k_descale),
                    ("v_descale", v_descale)):
        if d is None:
            continue
        if not isinstance(d, torch.Tensor) or tuple(d.shape) != expected \
                or d.dtype != torch.float32 or d.device != q.device:
            raise ValueError(f"{name}: expected None or an fp32 tensor of shape {expected} "
                             f"(batch, nheads_kv) on {q.device}, got {describe(d)}")


def kernel_descales(batch: int, heads_kv: int, q_descale, k_descale, v_descale,
                    device) -> list:
    """The kernel's descales of q, k and v: views (1, batch, nheads_kv) of
    the caller's, and ones (made once per shape) where None, so that a call
    launches nothing to gather them."""
    def view(d):
        if d is None:
            return launch_plan.cached_per_shape(("descale_ones", batch, heads_kv, device),
                                                lambda: torch.ones((1, batch, heads_kv),
                                                                   device=device))
        return d.unsqueeze(0)
    return [view(d) for d in (q_descale, k_descale, v_descale)]


def _dequantized(x8, descale):
    from .fp8 import dequantize_fp8  # the CPU path only

    if descale is None:
        return x8.float()
    return dequantize_fp8(x8, descale)


def _fwd_fp8_cpu(q, k, v, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                 causal=False, out_dtype=None):
    check_fp8_inputs(q, k, v, q_descale, k_descale, v_descale, softmax_scale, out_dtype)
    with nvtx_ranges.op_range(nvtx_ranges.range_name("fwd", q, v, causal)):
        out, lse = attention_reference(_dequantized(q, q_descale), _dequantized(k, k_descale),
                                       _dequantized(v, v_descale), resolve_scale(q, softmax_scale),
                                       causal)
    return out.to(out_dtype or E4M3_OUT).contiguous(), lse.contiguous()


def forward_fp8_cuda(q, k, v, q_descale=None, k_descale=None, v_descale=None,
                     softmax_scale=None, causal=False, out_dtype=None, config=None, tail=None):
    """The e4m3 forward kernel by its launch plan; `config` overrides the
    default (config.fp8_config_for_problem), `tail` a split_tail config's split
    (profiling.sweep)."""
    out_dtype = out_dtype or E4M3_OUT
    batch, seqlen_q, heads, _ = q.shape
    if q.numel() == 0 or k.shape[1] == 0:
        out = torch.zeros((batch, seqlen_q, heads, v.shape[3]), dtype=out_dtype, device=q.device)
        return out, keyless_lse((batch, heads, seqlen_q), 1, None, q.device)
    scores = resolve(causal, -1, -1, 0.0, seqlen_q, k.shape[1])
    name = nvtx_ranges.range_name("fwd", q, v, causal, scores)
    kernel, config, device_index = fwd_kernel_for(q, v, scores.causal, config, scores.features,
                                                  out_dtype)
    plan = launch_plan.plan_fwd(config, launch_plan.shape_of(q, k, v), num_sms(device_index),
                                tail, scores.window, fp8=True)
    inputs = [tma_ready(q), tma_ready(k), tma_ready(v),
              *kernel_descales(q.shape[0], k.shape[2], q_descale, k_descale, v_descale,
                               q.device)]
    nvtx_ranges.push(name)
    try:
        return launch_plan.execute(plan, [kernel.fn], inputs, resolve_scale(q, softmax_scale),
                                   out_dtype=out_dtype)
    finally:
        nvtx_ranges.pop()


def _fwd_fp8_cuda(q, k, v, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                  causal=False, out_dtype=None):
    check_fp8_inputs(q, k, v, q_descale, k_descale, v_descale, softmax_scale, out_dtype)
    return forward_fp8_cuda(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal,
                            out_dtype)


def _fwd_fp8_fake(q, k, v, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                  causal=False, out_dtype=None):
    check_fp8_inputs(q, k, v, q_descale, k_descale, v_descale, softmax_scale, out_dtype)
    batch, seqlen_q, heads, _ = q.shape
    out = torch.empty((batch, seqlen_q, heads, v.shape[3]), dtype=out_dtype or E4M3_OUT,
                      device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    return out, lse


def _no_backward(ctx, grad_out, grad_lse):
    raise NotImplementedError(
        "cute_fa: the FP8 (e4m3) forward has no backward (FlashAttention-3 has none either); "
        "compute gradients with bf16 or fp16 q, k, v")


register_kernels("fwd_fp8", _fwd_fp8_cpu, _fwd_fp8_cuda, _fwd_fp8_fake)
torch.library.register_autograd("cute_fa::fwd_fp8", _no_backward, lib=_lib)
