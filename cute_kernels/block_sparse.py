"""Block sparsity: which tiles a kernel visits, read from its tile lists, and
the element mask of the tiles that are only partly visible.

The host (python_api/block_mask.py) packs one int32 row per outer tile of a
kernel (a query tile of the forward, a key tile of the backward) and
(batch, head) of the mask, in a tensor (batch_m, heads_m * tiles, words),
row head * tiles + tile; batch_m and heads_m are 1 where the mask is the
same for every batch or head:

    [n_partial, n_full, bits_start, 0,            header (16 bytes)
     inner tile indices: the partial ones first, then the full ones,
     padding to bits_start,
     per partial tile: its visibility bits, rows x (cols / 32) words]

The inner tiles are key tiles (forward) or query tiles (backward) in units of
the kernel's tile size; a tile absent from the row is neither loaded nor
multiplied. Bit c % 32 of word c // 32 of a tile's row r says whether row r
sees column c (forward rows: queries, columns: keys; backward rows: keys,
columns: queries, the transposed tile the backward computes). A full tile
needs no mask; a partial one its bits, applied to the accumulator in
registers: a thread loads the bit words of its own rows and tests its
columns, whose offsets within a row are the same compile-time constants for
every thread up to one per-thread shift (the WGMMA accumulator layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .dsl_struct import DslStruct
from .wgmma import acc_rows_cols

HEADER_WORDS = 4
WORD_BITS = 32


@dataclass
class SparseRow(DslStruct):
    """One outer tile's list: its count of partial and of full inner tiles,
    where its bit words start, and the row of the packed table."""

    row: cute.Tensor  # int32 (words,)
    n_partial: Int32
    count: Int32  # partial + full
    bits_start: Int32
    inner_tiles: Int32

    @staticmethod
    def load(table: cute.Tensor, batch: Int32, head: Int32, tile: Int32, tiles: Int32,
             inner_tiles: Int32, bits_per_entry: int) -> "SparseRow":
        """The row of (batch, head, tile) of a kernel with `tiles` outer and
        `inner_tiles` inner tiles per head; a mask shared by every batch or
        head has a single one there (modulo its extent). The host does not
        read the lists' values (that would wait for the GPU): the counts, the
        bits' start and each index are clamped to the row and to the inner
        tiles, so that a corrupted list gives wrong scores, never an access
        outside the table or the tensors."""
        heads = table.shape[1] // tiles
        row = table[batch % table.shape[0], (head % heads) * tiles + tile, None]
        words = table.shape[2]
        count = cutlass.min(cutlass.max(row[0] + row[1], 0), words - HEADER_WORDS)
        n_partial = cutlass.min(cutlass.min(cutlass.max(row[0], 0), count),
                                (words - HEADER_WORDS) // bits_per_entry)
        bits_start = cutlass.min(cutlass.max(row[2], HEADER_WORDS),
                                 words - n_partial * bits_per_entry)
        return SparseRow(row, n_partial, count, bits_start, inner_tiles)

    def inner(self, i: Int32) -> Int32:
        """The i-th inner tile of the list (i < count)."""
        return cutlass.min(cutlass.max(self.row[HEADER_WORDS + i], 0), self.inner_tiles - 1)


@cute.jit
def apply_bits(acc: cute.Tensor, coords: cute.Tensor, coords0: cute.Tensor, row: SparseRow,
               entry: Int32, tile_rows: cutlass.Constexpr[int],
               tile_cols: cutlass.Constexpr[int]):
    """Set the accumulator entries that the bits of list entry `entry` (a
    partial tile, entry < n_partial) mark invisible to -inf. coords: this
    thread's (row, col) in the tile of each accumulator register; coords0:
    thread 0's, static. A thread's columns are thread 0's shifted by whole
    words (another warpgroup's columns) and by less than 8 (its place in
    the WGMMA layout, where thread 0's columns are 8k and 8k + 1), so each
    register's word is static and its bit within the word does not carry."""
    row_words = tile_cols // WORD_BITS
    s = acc_rows_cols(acc)
    c = acc_rows_cols(coords)
    c0 = acc_rows_cols(coords0)
    cols = cute.size(s, mode=[1])
    for j in cutlass.range_constexpr(cols):
        if cutlass.const_expr(not isinstance(c0[0, j][1], int)):
            raise TypeError("apply_bits: thread 0's accumulator columns must be "
                            "compile-time values")
    words = max(c0[0, j][1] for j in range(cols)) // WORD_BITS + 1
    shift = c[0, 0][1] - c0[0, 0][1]
    first_word = shift // WORD_BITS
    bit_shift = shift % WORD_BITS
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        start = row.bits_start + (entry * tile_rows + c[r, 0][0]) * row_words + first_word
        bits = [row.row[start + w] for w in range(words)]
        for j in cutlass.range_constexpr(cols):
            col = c0[r, j][1]
            visible = (bits[col // WORD_BITS] >> (col % WORD_BITS + bit_shift)) & 1
            if visible == 0:
                s[r, j] = -Float32.inf


@dataclass
class SparseScoreMask:
    """The forward's element mask of one query tile under block sparsity
    (the interface of mask.ScoreMask). The main loop walks blocks count - 1
    down to 0; block b is list entry count - 1 - b, so the partial tiles,
    first in the list, come first, where the limits' masked blocks do."""

    coords: cute.Tensor  # this thread's (row, col) in the tile of each S register
    coords0: cute.Tensor  # thread 0's, static
    row: SparseRow
    tile_m: int
    tile_n: int

    right_masked = True  # the partial tiles after the first
    left_masked = False

    @cute.jit
    def apply(self, acc_s: cute.Tensor, n_block: Int32):
        entry = self.row.count - 1 - n_block
        if entry < self.row.n_partial:
            apply_bits(acc_s, self.coords, self.coords0, self.row, entry, self.tile_m,
                       self.tile_n)

    def masked_bounds(self, walk):
        """(n_masked_end, n_lo) of the walk (mask.KeyWalk, the tile's): the
        blocks of the partial tiles after the first are [n_masked_end,
        n_max - 1)."""
        n_lo, n_max = walk.n_lo, walk.n_max
        n_masked_end = cute.arch.make_warp_uniform(cutlass.max(cutlass.min(
            n_max - self.row.n_partial, n_max - 1), n_lo))
        return n_masked_end, n_lo
