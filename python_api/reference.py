"""Reference attention math: the one definition every test and the CPU op use.

Conventions, shared with the kernels:
- layout (batch, seqlen, nheads, headdim); GQA: query head h reads K/V head
  h // (nheads_q // nheads_kv);
- causal is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q;
- a query row that sees no key gives O = 0 and LSE = -inf;
- LSE is the natural-log log-sum-exp of the scaled scores, (batch, nheads, seqlen_q), fp32.
"""

from __future__ import annotations

import math

import torch


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k): True where the key is visible."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def attention_reference(q, k, v, softmax_scale=None, causal=False, compute_dtype=torch.float32):
    """Returns (out in q.dtype, lse fp32). compute_dtype=None computes in the input dtype,
    which is PyTorch's own low-precision math path."""
    out_dtype = q.dtype
    if compute_dtype is not None:
        q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        visible = causal_mask(q.shape[1], k.shape[1], device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    probs = torch.exp(scores - lse[..., None].to(scores.dtype))
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out.to(out_dtype), lse
