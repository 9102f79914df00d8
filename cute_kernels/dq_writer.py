"""The backward's dQ writer warp, and the handoff of dQ partials to it.

Each step, every consumer warpgroup that computes dQ (BwdConfig.dq_warpgroups)
stages its partial in a shared-memory slab of its own (stage) and goes on;
warp 1 of the producer warpgroup adds the slab into the fp32 accumulator with
one bulk reduce-add (dq_accum.py) and frees it. Two named barriers a slab
order the handoff: DQ_FULL (the consumer's stores are done) and DQ_EMPTY
(the bulk read of the slab is done). The writer walks the same tiles and
query blocks as the consumers (bwd_tiles.KeyTiles), so each slab's
destination is known without a message. In deterministic mode the adds into
one query tile follow the key blocks' order (a semaphore per tile and
warpgroup). With BwdConfig.dq_first_store a tile's first partial is
stored, not added (dq_accum.py, first touch), so nothing zeroes the
accumulator. With BwdConfig.dq_direct the consumers add dQ from registers
and the warp only frees claimed tiles' K/V. With BwdConfig.convert_dq it
counts each completed add on the query tile's counter and sends the tile
its add completes to the converter warps (dq_convert.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from . import dq_accum
from .bwd_tiles import KeyTile, KeyTiles
from .config import WARPGROUP_THREADS
from .dsl_struct import DslStruct
from .mask import BlockRange, Limits
from .pipeline import DQ_HANDOFF_THREADS, BwdBarrier, consumer_state


@dataclass
class DqWriter(DslStruct):
    """The dQ handoff of one backward kernel (its BwdConfig's choices)."""

    tile_m: int
    tile_n: int
    head_dim: int
    warpgroups: int  # BwdConfig.dq_warpgroups: the slabs a step
    direct: bool  # BwdConfig.dq_direct: no slabs, the consumers add dQ
    deterministic: bool
    dynamic_tiles: bool
    first_store: bool  # BwdConfig.dq_first_store
    converter: object  # DqConverter with BwdConfig.convert_dq, else None

    @staticmethod
    def of(config, tile_m: int, tile_n: int, head_dim: int, converter=None) -> "DqWriter":
        return DqWriter(tile_m, tile_n, head_dim, config.dq_warpgroups, config.dq_direct,
                        config.deterministic, config.dynamic_tiles, config.dq_first_store,
                        converter)

    @cute.jit
    def stage(self, acc_dq: cute.Tensor, sdQ: cute.Tensor, wg: Int32, tid: Int32):
        """A consumer warpgroup's side: its dQ partial into its slab, handed
        to the writer warp."""
        cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_EMPTY_BASE) + wg,
                          number_of_threads=DQ_HANDOFF_THREADS)
        cute.autovec_copy(dq_accum.register_view(acc_dq),
                          dq_accum.thread_view(sdQ.iterator, wg, tid % WARPGROUP_THREADS,
                                               self.tile_m, self.head_dim, self.warpgroups))
        # generic-proxy stores, read next by the bulk copy through the async proxy
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_FULL_BASE) + wg,
                                 number_of_threads=DQ_HANDOFF_THREADS)

    @cute.jit
    def run(self, mdQaccum: cute.Tensor, mSemaphore: cute.Tensor, sdQ: cute.Tensor,
            pipe_kv, tiles: KeyTiles, limits: Limits, convert_pipe=None, convert_slots=None):
        """The writer warp: per query block and dQ warpgroup, one bulk
        reduce-add of the slab into the accumulator (lane 0 issues it). In
        deterministic mode it first waits until the key blocks before this one
        have added theirs to the same tile, and signals after its own landed.
        With a converter, the tiles its adds complete go to convert_pipe's
        slots, then the end mark."""
        lane = cute.arch.lane_idx()
        sent = Int32(0)  # tiles sent to the converter
        for w in cutlass.range_constexpr(0 if self.direct else self.warpgroups):
            # every slab starts free
            cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY_BASE) + w,
                                     number_of_threads=DQ_HANDOFF_THREADS)
        num_tiles = tiles.num_tiles()
        if cutlass.const_expr(self.dynamic_tiles):
            kv_state = consumer_state(1)
            round_idx = Int32(0)
            # the tile's index is published with K/V
            tile = tiles.sequence.received(round_idx, pipe_kv, kv_state)
            while tile < num_tiles:
                # The index is read: the producer may reuse its slot (and,
                # when no query block sees this key block, this warp cannot
                # fall two tiles behind the K/V barrier's phase).
                if lane == 0:
                    cute.arch.mbarrier_arrive(pipe_kv.sync_object_empty.get_barrier(
                        kv_state.index))
                if cutlass.const_expr(not self.direct):
                    sent = self._write_tile(mdQaccum, mSemaphore, sdQ, tiles.decode(tile), tiles,
                                            limits, convert_pipe, convert_slots, sent)
                kv_state.advance()
                round_idx += 1
                tile = tiles.sequence.received(round_idx, pipe_kv, kv_state)
        elif cutlass.const_expr(not self.direct):
            sent = self._write_tile(mdQaccum, mSemaphore, sdQ, tiles.own(num_tiles), tiles,
                                    limits, convert_pipe, convert_slots, sent)
        if cutlass.const_expr(self.converter is not None):
            self.converter.send(convert_pipe, sent, convert_slots, Int32(-1), Int32(0), Int32(0))

    @cute.jit
    def _write_tile(self, mdQaccum: cute.Tensor, mSemaphore: cute.Tensor, sdQ: cute.Tensor,
                    tile: KeyTile, tiles: KeyTiles, limits: Limits, convert_pipe, convert_slots,
                    sent):
        tile_m, d, wgs = self.tile_m, self.head_dim, self.warpgroups
        seqlens = tiles.seqlens
        seqlen_q, seqlen_k = tile.seqlen_q, tile.seqlen_k
        region = dq_accum.warpgroup_region(tile_m, d, wgs)
        lane = cute.arch.lane_idx()
        n_block, batch = tile.n_block, tile.batch
        # a packed sequence's query tiles start at its padded row (varlen.py)
        first_m_block = seqlens.padded_start_q(batch, tile_m) // tile_m
        buffer_batch = seqlens.buffer_batch(batch)
        m_min, m_count = tiles.query_blocks(n_block, seqlen_q, seqlen_k, limits)
        # the key blocks that add into a query block before this one: all
        # before it, or with a window those from its first visible one on
        key_blocks = BlockRange(tile_m, self.tile_n, limits)
        # first touch without the deterministic order: claimed per tile
        claims = self.first_store and not self.deterministic
        for h in cutlass.range(tile.head_count, unroll=1):
            head = tile.first_head + h
            walk = tiles.query_walk(tile, head, m_min, m_count)
            for i in cutlass.range(walk.count, unroll=1):
                m_block = walk.m_block(i)
                tile_index = first_m_block + m_block
                first = Int32(0)  # this partial is the tile's first: stored, not added
                seen = Int32(0)
                if cutlass.const_expr(claims):
                    if lane == 0:
                        seen = dq_accum.peek(dq_accum.tile_slot(mSemaphore, tile_index, head,
                                                                buffer_batch))
                for w in cutlass.range_constexpr(wgs):
                    cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_FULL_BASE) + w,
                                      number_of_threads=DQ_HANDOFF_THREADS)
                    if lane == 0:
                        offset = tile_index * tile_m * d + w * region
                        dst = mdQaccum.iterator + cute.crd2idx((offset, head, buffer_batch),
                                                               mdQaccum.layout)
                        src = sdQ.iterator + w * region
                        if cutlass.const_expr(self.deterministic):
                            semaphore = mSemaphore.iterator + cute.crd2idx(
                                (dq_accum.turn_index(tile_index, w, wgs), head, buffer_batch),
                                mSemaphore.layout)
                            turn = n_block - key_blocks.n_block_min(m_block, seqlen_q, seqlen_k)
                            dq_accum.wait_turn(semaphore, turn)
                            first = Int32(turn == 0)
                        elif cutlass.const_expr(claims and w == 0):
                            first = dq_accum.claim_or_wait(
                                dq_accum.tile_slot(mSemaphore, tile_index, head, buffer_batch),
                                seen)
                        dq_accum.bulk_write_f32(dst, src, region * 4, first)
                        cute.arch.cp_async_bulk_commit_group()
                        if cutlass.const_expr(self.deterministic):
                            cute.arch.cp_async_bulk_wait_group(0, read=False)
                            dq_accum.pass_turn(semaphore)
                if lane == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.sync_warp()  # the slabs are read: all lanes may release them
                for w in cutlass.range_constexpr(wgs):
                    cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY_BASE) + w,
                                             number_of_threads=DQ_HANDOFF_THREADS)
                if cutlass.const_expr(claims):
                    # the others wait for WRITTEN: published once the stores
                    # have landed, after the slabs went back to the consumers
                    if first != 0:  # set on lane 0 only
                        cute.arch.cp_async_bulk_wait_group(0, read=False)
                        dq_accum.publish(dq_accum.tile_slot(mSemaphore, tile_index, head,
                                                            buffer_batch))
                if cutlass.const_expr(self.converter is not None):
                    if self._completes(mSemaphore, tile_index, head, buffer_batch, n_block,
                                       key_blocks, m_block, seqlen_q, seqlen_k):
                        self.converter.send(convert_pipe, sent, convert_slots, m_block, head,
                                            batch)
                        sent += 1
        return sent

    @cute.jit
    def _completes(self, mSemaphore: cute.Tensor, tile_index: Int32, head: Int32,
                   buffer_batch: Int32, n_block: Int32, key_blocks: BlockRange, m_block: Int32,
                   seqlen_q: Int32, seqlen_k: Int32) -> cutlass.Boolean:
        """Whether this key block's adds, just issued, complete the query
        tile: all the key blocks that walk it (key_blocks' range) have added.
        Deterministic: this is the last turn (the adds have completed).
        Otherwise lane 0 waits for its adds, then counts them."""
        first = key_blocks.n_block_min(m_block, seqlen_q, seqlen_k)
        contributions = key_blocks.n_block_max(m_block, seqlen_q, seqlen_k) - first
        last = Int32(0)
        if cutlass.const_expr(self.deterministic):
            last = Int32(n_block - first == contributions - 1)
        elif cute.arch.lane_idx() == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            dq_accum.fence_async_global()
            # acq_rel: the last count's thread acquires every other add
            before = cute.arch.atomic_add(
                dq_accum.tile_slot(mSemaphore, tile_index, head, buffer_batch), Int32(1),
                sem="acq_rel", scope="gpu")
            last = Int32(before == contributions - 1)
        return cute.arch.shuffle_sync(last, 0) != 0
