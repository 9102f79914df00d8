"""The kernels of attention against a KV cache (kvcache.py's CUDA path):
GQA packing, the split of the keys, and the launches.

The forward kernel runs over a packed batch (Features.varlen): every
sequence's keys are rows of the cache seen as one token axis, found by
their start (cu_seqlens_k) and length (seqused_k), so a decode step reads
no value on the host and is captured in a CUDA graph whole. Where each
sequence's query rows fit one tile (Features.one_q_tile, a step of up to
64 / g tokens) a tile's sequence and head come from its index alone, not
from a scan of cu_seqlens_q.

GQA packing. A decode step has 1 query token (speculative decoding: a few)
per sequence and head, and a WGMMA tile has at least 64 rows. With the
queries that share a KV head packed into the rows of one tile, the tile's
keys and values are read once per KV head, not once per query head, and
with several tokens once for all of them. Each batch row is one sequence
of the kernel per KV head, with s_q · g rows: row t · g + j is query head j
of the KV head's group at token t, and the kernel's causal mask gives g
rows each token's place (Features.rows_per_query). How the kernel reaches
those rows (Rows):
- one token: a view. q (b, 1, h, d) is contiguous and the g query heads of
  a KV head lie d apart, KV heads g · d apart, so with rows d apart and KV
  "heads" g · d apart sequence b starts at row b · h and holds g rows. Its
  rows past g belong to other heads: loaded, masked, never stored (the
  packed epilogue stores a sequence's last rows one by one). O and the
  per-row LSE use the same views.
- several tokens, g dividing the tile's 64 rows: the rows of one KV head
  are no longer one stride apart (heads d apart, tokens h · d), and the
  kernel itself sees q, O and LSE with two and three row strides
  (Features.heads_in_rows, cute_kernels/head_groups.py), which TMA loads
  as boxes of whole groups. Nothing is copied.
- several tokens otherwise: q is copied into that order (b, s_q · g, h_kv,
  d) and O and LSE back, three launches more.

A tile keeps WGMMA's 64 rows though a decode step fills g of them (4 for
Llama-3-8B): a long part is bound by the bytes of K and V, and the tensor
cores, idle most of the step, do the empty rows' work in their slack; the
rows cost no HBM bytes beyond q's own (their loads hit other heads' rows
of the same few KB), and a smaller M would need the slower non-WGMMA path.
A short part (a short cache, or one split many ways) is its chain of
dependent steps, each a GEMM, the softmax of all 64 rows and a GEMM: where
the parts hold at most SHORT_PART_KEYS keys the 16-bit kernels take 64
keys a step (decode_fwd_config's short_parts), half a 128-key step's work.

Split-KV (flash-decoding). b · h_kv tiles leave most of 132 SMs idle at a
small batch. With Features.split_kv the keys of each tile are split into
`num_splits` ranges that different CTAs take, each leaving fp32 O and LSE;
split_combine.py merges them (one more launch). num_splits = 0 chooses it
from the shapes and the SM count alone (choose_splits): no cache length
is read on the host.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from . import ops
from .fp8_ops import E4M3_OUT
from .kernels.config import MAX_KV_SPLITS as MAX_SPLITS
from .kernels.config import (SEQUSED_K, SEQUSED_Q, WGMMA_M, Features, FwdConfig,
                             decode_fwd_config, kernel_head_dim)
from .launch_plan import LOG2_E, cached_per_shape
from .variants import fwd_kernel_for, num_sms

# The share of the SMs that the short parts of a sequence of many query rows
# fill (each part's fp32 rows cost the merge), and the most parts one tile
# takes. Sequences of a few rows fill every SM: on the H200 that ran 4-17 %
# faster than half of them at batch 1-4, where the H100 had measured half of
# them as fast (docs/findings.md, "Decode").
SPLIT_TARGET_SM_SHARE = 0.5
# Sequences of more than SHORT_CACHE_SPLIT_MAX_ROWS query rows split over all
# the SMs only where each part keeps at least this many keys; shorter parts
# over SPLIT_TARGET_SM_SHARE of them (docs/findings.md, "Decode").
FULL_GRID_PART_KEYS = 512
# A part of at most this many keys (a few blocks) runs the 16-bit kernel of
# 64-key steps (decode_fwd_config's short_parts), a longer one 128-key steps
# (docs/findings.md, "Decode").
SHORT_PART_KEYS = 256
# An e4m3 part streams about half the bytes a 16-bit one does in the same
# time, so e4m3 caches need all the SMs for that (docs/findings.md, "Decode").
E4M3_SPLIT_TARGET_SM_SHARE = 1.0
# A split pays where the keys it takes off each tile's chain outweigh the
# merge it adds: at least this many (six blocks of 128 keys; docs/findings.md,
# "Decode").
MIN_SPLIT_SAVED_KEYS = 768
# Sequences of at most this many query rows per KV head split over all the
# SMs whatever their parts' length; above it every part writes its rows'
# fp32 O and the merge reads them back, which at 128 rows cost more than
# parts of 256 keys save (docs/findings.md, "Decode").
SHORT_CACHE_SPLIT_MAX_ROWS = 32
# K/V stages of e4m3 caches on a grid of at most SPLIT_TARGET_SM_SHARE of the
# SMs, whose CTAs each stream at the rate their bytes in flight allow: an
# e4m3 stage holds half a 16-bit one's bytes (docs/findings.md, "Decode":
# 8-10 % faster there, up to 3 % slower on a full GPU, which keeps two).
E4M3_SMALL_GRID_STAGES = 3


class Rows(enum.Enum):
    """How the kernel reaches a problem's query rows (the module's docstring)."""

    VIEW = "view"  # one token: strided views of q, O and LSE
    IN_KERNEL = "in_kernel"  # several tokens, g divides the tile: the kernel's own view
    COPY = "copy"  # several tokens otherwise: copied into the packed order and back


def groups_fill_tile(group: int) -> bool:
    """Whether the kernel reads several tokens' rows in place: groups of g > 1
    query heads, whole groups to a 64-row tile (a TMA box of them)."""
    return group > 1 and WGMMA_M % group == 0


def kernel_rows_per_query(group: int, several_tokens: bool, causal: bool) -> int:
    """The rows_per_query a step's kernel is built for: g where several
    tokens' rows share a mask row per token (causal) or are read in place
    (groups_fill_tile), else 1."""
    return group if several_tokens and (causal or groups_fill_tile(group)) else 1


def rows_for(seqlen_q: int, group: int) -> Rows:
    if seqlen_q == 1:
        return Rows.VIEW
    return Rows.IN_KERNEL if groups_fill_tile(group) else Rows.COPY


@dataclass(frozen=True)
class DecodePlan:
    """How one KV-cache problem runs: each batch row a sequence of the
    kernel per KV head, holding its s_q · g query rows, and the split of its
    keys."""

    layout: Rows
    sequences: int  # the kernel's packed sequences: b
    rows: int  # query rows per sequence: s_q · g
    heads: int  # the kernel's heads: h_kv
    group: int  # g = h / h_kv, query rows per token
    total_rows: int  # the packed row axis the views span
    tiles: int  # the kernel's tiles: sequences x heads x 64-row blocks
    num_splits: int

    @property
    def ctas(self) -> int:
        """The forward's grid of work: tiles times parts."""
        return self.tiles * self.num_splits

    def one_tile(self, tile_m: int) -> bool:
        """Whether each sequence's query rows fit one tile (Features.one_q_tile)."""
        return self.rows <= tile_m


