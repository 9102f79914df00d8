"""Zero gradients for the rows of a packed batch that lie outside every
sequence (varlen.py), after the backward of a packed batch.

The backward's kernels write dQ, dK and dV for every row inside a sequence
and never touch the others: rows past seqused, before cu_seqlens[0] or past
cu_seqlens[-1]. Those take no part in the output, so their gradient is
zero. Allocating the three gradients zeroed wrote every byte of them once
more (three memsets of the whole tensors); this kernel writes the gaps
only.

Launch: grid (batch + 1, 3, ctas_per_gap). CTA (b, t, i) owns gap b of
tensor t (0: dQ on the query side; 1, 2: dK, dV on the key side): the rows
between the end of sequence b − 1 (0 for b = 0) and the start of sequence
b (the tensor's end for b = batch), cut to the tensor, in the lengths the
main kernel uses (varlen.Seqlens, which keeps wrong cu_seqlens / seqused
inside the tensor). The gap's 16-byte pieces are dealt over its
ctas_per_gap CTAs; a batch without gaps costs one round trip for the
lengths per CTA.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .head_rows import THREADS, HeadRowKernel
from .varlen import Seqlens


class RowGaps(HeadRowKernel):
    """The zeroing of the gaps (this module's docstring)."""

    @cute.jit
    def __call__(self, mdQ: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedQ: cute.Tensor,
                 mSeqUsedK: cute.Tensor, seqused: Int32, ctas_per_gap: Int32,
                 stream: cuda.CUstream):
        """dQ (1, total_q, h, d), dK (1, total_k, h_kv, d), dV (1, total_k,
        h_kv, d_v), 16-byte pieces; cu_seqlens and seqused int32 (1, 1, n)
        with the seqused bits (config.SEQUSED_Q | SEQUSED_K) saying which
        seqused hold lengths, as the main kernel takes them."""
        seqlens = Seqlens(True, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, seqused,
                          mdQ.shape[1], mdK.shape[1])
        gaps = seqlens.num_batch(Int32(0)) + 1
        self.kernel(mdQ, mdK, mdV, seqlens).launch(
            grid=[gaps, 3, ctas_per_gap], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQ: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, seqlens: Seqlens):
        gap, tensor, part = cute.arch.block_idx()
        parts = cute.arch.grid_dim()[2]
        first = cute.arch.thread_idx()[0] + part * THREADS
        if tensor == 0:
            lo, hi = self._gap_rows(gap, seqlens, True)
            self._zero_rows(mdQ[0, None, None, None], lo, hi, self.head_dim, first,
                            parts * THREADS)
        else:
            lo, hi = self._gap_rows(gap, seqlens, False)
            if tensor == 1:
                self._zero_rows(mdK[0, None, None, None], lo, hi, self.head_dim, first,
                                parts * THREADS)
            else:
                self._zero_rows(mdV[0, None, None, None], lo, hi, self.head_dim_v, first,
                                parts * THREADS)

    @cute.jit
    def _gap_rows(self, gap: Int32, seqlens: Seqlens, queries: cutlass.Constexpr[bool]):
        """[lo, hi): the rows between sequence gap − 1's end and sequence
        gap's start, inside the tensor."""
        rows = seqlens.rows_q if cutlass.const_expr(queries) else seqlens.rows_k
        lo = Int32(0)
        hi = rows
        if gap > 0:
            if cutlass.const_expr(queries):
                lo = seqlens.start_q(gap - 1) + seqlens.len_q(gap - 1)
            else:
                lo = seqlens.start_k(gap - 1) + seqlens.len_k(gap - 1)
        if gap < seqlens.num_batch(Int32(0)):
            hi = seqlens.start_q(gap) if cutlass.const_expr(queries) else seqlens.start_k(gap)
        return cutlass.max(lo, 0), cutlass.min(hi, rows)

    @cute.jit
    def _zero_rows(self, t: cute.Tensor, lo: Int32, hi: Int32, dim: cutlass.Constexpr[int],
                   first: Int32, stride: Int32):
        """t[lo:hi] = 0 for t (rows, heads, dim), dim contiguous, one
        16-byte piece a store, pieces dealt from `first` by `stride`."""
        pieces = dim // self.piece
        per_row = t.shape[1] * pieces
        zeros = cute.make_rmem_tensor((self.piece,), self.dtype)
        zeros.fill(0.0)
        for i in cutlass.range(first, cutlass.max(hi - lo, 0) * per_row, stride):
            row = lo + i // per_row
            head = i % per_row // pieces
            cute.local_tile(t[row, head, None], (self.piece,), (i % pieces,)).store(
                zeros.load())
