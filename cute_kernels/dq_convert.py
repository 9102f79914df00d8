"""dQ converted inside the backward's main kernel (BwdConfig.convert_dq).

Without it, every key block adds its partial into the fp32 accumulator and
a postprocess kernel reads the whole accumulator back from memory, scales
it and writes dQ. At short sequences that pass costs a sixth of the main
kernel's time (docs/findings.md, "Backward"): the accumulator is twice dQ's
size, and by the time the postprocess runs most of it has left L2.

With convert_dq the key block whose partial completes a query tile
converts that tile at once, while the tile is still in L2:
- The dQ writer warp (dq_writer.py), once its reduce-add of a query tile
  has completed, counts it on the tile's counter (one int32 per query
  tile, head and sequence in the semaphore tensor (dq_accum.tile_slot),
  zeroed by the preprocess). The tile has as many contributions as key
  blocks that walk it (mask.BlockRange: the deterministic order's turns
  count the same blocks); the one that brings the count there sends the
  tile to the converter. In deterministic mode the last turn is known
  without counting.
- The converter, warps 2 and 3 of the producer warpgroup (otherwise idle),
  brings the tile into shared memory one warpgroup's region at a time (one
  bulk copy each: 24 registers a thread leave room for one or two loads
  in flight, and the tile's 128 loads a thread from L2 took longer than
  the tiles came), drops the region's lines from L2 (discard.global.L2:
  nobody reads them again, and written back they would cost as much DRAM
  traffic as the postprocess's read), reads it in the accumulator's
  register order (dq_accum.py), maps each value to its (row, column)
  through the dQ GEMM's own partition, and writes dQ · scale as 16-bit
  pairs, rows past the sequence left out.
The writer hands tiles over through a ring of CONVERT_STAGES slots guarded
by mbarriers (bwd_config.py), and ends it with a negative query block.

Query tiles no key block walks (no key visible to any of their rows) never
complete a count: their rows have no visible key, so their LSE is -inf, and
the preprocess writes their dQ rows as zeros (bwd_pre_post.py). A learnable
sink gives such rows a finite LSE: those kernels keep the postprocess.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from . import dq_accum, wgmma
from .bwd_config import CONVERT_STAGES
from .config import WARPGROUP_THREADS
from .dsl_struct import DslStruct
from .pipeline import BwdBarrier, consumer_state, release, wait_full
from .varlen import Seqlens

CONVERTER_WARPS = (2, 3)  # of the producer warpgroup
CONVERTER_THREADS = 32 * len(CONVERTER_WARPS)
L2_LINE_BYTES = 128


@dataclass
class DqConverter(DslStruct):
    """The conversion of one backward kernel (its BwdConfig's choices)."""

    tile_m: int
    head_dim: int
    warpgroups: int  # the dQ warpgroups: their partials make up a tile
    transposed: bool  # BwdConfig.dq_transposed: the GEMM computes dQᵀ
    gemm_m: int  # (M, N) of the dQ GEMM (bwd_partition.dq_gemm_shape)
    gemm_n: int

    def values_per_thread(self) -> int:
        return dq_accum.values_per_thread(self.tile_m, self.head_dim, self.warpgroups)

    # ------------------------------------------------------------ writer side
    @cute.jit
    def send(self, pipe, sent: Int32, slots: cute.Tensor, m_block: Int32, head: Int32,
             batch: Int32):
        """The writer warp: its tile number `sent` for the converter (lane 0
        waits for the slot, writes it, and the mbarrier arrive releases it)."""
        if cute.arch.lane_idx() == 0:
            index = sent % CONVERT_STAGES
            # a producer's first round finds every slot free: its phase starts at 1
            pipe.sync_object_empty.wait(index, 1 - sent // CONVERT_STAGES % 2)
            slots[0, index] = m_block
            slots[1, index] = head
            slots[2, index] = batch
            cute.arch.mbarrier_arrive(pipe.sync_object_full.get_barrier(index))
        cute.arch.sync_warp()

    # --------------------------------------------------------- converter side
    @cute.jit
    def run(self, pipe, slots: cute.Tensor, mdQaccum: cute.Tensor, mdQ: cute.Tensor,
            seqlens: Seqlens, softmax_scale: Float32, mma: cute.TiledMma, staging: cute.Pointer,
            loaded: cute.Pointer):
        """Warps 2 and 3: convert the tiles the writer sends until the end
        mark. mdQ: kernel order (s, d, h, b); staging: shared memory for one
        warpgroup region, filled by bulk copies that `loaded` (an mbarrier
        of one arrival) counts."""
        thread = cute.arch.thread_idx()[0] % WARPGROUP_THREADS - 32 * CONVERTER_WARPS[0]
        state = consumer_state(CONVERT_STAGES)
        loads = Int32(0)
        wait_full(pipe, state)
        m_block, head, batch = slots[0, state.index], slots[1, state.index], slots[2, state.index]
        release(pipe, state)
        state.advance()
        while m_block >= 0:
            loads = self._tile(mdQaccum, mdQ, seqlens, softmax_scale, mma, m_block, head, batch,
                               thread, staging, loaded, loads)
            wait_full(pipe, state)
            m_block = slots[0, state.index]
            head = slots[1, state.index]
            batch = slots[2, state.index]
            release(pipe, state)
            state.advance()

    @cute.jit
    def _tile(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, seqlens: Seqlens,
              softmax_scale: Float32, mma: cute.TiledMma, m_block: Int32, head: Int32,
              batch: Int32, thread: Int32, staging: cute.Pointer, loaded: cute.Pointer,
              loads: Int32) -> Int32:
        """One tile; returns the bulk copies made so far (their parity is the
        mbarrier's phase)."""
        tile_m, d, wgs = self.tile_m, self.head_dim, self.warpgroups
        first_row = seqlens.padded_start_q(batch, tile_m) + m_block * tile_m
        base = mdQaccum.iterator + cute.crd2idx((first_row * d, head, seqlens.buffer_batch(batch)),
                                                mdQaccum.layout)
        rows_out = seqlens.len_q(batch) - m_block * tile_m
        g = cute.local_tile(seqlens.q_rows(mdQ, head, batch), (tile_m, d), (m_block, 0))
        if cutlass.const_expr(self.transposed):
            g = wgmma.transpose_view(g)  # the GEMM's (head dims, rows)
        identity = cute.make_identity_tensor((self.gemm_m, self.gemm_n))
        n = self.values_per_thread()
        region = dq_accum.warpgroup_region(tile_m, d, wgs)
        for wg in cutlass.range_constexpr(wgs):
            if thread == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(loaded, region * 4)
                _bulk_load(staging, base + wg * region, region * 4, loaded)
            cute.arch.mbarrier_wait(loaded, loads % 2)
            loads += 1
            self._discard(base + wg * region, region, thread)
            # the region's threads, CONVERTER_THREADS at a time
            for chunk in cutlass.range(WARPGROUP_THREADS // CONVERTER_THREADS, unroll=1):
                t = chunk * CONVERTER_THREADS + thread
                coords = mma.get_slice(wg * WARPGROUP_THREADS + t).partition_C(identity)
                src = dq_accum.thread_view(staging, 0, t, tile_m, d, wgs)
                for v in cutlass.range_constexpr(n // dq_accum.VECTOR):
                    values = src[None, v].load()
                    for p in cutlass.range_constexpr(dq_accum.VECTOR // 2):
                        j = v * dq_accum.VECTOR + 2 * p
                        lo = values[2 * p] * softmax_scale
                        hi = values[2 * p + 1] * softmax_scale
                        if cutlass.const_expr(self.transposed):
                            # neighbours are consecutive rows of one column
                            for i, x in ((j, lo), (j + 1, hi)):
                                if coords[i][1] < rows_out:
                                    _store_one(g.iterator + cute.crd2idx(coords[i], g.layout),
                                               x, g.element_type)
                        elif coords[j][0] < rows_out:
                            # neighbours are adjacent columns of one row
                            _store_pair(g.iterator + cute.crd2idx(coords[j], g.layout), lo, hi,
                                        g.element_type)
            # every converter thread has read the region before the next copy
            # overwrites it
            cute.arch.barrier(barrier_id=int(BwdBarrier.CONVERT_READ),
                              number_of_threads=CONVERTER_THREADS)
        return loads

    @cute.jit
    def _discard(self, region_base: cute.Pointer, region: int, thread: Int32):
        """Drop a region's lines from L2 (its bulk copy has read them)."""
        lines = region * 4 // L2_LINE_BYTES
        for r in cutlass.range_constexpr(-(-lines // CONVERTER_THREADS)):
            line = thread + CONVERTER_THREADS * r
            if line < lines:
                _discard_l2(region_base + line * (L2_LINE_BYTES // 4))


@dsl_user_op
def _store_pair(ptr: cute.Pointer, lo: Float32, hi: Float32, dtype, *, loc=None,
                ip=None) -> None:
    """Two fp32 values rounded to 16 bits, lo at ptr, hi after it: one 4-byte
    store (cvt's first source fills the upper half)."""
    pair = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
         Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        f"{{ .reg .b32 w; cvt.rn.{pair}.f32 w, $1, $2; st.global.b32 [$0], w; }}",
        "l,f,f,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def _store_one(ptr: cute.Pointer, x: Float32, dtype, *, loc=None, ip=None) -> None:
    kind = "bf16" if dtype is cutlass.BFloat16 else "f16"
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), Float32(x).ir_value(loc=loc, ip=ip)],
        f"{{ .reg .b16 h; cvt.rn.{kind}.f32 h, $1; st.global.b16 [$0], h; }}",
        "l,f,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def _bulk_load(dst_smem: cute.Pointer, src_gmem: cute.Pointer, num_bytes: int,
               barrier: cute.Pointer, *, loc=None, ip=None) -> None:
    """num_bytes from global to shared memory, completed on `barrier`."""
    llvm.inline_asm(
        None,
        [dst_smem.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
         src_gmem.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
         Int32(num_bytes).ir_value(loc=loc, ip=ip),
         barrier.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def _discard_l2(ptr: cute.Pointer, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None, [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)],
        f"discard.global.L2 [$0], {L2_LINE_BYTES};", "l,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)
