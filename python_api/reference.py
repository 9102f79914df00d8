"""Reference attention math: the one definition every test and the CPU op use.

Conventions, shared with the kernels:
- layout (batch, seqlen, nheads, headdim); GQA: query head h reads K/V head
  h // (nheads_q // nheads_kv);
- causal is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q;
- a window (left, right), -1 unbounded, the same alignment: query i sees key j iff
  i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right
  (causal sets right = 0);
- softcap > 0: each score s·scale becomes softcap · tanh(s·scale / softcap);
- a query row that sees no key gives O = 0 and LSE = -inf;
- learnable sinks (nheads,): one more column per row of logit sink[h] (the
  units of the scaled scores) and no value: LSE = log(Σ exp(s) + exp(sink)),
  O = Σ exp(s − LSE)·v; a row with no visible key then has LSE = sink;
- LSE is the natural-log log-sum-exp of the scaled scores, (batch, nheads, seqlen_q), fp32;
- a packed (varlen) batch, (total, nheads, headdim) with cu_seqlens, is each
  sequence on its own, its LSE (nheads, total_q).
"""

from __future__ import annotations

import math

import torch


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def resolve_scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    """The scale an op applies: the caller's, else 1/sqrt(q's head dim)."""
    return default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k): True where the key is visible."""
    return visible_mask(seqlen_q, seqlen_k, (-1, 0), device)


def visible_mask(seqlen_q: int, seqlen_k: int, window: tuple[int, int],
                 device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k): True where the window (left, right) lets
    the query see the key."""
    left, right = window
    diag = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones((seqlen_q, seqlen_k), dtype=torch.bool, device=device)
    if right >= 0:
        visible &= cols <= diag + right
    if left >= 0:
        visible &= cols >= diag - left
    return visible


def _expanded_kv(q, k, v):
    """K and V repeated to the query heads (GQA: query head h reads K/V head h // group)."""
    group = q.shape[2] // k.shape[2]
    if group > 1:
        return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    return k, v


