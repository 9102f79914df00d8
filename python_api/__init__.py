"""Public functions of cute_fa: exact attention for Hopper in the CuTe DSL.

    from . import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)      # (batch, seqlen, nheads, headdim)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k)  # packed batches
    out = flash_attn_func(q, k, v, block_mask=create_block_mask(...))  # block-sparse

The work is done by `torch.ops.cute_fa.fwd` and `torch.ops.cute_fa.bwd`
(ops.py) and their packed-batch twins `varlen_fwd` and `varlen_bwd`
(varlen.py), and block_sparse_fwd / block_sparse_bwd (block_sparse_ops.py):
the DSL kernels on an sm_90 GPU, the reference math on the CPU.
"""

from __future__ import annotations

import sys

import torch

from . import ops  # noqa: F401  (registers torch.ops.cute_fa.*)
from . import fp8_ops  # noqa: F401  (registers torch.ops.cute_fa.fwd_fp8)
from . import varlen  # noqa: F401  (registers torch.ops.cute_fa.varlen_*)
from . import block_sparse_ops  # noqa: F401  (registers torch.ops.cute_fa.block_sparse_*)
from .block_mask import BlockSparseMask
from .kvcache import flash_attn_with_kvcache  # (registers torch.ops.cute_fa.fwd_kvcache)
from .reference import attention_reference
from .scores import check_score_args, check_sink, check_sink_type, window_from_size
from .validate import (check_argument_types, check_attention_tensors, check_tensor_types,
                       describe)

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "attention_reference", "BlockSparseMask"]


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    learnable_sink: torch.Tensor | None = None, return_lse: bool = False,
                    deterministic: bool = False, q_descale: torch.Tensor | None = None,
                    k_descale: torch.Tensor | None = None,
                    v_descale: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None, block_mask=None):
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
    learnable_sink: (nheads,) fp32/bf16/fp16, one logit per query head (gpt-oss's
        attention sinks, in the units of the scaled scores): a softmax column
        with no value, so out = Σ_j exp(s_j − lse)·v_j with lse = log(Σ_j
        exp(s_j) + exp(sink)); a row that sees no key gives 0 and lse = sink.
        Differentiable (its gradient has the sinks' dtype).
    softmax_scale: defaults to 1/sqrt(headdim).
    deterministic: the backward adds dQ partials in a fixed order, so gradients
        are bitwise reproducible (a little slower).
    FP8: q, k, v all torch.float8_e4m3fn (head dims 64, 96, 128, 192, 256, v's
        that of q), with descales q_descale, k_descale, v_descale fp32 (batch,
        nheads_kv), x ≈ x8 · descale (None: 1; fp8.quantize_fp8 makes both
        from a bf16/fp16 tensor): the attention of the dequantized inputs,
        out bf16 (out_dtype: bf16 or fp16), through torch.ops.cute_fa.fwd_fp8.
        Full or causal; no window, softcap or sinks; no backward (a gradient
        through it raises NotImplementedError).
    block_mask: block-sparse attention (torch.ops.cute_fa.block_sparse_fwd):
        a FlexAttention BlockMask (torch.nn.attention.flex_attention.
        create_block_mask, for this batch, nheads or 1 and the sequence
        lengths; block sizes dividing 128 or multiples of it), or a
        BlockSparseMask made from one (BlockSparseMask.from_block_mask: convert
        once and reuse it, as the conversion evaluates the mask_mod and waits
        for the GPU; under torch.compile(fullgraph=True) pass a
        BlockSparseMask made outside). Key blocks the mask leaves out are
        never loaded; partial blocks are masked element by element from the
        mask_mod's bits. The mask holds every limit: no causal or window_size
        with it; softcap and learnable_sink combine with it; not
        deterministic, no FP8.
    Returns out (batch, seqlen_q, nheads, headdim_v), and with return_lse the
    fp32 log-sum-exp (batch, nheads, seqlen_q).
    Differentiable: the backward runs the DSL backward kernel (torch.ops.cute_fa.bwd)
    on CUDA, at every head dim of the forward.
    """
    if block_mask is not None:
        return _block_sparse_call(q, k, v, block_mask, softmax_scale, causal, window_size,
                                  softcap, learnable_sink, return_lse, deterministic,
                                  (q_descale, k_descale, v_descale, out_dtype))
    check_argument_types(q, k, v, softmax_scale)
    fp8 = fp8_ops.FP8_DTYPES
    if q.dtype in fp8 or k.dtype in fp8 or v.dtype in fp8:
        _check_fp8_call(window_size, softcap, learnable_sink, deterministic)
        check_tensor_types(("q_descale", "k_descale", "v_descale"), q_descale, k_descale,
                           v_descale, optional=True)
        out, lse = torch.ops.cute_fa.fwd_fp8(q, k, v, q_descale, k_descale, v_descale,
                                             softmax_scale, bool(causal), out_dtype)
        return (out, lse) if return_lse else out
    if not (q_descale is None and k_descale is None and v_descale is None
            and out_dtype is None):
        _reject_fp8_arguments(q, q_descale, k_descale, v_descale, out_dtype)
    window_left, window_right = window_from_size(window_size)
    check_score_args(window_left, window_right, softcap)
    check_sink_type(learnable_sink)
    softcap = float(softcap)
    if q.is_cuda and not torch.compiler.is_compiling():
        # Eager on the GPU: same kernels, without the custom-op dispatch cost.
        check_attention_tensors(q, k, v, softmax_scale)
        check_sink(learnable_sink, q.shape[2], q.device)
        out, lse = ops.EagerCudaAttention.apply(q, k, v, softmax_scale, bool(causal),
                                                bool(deterministic), window_left, window_right,
                                                softcap, learnable_sink)
    else:
        # The op validates the rest (once) and resolves the default scale.
        out, lse = torch.ops.cute_fa.fwd(q, k, v, softmax_scale, bool(causal),
                                         bool(deterministic), window_left, window_right,
                                         softcap, learnable_sink)
    return (out, lse) if return_lse else out


def _block_sparse_call(q, k, v, block_mask, softmax_scale, causal, window_size, softcap,
                       learnable_sink, return_lse, deterministic, fp8_arguments):
    """flash_attn_func under a block mask: what it does not combine with
    named, the mask converted (a BlockMask) and checked, the op called."""
    check_argument_types(q, k, v, softmax_scale)
    if causal or tuple(window_size) != (-1, -1):
        raise ValueError(f"causal, window_size: expected False and (-1, -1) with a block_mask "
                         f"(put the limits in its mask_mod), got {causal} and {window_size}")
    if deterministic:
        raise ValueError("deterministic: expected False with a block_mask (the block-sparse "
                         "backward adds dQ in the order its key tiles finish)")
    if any(a is not None for a in fp8_arguments) or q.dtype not in (torch.bfloat16,
                                                                   torch.float16):
        raise ValueError(f"block_mask: expected bf16 or fp16 q, k, v without descales or "
                         f"out_dtype (no FP8 block-sparse forward), got q {q.dtype}")
    check_score_args(-1, -1, softcap)
    check_attention_tensors(q, k, v, softmax_scale)  # before the mask's lists read their shapes
    check_sink_type(learnable_sink)  # the op checks the rest
    mask = block_mask
    if not isinstance(mask, BlockSparseMask):
        if not hasattr(mask, "kv_num_blocks"):
            raise TypeError(f"block_mask: expected a FlexAttention BlockMask or a "
                            f"BlockSparseMask, got {type(mask).__name__}")
        mask = BlockSparseMask.from_block_mask(mask)
    block_sparse_ops.check_mask_shape(mask, q, k)
    fwd_lists, bwd_lists = block_sparse_ops.lists_for(mask, q, v)
    out, lse = torch.ops.cute_fa.block_sparse_fwd(q, k, v, fwd_lists, bwd_lists, softmax_scale,
                                                  float(softcap), learnable_sink)
    return (out, lse) if return_lse else out


def _reject_fp8_arguments(q, q_descale, k_descale, v_descale, out_dtype) -> None:
    for name, value in (("q_descale", q_descale), ("k_descale", k_descale),
                        ("v_descale", v_descale), ("out_dtype", out_dtype)):
        if value is not None:
            raise ValueError(f"{name}: expected None for {q.dtype} inputs (it belongs to "
                             f"float8_e4m3fn q, k, v), got {describe(value)}")


def _check_fp8_call(window_size, softcap, learnable_sink, deterministic) -> None:
    """What the FP8 forward does not take, named."""
    if tuple(window_size) != (-1, -1):
        raise ValueError(f"window_size: expected (-1, -1) with float8_e4m3fn inputs (the FP8 "
                         f"forward has no sliding window), got {window_size}")
    if softcap:
        raise ValueError(f"softcap: expected 0.0 with float8_e4m3fn inputs, got {softcap}")
    if learnable_sink is not None:
        raise ValueError("learnable_sink: expected None with float8_e4m3fn inputs (the FP8 "
                         "forward has no sinks)")
    if deterministic:
        raise ValueError("deterministic: expected False with float8_e4m3fn inputs (it is a "
                         "property of the backward, which FP8 does not have)")


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                           seqused_q: torch.Tensor | None = None,
                           seqused_k: torch.Tensor | None = None,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           learnable_sink: torch.Tensor | None = None,
                           deterministic: bool = False, return_lse: bool = False):
    """flash_attn_func over a packed batch of sequences of different lengths
    (FlashAttention's varlen layout and names).

    q: (total_q, nheads, headdim); k: (total_k, nheads_kv, headdim); v:
    (total_k, nheads_kv, headdim_v). cu_seqlens_q / cu_seqlens_k: int32
    (batch + 1,), cumulative lengths from 0: sequence b's queries are rows
    cu_seqlens_q[b] to cu_seqlens_q[b+1] of q, its keys those of k. Each
    sequence attends on its own; causal masks and windows are aligned to its
    own lengths (bottom-right), a sequence with no keys gives output 0 and
    LSE -inf (with learnable sinks, the sink). seqused_q / seqused_k: int32
    (batch,), how many rows of each segment take part (the rest are left
    out; their outputs are undefined and their gradients 0).
    max_seqlen_q / max_seqlen_k: the longest sequences, at least every
    sequence's length. None reads them from cu_seqlens (and seqused) on the
    host, checking those values too: a wait for the GPU, which a caller that
    knows them (or runs under CUDA graphs) avoids by passing them.
    Returns out (total_q, nheads, headdim_v), and with return_lse the fp32
    LSE (nheads, total_q). Differentiable like flash_attn_func.
    """
    check_argument_types(q, k, v, softmax_scale)
    window_left, window_right = window_from_size(window_size)
    check_score_args(window_left, window_right, softcap)
    varlen.check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q or 0,
                               max_seqlen_k or 0, seqused_q, seqused_k, softmax_scale)
    check_sink(learnable_sink, q.shape[1], q.device)
    if max_seqlen_q is None or max_seqlen_k is None:
        longest = varlen.check_seqlen_values(cu_seqlens_q, cu_seqlens_k, q.shape[0],
                                             k.shape[0], seqused_q, seqused_k)
        max_seqlen_q = longest[0] if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = longest[1] if max_seqlen_k is None else max_seqlen_k
        varlen.check_max_seqlens(longest, max_seqlen_q, max_seqlen_k)
    out, lse = torch.ops.cute_fa.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                            int(max_seqlen_q), int(max_seqlen_k), seqused_q,
                                            seqused_k, softmax_scale, bool(causal),
                                            bool(deterministic), window_left, window_right,
                                            float(softcap), learnable_sink)
    return (out, lse) if return_lse else out


# transformers models reach the kernels as attn_implementation="cute_fa"
# (transformers_attention.py): registered here when transformers is already
# imported, else by importing cute_fa.transformers_attention.
if "transformers" in sys.modules:
    from . import transformers_attention  # noqa: E402,F401
