"""Kernel configuration: one frozen dataclass per kernel.

A config is the single source for three things: the compile-cache key (with
dtype, head dim and causal), the fields a kernel developer sweeps from
`python -m cute_fa.profiling.sweep`, and the defaults the torch op picks per
problem. Validation lives here too, so a bad combination fails on the host
with a message instead of a hang or a launch error on the device.

Each field is a design axis of the kernel; the measurements that chose the
defaults are in docs/findings.md and the benchmark report.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

WARPGROUP_THREADS = 128
WGMMA_M = 64
# Hopper: 228 KB of shared memory per SM, of which each resident CTA also
# takes 1 KB: 227 KB usable by one CTA.
SMEM_PER_SM_BYTES = 228 * 1024
SMEM_CAPACITY_BYTES = SMEM_PER_SM_BYTES - 1024
# 64K 32-bit registers per SM; setmaxnreg moves them between warpgroups.
REGISTERS_PER_SM = 65536
SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)  # the forward kernel's own
# The backward kernel keeps a CTA's dK and dV in registers: (d + dv) / 2 per
# thread for 64 keys of one warpgroup, which fits up to this head dim; above it
# two warpgroups split them by head dim (BwdConfig.dim_split).
BACKWARD_OWN_KEYS_MAX_DIM = 128
# The ops take any multiple of this up to the largest kernel head dim: TMA
# moves rows of 16 bytes, 8 16-bit elements (kernel_head_dim).
HEAD_DIM_MULTIPLE = 8
# Bits of a packed batch's `seqused` argument (varlen.Seqlens): which
# seqused tensors hold the sequences' lengths. Here, free of the DSL, for
# the host code that passes them.
SEQUSED_Q, SEQUSED_K = 1, 2
# The most key ranges a split_kv forward takes per tile: the merge
# (split_combine.py) holds their LSEs in a warp's registers, 4 per lane.
MAX_KV_SPLITS = 128


@dataclass(frozen=True)
class Features:
    """A kernel's compile-time features beside causal (which stays its own
    key): what a problem does to its scores, and how its batch is laid out.
    Window sizes, the cap and the sequence lengths are runtime arguments of
    the kernels, so every window, cap and batch shares one kernel.

    local: a sliding window, query i (aligned bottom-right, as causal) seeing
        keys i + s_k - s_q - window_left ... i + s_k - s_q + window_right;
        key blocks outside every row's window are neither loaded nor multiplied.
    softcap: scores soft-capped as softcap · tanh(scale · q·k / softcap).
    varlen: sequences of different lengths packed along one token axis
        (total_tokens, heads, d), found through cu_seqlens (varlen.py);
        otherwise a dense (batch, seqlen, heads, d) batch.
    sink: a learnable sink per query head, one more softmax column of that
        logit (scaled units) and no value: it takes part in every row's
        normaliser and LSE, never in O (softmax.py); the backward's
        preprocess sums its gradient.
    split_kv: (forward) the keys of every tile split into `parts` ranges
        (a runtime argument) that different CTAs take, each writing its
        rows' normalised O and LSE in fp32 to a workspace; split_combine.py
        merges them. Flash-decoding: a few query rows per sequence against
        a long cache fill the GPU along the keys.
    paged_kv: (forward, packed batch) K and V are paged caches (num_pages,
        page_size, h_kv, d) and each sequence's keys lie in the pages its
        row of a page table names, loaded in place (paged.py).
    rows_per_query: (forward) consecutive query rows that share one query
        position in the causal/local mask: a KV-cache step with several new
        tokens packs each token's g query heads of one KV head into g rows
        (decode.py), row r being token r // g.
    heads_in_rows: (forward, packed batch, with rows_per_query g) q, O and
        LSE in the caller's layout, each KV head's g query heads seen as g
        rows of every token (head_groups.py): no copies into that order.
    block_sparse: the tiles each query tile (forward) or key tile
        (backward) visits come from a list per (batch, head, tile), and the
        tiles that are partly visible from a bit mask (block_sparse.py): a
        FlexAttention BlockMask, without causal or window limits of its own.
    one_q_tile: (forward, packed batch) no sequence holds more query rows
        than one tile (a KV-cache step, decode.py): tile t is head t % h of
        sequence t // h, known without the scan of cu_seqlens_q that other
        packed batches take (varlen.VarlenScheduler), so a tile's loads of
        its lengths depend on no earlier load.
    """

    local: bool = False
    softcap: bool = False
    varlen: bool = False
    sink: bool = False
    split_kv: bool = False
    paged_kv: bool = False
    rows_per_query: int = 1
    heads_in_rows: bool = False
    block_sparse: bool = False
    one_q_tile: bool = False


PLAIN_FEATURES = Features()


def kernel_head_dim(head_dim: int) -> int | None:
    """The kernels' head dim that serves `head_dim`: itself, else the next one
    up (the op pads q, k, v with zeros to it); None where none does."""
    if head_dim <= 0 or head_dim % HEAD_DIM_MULTIPLE:
        return None
    return next((d for d in SUPPORTED_HEAD_DIMS if d >= head_dim), None)


def _align_1k(n: int) -> int:
    """Shared-memory buffers start on 1 KB (swizzle-pattern) boundaries."""
    return -(-n // 1024) * 1024


def smem_capacity(ctas_per_sm: int = 1) -> int:
    """Shared memory one CTA may take with ctas_per_sm of them on an SM."""
    return SMEM_PER_SM_BYTES // ctas_per_sm - 1024


def _check_shared_fields(config, bad, ctas_per_sm: int = 1) -> None:
    """The fields both kernels have: setmaxnreg targets, the register file they
    divide (among ctas_per_sm CTAs of an SM), the scheduler's L2 section size."""
    if not 1 <= config.l2_section_mb <= 1024:
        raise bad("l2_section_mb", "an integer in [1, 1024]")
    for field in ("producer_regs", "consumer_regs"):
        value = getattr(config, field)
        if value % 8 or not 24 <= value <= 256:
            raise bad(field, "a multiple of 8 in [24, 256] (setmaxnreg)")
    # setmaxnreg moves registers within what the launch gave the CTA: each
    # thread's share of the file, a multiple of 8 (168 at 384 threads); an
    # increase beyond what the decrease freed waits forever
    warpgroups = 1 + config.launched_warpgroups
    per_thread = min(REGISTERS_PER_SM // (WARPGROUP_THREADS * warpgroups * ctas_per_sm),
                     255) // 8 * 8
    total = config.producer_regs + config.launched_warpgroups * config.consumer_regs
    if total > warpgroups * per_thread:
        raise bad("consumer_regs", f"producer_regs + {config.launched_warpgroups} * "
                                   f"consumer_regs <= {warpgroups * per_thread} ({per_thread} "
                                   f"registers per thread at launch)")


def _field_error(config, head_dim: int):
    def bad(field: str, expected: str) -> ValueError:
        return ValueError(
            f"{type(config).__name__}.{field}: expected {expected}, got "
            f"{getattr(config, field)!r} (head_dim={head_dim}, config={config})")
    return bad


