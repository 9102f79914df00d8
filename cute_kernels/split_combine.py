"""The merge after a split_kv forward (Features.split_kv): each query row's
O and LSE from the key ranges that different CTAs computed, combined
exactly:

    lse = log Σ_p exp(lse_p),   O = Σ_p exp(lse_p − lse) · O_p

with the O_p normalised over their own ranges (a range with no visible key
has lse_p = −inf and weighs 0; a row with none at all gets O = 0 and
LSE −inf, as the forward gives it). The sum runs in part order, so a
call's output does not depend on which CTA finished first.

One warp per row (batch, query, head), rows in O's memory order: lane i
holds the LSEs of parts i, i + 32, ... (up to MAX_SPLITS), reduced with
shuffles; then each lane takes 16-byte pieces (4 fp32) of the row, so one
load instruction of the warp reads 512 contiguous bytes of a part's O.
The weights travel from the lane that holds them by shuffle, not through
memory.

The kernel is launched as a programmatic dependent of the forward (PDL):
the forward's CTAs signal at their start, so the combine's CTAs are
launched and resident while the forward runs and wait in
griddepcontrol.wait, which returns once the forward has completed and its
writes are visible; the launch latency leaves the decode step's critical
path. Behind any other kernel the wait returns at once.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .config import MAX_KV_SPLITS as MAX_SPLITS

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)
WARPS_PER_CTA = 4
PIECE = 4  # fp32 values per lane and load: 16 bytes


class SplitCombine:
    """One compiled kernel per (output dtype, head_dim_v)."""

    def __init__(self, dtype, head_dim_v: int):
        if head_dim_v % PIECE:
            raise ValueError(f"head_dim_v: expected a multiple of {PIECE}, got {head_dim_v}")
        self.dtype = dtype
        self.head_dim_v = head_dim_v

    @cute.jit
    def __call__(self, mOPart: cute.Tensor, mLSEPart: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, stream: cuda.CUstream):
        """Partials O (parts, b, s_q, h, d_v) and LSE (parts, b, h, s_q), fp32 ->
        O (b, s_q, h, d_v) in the output dtype and LSE (b, h, s_q) fp32 (any
        strides; d_v contiguous)."""
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.kernel(mOPart, mLSEPart, mO, mLSE).launch(
            grid=[cute.ceil_div(rows, WARPS_PER_CTA), 1, 1], block=[32 * WARPS_PER_CTA, 1, 1],
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mOPart: cute.Tensor, mLSEPart: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor):
        cute.arch.griddepcontrol_wait()  # the forward's partials are complete and visible
        tid = cute.arch.thread_idx()[0]
        lane = tid % 32
        row = cute.arch.block_idx()[0] * WARPS_PER_CTA + tid // 32
        batch, seqlen_q, heads = mO.shape[0], mO.shape[1], mO.shape[2]
        parts = mOPart.shape[0]
        slots = MAX_SPLITS // 32
        if row < batch * seqlen_q * heads:
            head = row % heads
            query = row // heads % seqlen_q
            b = row // (heads * seqlen_q)
            lse_p = cute.make_rmem_tensor((slots,), Float32)
            top = -Float32.inf
            for i in cutlass.range_constexpr(slots):
                lse_p[i] = -Float32.inf
                if lane + 32 * i < parts:
                    lse_p[i] = mLSEPart[lane + 32 * i, b, head, query]
                top = cute.arch.fmax(top, lse_p[i])
            top = cute.arch.warp_reduction_max(top)
            if top == -Float32.inf:  # no part saw a key: weigh against 0, not -inf
                top = Float32(0.0)
            total = Float32(0.0)
            for i in cutlass.range_constexpr(slots):
                lse_p[i] = cute.math.exp2((lse_p[i] - top) * LOG2_E, fastmath=True)
                total += lse_p[i]
            total = cute.arch.warp_reduction_sum(total)
            inv_total = Float32(0.0)
            lse = -Float32.inf
            if total > Float32(0.0):
                inv_total = cute.arch.rcp_approx(total)
                lse = top + cute.math.log2(total, fastmath=True) * LN2
            if lane == 0:
                mLSE[b, head, query] = lse

            pieces = self.head_dim_v // PIECE
            per_lane = (pieces + 31) // 32
            acc = cute.make_rmem_tensor((per_lane, PIECE), Float32)
            acc.fill(0.0)
            for i in cutlass.range_constexpr(slots):
                # parts 32 i .. 32 i + 31, their weights in lane j's slot i
                for j in cutlass.range(cutlass.max(cutlass.min(parts - 32 * i, 32), 0),
                                       unroll=8):
                    weight = cute.arch.shuffle_sync(lse_p[i], j) * inv_total
                    src_row = mOPart[32 * i + j, b, query, head, None]
                    for k in cutlass.range_constexpr(per_lane):
                        if cutlass.const_expr((k + 1) * 32 <= pieces):
                            self._add_piece(acc, k, weight, src_row, lane + 32 * k)
                        elif lane + 32 * k < pieces:
                            self._add_piece(acc, k, weight, src_row, lane + 32 * k)
            dst_row = mO[b, query, head, None]
            for k in cutlass.range_constexpr(per_lane):
                if cutlass.const_expr((k + 1) * 32 <= pieces):
                    self._store_piece(acc, k, dst_row, lane + 32 * k)
                elif lane + 32 * k < pieces:
                    self._store_piece(acc, k, dst_row, lane + 32 * k)

    @cute.jit
    def _add_piece(self, acc: cute.Tensor, k: cutlass.Constexpr[int], weight: Float32,
                   src_row: cute.Tensor, piece: Int32):
        src = cute.local_tile(src_row, (PIECE,), (piece,))
        acc[k, None].store(acc[k, None].load() + weight * src.load())

    @cute.jit
    def _store_piece(self, acc: cute.Tensor, k: cutlass.Constexpr[int], dst_row: cute.Tensor,
                     piece: Int32):
        dst = cute.local_tile(dst_row, (PIECE,), (piece,))
        dst.store(acc[k, None].load().to(self.dtype))
