"""Where each sequence of a batch lies, and the tile order over a packed batch.

A dense batch holds `batch` sequences of one length each, (batch, seqlen,
heads, d). A packed (varlen) batch holds sequences of different lengths one
after another on a single token axis, (total_tokens, heads, d), with
cu_seqlens (batch + 1 int32, cumulative, starting at 0) marking where each
begins; seqused, where given, says how many of a sequence's tokens take part
(at most its segment). The kernels see a packed tensor as a batch of one,
(1, total, heads, d), and each sequence's rows as that tensor shifted by its
start (cute.domain_offset), so TMA loads address a sequence's tiles from its
first row; tile rows past its end belong to the next sequence (or are past
the tensor, zero-filled) and are masked like the ragged edge of a dense
batch. Stores must not run past the end: the epilogues store a partial last
tile row by row (store_rows).

The per-row buffers of the backward (LSE₂, D, the dQ accumulator and its
semaphores) keep each sequence in whole query tiles: sequence b starts at
row padded_start(b) = (cu_seqlens[b] + b·tile_m) // tile_m · tile_m, which
leaves room for its last tile before the next one starts (FlashAttention-3's
padding); they hold total + batch·tile_m rows.

Tiles over a packed batch (VarlenScheduler): every (sequence, head) has
ceil(length / tile) blocks; tiles go sequence after sequence, head after
head, blocks in the order the dense scheduler uses (longest first under a
causal mask). Finding the sequence of a tile index is a prefix sum over the
sequences' tile counts, 32 sequences per warp step (shuffles and a ballot),
which every warp that needs a tile runs itself: no workspace, no host work.
The persistent CTAs claim tiles from a counter (dynamic_tiles), so short
and long sequences balance over the SMs. Where no sequence holds more
query rows than a tile (Features.one_q_tile: a KV-cache step), tile t is
head t % h of sequence t // h, and the scan is skipped: in a decode step
its loads of cu_seqlens_q were one more round trip to memory, before the
sequence's lengths could be read, ahead of the tile's first TMA load.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .config import SEQUSED_K, SEQUSED_Q
from .dsl_struct import DslStruct
from .scheduler import deal


@dataclass
class Seqlens(DslStruct):
    """The sequences of a batch, queries and keys. Dense: lengths from the
    tensors' shapes, sequence b at batch index b. Packed (varlen): from
    cu_seqlens (and seqused), every sequence in batch index 0. The cu_seqlens
    and seqused tensors are int32 (1, 1, n); a dense kernel never reads them."""

    varlen: bool
    cu_q: cute.Tensor
    cu_k: cute.Tensor
    used_q: cute.Tensor
    used_k: cute.Tensor
    seqused: Int32  # SEQUSED_Q | SEQUSED_K: which seqused tensors hold the lengths
    rows_q: Int32  # the tensors' rows: a dense batch's seqlen, a packed one's total
    rows_k: Int32

    def num_batch(self, dense_batch: Int32) -> Int32:
        if cutlass.const_expr(self.varlen):
            return Int32(cute.size(self.cu_q, mode=[2]) - 1)
        return dense_batch

    def start_q(self, batch: Int32) -> Int32:
        return self.cu_q[0, 0, batch] if cutlass.const_expr(self.varlen) else Int32(0)

    def start_k(self, batch: Int32) -> Int32:
        return self.cu_k[0, 0, batch] if cutlass.const_expr(self.varlen) else Int32(0)

    def len_q(self, batch: Int32) -> Int32:
        if cutlass.const_expr(not self.varlen):
            return self.rows_q
        return _packed_len(self.cu_q, self.used_q, self.seqused & SEQUSED_Q, self.rows_q, batch)

    def len_k(self, batch: Int32) -> Int32:
        if cutlass.const_expr(not self.varlen):
            return self.rows_k
        return _packed_len(self.cu_k, self.used_k, self.seqused & SEQUSED_K, self.rows_k, batch)

    def buffer_batch(self, batch: Int32) -> Int32:
        """The batch index of a sequence in a kernel-order tensor."""
        return Int32(0) if cutlass.const_expr(self.varlen) else batch

    def padded_start_q(self, batch: Int32, tile_m: int) -> Int32:
        """Sequence b's first row in the backward's per-row buffers (packed)."""
        if cutlass.const_expr(not self.varlen):
            return Int32(0)
        return (self.start_q(batch) + batch * tile_m) // tile_m * tile_m

    @cute.jit
    def sequence_at_padded_row(self, row: Int32, tile_m: int) -> Int32:
        """Packed: the sequence whose rows of the per-row buffers hold `row`
        (the last whose padded_start_q is at most it), found by a whole warp,
        32 sequences a step."""
        num_batch = self.num_batch(Int32(1))
        lane = cute.arch.lane_idx()
        below = Int32(0)  # sequences that start at or before the row
        base = Int32(0)
        while base < num_batch:
            starts_before = Int32(0)
            if base + lane < num_batch:
                if self.padded_start_q(base + lane, tile_m) <= row:
                    starts_before = Int32(1)
            count = cute.arch.popc(cute.arch.vote_ballot_sync(starts_before != 0))
            below += count
            base += 32
            if count < 32:  # the starts grow with the sequence: none further
                base = num_batch
        return cute.arch.make_warp_uniform(cutlass.max(below - 1, 0))

    def rows(self, t: cute.Tensor, start: Int32, head: Int32, batch: Int32) -> cute.Tensor:
        """The (rows, d) view of one head of one sequence of a kernel-order
        (seq, d, head, batch) tensor, row 0 its first token."""
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((start, 0), t[None, None, head, 0])
        return t[None, None, head, batch]

    def q_rows(self, t: cute.Tensor, head: Int32, batch: Int32) -> cute.Tensor:
        return self.rows(t, self.start_q(batch), head, batch)

    def k_rows(self, t: cute.Tensor, head: Int32, batch: Int32) -> cute.Tensor:
        return self.rows(t, self.start_k(batch), head, batch)

    def row_stats(self, t: cute.Tensor, start: Int32, head: Int32, batch: Int32) -> cute.Tensor:
        """The (rows,) view of one head of one sequence of a kernel-order
        (seq, head, batch) per-row tensor (LSE, LSE₂, D)."""
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((start,), t[None, head, 0])
        return t[None, head, batch]


@cute.jit
def _packed_len(cu: cute.Tensor, used: cute.Tensor, from_used: Int32, rows: Int32,
                batch: Int32) -> Int32:
    """A packed sequence's length, kept inside the tensor: cu_seqlens or
    seqused that run past it (a caller's error the host does not check on
    every call) must not make the kernels write outside it."""
    start = cu[0, 0, batch]
    n = cu[0, 0, batch + 1] - start
    if from_used != 0:
        n = used[0, 0, batch]
    if start < 0:
        n = Int32(0)
    return cutlass.max(cutlass.min(n, rows - start), 0)


@dataclass
class VarlenScheduler(DslStruct):
    """TileScheduler's interface (num_tiles, decode) over a packed batch:
    tiles of `tile` rows of each (sequence, head), on the query side (the
    forward) or the key side (the backward). Every method is called by a
    whole warp."""

    seqlens: Seqlens
    keys: bool  # tiles over keys (backward), else over queries
    tile: int
    num_heads: Int32
    num_batch: Int32
    last_block_first: bool  # causal forward: the longest query block is the last
    one_tile: bool = False  # Features.one_q_tile: one query tile per (sequence, head)

    def tile_at(self, round_idx: Int32) -> Int32:
        return deal(round_idx)

    def _blocks(self, batch: Int32) -> Int32:
        length = self.seqlens.len_k(batch) if cutlass.const_expr(self.keys) \
            else self.seqlens.len_q(batch)
        return (length + self.tile - 1) // self.tile

    @cute.jit
    def _scan(self, base: Int32):
        """(tile count, inclusive prefix of the tile counts) of sequence
        base + lane, for the 32 sequences from base."""
        lane = cute.arch.lane_idx()
        count = Int32(0)
        if base + lane < self.num_batch:
            count = self._blocks(base + lane) * self.num_heads
        prefix = count
        for i in cutlass.range_constexpr(5):
            below = cute.arch.shuffle_sync_up(prefix, 1 << i)
            if lane >= (1 << i):
                prefix += below
        return count, prefix

    def num_tiles(self) -> Int32:
        if self.one_tile:
            return self.num_batch * self.num_heads
        return self._counted_tiles()

    @cute.jit
    def _counted_tiles(self) -> Int32:
        total = Int32(0)
        for base in cutlass.range(0, self.num_batch, 32, unroll=1):
            _, prefix = self._scan(base)
            total += cute.arch.shuffle_sync(prefix, 31)
        return cute.arch.make_warp_uniform(total)

    def decode(self, tile: Int32):
        """Linear tile index (< num_tiles) -> (block, head, batch), warp-uniform."""
        if self.one_tile:
            uniform = cute.arch.make_warp_uniform
            # 0 for every tile, but not a constant: with block 0 known, ptxas
            # hoists the epilogue's per-row addresses out of the tile loop
            # and holds them through the main loop (spilled: split heads_in_rows)
            block = tile // (self.num_heads * self.num_batch)
            return (uniform(block), uniform(tile % self.num_heads),
                    uniform(tile // self.num_heads))
        return self._scanned_tile(tile)

    @cute.jit
    def _scanned_tile(self, tile: Int32):
        batch = Int32(0)
        index = tile  # the tile's index among those of its sequence, once found
        base = Int32(0)
        while base < self.num_batch:
            count, prefix = self._scan(base)
            chunk = cute.arch.shuffle_sync(prefix, 31)
            if index < chunk:
                # prefixes grow with the lane: the sequence's lane is the
                # number of lanes whose prefix does not pass the index
                lane = cute.arch.popc(cute.arch.vote_ballot_sync(prefix <= index))
                index -= cute.arch.shuffle_sync(prefix - count, lane)
                batch = base + lane
                base = self.num_batch
            else:
                index -= chunk
                base += 32
        blocks = cutlass.max(self._blocks(batch), 1)  # (no tiles at all: any tile)
        block = index % blocks
        if cutlass.const_expr(self.last_block_first):
            block = blocks - 1 - block
        uniform = cute.arch.make_warp_uniform
        return uniform(block), uniform(index // blocks), uniform(batch)

    @staticmethod
    def max_tiles(total_rows: Int32, num_batch: Int32, num_heads: Int32, tile: int,
                  one_tile: bool = False) -> Int32:
        """An upper bound of num_tiles from shapes alone (the host's grid):
        the sequences' blocks are at most total / tile + one partial each
        (one_tile: exactly one each)."""
        if one_tile:
            return num_batch * num_heads
        return (total_rows // tile + num_batch) * num_heads
