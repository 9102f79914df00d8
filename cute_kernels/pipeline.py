"""Barriers between the warpgroups of the attention kernels.

- TMA pipelines (mbarriers): the producer warp fills Q (one stage) and the
  K and V rings (`kv_stages` each); consumers free a stage once the WGMMA
  that read it has completed (wait_full / release: how they wait and arrive);
  the backward's rings and named barriers are described at BwdBarrier.
- Named barriers (bar.sync / bar.arrive), ids below; id 0 is __syncthreads.
  Every consumer warpgroup has its own, so warpgroups never wait for each
  other outside the ping-pong, and keep their phase offset across tiles.
  * EPILOGUE_BASE + w: warpgroup w's previous O store has left its
    shared-memory slab before the slab is overwritten; with O staged in the
    V ring of several tile streams (FwdConfig.concurrent_tiles), instead
    O_IN_V for that warpgroup's stream alone.
  * EPILOGUE_STORE_BASE + w: warpgroup w has written its O slab; its first
    warp then issues the TMA store.
  * O_IN_V: with O staged in the V ring, every consumer warpgroup's last
    P·V of the tile has completed, so the V stages may be overwritten.
  * PINGPONG_BASE + w: consumer warpgroup w may issue its GEMMs. Warpgroup w
    waits on its own barrier and, once its GEMMs are issued, arrives on the
    next one's, so the tensor cores run one warpgroup's GEMMs while the
    others do softmax.
  * SLAB_TURN_BASE + w: with one O slab for all consumer warpgroups
    (shared_o_slab), warpgroup w may write it: the previous holder's first
    warp arrives once its TMA store has read the slab out, w's threads wait.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cpipeline
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op, if_generate

from .config import WARPGROUP_THREADS
from .dsl_struct import DslStruct


class NamedBarrier(enum.IntEnum):
    # one id per consumer warpgroup (at most 3) from each base
    EPILOGUE_BASE = 1
    EPILOGUE_STORE_BASE = 4
    PINGPONG_BASE = 7
    O_IN_V = 10  # all consumer warpgroups (FwdConfig.o_in_v_smem)
    SLAB_TURN_BASE = 11  # FwdConfig.shared_o_slab


def make_tma_pipeline(barrier_storage, stages: int, consumer_arrivals: int, tx_bytes: int):
    """A TMA-producer / consumer ring. Exactly one warp produces; a stage is
    free again after `consumer_arrivals` arrivals (release: one per consumer
    thread)."""
    return cpipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_storage,
        num_stages=stages,
        producer_group=cpipeline.CooperativeGroup(cpipeline.Agent.Thread, 1),
        consumer_group=cpipeline.CooperativeGroup(cpipeline.Agent.Thread, consumer_arrivals),
        tx_count=tx_bytes,
        defer_sync=True,  # one CTA-wide sync after all barriers are initialised
    )


def make_thread_pipeline(barrier_storage, stages: int, producer_arrivals: int,
                         consumer_arrivals: int):
    """A ring between two groups of threads (no TMA): a stage is full after
    `producer_arrivals` arrivals (producer_commit, one per producer thread)
    and free after `consumer_arrivals` (release)."""
    return cpipeline.PipelineAsync.create(
        barrier_storage=barrier_storage,
        num_stages=stages,
        producer_group=cpipeline.CooperativeGroup(cpipeline.Agent.Thread, producer_arrivals),
        consumer_group=cpipeline.CooperativeGroup(cpipeline.Agent.Thread, consumer_arrivals),
        defer_sync=True,
    )


# How consumer threads wait for a full stage and free it. Waiting spins on
# try_wait: the DSL pipeline's consumer_wait passes a suspend-time hint that
# ptxas lowers to a NANOSLEEP retry path beside every wait of the main loop.
# Freeing is an arrive from every consumer thread: the DSL's consumer_release
# arrives from lane 0 of each warp, a test on the thread index that ptxas
# re-reads at each release once registers are scarce.


@cute.jit
def wait_full(pipe, state):
    """Wait until the stage of `state` has landed."""
    ready = pipe.consumer_try_wait(state)
    while not ready:
        ready = pipe.consumer_try_wait(state)


@cute.jit
def release(pipe, state):
    """Free the stage of `state` (every consumer thread arrives)."""
    cute.arch.mbarrier_arrive(pipe.sync_object_empty.get_barrier(state.index))


@cute.jit
def pass_stages(k_pipe, v_pipe, state, count: Int32, pingpong: "PingPong", wg: Int32):
    """Release the next `count` K and V stages uncomputed, each once it has
    landed: the ring's empty barrier counts every consumer's release of a
    stage, and a release before the fill would count towards the fill
    before it. Each stage takes the ping-pong turn its step would have
    taken, so that the warpgroups' turns stay paired. Returns the state."""
    for _ in cutlass.range(count, unroll=1):
        wait_full(k_pipe, state)
        release(k_pipe, state)
        pingpong.wait_turn(wg)
        pingpong.pass_turn(wg)
        wait_full(v_pipe, state)
        release(v_pipe, state)
        state.advance()
    return state


@cute.jit
def release_after(pipe, state, value: Float32):
    """release, ordered after the instruction that computes `value`: the
    arrive is predicated on `value >= 0 or NaN`, which the caller knows to
    hold (an exp2), so every thread still arrives. ptxas hoists a data-free
    arrive as far up as the last wait before it (and the waits behind it with
    it); this one cannot rise above `value`."""
    _arrive_unless_negative(pipe.sync_object_empty.get_barrier(state.index), value)


