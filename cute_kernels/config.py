"""Kernel configuration: one frozen dataclass per kernel.

A config is the single source for three things: the compile-cache key (with
dtype, head dim and causal), the fields a kernel developer sweeps from
`profiling.sweep`, and the defaults the torch op picks per problem.
Validation lives here too, so a bad combination fails on the host with a
message instead of a hang or a launch error on the device.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

WARPGROUP_THREADS = 128
WGMMA_M = 64
# Hopper: 228 KB of shared memory per SM, 227 KB usable by one CTA.
SMEM_CAPACITY_BYTES = 227 * 1024
# 64K 32-bit registers per SM; setmaxnreg moves them between warpgroups.
REGISTERS_PER_SM = 65536
SUPPORTED_HEAD_DIMS = (64, 96, 128)


def _align_1k(n: int) -> int:
    """Shared-memory buffers start on 1 KB (swizzle-pattern) boundaries."""
    return -(-n // 1024) * 1024


def _check_shared_fields(config, bad) -> None:
    """The fields both kernels have: setmaxnreg targets, the register file they
    divide, the scheduler's L2 section size."""
    if not 1 <= config.l2_section_mb <= 1024:
        raise bad("l2_section_mb", "an integer in [1, 1024]")
    for field in ("producer_regs", "consumer_regs"):
        value = getattr(config, field)
        if value % 8 or not 24 <= value <= 256:
            raise bad(field, "a multiple of 8 in [24, 256] (setmaxnreg)")
    total = WARPGROUP_THREADS * (config.producer_regs
                                 + config.consumer_warpgroups * config.consumer_regs)
    if total > REGISTERS_PER_SM:
        raise bad("consumer_regs", f"producer_regs + {config.consumer_warpgroups} * "
                                   f"consumer_regs <= {REGISTERS_PER_SM // WARPGROUP_THREADS}")


def _field_error(config, head_dim: int):
    def bad(field: str, expected: str) -> ValueError:
        return ValueError(
            f"{type(config).__name__}.{field}: expected {expected}, got "
            f"{getattr(config, field)!r} (head_dim={head_dim}, config={config})")
    return bad


