"""The merge after a split_kv forward (Features.split_kv): each query row's
O and LSE from the key ranges that different CTAs computed, combined
exactly:

    lse = log Σ_p exp(lse_p),   O = Σ_p exp(lse_p − lse) · O_p

with the O_p normalised over their own ranges (a range with no visible key
has lse_p = −inf and weighs 0; a row with none at all gets O = 0 and
LSE −inf, as the forward gives it). The sum's order is fixed by the part
indices, so a call's output does not depend on which CTA finished first.

One CTA of WARPS_PER_ROW warps per row (batch, query, head), each warp
a slice of the row's head dims. Every warp reads all the parts' LSEs
(lane i: parts i, i + 32, ... up to MAX_SPLITS) and reduces them with
shuffles. Its lanes split PART_LANES ways over the parts and PIECE_LANES
ways over its slice's 16-byte pieces (4 fp32): lane (s, p) sums the
weighted O of parts s, s + 4, ... at its pieces, and the four sums of a
piece meet by shuffles in a fixed order. `in_flight` of a lane's parts
are loaded at once (16 up to head dim 128, 8 above), the first before the
LSEs are read and reduced (their values do not depend on the weights): a
row of up to 4 · in_flight parts costs one round trip to memory. A
batch-1 decode's partials are a few hundred KB, so the merge is a chain
of latencies, not of bandwidth: one warp a row walking the parts eight
loads at a time took 2.2-4.7 µs longer at 64 parts.

An ordinary launch after the forward, not a programmatic dependent one
(PDL, the merge's CTAs resident during the forward and waiting in
griddepcontrol.wait): that saved 1.0-1.5 µs where our calls came close
together, but cost 0.4-3.9 µs where the kernels of several other calls
ran between two of ours (docs/findings.md, "Decode").
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
WARPS_PER_ROW = 4
PART_LANES = 4  # a warp's lanes over the parts
PIECE_LANES = 8  # ... and over its slice of the row's pieces
PIECE = 4  # fp32 values per lane and load: 16 bytes
IN_FLIGHT_REGS = 64  # fp32 registers per lane that its loads in flight take


class SplitCombine:
    """One compiled kernel per (output dtype, head_dim_v)."""

    def __init__(self, dtype, head_dim_v: int):
        if head_dim_v % PIECE:
            raise ValueError(f"head_dim_v: expected a multiple of {PIECE}, got {head_dim_v}")
        self.dtype = dtype
        self.head_dim_v = head_dim_v
        self.pieces = head_dim_v // PIECE
        self.warp_pieces = -(-self.pieces // WARPS_PER_ROW)
        self.per_lane = -(-self.warp_pieces // PIECE_LANES)
        # parts whose O a lane loads at once: 16 up to head dim 128, 8 above
        self.in_flight = IN_FLIGHT_REGS // (PIECE * self.per_lane)
        self.chunk = PART_LANES * self.in_flight
        # a chunk of parts spans whole 32-part LSE slots, so a part's slot is
        # known at compile time
        assert self.chunk % 32 == 0 and PART_LANES * PIECE_LANES == 32
        # every lane's pieces inside its warp's slice and the row (head dim 128, 256)
        self.slices_even = (self.warp_pieces % PIECE_LANES == 0
                            and self.pieces % WARPS_PER_ROW == 0)

    @cute.jit
    def __call__(self, mOPart: cute.Tensor, mLSEPart: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, stream: cuda.CUstream):
        """Partials O (parts, b, s_q, h, d_v) and LSE (parts, b, h, s_q), fp32 ->
        O (b, s_q, h, d_v) in the output dtype and LSE (b, h, s_q) fp32 (any
        strides; d_v contiguous)."""
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.kernel(mOPart, mLSEPart, mO, mLSE).launch(
            grid=[rows, 1, 1], block=[32 * WARPS_PER_ROW, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOPart: cute.Tensor, mLSEPart: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        lane = tid % 32
        part_lane, piece_lane = lane // PIECE_LANES, lane % PIECE_LANES
        warp = cute.arch.make_warp_uniform(tid // 32)
        row = cute.arch.block_idx()[0]
        seqlen_q, heads = mO.shape[1], mO.shape[2]
        parts = mOPart.shape[0]
        head = row % heads
        query = row // heads % seqlen_q
        b = row // (heads * seqlen_q)
        first_piece = warp * self.warp_pieces + piece_lane

        values = cute.make_rmem_tensor((self.in_flight, self.per_lane, PIECE), Float32)
        # the first chunk's loads go out before the LSEs are read and reduced
        self._load_chunk(values, mOPart, parts, 0, part_lane, piece_lane, first_piece, b,
                         query, head)
        weights, inv_total, lse = self._weights(mLSEPart, parts, lane, b, head, query)
        if tid == 0:
            mLSE[b, head, query] = lse

        acc = cute.make_rmem_tensor((self.per_lane, PIECE), Float32)
        acc.fill(0.0)
        for c in cutlass.range_constexpr(-(-MAX_SPLITS // self.chunk)):
            if self.chunk * c < parts:
                if cutlass.const_expr(c > 0):
                    self._load_chunk(values, mOPart, parts, self.chunk * c, part_lane,
                                     piece_lane, first_piece, b, query, head)
                for u in cutlass.range_constexpr(self.in_flight):
                    # part chunk · c + s + 4 u: in LSE slot (chunk · c + 4 u) // 32
                    # of lane s + 4 u % 32
                    offset = self.chunk * c + PART_LANES * u
                    weight = cute.arch.shuffle_sync(weights[offset // 32],
                                                    part_lane + offset % 32) * inv_total
                    for k in cutlass.range_constexpr(self.per_lane):
                        acc[k, None].store(acc[k, None].load() + weight * values[u, k, None].load())

        # the part lanes' sums of each piece, in a fixed order
        for k in cutlass.range_constexpr(self.per_lane):
            for j in cutlass.range_constexpr(PIECE):
                for step in (PIECE_LANES, 2 * PIECE_LANES):
                    acc[k, j] = acc[k, j] + cute.arch.shuffle_sync_bfly(acc[k, j], offset=step)
        if part_lane == 0:
            dst_row = mO[b, query, head, None]
            for k in cutlass.range_constexpr(self.per_lane):
                if self._owns_piece(piece_lane, k, first_piece):
                    dst = cute.local_tile(dst_row, (PIECE,), (first_piece + PIECE_LANES * k,))
                    dst.store(acc[k, None].load().to(self.dtype))

    @cute.jit
    def _weights(self, mLSEPart: cute.Tensor, parts: Int32, lane: Int32, b: Int32,
                 head: Int32, query: Int32):
        """(exp(lse_p - top) of parts lane, lane + 32, ... in the warp's
        registers, 1 / their sum over all parts, the row's LSE); a row no part
        saw a key of gets weights 0 and LSE -inf."""
        slots = MAX_SPLITS // 32
        weights = cute.make_rmem_tensor((slots,), Float32)
        top = -Float32.inf
        for i in cutlass.range_constexpr(slots):
            weights[i] = -Float32.inf
            if lane + 32 * i < parts:
                weights[i] = mLSEPart[lane + 32 * i, b, head, query]
            top = cute.arch.fmax(top, weights[i])
        top = cute.arch.warp_reduction_max(top)
        if top == -Float32.inf:  # weigh against 0, not -inf
            top = Float32(0.0)
        total = Float32(0.0)
        for i in cutlass.range_constexpr(slots):
            weights[i] = cute.math.exp2((weights[i] - top) * LOG2_E, fastmath=True)
            total += weights[i]
        total = cute.arch.warp_reduction_sum(total)
        inv_total = Float32(0.0)
        lse = -Float32.inf
        if total > Float32(0.0):
            inv_total = cute.arch.rcp_approx(total)
            lse = top + cute.math.log2(total, fastmath=True) * LN2
        return weights, inv_total, lse

    def _owns_piece(self, piece_lane: Int32, k: int, first_piece: Int32):
        """Whether the lane's k-th piece lies in its warp's slice and the row."""
        if self.slices_even:
            return True
        return ((piece_lane + PIECE_LANES * k < self.warp_pieces)
                & (first_piece + PIECE_LANES * k < self.pieces))

    @cute.jit
    def _load_chunk(self, values: cute.Tensor, mOPart: cute.Tensor, parts: Int32,
                    first: cutlass.Constexpr[int], part_lane: Int32, piece_lane: Int32,
                    first_piece: Int32, b: Int32, query: Int32, head: Int32):
        """The lane's parts first + s + 4 u of the row at its pieces into
        values[u], zeros past the last part (their weights are 0)."""
        values.fill(0.0)
        for u in cutlass.range_constexpr(self.in_flight):
            part = first + part_lane + PART_LANES * u
            if part < parts:
                src_row = mOPart[part, b, query, head, None]
                for k in cutlass.range_constexpr(self.per_lane):
                    if self._owns_piece(piece_lane, k, first_piece):
                        values[u, k, None].store(cute.local_tile(
                            src_row, (PIECE,), (first_piece + PIECE_LANES * k,)).load())