class _KernelConfig:
    """What both config dataclasses derive the same way from their fields
    (each defines `consumer_warpgroups`, a tile's)."""

    @property
    def launched_warpgroups(self) -> int:
        """The consumer warpgroups of a CTA: a tile's (FwdConfig: times the
        tiles it runs at once)."""
        return self.consumer_warpgroups

    @property
    def threads(self) -> int:
        """One producer warpgroup and the consumer warpgroups."""
        return WARPGROUP_THREADS * (self.launched_warpgroups + 1)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class FwdConfig(_KernelConfig):
    """Structural choices of the SM90 forward kernel (fwd_sm90.py).

    tile_m: query rows per CTA tile; each consumer warpgroup owns 64 of them,
        so tile_m // 64 consumer warpgroups are launched.
    tile_n: key/value rows per main-loop step (WGMMA N of S = Q·Kᵀ).
    kv_stages: depth of the K and V shared-memory rings filled by TMA.
    q_stages: depth of the Q ring, 1 or 2: with 2 the producer loads the next
        tile's Q as soon as it has the tile, under the current tile's main
        loop, instead of after the consumers' last Q·Kᵀ of it (where short
        rows leave too little work after that release to hide the load).
    pingpong: consumer warpgroups take turns issuing their GEMMs (named
        barriers), so one warpgroup's softmax runs under the other's WGMMA.
    intra_wg_overlap: inside a warpgroup, issue the next block's S = Q·Kᵀ
        before this block's probabilities are consumed by O += P·V, so the
        softmax runs while both GEMMs are in flight.
    persistent: grid = number of SMs, each CTA loops over tiles; otherwise
        one CTA per tile.
    dynamic_tiles: with persistent, a CTA takes round 0 by its index and
        claims each further tile from a global counter (scheduler.TileQueue),
        instead of the fixed snake deal; balances causal tiles, which differ
        in length.
    split_tail: non-causal, persistent: the tiles of the last, partial round
        are cut into key ranges that every SM shares, and the last part of
        each merges the others' rows (tail_split.py; the op picks the number
        of parts per problem, csrc/launch_plan.cpp).
    pv_wait_after_exp2: with intra_wg_overlap, the K stage's release is
        ordered after row 0's exp2 of this column (1-based; 0: no order), so
        the wait for the previous P·V, which ptxas keeps behind that release,
        comes after the first exponentials instead of before them.
    rederive_epilogue_coords: the epilogue derives its tile, stmatrix
        addresses and LSE rows from opaque copies of the tile and thread
        indices, instead of values LLVM hoists out of the persistent tile
        loop and keeps live through every main-loop step.
    rescale_o_before_pv: with intra_wg_overlap, O is rescaled for the
        probabilities of block j+1 while S_j = Q·K_jᵀ is in flight, right
        before O += P·V is issued, instead of after the wait for that P·V:
        the rescale (dv / 2 multiplies a thread at 64 rows) leaves the path
        from one GEMM issue to the next. Costs one factor per row in registers.
    o_in_v_smem: the epilogue stages O in the V ring's shared memory instead
        of a slab of its own (what makes a 128-row tile fit at head dim 192
        and 256). The consumer warpgroups meet after their last P·V before
        writing it, and the producer loads the next tile's first V only after
        the O stores have read it out (Q and the first K load before that).
    shared_o_slab: the consumer warpgroups stage O in one 64-row slab in
        turn (a warpgroup's TMA store, once it has read the slab out, hands it
        to the next) instead of a slab each: the shared memory of the others
        goes to wider K/V tiles where the V ring cannot hold O (e4m3: the
        consumers read the Vᵀ ring up to their last P·V). A warpgroup waits
        for its store's read before its next tile.
    bounded_softmax: (bf16 soft-capped scores) where the cap bounds every
        exponent within fp32's and bf16's range (softcap.py), the main loop
        keeps no running row maximum and never rescales O; otherwise, and
        False, a running maximum as for unbounded scores.
    skip_unmoved_rescale: a warp none of whose rows raised its running
        maximum on a step skips O's rescale (a vote and a branch; softmax.py):
        fewer instructions in a softmax-bound step, but a branch that ptxas
        does not schedule across.
    exp2_on_fma: with bounded_softmax, of every 8 exponentials of a row, how
        many the consumers compute as a polynomial on the FMA pipe instead of
        the MUFU unit (exp2_fma.py), 0 to 8: that softmax, without the
        running maximum's instructions, has issue slots to spare for them,
        and the cap's tanh loads the MUFU twice. Softmaxes with a maximum
        keep every exponential on the MUFU (their issue slots are the limit).
    warpgroup_key_ranges: under a right limit (causal) or a window, each
        consumer warpgroup computes only the K/V blocks that its own 64 rows
        see, and passes the tile's others through the rings uncomputed
        (mask.KeyWalk): a 192-row tile's first warpgroup stops one 128-key
        block short of its last warpgroup on the diagonal, and under a
        window its last starts one block later. The tile's loads do not
        change; its GEMMs and exponentials of rows that see nothing do.
    producer_regs / consumer_regs: setmaxnreg targets of the TMA warpgroup
        and of each consumer warpgroup.
    l2_section_mb: causal tiles run longest-first inside sections of heads
        whose K/V fit in this many MB of L2, a power of two of them
        (scheduler.py).
    kv_load_rows: 0, or (paged_kv) the page size where it is below tile_n:
        each K/V block then arrives as tile_n / kv_load_rows TMA loads, one
        per page, into one stage (paged.py).
    transpose_warps: (e4m3 inputs) the warps of the producer warpgroup,
        beside its TMA warp, that transpose each V stage into the Vᵀ ring
        the e4m3 P·V reads (fp8_operands.py); 1 to 3.
    ctas_per_sm: CTAs resident on one SM, 1 to 3 (the persistent grid is
        this many per SM, each with its share of the registers and shared
        memory): several interleave one tile's prologue and epilogue with
        the others' main loops, where short rows make those a large part of
        a tile.
    concurrent_tiles: tiles one CTA runs at once, 1 to 3, each a stream of
        its own: producer warp s loads tile stream s into bank s of the Q, K
        and V rings (each ring holds q_stages or kv_stages stages per bank),
        and consumer warpgroup s computes it (tile_m 64, one warpgroup a
        tile). As ctas_per_sm CTAs would, the streams interleave one tile's
        prologue and epilogue with the others' main loops, but one producer
        warpgroup serves them all, so the consumers keep the registers that
        further producer warpgroups would hold (three streams: 160 a thread,
        three CTAs: 136).
    """

    tile_m: int = 128
    tile_n: int = 128
    kv_stages: int = 2
    q_stages: int = 1
    pingpong: bool = True
    intra_wg_overlap: bool = True
    persistent: bool = True
    dynamic_tiles: bool = False
    split_tail: bool = False
    pv_wait_after_exp2: int = 0
    rederive_epilogue_coords: bool = False
    rescale_o_before_pv: bool = False
    o_in_v_smem: bool = False
    shared_o_slab: bool = False
    bounded_softmax: bool = True
    skip_unmoved_rescale: bool = False
    exp2_on_fma: int = 0
    warpgroup_key_ranges: bool = False
    producer_regs: int = 24
    consumer_regs: int = 240
    l2_section_mb: int = 16
    kv_load_rows: int = 0
    transpose_warps: int = 3
    ctas_per_sm: int = 1
    concurrent_tiles: int = 1

    @property
    def consumer_warpgroups(self) -> int:
        return self.tile_m // WGMMA_M

    @property
    def launched_warpgroups(self) -> int:
        return self.consumer_warpgroups * self.concurrent_tiles

    def smem_bytes(self, head_dim: int, head_dim_v: int | None = None,
                   fp8: bool = False) -> int:
        """Dynamic shared memory of the kernel's SharedStorage, as laid out there:
        mbarriers first, then Q, the K and V rings (fp8: one-byte elements,
        and the Vᵀ ring after V) and the 16-bit O slabs (or O in the V ring,
        which is then at least O's size), each 1 KB aligned."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        elem_bytes = 1 if fp8 else 2
        v_ring = self.kv_stages * self.tile_n * head_dim_v * elem_bytes
        if fp8:
            v_ring = _align_1k(v_ring) * 2                                    # V, Vᵀ
        banks = self.concurrent_tiles
        v_ring *= banks
        o_slabs = (WGMMA_M if self.shared_o_slab else self.tile_m) * head_dim_v * 2 * banks
        size = 8 * banks * (1 + 2 * self.q_stages + 6 * self.kv_stages) \
            + 4 * (8 + (banks - 1) * (self.q_stages + 1))                    # mbarriers, words
        size = _align_1k(size) + banks * self.q_stages * self.tile_m * head_dim * elem_bytes  # Q
        size = _align_1k(size) + banks * self.kv_stages * self.tile_n * head_dim * elem_bytes
        if self.o_in_v_smem:
            return _align_1k(size) + max(v_ring, o_slabs)                     # V / O
        size = _align_1k(size) + v_ring                                       # V
        return _align_1k(size) + o_slabs                                      # O slabs

    def validate(self, head_dim: int, head_dim_v: int | None = None, fp8: bool = False) -> None:
        """Raise ValueError naming the field when the combination cannot run
        (fp8: for e4m3 inputs)."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        bad = _field_error(self, head_dim)

        if not 1 <= self.transpose_warps <= 3:
            raise bad("transpose_warps", "1, 2 or 3 (the producer warpgroup's warps beside the "
                                         "TMA warp)")
        if fp8 and self.tile_n % 32:
            raise bad("tile_n", "a multiple of 32 for e4m3 inputs (the e4m3 WGMMA's K)")
        if fp8 and self.o_in_v_smem:
            raise bad("o_in_v_smem", "False for e4m3 inputs (the V ring holds bytes, O 16-bit "
                                     "values)")
        if self.shared_o_slab and self.o_in_v_smem:
            raise bad("shared_o_slab", "False with o_in_v_smem (O is staged in the V ring "
                                       "then, not in slabs)")
        if self.tile_m % WGMMA_M or not 1 <= self.consumer_warpgroups <= 3:
            raise bad("tile_m", "64, 128 or 192 (one consumer warpgroup per 64 rows)")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise bad("tile_n", "a multiple of 16 in [16, 256] (WGMMA N, and the P·V K step)")
        if not 1 <= self.kv_stages <= 8:
            raise bad("kv_stages", "an integer in [1, 8]")
        if self.q_stages not in (1, 2):
            raise bad("q_stages", "1 or 2 (a second Q tile hides the next tile's load; a "
                                  "third has nothing left to hide)")
        if self.intra_wg_overlap and self.kv_stages < 2:
            raise bad("kv_stages", ">= 2 when intra_wg_overlap is on (K_{j+1} and V_j are "
                                   "in flight together)")
        if not 0 <= self.pv_wait_after_exp2 <= self.tile_n // 4:
            raise bad("pv_wait_after_exp2", f"a column of a thread's row in [0, tile_n / 4 = "
                                            f"{self.tile_n // 4}]")
        if not 0 <= self.exp2_on_fma <= 8:
            raise bad("exp2_on_fma", "an integer in [0, 8] (of every 8 exponentials)")
        if self.exp2_on_fma and not self.bounded_softmax:
            raise bad("exp2_on_fma", "0 unless bounded_softmax (only a softmax without a "
                                     "running maximum takes exponentials to the FMA pipe)")
        if self.rescale_o_before_pv and not self.intra_wg_overlap:
            raise bad("rescale_o_before_pv", "False unless intra_wg_overlap (without it the "
                                             "rescale already precedes the P·V issue)")
        if self.warpgroup_key_ranges and (self.o_in_v_smem or not self.intra_wg_overlap):
            raise bad("warpgroup_key_ranges", "False with o_in_v_smem (blocks pass after the "
                                              "epilogue, which would stage O in their V "
                                              "stages) or without intra_wg_overlap (a passed "
                                              "block takes the turn of that loop's step)")
        if self.pv_wait_after_exp2 and not self.intra_wg_overlap:
            raise bad("pv_wait_after_exp2", "0 unless intra_wg_overlap (without it no P·V is "
                                            "in flight during the softmax)")
        if self.dynamic_tiles and not self.persistent:
            raise bad("dynamic_tiles", "False unless persistent (one CTA per tile has no "
                                       "next tile to claim)")
        if self.kv_load_rows and (self.kv_load_rows % 8 or self.tile_n % self.kv_load_rows
                                  or self.kv_load_rows >= self.tile_n):
            raise bad("kv_load_rows", "0, or a multiple of 8 (the swizzle's rows) that divides "
                                      "tile_n and is below it")
        if self.split_tail and (self.dynamic_tiles or not self.persistent):
            raise bad("split_tail", "False unless persistent, and False with dynamic_tiles (a "
                                    "claimed order has no fixed last round to split)")
        if self.ctas_per_sm not in (1, 2, 3):
            raise bad("ctas_per_sm", "1, 2 or 3")
        if self.ctas_per_sm > 1 and (self.split_tail or fp8):
            raise bad("ctas_per_sm", "1 with split_tail (its plan counts one CTA an SM) or "
                                     "e4m3 inputs (several CTAs an SM are built for 16-bit "
                                     "inputs only)")
        if self.concurrent_tiles not in (1, 2, 3):
            raise bad("concurrent_tiles", "1, 2 or 3 (a producer warp and a consumer "
                                          "warpgroup each)")
        if self.concurrent_tiles > 1 and (
                self.tile_m != WGMMA_M or self.ctas_per_sm > 1 or not self.persistent
                or self.split_tail or self.shared_o_slab or fp8
                or (self.o_in_v_smem and self.tile_n % WGMMA_M)):
            raise bad("concurrent_tiles", "1 unless tile_m is 64 in one persistent CTA an "
                                          "SM without split_tail, shared_o_slab or e4m3 "
                                          "inputs (and with o_in_v_smem a tile_n of whole "
                                          "64-row O slabs)")
        _check_shared_fields(self, bad, self.ctas_per_sm)
        smem = self.smem_bytes(head_dim, head_dim_v, fp8)
        capacity = smem_capacity(self.ctas_per_sm)
        if smem > capacity:
            # the field whose depth broke the budget: Q's second stage where it alone did
            field = ("q_stages" if self.q_stages > 1 and self.replace(q_stages=1).smem_bytes(
                head_dim, head_dim_v, fp8) <= capacity else "kv_stages")
            hint = ""
            if not (self.o_in_v_smem or self.shared_o_slab):
                if not fp8:
                    hint = " (o_in_v_smem saves the O slabs)"
                elif self.consumer_warpgroups > 1:
                    hint = " (shared_o_slab saves all but one O slab)"
            raise bad(field, f"a shared-memory footprint <= {capacity} B, this needs {smem} B "
                             f"at head dims {head_dim}/{head_dim_v}{hint}")


