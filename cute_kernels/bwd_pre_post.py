"""The small kernels around the backward main kernel (bwd_sm90.py).

Preprocess, one row (query, head, batch) per 8 threads, which take its
16-byte pieces in turn so every load and store instruction covers whole
sectors (an H200, d=128 2k: 0.067 ms; 0.091 with a contiguous chunk per
lane, half a sector per instruction; fa4's 0.081):
    D    = rowsum(dO ∘ O) − dLSE     (dLSE: gradient flowing into the LSE output, if any)
    LSE₂ = LSE · log2(e)             (+inf for rows with no visible key and for padding,
                                      so exp2(s·scale_log2 − LSE₂) is 0 there, never NaN)
    dQ accumulator rows zeroed (not with BwdConfig.dq_first_store, whose
        tiles' first partials are stored: dq_accum.py)
    with a learnable sink (Features.sink): each warp's share of
        dsink[h] = −Σ_rows exp(sink[h] − LSE) · D
    (the sink's probability times D: its column has no value, so dO·V
    drops out), one partial per warp that torch sums (a fixed order, so
    deterministic)
    the main kernel's tile counter zeroed (BwdConfig.dynamic_tiles: the
    semaphore's first element; harmless otherwise)
    with BwdConfig.convert_dq or dq_first_store, not deterministic: the
    query tiles' slots zeroed (dq_accum.tile_slot); with convert_dq, dQ
    rows with no visible key (LSE -inf) written as zeros: no key block
    completes their tiles (dq_convert.py)
Both per-row vectors are padded to whole query tiles, so the main kernel's
TMA loads of them never leave the buffer (in a packed batch, each sequence's
rows are: varlen.py). A packed batch's grid covers those buffers' rows,
each CTA finding its sequence (Seqlens.sequence_at_padded_row): a grid of
the longest sequence's rows for every sequence is mostly idle CTAs.

Postprocess, one CTA per (query tile, head, batch), same threads as the
main kernel's consumers: dQ = scale · accumulator, converted to 16 bits.
It reads the accumulator in its register-order layout (dq_accum.py), whose
values each warpgroup holds as its slice of the main kernel's dQ tiled MMA,
writes them to shared memory with stmatrix and the tile to dQ with one TMA
store (a packed sequence's partial last tile row by row; 4-byte stores
straight from registers fill half a sector each: at 16k tokens, d=128, the
kernel took 96 µs where fa4's takes 68). With BwdConfig.dq_first_store a
tile no key block wrote is read as zeros (its rows see no key).

Group sum, after a split_gqa main kernel (BwdConfig.split_gqa), one row
(key, KV head, batch) per 8 threads: dK and dV = the fp32 partials of the
group's query heads added in head order (so the result is deterministic),
converted to 16 bits. One launch reads each partial once; summing in torch
took three launches and wrote and re-read an fp32 intermediate.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from . import dq_accum, wgmma
from .bwd_partition import dq_gemm_shape, dq_tiled_mma
from .config import WARPGROUP_THREADS, WGMMA_M
from .bwd_config import BwdConfig
from .kernel_base import SMEM_ALIGN, permute, store_rows, tma_store_tile
from .varlen import Seqlens

LOG2_E = math.log2(math.e)
LANES_PER_ROW = 8
PRE_THREADS = 128
ROWS_PER_CTA = PRE_THREADS // LANES_PER_ROW


def _query_seqlens(varlen: bool, mCuSeqlensQ, mSeqUsedQ, seqused, seqlen) -> Seqlens:
    """The query side of varlen.Seqlens (the key side is never read here)."""
    return Seqlens(varlen, mCuSeqlensQ, mCuSeqlensQ, mSeqUsedQ, mSeqUsedQ, seqused, seqlen,
                   seqlen)


class BackwardPreprocess:
    def __init__(self, dtype, head_dim: int, has_grad_lse: bool, config: BwdConfig,
                 varlen: bool = False, sink: bool = False):
        """config: the main kernel's."""
        self.dtype = dtype
        self.head_dim = head_dim
        self.has_grad_lse = has_grad_lse
        self.tile_m = config.tile_m  # the per-row buffers hold whole tiles
        self.varlen = varlen
        self.sink = sink
        self.convert_dq = config.convert_dq
        self.first_store = config.dq_first_store  # nothing to zero
        # packed: a CTA per 16 rows of the per-row buffers, not per 16 rows of
        # the longest sequence for every sequence (most of those CTAs had no
        # rows); a sink's gradient keeps the latter, one partial per CTA
        self.flat_rows = varlen and not sink
        # the tiles' slots of convert_dq's counts or first_store's claims: zeroed here
        self.zero_slots = ((config.convert_dq or config.dq_first_store)
                           and not config.deterministic)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mdLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
                 mdQaccum: cute.Tensor, mdQ: cute.Tensor, mSemaphore: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor,
                 mSeqUsedQ: cute.Tensor, mSink: cute.Tensor, mSinkGrad: cute.Tensor,
                 seqused: cutlass.Int32, max_seqlen_q: cutlass.Int32, stream: cuda.CUstream):
        """O, dO (b, s, h, d); LSE, dLSE (b, h, s) fp32 (dLSE ignored unless
        has_grad_lse); LSE₂, D (b, h, s_pad) fp32; dQ accumulator (b, h, s_pad·d);
        dQ (b, s, h, d) (written only with convert_dq); the main kernel's
        semaphore, int32 (its first element is zeroed; with zero_slots,
        (b, h, 1 + s_pad / tile_m): the tiles' slots too).
        Varlen: packed as the main kernel's, with its cu_seqlens_q, seqused_q
        and seqused bits; max_seqlen_q: the longest sequence (dense: s).
        With a sink: the sinks (1, 1, h) fp32 and the gradient's partials
        (sequences, h, warps: 4 per CTA of the grid's first mode), fp32,
        each written by one warp; otherwise neither is read."""
        seqlens = _query_seqlens(self.varlen, mCuSeqlensQ, mSeqUsedQ, seqused, mO.shape[1])
        if cutlass.const_expr(self.flat_rows):
            grid = (cute.ceil_div(mLSE2.shape[2], ROWS_PER_CTA), mLSE2.shape[1], 1)
        else:
            padded_rows = cute.ceil_div(max_seqlen_q, self.tile_m) * self.tile_m
            grid = (cute.ceil_div(padded_rows, ROWS_PER_CTA), mLSE2.shape[1],
                    seqlens.num_batch(mLSE2.shape[0]))
        self.kernel(mO, mdO, mLSE, mdLSE, mLSE2, mD, mdQaccum, mdQ, mSemaphore, mSink,
                    mSinkGrad, seqlens).launch(
            grid=list(grid), block=[PRE_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor,
               mLSE2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdQ: cute.Tensor,
               mSemaphore: cute.Tensor, mSink: cute.Tensor, mSinkGrad: cute.Tensor,
               seqlens: Seqlens):
        tid = cute.arch.thread_idx()[0]
        row_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.flat_rows):
            first_row = row_block * ROWS_PER_CTA  # a tile's rows are one sequence's
            batch = seqlens.sequence_at_padded_row(first_row, self.tile_m)
            row_block = (first_row - seqlens.padded_start_q(batch, self.tile_m)) // ROWS_PER_CTA
        sequence = batch
        if (row_block | head | batch | tid) == 0:
            mSemaphore[0, 0, 0] = cutlass.Int32(0)  # the tile counter (dynamic_tiles)
        row = row_block * ROWS_PER_CTA + tid // LANES_PER_ROW
        lane = tid % LANES_PER_ROW
        seqlen = seqlens.len_q(batch)
        padded = cute.ceil_div(seqlen, self.tile_m) * self.tile_m
        start = seqlens.start_q(batch)
        stats_row = seqlens.padded_start_q(batch, self.tile_m) + row
        batch = seqlens.buffer_batch(batch)

        # A row's lanes take 16-byte pieces in turn (lane, lane + 8, ...), so
        # each load and store instruction covers whole 32-byte sectors; with
        # one contiguous chunk per lane each covered half a sector.
        dot = Float32(0.0)
        if row < seqlen:
            o, pieces = interleaved_pieces(mO[batch, start + row, head, None], lane)
            do, _ = interleaved_pieces(mdO[batch, start + row, head, None], lane)
            for i in cutlass.range_constexpr(cute.size(o, mode=[1])):
                if lane + LANES_PER_ROW * i < pieces:
                    prod = o[None, i].load().to(Float32) * do[None, i].load().to(Float32)
                    dot += prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        dot = cute.arch.warp_reduction_sum(dot, threads_in_group=LANES_PER_ROW)
        if cutlass.const_expr(self.sink):
            self._sink_grad(mLSE, mdLSE, mSink, mSinkGrad, dot, row, seqlen, start, head,
                            batch, sequence, row_block, tid)
        if row < padded:
            if lane == 0:
                lse2 = Float32.inf
                dsum = Float32(0.0)
                if row < seqlen:
                    lse = mLSE[batch, head, start + row]
                    if lse != -Float32.inf:
                        lse2 = lse * LOG2_E
                    dsum = dot
                    if cutlass.const_expr(self.has_grad_lse):
                        dsum = dot - mdLSE[batch, head, start + row]
                mLSE2[batch, head, stats_row] = lse2
                mD[batch, head, stats_row] = dsum
            if cutlass.const_expr(not self.first_store):
                acc_row = cute.local_tile(mdQaccum[batch, head, None], (self.head_dim,),
                                          (stats_row,))
                zeros, pieces = interleaved_pieces(acc_row, lane)
                for i in cutlass.range_constexpr(cute.size(zeros, mode=[1])):
                    if lane + LANES_PER_ROW * i < pieces:
                        zeros[None, i].fill(0.0)
            if cutlass.const_expr(self.zero_slots):
                if stats_row % self.tile_m == 0 and lane == 0:
                    slot = dq_accum.slot_index(stats_row // self.tile_m)
                    mSemaphore[batch, head, slot] = cutlass.Int32(dq_accum.UNTOUCHED)
        if cutlass.const_expr(self.convert_dq):
            if row < seqlen:
                if mLSE[batch, head, start + row] == -Float32.inf:
                    dq_zeros, pieces = interleaved_pieces(mdQ[batch, start + row, head, None],
                                                          lane)
                    for i in cutlass.range_constexpr(cute.size(dq_zeros, mode=[1])):
                        if lane + LANES_PER_ROW * i < pieces:
                            dq_zeros[None, i].fill(0.0)


    @cute.jit
    def _sink_grad(self, mLSE: cute.Tensor, mdLSE: cute.Tensor, mSink: cute.Tensor,
                   mSinkGrad: cute.Tensor, dot: Float32, row, seqlen, start, head, batch,
                   sequence, row_block, tid):
        """This warp's partial of dsink[head]: −exp(sink − LSE)·D over its rows
        (one lane per row holds a term; every lane takes part in the sum)."""
        term = Float32(0.0)
        if row < seqlen and tid % LANES_PER_ROW == 0:
            lse = mLSE[batch, head, start + row]
            dsum = dot
            if cutlass.const_expr(self.has_grad_lse):
                dsum = dot - mdLSE[batch, head, start + row]
            if lse != -Float32.inf:  # (a sink of -inf: no sink)
                term = -cute.math.exp2((mSink[0, 0, head] - lse) * LOG2_E,
                                       fastmath=True) * dsum
        term = cute.arch.warp_reduction_sum(term)
        if tid % 32 == 0:
            warps = PRE_THREADS // 32
            mSinkGrad[sequence, head, row_block * warps + tid // 32] = term


def interleaved_pieces(row: cute.Tensor, lane) -> tuple[cute.Tensor, int]:
    """(elements of a 16-byte piece, round) view of a contiguous row's pieces
    lane, lane + LANES_PER_ROW, ..., and the row's piece count: the last
    round may run past the row (d=96: 12 pieces of bf16), so a round is
    used where lane + LANES_PER_ROW · round < pieces (for whole rounds
    LLVM folds the test away: lane < LANES_PER_ROW)."""
    vec = 128 // row.element_type.width
    pieces = cute.size(row) // vec
    rounds = -(-pieces // LANES_PER_ROW)
    view = cute.make_tensor(row.iterator, cute.make_layout(
        (vec, LANES_PER_ROW, rounds), stride=(1, vec, vec * LANES_PER_ROW)))
    return view[None, lane, None], pieces


class BackwardPostprocess:
    def __init__(self, dtype, head_dim: int, config: BwdConfig, varlen: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        self.cfg = config
        self.varlen = varlen

    def _slab_shape(self) -> tuple[int, int]:
        """The (rows, cols) of the dQ tile one warpgroup holds (dq_tiled_mma):
        64 rows each when the warpgroups split the rows, else all rows and
        head_dim / warpgroups columns each (dQ transposed: 64 each)."""
        if self.cfg.dq_split_m():
            return WGMMA_M, self.head_dim
        return self.cfg.tile_m, self.head_dim // self.cfg.dq_warpgroups

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mSemaphore: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mSeqUsedQ: cute.Tensor, softmax_scale: Float32,
                 seqused: cutlass.Int32, max_seqlen_q: cutlass.Int32, stream: cuda.CUstream):
        """dQ accumulator (b, h, s_pad·d) fp32 -> dQ (b, s, h, d); the main
        kernel's semaphore (read with dq_first_store only); varlen as the
        preprocess."""
        tile_m, d = self.cfg.tile_m, self.head_dim
        seqlens = _query_seqlens(self.varlen, mCuSeqlensQ, mSeqUsedQ, seqused, mdQ.shape[1])
        grid = (cute.ceil_div(max_seqlen_q, tile_m), mdQ.shape[2],
                seqlens.num_batch(mdQ.shape[0]))
        # one swizzle atom per warpgroup slab, so each slab is a plain sub-tile
        sdQ_layout = wgmma.smem_layout(self.dtype, tile_m, d, atom_cols=self._slab_shape()[1])
        tma_dq, tdQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), permute(mdQ, [1, 3, 2, 0]), sdQ_layout,
            (tile_m, d))

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdQ_layout)],
                                   SMEM_ALIGN]

        mma = dq_tiled_mma(self.dtype, self.cfg, d)
        self.kernel(mdQaccum, tdQ, permute(mdQ, [1, 3, 2, 0]), permute(mSemaphore, [2, 1, 0]),
                    seqlens, tma_dq, softmax_scale, mma, sdQ_layout, SharedStorage).launch(
            grid=list(grid), block=[self.cfg.dq_warpgroups * WARPGROUP_THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mdQ_rows: cute.Tensor,
               mSemaphore: cute.Tensor, seqlens: Seqlens, tma_dq: cute.CopyAtom,
               softmax_scale: Float32, mma: cute.TiledMma, sdQ_layout: cute.ComposedLayout,
               SharedStorage: cutlass.Constexpr):
        m_block, head, batch = cute.arch.block_idx()
        rows_out = seqlens.len_q(batch) - m_block * self.cfg.tile_m
        if rows_out > 0:  # a packed batch's grid covers its longest sequence
            self._tile(mdQaccum, mdQ, mdQ_rows, mSemaphore, seqlens, tma_dq, softmax_scale, mma,
                       sdQ_layout, SharedStorage, m_block, head, batch, rows_out)

    @cute.jit
    def _tile(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mdQ_rows: cute.Tensor,
              mSemaphore: cute.Tensor, seqlens: Seqlens, tma_dq: cute.CopyAtom,
              softmax_scale: Float32,
              mma: cute.TiledMma, sdQ_layout: cute.ComposedLayout,
              SharedStorage: cutlass.Constexpr, m_block, head, batch, rows_out):
        tid = cute.arch.thread_idx()[0]
        tile_m, d, wgs = self.cfg.tile_m, self.head_dim, self.cfg.dq_warpgroups
        wg = cute.arch.make_warp_uniform(tid // WARPGROUP_THREADS)
        storage = SmemAllocator().allocate(SharedStorage)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)

        first_row = seqlens.padded_start_q(batch, tile_m) + m_block * tile_m
        buffer_batch = seqlens.buffer_batch(batch)
        tile = mdQaccum[buffer_batch, head, None].iterator + first_row * d
        src = dq_accum.thread_view(tile, wg, tid % WARPGROUP_THREADS, tile_m, d, wgs)
        values = cute.make_rmem_tensor(src.shape, Float32)
        cute.autovec_copy(src, values)
        if cutlass.const_expr(self.cfg.dq_first_store):
            # a tile no key block walked was never written: its rows see no key
            if not self._written(mSemaphore, first_row // tile_m, head, buffer_batch):
                values.fill(0.0)
        for j in cutlass.range(cute.size(values), unroll_full=True):
            values[j] = values[j] * softmax_scale
        values_16bit = cute.make_rmem_tensor(values.shape, self.dtype)
        wgmma.convert_to_16bit(values, values_16bit)
        # values are in accumulator register order: view them with its shape
        acc_shape = mma.partition_shape_C(dq_gemm_shape(self.cfg, d))
        acc_shaped = cute.make_tensor(values_16bit.iterator, cute.make_layout(acc_shape))
        slab_coord = (wg, 0) if cutlass.const_expr(self.cfg.dq_split_m()) else (0, wg)
        slab = cute.local_tile(sdQ, self._slab_shape(), slab_coord)
        transposed = self.cfg.dq_transposed()
        if cutlass.const_expr(transposed):  # the warpgroup holds (head_dim slice, rows)
            slab = wgmma.transpose_view(slab)
        wgmma.stmatrix_store(self.dtype, acc_shaped, slab, tid % WARPGROUP_THREADS,
                             transpose=transposed)
        # stmatrix writes go through the generic proxy; TMA reads through the async one.
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        by_rows = cutlass.Boolean(False)
        if cutlass.const_expr(self.varlen):
            by_rows = rows_out < tile_m
        if by_rows:
            store_rows(sdQ, cute.local_tile(seqlens.q_rows(mdQ_rows, head, batch), (tile_m, d),
                                            (m_block, 0)),
                       rows_out, tid, wgs * WARPGROUP_THREADS)
        elif tid < 32:  # TMA clips the rows past the tensor's end
            tma_store_tile(tma_dq, sdQ, cute.local_tile(seqlens.q_rows(mdQ, head, batch),
                                                        (tile_m, d), (m_block, 0)))
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


    @cute.jit
    def _written(self, mSemaphore: cute.Tensor, tile_index, head, buffer_batch) -> cutlass.Boolean:
        """Whether a key block stored the tile's first partial (first touch):
        its slot, or with the deterministic order its first warpgroup's
        turns."""
        if cutlass.const_expr(self.cfg.deterministic):
            turns = dq_accum.turn_index(tile_index, 0, self.cfg.dq_warpgroups)
            written = mSemaphore[turns, head, buffer_batch] > 0
        else:
            written = mSemaphore[dq_accum.slot_index(tile_index), head,
                                 buffer_batch] == dq_accum.WRITTEN
        return written


class GroupSum:
    def __init__(self, dtype, head_dim: int, head_dim_v: int | None = None):
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v

    @cute.jit
    def __call__(self, mdKpart: cute.Tensor, mdVpart: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, stream: cuda.CUstream):
        """dK, dV partials (b, s_k, h_q, d / dv) fp32 -> dK, dV (b, s_k, h_kv, d / dv)."""
        grid = (cute.ceil_div(mdK.shape[1], ROWS_PER_CTA), mdK.shape[2], mdK.shape[0])
        self.kernel(mdKpart, mdVpart, mdK, mdV).launch(
            grid=list(grid), block=[PRE_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdKpart: cute.Tensor, mdVpart: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor):
        tid = cute.arch.thread_idx()[0]
        row_block, head_kv, batch = cute.arch.block_idx()
        row = row_block * ROWS_PER_CTA + tid // LANES_PER_ROW
        lane = tid % LANES_PER_ROW
        group = mdKpart.shape[2] // mdK.shape[2]
        if row < mdK.shape[1]:
            for partials, out, dim in ((mdKpart, mdK, self.head_dim),
                                       (mdVpart, mdV, self.head_dim_v)):
                chunk = dim // LANES_PER_ROW
                total = cute.make_rmem_tensor((chunk,), Float32)
                total.fill(0.0)
                for g in cutlass.range(group):
                    part = cute.local_tile(partials[batch, row, head_kv * group + g, None],
                                           (chunk,), (lane,))
                    total.store(total.load() + part.load())
                dst = cute.local_tile(out[batch, row, head_kv, None], (chunk,), (lane,))
                dst.store(total.load().to(self.dtype))
