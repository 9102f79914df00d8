"""FlashAttention-3 backward for Hopper (sm_90a), in the CuTe DSL.

One CTA per (key block, KV head, batch), or per (key block, query head, batch)
with cfg.split_gqa, causal key blocks longest-first (scheduler.py); with
cfg.dynamic_tiles a persistent grid whose CTAs claim those tiles in turn
(scheduler.TileSequence); threads = 128 · (1 + consumer_warpgroups).
  warpgroup 0   producer (setmaxnreg.dec). Warp 0 issues every TMA load:
                K and V of the CTA's key block, then, for each query head
                it walks (all of the KV group's, or its own with split_gqa)
                and each query block that sees these keys,
                Q + LSE₂ into the Q ring and dO + D into the dO ring;
                with cfg.dynamic_tiles it claims the next key block and
                publishes it with that block's K/V barrier.
                Warp 1 is the dQ writer (dq_writer.py): it adds each consumer
                warpgroup's dQ partial from shared memory into the fp32
                accumulator (one bulk reduce-add each), so consumers never
                wait on global memory; with cfg.dq_direct the consumers add
                it from registers (16-byte reductions) and warp 1 only frees
                claimed K/V. All three roles walk the same tiles and query
                blocks (bwd_tiles.py). With cfg.convert_dq warps 2 and 3
                convert each query tile the writer's adds complete into dQ
                (dq_convert.py).
  warpgroups 1+ consumers (setmaxnreg.inc), 64 keys each, or with
                cfg.dim_split 2 two per 64 keys, each with half of the head
                dims of dK and dV. dK and dV stay in registers for the whole
                walk over query blocks.
Pipelines: K/V (1 stage), Q (qdo_stages) and dO (dO_stages()), TMA → consumer-thread
mbarriers (pipeline.py); named barriers BwdBarrier between consumers and
between consumers and the dQ writer.

Per query block, each consumer warpgroup (the computation runs transposed,
keys on WGMMA's M axis, so Pᵀ and dSᵀ come out in the register layout the
next WGMMA takes as its A operand):
    Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ          SS-WGMMA, both in flight
    Pᵀ = exp2(Sᵀ·scale_log2 − LSE₂)    LSE₂ = LSE·log2(e), from the preprocess;
                                       converted to 16 bits at once
    dSᵀ = Pᵀ ∘ (dPᵀ − D)               D = rowsum(dO ∘ O), from the preprocess;
                                       Pᵀ read back from its 16-bit registers
    dV += Pᵀ·dO                        RS-WGMMA, Pᵀ from registers: issued after
                                       dSᵀ, or after dSᵀ → smem (cfg.dv_at_ds_barrier)
    dSᵀ → smem; [DS_READY]  dQ_part = dS·K   (SS-WGMMA over all keys of the CTA;
                                       dQᵀ = Kᵀ·dSᵀ when tile_m is no multiple of 64;
                                       cfg.dq_one_warpgroup: the first alone)
    dK += dSᵀ·Q                        RS-WGMMA, dSᵀ from registers, issued after
                                       dQ, so the dQ partial's stores to shared
                                       memory run under it
    dQ_part → smem [DQ_FULL]; the writer warp reduce-adds it into the fp32 dQ
    accumulator (dq_accum.py) and frees the slab [DQ_EMPTY]
With cfg.dim_split 2 (head dims above 128) the two warpgroups of the 64 keys
each compute Sᵀ and dPᵀ for half of the query columns and write Pᵀ and dSᵀ to
shared memory; after the DS_READY barrier both run dV += Pᵀ·dO and dK += dSᵀ·Q
as SS-WGMMAs over all queries for their half of the head dims. With
cfg.keys_on_n (head dim 192: 96 keys a CTA) each of two warpgroups owns half
of the keys on WGMMA's N axis: S = Q·Kᵀ and dP = dO·Vᵀ, P and dS stored
transposed (stmatrix .trans) into the same ring, then dVᵀ += dOᵀ·P and
dKᵀ += Qᵀ·dS (SS, head dims on M); dQ as above (bwd_partition.py).
At the end dK·scale and dV go to global memory: 16-bit through the K and V
buffers and TMA stores, or with split_gqa as fp32 partials per query head
straight from registers, which the group-sum kernel adds over each group;
the postprocess kernel turns the dQ accumulator into dQ (bwd_pre_post.py),
or with cfg.convert_dq the converter warps do as the tiles complete.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cpipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from . import dq_accum, wgmma
from .block_sparse import apply_bits
from .bwd_partition import (Operands, dkv_shape, dkv_tiled_mma, dq_gemm_shape, dq_tiled_mma,
                            make_operands, pt_buffer, score_shape, sdp_tiled_mma,
                            warpgroup_slab)
from .bwd_config import CONVERT_STAGES, SLOT_FIELDS
from .bwd_tiles import KeyTile, KeyTiles
from .config import PLAIN_FEATURES, WARPGROUP_THREADS, Features
from .dq_convert import CONVERTER_THREADS, CONVERTER_WARPS, DqConverter
from .dq_writer import DqWriter
from .exp2_fma import exp2_of_column
from .kernel_base import (SMEM_ALIGN, Sm90AttentionKernel, permute, store_rows,
                          tma_store_tile, tma_views)
from .mask import (Limits, QueryBlockRange, QueryWalk, Window, apply_mask,
                   apply_mask_transposed)
from .pipeline import (BwdBarrier, consumer_state, make_thread_pipeline, make_tma_pipeline,
                       producer_state, release, wait_full)
from .scheduler import TileQueue, TileScheduler, TileSequence
from .softcap import cap_scores, exp2_with_slope
from .varlen import Seqlens, VarlenScheduler


def query_of(coords, i: int, keys_on_n: bool):
    """The tile query of a thread's score column i (row i with keys_on_n)."""
    return coords[i, 0][0] if keys_on_n else coords[0, i][1]


class _QueryStats:
    """BwdConfig.stats_early off: the statistic of the thread's i-th query
    (query_of), read from shared memory where it is indexed (at trace time,
    i is a Python int), so the loads sit after the WGMMA wait, next to their
    use."""

    def __init__(self, sStat: cute.Tensor, coords, stage, keys_on_n: bool):
        self.sStat, self.coords, self.stage, self.keys_on_n = sStat, coords, stage, keys_on_n

    def __getitem__(self, i: int):
        return self.sStat[query_of(self.coords, i, self.keys_on_n), self.stage]


@dataclass
class Buffers:
    """The CTA's shared memory: K and V of its key block, the Q and dO rings
    with their statistics (LSE₂, D), the two dSᵀ buffers, the dQ slabs."""

    k: cute.Tensor
    v: cute.Tensor
    q: cute.Tensor
    do: cute.Tensor
    lse2: cute.Tensor
    d: cute.Tensor
    dst: cute.Tensor
    dq: cute.Tensor
    # where dK and dV are staged for their stores: k and v, or with
    # dkv_via_scores views of dst
    dk_out: cute.Tensor
    dv_out: cute.Tensor