# Sequences up to this many tokens (queries and keys) take the short-sequence
# tiles of default_fwd_config.
SHORT_SEQLEN = 1024
# Sequences of at least this many tokens (queries or keys) take the
# long-sequence tiles of default_fwd_config (head dim 96 causal).
LONG_SEQLEN = 8192
# Causal sequences of at most this many tokens take the tiny tiles where
# they fill the GPU (tiny_fwd_config).
TINY_SEQLEN = 256
# A sliding window whose rows see at least this many keys takes the wide
# tiles of default_fwd_config (head dim 64).
WIDE_WINDOW_KEYS = 2048
# A sliding window whose rows see at least this many keys and fewer than
# WIDE_WINDOW_KEYS runs head dim 64's three tile streams (without a cap, not
# in a packed batch: fwd_config_for_problem's streamed_window).
STREAMED_WINDOW_KEYS = 1024
# Of every 8 exponentials of a bounded softmax (bf16 under a cap) at head
# dim 64, where the tanh and the exponentials load the MUFU unit twice as
# long as the GEMMs run, those taken to the FMA pipe (FwdConfig.exp2_on_fma).
CAPPED_EXP2_ON_FMA = 4
# Head dim 64's 64-row tiles run three CTAs an SM where they fill at least
# this many rounds of them (few_tiles in default_fwd_config); two below it,
# where a third CTA an SM leaves more SMs idle than it hides.
THREE_CTAS_MIN_ROUNDS = 3


