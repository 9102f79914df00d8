"""The kernels of attention against a KV cache (kvcache.py's CUDA path):
GQA packing, the split of the keys, and the launches.

The forward kernel runs over a packed batch (Features.varlen): every
sequence's keys are rows of the cache seen as one token axis, found by
their start (cu_seqlens_k) and length (seqused_k), so a decode step reads
no value on the host and is captured in a CUDA graph whole.

GQA packing. A decode step has 1 query token (speculative decoding: a few)
per sequence and head, and a WGMMA tile has at least 64 rows. With the
queries of one (sequence, token) that share a KV head packed into the rows
of one tile, the tile's keys and values are read once per KV head, not
once per query head. The packing is a view: q (b, s_q, h, d) is
contiguous, and the h = h_kv · g query heads of one token lie g · d apart
per KV head, d apart within a group; so with rows d apart and KV "heads"
g · d apart, sequence i = (batch, token) of the kernel starts at row i · h
and holds g rows. Its rows past g belong to other heads: loaded, masked,
never stored (the packed epilogue stores a sequence's last rows one by
one). O and the per-row LSE use the same views. With s_q > 1 each token is
a sequence of its own seeing the keys up to its place (a causal mask in
cache lengths, seqused_k), so the kernel itself is never causal there;
the keys are read once per token instead of once per query head, which is
the better side while s_q < g (else the plain layout runs: s_q rows per
sequence, heads as they are, the kernel's causal mask).

A tile keeps WGMMA's 64 rows though a decode step fills g of them (4 for
Llama-3-8B): the kernel is bound by the bytes of K and V, and the tensor
cores, idle most of the step, do the empty rows' work in their slack; the
rows cost no HBM bytes beyond q's own (their loads hit other heads' rows
of the same few KB), and a smaller M would need the slower non-WGMMA path.

Split-KV (flash-decoding). b · h_kv tiles leave most of 132 SMs idle at a
small batch. With Features.split_kv the keys of each tile are split into
`num_splits` ranges that different CTAs take, each leaving fp32 O and LSE;
split_combine.py merges them (one more launch). num_splits = 0 chooses it
from the shapes and the SM count alone (choose_splits): no cache length
is read on the host.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import ops
from .kernels.config import MAX_KV_SPLITS as MAX_SPLITS
from .kernels.config import (SEQUSED_K, SEQUSED_Q, Features, FwdConfig, decode_fwd_config,
                             kernel_head_dim)
from .launch_plan import LOG2_E
from .variants import fwd_kernel_for, num_sms

# Below this share of the SMs busy a split pays for its combine launch
# (FlashAttention-3's threshold for its split heuristic).
SPLIT_BELOW_SM_SHARE = 0.8
# The smallest split count whose SM efficiency is within this of the best.
SPLIT_EFFICIENCY_SLACK = 0.85


@dataclass(frozen=True)
class DecodePlan:
    """How one KV-cache problem runs: its query rows as the kernel's packed
    sequences, and the split of its keys."""

    gqa_packed: bool
    sequences: int  # the kernel's packed sequences: b · s_q packed, else b
    rows: int  # query rows per sequence: g packed, else s_q
    heads: int  # the kernel's heads: h_kv packed, else h
    group: int  # g = h / h_kv
    total_rows: int  # the packed row axis the views span
    num_splits: int


def choose_splits(tiles: int, n_blocks: int, sms: int) -> int:
    """Key ranges per tile from shapes only: 1 where the tiles already fill
    most SMs; else the fewest splits whose share of busy SMs over the waves
    is within SPLIT_EFFICIENCY_SLACK of the best, at most one K/V block each
    and MAX_SPLITS."""
    if tiles >= SPLIT_BELOW_SM_SHARE * sms or n_blocks <= 1:
        return 1
    most = min(MAX_SPLITS, n_blocks, sms)

    def efficiency(splits: int) -> float:
        units = tiles * splits
        return units / (math.ceil(units / sms) * sms)

    best = max(efficiency(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if efficiency(s) >= SPLIT_EFFICIENCY_SLACK * best)


@functools.lru_cache(maxsize=1024)
def plan(batch: int, seqlen_q: int, heads: int, heads_kv: int, capacity: int, tile_n: int,
         num_splits: int, sms: int) -> DecodePlan:
    """The plan of a problem from its shapes (capacity: the most keys a
    sequence holds; num_splits 0: choose_splits)."""
    group = heads // heads_kv
    packed = seqlen_q == 1 or seqlen_q < group
    if packed:
        sequences, rows, kernel_heads = batch * seqlen_q, group, heads_kv
        total_rows = (sequences - 1) * heads + group
    else:
        sequences, rows, kernel_heads = batch, seqlen_q, heads
        total_rows = batch * seqlen_q
    n_blocks = -(-capacity // tile_n)
    if num_splits == 0:
        tiles = sequences * kernel_heads * -(-rows // 64)
        num_splits = choose_splits(tiles, n_blocks, sms)
    num_splits = max(1, min(num_splits, MAX_SPLITS, max(n_blocks, 1)))
    return DecodePlan(packed, sequences, rows, kernel_heads, group, total_rows, num_splits)


def _rows_view(t: torch.Tensor, p: DecodePlan) -> torch.Tensor:
    """A contiguous (parts, b, s_q, h, x) tensor as the kernel's (parts,
    total_rows, heads, x) packed batch (the module's docstring)."""
    parts, x = t.shape[0], t.shape[-1]
    if not p.gqa_packed:
        return t.view(parts, p.total_rows, p.heads, x)
    return t.as_strided((parts, p.total_rows, p.heads, x),
                        (t.stride(0), x, p.group * x, 1))


def _lse_buffer(parts: int, batch: int, seqlen_q: int, heads: int, p: DecodePlan, device):
    """A per-row fp32 buffer as (the kernel's (parts, heads, total_rows)
    view, the (parts, b, h, s_q) view): packed rows are laid (b, s_q, h), so
    a KV head's g rows are adjacent; plain ones (h, b · s_q)."""
    if p.gqa_packed:
        buf = torch.empty((parts, batch, seqlen_q, heads), dtype=torch.float32, device=device)
        kernel = buf.as_strided((parts, p.heads, p.total_rows), (buf.stride(0), p.group, 1))
        return kernel, buf.permute(0, 1, 3, 2)
    buf = torch.empty((parts, heads, batch, seqlen_q), dtype=torch.float32, device=device)
    return buf.view(parts, heads, batch * seqlen_q), buf.permute(0, 2, 1, 3)


@dataclass
class _Constants:
    """What a decode call needs beside its inputs that depends on shapes
    alone: made once per shape and device (outside any CUDA graph capture,
    where a tensor made would hold its values only at replay)."""

    cu_q: torch.Tensor  # (1, 1, sequences + 1) int32
    used_q: torch.Tensor  # (1, 1, sequences) int32
    cu_k: torch.Tensor  # for caches in batch order: row b · capacity; paged: 0
    full: torch.Tensor  # every sequence's cache full: (sequences,) int32
    offsets: torch.Tensor | None  # causal, s_q > 1, packed: s_q - 1 - token
    stand_in: torch.Tensor  # fp32 (1, 1, 1): the sinks, unsplit partials
    no_pages: torch.Tensor  # int32 (1, 1, 1): the page table of a contiguous cache, and
    # the tile counter, which the static tile order (decode_fwd_config) never reads


_constants: dict = {}


def _make_constants(p: DecodePlan, batch: int, seqlen_q: int, capacity: int, paged: bool,
                    device) -> _Constants:
    i32 = dict(dtype=torch.int32, device=device)
    steps = torch.arange(p.sequences + 1, **i32)
    per_sequence = p.rows if not p.gqa_packed else p.group * p.heads
    tokens = seqlen_q if p.gqa_packed else 1  # the kernel's sequences per batch row
    cu_k = (steps // tokens * (0 if paged else capacity)).view(1, 1, -1)
    offsets = None
    if p.gqa_packed and seqlen_q > 1:
        offsets = torch.arange(seqlen_q - 1, -1, -1, **i32)
    used_q = torch.full((1, 1, p.sequences), p.rows, **i32)
    full = torch.full((batch,), capacity, **i32)
    return _Constants((steps * per_sequence).view(1, 1, -1), used_q, cu_k, full, offsets,
                      torch.zeros((1, 1, 1), dtype=torch.float32, device=device),
                      torch.zeros((1, 1, 1), **i32))


def _constants_for(p: DecodePlan, batch: int, seqlen_q: int, capacity: int, paged: bool,
                   device) -> _Constants:
    key = (p, batch, seqlen_q, capacity, paged, device)
    found = _constants.get(key)
    if found is None:
        found = _make_constants(p, batch, seqlen_q, capacity, paged, device)
        if not torch.cuda.is_current_stream_capturing():
            _constants[key] = found
    return found


def _key_sequences(p: DecodePlan, c: _Constants, seqlen_q: int, capacity: int,
                   cache_rows, lengths, causal: bool):
    """cu_seqlens_k and seqused_k (int32 (1, 1, n)) of the kernel's sequences:
    each starts at its cache row, and with s_q > 1 packed, token t of
    sequence b sees its cache up to its own place when causal."""
    cu_k = c.cu_k
    if cache_rows is not None:
        starts = cache_rows * capacity
        if p.gqa_packed and seqlen_q > 1:
            starts = starts.repeat_interleave(seqlen_q)
        cu_k = torch.cat([starts, starts[-1:]]).view(1, 1, -1)
    used_k = c.full if lengths is None else lengths
    if p.gqa_packed and seqlen_q > 1:
        used_k = used_k[:, None].expand(-1, seqlen_q)
        if causal:
            used_k = (used_k - c.offsets).clamp(min=0)
        used_k = used_k.reshape(-1)
    return cu_k, used_k.view(1, 1, -1)


def paged_config(config: FwdConfig, page_size: int) -> FwdConfig | None:
    """The config that reads a paged cache in place (cute_kernels/paged.py):
    blocks inside pages where tile_n divides the page size; page-wise loads
    into each block where the page divides tile_n (kv_load_rows); else a
    block of one page where it is a WGMMA N (a multiple of 16 below
    tile_n). None: the cache is gathered into contiguous sequences first."""
    tile_n = config.tile_n
    if page_size % tile_n == 0:
        return config
    if tile_n % page_size == 0 and page_size % 8 == 0:
        return config.replace(kv_load_rows=page_size)
    if page_size < tile_n and page_size % 16 == 0:
        return config.replace(tile_n=page_size)
    return None


@functools.lru_cache(maxsize=None)  # asked on every call
def kernel_config(head_dim: int, head_dim_v: int, page_size: int | None) -> FwdConfig | None:
    """The forward config of a KV-cache problem at these kernel head dims: a
    contiguous cache (page_size None) or pages read in place (None where
    paged_config does not take the page size). With kernel_features, what the precompile
    command builds (python -m cute_fa.precompile --directions decode)."""
    config = decode_fwd_config(head_dim, head_dim_v)
    return config if page_size is None else paged_config(config, page_size)


def kernel_features(split: bool, paged: bool) -> Features:
    return _FEATURES[split, paged]


def reads_pages_in_place(page_size: int, head_dim: int, head_dim_v: int) -> bool:
    """Whether the kernel loads a paged cache's blocks from its pages
    (paged_config takes the page size), rather than from a gathered copy."""
    return kernel_config(kernel_head_dim(head_dim), kernel_head_dim(head_dim_v),
                         page_size) is not None


def run(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cache_rows, page_table,
        lengths, capacity: int, softmax_scale: float, causal: bool, num_splits: int):
    """q (b, s_q, h, d) against a cache of K and V: contiguous, (1, rows,
    h_kv, d) holding each sequence's in `capacity` rows, sequence b's from
    row cache_rows[b] · capacity (None: b · capacity); or paged, (num_pages,
    page_size, h_kv, d) with page_table (b, max_pages) int32 (paged_config
    must take the page size). lengths[b] keys of sequence b (int32 (b,);
    None: all, `capacity`). Returns O (b, s_q, h, d_v) and LSE (b, h, s_q)
    fp32."""
    batch, seqlen_q, heads, head_dim = q.shape
    head_dim_v = values.shape[3]
    paged = page_table is not None
    kernel_dim, kernel_dim_v = kernel_head_dim(head_dim), kernel_head_dim(head_dim_v)
    q = ops.pad_head_dim(q.contiguous(), kernel_dim)
    keys, values = ops.pad_head_dim(keys, kernel_dim), ops.pad_head_dim(values, kernel_dim_v)
    config = kernel_config(kernel_dim, kernel_dim_v, keys.shape[1] if paged else None)
    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    sms = num_sms(device_index)
    p = plan(batch, seqlen_q, heads, keys.shape[2], capacity, config.tile_n, num_splits, sms)
    c = _constants_for(p, batch, seqlen_q, capacity, paged, q.device)
    split = p.num_splits > 1
    kernel_causal = bool(causal) and not p.gqa_packed and seqlen_q > 1
    q_rows = _rows_view(q.unsqueeze(0), p)
    kernel, _, _ = fwd_kernel_for(q_rows, values, kernel_causal, config,
                                  kernel_features(split, paged))
    out = q.new_empty((batch, seqlen_q, heads, kernel_dim_v))
    parts = p.num_splits
    lse_kernel, lse_bhs = _lse_buffer(parts, batch, seqlen_q, heads, p, q.device)
    partials = c.stand_in
    if split:
        o_part = torch.empty((parts, batch, seqlen_q, heads, kernel_dim_v), dtype=torch.float32,
                             device=q.device)
        partials = _rows_view(o_part, p)
    cu_k, used_k = _key_sequences(p, c, seqlen_q, capacity, cache_rows, lengths, causal)
    pages = c.no_pages
    if paged:
        if p.gqa_packed and seqlen_q > 1:  # each token a sequence of its own
            page_table = page_table.repeat_interleave(seqlen_q, 0)
        pages = page_table.unsqueeze(0)
    kernel.fn(q_rows, keys, values, _rows_view(out.unsqueeze(0), p), lse_kernel, c.no_pages,
              partials, c.cu_q, cu_k, c.used_q, used_k, c.stand_in, pages,
              softmax_scale * LOG2_E, sms, 0, parts, 0, 0, 0.0, SEQUSED_Q | SEQUSED_K)
    if split:
        lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
        kernel.combine(o_part, lse_bhs, out, lse)
    else:
        lse = lse_bhs[0].contiguous()
    if kernel_dim_v != head_dim_v:
        out = out[..., :head_dim_v].contiguous()
    return out, lse


_FEATURES = {(split, paged): Features(varlen=True, split_kv=split, paged_kv=paged)
             for split in (False, True) for paged in (False, True)}
