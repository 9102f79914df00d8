"""The backward's tiles: which key block a CTA computes, and the query
blocks it walks.

A tile is one key block of one head of one sequence (KeyTile). With
BwdConfig.dynamic_tiles the persistent CTAs take the tile of their index,
then the ones their producer claims (scheduler.TileSequence); otherwise
each CTA runs its own. The producer warp, the consumer warpgroups and the
dQ writer warp each walk the same query blocks of the same tiles in step:
KeyTiles.query_blocks and query_walk are that walk, so the roles cannot
disagree on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .block_sparse import SparseRow
from .dsl_struct import DslStruct
from .mask import Limits, QueryBlockRange, QueryWalk
from .scheduler import TileSequence
from .varlen import Seqlens


@dataclass
class KeyTile:
    """One CTA tile: a key block of one head of one sequence, the query
    heads that read it (all of its KV group's, or with split_gqa one), and
    the sequence's lengths."""

    n_block: Int32
    cta_head: Int32  # the scheduler's head: a KV head, or with split_gqa a query head
    batch: Int32
    head_kv: Int32
    first_head: Int32  # the first query head walked
    head_count: Int32
    seqlen_q: Int32
    seqlen_k: Int32


@dataclass
class KeyTiles(DslStruct):
    """The key blocks (tiles) of a CTA: its own (one CTA per tile), or with
    BwdConfig.dynamic_tiles its index's, then the ones its producer claims;
    and the query blocks each of them meets."""

    sequence: TileSequence
    seqlens: Seqlens
    q_per_kv: Int32
    split_gqa: bool  # scheduler heads are query heads, else KV heads
    block_sparse: cute.Tensor  # the tile lists (block_sparse kernels read it)
    sparse: bool  # a block_sparse kernel: the walks follow the lists
    tile_m: int  # query rows a step
    tile_n: int  # keys a tile

    def first(self) -> Int32:
        return Int32(cute.arch.block_idx()[0])

    def num_tiles(self) -> Int32:
        """The tiles' count (over a packed batch a scan of its sequences:
        taken once per role)."""
        return self.sequence.scheduler.num_tiles()

    def own(self, num_tiles: Int32) -> KeyTile:
        """One CTA per tile (no dynamic_tiles): this CTA's. A packed batch's
        grid is an upper bound of its tiles: a CTA past the last one gets
        the last tile with no query heads and no keys, so that it loads,
        computes and stores nothing (a branch around the roles' work would
        not do: the pipelines' state may not leave one)."""
        first = self.first()
        tile = self.decode(cutlass.max(cutlass.min(first, num_tiles - 1), 0))
        if cutlass.const_expr(self.seqlens.varlen):
            keep = cutlass.min(cutlass.max(num_tiles - first, 0), 1)  # 1: a tile of its own
            tile.head_count = tile.head_count * keep
            edge = tile.n_block * self.sequence.scheduler.tile
            tile.seqlen_k = edge + (tile.seqlen_k - edge) * keep
        return tile

    def decode(self, tile: Int32) -> KeyTile:
        n_block, cta_head, batch = self.sequence.scheduler.decode(tile)
        seqlen_q, seqlen_k = self.seqlens.len_q(batch), self.seqlens.len_k(batch)
        if cutlass.const_expr(self.split_gqa):
            return KeyTile(n_block, cta_head, batch, cta_head // self.q_per_kv, cta_head,
                           Int32(1), seqlen_q, seqlen_k)
        return KeyTile(n_block, cta_head, batch, cta_head, cta_head * self.q_per_kv,
                       self.q_per_kv, seqlen_q, seqlen_k)

    def query_blocks(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, limits: Limits):
        """(first query block, count) that see this key block."""
        blocks = QueryBlockRange(self.tile_m, self.tile_n, limits)
        m_min = blocks.m_block_min(n_block, seqlen_q, seqlen_k)
        m_count = blocks.m_block_max(n_block, seqlen_q, seqlen_k) - m_min
        if cutlass.const_expr(limits.local):
            m_count = cutlass.max(m_count, 0)  # keys no window reaches
        return m_min, m_count

    @cute.jit
    def query_walk(self, tile: KeyTile, head: Int32, m_min: Int32, m_count: Int32) -> QueryWalk:
        """The walk of one query head over the query blocks that see the key
        block: [m_min, m_min + m_count) (query_blocks), or under block
        sparsity its list."""
        sparse = None
        if cutlass.const_expr(self.sparse):
            sparse = SparseRow.load(self.block_sparse, tile.batch, head, tile.n_block,
                                    cute.ceil_div(tile.seqlen_k, self.tile_n),
                                    cute.ceil_div(tile.seqlen_q, self.tile_m),
                                    self.tile_n * self.tile_m // 32)
            m_count = sparse.count
        return QueryWalk(m_min, m_count, sparse)