def window_keys(window: tuple, seqlen_k: int) -> int:
    """The most keys a row of a local kernel sees: left + right + 1, an
    unbounded side (-1) counting every key."""
    left, right = (seqlen_k if side < 0 else side for side in window)
    return left + right + 1


@functools.lru_cache(maxsize=4096)  # asked on every call
def fwd_config_for_problem(head_dim: int, causal: bool, head_dim_v: int | None,
                           features: Features, seqlen_q: int, seqlen_k: int,
                           query_heads: int = 0, num_sms: int = 0,
                           window: tuple = (-1, -1)) -> FwdConfig:
    """The op's forward config for a problem: default_fwd_config, with the
    short-sequence tiles where no sequence is longer than SHORT_SEQLEN, the
    long-sequence ones where one has LONG_SEQLEN tokens or more, the tiny
    ones (tiny_fwd_config) where no sequence is longer than TINY_SEQLEN and
    they run two rounds or more, the wide ones where a local kernel's window
    (left, right; -1 unbounded) lets a row see WIDE_WINDOW_KEYS keys or
    more, and among the short ones the narrower tile (narrow_fwd_config)
    where the short tile leaves SMs idle, the wider one (wide_fwd_config)
    where it fills the SMs' waves better, one Q stage where a grid is one
    round (grid_rounds: no next tile to load ahead), and tiles dealt by
    index where a claimed-tile grid is two waves at most
    (fixed_deal_balances), two CTAs an SM of 64-row tiles instead of three
    where three would run fewer than THREE_CTAS_MIN_ROUNDS rounds
    (few_tiles), and the three tile streams of a window within
    STREAMED_WINDOW_KEYS up to the wide ones (streamed_window): query_heads (batch x query
    heads) and num_sms give the grid (0: unknown, neither)."""
    rows = max(seqlen_q, seqlen_k)
    short, long_rows, tiny_rows = rows <= SHORT_SEQLEN, rows >= LONG_SEQLEN, rows <= TINY_SEQLEN
    keys = window_keys(window, seqlen_k) if features.local else 0  # 0: no window
    wide_window = keys >= WIDE_WINDOW_KEYS
    streamed_window = not (features.softcap or features.varlen) \
        and STREAMED_WINDOW_KEYS <= keys < WIDE_WINDOW_KEYS
    few_tiles = 0 < query_heads and 0 < num_sms and grid_rounds(
        three_ctas_an_sm(True, False), seqlen_q, query_heads, num_sms) < THREE_CTAS_MIN_ROUNDS
    config = default_fwd_config(head_dim, causal, head_dim_v, features, short, wide_window,
                                long_rows, few_tiles, streamed_window)
    if query_heads <= 0 or num_sms <= 0:
        return config
    if short and features == PLAIN_FEATURES:
        tiny = tiny_fwd_config(head_dim, causal, head_dim_v)
        # three CTAs an SM beat the tiny tiles where they run (head dim 64)
        if tiny_rows and tiny is not None and config.ctas_per_sm < 3 \
                and grid_rounds(tiny, seqlen_q, query_heads, num_sms) >= 2:
            config = tiny
        narrow = narrow_fwd_config(head_dim, causal, head_dim_v)
        if narrow is not None and narrow_tiles_pay(config.tile_m, narrow.tile_m, causal,
                                                   seqlen_q, query_heads, num_sms):
            config = narrow
        wide = wide_fwd_config(head_dim, causal, head_dim_v)
        if wide is not None and fills_waves_better(wide.tile_m, config.tile_m, seqlen_q,
                                                   query_heads, num_sms):
            config = wide
    if config.q_stages > 1 and grid_rounds(config, seqlen_q, query_heads, num_sms) <= 1:
        config = one_q_stage(config)
    if fixed_deal_balances(config, features, seqlen_q, query_heads, num_sms):
        config = dealt_by_index(config)
    return config