class _KernelConfig:
    """What both config dataclasses derive the same way from their fields
    (each defines `consumer_warpgroups`)."""

    @property
    def threads(self) -> int:
        """One producer warpgroup and the consumer warpgroups."""
        return WARPGROUP_THREADS * (self.consumer_warpgroups + 1)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class FwdConfig(_KernelConfig):
    """Structural choices of the SM90 forward kernel.

    tile_m: query rows per CTA tile; each consumer warpgroup owns 64 of them,
        so tile_m // 64 consumer warpgroups are launched.
    tile_n: key/value rows per main-loop step (WGMMA N of S = Q·Kᵀ).
    kv_stages: depth of the K and V shared-memory rings filled by TMA.
    pingpong: consumer warpgroups take turns issuing their GEMMs (named
        barriers), so one warpgroup's softmax runs under the other's WGMMA.
    intra_wg_overlap: inside a warpgroup, issue S_{j+1} = Q·K_{j+1}ᵀ before
        the softmax of block j is consumed by O += P_j·V_j.
    persistent: grid = number of SMs, each CTA loops over tiles; otherwise
        one CTA per tile.
    dynamic_tiles: with persistent, a CTA takes round 0 by its index and
        each further tile from a global counter (scheduler.TileQueue: the
        producer warp claims it when the current tile's loads are issued,
        just in time; the op passes a fresh zeroed counter per call) instead
        of the fixed snake deal. Causal tiles differ in length: the fixed
        deal lost to one CTA per tile (the hardware's dispatch balances them)
        from 8k keys on, one CTA per tile lost the persistent loop's overlap
        of one tile's epilogue with the next one's loads. Claimed tiles keep
        both. On the H100 (bf16, 16k tokens, TFLOP/s dynamic vs one CTA per
        tile vs the fixed deal): d128 causal 2k 574.0 vs 531.5 vs 394.8, 8k
        717.9 vs 698.7 vs 457.2, 16k 747.7 vs 738.6 vs 468.1; d96 causal 2k
        506.7 vs 461.3 vs 495.9, 8k 605.1 vs 592.7 vs 559.7, 16k 631.0 vs
        623.8; d64 causal 2k 398.3 vs - vs 394.3, 4k 474.3 vs - vs 460.8,
        8k 549.4 vs 542.7 vs 516.1, 16k 580.0 vs 575.3 vs 541.3. Claiming
        tile r+1 when tile r starts (the atomic's latency hidden further)
        lost at d128 causal 16k (734.8 vs 748.8 one CTA per tile): a tile
        claimed a whole tile early goes to a CTA that is not the next one
        free. Non-causal tiles are even, and it ties there (d64 16k 603.3 vs
        605.4 fixed, d128 16k 760.6 vs 760.2, d96 8k 633.2 vs 632.2, d128 2k
        676.9 vs 683.6): off, which spares the counter's memset.
    rescale_threshold: lazy O rescaling (softmax.py): a warp moves its rows'
        softmax reference maxima only when one grew by more than
        2^rescale_threshold, so most steps skip the O rescale; 0 rescales
        at every increase. In [0, 16] (P stays below 2^rescale_threshold).
        Off by default: on the H100 it lost everywhere (bf16, 16k tokens,
        TFLOP/s 0 vs 8: d64 causal 8k 523.6 vs 516.4, d64 8k 578.4 vs 563.5,
        d128 8k 729.7 vs 704.7, d128 causal 8k 679.4 vs 670.9): the FMULs it
        skips were hidden under the GEMMs, while the warp vote sits between
        the row maxima and the first exp2.
    producer_regs / consumer_regs: setmaxnreg targets of the TMA warpgroup
        and of each consumer warpgroup.
    l2_section_mb: causal tiles run longest-first inside sections of heads
        whose K/V fit in this many MB of L2 (scheduler.py).
    lean_consumer_sync: consumers wait for a stage by spinning on try_wait
        and free it with an arrive from every thread, instead of the DSL
        pipeline's suspending wait (a NANOSLEEP path beside each wait) and
        lane-0 release (a thread-index read per release); pipeline.py's
        ConsumerSync. d=128 128x128 K/V step: 500 -> 470 SASS instructions
        (456 with kernel_base.mma_operand_view as well; fa4: 457).
        On the H100 (bf16, 16k tokens, TFLOP/s off vs on): d128 16k 727.3
        vs 743.7, d128 causal 8k 674.3 vs 690.5, d96 8k 599.5 vs 614.2, d64
        8k 570.1 vs 581.6; but d64 causal loses (16k one CTA per tile 571.8
        vs 537.6, 8k 532.3 vs 508.3, 4k 462.6 vs 444.9). Together with
        pv_wait_after_exp2=2 it wins there too (2k 401.1 vs 395.7, 8k 540.9
        vs 536.7, 16k 571.7 vs 569.2 against the DSL pipeline's wait and
        release without the hold, whose P·V wait also sits above every
        exp2), so every default has it.
    pv_wait_after_rows: with intra_wg_overlap, hold the wait for the previous
        block's P·V until the exponentials of this many of the thread's two
        rows are issued (0: where ptxas puts it). ptxas keeps mbarrier arrives
        and WGMMA waits in program order but lifts them as early as their
        operands allow; the K stage's release reads nothing, so it rose to the
        S wait, and the P·V wait (right behind it) rose above the first exp2:
        the warp waited on the tensor core with its whole softmax still to do
        (SASS, d=64: after the first row's max; fa4's wait lands after ~12
        exp2). With 1 or 2 the release is conditioned on those rows' sums
        (always true: sums of exp2 are >= 0 or NaN), and the wait follows
        their exp2s: 1 leaves the other row's exp2s to fill the gaps of the O
        rescale and the P conversion behind the wait, 2 puts every exp2 first.
    pv_wait_after_exp2: with intra_wg_overlap, hold the K stage's release
        until row 0's exp2 of this column (1-based; 0: no hold) is computed,
        with an arrive predicated on that probability (pipeline.py's
        ConsumerSync.release_after): the P·V wait, which ptxas keeps behind
        the release, then comes after the first exp2s instead of before
        them, as in fa4's loop, at no extra instruction (d128 128x128: the
        wait follows 15 exp2s, 455 instructions per step instead of 456;
        pv_wait_after_rows' vote and branch cost 17, and its release after a
        whole row's exp2s lost). On the H100 (bf16, 16k tokens, TFLOP/s 0 vs
        the default): d128 8k 729.9 vs 732.6 (8), 16k with tile_n 160 752.4
        vs 762.6 (8), causal 16k 735.8 vs 742.5 (8); d96 8k 621.0 vs 639.3,
        causal 555.6 vs 596.4 (8); d64 16k 598.3 vs 607.7 (4; 8 and 16 lost
        at 8k: 578.4, 582.0 vs 587.3); d64 causal with lean_consumer_sync,
        above.
    rescale_o_before_pv: with intra_wg_overlap, O's rescale by the new row
        maxima is applied at the next step, after S = Q·Kᵀ is issued and
        before P·V adds to O, instead of after the softmax: its FMULs leave
        the end of the softmax, where they follow the last exp2 (ptxas
        schedules them there whatever the source order), and run while S
        occupies the tensor cores (fa4's rescale_O_before_gemm, which it uses
        above head dim 128). Needs rescale_threshold 0. Every default config
        keeps its instruction count (d64 406, d128 536-537 per step) with no
        FMUL after the last exp2. Off: on the H100 (bf16, 16k tokens,
        TFLOP/s off vs on) it lost at d64 causal 8k 539.0 vs 523.7, 16k
        574.7 vs 556.2, d64 16k 603.9 vs 600.4 and d128 causal 16k 735.6 vs
        716.9, and won only at d128 8k (740.4 vs 745.2), already above fa4.
    rederive_epilogue_coords: the epilogue derives its coordinates itself
        (the tile from an opaque copy of the tile index, the stmatrix
        addresses and LSE rows from an opaque copy of the thread index)
        instead of using values that LLVM hoists out of the persistent tile
        loop, which then stay live through every main-loop step. d64
        non-causal: the step enters with 82 live registers instead of 88
        (fa4: 75) and peaks at 147 of 160 instead of 153; 405 SASS
        instructions instead of 413. On the H100 (bf16, 16k tokens, ratio
        to fa4 within one bench each, off -> on): d64 2k 0.985 -> 1.002, 4k
        0.976 -> 0.990, 8k 0.974 -> 0.986, 16k 0.972 -> 0.982; d128 even
        (2k 1.010 -> 1.001, 16k 0.991 -> 0.988); causal loses (d64 8k 0.982
        -> 0.949, d128 2k 1.003 -> 0.976): with registers to spare ptxas
        puts d64 causal's P·V wait behind 15 exp2s, a late wait like the one
        pv_wait_after_rows showed to lose. On for d64 non-causal only.
    split_tail: non-causal, persistent: when the tile count is not a
        multiple of the grid, the tiles of the last, partial round are cut
        into key ranges that every SM shares, and the last part of each
        merges the others' rows (tail_split.py; the op picks the number of
        parts per problem from a cost model, or none). The partial round cost
        1.7-2.1 % on the H100 (d128 16k, 16 heads: 761.4 TFLOP/s against
        774.7 with 33 heads, whose 4224 tiles fill every round; 8k: 746.4
        against 762.2). Unsplit -> split (bf16, 16k tokens, TFLOP/s, forced
        plans in one process): d128 8k 743.7 -> 748.2, 16k 762.0 -> 769.3,
        d96 8k 636.5 -> 646.8, d64 2k 511.9 -> 523.0, 4k 546.2 -> 566.1; d128
        4k (720.2 -> 719.3) and shorter keys lose, d64 8k/16k (112 of 132
        SMs busy in the last round) cannot gain: there the plan is no split.
    """

    tile_m: int = 128
    tile_n: int = 128
    kv_stages: int = 2
    pingpong: bool = True
    intra_wg_overlap: bool = True
    persistent: bool = True
    rescale_threshold: int = 0
    producer_regs: int = 24
    consumer_regs: int = 240
    l2_section_mb: int = 16
    lean_consumer_sync: bool = True
    pv_wait_after_rows: int = 0
    pv_wait_after_exp2: int = 0
    rescale_o_before_pv: bool = False
    rederive_epilogue_coords: bool = False
    dynamic_tiles: bool = False
    split_tail: bool = False

    @property
    def consumer_warpgroups(self) -> int:
        return self.tile_m // WGMMA_M


    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Dynamic shared memory of the kernel's SharedStorage, as laid out there:
        mbarriers first, then Q, the K and V rings and the O slabs, each 1 KB aligned."""
        size = 8 * (2 + 4 * self.kv_stages)                              # mbarriers
        size = _align_1k(size) + self.tile_m * head_dim * elem_bytes          # Q
        size = _align_1k(size) + self.kv_stages * self.tile_n * head_dim * elem_bytes  # K
        size = _align_1k(size) + self.kv_stages * self.tile_n * head_dim * elem_bytes  # V
        size = _align_1k(size) + self.tile_m * head_dim * elem_bytes          # O slabs
        return size

    def validate(self, head_dim: int) -> None:
        """Raise ValueError naming the field when the combination cannot run."""
        bad = _field_error(self, head_dim)

        if self.tile_m % WGMMA_M or not 1 <= self.consumer_warpgroups <= 3:
            raise bad("tile_m", "64, 128 or 192 (one consumer warpgroup per 64 rows)")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise bad("tile_n", "a multiple of 16 in [16, 256] (WGMMA N, and the P·V K step)")
        if not 1 <= self.kv_stages <= 8:
            raise bad("kv_stages", "an integer in [1, 8]")
        if not 0 <= self.rescale_threshold <= 16:
            raise bad("rescale_threshold", "an integer in [0, 16] (log2 of the largest P)")
        if self.intra_wg_overlap and self.kv_stages < 2:
            raise bad("kv_stages", ">= 2 when intra_wg_overlap is on (K_{j+1} and V_j are "
                                   "in flight together)")
        if self.pv_wait_after_rows not in (0, 1, 2):
            raise bad("pv_wait_after_rows", "0, 1 or 2 (a thread holds two rows of each "
                                            "64-row warpgroup tile)")
        if not 0 <= self.pv_wait_after_exp2 <= self.tile_n // 4:
            raise bad("pv_wait_after_exp2", f"a column of a thread's row in [0, tile_n / 4 = "
                                            f"{self.tile_n // 4}]")
        if self.pv_wait_after_exp2 and (self.pv_wait_after_rows or not self.intra_wg_overlap):
            raise bad("pv_wait_after_exp2", "0 unless intra_wg_overlap, and 0 with "
                                            "pv_wait_after_rows (both hold the same release)")
        if self.dynamic_tiles and not self.persistent:
            raise bad("dynamic_tiles", "False unless persistent (one CTA per tile has no "
                                       "next tile to claim)")
        if self.split_tail and (self.dynamic_tiles or not self.persistent):
            raise bad("split_tail", "False unless persistent, and False with dynamic_tiles (a "
                                    "claimed order has no fixed last round to split)")
        if self.rescale_o_before_pv and (self.rescale_threshold or not self.intra_wg_overlap):
            raise bad("rescale_o_before_pv", "False unless intra_wg_overlap, and False with "
                                             "lazy rescaling (rescale_threshold > 0)")
        if self.pv_wait_after_rows and not self.intra_wg_overlap:
            raise bad("pv_wait_after_rows", "0 unless intra_wg_overlap (without it no P·V is "
                                            "in flight during the softmax)")
        _check_shared_fields(self, bad)
        if self.smem_bytes(head_dim) > SMEM_CAPACITY_BYTES:
            raise bad("kv_stages", f"a shared-memory footprint <= {SMEM_CAPACITY_BYTES} B, "
                                   f"this needs {self.smem_bytes(head_dim)} B")



@functools.lru_cache(maxsize=None)
def default_fwd_config(head_dim: int, causal: bool) -> FwdConfig:
    """The op's choice per problem, picked with `profiling.sweep` on an H100
    (bf16, 16k tokens; TFLOP/s of the choice vs the runner-up):

    - causal: persistent with dynamic_tiles at every head dim and length
      (figures there); non-causal: persistent with the fixed deal and
      split_tail (the plan splits only where its cost model gains);
    - head dim 128 non-causal: tile_n 160 (with pv_wait_after_exp2=8, vs
      128: 2k 686.6 vs 686.4, 8k 746.1 vs 742.1, 16k 762.3 vs 749.9; without
      it 128 won below 16k, the last partial 160-key block costing more than
      the longer step saves); causal keeps 128 (2k: 507 vs 441), fewer
      masked columns on the diagonal;
    - causal L2 sections of 16 MB (hdim 128, 1k: 373 vs 362 with 32 MB; 4k, 16k even);
    - head dim 64: three consumer warpgroups (192 rows amortise each K/V tile:
      8k 577 vs 444 with 128 rows) and three K/V stages (4k: 530 vs 494).
    """
    if head_dim <= 64:
        return FwdConfig(tile_m=192, tile_n=128, kv_stages=3, persistent=True,
                         dynamic_tiles=causal, split_tail=not causal, producer_regs=32,
                         consumer_regs=160, rederive_epilogue_coords=not causal,
                         pv_wait_after_exp2=2 if causal else 4)
    if head_dim <= 96 or causal:
        return FwdConfig(tile_m=128, tile_n=128, kv_stages=2, persistent=True,
                         dynamic_tiles=causal, split_tail=not causal, pv_wait_after_exp2=8)
    return FwdConfig(tile_m=128, tile_n=160, kv_stages=2, persistent=True, split_tail=True,
                     pv_wait_after_exp2=8)


@dataclass(frozen=True)
class BwdConfig(_KernelConfig):
    """Structural choices of the SM90 backward kernel (bwd_sm90.py).

    One CTA owns tile_n keys (tile_n // 64 consumer warpgroups, 64 keys each)
    and walks the query tiles that see them, tile_m queries at a time.
    tile_m: queries per main-loop step (WGMMA N of Sᵀ = K·Qᵀ, K of dV/dK).
        A multiple of 64 (dQ = dS·K with the warpgroups splitting its rows,
        or at 64 its columns), or of 16 otherwise, e.g. 80 (fa4's d=128
        non-causal tile): dQ is then computed transposed, dQᵀ = Kᵀ·dSᵀ,
        with head_dim on WGMMA's M axis, 64 rows per warpgroup. In SASS
        (d=128, non-causal) 80 rows fit the registers with ds_from_16bit_p:
        483 instructions per step against 400 for 64 rows, 6.0 per query
        row against 6.3 (fa4's 80-row step: 465, 5.8). Without it ptxas
        spills and serialises every WGMMA; causal, the mask adds a 16-byte
        spill. On the H100 (d=128 non-causal, bf16) 80 rows beat 64 at
        2k, 8k and 16k (see default_bwd_config): the default there.
    tile_n: keys per CTA.
    qdo_stages: depth of the Q (+LSE) and dO (+D) shared-memory rings.
    deterministic: dQ partial sums are added to the fp32 accumulator in
        key-block order (a per-tile semaphore), so gradients are bitwise
        reproducible; otherwise in whatever order CTAs finish.
    dv_under_ds: issue dV += Pᵀ·dO before dSᵀ is computed, so that GEMM runs
        under the elementwise work; Pᵀ is then live in fp32 and 16 bits at
        once (tile_m / 4 more registers). Off: the FlashAttention-3 order, dSᵀ
        first, then dV and dK back to back.
    dv_at_ds_barrier: with dv_under_ds off, issue dV after dSᵀ is written
        to shared memory, just before the barrier where the warpgroups meet
        for dQ (fa4's order), so a warpgroup that arrives first has its dV
        GEMM running while it waits; off, right after dSᵀ is computed.
        On the H100 (bf16, TFLOP/s, dV before dSᵀ / after dSᵀ / at the
        barrier, dSᵀ from the 16-bit Pᵀ): d64 8k 557.1 / 574.3 / 594.9,
        causal 16k 563.2 / 576.5 / 592.9, 2k 477.3 / 489.8 / 505.6; d96 8k
        593.9 / 595.6 / 604.8; but d128 8k 673.1 / 680.7 / 660.2, causal
        16k 655.2 / 668.6 / 650.5, 2k 564.7 / 570.9 / 555.7, so d128
        issues dV right after dSᵀ (why 128 differs is not profiled yet).
    ds_from_16bit_p: compute dSᵀ from the 16-bit Pᵀ that dV reads (made
        right after the exp2s) instead of the fp32 one, which is then dead
        before dPᵀ lands (tile_m / 2 registers fewer per thread: what lets
        tile_m=128 run without ptxas serialising the WGMMAs), for one
        conversion per element
        (wgmma.read_16bit_as_f32: one whole-word operation per value; the
        DSL's own conversion extracted halves with merging PRMTs that kept
        11 registers live across the loop at d=64: 86 live at the loop head
        vs fa4's 77, now 75; 851 SASS instructions per step, now 787).
    dq_store_under_dk: issue dK += dSᵀ·Q after dQ = dS·K instead of before
        it, so the dQ partial's stores to shared memory run under dK (dSᵀ
        stays in registers through the dSᵀ barrier).
    stats_early: read each query block's LSE₂ from shared memory into
        registers as soon as its Q stage has landed, ahead of the Sᵀ and dPᵀ
        GEMM issue (D: ahead of the dV issue), instead of next to each use.
        An LDS issued behind HGMMAs waits in the MIO queue until the tensor
        core has accepted them, so the lazy loads, and loads placed between
        the GEMM issues, held the first exp2 until the dPᵀ GEMM started (ncu
        source view, d=128 causal 8k: 12-27 k of 240 k stall samples on that
        FFMA). Costs tile_m / 4 registers per statistic while they wait.
        On the H100 (bf16 8k, TFLOP/s on vs off): d128 625.7 vs 614.7,
        causal 580.9 vs 573.5; d64 (tile_m 128: 32 more registers) 545.3 vs
        548.3, causal 497.0 vs 513.7, so the op turns it on for d > 64 only
        (d96 shares d128's tile; not timed separately).
    stats_shuffle: each lane reads 2 · tile_m / 64 of a query block's
        statistics (LSE₂, D) once, and every column's value comes by shuffle
        from the lane holding it: per step at tile_m=64, 2 LDS.64 and 32
        SHFL instead of 16 LDS.64 (fa4's way). ncu of the d=128 backward
        put our gap to fa4 in short-scoreboard stalls (2.10 vs 0.95 warps
        per issue) and shared-memory load bank conflicts (5.4 M vs 0).
        Off: on the H100 it loses (bf16 8k, TFLOP/s off vs on: d128 623.3 vs
        619.9, d64 553.4 vs 532.9).
    split_gqa: one CTA per (key block, query head) instead of per (key block,
        KV head): with GQA the q_per_kv query heads of a group are walked by
        q_per_kv CTAs instead of one, so a small grid fills the GPU and the
        longest CTA (under causal masking, the first key block's) is
        q_per_kv times shorter. dK and dV then leave the kernel as fp32
        partials per query head, summed over the group afterwards.
    l2_section_mb: causal key blocks run longest-first (the first key blocks
        are seen by the most query blocks) inside sections of heads whose Q,
        dO and dQ accumulator fit in this many MB of L2 (scheduler.py).
    producer_regs / consumer_regs: setmaxnreg targets.
    lean_consumer_sync: as in FwdConfig (pipeline.py's ConsumerSync); on
        the H100 even (d128 8k: 623.2 vs 623.3 TFLOP/s off vs on).
    kv_with_first_block: K is loaded on the first Q stage's barrier and V on
        the first dO stage's, in the order K, Q, V, dO, so the first Sᵀ GEMM
        waits for K and Q only. Off: K and V first, on a barrier of their
        own that the consumers wait on before the first block. On the H100
        even (bf16, TFLOP/s off vs on, dkv_tma_store on: d128 2k 534.6 vs
        534.8, causal 414.3 vs 414.7, d128 8k 641.3 vs 639.8, d64 2k 467.8
        vs 465.8), so off.
    dkv_tma_store: the 16-bit dK and dV leave through shared memory (the K
        and V buffers, free once every warpgroup's last GEMM has retired) and
        one TMA store each, instead of 4-byte stores from the accumulator
        registers, which run at half a sector each and hold the CTA (and the
        next CTA on the SM) until they issue. split_gqa's fp32 partials always
        go straight from registers. On the H100 (bf16, TFLOP/s off vs on):
        d128 2k 509.9 vs 534.6, causal 391.9 vs 414.3, 8k 633.4 vs 641.3;
        d64 2k 456.5 vs 467.8.
    early_launch: the main kernel is launched with programmatic dependent
        launch, so its CTAs start (barrier setup, descriptor prefetch, the
        K/V loads) while the preprocess's last CTAs run; the producer and
        the dQ writer wait for the preprocess (griddepcontrol.wait) before
        reading LSE₂ and D or adding into the dQ accumulator it zeroes.
        On the H100 even (bf16 2k, TFLOP/s off vs on: d128 545.8 vs 545.7,
        d64 causal 376.4 vs 377.3), so off.
    dynamic_tiles: a persistent grid (one CTA per SM) whose CTAs take
        round 0 by their index and claim each further key block from a
        global counter, as FwdConfig.dynamic_tiles (scheduler.TileQueue: the
        producer claims a tile once the current one's loads are issued and
        hands it to the consumers and the dQ writer with that tile's K and V
        barrier). The next tile's Q and dO stream in under the current
        tile's dK/dV epilogue, and no CTA is launched or torn down per key
        block. The preprocess zeroes the counter (the semaphore's first
        element). Not with deterministic (its semaphore counts turns),
        kv_with_first_block (the tile travels with the K/V barrier) or
        early_launch (the preprocess zeroes the counter). On the H100 (bf16,
        16k tokens, TFLOP/s on vs one CTA per key block): causal d64 1k
        282.8 vs 276.2, 2k 398.0 vs 390.3, 8k 555.8 vs 553.9; d128 2k 444.3
        vs 442.1, 8k 626.6 vs 618.5, 16k 667.7 vs 655.2; non-causal even
        (d64 2k 501.2 vs 505.6 / 500.2, d128 2k 573.5 vs 575.0 / 572.9), so
        on for causal only.
    """

    tile_m: int = 64
    tile_n: int = 128
    qdo_stages: int = 2
    deterministic: bool = False
    dv_under_ds: bool = True
    dv_at_ds_barrier: bool = False
    ds_from_16bit_p: bool = False
    dq_store_under_dk: bool = True
    stats_early: bool = False
    stats_shuffle: bool = False
    split_gqa: bool = False
    l2_section_mb: int = 16
    producer_regs: int = 24
    consumer_regs: int = 240
    lean_consumer_sync: bool = True
    kv_with_first_block: bool = False
    dkv_tma_store: bool = True
    early_launch: bool = False
    dynamic_tiles: bool = False

    @property
    def consumer_warpgroups(self) -> int:
        return self.tile_n // WGMMA_M


    def dq_split_m(self) -> bool:
        """dQ = dS·K: warpgroups split the tile's rows when there is one 64-row
        slice per warpgroup, else they split the head dimension."""
        return self.tile_m == WGMMA_M * self.consumer_warpgroups

    def dq_transposed(self) -> bool:
        """dQᵀ = Kᵀ·dSᵀ (tile_m not a multiple of 64): head_dim on WGMMA's M
        axis, 64 rows of it per warpgroup, and the query rows on N."""
        return self.tile_m % WGMMA_M != 0

    def stat_stage_floats(self) -> int:
        """Floats between two stages of the LSE₂ and D rings: tile_m rounded up
        to 128 bytes, the alignment a TMA destination needs."""
        return -(-self.tile_m // 32) * 32

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        size = 8 * (2 + 4 * self.qdo_stages)                                   # mbarriers
        size = _align_1k(size) + 2 * self.tile_n * head_dim * elem_bytes           # K, V
        size = _align_1k(size) + 2 * self.qdo_stages * self.tile_m * head_dim * elem_bytes  # Q, dO
        size = _align_1k(size) + 2 * self.qdo_stages * self.stat_stage_floats() * 4  # LSE, D
        size = _align_1k(size) + 2 * self.tile_n * self.tile_m * elem_bytes        # dSᵀ (2 buffers)
        size = _align_1k(size) + self.tile_m * head_dim * 4                        # dQ partial
        return size

    def validate(self, head_dim: int) -> None:
        bad = _field_error(self, head_dim)

        if self.tile_n % WGMMA_M or not 1 <= self.consumer_warpgroups <= 3:
            raise bad("tile_n", "64, 128 or 192 (one consumer warpgroup per 64 keys)")
        if self.tile_m % 16 or not WGMMA_M <= self.tile_m <= 192:
            raise bad("tile_m", "a multiple of 16 in [64, 192] (the K of the dV and dK "
                                "GEMMs)")
        if self.dq_transposed():
            if head_dim != WGMMA_M * self.consumer_warpgroups:
                raise bad("tile_m", f"a multiple of 64 at head_dim {head_dim}: other tiles "
                                    f"compute dQᵀ with head_dim = 64 * consumer_warpgroups "
                                    f"({WGMMA_M * self.consumer_warpgroups})")
            if self.stats_shuffle:
                raise bad("stats_shuffle", "False when tile_m is not a multiple of 64 (each "
                                           "lane holds tile_m / 64 statistics)")
        elif not self.dq_split_m():
            if self.tile_m != WGMMA_M or (head_dim // self.consumer_warpgroups) % 8 \
                    or head_dim % self.consumer_warpgroups:
                raise bad("tile_m", f"64 * consumer_warpgroups "
                                    f"({WGMMA_M * self.consumer_warpgroups}), or 64 with "
                                    f"head_dim split evenly in multiples of 8 across "
                                    f"{self.consumer_warpgroups} warpgroups")
        if self.dv_at_ds_barrier and self.dv_under_ds:
            raise bad("dv_at_ds_barrier", "False when dv_under_ds (one place to issue dV)")
        if self.stats_shuffle and self.stats_early:
            raise bad("stats_shuffle", "False when stats_early (one way to read the "
                                       "statistics)")
        if not 1 <= self.qdo_stages <= 4:
            raise bad("qdo_stages", "an integer in [1, 4]")
        if self.dynamic_tiles and (self.deterministic or self.kv_with_first_block
                                   or self.early_launch):
            raise bad("dynamic_tiles", "False with deterministic, kv_with_first_block or "
                                       "early_launch")
        _check_shared_fields(self, bad)
        if self.smem_bytes(head_dim) > SMEM_CAPACITY_BYTES:
            raise bad("qdo_stages", f"a shared-memory footprint <= {SMEM_CAPACITY_BYTES} B, "
                                    f"this needs {self.smem_bytes(head_dim)} B")



def split_gqa_pays(q_per_kv: int, kv_ctas: int, num_sms: int) -> bool:
    """Whether the backward's default gives each query head of a GQA group its
    own CTAs (BwdConfig.split_gqa): when one CTA per (key block, KV head,
    batch) makes fewer than two waves, SMs idle while the longest CTAs finish.
    With more waves the hardware's CTA dispatch balances them, and the fp32
    dK/dV partials would only add memory traffic."""
    return q_per_kv > 1 and kv_ctas < 2 * num_sms


def bwd_config_for_problem(head_dim: int, causal: bool, deterministic: bool, batch: int,
                           seqlen_k: int, heads_q: int, heads_kv: int,
                           num_sms: int) -> BwdConfig:
    """The op's backward config for one problem: default_bwd_config, with
    split_gqa where split_gqa_pays for the grid that config would launch."""
    config = default_bwd_config(head_dim, causal, deterministic)
    kv_ctas = -(-seqlen_k // config.tile_n) * heads_kv * batch
    if split_gqa_pays(heads_q // heads_kv, kv_ctas, num_sms):
        return default_bwd_config(head_dim, causal, deterministic, split_gqa=True)
    return config


@functools.lru_cache(maxsize=None)
def default_bwd_config(head_dim: int, causal: bool, deterministic: bool = False,
                       split_gqa: bool = False) -> BwdConfig:
    """128 keys per CTA in two consumer warpgroups (their dK and dV stay in
    registers for the whole walk over queries). Picked with `profiling.sweep
    --kernel bwd` on an H100 (bf16, seqlen 8k, batch 2; TFLOP/s of the
    backward kernels, the choice vs the runner-up):

    - head dim 64: 128 queries per step with dSᵀ from the 16-bit Pᵀ (488.6 vs
      415.5 with 64 queries, non-causal; causal 464.8 vs 394.7). With 128
      queries and the fp32 Pᵀ ptxas runs out of registers and serialises the
      WGMMAs (463.6 even in the FlashAttention-3 order);
    - head dim 96/128: 64 queries per step (128 would need 256 accumulator
      registers per thread), dSᵀ from the 16-bit Pᵀ (d96 8k with dV at the
      dQ barrier: 604.8 vs 591.1 from the fp32 one);
    - head dim 128 non-causal: 80 queries per step with dSᵀ from the 16-bit
      Pᵀ (dQ transposed; 680.8 vs 662.1 with 64, 16k 689.8 vs 653.7, 2k
      565.9 vs 556.9); 64 rows with the 16-bit Pᵀ beat the fp32 one by
      650.2 vs 643.0 (16k 654.3 vs 641.7, 2k 549.2 vs 543.2);
    - head dim 128 causal: 64 queries, dSᵀ from the 16-bit Pᵀ (612.5 vs
      611.3, even; 16k 654.9 vs 653.0, 2k 428.6 vs 428.5);
    - dQ partial stored under the dK GEMM (d128 618.3 vs 600.7, causal 555.8
      vs 542.8; d64 541.4 vs 504.9, causal 500.4 vs 464.5);
    - head dim 96/128: LSE₂ read before the GEMM issue (stats_early; d128
      8k 625.7 vs 614.7, causal 580.9 vs 573.5);
    - dK and dV stored through the K and V buffers with TMA (dkv_tma_store,
      a field default: d128 2k 534.6 vs 509.9, causal 414.3 vs 391.9, 8k
      641.3 vs 633.4; d64 2k 467.8 vs 456.5);
    - dV issued where the warpgroups meet for dQ at d64 and d96, right
      after dSᵀ is computed at d128, with dSᵀ from the 16-bit Pᵀ everywhere
      (BwdConfig.dv_at_ds_barrier: d64 8k 594.9 vs 557.1 with dV under
      dSᵀ, d96 604.8 vs 578.9, d128 16k 698.3 vs 672.4, causal 8k 625.9
      vs 614.1); qdo_stages 3 gains nothing (616.0 vs 618.3).
    - causal key blocks longest-first in 16 MB L2 sections (d128 causal 4k
      batch 4: 499.3 vs 485.4 with 4 MB and 319.6 with one global order;
      d64 causal 8k: 501.0 vs 489.4 and 357.3);
    - causal: persistent with claimed key blocks (dynamic_tiles), unless
      deterministic;
    - split_gqa (chosen per problem by the op, split_gqa_pays): at the
      model shape of issue 5 (d128 causal 4k, batch 1, 8 query / 4 KV heads:
      128 CTAs) 0.225 vs 0.305 ms; d64 causal 4k, 16 / 4 heads 0.240 vs
      0.346 ms; with many waves it loses (d128 causal 8k batch 2, 16 / 8
      heads, 1024 CTAs: 534.9 vs 549.3 TFLOP/s), as without GQA it would
      (non-causal model shape: 0.356 vs 0.314 ms).
    Each pair comes from one sweep run; runs differ by a few % (see RESULTS.md).
    """
    dynamic_tiles = causal and not deterministic
    if head_dim <= 64:
        return BwdConfig(tile_m=128, tile_n=128, qdo_stages=2, deterministic=deterministic,
                         dv_under_ds=False, dv_at_ds_barrier=True, ds_from_16bit_p=True,
                         split_gqa=split_gqa, dynamic_tiles=dynamic_tiles)
    if head_dim == 128:
        # 80 rows: the mask (causal) or split_gqa's fp32 partial stores make
        # ptxas spill 16 bytes; they keep 64 (causal on an H100, 64 vs 80
        # rows: 4k 550.1 vs 526.5, 16k 668.1 vs 658.3)
        return BwdConfig(tile_m=64 if causal or split_gqa else 80, tile_n=128, qdo_stages=2,
                         deterministic=deterministic, dv_under_ds=False, ds_from_16bit_p=True,
                         stats_early=True, split_gqa=split_gqa, dynamic_tiles=dynamic_tiles)
    return BwdConfig(tile_m=64, tile_n=128, qdo_stages=2, deterministic=deterministic,
                     dv_under_ds=False, dv_at_ds_barrier=True, ds_from_16bit_p=True,
                     stats_early=True, split_gqa=split_gqa, dynamic_tiles=dynamic_tiles)


KERNEL_CONFIGS = {"fwd": FwdConfig, "bwd": BwdConfig}


def default_config(kind: str, head_dim: int, causal: bool):
    """The op's default FwdConfig ('fwd') or BwdConfig ('bwd') for a problem."""
    if kind not in KERNEL_CONFIGS:
        raise ValueError(f"kind: expected one of {sorted(KERNEL_CONFIGS)}, got {kind!r}")
    return (default_fwd_config if kind == "fwd" else default_bwd_config)(head_dim, causal)


def config_fields(kind: str = "fwd") -> list[str]:
    return [f.name for f in dataclasses.fields(KERNEL_CONFIGS[kind])]


def parse_field(name: str, text: str, kind: str = "fwd"):
    """A config field value from text ('1'/'true'/'yes' for booleans), for
    command lines; ValueError names the field."""
    cls = KERNEL_CONFIGS[kind]
    if name not in config_fields(kind):
        raise ValueError(f"unknown {cls.__name__} field {name!r}; fields: {config_fields(kind)}")
    if isinstance(getattr(cls(), name), bool):
        return text.lower() in ("1", "true", "yes")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{cls.__name__}.{name}: expected an integer, got {text!r}") from None
