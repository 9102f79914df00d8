"""Where the forward's producer finds K/V block n of a sequence.

Contiguous keys (dense, or a packed batch): the sequence's rows from its
start, block n at rows [n · tile_n, (n + 1) · tile_n).

A paged cache (Features.paged_kv): the cache is (num_pages, page_size,
h_kv, d) and sequence b's keys lie in pages page_table[b, 0], [b, 1], ...
in order. With page_size a multiple of tile_n, block n is whole inside
page n // (page_size / tile_n), so it stays one TMA load: the block's page
comes from the table (one int32 read by the producer thread, per block)
and its place in that page is n mod (page_size / tile_n). The kernel reads
the page size from the cache's shape; the host picks tile_n to divide it
(python_api/decode.py). Pages smaller than a block (FwdConfig.kv_load_rows
= page_size) arrive one TMA load per page, each into its rows of the
stage, all counted on the stage's one barrier: 16-key pages keep 128-key
main-loop steps instead of 16-key ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .dsl_struct import DslStruct
from .kernel_base import tma_views


@dataclass
class KvBlocks(DslStruct):
    """The K/V block lookup of one kernel: `paged` is compile-time; the
    page table is int32 (1, b, max_pages) (a never-read stand-in otherwise)."""

    paged: bool
    page_table: cute.Tensor

    def gmem_blocks(self, m_kv: cute.Tensor, rows: cute.Tensor, head_kv: Int32, tile_n: int,
                    head_dim: int) -> cute.Tensor:
        """The TMA coordinate view of one KV head's blocks: contiguous
        (tile_n, d, blocks) of `rows` (the sequence's rows); paged
        (tile_n, d, blocks per page, pages) of the kernel-order cache m_kv
        (page_size, d, h_kv, pages)."""
        if cutlass.const_expr(not self.paged):
            return cute.local_tile(rows, (tile_n, head_dim), (None, 0))
        per_head = m_kv[None, None, head_kv, None]
        return cute.flat_divide(per_head, (tile_n, head_dim))[None, None, None, 0, None]

    def first_page(self, batch: Int32) -> Int32 | int:
        """Sequence `batch`'s first page (0 unpaged). Its address needs no
        length, so the producer reads it beside the sequence's lengths: a
        contiguous cache read as one page per sequence (python_api/decode.py)
        then has its page before its lengths tell which block comes first,
        instead of one round trip after them."""
        if cutlass.const_expr(not self.paged):
            return 0
        return self.page_table[0, batch, 0]

    @cute.jit
    def block(self, g_view: cute.Tensor, batch: Int32, n_block: Int32,
              first_page: Int32 | int) -> cute.Tensor:
        """The TMA-partitioned gmem view of block n_block of sequence `batch`
        (first_page: its page 0, KvBlocks.first_page)."""
        if cutlass.const_expr(not self.paged):
            return g_view[None, n_block]
        per_page = cute.size(g_view, mode=[1])
        index = n_block // per_page
        page = first_page
        if index != 0:
            page = self.page_table[0, batch, index]
        return g_view[None, n_block % per_page, page]


@dataclass
class KvStream(DslStruct):
    """The K (or V) blocks of one tile as the producer loads them into a
    ring's stages. Whole-block loads: g and s are the TMA-partitioned gmem
    blocks (KvBlocks.gmem_blocks) and stages; page-wise loads
    (load_rows < tile_n): g is the kernel-order cache's TMA coordinates
    (page_size, d, h_kv, pages) and s the swizzled stages (tile_n, d, stages)."""

    g: cute.Tensor
    s: cute.Tensor
    head_kv: Int32
    batch: Int32
    load_rows: int
    tile_n: int
    cols: int
    first_page: Int32 | int = 0  # KvBlocks.first_page

    @cute.jit
    def load(self, atom, pipe, state, n_block: Int32, blocks: KvBlocks):
        # The block's pages are read from the table before the stage is
        # waited for: their round trip to memory overlaps the wait instead of
        # delaying the TMA loads after it.
        if cutlass.const_expr(self.load_rows == self.tile_n):
            g_block = blocks.block(self.g, self.batch, n_block, self.first_page)
            pipe.producer_acquire(state)
            cute.copy(atom, g_block, self.s[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))
        else:
            per_block = self.tile_n // self.load_rows
            # a last block's pages past the table stay in it (their rows are masked)
            last = blocks.page_table.shape[2] - 1
            pages = []
            for i in cutlass.range_constexpr(per_block):
                pages.append(blocks.page_table[0, self.batch,
                                               cutlass.min(n_block * per_block + i, last)])
            pipe.producer_acquire(state)
            barrier = pipe.producer_get_barrier(state)
            box = (self.load_rows, self.cols)
            for i in cutlass.range_constexpr(per_block):
                s_view, g_view = tma_views(
                    atom, cute.local_tile(self.s[None, None, state.index], box, (i, 0)),
                    cute.local_tile(self.g[None, None, self.head_kv, pages[i]], box, (0, 0)),
                    staged=False)
                cute.copy(atom, g_view, s_view, tma_bar_ptr=barrier)
        return state