def grid_rounds(config: FwdConfig, seqlen_q: int, query_heads: int, num_sms: int) -> int:
    """The rounds of tiles a dense grid of this config runs: its tiles over
    the CTAs that fit the GPU at once."""
    tiles = -(-seqlen_q // config.tile_m) * query_heads
    return -(-tiles // (num_sms * config.ctas_per_sm * config.concurrent_tiles))


@functools.lru_cache(maxsize=None)  # asked on every call of a grid of one round
def one_q_stage(config: FwdConfig) -> FwdConfig:
    """A Q-ring config with one Q stage, as a grid of one round
    (grid_rounds) takes it: a second stage has no next tile to load there
    (docs/findings.md)."""
    return config.replace(q_stages=1)


@functools.lru_cache(maxsize=None)  # asked on every call of a grid of two waves or less
def dealt_by_index(config: FwdConfig) -> FwdConfig:
    """A claimed-tile config with its tiles dealt by index instead
    (fixed_deal_balances)."""
    return config.replace(dynamic_tiles=False)


def fixed_deal_balances(config: FwdConfig, features: Features, seqlen_q: int,
                        query_heads: int, num_sms: int) -> bool:
    """Whether a claimed-tile config's dense grid runs at most two waves of
    tiles. The fixed deal then balances them as claiming would: in one wave
    every CTA runs the tile of its index; in two its snake hands the CTA
    with round 0's longest tile round 1's shortest (scheduler.py). And it
    leaves out the claim counter and the launch that zeroes it before every
    call (a few µs, much of a call at batch 1). Past two waves the last,
    partial round unbalances it (docs/findings.md)."""
    dense = not (features.varlen or features.block_sparse or features.split_kv
                 or features.paged_kv or features.local)
    return (config.dynamic_tiles and dense
            and grid_rounds(config, seqlen_q, query_heads, num_sms) <= 2)


@functools.lru_cache(maxsize=None)
def tiny_fwd_config(head_dim: int, causal: bool, head_dim_v: int | None = None):
    """The causal config of sequences of up to TINY_SEQLEN tokens on a grid
    of two rounds or more (docs/findings.md): head dim 64's 128-row tile,
    one CTA an SM of two consumer warpgroups, in place of two CTAs of 64
    rows (a 128-token sequence is one tile of it, and such a forward is
    bound by its memory traffic), not where three CTAs an SM run
    (fwd_config_for_problem: they beat it); head dim 128's 64 keys a step, the
    diagonal's masked columns halved. None elsewhere."""
    if not causal:
        return None
    config = default_fwd_config(head_dim, causal, head_dim_v, short=True, few_tiles=True)
    if head_dim <= 64:
        return config.replace(tile_m=2 * WGMMA_M, ctas_per_sm=1, consumer_regs=240)
    if head_dim == 128 and (head_dim_v or head_dim) == head_dim:
        return config.replace(tile_n=64)
    return None


@functools.lru_cache(maxsize=None)
def narrow_fwd_config(head_dim: int, causal: bool, head_dim_v: int | None = None):
    """The short-sequence config with fewer query rows a tile, where one was
    measured faster on a GPU the short tiles leave partly idle (batch 1,
    docs/findings.md): head dim 128 64 rows in one warpgroup. None elsewhere
    (head dim 64's short tiles have 64 rows already)."""
    config = default_fwd_config(head_dim, causal, head_dim_v, short=True)
    if head_dim == 128 and (head_dim_v or head_dim) == 128:
        return config.replace(tile_m=WGMMA_M)
    return None


def narrow_tiles_pay(tile_m: int, narrow_m: int, causal: bool, seqlen_q: int,
                     query_heads: int, num_sms: int) -> bool:
    """Whether narrow_m query rows a tile finish a short problem sooner than
    tile_m. Causal: where tile_m's tiles all start at once (no more of them
    than SMs), the longest, on the diagonal's far end, sets the time, and
    narrower tiles halve it. Non-causal (tiles of equal work): where the
    narrower tiles fill the SMs' waves by a tenth more."""
    if causal:
        return -(-seqlen_q // tile_m) * query_heads <= num_sms
    return fills_waves_better(narrow_m, tile_m, seqlen_q, query_heads, num_sms)


@functools.lru_cache(maxsize=None)
def wide_fwd_config(head_dim: int, causal: bool, head_dim_v: int | None = None):
    """The short-sequence config with more query rows a tile, where the short
    tiles run one round and part of another and the wider ones fill one
    (fills_waves_better; batch 1, docs/findings.md): head dim 96 non-causal, the
    192 x 112 tile of longer rows, without split_tail (it measured slower
    on a grid of one partial round). None elsewhere."""
    if causal or head_dim != 96 or (head_dim_v or head_dim) != head_dim:
        return None
    return default_fwd_config(head_dim, causal, head_dim_v).replace(split_tail=False)


def fills_waves_better(rows: int, than_rows: int, seqlen_q: int, query_heads: int,
                       num_sms: int) -> bool:
    """Whether tiles of `rows` query rows fill the SMs' waves (tiles over the
    slots of the rounds they take) by a tenth more than tiles of `than_rows`."""
    def wave_fill(tile_rows: int) -> float:
        count = -(-seqlen_q // tile_rows) * query_heads
        return count / (-(-count // num_sms) * num_sms)

    return wave_fill(rows) >= 1.1 * wave_fill(than_rows)


def two_ctas_an_sm(q_stages: int, dynamic_tiles: bool, pv_wait_after_exp2: int,
                   rederive_epilogue_coords: bool = False) -> FwdConfig:
    """Head dim 64's 64-row tiles, two CTAs an SM of one consumer warpgroup
    (232 registers) each: where rows see few key blocks (short rows,
    narrow windows, block masks), one CTA's tile prologue and epilogue run
    under the other's steps."""
    return FwdConfig(tile_m=WGMMA_M, tile_n=128, kv_stages=2, q_stages=q_stages,
                     persistent=True, dynamic_tiles=dynamic_tiles, producer_regs=24,
                     consumer_regs=232, rederive_epilogue_coords=rederive_epilogue_coords,
                     pv_wait_after_exp2=pv_wait_after_exp2, ctas_per_sm=2)


def three_tile_streams(dynamic_tiles: bool) -> FwdConfig:
    """Head dim 64's 64-row tiles, three at once in one CTA an SM
    (concurrent_tiles): a stream each of 128 keys a step in two K/V stages
    and one Q stage, O staged in its V bank, 160 registers a consumer
    thread. Where rows see few key blocks (short non-causal rows, block
    masks), two other tiles' steps run under a tile's prologue and
    epilogue, as with three CTAs an SM, but one producer warpgroup leaves
    the consumers the registers for 128 keys a step."""
    return FwdConfig(tile_m=WGMMA_M, tile_n=128, kv_stages=2, q_stages=1, persistent=True,
                     dynamic_tiles=dynamic_tiles, producer_regs=32, consumer_regs=160,
                     rederive_epilogue_coords=True, o_in_v_smem=True, pv_wait_after_exp2=4,
                     concurrent_tiles=3)


def three_ctas_an_sm(dynamic_tiles: bool, rederive_epilogue_coords: bool) -> FwdConfig:
    """Head dim 64's 64-row tiles, three CTAs an SM of one consumer
    warpgroup each: a third of the register file (136 a consumer thread)
    holds 64 keys a step with the next step's scores in flight, a third of
    the shared memory three K/V stages of them beside one Q stage. Where
    rows see few key blocks (short causal rows, narrow windows), two other
    CTAs' steps run under a tile's prologue and epilogue."""
    return FwdConfig(tile_m=WGMMA_M, tile_n=64, kv_stages=3, q_stages=1, persistent=True,
                     dynamic_tiles=dynamic_tiles, producer_regs=24, consumer_regs=136,
                     rederive_epilogue_coords=rederive_epilogue_coords,
                     pv_wait_after_exp2=4, ctas_per_sm=3)


@functools.lru_cache(maxsize=None)
def default_fwd_config(head_dim: int, causal: bool, head_dim_v: int | None = None,
                       features: Features = PLAIN_FEATURES, short: bool = False,
                       wide_window: bool = False, long_rows: bool = False,
                       few_tiles: bool = False, streamed_window: bool = False) -> FwdConfig:
    """The op's forward config for a problem (chosen with profiling.sweep on an
    H100; docs/findings.md):

    - every head dim: persistent; causal claims its tiles (dynamic_tiles),
      non-causal deals them in a fixed order and splits the last round
      (split_tail, where the plan's cost model gains);
    - head dim 64: 192 query rows (three consumer warpgroups amortise each
      K/V tile), three K/V stages, 160 registers per consumer thread, the
      epilogue's addresses re-derived (held through the main loop they spill);
    - head dim 96: 192 query rows of 112 keys a step (three consumer
      warpgroups of 160 registers; 128 keys spill there) beyond short
      sequences, causal only over long rows (long_rows: a sequence of
      LONG_SEQLEN tokens or more); 128 x 128 otherwise, and in packed
      batches, windows and with sinks;
    - head dim 128 non-causal: 160 keys per step; causal keeps 128 (fewer
      masked columns on the diagonal); soft-capped scores (without a window,
      a packed batch or sinks: not measured there) 192 rows of three
      consumer warpgroups without ping-pong, 80 keys a step: the cap's tanh
      doubles the softmax's exponential-unit work, and three softmaxes
      interleave where two took turns;
    - head dims 192 and 256: O staged in the V ring (o_in_v_smem), which
      leaves room for two stages of 128 keys at 192 with a 128-wide V, 112
      keys at 192/192, and 80 at 256 (FlashAttention-3's tiles there); at a
      256-wide V, O rescaled before the P·V issue (rescale_o_before_pv).
    - short sequences (short: none longer than SHORT_SEQLEN): head dim 64
      64-row tiles, two CTAs an SM (ctas_per_sm) of one consumer warpgroup
      of 232 registers each, whose tiles' prologues and epilogues, a large
      part of a short tile, run under the other's main loop; causal, three
      CTAs an SM of 64 keys a step (three_ctas_an_sm), caps and sinks
      included, unless the grid has few tiles (few_tiles: fewer than
      THREE_CTAS_MIN_ROUNDS rounds of them), where a third CTA leaves SMs
      idle (there, in packed batches, under a cap and with sinks the
      128-row tile, two consumer warpgroups of 240 registers, causal);
      non-causal (caps and sinks too), three tile streams of 128 keys a step
      in one CTA (three_tile_streams) unless the grid has few tiles; head
      dim 128 non-causal 128 keys a step (160 split a 1k sequence into
      uneven steps); a second Q
      stage (q_stages) at head dims 64-128, where short rows (causal: the
      diagonal's tiles of one to eight key blocks) leave too little work
      after the last Q·Kᵀ to hide the next tile's Q load; at head dim 64
      causal at every length too, and under a window at head dims 64-128,
      caps and sinks included (not in packed batches: no gain there);
      fwd_config_for_problem takes it back where a grid of one round has
      no next tile, and gives causal rows of up to TINY_SEQLEN tokens the
      tiny tiles on a grid of two rounds or more (tiny_fwd_config: head
      dim 64 128 rows where three CTAs an SM do not run, head dim 128 64
      keys a step);
    - a sliding window (local) takes the causal choices (its tiles start at
      different key blocks: claimed, never split), and at head dim 64 the
      short causal rows' three CTAs an SM of 64-row tiles (a row's few key
      blocks leave a tile's prologue and epilogue as large a share as a
      short row's; with caps, sinks and in packed batches too; the
      epilogue's addresses held), or with few tiles two CTAs (the P·V wait
      after the 8th exponential), unless the window is wide (wide_window: a
      row sees WIDE_WINDOW_KEYS keys or more), where the 192-row tile's K/V
      reuse outweighs the masked edges it adds; a window of
      STREAMED_WINDOW_KEYS up to the wide ones without a cap
      (streamed_window) three tile streams of 128 keys a step instead of
      either, unless the grid has few tiles (under a cap three CTAs' 64
      keys measured faster).
    - head dim 64's 192-row tile under a right limit or a window, and head
      dim 96's causal one, without a cap: each warpgroup walks the key
      blocks its own rows see (warpgroup_key_ranges; under a cap it
      measured slower), and under a window with one Q stage and the P·V
      wait after the 8th exponential.
    - a packed batch (varlen) takes the causal choices too (its tiles
      differ in length with their sequences) but keeps head dim 64's
      192-row tile: a sequence's last tile is partly empty, yet the wider
      tile's K/V reuse gains more.
    - bf16 scores under a cap at head dim 64 (bounded_softmax): every tile
      but a wide window's (whose registers spill with it) takes
      CAPPED_EXP2_ON_FMA of every 8 exponentials to the FMA pipe.
    """
    config = _fwd_tiles(head_dim, causal, head_dim_v, features, short, wide_window,
                        long_rows, few_tiles, streamed_window)
    if features.softcap and head_dim <= 64 and not wide_window:
        config = config.replace(exp2_on_fma=CAPPED_EXP2_ON_FMA)
    return config


def _fwd_tiles(head_dim: int, causal: bool, head_dim_v: int | None, features: Features,
               short: bool, wide_window: bool, long_rows: bool, few_tiles: bool,
               streamed_window: bool) -> FwdConfig:
    """default_fwd_config's tiles, warpgroups and pipelines."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if features.block_sparse:
        return block_sparse_fwd_config(head_dim, head_dim_v,
                                       features.softcap and features.sink)
    claimed = causal or features.local or features.varlen
    if head_dim > 128:
        tile_n = 80 if head_dim > 192 else 128 if head_dim_v <= 128 else 112
        # split_tail's merge spills there
        return FwdConfig(tile_m=128, tile_n=tile_n, kv_stages=2, persistent=True,
                         dynamic_tiles=claimed, split_tail=False,
                         pv_wait_after_exp2=0 if head_dim_v > 192 else 8,
                         rederive_epilogue_coords=causal and head_dim == 192,
                         rescale_o_before_pv=head_dim_v > 192, o_in_v_smem=True)
    if features.softcap and head_dim == head_dim_v == 128 and not (
            features.local or features.varlen or features.sink):
        # the cap's tanh doubles the softmax's MUFU work: three softmaxes interleave
        return FwdConfig(tile_m=3 * WGMMA_M, tile_n=80, kv_stages=2, pingpong=False,
                         persistent=True, dynamic_tiles=claimed, split_tail=not claimed,
                         producer_regs=32, consumer_regs=160, rederive_epilogue_coords=True,
                         pv_wait_after_exp2=8)
    plain = not (features.local or features.varlen or features.softcap or features.sink)
    # the next tile's Q loads under this one's: where a tile's rows are short
    # (causal diagonal tiles of one to eight key blocks, or short rows), at
    # head dim 64 causal with any score variant (its three K/V stages still
    # fit), and under a window up to head dim 128 (a row's keys end at its
    # window); not in packed batches (no gain measured)
    q_ring = (head_dim <= 64 and causal or head_dim <= 128 and features.local) \
        and not features.varlen
    q_stages = 2 if (plain and short) or q_ring else 1
    if head_dim <= 64 and streamed_window and not few_tiles:
        return three_tile_streams(claimed)
    if head_dim <= 64 and features.local and not wide_window:
        if not few_tiles:
            return three_ctas_an_sm(claimed, rederive_epilogue_coords=False)
        return two_ctas_an_sm(q_stages, claimed, pv_wait_after_exp2=8)
    if head_dim <= 64 and short and causal and not (features.varlen or few_tiles):
        return three_ctas_an_sm(claimed, rederive_epilogue_coords=True)
    if head_dim <= 64 and short and not (causal or features.local or features.varlen
                                         or few_tiles):
        return three_tile_streams(claimed)
    if head_dim <= 64 and short and plain:
        return two_ctas_an_sm(q_stages, claimed, pv_wait_after_exp2=2 if causal else 4,
                              rederive_epilogue_coords=True)
    # a 192-row tile's first warpgroup sees a block fewer on the diagonal,
    # its last one a block fewer at a window's left edge
    ranged = (causal or features.local) and not features.softcap
    if head_dim <= 64:  # a window here is wide
        wide = not (short and causal)
        pv_wait = 2 if causal else 4
        if wide and ranged and features.local:  # each measured faster there
            q_stages, pv_wait = 1, 8
        return FwdConfig(tile_m=192 if wide else 128, tile_n=128, kv_stages=3,
                         q_stages=q_stages, persistent=True, dynamic_tiles=claimed,
                         split_tail=not claimed,
                         producer_regs=32 if wide else 24, consumer_regs=160 if wide else 240,
                         rederive_epilogue_coords=True, pv_wait_after_exp2=pv_wait,
                         warpgroup_key_ranges=wide and ranged)
    if head_dim <= 96 and not (features.local or features.varlen or features.sink) \
            and (long_rows if causal else not short):
        return FwdConfig(tile_m=192, tile_n=112, kv_stages=3, persistent=True,
                         dynamic_tiles=claimed, split_tail=not claimed, producer_regs=32,
                         consumer_regs=160, rederive_epilogue_coords=True,
                         pv_wait_after_exp2=4, warpgroup_key_ranges=ranged)
    if head_dim <= 96 or claimed or short:
        return FwdConfig(tile_m=128, tile_n=128, kv_stages=2, q_stages=q_stages,
                         persistent=True, dynamic_tiles=claimed, split_tail=not claimed,
                         pv_wait_after_exp2=8)
    return FwdConfig(tile_m=128, tile_n=160, kv_stages=2, persistent=True, split_tail=True,
                     pv_wait_after_exp2=8)


# The block size of a block-sparse mask as the kernels take it (queries x
# keys): FlexAttention's default. Block-sparse kernels' tiles divide it, so
# that each tile lies in one block (python_api/block_mask.py).
SPARSE_BLOCK = 128


@functools.lru_cache(maxsize=None)
def block_sparse_fwd_config(head_dim: int, head_dim_v: int,
                            capped_with_sink: bool = False) -> FwdConfig:
    """The forward config under a block mask: the causal choices (tiles that
    differ in length, claimed; 128 keys a step, which divides the mask's
    blocks); at head dim 64 three tile streams of 64-row tiles in one CTA
    (three_tile_streams: a query tile walks only its listed blocks, a few
    at low densities, and two other tiles' steps run under its prologue and
    epilogue), or under a cap together with sinks (capped_with_sink), whose
    registers spill at 160 a thread, two CTAs an SM of the same tile;
    above 128, 64 keys a step with O staged in the V ring."""
    if head_dim > 128:
        return FwdConfig(tile_m=128, tile_n=64, kv_stages=2, persistent=True,
                         dynamic_tiles=True, pv_wait_after_exp2=0 if head_dim_v > 192 else 8,
                         rescale_o_before_pv=head_dim_v > 192, o_in_v_smem=True)
    if head_dim <= 64 and capped_with_sink:
        return two_ctas_an_sm(q_stages=2, dynamic_tiles=True, pv_wait_after_exp2=8)
    if head_dim <= 64:
        return three_tile_streams(dynamic_tiles=True)
    return FwdConfig(tile_m=128, tile_n=128, kv_stages=2, persistent=True, dynamic_tiles=True,
                     pv_wait_after_exp2=8)


# The head dims of the e4m3 forward: multiples of 32 (the e4m3 WGMMA's K) among
# the kernels', with v's equal to q's.
FP8_HEAD_DIMS = (64, 96, 128, 192, 256)


# Causal e4m3 problems whose rows see at least this many keys take the wide
# key tile of fp8_fwd_config at head dims 96 and 128 (measured at 128).
FP8_WIDE_CAUSAL_KEYS = 4096


# Causal e4m3 rows of at least this many keys take three consumer warpgroups
# at head dim 128 (fp8_fwd_config's three_warpgroup_rows).
FP8_THREE_WARPGROUP_CAUSAL_KEYS = 8192


# e4m3 rows of at most this many keys keep two consumer warpgroups where three
# need longer rows to gain: non-causal at head dims 96 and 128 (measured at
# 128), causal at head dim 64 (fp8_fwd_config's short_rows).
FP8_SHORT_ROW_KEYS = 1024


# Causal e4m3 rows of at least this many keys keep one Q stage in three
# warpgroups (head dims 64 and 128), where the second measured slower
# (fp8_fwd_config's long_rows).
FP8_LONG_CAUSAL_KEYS = 16384

# The shortest row (keys) of each class of rows that fp8_config_for_problem
# tells apart: what precompile builds one e4m3 forward for.
FP8_ROW_CLASS_KEYS = (1, FP8_SHORT_ROW_KEYS + 1, FP8_WIDE_CAUSAL_KEYS,
                      FP8_THREE_WARPGROUP_CAUSAL_KEYS, FP8_LONG_CAUSAL_KEYS)


@functools.lru_cache(maxsize=4096)  # asked on every e4m3 call
def fp8_config_for_problem(head_dim: int, causal: bool, features: Features,
                           seqlen_k: int) -> FwdConfig:
    """The op's e4m3 forward config for a problem: fp8_fwd_config, with the
    wide key tile for causal attention over FP8_WIDE_CAUSAL_KEYS keys or
    more, three warpgroups at head dim 128 over FP8_THREE_WARPGROUP_CAUSAL_KEYS,
    the short-row tiles for rows of up to FP8_SHORT_ROW_KEYS, and one Q stage
    in three warpgroups for causal rows of FP8_LONG_CAUSAL_KEYS or more."""
    plain_causal = causal and not features.local
    return fp8_fwd_config(head_dim, causal, features,
                          wide_causal=plain_causal and seqlen_k >= FP8_WIDE_CAUSAL_KEYS,
                          three_warpgroup_rows=(plain_causal and seqlen_k
                                                >= FP8_THREE_WARPGROUP_CAUSAL_KEYS),
                          short_rows=seqlen_k <= FP8_SHORT_ROW_KEYS,
                          long_rows=seqlen_k >= FP8_LONG_CAUSAL_KEYS)


@functools.lru_cache(maxsize=None)
def fp8_fwd_config(head_dim: int, causal: bool, features: Features = PLAIN_FEATURES,
                   wide_causal: bool = False, short_rows: bool = False,
                   long_rows: bool = False, three_warpgroup_rows: bool = False) -> FwdConfig:
    """The forward config for e4m3 q, k, v (FP8_HEAD_DIMS), chosen with
    profiling.sweep on an H100 (docs/findings.md). The producer warpgroup's
    three spare warps transpose V into a Vᵀ ring of as many stages as V's.
    Scheduling as the 16-bit kernels': claimed tiles for causal and windows,
    the split tail otherwise. The FP8 GEMMs take half the 16-bit ones' time
    against the same softmax, whose exponentials then take as long on the
    MUFU unit as the GEMMs on the tensor cores; the configs give the
    softmax the most independent work the registers allow:

    - head dims up to 128 non-causal, 64 causal, and 128 causal over rows of
      FP8_THREE_WARPGROUP_CAUSAL_KEYS or more (three_warpgroup_rows,
      fp8_config_for_problem): 192-row tiles of three consumer warpgroups
      (152 registers each, the transposers 40) without ping-pong, whose
      three softmaxes interleave on every SM sub-partition,
      128 keys a step at head dim 64, 96 above, three K/V stages (causal at
      head dim 128 with the epilogue's coordinates rederived: spill-free);
    - rows of a few steps (short_rows: FP8_SHORT_ROW_KEYS), whose steps do
      not fill three stages: non-causal at head dims 96 and 128 128-row
      tiles of two warpgroups taking turns (ping-pong), 128 keys a step;
      causal at head dim 64 128-row tiles of two, 192 keys a step;
    - head dims 96 and 128 causal: 128-row tiles of two, without ping-pong,
      128 keys a step, 192 over rows of FP8_WIDE_CAUSAL_KEYS or more
      (wide_causal; measured at 128, spill-free at 96), whose masked
      diagonal costs less there than the wider tile gains;
    - head dims 192 and 256: 128-row tiles of two, 128 keys a step at 192
      and 96 at 256, where K, V and Vᵀ stages that wide fit beside Q only
      with one O slab that the warpgroups take in turn (shared_o_slab).

    Claimed tiles (causal) take a second Q stage up to head dim 128, where
    it fits: the producer loads a claimed tile's Q while the one before runs;
    not in three warpgroups over the longest rows (long_rows), where it
    measured slower.

    Without ping-pong a warp skips O's rescale on the steps where none of its
    rows' maxima rose (skip_unmoved_rescale); with it that branch measured
    slower than the multiplies. Causal three-warpgroup tiles at head dim 64
    walk each warpgroup's own key blocks (warpgroup_key_ranges; at 128,
    96 keys a step, they measured slower)."""
    claimed = causal or features.local
    if head_dim <= 64:
        three_warpgroups = not (claimed and short_rows)
    else:
        three_warpgroups = (head_dim <= 128 and not (claimed or short_rows)
                            or head_dim == 128 and three_warpgroup_rows)
    q_stages = 2 if claimed and head_dim <= 128 and not (three_warpgroups and long_rows) else 1
    if three_warpgroups:
        return FwdConfig(tile_m=3 * WGMMA_M, tile_n=128 if head_dim <= 64 else 96, kv_stages=3,
                         q_stages=q_stages, pingpong=False, persistent=True,
                         dynamic_tiles=claimed,
                         split_tail=not claimed, pv_wait_after_exp2=0,
                         rederive_epilogue_coords=claimed and head_dim > 64,
                         skip_unmoved_rescale=True, producer_regs=40, consumer_regs=152,
                         transpose_warps=3, warpgroup_key_ranges=claimed and head_dim <= 64)
    if head_dim <= 128 and not claimed:
        return FwdConfig(tile_m=2 * WGMMA_M, tile_n=128, kv_stages=2, pingpong=True,
                         persistent=True, split_tail=True, pv_wait_after_exp2=0,
                         producer_regs=40, consumer_regs=232, transpose_warps=3)
    producer_regs, consumer_regs = 56, 224
    if head_dim <= 128:
        tile_n, pv_wait = (192 if head_dim <= 64 or wide_causal else 128), 8
        if wide_causal:
            producer_regs = 40
    else:
        tile_n, pv_wait = (128 if head_dim <= 192 else 96), 0
        if head_dim > 192 and not claimed:  # the split tail's merge spills with 224
            producer_regs, consumer_regs = 40, 232
    return FwdConfig(tile_m=2 * WGMMA_M, tile_n=tile_n, kv_stages=2,
                     q_stages=q_stages, pingpong=False,
                     persistent=True, dynamic_tiles=claimed, split_tail=not claimed,
                     pv_wait_after_exp2=pv_wait, skip_unmoved_rescale=True,
                     shared_o_slab=head_dim > 192, producer_regs=producer_regs,
                     consumer_regs=consumer_regs, transpose_warps=3)


@functools.lru_cache(maxsize=None)
def decode_fwd_config(head_dim: int, head_dim_v: int | None = None,
                      short_parts: bool = False) -> FwdConfig:
    """The forward config of attention against a KV cache (python_api/decode.py):
    a few query rows per (sequence, KV head), so one 64-row consumer
    warpgroup per tile (no ping-pong partner); tiles dealt in a fixed order
    (the split count aims at one wave of them, and no tile counter needs
    zeroing before each call); 128 keys a step in two stages, 64 above head
    dim 128, and 64 where a split's parts hold a few blocks (short_parts,
    which python_api/decode.py asks for 16-bit caches: each part is its
    chain of dependent steps, and a 64-key step's GEMMs and softmax over all
    64 rows are half a 128-key one's; a long part streams more bytes a step
    with 128; docs/findings.md, "Decode"); 56 registers for the producer, which holds a block's page
    numbers (up to 8) through the wait for its stage: they spill at 40
    (pages of 16, split, head dim 128)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    wide = max(head_dim, head_dim_v) <= 128 and not short_parts
    return FwdConfig(tile_m=64, tile_n=128 if wide else 64, kv_stages=2, pingpong=False,
                     persistent=True, dynamic_tiles=False, split_tail=False, producer_regs=56)