def _scores(q, k, scale, causal, window=(-1, -1), softcap=0.0, visible=None):
    """The scores the softmax takes, (batch, heads, seqlen_q, seqlen_k): scale ·
    Q·Kᵀ, soft-capped, -inf where the mask (or `visible`, boolean and
    broadcastable to the scores) hides the key; and the cap's slope 1 − tanh²
    (None without a cap)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    slope = None
    if softcap:
        t = torch.tanh(scores / softcap)
        scores, slope = softcap * t, 1 - t * t
    left, right = window
    if causal:
        right = 0
    if left >= 0 or right >= 0:
        limits = visible_mask(q.shape[1], k.shape[1], (left, right), device=q.device)
        scores = scores.masked_fill(~limits, float("-inf"))
    if visible is not None:
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return scores, slope


def _with_sink(scores, sink):
    """The scores with the sink column appended (b, h, s_q, s_k + 1)."""
    column = sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    return torch.cat([scores, column], dim=-1)


def _probabilities(scores, lse):
    """exp(scores − LSE), 0 in the rows that see no key (LSE −inf, where the
    difference is NaN); a NaN in the inputs stays NaN, as on the GPU."""
    probs = torch.exp(scores - lse[..., None].to(scores.dtype))
    return probs.masked_fill(torch.isneginf(lse)[..., None], 0.0)


def attention_reference(q, k, v, softmax_scale=None, causal=False, compute_dtype=torch.float32,
                        window=(-1, -1), softcap=0.0, sink=None, visible=None):
    """Returns (out in q.dtype, lse fp32). compute_dtype=None computes in the input dtype,
    which is PyTorch's own low-precision math path. visible: a boolean mask
    (batch or 1, nheads or 1, seqlen_q, seqlen_k), True where the key is
    visible (a block-sparse call's)."""
    out_dtype = q.dtype
    if compute_dtype is not None:
        q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    scale = resolve_scale(q, softmax_scale)
    k, v = _expanded_kv(q, k, v)
    scores, _ = _scores(q, k, scale, causal, window, softcap, visible)
    normalised = scores if sink is None else _with_sink(scores, sink)
    lse = torch.logsumexp(normalised.to(torch.promote_types(scores.dtype, torch.float32)),
                          dim=-1)
    probs = _probabilities(scores, lse)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out.to(out_dtype), lse


def attention_backward_reference(grad_out, q, k, v, out, lse, softmax_scale, causal,
                                 grad_lse=None, compute_dtype=torch.float32, window=(-1, -1),
                                 softcap=0.0, sink=None, visible=None):
    """Closed-form gradients (dq, dk, dv) of attention_reference, in the form the
    backward kernel computes them:
        P  = exp(scale·QKᵀ − LSE)            (0 where masked or the row sees no key)
        dV = Pᵀ·dO            dP = dO·Vᵀ
        D  = rowsum(dO ∘ O) − dLSE
        dS = P ∘ (dP − D)
        dQ = scale·dS·K       dK = scale·dSᵀ·Q
    (with a softcap, dS also carries the cap's slope 1 − tanh²).
    GQA: dK and dV are summed over the query heads that share a K/V head.
    grad_lse: gradient flowing into the LSE output (None = 0).
    With sinks, also d(sink) = −Σ_rows exp(sink − LSE)·D (in the sinks'
    dtype), returned fourth. visible: as attention_reference's."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    f = (lambda t: t.to(compute_dtype)) if compute_dtype is not None else (lambda t: t)
    q, k, v, out, grad_out = f(q), f(k), f(v), f(out), f(grad_out)
    heads_kv = k.shape[2]
    group = q.shape[2] // heads_kv
    k_rep, v_rep = _expanded_kv(q, k, v)
    scores, slope = _scores(q, k_rep, softmax_scale, causal, window, softcap, visible)
    probs = _probabilities(scores, lse)
    grad_v = torch.einsum("bhqk,bqhd->bkhd", probs, grad_out)
    grad_p = torch.einsum("bqhd,bkhd->bhqk", grad_out, v_rep)
    delta = (grad_out * out).sum(-1).transpose(1, 2)  # (b, h, s_q)
    if grad_lse is not None:
        delta = delta - grad_lse.to(delta.dtype)
    grad_s = probs * (grad_p - delta[..., None])
    if slope is not None:
        grad_s = grad_s * slope
    grad_q = torch.einsum("bhqk,bkhd->bqhd", grad_s, k_rep) * softmax_scale
    grad_k = torch.einsum("bhqk,bqhd->bkhd", grad_s, q) * softmax_scale
    if group > 1:
        grad_k = grad_k.unflatten(2, (heads_kv, group)).sum(3)
        grad_v = grad_v.unflatten(2, (heads_kv, group)).sum(3)
    grads = grad_q.to(dtypes[0]), grad_k.to(dtypes[1]), grad_v.to(dtypes[2])
    if sink is None:
        return grads
    sink_probs = torch.exp(sink.to(delta.dtype)[None, :, None] - lse.to(delta.dtype))
    return grads + (-(sink_probs * delta).sum(dim=(0, 2)).to(sink.dtype),)


def _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None):
    """Per sequence of a packed batch: (query rows, key rows) as slices."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used_q = seqused_q.tolist() if seqused_q is not None else None
    used_k = seqused_k.tolist() if seqused_k is not None else None
    for b in range(len(cu_q) - 1):
        len_q = used_q[b] if used_q is not None else cu_q[b + 1] - cu_q[b]
        len_k = used_k[b] if used_k is not None else cu_k[b + 1] - cu_k[b]
        yield slice(cu_q[b], cu_q[b] + len_q), slice(cu_k[b], cu_k[b] + len_k)


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None,
                               causal=False, seqused_q=None, seqused_k=None,
                               compute_dtype=torch.float32, window=(-1, -1), softcap=0.0,
                               sink=None):
    """attention_reference over a packed batch: q (total_q, nheads, d), k, v
    (total_k, nheads_kv, d); each sequence on its own (masks aligned to its
    own lengths). Returns out (total_q, nheads, dv) in q.dtype, 0 on rows
    outside every sequence, and the fp32 LSE (nheads, total_q), -inf there."""
    out = q.new_zeros(q.shape[:2] + v.shape[2:])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32,
                     device=q.device)
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        if rows_q.stop == rows_q.start:
            continue
        o, l = attention_reference(q[None, rows_q], k[None, rows_k], v[None, rows_k],
                                   softmax_scale, causal, compute_dtype, window, softcap, sink)
        out[rows_q], lse[:, rows_q] = o[0], l[0]
    return out, lse


def varlen_backward_reference(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                              softmax_scale, causal, seqused_q=None, seqused_k=None,
                              grad_lse=None, compute_dtype=torch.float32, window=(-1, -1),
                              softcap=0.0, sink=None):
    """attention_backward_reference over a packed batch (lse, grad_lse:
    (nheads, total_q)); rows outside every sequence get zero gradients.
    With sinks, d(sink) fourth (a sequence with no keys adds its rows'
    −exp(sink − LSE)·D = −D: the sink holds all of their weight)."""
    grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    sink_grad = None if sink is None else torch.zeros(sink.shape, dtype=torch.float64)
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        if rows_q.stop == rows_q.start:
            continue
        seq_grad_lse = None if grad_lse is None else grad_lse[None, :, rows_q]
        if rows_k.stop == rows_k.start:
            if sink is not None and seq_grad_lse is not None:
                # O = 0, LSE = sink: only the LSE's gradient reaches the sink
                sink_grad += seq_grad_lse[0].double().sum(-1).cpu()
            continue
        seq = attention_backward_reference(
            grad_out[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k],
            out[None, rows_q], lse[None, :, rows_q], softmax_scale, causal, seq_grad_lse,
            compute_dtype, window, softcap, sink)
        grads[0][rows_q], grads[1][rows_k], grads[2][rows_k] = seq[0][0], seq[1][0], seq[2][0]
        if sink is not None:
            sink_grad += seq[3].double().cpu()
    if sink is None:
        return tuple(grads)
    return (*grads, sink_grad.to(device=sink.device, dtype=sink.dtype))
