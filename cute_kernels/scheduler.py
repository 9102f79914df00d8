"""Tile scheduling: which (m_block, head, batch) each CTA computes, in order.

Persistent mode launches one CTA per SM; CTA c takes tiles c, c + grid,
c + 2·grid, ... of a linear order. Non-persistent mode launches one CTA per
tile with the same order. The order:
- non-causal: m_block fastest, so CTAs running at once share the K/V of a
  head and read it from L2;
- causal: longest first (LPT): tiles near the bottom of the causal triangle
  visit the most K/V blocks, so they start first and the short ones fill the
  tail of the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .dsl_struct import DslStruct


@dataclass
class TileScheduler(DslStruct):
    num_m_blocks: Int32
    num_heads: Int32
    num_batch: Int32
    longest_first: bool

    def num_tiles(self) -> Int32:
        return self.num_m_blocks * self.num_heads * self.num_batch

    @staticmethod
    def grid(num_tiles: Int32, num_sms: Int32, persistent: bool) -> Int32:
        if cutlass.const_expr(persistent):
            return cutlass.min(num_tiles, num_sms)
        return num_tiles

    def first_tile(self) -> Int32:
        return Int32(cute.arch.block_idx()[0])

    def stride(self) -> Int32:
        return Int32(cute.arch.grid_dim()[0])

    def decode(self, tile: Int32):
        """Linear tile index -> (m_block, head, batch)."""
        if cutlass.const_expr(self.longest_first):
            heads_batch = self.num_heads * self.num_batch
            m_block = self.num_m_blocks - 1 - tile // heads_batch
            rest = tile % heads_batch
        else:
            m_block = tile % self.num_m_blocks
            rest = tile // self.num_m_blocks
        return m_block, rest % self.num_heads, rest // self.num_heads
