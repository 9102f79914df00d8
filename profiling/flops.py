"""FLOP counts and problem-grid arithmetic shared by every benchmark.

Standard attention counts (as FlashAttention reports them):
    forward  = 4 · batch · heads · seqlen_q · seqlen_k · headdim   (two GEMMs, 2 FLOPs per MAC)
               2 · batch · heads · seqlen_q · seqlen_k · (headdim + headdim_v) where v's differs
    causal   = forward / 2
    backward = 2.5 · forward   (five GEMMs against two)
"""

from __future__ import annotations

BWD_FACTOR = 2.5


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple) -> int:
    """(query, key) pairs a window (left, right; -1 unbounded; causal: right 0)
    lets through, bottom-right aligned: the useful work of a local problem."""
    left, right = window
    right = 0 if causal else right
    total = 0
    for i in range(seqlen_q):
        diag = i + seqlen_k - seqlen_q
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, diag + right)
        lo = 0 if left < 0 else max(0, diag - left)
        total += max(0, hi - lo + 1)
    return total


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool, direction: str = "fwd", head_dim_v: int | None = None,
                    window: tuple = (-1, -1)) -> float:
    """4·b·h·s_q·s_k·d (d+dv over 2 each), halved for causal; with a window
    the pairs it lets through (visible_pairs) in place of s_q·s_k."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    fwd = 2.0 * batch * heads * seqlen_q * seqlen_k * (head_dim + head_dim_v)
    if tuple(window) != (-1, -1):
        fwd *= visible_pairs(seqlen_q, seqlen_k, causal, window) / (seqlen_q * seqlen_k)
    elif causal:
        fwd /= 2
    if direction == "fwd":
        return fwd
    if direction == "bwd":
        return BWD_FACTOR * fwd
    if direction == "fwd_bwd":
        return (1 + BWD_FACTOR) * fwd
    raise ValueError(f"direction: expected 'fwd', 'bwd' or 'fwd_bwd', got {direction!r}")


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def batch_for(total_tokens: int, seqlen: int) -> int:
    """Batch so that batch · seqlen = total_tokens (at least 1)."""
    if seqlen <= 0 or total_tokens <= 0:
        raise ValueError(f"seqlen and total_tokens must be positive, got {seqlen}, {total_tokens}")
    return max(1, total_tokens // seqlen)
