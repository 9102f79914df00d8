"""Query heads as rows (Features.heads_in_rows): a KV-cache step with several
new tokens (python_api/decode.py) packs the g query heads that share a KV
head into the rows of one tile, read and written in the caller's layout.

q and O arrive as packed batches of one, (1, T, h, d) with T = b · s_q
tokens (sequence b's s_q tokens adjacent), LSE as (parts · b, h, s_q). The
kernel sees h_kv heads, each with g · T rows: row t · g + j is query head
j of the KV head's group at token t, so a sequence (g · s_q rows) starts at
row b · s_q · g. In q and O those rows have two strides, one between the
heads of a group (d apart) and one between tokens, which TMA loads and
stores as a box of (d, g, tile rows / g): g must divide the tile's rows. In
LSE tokens and sequences are apart too, three strides ((g, s_q, b)), and
the parts of a split the next mode. The rows of several tokens were once
copied into that order before the kernel and O and LSE back after it: three
launches, a quarter of a batch-1 step at an 8k cache (docs/findings.md,
"Decode")."""

from __future__ import annotations

import cutlass.cute as cute


def token_rows(t: cute.Tensor, group: int) -> cute.Tensor:
    """A kernel-order (T, d, h, batch) tensor (q, O or the split's fp32 O)
    as ((g, T), d, h / g, batch): row t · g + j at token t, head j of a
    group."""
    tokens, dim, heads, batch = t.shape
    s_token, s_dim, s_head, s_batch = t.layout.stride
    return cute.make_tensor(t.iterator, cute.make_layout(
        ((group, tokens), dim, heads // group, batch),
        stride=((s_head, s_token), s_dim, s_head * group, s_batch)))


def lse_rows(t: cute.Tensor, group: int, sequences) -> cute.Tensor:
    """A kernel-order (s_q, h, parts · b) per-row tensor (LSE, or the split's
    LSE of each part) as ((g, s_q, b), h / g, parts), b = `sequences`."""
    seqlen_q, heads, parts_batch = t.shape
    s_token, s_head, s_batch = t.layout.stride
    return cute.make_tensor(t.iterator, cute.make_layout(
        ((group, seqlen_q, sequences), heads // group, parts_batch // sequences),
        stride=((s_head, s_token, s_batch), s_head * group, s_batch * sequences)))
