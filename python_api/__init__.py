"""Public functions of cute_fa: exact attention for Hopper in the CuTe DSL.

    from . import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)      # (batch, seqlen, nheads, headdim)

The work is done by `torch.ops.cute_fa.fwd` and `torch.ops.cute_fa.bwd`
(ops.py): the DSL kernels on an sm_90 GPU, the reference math on the CPU.
"""

from __future__ import annotations

import torch

from . import ops  # noqa: F401  (registers torch.ops.cute_fa.*)
from .reference import attention_reference
from .scores import check_score_args, window_from_size
from .validate import check_argument_types, check_attention_tensors

__all__ = ["flash_attn_func", "attention_reference"]


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    return_lse: bool = False, deterministic: bool = False):
    """Exact attention softmax(q·kᵀ·scale)·v.

    q: (batch, seqlen_q, nheads, headdim); k: (batch, seqlen_k, nheads_kv, headdim);
    v: (batch, seqlen_k, nheads_kv, headdim_v), headdim_v <= headdim (e.g. 192/128);
    nheads_kv divides nheads (GQA/MQA); bf16 or fp16. Head dims: multiples of 8
    up to 256; 64, 96, 128, 192 and 256 run as they are, the others zero-padded
    to the next of those.
    causal: bottom-right aligned mask when seqlen_q != seqlen_k.
    window_size: (left, right) sliding window (local attention, e.g. Mistral's
        (4095, 0)): query i sees keys i + seqlen_k - seqlen_q - left through
        i + seqlen_k - seqlen_q + right; -1 is unbounded on that side; with
        causal, right is 0. Key blocks outside the window are skipped.
    softcap: > 0 soft-caps the scores (Gemma 2): softcap · tanh(scale·q·k / softcap).
    softmax_scale: defaults to 1/sqrt(headdim).
    deterministic: the backward adds dQ partials in a fixed order, so gradients
        are bitwise reproducible (a little slower).
    Returns out (batch, seqlen_q, nheads, headdim_v), and with return_lse the
    fp32 log-sum-exp (batch, nheads, seqlen_q).
    Differentiable: the backward runs the DSL backward kernel (torch.ops.cute_fa.bwd),
    on CUDA for headdim up to 128 with headdim_v = headdim (after padding); a
    gradient through other head dims raises NotImplementedError there.
    """
    check_argument_types(q, k, v, softmax_scale)
    window_left, window_right = window_from_size(window_size)
    check_score_args(window_left, window_right, softcap)
    softcap = float(softcap)
    if q.is_cuda and not torch.compiler.is_compiling():
        # Eager on the GPU: same kernels, without the custom-op dispatch cost.
        check_attention_tensors(q, k, v, softmax_scale)
        out, lse = ops.EagerCudaAttention.apply(q, k, v, softmax_scale, bool(causal),
                                                bool(deterministic), window_left, window_right,
                                                softcap)
    else:
        # The op validates the rest (once) and resolves the default scale.
        out, lse = torch.ops.cute_fa.fwd(q, k, v, softmax_scale, bool(causal),
                                         bool(deterministic), window_left, window_right,
                                         softcap)
    return (out, lse) if return_lse else out
