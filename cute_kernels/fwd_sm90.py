"""FlashAttention-3 forward for Hopper (sm_90a), in the CuTe DSL.

Roles (threads = 128 · (1 + consumer_warpgroups)):
  warpgroup 0   producer: gives registers back (setmaxnreg.dec); its warp 0
                issues every TMA load: Q once per tile, then K and V blocks
                from the last one down, into `kv_stages`-deep rings; with
                dynamic_tiles it also claims the CTA's next tile and hands
                it to the consumers with that tile's Q (scheduler.TileQueue).
                e4m3 inputs: its warps 1 .. transpose_warps transpose each
                V stage into the Vᵀ ring (fp8_operands.py), following the
                V ring until warp 0 marks its end.
                With concurrent_tiles (FwdConfig) its warp s is the TMA warp
                of tile stream s, which fills bank s of each ring.
  warpgroups 1+ consumers (setmaxnreg.inc), 64 query rows each: WGMMA
                S = Q·Kᵀ (smem × smem), online softmax in registers,
                WGMMA O += P·V with P in registers, then the epilogue
                (O → smem → TMA store, LSE → global). With split_tail the
                last round's tiles come in key ranges: a warpgroup ending
                one publishes its rows, and the last to count in merges
                them before the epilogue (tail_split.py). With split_kv
                (Features) every tile comes in key ranges, each leaving
                fp32 O and LSE for split_combine.py.
                With concurrent_tiles warpgroup s runs tile stream s alone.
Pipelines: Q (q_stages), K and V (kv_stages each; with concurrent_tiles a
bank of such stages per tile stream), all TMA → consumer-thread
mbarrier rings (pipeline.py); e4m3: V feeds the transposer, whose Vᵀ ring
(kv_stages, thread → thread) feeds the consumers in V's place, P is packed
to e4m3 in registers and the descales scale the scores and O (one multiply
each); ping-pong named barriers between consumer warpgroups; epilogue named
barriers.

Main loop of one consumer warpgroup, with intra_wg_overlap (block j from
last to first):
    S_last = Q·K_lastᵀ; mask; P = softmax(S_last)
    for j in remaining blocks:           # [turn] = ping-pong wait/pass
        [turn] issue S_j = Q·K_jᵀ; issue O += P·V_{j+1} [pass]
        wait S_j; mask if on the diagonal; P' = softmax(S_j)
        wait P·V; O *= rescale; P = P'
    O += P·V_first
so the exp2/max/sum of block j run while the tensor cores work on
S_j and P·V_{j+1}, and the other warpgroup's GEMMs fill the gaps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cpipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from . import fp8_operands, head_groups, wgmma
from .block_sparse import SparseRow, SparseScoreMask
from .config import PLAIN_FEATURES, WARPGROUP_THREADS, WGMMA_M, Features
from .fwd_checks import check_forward
from .fwd_epilogue import ForwardEpilogue
from .kernel_base import (SMEM_ALIGN, Sm90AttentionKernel, mma_operand_parts_at, mma_operand_view,
                          permute, tma_views)
from .mask import BlockRange, KeyWalk, Limits, ScoreMask, Window
from .paged import KvBlocks, KvStream
from .pipeline import (NamedBarrier, PingPong, consumer_state, make_thread_pipeline,
                       make_tma_pipeline, pass_stages, producer_state, release, release_after,
                       wait_full)
from .scheduler import TileQueue, TileScheduler, TileSequence
from .softcap import FixedReference, cap_scores
from .softmax import OnlineSoftmax
from .tail_split import TailSplit
from .varlen import Seqlens, VarlenScheduler

LOG2_E = math.log2(math.e)


@dataclass
class Buffers:
    """The CTA's shared-memory tiles: Q, the K and V rings, the O slabs."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    o: cute.Tensor


@dataclass
class Pipes:
    """The TMA → consumer rings of Q, K and V; an e4m3 kernel's V ring feeds
    the transposer, whose Vᵀ ring (vt) feeds the consumers."""

    q: object
    k: object
    v: object
    vt: object = None


@dataclass
class Copies:
    """The TMA atoms: loads of Q, K, V and the store of O."""

    q: cute.CopyAtom
    k: cute.CopyAtom
    v: cute.CopyAtom
    o: cute.CopyAtom


@dataclass
class Work:
    """One unit of work: a query tile (m_block, head, batch) and the K/V
    blocks [n_lo, n_max) it visits, part `part` of its tile's `parts` (a
    constant 0 unless split_kv reads it); the lengths of its sequence."""

    m_block: Int32
    head: Int32
    batch: Int32
    n_lo: Int32
    n_max: Int32
    part: Int32
    parts: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    sparse: SparseRow | None = None  # block_sparse: the tile's list of key blocks
    first_page: Int32 | int = 0  # the producer's: KvBlocks.first_page


@dataclass
class Consumer:
    """What one consumer warpgroup keeps across its tiles: the two GEMMs and
    its operand fragments (Q and K from shared memory, P from registers, Vᵀ
    from shared memory), the O accumulator, the softmax state and its turn."""

    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma
    q: cute.Tensor | wgmma.AtomParts  # AtomParts: a tile's stage of the Q ring
    k: cute.Tensor
    p: cute.Tensor
    vt: cute.Tensor
    acc_o: cute.Tensor
    softmax: OnlineSoftmax
    o_scale: cute.Tensor  # rescale_o_before_pv: the factors O awaits before the next P·V
    pre_tanh: Float32  # softcap: scale / softcap
    pingpong: PingPong
    wg: Int32


