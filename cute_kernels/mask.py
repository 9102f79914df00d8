"""Which K/V blocks a query tile visits (and which query blocks a key block
meets in the backward), and the element mask on S.

Limits are bottom-right aligned (FlashAttention 2+): with shift = seqlen_k -
seqlen_q, query row i sees key j iff
    j <= i + shift + right     causal: right = 0; local: right = window_right
    j >= i + shift - left      local only: left = window_left
and j < seqlen_k. With rows_per_query g > 1 (decode's GQA packing of
several tokens: g query heads of one token in consecutive rows) i is the
token of the row, row // g, and seqlen_q counts tokens, rows // g. The
window sizes are runtime values (Window), clamped on the host so that
"unbounded" needs no special case here. Blocks that no row of
a tile sees are never loaded; the forward's main loop walks K/V blocks from
the last one down, so the blocks that need an element mask (the ragged
seqlen_k edge and the right limit) come first, then the unmasked ones, then,
with a window, the ones its left limit cuts.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .dsl_struct import DslStruct
from .wgmma import acc_rows_cols


@dataclass
class Window(DslStruct):
    """The visible keys around each query's diagonal, in keys; only a local
    kernel reads them (the host clamps -1, unbounded, to seqlen_k on the left
    and seqlen_q on the right)."""

    left: Int32
    right: Int32


@dataclass
class Limits(DslStruct):
    """Which limits a kernel applies (compile time) and the window's sizes."""

    causal: bool
    local: bool
    window: Window
    rows_per_query: int = 1  # consecutive rows sharing one query position

    @property
    def has_right(self) -> bool:
        return self.causal or self.local

    def query(self, row):
        """The query position of a row of the sequence (also: the positions
        of seqlen_q rows)."""
        if cutlass.const_expr(self.rows_per_query == 1):
            return row
        return row // self.rows_per_query

    def query_end(self, end_row):
        """One past the query position of row end_row - 1."""
        if cutlass.const_expr(self.rows_per_query == 1):
            return end_row
        return (end_row + self.rows_per_query - 1) // self.rows_per_query

    def right(self) -> Int32:
        """Keys right of the diagonal a query still sees (0: causal)."""
        return self.window.right if cutlass.const_expr(self.local) else Int32(0)