@dataclass
class Pipes:
    """The TMA → consumer rings: K/V (one stage), Q (+LSE₂), dO (+D)."""

    kv: object
    q: object
    do: object


@dataclass
class Copies:
    """The TMA atoms: loads of Q, K, V, dO, LSE₂, D; the dK and dV stores
    (None with split_gqa, whose fp32 partials leave from registers)."""

    q: cute.CopyAtom
    k: cute.CopyAtom
    v: cute.CopyAtom
    do: cute.CopyAtom
    lse2: cute.CopyAtom
    d: cute.CopyAtom
    dk: object
    dv: object


@dataclass
class Consumer:
    """What one consumer warpgroup keeps across the key blocks it computes."""

    ops: Operands
    mma_sdp: cute.TiledMma
    mma_dk: cute.TiledMma  # dK += dSᵀ·Q (N = head_dim)
    mma_dv: cute.TiledMma  # dV += Pᵀ·dO (N = head_dim_v)
    mma_dq: cute.TiledMma
    acc_dk: cute.Tensor
    acc_dv: cute.Tensor
    score_coords: cute.Tensor  # (M, N) of each of the thread's score registers (score_shape)
    wg: Int32
    tid: Int32  # among the consumer threads
    smem: Buffers
    pipes: Pipes
    copies: Copies
    mdK: cute.Tensor
    mdV: cute.Tensor
    mdK_rows: cute.Tensor  # dK and dV themselves (mdK, mdV: the TMA stores' views)
    mdV_rows: cute.Tensor
    mdQaccum: cute.Tensor  # the fp32 dQ accumulator (dq_direct adds into it)
    seqlens: Seqlens
    softmax_scale_log2: Float32
    softmax_scale: Float32
    limits: Limits
    pre_tanh: Float32  # softcap: scale / softcap


