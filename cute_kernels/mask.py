"""Which K/V blocks a query tile visits, and the element mask on S.

Causal masking is bottom-right aligned (FlashAttention 2+): query row i sees
key j iff j <= i + (seqlen_k - seqlen_q). Blocks wholly above that diagonal
are never loaded; the main loop walks K/V blocks from the last one down, so
the blocks that need an element mask (the ragged seqlen_k edge and the
diagonal) come first and the rest run unmasked.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .dsl_struct import DslStruct
from .wgmma import acc_rows_cols


@dataclass
class BlockRange(DslStruct):
    """K/V block bounds for one (m_block) tile, all in units of tile_n."""

    tile_m: int
    tile_n: int
    causal: bool

    def n_block_max(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """One past the last K/V block any row of the tile sees (may be <= 0)."""
        n_max = cute.ceil_div(seqlen_k, self.tile_n)
        if cutlass.const_expr(self.causal):
            last_visible_col = (m_block + 1) * self.tile_m + seqlen_k - seqlen_q
            n_max = cutlass.min(n_max, cute.ceil_div(cutlass.max(last_visible_col, 0),
                                                     self.tile_n))
        return n_max

    def n_block_min_unmasked(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """Blocks below this index need no causal element mask."""
        first_row_diag = m_block * self.tile_m + seqlen_k - seqlen_q
        return cutlass.max(first_row_diag, 0) // self.tile_n


@cute.jit
def apply_mask(acc_s: cute.Tensor, coords: cute.Tensor, m_block: Int32, n_block: Int32,
               seqlen_q: Int32, seqlen_k: Int32, tile_m: cutlass.Constexpr[int],
               tile_n: cutlass.Constexpr[int], causal: cutlass.Constexpr[bool]):
    """Set scores of invisible keys to -inf.

    coords: the accumulator's partition of an identity tensor over the
    (tile_m, tile_n) tile, giving each register its (row, col) in the tile.
    """
    s = acc_rows_cols(acc_s)
    c = acc_rows_cols(coords)
    cols_left = seqlen_k - n_block * tile_n
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        limit = cols_left
        if cutlass.const_expr(causal):
            row = m_block * tile_m + c[r, 0][0]
            limit = cutlass.min(limit, row + seqlen_k - seqlen_q + 1 - n_block * tile_n)
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            if c[r, j][1] >= limit:
                s[r, j] = -Float32.inf


@dataclass
class ScoreMask:
    """The element mask of one forward query tile: apply(S, n_block) sets the
    scores of keys that the tile's rows do not see to -inf."""

    coords: cute.Tensor  # the (row, col) in the tile of each of the thread's S registers
    m_block: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    tile_m: int
    tile_n: int
    causal: bool

    def apply(self, acc_s: cute.Tensor, n_block: Int32):
        apply_mask(acc_s, self.coords, self.m_block, n_block, self.seqlen_q, self.seqlen_k,
                   self.tile_m, self.tile_n, self.causal)


@dataclass
class QueryBlockRange(DslStruct):
    """The backward's view: which query blocks (units of tile_m) see one key block."""

    tile_m: int
    tile_n: int
    causal: bool

    def m_block_min(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        if cutlass.const_expr(not self.causal):
            return Int32(0)
        first_query = n_block * self.tile_n - (seqlen_k - seqlen_q)
        return cutlass.max(first_query, 0) // self.tile_m

    def m_block_max(self, seqlen_q: Int32) -> Int32:
        return cute.ceil_div(seqlen_q, self.tile_m)

    def m_block_min_unmasked(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """From this query block on, every query sees every key of the block."""
        last_key_query = (n_block + 1) * self.tile_n - 1 - (seqlen_k - seqlen_q)
        return cute.ceil_div(cutlass.max(last_key_query, 0), self.tile_m)


@cute.jit
def apply_mask_transposed(acc_st: cute.Tensor, coords: cute.Tensor, n_block: Int32,
                          m_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
                          tile_n: cutlass.Constexpr[int], tile_m: cutlass.Constexpr[int],
                          causal: cutlass.Constexpr[bool]):
    """Set Sᵀ entries (rows: keys, columns: queries) of invisible keys to -inf:
    keys past seqlen_k and, when causal, keys right of a query's diagonal."""
    s = acc_rows_cols(acc_st)
    c = acc_rows_cols(coords)
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        key = n_block * tile_n + c[r, 0][0]
        # columns (queries in the tile) below this index cannot see the key
        col_limit = Int32(0)
        if cutlass.const_expr(causal):
            col_limit = key - (seqlen_k - seqlen_q) - m_block * tile_m
        if key >= seqlen_k:
            col_limit = Int32(tile_m)
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            if c[r, j][1] < col_limit:
                s[r, j] = -Float32.inf