class FlashAttentionForwardSm90(ForwardEpilogue, Sm90AttentionKernel):
    """One compiled kernel per (dtype, out_dtype, head_dim, head_dim_v, causal,
    features, config: FwdConfig). dtype is that of Q, K, V; out_dtype that
    of O (None: dtype), bf16 or fp16 where the inputs are e4m3."""

    def __init__(self, dtype, head_dim: int, causal: bool, config, head_dim_v: int | None = None,
                 features: Features = PLAIN_FEATURES, out_dtype=None):
        super().__init__(dtype, head_dim, causal, config, head_dim_v, features)
        self.fp8 = dtype is cutlass.Float8E4M3FN
        self.out_dtype = dtype if out_dtype is None else out_dtype
        check_forward(self)
        self.streams = config.concurrent_tiles

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mCounters: cute.Tensor, mPartials: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedQ: cute.Tensor,
                 mSeqUsedK: cute.Tensor, mSink: cute.Tensor, mPageTable: cute.Tensor,
                 mDescaleQ: cute.Tensor, mDescaleK: cute.Tensor, mDescaleV: cute.Tensor,
                 mBlockSparse: cute.Tensor, softmax_scale_log2: Float32, num_sms: Int32,
                 full_tiles: Int32, tail_parts: Int32, window_left: Int32,
                 window_right: Int32, score_pre_tanh: Float32, seqused: Int32,
                 stream: cuda.CUstream):
        """Tensors in torch order: Q, O (b, s_q, h, d); K, V (b, s_k, h_kv, d);
        LSE (b, h, s_q) fp32; a varlen kernel's are packed batches of one,
        (1, total, h, d) and (1, h, total_q) (heads_in_rows: LSE (parts · b,
        h, s_q), head_groups.py), with cu_seqlens (1, 1, b + 1)
        int32 and, as the seqused bits say (varlen.SEQUSED_Q, _K), the
        seqused lengths (1, 1, b) int32; other kernels never read those four.
        A sink kernel's learnable sinks, (1, 1, h) fp32 (others never read it).
        A paged_kv kernel's K and V are the caches (num_pages, page_size,
        h_kv, d) and mPageTable its pages per sequence, int32 (1, b,
        max_pages); its cu_seqlens_k are 0 (others never read the table).
        An e4m3 kernel's descales, Q's, K's and V's, fp32 (1, b, h_kv) each
        (fp8_operands.Descales; others never read them); O is then bf16 or
        fp16 (out_dtype). A block_sparse kernel's tile lists, int32 (b or
        1, (h or 1) · m_blocks, words) (block_sparse.py; others never read
        it).
        Read only by some configs: the counters, int32
        (1, 1, n) and zero at launch (dynamic_tiles: the tile counter, element
        0; split_tail: the split tiles' counters after it), and with
        split_tail the fp32 partials workspace and the tail plan, full_tiles
        and tail_parts (tail_split.py). A split_kv kernel's partials are its
        fp32 O workspace, (parts · b, s_q, h, d_v) in O's order (part p of
        dense sequence b at batch index p · b + b; packed: p), its LSE the
        matching (parts · b, h, s_q) workspace, and tail_parts the parts per
        tile (full_tiles 0); mO is then not written. Read only by local
        kernels: the window (mask.Window); by softcap kernels: scale /
        softcap, with softmax_scale_log2 then softcap · log2(e) (softcap.py)."""
        # Kernel order: (seq, d, head, batch) with d contiguous; LSE (seq, head, batch).
        mQ, mK, mV, mO = [permute(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        if cutlass.const_expr(self.features.split_kv):
            mPartials = permute(mPartials, [1, 3, 2, 0])
        mLSE = permute(mLSE, [2, 1, 0])
        if cutlass.const_expr(self.features.heads_in_rows):
            group = self.features.rows_per_query
            mLSE = head_groups.lse_rows(mLSE, group, mQ.shape[0] // mLSE.shape[0])
            mQ, mO = head_groups.token_rows(mQ, group), head_groups.token_rows(mO, group)
            if cutlass.const_expr(self.features.split_kv):
                mPartials = head_groups.token_rows(mPartials, group)
        rows_k = mK.shape[0]
        if cutlass.const_expr(self.features.paged_kv):  # a sequence's most keys
            rows_k = mPageTable.shape[2] * mK.shape[0]
        seqlens = Seqlens(self.features.varlen, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
                          seqused, cute.size(mQ, mode=[0]), rows_k)
        kv_blocks = KvBlocks(self.features.paged_kv, mPageTable)
        descales = fp8_operands.Descales(mDescaleQ, mDescaleK, mDescaleV)
        tile_m, tile_n, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v

        sQ_layout = wgmma.smem_layout(self.dtype, tile_m, d, self.q_ring_stages)
        # each ring holds a bank of stages per tile stream (concurrent_tiles)
        sK_layout = wgmma.smem_layout(self.dtype, tile_n, d, self.cfg.kv_stages * self.streams)
        sV_layout = wgmma.smem_layout(self.dtype, tile_n, dv, self.cfg.kv_stages * self.streams)
        # e4m3: Vᵀ, K-major for P·V, filled by the transposer (fp8_operands.py)
        sVt_layout = wgmma.smem_layout(self.dtype, dv, tile_n, self.cfg.kv_stages)
        # One (64, dv) slab per consumer warpgroup, stored by that warpgroup alone,
        # or one that they take in turn (shared_o_slab).
        sO_layout = wgmma.smem_layout(self.out_dtype, WGMMA_M, dv, self._o_slabs)
        tiled_mma_qk = wgmma.tiled_mma_ss(self.dtype, self.consumer_wgs, tile_n)
        if cutlass.const_expr(self.fp8):
            tiled_mma_pv = wgmma.tiled_mma(self.dtype, True, True, (self.consumer_wgs, 1, 1), dv,
                                           a_in_registers=True)
        else:
            tiled_mma_pv = wgmma.tiled_mma_rs(self.dtype, self.consumer_wgs, dv)

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(load, mQ, self._q_stage_layout(sQ_layout),
                                                (tile_m, d))
        tma_k, tK = cpasync.make_tiled_tma_atom(load, mK, self._kv_box(sK_layout, d), (
            self.kv_load_rows, d))
        tma_v, tV = cpasync.make_tiled_tma_atom(load, mV, self._kv_box(sV_layout, dv), (
            self.kv_load_rows, dv))
        tma_o, tO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO,
                                                cute.select(sO_layout, mode=[0, 1]),
                                                (WGMMA_M, dv))

        SharedStorage = self._shared_storage(sQ_layout, sK_layout, sV_layout, sVt_layout,
                                             sO_layout)

        if cutlass.const_expr(self.features.varlen):
            num_tiles = VarlenScheduler.max_tiles(seqlens.rows_q, seqlens.num_batch(mQ.shape[3]),
                                                  mQ.shape[2], tile_m, self.features.one_q_tile)
        else:
            num_tiles = cute.ceil_div(mQ.shape[0], tile_m) * mQ.shape[2] * mQ.shape[3]
        # Built whatever the config; only split_tail kernels read it.
        tail = TailSplit(full_tiles, tail_parts, mCounters, mPartials, self.consumer_wgs)
        grid = TileScheduler.grid(self._num_units(num_tiles, tail),
                                  num_sms * self.cfg.ctas_per_sm, self.cfg.persistent,
                                  self.streams)
        self.kernel(tQ, tK, tV, tO, mO, mLSE, mCounters, mSink, descales, mBlockSparse, tail,
                    seqlens,
                    kv_blocks, tma_q, tma_k, tma_v, tma_o, softmax_scale_log2,
                    Window(window_left, window_right), score_pre_tanh,
                    sQ_layout, sK_layout, sV_layout, sVt_layout, sO_layout,
                    tiled_mma_qk, tiled_mma_pv, SharedStorage).launch(
            grid=[grid, 1, 1], block=[self.cfg.threads, 1, 1], stream=stream,
            min_blocks_per_mp=self.cfg.ctas_per_sm,
            # two CTAs take the largest carveout; named here, the DSL need not
            # ask a device for it (compiling where there is none)
            preferred_smem_carveout=100 if self.cfg.ctas_per_sm > 1 else None)

    @property
    def bounded_scores(self) -> bool:
        """Soft-capped bf16 scores: the main loop runs without a running
        maximum when the cap allows it (softcap.py), with one otherwise."""
        return (self.features.softcap and self.dtype is cutlass.BFloat16
                and self.cfg.bounded_softmax)

    @property
    def warpgroup_key_ranges(self) -> bool:
        """Each consumer warpgroup computes only the K/V blocks its own rows
        see (FwdConfig.warpgroup_key_ranges): under a right limit or a
        window, with several consumer warpgroups a tile, without a block
        mask (whose lists are a tile's)."""
        return (self.cfg.warpgroup_key_ranges and self.consumer_wgs > 1
                and (self.causal or self.features.local) and not self.features.block_sparse)

    def rescales_before_pv(self, me: Consumer) -> bool:
        """O's rescale waits for the next P·V issue (rescale_o_before_pv),
        where the softmax rescales at all."""
        return self.cfg.rescale_o_before_pv and me.softmax.rescales

    @property
    def q_ring_stages(self) -> int | None:
        """The Q ring's stage mode (q_stages, a bank of them per tile stream),
        or None: one unstaged tile."""
        if self.cfg.q_stages == 1 and self.streams == 1:
            return None
        return self.cfg.q_stages * self.streams

    @property
    def _o_slabs(self) -> int:
        """The O slabs (64 rows each) of O's layout: one per consumer
        warpgroup, or one they share (shared_o_slab); O staged in the V ring
        with several tile streams: as many as cover the whole ring, stream
        s's slab the first of its bank (the epilogue's slab_index)."""
        if self.cfg.o_in_v_smem and self.streams > 1:
            return self.streams * self._o_slabs_per_bank
        if self.cfg.shared_o_slab:
            return 1
        return self.consumer_wgs * self.streams

    @property
    def _o_slabs_per_bank(self) -> int:
        return self.cfg.kv_stages * self.tile_n // WGMMA_M

    def _bank(self, stream):
        """A ring position's bank: None (one bank) or the tile stream's."""
        return stream if self.streams > 1 else None

    def _q_stage_layout(self, sQ_layout):
        """One stage of Q's shared-memory layout (what one TMA load fills)."""
        if self.q_ring_stages is None:
            return sQ_layout
        return cute.select(sQ_layout, mode=[0, 1])

    def _q_stage(self, t: cute.Tensor, q_state) -> cute.Tensor:
        """t (a view of the Q ring, its stage mode last) at q_state's stage."""
        if cutlass.const_expr(self.q_ring_stages is None):
            return t
        return t[(None,) * (cute.rank(t) - 1) + (q_state.index,)]

    @property
    def splits_tiles(self) -> bool:
        """Tiles come in key ranges: the last round's (split_tail) or all
        (split_kv), units of work dealt through TailSplit."""
        return self.cfg.split_tail or self.features.split_kv

    @property
    def kv_load_rows(self) -> int:
        """Rows of one K/V TMA load: a block, or a page of it (kv_load_rows)."""
        return self.cfg.kv_load_rows or self.tile_n

    def _kv_box(self, staged_layout, cols: int):
        """The shared-memory layout one K/V TMA load fills: a stage's first
        kv_load_rows rows (the stage itself for whole-block loads)."""
        stage = cute.select(staged_layout, mode=[0, 1])
        if self.kv_load_rows == self.tile_n:
            return stage
        return cute.composition(stage, cute.make_layout((self.kv_load_rows, cols),
                                                        stride=(1, self.tile_n)))

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout, sVt_layout, sO_layout):
        """The CTA's shared memory (FwdConfig.smem_bytes counts it): barriers,
        Q, the K and V rings (e4m3: and the Vᵀ ring), and the O slabs, unless
        they are staged in the V ring (o_in_v_smem), which is then at least
        their size."""
        stages = self.cfg.kv_stages * self.streams

        def tiles(elems: int, dtype=self.dtype):
            return cute.struct.Align[cute.struct.MemRange[dtype, elems], SMEM_ALIGN]

        mem = cute.struct.MemRange
        fields = {
            "q_barriers": mem[cutlass.Int64, 2 * self.cfg.q_stages * self.streams],
            "k_barriers": mem[cutlass.Int64, 2 * stages],
            "v_barriers": mem[cutlass.Int64, 2 * stages],
            # O staged in V has been stored (o_in_v_smem), one per tile stream
            "o_read": mem[cutlass.Int64, self.streams],
            "tile_slots": mem[Int32, self.streams * TileQueue.slots_for(self.cfg.q_stages)],
            "split_arrivals": mem[Int32, 4],  # per consumer warpgroup (split_tail)
        }
        if self.fp8:
            fields["vt_barriers"] = mem[cutlass.Int64, 2 * stages]  # the Vᵀ ring
            fields["v_stream_done"] = mem[Int32, stages]  # the V ring's end of stream
        fields["sQ"] = tiles(cute.cosize(sQ_layout))
        fields["sK"] = tiles(cute.cosize(sK_layout))
        if self.cfg.o_in_v_smem:
            fields["sV"] = tiles(max(cute.cosize(sV_layout), cute.cosize(sO_layout)))
        else:
            fields["sV"] = tiles(cute.cosize(sV_layout))
            if self.fp8:
                fields["sVt"] = tiles(cute.cosize(sVt_layout))
            fields["sO"] = tiles(cute.cosize(sO_layout), self.out_dtype)
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ---------------------------------------------------------------- kernel
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mO_rows: cute.Tensor, mLSE: cute.Tensor, mCounters: cute.Tensor,
               mSink: cute.Tensor, descales: fp8_operands.Descales, mBlockSparse: cute.Tensor,
               tail: TailSplit, seqlens: Seqlens,
               kv_blocks: KvBlocks, tma_q: cute.CopyAtom,
               tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, tma_o: cute.CopyAtom,
               softmax_scale_log2: Float32, window: Window, score_pre_tanh: Float32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sVt_layout: cute.ComposedLayout,
               sO_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        copies = Copies(tma_q, tma_k, tma_v, tma_o)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(SharedStorage)
        arrivals = self.consumer_threads
        # e4m3: the transposer frees V stages, and fills the Vᵀ ring
        v_arrivals = self.transpose_threads if cutlass.const_expr(self.fp8) else arrivals
        # with several tile streams, one bank of stages each (pipeline.BankedState)
        pipes = Pipes(
            make_tma_pipeline(storage.q_barriers.data_ptr(), self.cfg.q_stages * self.streams,
                              arrivals,
                              cute.size_in_bytes(self.dtype, self._q_stage_layout(sQ_layout))),
            make_tma_pipeline(storage.k_barriers.data_ptr(), self.cfg.kv_stages * self.streams,
                              arrivals,
                              cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))),
            make_tma_pipeline(storage.v_barriers.data_ptr(), self.cfg.kv_stages * self.streams,
                              v_arrivals,
                              cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))),
        )
        done = None  # e4m3: the V ring's end-of-stream words (fp8_operands)
        if cutlass.const_expr(self.fp8):
            pipes.vt = make_thread_pipeline(storage.vt_barriers.data_ptr(), self.cfg.kv_stages,
                                            self.transpose_threads, arrivals)
            done = storage.v_stream_done.data_ptr().toint()
            if warp_idx == 0:
                with cute.arch.elect_one():
                    fp8_operands.start_v_stream(done, self.cfg.kv_stages)
        o_read = storage.o_read.data_ptr()
        if cutlass.const_expr(self.cfg.o_in_v_smem):
            if warp_idx == 0:
                with cute.arch.elect_one():
                    # one arrival per consumer warpgroup and tile (_o_left)
                    for stream in cutlass.range_constexpr(self.streams):
                        cute.arch.mbarrier_init(o_read + stream, self.consumer_wgs)
            cute.arch.mbarrier_init_fence()
        cpipeline.pipeline_init_arrive()
        o_storage = storage.sV if cutlass.const_expr(self.cfg.o_in_v_smem) else storage.sO
        smem = Buffers(
            storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
            o_storage.get_tensor(sO_layout.outer, swizzle=sO_layout.inner),
        )
        if cutlass.const_expr(self.features.varlen):
            scheduler = VarlenScheduler(seqlens, False, self.tile_m, mQ.shape[2],
                                        seqlens.num_batch(mQ.shape[3]), self.causal,
                                        self.features.one_q_tile)
        else:
            scheduler = TileScheduler.create(
                cute.ceil_div(mQ.shape[0], self.tile_m), mQ.shape[2], mQ.shape[3], mK.shape[0],
                mQ.shape[2] // mK.shape[2],
                (self.head_dim + self.head_dim_v) * self.dtype.width // 8,
                self.cfg.l2_section_mb * 1024 * 1024, longest_first=self.causal)
        queue = TileQueue(mCounters, storage.tile_slots.get_tensor(cute.make_layout(
            self.streams * TileQueue.slots_for(self.cfg.q_stages))), streams=self.streams)
        cpipeline.pipeline_init_wait()  # barriers initialised before anyone uses them
        limits = Limits(self.causal, self.features.local, window, self.features.rows_per_query)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx < self.streams:
                stream = self._stream(warp_idx, producer=True)
                self.produce(mQ, mK, mV, copies, smem, pipes,
                             self._tiles(scheduler, queue, stream), tail, seqlens, kv_blocks,
                             self._o_read(o_read, stream), limits, done, mBlockSparse, stream)
            if cutlass.const_expr(self.fp8):
                if warp_idx >= 1 and warp_idx <= self.cfg.transpose_warps:
                    fp8_operands.transpose_v_stream(
                        fp8_operands.VTransposeRing.create(
                            pipes.v, pipes.vt, storage.sV.data_ptr().toint(),
                            cute.select(sV_layout, mode=[0, 1]), storage.sVt.data_ptr().toint(),
                            cute.select(sVt_layout, mode=[0, 1]), done, self.cfg.kv_stages),
                        cute.arch.thread_idx()[0] - 32, self.transpose_threads)
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            # Q, K, V (e4m3: Vᵀ) once more for the WGMMAs (kernel_base.mma_operand_view).
            if cutlass.const_expr(self.fp8):
                mma_v = mma_operand_view(storage.sVt, sVt_layout, self.dtype)
                consumer_pipes = Pipes(pipes.q, pipes.k, pipes.vt)
            else:
                mma_v = mma_operand_view(storage.sV, sV_layout, self.dtype)
                consumer_pipes = pipes
            mma_smem = Buffers(mma_operand_view(storage.sQ, sQ_layout, self.dtype),
                               mma_operand_view(storage.sK, sK_layout, self.dtype), mma_v, smem.o)
            stream = self._stream(warp_idx, producer=False)
            self.consume(mO, mO_rows, mLSE, mSink, descales, mBlockSparse, copies, seqlens,
                         softmax_scale_log2, score_pre_tanh,
                         limits, mma_smem, consumer_pipes,
                         self._tiles(scheduler, queue, stream), tail,
                         storage.split_arrivals.get_tensor(cute.make_layout(4)),
                         self._o_read(o_read, stream), tiled_mma_qk, tiled_mma_pv,
                         storage.sQ.data_ptr().toint(), self._q_stage_layout(sQ_layout), stream)

    def _stream(self, warp_idx, producer: bool):
        """The tile stream a warp serves: producer warp s loads stream s's
        tiles, consumer warpgroup s + 1 computes them (0 with one stream)."""
        stream = 0
        if cutlass.const_expr(self.streams > 1):
            stream = warp_idx if producer else warp_idx // 4 - 1
        return stream

    def _o_read(self, o_read: cute.Pointer, stream):
        """The tile stream's barrier of O read out of the V ring (o_in_v_smem)."""
        if cutlass.const_expr(self.streams > 1):
            return o_read + stream
        return o_read

    def _tiles(self, scheduler, queue: TileQueue, stream) -> TileSequence:
        """The tiles of one tile stream of this CTA (one of concurrent_tiles)."""
        if cutlass.const_expr(self.streams > 1):
            scheduler = replace(scheduler, stream=stream, streams=self.streams)
            queue = replace(queue, stream=stream)
        return TileSequence(scheduler, queue, self.cfg.dynamic_tiles)

    # -------------------------------------------------------------- producer
    @cute.jit
    def produce(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, copies: Copies,
                smem: Buffers, pipes: Pipes, tiles: TileSequence, tail: TailSplit,
                seqlens: Seqlens, kv: KvBlocks, o_read: cute.Pointer, limits: Limits,
                done: Int32 | None, mBlockSparse: cute.Tensor, stream):
        blocks = BlockRange(self.tile_m, self.tile_n, limits)
        q_per_kv = mQ.shape[2] // mK.shape[2]
        q_state = producer_state(self.cfg.q_stages, self._bank(stream))
        kv_state = producer_state(self.cfg.kv_stages, self._bank(stream))
        dynamic = cutlass.const_expr(self.cfg.dynamic_tiles)
        num_units = self._num_units(tiles.scheduler.num_tiles(), tail)
        round_idx = Int32(0)
        tile = tiles.scheduler.tile_at(round_idx)
        while tile < num_units:
            if dynamic:
                tiles.queue.publish(round_idx, tile)
            work = self._locate(tiles.scheduler, tail, blocks, tile, seqlens, mBlockSparse, kv)
            head_kv = work.head // q_per_kv
            gQ = cute.local_tile(seqlens.q_rows(mQ, work.head, work.batch),
                                 (self.tile_m, self.head_dim), (work.m_block, 0))
            tQs, tQg = tma_views(copies.q, smem.q, gQ, staged=self.q_ring_stages is not None,
                                 g_tile_modes=2)
            k_blocks = self._kv_stream(copies.k, mK, smem.k, kv, seqlens, head_kv, work,
                                       self.head_dim)
            v_blocks = self._kv_stream(copies.v, mV, smem.v, kv, seqlens, head_kv, work,
                                       self.head_dim_v)

            pipes.q.producer_acquire(q_state)
            cute.copy(copies.q, tQg, self._q_stage(tQs, q_state),
                      tma_bar_ptr=pipes.q.producer_get_barrier(q_state))
            q_state.advance()

            n_lo, n_max = work.n_lo, work.n_max
            if n_max > n_lo:
                kv_state = k_blocks.load(copies.k, pipes.k, kv_state,
                                         self._key_block(work, n_max - 1), kv)
                if cutlass.const_expr(self.cfg.o_in_v_smem):
                    # The previous round's O, staged in the V ring, has been stored.
                    cute.arch.mbarrier_wait(o_read, (round_idx + 1) % 2)
                if cutlass.const_expr(self.cfg.intra_wg_overlap):
                    # V_j trails K_{j-1} by one step, the order the consumers use them.
                    for i in cutlass.range(n_max - 1 - n_lo, unroll=1):
                        v_state = kv_state.clone()
                        kv_state.advance()
                        kv_state = k_blocks.load(copies.k, pipes.k, kv_state,
                                                 self._key_block(work, n_max - 2 - i), kv)
                        v_state = v_blocks.load(copies.v, pipes.v, v_state,
                                                self._key_block(work, n_max - 1 - i), kv)
                    kv_state = v_blocks.load(copies.v, pipes.v, kv_state,
                                             self._key_block(work, n_lo), kv)
                    kv_state.advance()
                else:
                    kv_state = v_blocks.load(copies.v, pipes.v, kv_state,
                                             self._key_block(work, n_max - 1), kv)
                    kv_state.advance()
                    for i in cutlass.range(n_max - 1 - n_lo, unroll=1):
                        n_block = self._key_block(work, n_max - 2 - i)
                        kv_state = k_blocks.load(copies.k, pipes.k, kv_state, n_block, kv)
                        kv_state = v_blocks.load(copies.v, pipes.v, kv_state, n_block, kv)
                        kv_state.advance()
            round_idx += 1
            tile = tiles.claimed(round_idx)
        if dynamic:
            tiles.queue.finish(round_idx, tile, pipes.q, q_state)
        if cutlass.const_expr(self.fp8):
            fp8_operands.end_v_stream(pipes.v, kv_state, done)

    @property
    def transpose_threads(self) -> int:
        """The producer warpgroup's threads that transpose V (e4m3): its warps
        1 .. transpose_warps, beside the TMA warp."""
        return 32 * self.cfg.transpose_warps

    def _num_units(self, num_tiles: Int32, tail: TailSplit) -> Int32:
        """The units of work the CTAs deal: the tiles, or with split_tail
        (split_kv) the whole ones and the parts of the split ones (no whole ones)."""
        if cutlass.const_expr(self.splits_tiles):
            return tail.num_units(num_tiles)
        return num_tiles

    @cute.jit
    def _locate(self, scheduler, tail: TailSplit, blocks: BlockRange, unit: Int32,
                seqlens: Seqlens, mBlockSparse: cute.Tensor, kv: KvBlocks | None = None) -> Work:
        """A unit of work -> its Work. Without split_tail a unit is a tile, and
        the first block and the parts are Python constants (the loops' bounds
        stay as they were). A block_sparse tile walks its list's entries as
        blocks [0, count) (_key_block). The producer passes `kv`: its first
        page is read here, beside the lengths."""
        tile, part, parts = unit, 0, 1
        if cutlass.const_expr(self.splits_tiles):
            tile, part, parts = tail.locate(unit)
        m_block, head, batch = scheduler.decode(tile)
        first_page = 0 if kv is None else kv.first_page(batch)
        seqlen_q, seqlen_k = seqlens.len_q(batch), seqlens.len_k(batch)
        sparse = None
        if cutlass.const_expr(self.features.block_sparse):
            sparse = SparseRow.load(mBlockSparse, batch, head, m_block,
                                    cute.ceil_div(seqlen_q, self.tile_m),
                                    cute.ceil_div(seqlen_k, self.tile_n),
                                    self.tile_m * self.tile_n // 32)
            n_lo, n_max = 0, sparse.count
        else:
            n_lo, n_max = 0, blocks.n_block_max(m_block, seqlen_q, seqlen_k)
        if cutlass.const_expr(self.features.local):
            n_lo = blocks.n_block_min(m_block, seqlen_q, seqlen_k)
        if cutlass.const_expr(self.splits_tiles):
            n_lo, n_max = TailSplit.key_range(part, parts, n_lo, n_max)
        if cutlass.const_expr(not self.features.split_kv):
            # only split_kv's epilogue reads it: a constant keeps it out of
            # the registers the main loop carries
            part = 0
        return Work(m_block, head, batch, n_lo, n_max, part, parts, seqlen_q, seqlen_k, sparse,
                    first_page)

    def _walk(self, blocks: BlockRange, work: Work, tile_wg) -> KeyWalk:
        """The K/V blocks of the tile that warpgroup tile_wg computes: its
        own rows' (warpgroup_key_ranges) or all of them."""
        if cutlass.const_expr(self.warpgroup_key_ranges):
            return KeyWalk.of_warpgroup(blocks, work.m_block, tile_wg, self.consumer_wgs,
                                        work.seqlen_q, work.seqlen_k, work.n_lo, work.n_max)
        return KeyWalk.of_tile(blocks, work.m_block, work.n_lo, work.n_max)

    def _key_block(self, work: Work, n_block: Int32) -> Int32:
        """The K/V block that the walk's block n_block loads: itself, or under
        block sparsity its list's entry count - 1 - n_block (SparseScoreMask)."""
        if cutlass.const_expr(self.features.block_sparse):
            return work.sparse.inner(work.sparse.count - 1 - n_block)
        return n_block

    @cute.jit
    def _sink(self, mSink: cute.Tensor, work: Work) -> Float32:
        """The tile's learnable sink (natural log units); -inf without sinks."""
        sink = -Float32.inf
        if cutlass.const_expr(self.features.sink):
            sink = mSink[0, 0, work.head]
        return sink

    @cute.jit
    def _sink_log2(self, sink: Float32, work: Work) -> Float32:
        """The sink in log2 units for finalize_with_sink; -inf for a part of
        a split tile (the merge adds it once)."""
        sink_log2 = sink * LOG2_E
        if cutlass.const_expr(self.cfg.split_tail):
            if work.parts > 1:
                sink_log2 = -Float32.inf
        return sink_log2

    @cute.jit
    def _kv_stream(self, atom, m_kv: cute.Tensor, s_ring: cute.Tensor, kv: KvBlocks,
                   seqlens: Seqlens, head_kv: Int32, work: Work, cols: int) -> KvStream:
        """One tile's K or V blocks for the producer (paged.KvStream)."""
        batch = work.batch
        if cutlass.const_expr(self.kv_load_rows == self.tile_n):
            blocks = kv.gmem_blocks(m_kv, seqlens.k_rows(m_kv, head_kv, batch), head_kv,
                                    self.tile_n, cols)
            s_view, g_view = tma_views(atom, s_ring, blocks, staged=True, g_tile_modes=2)
            return KvStream(g_view, s_view, head_kv, batch, self.tile_n, self.tile_n, cols,
                            work.first_page)
        return KvStream(m_kv, s_ring, head_kv, batch, self.kv_load_rows, self.tile_n, cols)

    # ------------------------------------------------------------- consumers
    @cute.jit
    def consume(self, mO: cute.Tensor, mO_rows: cute.Tensor, mLSE: cute.Tensor,
                mSink: cute.Tensor, descales: fp8_operands.Descales, mBlockSparse: cute.Tensor,
                copies: Copies,
                seqlens: Seqlens, softmax_scale_log2: Float32, score_pre_tanh: Float32,
                limits: Limits,
                smem: Buffers, pipes: Pipes,
                tiles: TileSequence, tail: TailSplit, split_arrivals: cute.Tensor,
                o_read: cute.Pointer, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                q_ring_base: Int32, sQ_stage: cute.ComposedLayout, stream):
        tid = cute.arch.thread_idx()[0] - WARPGROUP_THREADS
        # wg: this warpgroup among the CTA's consumers (its named barriers and
        # O slab); tile_wg, tile_tid: within its tile (its rows, its WGMMA slice)
        wg = cute.arch.make_warp_uniform(tid // WARPGROUP_THREADS)
        tile_wg, tile_tid = wg, tid
        if cutlass.const_expr(self.streams > 1):
            tile_wg, tile_tid = 0, tid & (WARPGROUP_THREADS - 1)
        # WGMMA operands are per warpgroup (descriptors / register A); the
        # accumulator coordinates are per thread.
        wg_qk = tiled_mma_qk.get_slice(tile_wg * WARPGROUP_THREADS)
        wg_pv = tiled_mma_pv.get_slice(tile_wg * WARPGROUP_THREADS)
        # with a Q ring, stage 0's view (each tile takes its own stage's: consume's loop)
        q_view = smem.q if cutlass.const_expr(self.q_ring_stages is None) else smem.q[None, None, 0]
        q = wg_qk.make_fragment_A(wg_qk.partition_A(q_view))
        k = wg_qk.make_fragment_B(wg_qk.partition_B(smem.k))
        p = wg_pv.make_fragment_A(wg_pv.partition_shape_A((self.tile_m, self.tile_n)))
        # smem.v: V, read MN-major through a transposed view; e4m3: Vᵀ itself
        vt_view = smem.v if cutlass.const_expr(self.fp8) else wgmma.transpose_view(smem.v)
        vt = wg_pv.make_fragment_B(wg_pv.partition_B(vt_view))
        acc_o = cute.make_rmem_tensor(wg_pv.partition_shape_C((self.tile_m, self.head_dim_v)),
                                      Float32)
        s_coords = tiled_mma_qk.get_slice(tile_tid).partition_C(
            cute.make_identity_tensor((self.tile_m, self.tile_n)))
        softmax = OnlineSoftmax.create(softmax_scale_log2,
                                       cute.size(wgmma.acc_rows_cols(acc_o), mode=[0]),
                                       per_tile_scale=self.fp8,
                                       skip_unmoved=self.cfg.skip_unmoved_rescale)
        pingpong = PingPong(self.consumer_wgs, self.cfg.pingpong)
        pingpong.start(wg)
        self._start_slab_turns(wg, tid)
        o_scale = cute.make_rmem_tensor(softmax.rows, Float32)
        me = Consumer(tiled_mma_qk, tiled_mma_pv, q, k, p, vt, acc_o, softmax, o_scale,
                      score_pre_tanh, pingpong, wg)
        reference = None
        if cutlass.const_expr(self.bounded_scores):
            reference = FixedReference.for_cap(softmax_scale_log2)

        blocks = BlockRange(self.tile_m, self.tile_n, limits)
        q_state = consumer_state(self.cfg.q_stages, self._bank(stream))
        kv_state = consumer_state(self.cfg.kv_stages, self._bank(stream))
        dynamic = cutlass.const_expr(self.cfg.dynamic_tiles)
        num_units = self._num_units(tiles.scheduler.num_tiles(), tail)
        round_idx = Int32(0)
        tile = tiles.received(round_idx, pipes.q, q_state)  # with its Q (TileQueue)
        while tile < num_units:
            work = self._locate(tiles.scheduler, tail, blocks, tile, seqlens, mBlockSparse)
            # the sink's load is issued here, its latency hidden by the main loop
            sink = self._sink(mSink, work)
            o_factor = None
            if cutlass.const_expr(self.fp8):
                # the descales: Q's and K's into the score scale, V's into O
                head_kv = work.head // (mO.shape[2] // descales.q.shape[2])
                softmax.set_tile_scale(softmax_scale_log2
                                       * descales.score_factor(work.batch, head_kv))
                o_factor = descales.o_factor(work.batch, head_kv)
            acc_o.fill(0.0)
            softmax.row_max.fill(-Float32.inf)
            softmax.row_sum.fill(0.0)
            if not dynamic:  # a claimed tile's Q was waited for with the tile
                wait_full(pipes.q, q_state)
            tile_me = me
            if cutlass.const_expr(self.q_ring_stages is not None):
                # this tile's Q stage, at opaque addresses (kernel_base.mma_operand_parts_at)
                q_parts = mma_operand_parts_at(
                    q_ring_base + q_state.index * cute.size_in_bytes(self.dtype, sQ_stage),
                    sQ_stage, self.dtype)
                tile_me = replace(me, q=wgmma.AtomParts(tuple(
                    wg_qk.make_fragment_A(wg_qk.partition_A(part)) for part in q_parts)))
            if work.n_max > work.n_lo:
                walk = self._walk(blocks, work, tile_wg)
                coords0 = wgmma.static_coords(tiled_mma_qk, (self.tile_m, self.tile_n))
                if cutlass.const_expr(self.features.block_sparse):
                    mask = SparseScoreMask(s_coords, coords0, work.sparse, self.tile_m,
                                           self.tile_n)
                else:
                    mask = ScoreMask(s_coords, coords0, work.m_block, work.seqlen_q,
                                     work.seqlen_k, self.tile_m, self.tile_n, limits)
                if cutlass.const_expr(self.bounded_scores):
                    if reference.fits:
                        kv_state = self.mainloop(
                            replace(tile_me, softmax=softmax.fixed_reference(
                                reference.offset, self.cfg.exp2_on_fma)),
                            pipes, q_state, kv_state, mask, walk)
                    else:
                        kv_state = self.mainloop(tile_me, pipes, q_state, kv_state, mask, walk)
                else:
                    kv_state = self.mainloop(tile_me, pipes, q_state, kv_state, mask, walk)
            else:
                release(pipes.q, q_state)
            q_state.advance()
            if cutlass.const_expr(self.features.sink):
                lse = softmax.finalize_with_sink(acc_o, self._sink_log2(sink, work), o_factor)
            else:
                lse = softmax.finalize(acc_o, o_factor)
            out = work  # where the epilogue writes
            if cutlass.const_expr(self.cfg.rederive_epilogue_coords):
                # from an opaque copy of the index, so that the main loop's
                # coordinates need not stay live through it
                out = self._locate(tiles.scheduler, tail, blocks,
                                   cute.arch.make_warp_uniform(tile), seqlens, mBlockSparse)
            if cutlass.const_expr(self.features.split_kv):
                self._o_staging_free(wg)
                self._store_partial(acc_o, lse, tiled_mma_pv, tail.partials, mLSE, tid, out,
                                    seqlens, mO.shape[3])
                self._o_left(o_read, tid)
            elif cutlass.const_expr(self.cfg.split_tail):
                writes = cutlass.Boolean(True)
                if work.parts > 1:
                    writes = tail.merge(acc_o, lse, tile, wg, tid,
                                        int(NamedBarrier.EPILOGUE_BASE) + wg, split_arrivals,
                                        sink)
                self._o_staging_free(wg)
                if writes:
                    self.epilogue(acc_o, lse, tiled_mma_pv, mO, mO_rows, mLSE, smem.o, copies.o,
                                  wg, tile_tid, out, seqlens, o_read)
                else:
                    self._skip_o_store(o_read, wg, tid)
            else:
                self._o_staging_free(wg)
                self.epilogue(acc_o, lse, tiled_mma_pv, mO, mO_rows, mLSE, smem.o, copies.o,
                              wg, tile_tid, out, seqlens, o_read)
            if cutlass.const_expr(self.warpgroup_key_ranges):
                # The tile's blocks below the walk (keys left of this
                # warpgroup's window edge, walked last): passed after the
                # epilogue, which runs while the other warpgroups compute
                # them, from bounds rederived here (a count held through the
                # main loop spilled).
                walk = self._walk(blocks, out, tile_wg)
                kv_state = pass_stages(pipes.k, pipes.v, kv_state, walk.n_lo - walk.tile_lo,
                                       me.pingpong, me.wg)
            round_idx += 1
            tile = tiles.received(round_idx, pipes.q, q_state)
        if tid % WARPGROUP_THREADS < 32:
            # The last O stores must finish reading shared memory before the CTA exits.
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def mainloop(self, me: Consumer, pipes: Pipes, q_state, kv_state, mask: ScoreMask,
                 walk: KeyWalk):
        """K/V blocks [n_lo, n_max) of the walk, last block first; with
        warpgroup_key_ranges the tile's blocks above them (keys past this
        warpgroup's last row's right limit) pass through the rings first,
        uncomputed (those below them after the epilogue: consume). Releases
        Q as soon as the last Q·Kᵀ is done, so that with one Q stage the
        next tile's Q loads under the last P·V and the epilogue (with two it
        may have loaded already). Returns the K/V ring state."""
        if cutlass.const_expr(self.warpgroup_key_ranges):
            kv_state = pass_stages(pipes.k, pipes.v, kv_state, walk.tile_max - walk.n_max,
                                   me.pingpong, me.wg)
        n_lo, n_max = walk.n_lo, walk.n_max
        n_masked_end, n_unmasked_lo = mask.masked_bounds(walk)
        if cutlass.const_expr(self.cfg.intra_wg_overlap):
            # First block: S, mask (seqlen edge and diagonal), softmax; its P·V
            # is issued together with the next block's S.
            wait_full(pipes.k, kv_state)
            acc_s = self._new_scores(me)
            wgmma.gemm(me.mma_qk, acc_s, me.q, me.k[None, None, None, kv_state.index],
                       zero_init=True, wait_groups=0)
            release(pipes.k, kv_state)
            self._mod_scores(me, acc_s, mask, n_max - 1, apply_mask=True)
            o_scale = me.softmax.update(acc_s, is_first=True)
            if cutlass.const_expr(self.rescales_before_pv(me)):
                me.o_scale.store(o_scale.load())
            self._convert_p(acc_s, me.p)
            for i in cutlass.range(n_max - 1 - n_masked_end, unroll=1):
                kv_state = self._overlapped_step(me, pipes, kv_state, mask, n_max - 2 - i,
                                                 apply_mask=True)
            for n_block in cutlass.range(n_masked_end - 1, n_unmasked_lo - 1, -1, unroll=1):
                kv_state = self._overlapped_step(me, pipes, kv_state, mask, n_block,
                                                 apply_mask=False)
            if cutlass.const_expr(mask.left_masked):
                for n_block in cutlass.range(n_unmasked_lo - 1, n_lo - 1, -1, unroll=1):
                    kv_state = self._overlapped_step(me, pipes, kv_state, mask, n_block,
                                                     apply_mask=True)
            release(pipes.q, q_state)
            # Last P·V.
            if cutlass.const_expr(self.rescales_before_pv(me)):
                me.softmax.rescale_o_where_moved(me.acc_o, me.o_scale)
            wait_full(pipes.v, kv_state)
            wgmma.gemm(me.mma_pv, me.acc_o, me.p, me.vt[None, None, None, kv_state.index],
                       zero_init=False, wait_groups=0)
            release(pipes.v, kv_state)
            kv_state.advance()
        else:
            me.pingpong.wait_turn(me.wg)
            kv_state = self._serial_step(me, pipes, kv_state, mask, n_max - 1,
                                         apply_mask=True, is_first=True)
            for i in cutlass.range(n_max - 1 - n_masked_end, unroll=1):
                kv_state = self._serial_step(me, pipes, kv_state, mask, n_max - 2 - i,
                                             apply_mask=mask.right_masked, is_first=False)
            for i in cutlass.range(n_masked_end - n_unmasked_lo, unroll=1):
                kv_state = self._serial_step(me, pipes, kv_state, mask, n_masked_end - 1 - i,
                                             apply_mask=False, is_first=False)
            if cutlass.const_expr(mask.left_masked):
                for i in cutlass.range(n_unmasked_lo - n_lo, unroll=1):
                    kv_state = self._serial_step(me, pipes, kv_state, mask,
                                                 n_unmasked_lo - 1 - i, apply_mask=True,
                                                 is_first=False)
            me.pingpong.pass_turn(me.wg)
            release(pipes.q, q_state)
        return kv_state

    @cute.jit
    def _mod_scores(self, me: Consumer, acc_s: cute.Tensor, mask: ScoreMask, n_block: Int32,
                    apply_mask: cutlass.Constexpr[bool]):
        """S as the softmax takes it: soft-capped (softcap), then masked where
        the block needs it (the cap comes first: tanh(-inf) is no -inf)."""
        if cutlass.const_expr(self.features.softcap):
            cap_scores(acc_s, me.pre_tanh)
        if cutlass.const_expr(apply_mask):
            mask.apply(acc_s, n_block)

    @cute.jit
    def _convert_p(self, acc_s: cute.Tensor, p: cute.Tensor):
        """P from the fp32 accumulator into P·V's register A operand: 16-bit
        in place, or e4m3 packed in the key order of fp8_operands."""
        if cutlass.const_expr(self.fp8):
            fp8_operands.convert_p_to_e4m3(acc_s, p)
        else:
            wgmma.convert_to_16bit(acc_s, p)

    def _new_scores(self, me: Consumer) -> cute.Tensor:
        """A fresh fp32 accumulator for S = Q·Kᵀ."""
        return cute.make_rmem_tensor(me.mma_qk.partition_shape_C((self.tile_m, self.tile_n)),
                                     Float32)

    @cute.jit
    def _overlapped_step(self, me: Consumer, pipes: Pipes, kv_state, mask: ScoreMask,
                         n_block: Int32, apply_mask: cutlass.Constexpr[bool]):
        """S_j = Q·K_jᵀ and O += P_{j+1}·V_{j+1} in flight together; softmax of S_j
        runs while P·V completes. kv_state enters at block j+1, leaves at j."""
        v_state = kv_state.clone()
        kv_state.advance()
        wait_full(pipes.k, kv_state)
        acc_s = self._new_scores(me)
        me.pingpong.wait_turn(me.wg)
        wgmma.gemm(me.mma_qk, acc_s, me.q, me.k[None, None, None, kv_state.index],
                   zero_init=True, wait_groups=-1)
        if cutlass.const_expr(self.rescales_before_pv(me)):
            # for P_{j+1}'s maximum, while S_j's GEMM runs
            me.softmax.rescale_o_where_moved(me.acc_o, me.o_scale)
        wait_full(pipes.v, v_state)
        wgmma.gemm(me.mma_pv, me.acc_o, me.p, me.vt[None, None, None, v_state.index],
                   zero_init=False, wait_groups=-1)
        me.pingpong.pass_turn(me.wg)
        warpgroup.wait_group(1)  # S_j has landed; P·V may still run
        if cutlass.const_expr(self.cfg.pv_wait_after_exp2 == 0):
            release(pipes.k, kv_state)
        self._mod_scores(me, acc_s, mask, n_block, apply_mask)
        rescale = me.softmax.update(acc_s, is_first=False)
        if cutlass.const_expr(self.cfg.pv_wait_after_exp2 > 0):
            # The P·V wait below stays behind this release (ptxas keeps their
            # order), and the release behind this exp2 (FwdConfig).
            release_after(pipes.k, kv_state, wgmma.acc_rows_cols(acc_s)[
                0, self.cfg.pv_wait_after_exp2 - 1])
        warpgroup.wait_group(0)  # P·V done: P's registers and the V stage are free
        release(pipes.v, v_state)
        if cutlass.const_expr(self.rescales_before_pv(me)):
            me.o_scale.store(rescale.load())
        elif cutlass.const_expr(me.softmax.rescales):
            me.softmax.rescale_o_where_moved(me.acc_o, rescale)
        self._convert_p(acc_s, me.p)
        return kv_state

    @cute.jit
    def _serial_step(self, me: Consumer, pipes: Pipes, kv_state, mask: ScoreMask,
                     n_block: Int32, apply_mask: cutlass.Constexpr[bool],
                     is_first: cutlass.Constexpr[bool]):
        """S_j, softmax, O += P_j·V_j in sequence (the intra_wg_overlap=False path).
        The warpgroup holds the ping-pong turn on entry; its turn spans P·V_{j+1}
        and S_j, the softmax runs outside it."""
        wait_full(pipes.k, kv_state)
        acc_s = self._new_scores(me)
        wgmma.gemm(me.mma_qk, acc_s, me.q, me.k[None, None, None, kv_state.index],
                   zero_init=True, wait_groups=-1)
        me.pingpong.pass_turn(me.wg)
        warpgroup.wait_group(0)
        release(pipes.k, kv_state)
        self._mod_scores(me, acc_s, mask, n_block, apply_mask)
        rescale = me.softmax.update(acc_s, is_first=is_first)
        self._convert_p(acc_s, me.p)
        if cutlass.const_expr(me.softmax.rescales):
            me.softmax.rescale_o_where_moved(me.acc_o, rescale)
        wait_full(pipes.v, kv_state)
        me.pingpong.wait_turn(me.wg)
        wgmma.gemm(me.mma_pv, me.acc_o, me.p, me.vt[None, None, None, kv_state.index],
                   zero_init=False, wait_groups=0)
        release(pipes.v, kv_state)
        kv_state.advance()
        return kv_state