class FlashAttentionBackwardSm90(Sm90AttentionKernel):
    """One compiled kernel per (dtype, head_dim, causal, features, config: BwdConfig)."""

    def __init__(self, dtype, head_dim: int, causal: bool, config, head_dim_v: int | None = None,
                 features: Features = PLAIN_FEATURES):
        super().__init__(dtype, head_dim, causal, config, head_dim_v, features)
        if features.varlen and config.split_gqa:
            raise ValueError(f"BwdConfig.split_gqa: expected False for a varlen kernel (its "
                             f"per-head fp32 partials are laid out for a dense batch), got "
                             f"True (head_dim={head_dim}, config={config})")
        if config.convert_dq and (features.sink or features.block_sparse):
            raise ValueError(f"BwdConfig.convert_dq: expected False with a learnable sink or a "
                             f"block mask (the preprocess zeroes dQ where no key is visible "
                             f"by the LSE, which a sink keeps finite; a block mask's walks are "
                             f"lists), got True ({features})")
        if features.rows_per_query != 1 or features.one_q_tile:
            raise ValueError(f"features.rows_per_query, one_q_tile: expected 1 and False for "
                             f"the backward (only the KV-cache forward packs a token's heads "
                             f"into one tile), got {features.rows_per_query} and "
                             f"{features.one_q_tile}")
        if features.block_sparse and (causal or features.local or features.varlen
                                      or config.deterministic or config.keys_on_n):
            raise ValueError(f"features.block_sparse: expected a dense, non-causal, "
                             f"non-deterministic kernel without a window, scores transposed "
                             f"(the block mask holds every limit, its bits in Sᵀ order; no "
                             f"order of the dQ adds is kept), got causal={causal}, {features}, "
                             f"deterministic={config.deterministic}, "
                             f"keys_on_n={config.keys_on_n}")

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdQ: cute.Tensor,
                 mdK: cute.Tensor, mdV: cute.Tensor, mSemaphore: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedQ: cute.Tensor,
                 mSeqUsedK: cute.Tensor, mBlockSparse: cute.Tensor, softmax_scale_log2: Float32,
                 softmax_scale: Float32, num_sms: Int32, window_left: Int32, window_right: Int32,
                 score_pre_tanh: Float32, seqused: Int32, stream: cuda.CUstream):
        """Torch order: Q (b, s_q, h, d), dO (b, s_q, h, dv); K (b, s_k, h_kv,
        d), V (b, s_k, h_kv, dv); dK, dV (b, s_k, h_kv, d / dv), or with
        split_gqa fp32 (b, s_k, h, d / dv) (dv = head_dim_v);
        LSE₂, D (b, h, s_q padded to tile_m) fp32; dQ accumulator (b, h, s_q padded
        · d) fp32, zeroed; dQ (b, s_q, h, d), written only with convert_dq;
        semaphore (b, h, m_blocks · warpgroups) int32, zeroed (read only in
        deterministic mode; with dynamic_tiles its first element is the tile
        counter, which the preprocess zeroes; with convert_dq, not
        deterministic, (b, h, 1 + m_blocks): the query tiles' counters after
        it, zeroed by the preprocess too). The window
        and scale / softcap as in the forward (local and softcap kernels). A
        varlen kernel's tensors are packed batches of one as in the forward,
        its per-row buffers laid out as varlen.py says, and the cu_seqlens and
        seqused tensors and bits as the forward's. A block_sparse kernel's
        tile lists, int32 (b or 1, (h or 1) · n_blocks, words), one per key
        block and query head (block_sparse.py; others never read it)."""
        mQ, mK, mV, mdO, mdK, mdV, mdQ = [permute(t, [1, 3, 2, 0])
                                          for t in (mQ, mK, mV, mdO, mdK, mdV, mdQ)]
        mLSE2, mD, mdQaccum, mSemaphore = [permute(t, [2, 1, 0])
                                           for t in (mLSE2, mD, mdQaccum, mSemaphore)]
        seqlens = Seqlens(self.features.varlen, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
                          seqused, mQ.shape[0], mK.shape[0])
        tile_m, tile_n, stages = self.tile_m, self.tile_n, self.cfg.qdo_stages
        d, dv = self.head_dim, self.head_dim_v

        # dK and dV read Q and dO MN-major, split along d / dv with dim_split.
        split = self.cfg.dim_split
        sQ_layout = wgmma.smem_layout(self.dtype, tile_m, d, stages, atom_cols=d // split)
        sdO_layout = wgmma.smem_layout(self.dtype, tile_m, dv, self.cfg.dO_stages(),
                                       atom_cols=dv // split)
        # dQ = dS·K reads K MN-major, split across warpgroups along d when not along M.
        k_atom_cols = d if self.cfg.dq_split_m() else d // self.cfg.dq_warpgroups
        sK_layout = wgmma.smem_layout(self.dtype, tile_n, d, atom_cols=k_atom_cols)
        # dV leaves through V's buffer in column slices of dv / dim_split
        sV_layout = wgmma.smem_layout(self.dtype, tile_n, dv, atom_cols=dv // split)
        sdSt_layout = wgmma.smem_layout(self.dtype, tile_n, tile_m, self.cfg.score_buffers())
        # each stage's statistics start 128-byte aligned, as a TMA destination
        # must (tile_m=80: 320 bytes a stage otherwise, a misaligned address)
        do_stages = self.cfg.dO_stages()
        stat_stride = self.cfg.stat_stage_floats()
        sStat_layout = cute.make_layout((tile_m, stages), stride=(1, stat_stride))
        sD_layout = cute.make_layout((tile_m, do_stages), stride=(1, stat_stride))
        mma_sdp = sdp_tiled_mma(self.dtype, self.cfg, tile_m)
        mma_dk = dkv_tiled_mma(self.dtype, self.cfg, d)
        mma_dv = dkv_tiled_mma(self.dtype, self.cfg, dv)
        mma_dq = dq_tiled_mma(self.dtype, self.cfg, d)

        load = cpasync.CopyBulkTensorTileG2SOp()
        q_stage = cute.select(sQ_layout, mode=[0, 1])
        tma_q, tQ = cpasync.make_tiled_tma_atom(load, mQ, q_stage, (tile_m, d))
        tma_do, tdO = cpasync.make_tiled_tma_atom(load, mdO, cute.select(sdO_layout, mode=[0, 1]),
                                                  (tile_m, dv))
        tma_k, tK = cpasync.make_tiled_tma_atom(load, mK, sK_layout, (tile_n, d))
        tma_v, tV = cpasync.make_tiled_tma_atom(load, mV, sV_layout, (tile_n, dv))
        stat_stage = cute.make_layout(tile_m)
        tma_lse, tLSE2 = cpasync.make_tiled_tma_atom(load, mLSE2, stat_stage, (tile_m,))
        tma_d, tD = cpasync.make_tiled_tma_atom(load, mD, stat_stage, (tile_m,))
        # dK and dV through the K and V buffers: the kernel then gets the
        # stores' coordinate tensors as tdK, tdV (and dK and dV themselves,
        # stored row by row where a packed sequence ends).
        store = cpasync.CopyBulkTensorTileS2GOp()
        tma_dk, tdK = (cpasync.make_tiled_tma_atom(store, mdK, sK_layout, (tile_n, d))
                       if self._dkv_tma_store() else (None, mdK))
        tma_dv, tdV = (cpasync.make_tiled_tma_atom(store, mdV, sV_layout, (tile_n, dv))
                       if self._dkv_tma_store() else (None, mdV))

        convert_floats = (self.tile_m * self.head_dim // self.cfg.dq_warpgroups
                          if self.cfg.convert_dq else 4)

        @cute.struct
        class SharedStorage:
            kv_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            # TileQueue (dynamic_tiles), carried by the K/V barrier of one stage
            tile_slots: cute.struct.MemRange[Int32, TileQueue.slots_for(1)]
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            do_barriers: cute.struct.MemRange[cutlass.Int64, 2 * do_stages]
            # convert_dq: the writer -> converter ring (kept always: it fits in
            # the padding before the 1 KB-aligned K)
            convert_barriers: cute.struct.MemRange[cutlass.Int64, 2 * CONVERT_STAGES + 1]
            convert_slots: cute.struct.MemRange[Int32, SLOT_FIELDS * CONVERT_STAGES]
            # one warpgroup region of a dQ tile, brought in by a bulk copy (four
            # floats in the padding without convert_dq)
            sConvert: cute.struct.Align[cute.struct.MemRange[Float32, convert_floats], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)],
                                  SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)],
                                  SMEM_ALIGN]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)],
                                  SMEM_ALIGN]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)],
                                   SMEM_ALIGN]
            sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, stat_stride * stages], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, stat_stride * do_stages], 128]
            sdSt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdSt_layout)],
                                    SMEM_ALIGN]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, self._dq_slab_floats()], 128]

        if cutlass.const_expr(self.features.varlen):
            max_tiles = VarlenScheduler.max_tiles(mK.shape[0], seqlens.num_batch(mK.shape[3]),
                                                  mK.shape[2], tile_n)
        else:
            max_tiles = self._scheduler(mQ, mK, seqlens).num_tiles()
        grid = (TileScheduler.grid(max_tiles, num_sms, self.cfg.dynamic_tiles), 1, 1)
        self.kernel(tQ, tK, tV, tdO, tLSE2, tD, mdQaccum, mdQ, tdK, tdV, mdK, mdV,
                    mSemaphore, mBlockSparse, seqlens,
                    tma_q, tma_k, tma_v, tma_do, tma_lse, tma_d, tma_dk, tma_dv,
                    softmax_scale_log2, softmax_scale, Window(window_left, window_right),
                    score_pre_tanh, sQ_layout, sK_layout, sV_layout, sdO_layout, sdSt_layout,
                    sStat_layout, sD_layout, mma_sdp, mma_dk, mma_dv, mma_dq,
                    SharedStorage).launch(
            grid=list(grid), block=[self.cfg.threads, 1, 1], stream=stream,
            min_blocks_per_mp=1)

    # ---------------------------------------------------------------- kernel
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdQ: cute.Tensor,
               mdK: cute.Tensor,
               mdV: cute.Tensor, mdK_rows: cute.Tensor, mdV_rows: cute.Tensor,
               mSemaphore: cute.Tensor, mBlockSparse: cute.Tensor, seqlens: Seqlens,
               tma_q: cute.CopyAtom,
               tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, tma_do: cute.CopyAtom,
               tma_lse: cute.CopyAtom, tma_d: cute.CopyAtom, tma_dk, tma_dv,
               softmax_scale_log2: Float32, softmax_scale: Float32, window: Window,
               score_pre_tanh: Float32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sdSt_layout: cute.ComposedLayout, sStat_layout: cute.Layout, sD_layout: cute.Layout,
               mma_sdp: cute.TiledMma, mma_dk: cute.TiledMma, mma_dv: cute.TiledMma,
               mma_dq: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        copies = Copies(tma_q, tma_k, tma_v, tma_do, tma_lse, tma_d, tma_dk, tma_dv)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do, tma_lse, tma_d):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(SharedStorage)
        arrivals = self.consumer_threads
        elem = self.dtype.width // 8
        stat_bytes = self.tile_m * 4
        pipes = Pipes(
            # With dynamic_tiles the dQ writer also frees K/V (one arrive per
            # tile, once it has read the tile's index: TileQueue's slots).
            make_tma_pipeline(storage.kv_barriers.data_ptr(), 1,
                              arrivals + (1 if self.cfg.dynamic_tiles else 0),
                              self.tile_n * (self.head_dim + self.head_dim_v) * elem),
            make_tma_pipeline(storage.q_barriers.data_ptr(), self.cfg.qdo_stages,
                              arrivals, self.tile_m * self.head_dim * elem + stat_bytes),
            make_tma_pipeline(storage.do_barriers.data_ptr(), self.cfg.dO_stages(),
                              arrivals, self.tile_m * self.head_dim_v * elem + stat_bytes),
        )
        # convert_dq's ring and staging barrier: initialised only where it is on
        convert_pipe = convert_slots = convert_loaded = None
        if cutlass.const_expr(self.cfg.convert_dq):
            convert_pipe = make_thread_pipeline(storage.convert_barriers.data_ptr(),
                                                CONVERT_STAGES, 1, CONVERTER_THREADS)
            convert_slots = storage.convert_slots.get_tensor(
                cute.make_layout((SLOT_FIELDS, CONVERT_STAGES)))
            convert_loaded = storage.convert_barriers.data_ptr() + 2 * CONVERT_STAGES
            if cute.arch.thread_idx()[0] == 0:
                cute.arch.mbarrier_init(convert_loaded, 1)
                cute.arch.mbarrier_init_fence()
        cpipeline.pipeline_init_arrive()
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        dkv_out = (sK, sV)
        if cutlass.const_expr(self.cfg.dkv_via_scores):
            dkv_out = self._dkv_in_scores(storage.sdSt.data_ptr(), sK_layout, sV_layout)
        smem = Buffers(
            sK, sV,
            storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner),
            storage.sLSE2.get_tensor(sStat_layout),
            storage.sD.get_tensor(sD_layout),
            storage.sdSt.get_tensor(sdSt_layout.outer, swizzle=sdSt_layout.inner),
            storage.sdQ.get_tensor(cute.make_layout(self._dq_slab_floats())),
            *dkv_out,
        )
        tiles = KeyTiles(TileSequence(self._scheduler(mQ, mK, seqlens),
                                      TileQueue(mSemaphore, storage.tile_slots.get_tensor(
                                          cute.make_layout(TileQueue.slots_for(1)))),
                                      self.cfg.dynamic_tiles),
                         seqlens, mQ.shape[2] // mK.shape[2], self.cfg.split_gqa, mBlockSparse,
                         self.features.block_sparse, self.tile_m, self.tile_n)
        cpipeline.pipeline_init_wait()  # barriers initialised before anyone uses them
        limits = Limits(self.causal, self.features.local, window)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                self.produce(mQ, mK, mV, mdO, mLSE2, mD, copies, smem, pipes, tiles, limits)
            if warp_idx == 1:
                self.dq_writer.run(mdQaccum, mSemaphore, smem.dq, pipes.kv, tiles, limits,
                                   convert_pipe, convert_slots)
            if cutlass.const_expr(self.cfg.convert_dq):
                if warp_idx >= CONVERTER_WARPS[0]:
                    self.dq_converter.run(convert_pipe, convert_slots, mdQaccum, mdQ, seqlens,
                                          softmax_scale, mma_dq, storage.sConvert.data_ptr(),
                                          convert_loaded)
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            self.consume(mdK, mdV, mdK_rows, mdV_rows, mdQaccum, copies, seqlens,
                         softmax_scale_log2,
                         softmax_scale, limits, score_pre_tanh, smem, pipes, mma_sdp, mma_dk,
                         mma_dv, mma_dq, tiles)

    @property
    def exp2_on_fma(self) -> int:
        """The config's share of P's exponentials on the FMA pipe: bf16 only
        (BwdConfig.exp2_on_fma)."""
        return self.cfg.exp2_on_fma if self.dtype is cutlass.BFloat16 else 0

    @property
    def dq_writer(self) -> DqWriter:
        return DqWriter.of(self.cfg, self.tile_m, self.tile_n, self.head_dim,
                           self.dq_converter if self.cfg.convert_dq else None)

    @property
    def dq_converter(self) -> DqConverter:
        return DqConverter(self.tile_m, self.head_dim, self.cfg.dq_warpgroups,
                           self.cfg.dq_transposed(), *dq_gemm_shape(self.cfg, self.head_dim))

    def _dq_slab_floats(self) -> int:
        """The dQ slabs' floats: every warpgroup's partial of a query block,
        or with dq_direct none (four, for a well-formed struct)."""
        return 4 if self.cfg.dq_direct else self.tile_m * self.head_dim

    def _dkv_in_scores(self, base: cute.Pointer, sK_layout: cute.ComposedLayout,
                       sV_layout: cute.ComposedLayout):
        """dkv_via_scores: (dK's, dV's) shared-memory tiles for their stores
        (Buffers.dk_out, dv_out) in the dSᵀ buffers at `base`, dV after dK
        where both fit, else both from the start."""
        dv_offset = 0
        if cutlass.const_expr(self.cfg.dkv_at_once(self.head_dim, self.head_dim_v)):
            dv_offset = cute.cosize(sK_layout)
        return tuple(cute.make_tensor(cute.recast_ptr(base + offset, layout.inner,
                                                      dtype=self.dtype), layout.outer)
                     for offset, layout in ((0, sK_layout), (dv_offset, sV_layout)))

    def _scheduler(self, mQ: cute.Tensor, mK: cute.Tensor, seqlens: Seqlens):
        """One CTA per (key block, KV head or with split_gqa query head, batch),
        causal key blocks longest-first. Every key block of a query head reads
        its Q and dO and adds into its dQ accumulator: that is what the CTAs of
        an L2 section share. Over a packed batch: sequence after sequence
        (varlen.VarlenScheduler)."""
        if cutlass.const_expr(self.features.varlen):
            return VarlenScheduler(seqlens, True, self.tile_n, mK.shape[2],
                                   seqlens.num_batch(mK.shape[3]), False)
        q_per_kv = mQ.shape[2] // mK.shape[2]
        split = self.cfg.split_gqa
        query_rows = mQ.shape[0] if split else mQ.shape[0] * q_per_kv
        # a query row's Q and dO, and its fp32 dQ accumulator
        row_bytes = (self.head_dim + self.head_dim_v) * (self.dtype.width // 8) + 4 * self.head_dim
        return TileScheduler.create(
            cute.ceil_div(mK.shape[0], self.tile_n), mQ.shape[2] if split else mK.shape[2],
            mK.shape[3], query_rows, 1, row_bytes, self.cfg.l2_section_mb * 1024 * 1024,
            longest_first=self.causal, first_block_longest=True)

    # -------------------------------------------------------------- producer
    @cute.jit
    def produce(self, mQ, mK, mV, mdO, mLSE2, mD, copies: Copies, smem: Buffers, pipes: Pipes,
                tiles: KeyTiles, limits: Limits):
        """Warp 0: the CTA's key block (one CTA per tile), or with
        dynamic_tiles each tile it claims and, past the last, the end
        (TileQueue)."""
        q_state = producer_state(self.cfg.qdo_stages)
        do_state = producer_state(self.cfg.dO_stages())
        kv_state = producer_state(1)
        num_tiles = tiles.num_tiles()
        if cutlass.const_expr(self.cfg.dynamic_tiles):
            round_idx = Int32(0)
            tile = tiles.first()
            while tile < num_tiles:
                tiles.sequence.queue.publish(round_idx, tile)
                q_state, do_state = self._produce_tile(
                    mQ, mK, mV, mdO, mLSE2, mD, copies, smem, pipes, tiles.decode(tile),
                    q_state, do_state, kv_state, limits, tiles)
                kv_state.advance()
                round_idx += 1
                tile = tiles.sequence.claimed(round_idx)
            tiles.sequence.queue.finish(round_idx, tile, pipes.kv, kv_state)
        else:
            self._produce_tile(mQ, mK, mV, mdO, mLSE2, mD, copies, smem, pipes,
                               tiles.own(num_tiles), q_state, do_state, kv_state, limits, tiles)

    @cute.jit
    def _produce_tile(self, mQ, mK, mV, mdO, mLSE2, mD, copies: Copies, smem: Buffers,
                      pipes: Pipes, tile: KeyTile, q_state, do_state, kv_state,
                      limits: Limits, tiles: KeyTiles):
        d = self.head_dim
        seqlens = tiles.seqlens
        n_block, batch = tile.n_block, tile.batch

        tKs, tKg = tma_views(copies.k, smem.k, cute.local_tile(
            seqlens.k_rows(mK, tile.head_kv, batch), (self.tile_n, d), (n_block, 0)),
            staged=False)
        tVs, tVg = tma_views(copies.v, smem.v, cute.local_tile(
            seqlens.k_rows(mV, tile.head_kv, batch), (self.tile_n, self.head_dim_v),
            (n_block, 0)),
            staged=False)
        pipes.kv.producer_acquire(kv_state)
        kv_bar = pipes.kv.producer_get_barrier(kv_state)
        cute.copy(copies.k, tKg, tKs, tma_bar_ptr=kv_bar)
        cute.copy(copies.v, tVg, tVs, tma_bar_ptr=kv_bar)

        m_min, m_count = tiles.query_blocks(n_block, tile.seqlen_q, tile.seqlen_k, limits)
        stats_start = seqlens.padded_start_q(batch, self.tile_m)
        for h in cutlass.range(tile.head_count, unroll=1):
            head = tile.first_head + h
            tQs, tQg = tma_views(copies.q, smem.q, cute.local_tile(
                seqlens.q_rows(mQ, head, batch), (self.tile_m, d), (None, 0)), staged=True)
            tdOs, tdOg = tma_views(copies.do, smem.do, cute.local_tile(
                seqlens.q_rows(mdO, head, batch), (self.tile_m, self.head_dim_v), (None, 0)),
                staged=True)
            tLs, tLg = tma_views(copies.lse2, smem.lse2, cute.local_tile(
                seqlens.row_stats(mLSE2, stats_start, head, batch), (self.tile_m,), (None,)),
                staged=True)
            tDs, tDg = tma_views(copies.d, smem.d, cute.local_tile(
                seqlens.row_stats(mD, stats_start, head, batch), (self.tile_m,), (None,)),
                staged=True)
            walk = tiles.query_walk(tile, head, m_min, m_count)
            for i in cutlass.range(walk.count, unroll=1):
                m_block = walk.m_block(i)
                pipes.q.producer_acquire(q_state)
                q_bar = pipes.q.producer_get_barrier(q_state)
                cute.copy(copies.q, tQg[None, m_block], tQs[None, q_state.index],
                          tma_bar_ptr=q_bar)
                cute.copy(copies.lse2, tLg[None, m_block], tLs[None, q_state.index],
                          tma_bar_ptr=q_bar)
                q_state.advance()
                pipes.do.producer_acquire(do_state)
                do_bar = pipes.do.producer_get_barrier(do_state)
                cute.copy(copies.do, tdOg[None, m_block], tdOs[None, do_state.index],
                          tma_bar_ptr=do_bar)
                cute.copy(copies.d, tDg[None, m_block], tDs[None, do_state.index],
                          tma_bar_ptr=do_bar)
                do_state.advance()
        return q_state, do_state

    # ------------------------------------------------------------- consumers
    @cute.jit
    def consume(self, mdK, mdV, mdK_rows, mdV_rows, mdQaccum, copies: Copies, seqlens: Seqlens,
                softmax_scale_log2: Float32, softmax_scale: Float32, limits: Limits,
                pre_tanh: Float32, smem: Buffers,
                pipes: Pipes, mma_sdp: cute.TiledMma, mma_dk: cute.TiledMma,
                mma_dv: cute.TiledMma, mma_dq: cute.TiledMma, tiles: KeyTiles):
        tid = cute.arch.thread_idx()[0] - WARPGROUP_THREADS
        wg = cute.arch.make_warp_uniform(tid // WARPGROUP_THREADS)
        cfg = self.cfg
        me = Consumer(make_operands(cfg, smem.k, smem.v, smem.q, smem.do, smem.dst, mma_sdp,
                                    mma_dk, mma_dv, mma_dq, wg),
                      mma_sdp, mma_dk, mma_dv, mma_dq,
                      cute.make_rmem_tensor(mma_dk.get_slice(wg * WARPGROUP_THREADS)
                                            .partition_shape_C(dkv_shape(cfg, self.head_dim)),
                                            Float32),
                      cute.make_rmem_tensor(mma_dv.get_slice(wg * WARPGROUP_THREADS)
                                            .partition_shape_C(dkv_shape(cfg, self.head_dim_v)),
                                            Float32),
                      mma_sdp.get_slice(tid).partition_C(
                          cute.make_identity_tensor(score_shape(cfg))),
                      wg, tid, smem, pipes, copies, mdK, mdV, mdK_rows, mdV_rows, mdQaccum,
                      seqlens,
                      softmax_scale_log2, softmax_scale, limits, pre_tanh)
        q_state = consumer_state(self.cfg.qdo_stages)
        do_state = consumer_state(self.cfg.dO_stages())
        step = Int32(0)
        num_tiles = tiles.num_tiles()
        if cutlass.const_expr(self.cfg.dynamic_tiles):
            kv_state = consumer_state(1)
            round_idx = Int32(0)
            # the tile comes with its K and V
            tile = tiles.sequence.received(round_idx, pipes.kv, kv_state)
            while tile < num_tiles:
                q_state, do_state, step = self._consume_tile(me, tiles, tiles.decode(tile),
                                                             q_state, do_state, step, kv_state)
                kv_state.advance()
                round_idx += 1
                tile = tiles.sequence.received(round_idx, pipes.kv, kv_state)
        else:
            wait_full(pipes.kv, consumer_state(1))
            self._consume_tile(me, tiles, tiles.own(num_tiles), q_state, do_state, step, None)

    @cute.jit
    def _consume_tile(self, me: Consumer, tiles: KeyTiles, tile: KeyTile, q_state, do_state,
                      step: Int32, kv_state):
        """One key block: every query block that sees it, then dK and dV out.
        kv_state: the K/V stage to release (None: one block a CTA, nothing
        loads after it). Returns the Q/dO ring states and the step count
        (which dSᵀ buffer)."""
        tile_m, tile_n = self.tile_m, self.tile_n
        n_block = tile.n_block
        me.acc_dk.fill(0.0)
        me.acc_dv.fill(0.0)
        seqlen_q, seqlen_k = tile.seqlen_q, tile.seqlen_k
        m_min, m_count = tiles.query_blocks(n_block, seqlen_q, seqlen_k, me.limits)
        blocks = QueryBlockRange(tile_m, tile_n, me.limits)
        m_unmasked = blocks.m_block_min_unmasked(n_block, seqlen_q, seqlen_k)
        m_left_masked = blocks.m_block_left_masked(n_block, seqlen_q, seqlen_k)
        seqlen_edge = (n_block + 1) * tile_n > seqlen_k
        for h in cutlass.range(tile.head_count, unroll=1):
            dq_head = self.dq_head_start(me, tile, tile.first_head + h)
            walk = tiles.query_walk(tile, tile.first_head + h, m_min, m_count)
            for i in cutlass.range(walk.count, unroll=1):
                m_block = walk.m_block(i)
                if cutlass.const_expr(self.features.block_sparse):
                    needs_mask = i < walk.sparse.n_partial  # the seqlen edge in its bits
                else:
                    needs_mask = seqlen_edge
                    if cutlass.const_expr(me.limits.has_right):
                        needs_mask = needs_mask or m_block < m_unmasked
                    if cutlass.const_expr(me.limits.local):
                        needs_mask = needs_mask or m_block >= m_left_masked
                self.step(me, q_state, do_state, step % self.cfg.ds_buffers, needs_mask, tile,
                          dq_head, m_block, walk, i)
                q_state.advance()
                do_state.advance()
                step += 1
        acc_dk = me.acc_dk  # a plain local: the loop below writes it
        for i in cutlass.range(cute.size(acc_dk), unroll_full=True):
            acc_dk[i] = acc_dk[i] * me.softmax_scale
        release_kv_first = self.cfg.dkv_via_scores and kv_state is not None
        if cutlass.const_expr(release_kv_first):
            # this thread's GEMMs, the last readers of K and V, have retired
            release(me.pipes.kv, kv_state)
        if cutlass.const_expr(self._dkv_tma_store()):
            self.store_dkv_via_smem(me, tile)
        else:
            self.store_dkv(me, tile)
        if cutlass.const_expr(kv_state is not None and not release_kv_first):
            # K and V are read (the dK/dV stores' reads of them waited for
            # in store_dkv_via_smem): the next tile may load over them.
            release(me.pipes.kv, kv_state)
        return q_state, do_state, step

    @cute.jit
    def query_stats(self, sStat: cute.Tensor, coords, stage: Int32):
        """The statistic (LSE₂ or D) of each of this thread's score columns
        (rows with keys_on_n): with stats_early a register copy, loaded here;
        otherwise a view that reads shared memory where it is indexed
        (holding all of a 64-key tile's columns in registers for the whole
        step spills)."""
        keys_on_n = self.cfg.keys_on_n
        if cutlass.const_expr(not self.cfg.stats_early):
            return _QueryStats(sStat, coords, stage, keys_on_n)
        count = cute.size(coords, mode=[0 if keys_on_n else 1])
        values = cute.make_rmem_tensor((count,), Float32)
        for i in cutlass.range_constexpr(count):
            values[i] = sStat[query_of(coords, i, keys_on_n), stage]
        return values

    @cute.jit
    def step(self, me: Consumer, q_state, do_state, ds_buffer: Int32, needs_mask,
             tile: KeyTile, dq_head, m_block: Int32, walk: QueryWalk, entry: Int32):
        """One query block: its GEMMs retired (all five, or four where
        another warpgroup computes dQ) and the dQ partial handed to the
        writer warp. (Issuing the next block's Sᵀ across the loop edge
        makes ptxas serialise every WGMMA of the kernel: measured 35 % slower.)
        The scores are Sᵀ (keys on M, a query per column), or with keys_on_n S
        (a query per row): each register's statistics are indexed by its
        column or its row."""
        tile_m, tile_n = self.tile_m, self.tile_n
        ops, pipes, smem = me.ops, me.pipes, me.smem
        keys_on_n = self.cfg.keys_on_n
        acc_s = cute.make_rmem_tensor(me.mma_sdp.partition_shape_C(score_shape(self.cfg)),
                                      Float32)
        acc_dp = cute.make_rmem_tensor_like(acc_s)
        wait_full(pipes.q, q_state)
        # Per-query statistics, one per query of this thread's scores: read
        # here (stats_early) or at their use. Here is ahead of the GEMM
        # issue: an LDS issued behind HGMMAs queues behind them until the
        # tensor core accepts them, so the first exp2 waited for the dPᵀ
        # GEMM to start (ncu: short-scoreboard stalls on that FFMA).
        coords = wgmma.acc_rows_cols(me.score_coords)
        lse2 = self.query_stats(smem.lse2, coords, q_state.index)
        # the scores and dP, both left in flight
        s_a, s_b = ops.scores(q_state.index)
        wgmma.gemm(me.mma_sdp, acc_s, s_a, s_b, zero_init=True, wait_groups=-1)
        wait_full(pipes.do, do_state)
        dp_a, dp_b = ops.dp(do_state.index)
        wgmma.gemm(me.mma_sdp, acc_dp, dp_a, dp_b, zero_init=True, wait_groups=-1)
        warpgroup.wait_group(1)  # the scores have landed
        softcap = self.features.softcap
        if cutlass.const_expr(softcap):
            cap_scores(acc_s, me.pre_tanh)  # t, the capped score / softcap
        if needs_mask:
            coords0 = wgmma.static_coords(me.mma_sdp, score_shape(self.cfg))
            if cutlass.const_expr(self.features.block_sparse):
                apply_bits(acc_s, me.score_coords, coords0, walk.sparse, entry, tile_n, tile_m)
            elif cutlass.const_expr(keys_on_n):
                apply_mask(acc_s, me.score_coords, coords0, m_block, tile.n_block,
                           tile.seqlen_q, tile.seqlen_k, tile_m, tile_n, me.limits)
            else:
                apply_mask_transposed(acc_s, me.score_coords, tile.n_block, m_block,
                                      tile.seqlen_q, tile.seqlen_k, tile_n, tile_m, me.limits)
        if cutlass.const_expr(softcap):
            # P · (1 − t²), what dS multiplies, in 16 bits
            ds_factor = cute.make_rmem_tensor_like(acc_s, self.dtype)
            exp2_with_slope(acc_s, me.softmax_scale_log2, lse2, keys_on_n, ds_factor,
                            self.exp2_on_fma)
        else:
            p = wgmma.acc_rows_cols(acc_s)
            for j in cutlass.range_constexpr(cute.size(p, mode=[1])):
                for r in cutlass.range_constexpr(cute.size(p, mode=[0])):
                    lse2_q = lse2[r] if keys_on_n else lse2[j]
                    p[r, j] = exp2_of_column(p[r, j] * me.softmax_scale_log2 - lse2_q, j,
                                             self.exp2_on_fma)
        dsum = self.query_stats(smem.d, coords, do_state.index)
        # The 16-bit P (dV's operand) is made at once, and dS reads it back:
        # the fp32 P is then dead before dP lands. Where the dV GEMM reads it
        # from shared memory, it goes there under the dP GEMM.
        shared = self.cfg.shares_scores()
        p_16bit = cute.make_rmem_tensor_like(acc_s, self.dtype) if shared else ops.dv_a
        wgmma.convert_to_16bit(acc_s, p_16bit)
        if cutlass.const_expr(not softcap):
            ds_factor = p_16bit
        if cutlass.const_expr(shared):
            self.store_slab(me, p_16bit, pt_buffer(self.cfg, ds_buffer))
        warpgroup.wait_group(0)  # dP has landed
        ds = wgmma.acc_rows_cols(acc_dp)
        for j in cutlass.range_constexpr(cute.size(ds, mode=[1])):
            for r in cutlass.range_constexpr(cute.size(ds, mode=[0])):
                dsum_q = dsum[r] if keys_on_n else dsum[j]
                factor = wgmma.read_16bit_as_f32(ds_factor, acc_s.layout.shape, r, j)
                ds[r, j] = factor * (ds[r, j] - dsum_q)
        if cutlass.const_expr(not shared and not self.cfg.dv_at_ds_barrier):
            self.issue_dv(me, do_state, ds_buffer)
        if cutlass.const_expr(shared):
            ds_16bit = cute.make_rmem_tensor_like(acc_dp, self.dtype)
            wgmma.convert_to_16bit(acc_dp, ds_16bit)
        else:
            wgmma.convert_to_16bit(acc_dp, ops.dk_a)
            # the register A fragment holds the values in accumulator order
            ds_16bit = cute.make_tensor(ops.dk_a.iterator, cute.make_layout(acc_dp.shape))

        if cutlass.const_expr(self.cfg.ds_buffers == 1):
            # every warpgroup's dQ GEMM of the step before, which read all of
            # dSᵀ, has retired (each waited for its GEMMs at that step's end)
            cute.arch.barrier(barrier_id=int(BwdBarrier.DS_FREE),
                              number_of_threads=self.consumer_threads)
        # dSᵀ to shared memory for dQ, which needs every warpgroup's keys
        self.store_slab(me, ds_16bit, ds_buffer)
        if cutlass.const_expr(not shared and self.cfg.dv_at_ds_barrier):
            # the tensor core runs dV while this warpgroup waits for the others
            self.issue_dv(me, do_state, ds_buffer)
        # generic-proxy stores, read next by WGMMA through the async proxy
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(BwdBarrier.DS_READY),
                          number_of_threads=self.consumer_threads)
        if cutlass.const_expr(shared):
            self.issue_dv(me, do_state, ds_buffer)  # P of every warpgroup is in
        if cutlass.const_expr(self.cfg.dq_one_warpgroup):
            if me.wg == 0:
                self.dq_then_dk(me, q_state, do_state, ds_buffer, dq_head, m_block)
            else:
                self.issue_dk(me, q_state, ds_buffer)
                warpgroup.wait_group(1)  # dV retired, dK runs on
                release(pipes.do, do_state)
        else:
            self.dq_then_dk(me, q_state, do_state, ds_buffer, dq_head, m_block)
        warpgroup.wait_group(0)
        release(pipes.q, q_state)

    @cute.jit
    def dq_then_dk(self, me: Consumer, q_state, do_state, ds_buffer: Int32, dq_head,
                   m_block: Int32):
        """This warpgroup's dQ partial issued, dK += dSᵀ·Q behind it so that
        the partial's hand-off runs under dK; dO released once dV and dQ
        retired (groups retire in order)."""
        tile_m, wgs = self.tile_m, self.cfg.dq_warpgroups
        acc_dq = cute.make_rmem_tensor(
            me.mma_dq.partition_shape_C(dq_gemm_shape(self.cfg, self.head_dim)), Float32)
        dq_a, dq_b = me.ops.dq(ds_buffer)
        wgmma.gemm(me.mma_dq, acc_dq, dq_a, dq_b, zero_init=True, wait_groups=-1)
        self.issue_dk(me, q_state, ds_buffer)
        warpgroup.wait_group(1)
        release(me.pipes.do, do_state)
        if cutlass.const_expr(self.cfg.dq_direct):
            dq_accum.reduce_add_registers(
                acc_dq, dq_head + m_block * (tile_m * self.head_dim), me.wg,
                me.tid % WARPGROUP_THREADS, tile_m, self.head_dim, wgs)
        else:
            self.dq_writer.stage(acc_dq, me.smem.dq, me.wg, me.tid)

    @cute.jit
    def issue_dk(self, me: Consumer, q_state, ds_buffer: Int32):
        """dK += dSᵀ·Q (dKᵀ += Qᵀ·dS with keys_on_n), left in flight."""
        dk_a, dk_b = me.ops.dk(q_state.index, ds_buffer)
        wgmma.gemm(me.mma_dk, me.acc_dk, dk_a, dk_b, zero_init=False, wait_groups=-1)

    @cute.jit
    def issue_dv(self, me: Consumer, do_state, ds_buffer: Int32):
        """dV += Pᵀ·dO (dVᵀ += dOᵀ·P with keys_on_n), P from registers or from
        its stage of the ring beside dSᵀ's, left in flight."""
        dv_a, dv_b = me.ops.dv(do_state.index, ds_buffer)
        wgmma.gemm(me.mma_dv, me.acc_dv, dv_a, dv_b, zero_init=False, wait_groups=-1)

    @cute.jit
    def store_slab(self, me: Consumer, values: cute.Tensor, buffer):
        """This warpgroup's 16-bit score-shaped values (P or dS, accumulator
        order) into stage `buffer` of the (tile_n, tile_m) ring, transposed
        where the scores are S (warpgroup_slab)."""
        slab, transpose = warpgroup_slab(self.cfg, me.smem.dst[None, None, buffer],
                                         self.tile_m, me.wg)
        wgmma.stmatrix_store(self.dtype, values, slab, me.tid % WARPGROUP_THREADS,
                             transpose=transpose)

    @cute.jit
    def dq_head_start(self, me: Consumer, tile: KeyTile, head: Int32):
        """dq_direct: where query block 0 of this head and sequence starts in
        the dQ accumulator (query block m's tile follows m tiles on; the
        layout the writer warp's slabs have, dq_accum.py), once per head so
        that the step adds one offset. None otherwise."""
        if cutlass.const_expr(not self.cfg.dq_direct):
            return None
        first_row = me.seqlens.padded_start_q(tile.batch, self.tile_m)
        return me.mdQaccum.iterator + cute.crd2idx(
            (first_row * self.head_dim, head, me.seqlens.buffer_batch(tile.batch)),
            me.mdQaccum.layout)

    # -------------------------------------------------------------- epilogue
    def _dkv_tma_store(self) -> bool:
        """dK and dV leave through shared memory and TMA stores (16-bit), or
        with split_gqa as fp32 partials straight from registers."""
        return not self.cfg.split_gqa

    @cute.jit
    def store_dkv_via_smem(self, me: Consumer, tile: KeyTile):
        """dK (scaled) and dV, 16-bit, into shared memory with stmatrix (each
        warpgroup its 64 rows): the K and V buffers, or with dkv_via_scores
        the dSᵀ buffers (Buffers.dk_out, dv_out; dK, then dV where both do
        not fit at once); then one TMA store each from the first consumer
        warp; TMA clips the rows past the tensor's end. A packed sequence's
        last, partial key block leaves row by row, from every consumer
        thread (kernel_base.store_rows)."""
        outputs = []
        for acc in (me.acc_dk, me.acc_dv):
            values = cute.make_rmem_tensor_like(acc, self.dtype)
            wgmma.convert_to_16bit(acc, values)
            outputs.append(values)
        # dQ = dS·K of every warpgroup's last block reads all of K and the
        # dSᵀ buffers: all consumers' GEMMs have retired before any
        # overwrites them.
        cute.arch.barrier(barrier_id=int(BwdBarrier.EPILOGUE),
                          number_of_threads=self.consumer_threads)
        groups = ((0, 1),)
        if cutlass.const_expr(self.cfg.dkv_via_scores and
                              not self.cfg.dkv_at_once(self.head_dim, self.head_dim_v)):
            groups = ((0,), (1,))
        buffers = (me.smem.dk_out, me.smem.dv_out)
        dims = (self.head_dim, self.head_dim_v)
        for group in groups:
            for i in group:
                slab, transpose = warpgroup_slab(self.cfg, buffers[i], dims[i], me.wg)
                wgmma.stmatrix_store(self.dtype, outputs[i], slab, me.tid % WARPGROUP_THREADS,
                                     transpose=transpose)
            # stmatrix writes go through the generic proxy; TMA reads through the async one.
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(BwdBarrier.EPILOGUE),
                              number_of_threads=self.consumer_threads)
            self._store_dkv_tile(tuple(buffers[i] for i in group),
                                 tuple((me.mdK, me.mdV)[i] for i in group),
                                 tuple((me.mdK_rows, me.mdV_rows)[i] for i in group),
                                 tuple((me.copies.dk, me.copies.dv)[i] for i in group),
                                 tuple(dims[i] for i in group), me.seqlens, tile, me.tid)
            if cutlass.const_expr(self.cfg.dkv_via_scores):
                # the stores have read the dSᵀ buffers before the next group
                # or the next block's dSᵀ overwrites them
                cute.arch.barrier(barrier_id=int(BwdBarrier.EPILOGUE),
                                  number_of_threads=self.consumer_threads)

    @cute.jit
    def _store_dkv_tile(self, buffers, tma_dsts, row_dsts, atoms, dims, seqlens: Seqlens,
                        tile: KeyTile, tid: Int32):
        """The stores of store_dkv_via_smem, of dK and dV or of one of them:
        buffers, their shared-memory tiles; tma_dsts, the TMA stores'
        coordinate tensors; row_dsts, the tensors themselves; atoms, the
        stores. (A function of its own: a branch where the Consumer is in
        scope would carry all of its state.)"""
        n_block, head_kv, batch = tile.n_block, tile.cta_head, tile.batch
        rows_out = tile.seqlen_k - n_block * self.tile_n
        by_rows = cutlass.Boolean(False)
        if cutlass.const_expr(self.features.varlen):
            by_rows = rows_out < self.tile_n
        if by_rows:
            # each thread's loads of the buffers are done before it goes on
            for s, m_out, dim in zip(buffers, row_dsts, dims):
                store_rows(s, cute.local_tile(seqlens.k_rows(m_out, head_kv, batch),
                                              (self.tile_n, dim), (n_block, 0)),
                           rows_out, tid, self.consumer_threads)
        elif tid < 32:
            for atom, s, m_out, dim in zip(atoms, buffers, tma_dsts, dims):
                tma_store_tile(atom, s, cute.local_tile(seqlens.k_rows(m_out, head_kv, batch),
                                                        (self.tile_n, dim), (n_block, 0)))
            cute.arch.cp_async_bulk_commit_group()
            # shared memory must outlive the stores' reads of it
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def store_dkv(self, me: Consumer, tile: KeyTile):
        """split_gqa: dK (scaled) and dV straight from registers (once per
        CTA), the fp32 partials of query head tile.cta_head (dense batches)."""
        n_block, out_head, batch = tile.n_block, tile.cta_head, tile.batch
        rows_valid = tile.seqlen_k - n_block * self.tile_n
        for acc, m_out, mma, dim in ((me.acc_dk, me.mdK, me.mma_dk, self.head_dim),
                                     (me.acc_dv, me.mdV, me.mma_dv, self.head_dim_v)):
            g_tile = cute.local_tile(m_out[None, None, out_head, batch],
                                     (self.tile_n, dim), (n_block, 0))
            wgmma.store_acc_tile(acc, mma.get_slice(me.tid), g_tile, rows_valid)
