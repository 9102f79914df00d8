"""Tile scheduling: which (m_block, head, batch) each CTA computes, in order.

Persistent mode launches one CTA per SM; CTA c takes tiles c, c + grid,
c + 2·grid, ... of a linear order. Non-persistent mode launches one CTA per
tile with the same order. The order:
- non-causal: m_block fastest, so CTAs running at once share the K/V of a
  head and read it from L2;
- causal: longest first (LPT) inside L2-sized sections of heads. Tiles near
  the bottom of the causal triangle visit the most K/V blocks, so they start
  first and short ones fill the tail. A section holds as many (batch, head)
  pairs as have K/V fitting in `L2_BUDGET_BYTES`: all m-blocks of those heads
  run close together in time and share K/V through L2 (with a global LPT
  order, CTAs running at once would all read different heads and every
  m-block would re-read K/V from HBM).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .dsl_struct import DslStruct


L2_BUDGET_BYTES = 32 * 1024 * 1024  # of the 50 MB L2 of an H100


@dataclass
class TileScheduler(DslStruct):
    num_m_blocks: Int32
    num_heads: Int32
    num_batch: Int32
    section_heads: Int32  # (batch, head) pairs per L2 section (longest_first only)
    longest_first: bool

    @staticmethod
    def create(num_m_blocks: Int32, num_heads: Int32, num_batch: Int32, seqlen_k: Int32,
               q_per_kv: Int32, kv_row_bytes: int, longest_first: bool) -> "TileScheduler":
        """kv_row_bytes: bytes of one K row plus one V row."""
        kv_head_bytes = seqlen_k * kv_row_bytes
        kv_heads = cutlass.max(Int32(L2_BUDGET_BYTES) // cutlass.max(kv_head_bytes, 1), 1)
        return TileScheduler(num_m_blocks, num_heads, num_batch, kv_heads * q_per_kv,
                             longest_first)

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
            section_tiles = self.section_heads * self.num_m_blocks
            section = tile // section_tiles
            idx = tile - section * section_tiles
            first = section * self.section_heads
            in_section = cutlass.min(self.section_heads,
                                     self.num_heads * self.num_batch - first)
            m_block = self.num_m_blocks - 1 - idx // in_section
            rest = first + idx % in_section
        else:
            m_block = tile % self.num_m_blocks
            rest = tile // self.num_m_blocks
        return m_block, rest % self.num_heads, rest // self.num_heads
