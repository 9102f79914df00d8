"""The forward kernel's epilogue (fwd_sm90.FlashAttentionForwardSm90 mixes it
in): O from the consumer warpgroups' registers to the output through a
shared-memory slab and a TMA store, or row by row at a packed sequence's
partial end; a split_kv part's rows straight to the fp32 workspaces; and
the handshakes of O staged in the V ring (o_in_v_smem) or in one slab that
the consumer warpgroups take in turn (shared_o_slab)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from . import wgmma
from .config import WARPGROUP_THREADS, WGMMA_M
from .kernel_base import store_rows, tma_store_tile
from .pipeline import NamedBarrier
from .varlen import Seqlens

if TYPE_CHECKING:
    from .fwd_sm90 import Work


class ForwardEpilogue:
    """The epilogue methods; the kernel class supplies cfg, features, tile_m,
    head_dim_v, out_dtype, consumer_wgs, consumer_threads, streams (tile
    streams a CTA, FwdConfig.concurrent_tiles) and _o_slabs_per_bank.
    Their `wg` is the warpgroup among the CTA's consumers, `tid` the thread
    within its tile."""

    @cute.jit
    def _store_partial(self, acc_o: cute.Tensor, lse: cute.Tensor, tiled_mma_pv: cute.TiledMma,
                       mO_part: cute.Tensor, mLSE_part: cute.Tensor, tid: Int32, work: Work,
                       seqlens: Seqlens, dense_batch: Int32):
        """A split_kv part's rows, straight from registers to the fp32
        workspaces: O (normalised over the part's keys) and LSE, rows past
        the sequence left out. A few rows per tile in decoding: no staging."""
        index = work.part * dense_batch + seqlens.buffer_batch(work.batch)
        if cutlass.const_expr(self.features.varlen):
            index = work.part
        start = seqlens.start_q(work.batch)
        o_rows = cute.domain_offset((start, 0), mO_part[None, None, work.head, index])
        coords = wgmma.acc_rows_cols(tiled_mma_pv.get_slice(tid).partition_C(
            cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        o = wgmma.acc_rows_cols(acc_o)
        first = work.m_block * self.tile_m
        for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
            row = first + coords[r, 0][0]
            if row < work.seqlen_q:
                for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                    o_rows[row, coords[r, c][1]] = o[r, c]
                if coords[0, 0][1] == 0:
                    mLSE_part[start + row, work.head, index] = lse[r]

    @cute.jit
    def _store_slab(self, slab: cute.Tensor, tma_o: cute.CopyAtom, out_rows: cute.Tensor,
                    row_block: Int32, rows_out: Int32, wg: Int32, is_store_warp):
        """The store warp's TMA store of this warpgroup's O slab, once the
        others' stmatrix writes are in (they arrive, it waits)."""
        if is_store_warp:
            cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE_STORE_BASE) + wg,
                              number_of_threads=WARPGROUP_THREADS)
            if rows_out > 0:  # TMA clips the rows past the tensor's end
                tma_store_tile(tma_o, slab, cute.local_tile(out_rows, (WGMMA_M, self.head_dim_v),
                                                            (row_block, 0)))
            cute.arch.cp_async_bulk_commit_group()
        else:
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.EPILOGUE_STORE_BASE) + wg,
                                     number_of_threads=WARPGROUP_THREADS)

    @cute.jit
    def _o_staging_free(self, wg: Int32):
        """With O staged in the V ring: every consumer warpgroup's last P·V
        has completed before any of them writes O over the V stages it read
        (with several tile streams: the tile's one warpgroup, over its bank,
        on the barrier its epilogue leaves unused with O in V)."""
        if cutlass.const_expr(self.cfg.o_in_v_smem):
            if cutlass.const_expr(self.streams > 1):
                cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE_BASE) + wg,
                                  number_of_threads=WARPGROUP_THREADS)
            else:
                cute.arch.barrier(barrier_id=int(NamedBarrier.O_IN_V),
                                  number_of_threads=self.consumer_threads)

    @cute.jit
    def _o_left(self, o_read: cute.Pointer, tid: Int32):
        """With O staged in the V ring: this warpgroup's O store (if any) has
        read its slab, so the producer may load V there again; one arrival
        per warpgroup and tile, from its store warp."""
        if cutlass.const_expr(self.cfg.o_in_v_smem):
            if tid % WARPGROUP_THREADS < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.sync_warp()  # the lane that issued the store has waited
                if tid % WARPGROUP_THREADS == 0:
                    cute.arch.mbarrier_arrive(o_read)

    @property
    def _slab_turns(self) -> bool:
        """The consumer warpgroups take turns on one O slab (shared_o_slab;
        with one warpgroup the slab is simply its own)."""
        return self.cfg.shared_o_slab and self.consumer_wgs > 1

    @cute.jit
    def _start_slab_turns(self, wg: Int32, tid: Int32):
        """Warpgroup 0 holds the shared slab first: the last warpgroup's first
        warp arrives on its barrier, as if handing it over."""
        if cutlass.const_expr(self._slab_turns):
            if wg == self.consumer_wgs - 1 and tid % WARPGROUP_THREADS < 32:
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.SLAB_TURN_BASE),
                                         number_of_threads=WARPGROUP_THREADS + 32)

    @cute.jit
    def _wait_slab_turn(self, wg: Int32):
        """This warpgroup's turn on the shared slab: the previous holder's store
        has read it out."""
        if cutlass.const_expr(self._slab_turns):
            cute.arch.barrier(barrier_id=int(NamedBarrier.SLAB_TURN_BASE) + wg,
                              number_of_threads=WARPGROUP_THREADS + 32)

    @cute.jit
    def _pass_slab_turn(self, wg: Int32, tid: Int32):
        """Hands the shared slab to the next warpgroup once this one's store
        (if it issued one) has read it out; the first warp arrives."""
        if cutlass.const_expr(self._slab_turns):
            if tid % WARPGROUP_THREADS < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.sync_warp()  # the lane that issued the store has waited
                cute.arch.barrier_arrive(
                    barrier_id=int(NamedBarrier.SLAB_TURN_BASE) + (wg + 1) % self.consumer_wgs,
                    number_of_threads=WARPGROUP_THREADS + 32)

    @cute.jit
    def _skip_o_store(self, o_read: cute.Pointer, wg: Int32, tid: Int32):
        """A warpgroup that writes no O this tile (a split tile's earlier part)
        keeps the handshakes of the staging it does not use."""
        self._o_left(o_read, tid)
        self._wait_slab_turn(wg)
        self._pass_slab_turn(wg, tid)

    @cute.jit
    def epilogue(self, acc_o: cute.Tensor, lse: cute.Tensor, tiled_mma_pv: cute.TiledMma,
                 mO: cute.Tensor, mO_rows: cute.Tensor, mLSE: cute.Tensor, sO: cute.Tensor,
                 tma_o: cute.CopyAtom, wg: Int32, tid: Int32, work: Work, seqlens: Seqlens,
                 o_read: cute.Pointer):
        """O (registers) -> this warpgroup's smem slab -> TMA store; LSE -> global.
        A packed sequence's last, partial slab is stored row by row instead
        (kernel_base.store_rows), by the whole warpgroup.

        A slab of its own: the slab's previous store is awaited here, not
        right after issuing it, so the store drains while the next tile's
        main loop runs. A slab in the V ring: awaited right after (_o_left),
        as the producer's next V load waits for it."""
        m_block, head, batch, seqlen_q = work.m_block, work.head, work.batch, work.seqlen_q
        r_o = cute.make_rmem_tensor_like(acc_o, self.out_dtype)
        wgmma.convert_to_16bit(acc_o, r_o)
        if cutlass.const_expr(self.streams > 1):
            # the thread within its tile's one warpgroup, read again here
            # rather than held through the main loop
            tid = Int32(cute.arch.thread_idx()[0]) & (WARPGROUP_THREADS - 1)
        if cutlass.const_expr(self.cfg.rederive_epilogue_coords):
            # An opaque copy of the thread index (a shuffle from its own
            # lane): what derives from it (stmatrix addresses, LSE rows) is
            # then computed here, not hoisted by LLVM out of the persistent
            # tile loop into registers held through every main-loop step.
            tid = cute.arch.shuffle_sync(tid, cute.arch.lane_idx())
        wg_tid = tid % WARPGROUP_THREADS
        is_store_warp = wg_tid < 32
        if cutlass.const_expr(self._slab_turns):
            self._wait_slab_turn(wg)
        elif cutlass.const_expr(not self.cfg.o_in_v_smem):
            if is_store_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE_BASE) + wg,
                              number_of_threads=WARPGROUP_THREADS)
        slab_index = wg
        if cutlass.const_expr(self.cfg.shared_o_slab):
            slab_index = 0
        elif cutlass.const_expr(self.cfg.o_in_v_smem and self.streams > 1):
            slab_index = wg * self._o_slabs_per_bank  # the first of its stream's V bank
        slab = sO[None, None, slab_index]
        wgmma.stmatrix_store(self.out_dtype, r_o, slab, wg_tid)
        # stmatrix writes go through the generic proxy; TMA reads through the async one.
        cute.arch.fence_view_async_shared()

        # LSE: the thread holding column 0 of a row writes it.
        o_coords = tiled_mma_pv.get_slice(tid).partition_C(
            cute.make_identity_tensor((self.tile_m, self.head_dim_v)))
        rows = wgmma.acc_rows_cols(o_coords)
        if rows[0, 0][1] == 0:
            first_row = seqlens.start_q(batch) + m_block * self.tile_m
            for r in cutlass.range_constexpr(cute.size(rows, mode=[0])):
                if m_block * self.tile_m + rows[r, 0][0] < seqlen_q:
                    mLSE[first_row + rows[r, 0][0], head, seqlens.buffer_batch(batch)] = lse[r]

        row_block = m_block * self.consumer_wgs + wg
        if cutlass.const_expr(self.streams > 1):
            row_block = m_block  # one warpgroup a tile
        rows_out = seqlen_q - row_block * WGMMA_M
        out_rows = seqlens.q_rows(mO, head, batch)
        if cutlass.const_expr(self.features.varlen):
            if rows_out > 0 and rows_out < WGMMA_M:
                cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE_STORE_BASE) + wg,
                                  number_of_threads=WARPGROUP_THREADS)
                store_rows(slab, cute.local_tile(seqlens.q_rows(mO_rows, head, batch),
                                                 (WGMMA_M, self.head_dim_v), (row_block, 0)),
                           rows_out, wg_tid, WARPGROUP_THREADS)
                if cutlass.const_expr(self.cfg.o_in_v_smem or self._slab_turns):
                    # every thread's reads of the slab are done before V (or the
                    # next warpgroup's O) may be written over it
                    cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE_STORE_BASE) + wg,
                                      number_of_threads=WARPGROUP_THREADS)
            else:
                self._store_slab(slab, tma_o, out_rows, row_block, rows_out, wg, is_store_warp)
        else:
            self._store_slab(slab, tma_o, out_rows, row_block, rows_out, wg, is_store_warp)
        self._o_left(o_read, tid)
        self._pass_slab_turn(wg, tid)