@dataclass
class BlockRange(DslStruct):
    """K/V block bounds for one (m_block) tile, all in units of tile_n."""

    tile_m: int
    tile_n: int
    limits: Limits

    def n_block_max(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """One past the last K/V block any row of the tile sees (may be <= 0)."""
        n_max = cute.ceil_div(seqlen_k, self.tile_n)
        if cutlass.const_expr(self.limits.has_right):
            last_visible_col = (self.limits.query_end((m_block + 1) * self.tile_m) + seqlen_k
                                - self.limits.query(seqlen_q) + self.limits.right())
            n_max = cutlass.min(n_max, cute.ceil_div(cutlass.max(last_visible_col, 0),
                                                     self.tile_n))
        return n_max

    def n_block_min(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """The first K/V block any row of the tile sees (0 without a window)."""
        if cutlass.const_expr(not self.limits.local):
            return Int32(0)
        first_col = (self.limits.query(m_block * self.tile_m) + seqlen_k
                     - self.limits.query(seqlen_q) - self.limits.window.left)
        return cutlass.max(first_col, 0) // self.tile_n

    def n_block_min_unmasked(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """Blocks below this index need no element mask for the right limit."""
        first_row_diag = (self.limits.query(m_block * self.tile_m) + seqlen_k
                          - self.limits.query(seqlen_q) + self.limits.right())
        return cutlass.max(first_row_diag, 0) // self.tile_n

    def n_block_left_masked_end(self, m_block: Int32, seqlen_q: Int32,
                                seqlen_k: Int32) -> Int32:
        """local: blocks below this index are cut by the left limit of some row
        (the tile's last row has the rightmost one)."""
        last_row_left = (self.limits.query((m_block + 1) * self.tile_m - 1) + seqlen_k
                         - self.limits.query(seqlen_q) - self.limits.window.left)
        return cute.ceil_div(cutlass.max(last_row_left, 0), self.tile_n)


@dataclass
class KeyWalk:
    """The K/V blocks one consumer warpgroup computes, [n_lo, n_max), last
    first, out of its tile's [tile_lo, tile_max): every block of the tile
    passes through the K/V rings, which each warpgroup releases in order.
    rows and m_block: the row block (the tile, or the warpgroup's own rows)
    whose limits bound the blocks that need an element mask."""

    tile_lo: Int32
    tile_max: Int32
    n_lo: Int32
    n_max: Int32
    rows: BlockRange
    m_block: Int32

    @staticmethod
    def of_tile(blocks: BlockRange, m_block: Int32, n_lo: Int32, n_max: Int32) -> "KeyWalk":
        """Every block of the tile, each computed by every warpgroup."""
        return KeyWalk(n_lo, n_max, n_lo, n_max, blocks, m_block)

    @staticmethod
    @cute.jit
    def of_warpgroup(blocks: BlockRange, m_block: Int32, wg: Int32, warpgroups: int,
                     seqlen_q: Int32, seqlen_k: Int32, n_lo: Int32, n_max: Int32) -> "KeyWalk":
        """The blocks that the rows of warpgroup wg (of the tile's warpgroups,
        a slice of tile_m / warpgroups rows each) see, within the tile's
        [n_lo, n_max): under a right limit the first warpgroups' rows stop
        short of the tile's last blocks, under a window the last ones' rows
        start past its first. Rows that see none of them walk the last block
        alone (masked whole)."""
        rows = BlockRange(blocks.tile_m // warpgroups, blocks.tile_n, blocks.limits)
        own = m_block * warpgroups + wg
        hi = cutlass.max(cutlass.min(rows.n_block_max(own, seqlen_q, seqlen_k), n_max), n_lo)
        lo = n_lo
        if cutlass.const_expr(blocks.limits.local):
            lo = cutlass.min(cutlass.max(rows.n_block_min(own, seqlen_q, seqlen_k), n_lo), hi)
        if lo >= hi:
            # the tile's last block, every score masked: the steps' turns of
            # a walk of one block, and O = 0, LSE = -inf as for a tile
            # without blocks
            lo, hi = cutlass.max(n_max - 1, n_lo), n_max
        return KeyWalk(n_lo, n_max, cute.arch.make_warp_uniform(lo),
                       cute.arch.make_warp_uniform(hi), rows, own)


@cute.jit
def apply_mask(acc_s: cute.Tensor, coords: cute.Tensor, coords0: cute.Tensor, m_block: Int32,
               n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, tile_m: cutlass.Constexpr[int],
               tile_n: cutlass.Constexpr[int], limits: Limits):
    """Set scores of invisible keys to -inf.

    coords: the accumulator's partition of an identity tensor over the
    (tile_m, tile_n) tile, giving each register its (row, col) in the tile;
    coords0: thread 0's (wgmma.static_coords), compile-time values. Under a
    window (two limits a register) the tests take thread 0's columns, and
    the row's limits move by this thread's shift of them: the per-register
    column indices would stay live through the main loop and spill.
    """
    s = acc_rows_cols(acc_s)
    c = acc_rows_cols(coords)
    cols = c
    col_shift = 0
    if cutlass.const_expr(limits.local):
        cols = acc_rows_cols(coords0)
        col_shift = c[0, 0][1] - cols[0, 0][1]
    cols_left = seqlen_k - n_block * tile_n - col_shift
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        # the columns of `cols` in [low, limit) are visible
        limit = cols_left
        diag = (limits.query(m_block * tile_m + c[r, 0][0]) + seqlen_k - limits.query(seqlen_q)
                - n_block * tile_n - col_shift)
        if cutlass.const_expr(limits.has_right):
            limit = cutlass.min(limit, diag + limits.right() + 1)
        if cutlass.const_expr(limits.local):
            low = diag - limits.window.left
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                if cols[r, j][1] >= limit or cols[r, j][1] < low:
                    s[r, j] = -Float32.inf
        else:
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                if cols[r, j][1] >= limit:
                    s[r, j] = -Float32.inf


@dataclass
class ScoreMask:
    """The element mask of one forward query tile: apply(S, n_block) sets the
    scores of keys that the tile's rows do not see to -inf."""

    coords: cute.Tensor  # the (row, col) in the tile of each of the thread's S registers
    coords0: cute.Tensor  # thread 0's, compile-time values (wgmma.static_coords)
    m_block: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    tile_m: int
    tile_n: int
    limits: Limits

    @property
    def right_masked(self) -> bool:
        """The blocks after the first may need the mask (compile time)."""
        return self.limits.has_right

    @property
    def left_masked(self) -> bool:
        """The last blocks of the walk may need the mask (compile time)."""
        return self.limits.local

    def apply(self, acc_s: cute.Tensor, n_block: Int32):
        apply_mask(acc_s, self.coords, self.coords0, self.m_block, n_block, self.seqlen_q,
                   self.seqlen_k, self.tile_m, self.tile_n, self.limits)

    def masked_bounds(self, walk: KeyWalk):
        """(n_masked_end, n_unmasked_lo) of the walk's [n_lo, n_max): blocks
        [n_masked_end, n_max - 1) are cut by the right limit (the causal
        diagonal or the window's right edge) of some row of walk.rows, blocks
        [n_lo, n_unmasked_lo) by the window's left edge; those between see no
        mask. Warp-uniform, or ptxas recomputes them in vector registers at
        every step of the main loop."""
        n_lo, n_max = walk.n_lo, walk.n_max
        n_masked_end = n_max - 1
        if cutlass.const_expr(self.limits.has_right):
            n_masked_end = cute.arch.make_warp_uniform(cutlass.max(cutlass.min(
                walk.rows.n_block_min_unmasked(walk.m_block, self.seqlen_q, self.seqlen_k),
                n_max - 1), n_lo))
        n_unmasked_lo = n_lo
        if cutlass.const_expr(self.limits.local):
            n_unmasked_lo = cute.arch.make_warp_uniform(cutlass.max(cutlass.min(
                walk.rows.n_block_left_masked_end(walk.m_block, self.seqlen_q, self.seqlen_k),
                n_masked_end), n_lo))
        return n_masked_end, n_unmasked_lo


@dataclass
class QueryBlockRange(DslStruct):
    """The backward's view: which query blocks (units of tile_m) see one key block."""

    tile_m: int
    tile_n: int
    limits: Limits

    def m_block_min(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        if cutlass.const_expr(not self.limits.has_right):
            return Int32(0)
        first_query = n_block * self.tile_n - (seqlen_k - seqlen_q) - self.limits.right()
        return cutlass.max(first_query, 0) // self.tile_m

    def m_block_max(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        m_max = cute.ceil_div(seqlen_q, self.tile_m)
        if cutlass.const_expr(self.limits.local):
            # the block's last key is the last one the queries after this see
            queries = (n_block + 1) * self.tile_n - (seqlen_k - seqlen_q) + self.limits.window.left
            m_max = cutlass.min(m_max, cute.ceil_div(cutlass.max(queries, 0), self.tile_m))
        return m_max

    def m_block_min_unmasked(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """From this query block on, every query sees every key of the block
        as far as the right limit goes."""
        last_key_query = ((n_block + 1) * self.tile_n - 1 - (seqlen_k - seqlen_q)
                          - self.limits.right())
        return cute.ceil_div(cutlass.max(last_key_query, 0), self.tile_m)

    def m_block_left_masked(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """local: from this query block on, the left limit of some query cuts
        the block (its first key leaves the window of the block's last query)."""
        queries = n_block * self.tile_n - (seqlen_k - seqlen_q) + self.limits.window.left + 1
        return cutlass.max(queries, 0) // self.tile_m


@dataclass
class QueryWalk:
    """The query blocks one query head walks for a key block: count of them
    from m_min on, or under block sparsity the entries of its list (the
    partial ones, which need the bit mask, first)."""

    m_min: Int32
    count: Int32
    sparse: object  # block_sparse.SparseRow, or None

    def m_block(self, i: Int32) -> Int32:
        if cutlass.const_expr(self.sparse is not None):
            return self.sparse.inner(i)
        return self.m_min + i


@cute.jit
def apply_mask_transposed(acc_st: cute.Tensor, coords: cute.Tensor, n_block: Int32,
                          m_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
                          tile_n: cutlass.Constexpr[int], tile_m: cutlass.Constexpr[int],
                          limits: Limits):
    """Set Sᵀ entries (rows: keys, columns: queries) of invisible keys to -inf:
    keys past seqlen_k, and keys outside a query's limits."""
    s = acc_rows_cols(acc_st)
    c = acc_rows_cols(coords)
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        key = n_block * tile_n + c[r, 0][0]
        diag_col = key - (seqlen_k - seqlen_q) - m_block * tile_m
        # columns (queries in the tile) in [col_low, col_end) see the key
        col_low = Int32(0)
        col_end = Int32(tile_m)
        if cutlass.const_expr(limits.has_right):
            col_low = diag_col - limits.right()
        if cutlass.const_expr(limits.local):
            col_end = diag_col + limits.window.left + 1
        if key >= seqlen_k:
            col_low = Int32(tile_m)
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            if cutlass.const_expr(limits.local):
                if c[r, j][1] < col_low or c[r, j][1] >= col_end:
                    s[r, j] = -Float32.inf
            else:
                if c[r, j][1] < col_low:
                    s[r, j] = -Float32.inf