@dsl_user_op
def _arrive_unless_negative(barrier: cute.Pointer, value: Float32, *, loc=None,
                            ip=None) -> None:
    """mbarrier arrive unless value < 0, predicated in PTX (no branch, no
    warp vote)."""
    llvm.inline_asm(
        None,
        [barrier.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
         Float32(value).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred skip;\n"
        "setp.lt.f32 skip, $1, 0f00000000;\n"
        "@!skip mbarrier.arrive.shared::cta.b64 _, [$0];\n}",
        "r,f,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


def producer_state(stages: int, bank=None):
    """The producer's position in a ring of `stages` stages, or in bank
    `bank` of a ring of several such banks (BankedState)."""
    if bank is None:
        return cpipeline.make_pipeline_state(cpipeline.PipelineUserType.Producer, stages)
    return BankedState(stages, Int32(0), Int32(0), Int32(1), Int32(bank) * stages)


def consumer_state(stages: int, bank=None):
    """The consumers' position, as producer_state (a stage is full once its
    phase has flipped from the producer's start)."""
    if bank is None:
        return cpipeline.make_pipeline_state(cpipeline.PipelineUserType.Consumer, stages)
    return BankedState(stages, Int32(0), Int32(0), Int32(0), Int32(bank) * stages)


class BankedState(cpipeline.PipelineState):
    """A position in one bank of a ring whose barriers and buffers hold
    several banks of `stages` stages each, one per tile stream
    (FwdConfig.concurrent_tiles): it wraps within the bank, and its index,
    which the pipelines and the buffers' stage modes read, is offset by the
    bank's first stage."""

    def __init__(self, stages: int, count, index, phase, first):
        super().__init__(stages, count, index, phase)
        self._first = first

    @property
    def index(self) -> Int32:
        return self._first + self._index

    def clone(self, *, loc=None, ip=None) -> "BankedState":
        return BankedState(self.stages, self._count, self._index, self._phase, self._first)

    def advance(self, *, loc=None, ip=None) -> None:
        self._index += 1
        self._count += 1
        self._index, self._phase = if_generate(
            self._index == self.stages, lambda index, phase: (Int32(0), phase ^ 1),
            lambda index, phase: (index, phase), [self._index, self._phase], [Int32, Int32])

    def __extract_mlir_values__(self):
        return [v.ir_value() for v in (self._count, self._index, self._phase, self._first)]

    def __new_from_mlir_values__(self, values) -> "BankedState":
        return BankedState(self.stages, *(Int32(v) for v in values))


@dataclass
class PingPong(DslStruct):
    """Turn-taking of the consumer warpgroups on the tensor cores.

    Each barrier counts 2 warpgroups: the owner syncs, the previous one arrives.
    """

    warpgroups: int
    enabled: bool

    def __post_init__(self):
        self.enabled = self.enabled and self.warpgroups >= 2
        self.threads = 2 * WARPGROUP_THREADS

    @cute.jit
    def start(self, wg: cutlass.Int32):
        """Warpgroup 0 holds the first turn: it pre-arrives on its own barrier."""
        if cutlass.const_expr(self.enabled):
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.PINGPONG_BASE),
                                         number_of_threads=self.threads)

    @cute.jit
    def wait_turn(self, wg: cutlass.Int32):
        if cutlass.const_expr(self.enabled):
            cute.arch.barrier(barrier_id=int(NamedBarrier.PINGPONG_BASE) + wg,
                              number_of_threads=self.threads)

    @cute.jit
    def pass_turn(self, wg: cutlass.Int32):
        if cutlass.const_expr(self.enabled):
            nxt = (wg + 1) % self.warpgroups
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.PINGPONG_BASE) + nxt,
                                     number_of_threads=self.threads)


class BwdBarrier(enum.IntEnum):
    """Named barriers of the backward kernel (bwd_sm90.py).

    DS_READY: every consumer warpgroup has written its rows of dSᵀ to shared
        memory, so dQ = dS·K, which reads all of them, may start.
    DQ_FULL_BASE + w: consumer warpgroup w has written its dQ partial to its
        shared-memory slab (128 arrive); the dQ-writer warp (32) waits, then
        issues the reduce-add.
    DQ_EMPTY_BASE + w: the reduce-add has finished reading slab w (the writer
        warp arrives); warpgroup w waits before writing the slab again.
    EPILOGUE (dK and dV through shared memory): every consumer warpgroup's last GEMM
        has retired before dK and dV overwrite K and V; then, every
        warpgroup's rows are written before the TMA stores read them.
    DS_FREE (BwdConfig.ds_buffers 1): every consumer warpgroup has retired
        the step before's dQ GEMM, which read all of dSᵀ's one buffer.
    CONVERT_READ (BwdConfig.convert_dq): every converter thread has read the
        staged dQ region before the next bulk copy overwrites it
        (dq_convert.py).
    """

    DS_READY = 1
    DQ_FULL_BASE = 2
    DQ_EMPTY_BASE = 5
    EPILOGUE = 8
    DS_FREE = 9
    CONVERT_READ = 10


# DQ_FULL / DQ_EMPTY count one consumer warpgroup and the dQ-writer warp.
DQ_HANDOFF_THREADS = WARPGROUP_THREADS + 32
