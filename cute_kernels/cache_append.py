"""New keys and values written into a KV cache in place, in one launch
(flash_attn_with_kvcache's k, v; python_api/kvcache.py).

Every cache is taken as pages: a paged one (num_pages, page_size, h_kv, d)
with its page table (batch, max_pages), a contiguous one (batch_cache,
capacity, h_kv, d) as pages of `capacity` tokens with one page per
sequence (its cache row). Token t of sequence b lands at position
cache_seqlens[b] + t: page page_table[b, position // page_size], slot
position % page_size. A position outside [0, max_pages · page_size) is not
written (no page holds it; the attention cuts the sequence there too).
The same launch writes each sequence's new length, cache_seqlens[b] +
seqlen_new, which the attention reads, so a decode step with new tokens
costs one launch here instead of a dozen indexing kernels.

One CTA per (new token, sequence); its threads copy the token's K and V
rows of every KV head in 16-byte pieces (the head dims are multiples of
16 bytes: the op's caller checks).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .head_rows import THREADS, HeadRowKernel


class CacheAppend(HeadRowKernel):
    """The append (this module's docstring)."""

    @cute.jit
    def __call__(self, mK: cute.Tensor, mV: cute.Tensor, mKCache: cute.Tensor,
                 mVCache: cute.Tensor, mPageTable: cute.Tensor, mSeqlens: cute.Tensor,
                 mLengths: cute.Tensor, stream: cuda.CUstream):
        """k, v (b, s_new, h_kv, d / d_v); the caches (pages, page_size, h_kv,
        d / d_v); page_table (b, max_pages) int32; cache_seqlens (b,) int32
        in, lengths (b,) int32 out."""
        self.kernel(mK, mV, mKCache, mVCache, mPageTable, mSeqlens, mLengths).launch(
            grid=[mK.shape[1], mK.shape[0], 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mV: cute.Tensor, mKCache: cute.Tensor,
               mVCache: cute.Tensor, mPageTable: cute.Tensor, mSeqlens: cute.Tensor,
               mLengths: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        token, batch, _ = cute.arch.block_idx()
        start = mSeqlens[batch]
        if token == 0 and tid == 0:
            mLengths[batch] = start + mK.shape[1]
        position = start + token
        page_size = mKCache.shape[1]
        if position >= 0 and position < mPageTable.shape[1] * page_size:
            page = mPageTable[batch, position // page_size]
            slot = position % page_size
            self._copy_heads(mK[batch, token, None, None], mKCache[page, slot, None, None],
                             self.head_dim, tid)
            self._copy_heads(mV[batch, token, None, None], mVCache[page, slot, None, None],
                             self.head_dim_v, tid)

    @cute.jit
    def _copy_heads(self, src: cute.Tensor, dst: cute.Tensor, dim: cutlass.Constexpr[int],
                    tid: Int32):
        """dst ← src, (h_kv, dim) each with dim contiguous, 16 bytes a load."""
        pieces = dim // self.piece
        for i in cutlass.range(tid, src.shape[0] * pieces, THREADS):
            head = i // pieces
            column = i % pieces
            piece = cute.local_tile(src[head, None], (self.piece,), (column,))
            cute.local_tile(dst[head, None], (self.piece,), (column,)).store(piece.load())
