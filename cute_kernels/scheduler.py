"""Tile scheduling: which (m_block, head, batch) each CTA computes, in order.

Persistent mode launches one CTA per SM and deals the linear order out in
rounds of `grid` tiles, alternating direction (a snake): in round r, CTA c
takes tile r·grid + c when r is even and r·grid + grid-1-c when r is odd, so
with longest-first orders each CTA's sum of tile lengths stays even (a plain
round-robin hands CTA 0 the longest tile of every round). Non-persistent mode
launches one CTA per tile (round 0 only) and the hardware's CTA dispatch does
the balancing. The order:
- non-causal: m_block fastest, so CTAs running at once share the K/V of a
  head and read it from L2;
- causal: longest first (LPT) inside L2-sized sections of heads. Tiles near
  the bottom of the causal triangle visit the most K/V blocks, so they start
  first and short ones fill the tail. A section holds as many (batch, head)
  pairs as have K/V fitting in the config's `l2_section_mb`: all m-blocks of those heads
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


@dataclass
class TileScheduler(DslStruct):
    num_m_blocks: Int32
    num_heads: Int32
    num_batch: Int32
    section_heads: Int32  # (batch, head) pairs per L2 section (longest_first only)
    longest_first: bool

    @staticmethod
    def create(num_m_blocks: Int32, num_heads: Int32, num_batch: Int32, seqlen_k: Int32,
               q_per_kv: Int32, kv_row_bytes: int, l2_section_bytes: int,
               longest_first: bool) -> "TileScheduler":
        """kv_row_bytes: bytes of one K row plus one V row."""
        kv_head_bytes = seqlen_k * kv_row_bytes
        kv_heads = cutlass.max(Int32(l2_section_bytes) // cutlass.max(kv_head_bytes, 1), 1)
        return TileScheduler(num_m_blocks, num_heads, num_batch, kv_heads * q_per_kv,
                             longest_first)

    def num_tiles(self) -> Int32:
        return self.num_m_blocks * self.num_heads * self.num_batch

    @staticmethod
    def grid(num_tiles: Int32, num_sms: Int32, persistent: bool) -> Int32:
        if cutlass.const_expr(persistent):
            return cutlass.min(num_tiles, num_sms)
        return num_tiles

    @cute.jit
    def tile_at(self, round_idx: Int32) -> Int32:
        """The linear tile this CTA computes in round `round_idx` (may be past the end)."""
        cta = Int32(cute.arch.block_idx()[0])
        grid = Int32(cute.arch.grid_dim()[0])
        offset = cta
        if round_idx % 2 == 1:
            offset = grid - 1 - cta
        return round_idx * grid + offset

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