def _largest_split(tiles: int, n_blocks: int, sms: int, sm_share: float) -> int:
    """The largest power of two of parts whose tiles · parts stay within
    sm_share of the SMs (and each tile's parts within SPLIT_TARGET_SM_SHARE
    of them), at most one K/V block a part and MAX_SPLITS."""
    # a tile's merge of more parts than SPLIT_TARGET_SM_SHARE of the SMs costs
    # more than the blocks they take off its chain (e4m3 caches at batch 1)
    most = max(1, min(MAX_SPLITS, n_blocks, int(sm_share * sms) // max(tiles, 1),
                      int(SPLIT_TARGET_SM_SHARE * sms)))
    return 1 << (most.bit_length() - 1)


def choose_splits(tiles: int, n_blocks: int, block_keys: int, sms: int,
                  sm_share: float = SPLIT_TARGET_SM_SHARE, rows: int = 1) -> int:
    """Key ranges per tile from shapes only (n_blocks K/V blocks of
    block_keys keys): _largest_split within all the SMs, or within sm_share
    of them where a sequence has more than SHORT_CACHE_SPLIT_MAX_ROWS query
    rows (`rows`, s_q · g) and the parts would keep fewer than
    FULL_GRID_PART_KEYS keys; 1 where the split would take fewer than
    MIN_SPLIT_SAVED_KEYS keys off a tile (docs/findings.md, "Decode": the
    measured split counts)."""
    splits = _largest_split(tiles, n_blocks, sms, 1.0)
    if rows > SHORT_CACHE_SPLIT_MAX_ROWS and n_blocks // splits * block_keys < FULL_GRID_PART_KEYS:
        splits = _largest_split(tiles, n_blocks, sms, sm_share)
    saved_keys = (n_blocks - -(-n_blocks // splits)) * block_keys
    return splits if saved_keys >= MIN_SPLIT_SAVED_KEYS else 1


@functools.lru_cache(maxsize=1024)
def plan(batch: int, seqlen_q: int, heads: int, heads_kv: int, capacity: int, tile_n: int,
         num_splits: int, sms: int, fp8: bool = False) -> DecodePlan:
    """The plan of a problem from its shapes (capacity: the most keys a
    sequence holds; num_splits 0: choose_splits, for e4m3 caches (fp8) over
    E4M3_SPLIT_TARGET_SM_SHARE of the SMs)."""
    group = heads // heads_kv
    layout = rows_for(seqlen_q, group)
    rows = seqlen_q * group
    total_rows = (batch - 1) * heads + group if layout is Rows.VIEW else batch * rows
    n_blocks = -(-capacity // tile_n)
    tiles = batch * heads_kv * -(-rows // WGMMA_M)
    if num_splits == 0:
        num_splits = choose_splits(tiles, n_blocks, tile_n, sms,
                                   E4M3_SPLIT_TARGET_SM_SHARE if fp8 else SPLIT_TARGET_SM_SHARE,
                                   rows)
    num_splits = max(1, min(num_splits, MAX_SPLITS, max(n_blocks, 1)))
    return DecodePlan(layout, batch, rows, heads_kv, group, total_rows, tiles, num_splits)


@functools.lru_cache(maxsize=1024)
def config_and_plan(batch: int, seqlen_q: int, heads: int, heads_kv: int, capacity: int,
                    kernel_dim: int, kernel_dim_v: int, page_size: int | None,
                    num_splits: int, sms: int, fp8: bool = False) -> tuple:
    """(FwdConfig, DecodePlan) of a problem at the kernel head dims: the
    plan of kernel_config's blocks, then e4m3 caches on a small grid take
    its stages (small_grid), and 16-bit caches whose parts hold at most
    SHORT_PART_KEYS keys the 64-key steps, planned again over those blocks."""
    config = kernel_config(kernel_dim, kernel_dim_v, page_size, fp8)
    p = plan(batch, seqlen_q, heads, heads_kv, capacity, config.tile_n, num_splits, sms, fp8)
    if fp8:
        if p.ctas <= int(SPLIT_TARGET_SM_SHARE * sms):
            config = kernel_config(kernel_dim, kernel_dim_v, page_size, fp8, small_grid=True)
        return config, p
    part_keys = -(-capacity // config.tile_n // p.num_splits) * config.tile_n
    if part_keys <= SHORT_PART_KEYS:
        config = kernel_config(kernel_dim, kernel_dim_v, page_size, short_parts=True)
        p = plan(batch, seqlen_q, heads, heads_kv, capacity, config.tile_n, num_splits, sms)
    return config, p


def _pack_tokens(q: torch.Tensor, p: DecodePlan) -> torch.Tensor:
    """q (b, s_q, h, x) copied into the kernel's order (b, s_q · g, h_kv, x):
    row t · g + j of KV head k holds query head k · g + j of token t."""
    b, s_q, _, x = q.shape
    return q.view(b, s_q, p.heads, p.group, x).transpose(2, 3).reshape(b, p.rows, p.heads, x)


def _unpack_tokens(out: torch.Tensor, lse: torch.Tensor, seqlen_q: int, p: DecodePlan):
    """O (b, s_q · g, h_kv, x) and LSE (b, h_kv, s_q · g) of the packed order
    back as (b, s_q, h, x) and (b, h, s_q)."""
    b, _, _, x = out.shape
    out = out.view(b, seqlen_q, p.group, p.heads, x).transpose(2, 3)
    lse = lse.view(b, p.heads, seqlen_q, p.group).transpose(2, 3)
    heads = p.heads * p.group
    return out.reshape(b, seqlen_q, heads, x), lse.reshape(b, heads, seqlen_q)


def _rows_view(t: torch.Tensor, p: DecodePlan) -> torch.Tensor:
    """A contiguous (parts, b, s_q, h, x) tensor (one token) or (parts, b,
    s_q · g, h_kv, x) one (packed order) as the kernel's (parts, total_rows,
    heads, x) packed batch (the module's docstring)."""
    parts, x = t.shape[0], t.shape[-1]
    if p.layout is not Rows.VIEW:
        return t.view(parts, p.total_rows, p.heads, x)
    return t.as_strided((parts, p.total_rows, p.heads, x),
                        (t.stride(0), x, p.group * x, 1))


def _lse_buffer(parts: int, batch: int, p: DecodePlan, device):
    """A per-row fp32 buffer as (the kernel's (parts, heads, total_rows)
    view, the combine's (parts, b, heads, rows) view): viewed rows are laid
    (b, h), so a KV head's g rows are adjacent; packed ones (h_kv, b, rows)."""
    if p.layout is Rows.VIEW:
        buf = torch.empty((parts, batch, 1, p.heads * p.group), dtype=torch.float32,
                          device=device)
        kernel = buf.as_strided((parts, p.heads, p.total_rows), (buf.stride(0), p.group, 1))
        return kernel, buf.permute(0, 1, 3, 2)
    buf = torch.empty((parts, p.heads, batch, p.rows), dtype=torch.float32, device=device)
    return buf.view(parts, p.heads, batch * p.rows), buf.permute(0, 2, 1, 3)


@dataclass
class _Constants:
    """What a decode call needs beside its inputs that depends on shapes
    alone: made once per shape and device (outside any CUDA graph capture,
    where a tensor made would hold its values only at replay)."""

    cu_q: torch.Tensor  # (1, 1, sequences + 1) int32
    used_q: torch.Tensor  # (1, 1, sequences) int32
    cu_k: torch.Tensor  # for caches in batch order: row b · capacity; paged: 0
    full: torch.Tensor  # every sequence's cache full: (sequences,) int32
    stand_in: torch.Tensor  # fp32 (1, 1, 1): the sinks, unsplit partials
    no_pages: torch.Tensor  # int32 (1, 1, 1): the page table of a contiguous cache, the
    # tile counter, which the static tile order (decode_fwd_config) never reads, and the
    # block mask's tile lists


def _make_constants(p: DecodePlan, capacity: int, paged: bool, device) -> _Constants:
    i32 = dict(dtype=torch.int32, device=device)
    steps = torch.arange(p.sequences + 1, **i32)
    # one token: sequence b starts at row b · h of the strided view
    per_sequence = p.group * p.heads if p.layout is Rows.VIEW else p.rows
    cu_k = (steps * (0 if paged else capacity)).view(1, 1, -1)
    used_q = torch.full((1, 1, p.sequences), p.rows, **i32)
    full = torch.full((p.sequences,), capacity, **i32)
    return _Constants((steps * per_sequence).view(1, 1, -1), used_q, cu_k, full,
                      torch.zeros((1, 1, 1), dtype=torch.float32, device=device),
                      torch.zeros((1, 1, 1), **i32))


def _constants_for(p: DecodePlan, capacity: int, paged: bool, device) -> _Constants:
    return cached_per_shape((p, capacity, paged, device),
                            lambda: _make_constants(p, capacity, paged, device))


def _key_sequences(c: _Constants, capacity: int, cache_rows, lengths):
    """cu_seqlens_k and seqused_k (int32 (1, 1, n)) of the kernel's
    sequences: each starts at its cache row and holds its cache's keys."""
    cu_k = c.cu_k
    if cache_rows is not None:
        starts = cache_rows * capacity
        cu_k = torch.cat([starts, starts[-1:]]).view(1, 1, -1)
    used_k = c.full if lengths is None else lengths
    return cu_k, used_k.view(1, 1, -1)


def paged_config(config: FwdConfig, page_size: int, fp8: bool = False,
                 widest_page_step: int = 0) -> FwdConfig | None:
    """The config that reads a paged cache in place (cute_kernels/paged.py):
    blocks inside pages where tile_n divides the page size; page-wise loads
    into each block where the page divides tile_n (kv_load_rows); else a
    block of one page where it is a WGMMA N (a multiple of 16; of 32, the
    e4m3 WGMMA's K, for e4m3 caches) below tile_n or widest_page_step. None:
    the cache is gathered into contiguous sequences first."""
    tile_n = config.tile_n
    if page_size % tile_n == 0:
        return config
    if tile_n % page_size == 0 and page_size % 8 == 0:
        return config.replace(kv_load_rows=page_size)
    if page_size < max(tile_n, widest_page_step) and page_size % (32 if fp8 else 16) == 0:
        return config.replace(tile_n=page_size)
    return None


@functools.lru_cache(maxsize=None)  # asked on every call
def kernel_config(head_dim: int, head_dim_v: int, page_size: int | None,
                  fp8: bool = False, small_grid: bool = False,
                  short_parts: bool = False) -> FwdConfig | None:
    """The forward config of a KV-cache problem at these kernel head dims: a
    contiguous cache (page_size None) or pages read in place (None where
    paged_config does not take the page size); fp8: e4m3 caches, with
    E4M3_SMALL_GRID_STAGES where the grid is small (small_grid); short_parts:
    the 64-key steps of 16-bit parts of at most SHORT_PART_KEYS keys. With
    kernel_features, what the precompile command builds (python -m
    cute_fa.precompile --directions decode)."""
    config = decode_fwd_config(head_dim, head_dim_v, short_parts)
    if fp8 and small_grid:
        config = config.replace(kv_stages=E4M3_SMALL_GRID_STAGES)
    if page_size is None:
        return config
    # Pages that neither divide nor are divided by the key block are read in
    # place, a page a step, below the long parts' step, which short parts'
    # 64-key steps keep (a page of 80-112 tokens is a step with either)
    widest = decode_fwd_config(head_dim, head_dim_v).tile_n
    return paged_config(config, page_size, fp8, widest)


@functools.lru_cache(maxsize=None)  # asked on every call: one Features per combination
def kernel_features(split: bool, paged: bool, rows_per_query: int = 1,
                    one_tile: bool = False) -> Features:
    """The forward's features for a KV-cache problem; rows_per_query:
    kernel_rows_per_query's (heads_in_rows where those rows are read in
    place, Rows.IN_KERNEL); one_tile: each sequence's s_q · g query rows
    fit one tile (DecodePlan.one_tile; Features.one_q_tile, which would
    drop the rows past it)."""
    return Features(varlen=True, split_kv=split, paged_kv=paged, rows_per_query=rows_per_query,
                    heads_in_rows=groups_fill_tile(rows_per_query), one_q_tile=one_tile)


def reads_pages_in_place(page_size: int, head_dim: int, head_dim_v: int,
                         fp8: bool = False) -> bool:
    """Whether the kernel loads a paged cache's blocks from its pages
    (paged_config takes the page size), rather than from a gathered copy."""
    return kernel_config(kernel_head_dim(head_dim), kernel_head_dim(head_dim_v),
                         page_size, fp8) is not None


def reads_rows_as_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether a contiguous cache (rows, capacity, h_kv, d) is read as a
    paged one of one page per row: contiguous, and its rows whole K/V
    blocks (the paged config is then the contiguous one). The kernel then
    cuts each length at its row's end itself, which saves the host's clamp
    launch (docs/findings.md, "Decode")."""
    capacity = k_cache.shape[1]
    dims = kernel_head_dim(head_dim), kernel_head_dim(v_cache.shape[3])
    return (capacity > 0 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and kernel_config(*dims, capacity) == kernel_config(*dims, None))


def row_pages(cache_rows, batch: int, device) -> torch.Tensor:
    """The page table of a contiguous cache read as pages: (batch, 1) int32,
    sequence b's one page its cache row (cache_rows[b], or b)."""
    if cache_rows is not None:
        return cache_rows.view(batch, 1)
    return cached_per_shape(("row_pages", batch, device), lambda: torch.arange(
        batch, dtype=torch.int32, device=device).view(batch, 1))


def run(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cache_rows, page_table,
        lengths, capacity: int, softmax_scale: float, causal: bool, num_splits: int,
        descales: list | None = None):
    """q (b, s_q, h, d) against a cache of K and V: contiguous, (1, rows,
    h_kv, d) holding each sequence's in `capacity` rows, sequence b's from
    row cache_rows[b] · capacity (None: b · capacity); or paged, (num_pages,
    page_size, h_kv, d) with page_table (b, max_pages) int32 (paged_config
    must take the page size). lengths[b] keys of sequence b (int32 (b,);
    None: all, `capacity`). e4m3 q, K and V take `descales`
    (fp8_ops.kernel_descales: q's, k's, v's) and give a bf16 O. Returns O
    (b, s_q, h, d_v) and LSE (b, h, s_q) fp32."""
    batch, seqlen_q, heads, head_dim = q.shape
    head_dim_v = values.shape[3]
    paged = page_table is not None
    kernel_dim, kernel_dim_v = kernel_head_dim(head_dim), kernel_head_dim(head_dim_v)
    q = ops.pad_head_dim(q.contiguous(), kernel_dim)
    keys, values = ops.pad_head_dim(keys, kernel_dim), ops.pad_head_dim(values, kernel_dim_v)
    fp8 = descales is not None
    out_dtype = E4M3_OUT if fp8 else q.dtype
    page_size = keys.shape[1] if paged else None
    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    sms = num_sms(device_index)
    config, p = config_and_plan(batch, seqlen_q, heads, keys.shape[2], capacity, kernel_dim,
                                kernel_dim_v, page_size, num_splits, sms, fp8)
    c = _constants_for(p, capacity, paged, q.device)
    split = p.num_splits > 1
    kernel_causal = bool(causal) and seqlen_q > 1
    b = _buffers(q, p, seqlen_q, kernel_dim_v, out_dtype)
    group = kernel_rows_per_query(p.group, seqlen_q > 1, causal)
    kernel, _, _ = fwd_kernel_for(b.q, values, kernel_causal, config,
                                  kernel_features(split, paged, group,
                                                  p.one_tile(config.tile_m)),
                                  out_dtype if fp8 else None)
    cu_k, used_k = _key_sequences(c, capacity, cache_rows, lengths)
    pages = c.no_pages if not paged else page_table.unsqueeze(0)
    kernel.fn(b.q, keys, values, b.out_kernel, b.lse_kernel, c.no_pages,
              c.stand_in if b.o_parts is None else b.o_parts_kernel, c.cu_q, cu_k, c.used_q,
              used_k, c.stand_in, pages, *(descales if fp8 else (c.stand_in,) * 3),
              c.no_pages, softmax_scale * LOG2_E, sms, 0, p.num_splits, 0, 0, 0.0,
              SEQUSED_Q | SEQUSED_K)
    out, lse = b.out, b.lse
    if split:
        kernel.combine(b.o_parts, b.lse_parts, out, lse)
    if p.layout is Rows.COPY:
        out, lse = _unpack_tokens(out, lse, seqlen_q, p)
    if kernel_dim_v != head_dim_v:
        out = out[..., :head_dim_v]
    return out.contiguous(), lse.contiguous()


@dataclass
class _Buffers:
    """What one call's kernel reads and writes and the split's merge takes,
    in the views of the problem's Rows."""

    q: torch.Tensor  # the kernel's q
    out: torch.Tensor  # O as the merge writes it: the caller's, or (COPY) the packed order
    out_kernel: torch.Tensor  # the kernel's view of `out`
    lse: torch.Tensor  # LSE (b, heads, rows) as the merge writes it
    lse_kernel: torch.Tensor  # the kernel's per-row LSE: `lse`, or the parts' (split)
    o_parts: torch.Tensor | None = None  # split: fp32 O per part (parts, b, rows, heads, x)
    o_parts_kernel: torch.Tensor | None = None
    lse_parts: torch.Tensor | None = None  # split: (parts, b, heads, rows)


def _buffers(q: torch.Tensor, p: DecodePlan, seqlen_q: int, dim_v: int,
             out_dtype: torch.dtype) -> _Buffers:
    batch, heads, parts = q.shape[0], q.shape[2], p.num_splits
    f32 = dict(dtype=torch.float32, device=q.device)
    if p.layout is Rows.IN_KERNEL:  # q, O and LSE as the caller has them
        tokens = batch * seqlen_q
        out = torch.empty((batch, seqlen_q, heads, dim_v), dtype=out_dtype, device=q.device)
        lse = torch.empty((batch, heads, seqlen_q), **f32)
        b = _Buffers(q.view(1, tokens, heads, q.shape[3]), out, out.view(1, tokens, heads, dim_v),
                     lse, lse)
        if parts > 1:
            b.o_parts = torch.empty((parts, batch, seqlen_q, heads, dim_v), **f32)
            b.o_parts_kernel = b.o_parts.view(parts, tokens, heads, dim_v)
            b.lse_parts = torch.empty((parts, batch, heads, seqlen_q), **f32)
            b.lse_kernel = b.lse_parts.view(parts * batch, heads, seqlen_q)
        return b
    # one token: O in the caller's layout; COPY: in the packed order, then copied
    rows, out_heads = (seqlen_q, heads) if p.layout is Rows.VIEW else (p.rows, p.heads)
    out = torch.empty((batch, rows, out_heads, dim_v), dtype=out_dtype, device=q.device)
    lse_kernel, lse_parts = _lse_buffer(parts, batch, p, q.device)
    q_rows = _rows_view((q if p.layout is Rows.VIEW else _pack_tokens(q, p)).unsqueeze(0), p)
    b = _Buffers(q_rows, out, _rows_view(out.unsqueeze(0), p), lse_parts[0], lse_kernel)
    if parts > 1:
        b.lse = torch.empty((batch, out_heads, rows), **f32)
        b.lse_parts = lse_parts
        b.o_parts = torch.empty((parts, batch, rows, out_heads, dim_v), **f32)
        b.o_parts_kernel = _rows_view(b.o_parts, p)
    return b
