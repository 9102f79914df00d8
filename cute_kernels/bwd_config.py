"""The backward kernel's configuration (bwd_sm90.py): BwdConfig, its
validation, and the defaults the torch op picks per problem; and the tiles
a block mask is packed for, which the forward's config and the backward's
set together. Shared pieces (features, shared-memory and register budgets,
the field errors) are those of config.py."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .config import (BACKWARD_OWN_KEYS_MAX_DIM, PLAIN_FEATURES, SMEM_CAPACITY_BYTES,
                     SUPPORTED_HEAD_DIMS, WGMMA_M, Features, _align_1k, _check_shared_fields,
                     _field_error, _KernelConfig, block_sparse_fwd_config)

# convert_dq's ring from the dQ writer to the converter (dq_convert.py):
# slots of (query block, head, sequence), with a full and an empty mbarrier
# each; kept in every kernel
CONVERT_STAGES = 2
SLOT_FIELDS = 3
CONVERT_RING_BYTES = CONVERT_STAGES * (2 * 8 + SLOT_FIELDS * 4) + 8  # + the staging's

@dataclass(frozen=True)
class BwdConfig(_KernelConfig):
    """Structural choices of the SM90 backward kernel (bwd_sm90.py).

    One CTA owns tile_n keys (tile_n // 64 · dim_split consumer warpgroups,
    or two with keys_on_n) and walks the query tiles that see them, tile_m
    queries at a time.
    tile_m: queries per main-loop step (WGMMA N of Sᵀ = K·Qᵀ, K of dV/dK).
        A multiple of 64 (dQ = dS·K with the warpgroups splitting its rows,
        or at 64 its columns), or of 16 otherwise, e.g. 80: dQ is then
        computed transposed, dQᵀ = Kᵀ·dSᵀ, with head_dim on WGMMA's M axis,
        64 rows per warpgroup.
    tile_n: keys per CTA.
    dim_split: consumer warpgroups per 64 keys. 1: each warpgroup owns its
        64 keys, keeps dK and dV for all of the head dim, and hands Pᵀ and
        dSᵀ to the dV and dK GEMMs in registers. 2: two warpgroups share the
        64 keys (tile_n 64); each computes Sᵀ and dPᵀ for half of the query
        columns and dK, dV for half of the head dims, so Pᵀ and dSᵀ meet in
        shared memory. Head dims above 128 need it: dK and dV of 64 keys
        take (d + dv) / 2 registers per thread of one warpgroup.
    keys_on_n: the scores untransposed, keys on WGMMA's N axis: two
        warpgroups own tile_n / 2 keys each (any multiple of 16, so 96 keys
        a CTA at head dim 192) and compute S = Q·Kᵀ and dP = dO·Vᵀ for them
        over all tile_m (64) queries, then dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS
        with the head dims on M, P and dS read back from shared memory
        (stored transposed, as the other layouts' Pᵀ and dSᵀ). A CTA of
        more keys than dim_split's 64 reads each query block's Q and dO and
        reduces its dQ partial for more FLOPs. Not with split_gqa (its fp32
        partials leave from registers in the keys-on-M order) nor with a
        block mask (its bits are addressed in Sᵀ order).
    qdo_stages: depth of the Q (+LSE₂) and dO (+D) shared-memory rings.
    do_stages: depth of the dO (+D) ring where it differs from Q's (0: the
        same, qdo_stages).
    ds_buffers: buffers of dSᵀ in the ring: 2, or 1 with keys_on_n, where
        every consumer warpgroup then meets the others at one more barrier
        a step before it overwrites dSᵀ (another warpgroup's dQ GEMM of the
        step before may still read it); frees tile_n · tile_m 16-bit values
        of shared memory.
    deterministic: dQ partial sums are added to the fp32 accumulator in
        key-block order (a per-tile semaphore), so gradients are bitwise
        reproducible; otherwise in whatever order CTAs finish.
    dv_at_ds_barrier: issue dV += Pᵀ·dO after dSᵀ is written to shared
        memory, just before the barrier where the warpgroups meet for dQ, so
        a warpgroup that arrives first has its dV GEMM running while it
        waits; off, right after dSᵀ is computed. Where P goes through
        shared memory (dim_split, keys_on_n), dV is issued just after that
        barrier either way.
    stats_early: read each query block's LSE₂ from shared memory into
        registers as soon as its Q stage has landed, ahead of the GEMM issue
        (D ahead of the dV issue), instead of next to each use: an LDS issued
        behind HGMMAs waits until the tensor core has accepted them. Costs
        tile_m / 4 registers per statistic.
    dq_one_warpgroup: the first consumer warpgroup computes all of dQ =
        dS·K (WGMMA N = head_dim) while the others skip it and go on to
        their dK GEMM and the next query block's scores, so their
        exponentials overlap its dQ GEMM; one dQ slab a step. Only where
        the warpgroups would split dQ's columns (tile_m 64 with several
        consumer warpgroups). flash-attn-4's SM90 backward takes this at
        head dim 96 (its dQ_single_wg).
    dq_direct: each consumer thread adds its dQ partial into the fp32
        accumulator with 16-byte vector reductions from registers, instead of
        staging it in shared memory for the writer warp's bulk reduce-add:
        frees tile_m · head_dim · 4 bytes of shared memory (at head dim 256 a
        second Q/dO stage). Not with deterministic (the writer orders the
        adds).
    split_gqa: one CTA per (key block, query head) instead of per (key block,
        KV head): with GQA a small grid fills the GPU and the longest CTA is
        q_per_kv times shorter; dK and dV then leave as fp32 partials per
        query head, summed over each group afterwards (bwd_pre_post.GroupSum).
    dynamic_tiles: a persistent grid whose CTAs take round 0 by their index
        and claim each further key block from a global counter, as
        FwdConfig.dynamic_tiles; the preprocess zeroes the counter. Not with
        deterministic (its semaphore counts turns).
    dkv_via_scores: dK and dV leave through the dSᵀ buffers (one after the
        other where both do not fit at once) instead of the K and V
        buffers, which are then released as soon as the walk's last GEMM
        has read them: with dynamic_tiles the next key block's K/V load runs
        under this block's epilogue instead of after it. Not where scores
        go through shared memory (dim_split, keys_on_n) nor with split_gqa
        (dK and dV leave from registers).
    convert_dq: the main kernel converts dQ: the key block whose add
        completes a query tile's accumulator sends it to two otherwise idle
        producer warps, which write dQ while the tile is in L2 and drop its
        lines (dq_convert.py); no postprocess. Not with dq_direct (the
        consumers' own adds are not counted), a learnable sink or a block
        mask (bwd_sm90.py says why).
    dq_first_store: a query tile's first dQ partial is stored into the fp32
        accumulator and later ones added (dq_accum.py, first touch), so the
        preprocess does not zero it: without the deterministic order the
        first is claimed per tile with a compare-and-swap. Not with
        dq_direct (each consumer thread adds its own share) nor convert_dq
        (its counters take the tiles' slots).
    l2_section_mb: causal key blocks run longest-first inside sections of
        heads whose Q, dO and dQ accumulator fit in this many MB of L2, a
        power of two of them (scheduler.py).
    exp2_on_fma: (bf16 inputs) of every 8 exponentials of P, how many are
        polynomials on the FMA pipe instead of MUFU ops (exp2_fma.py), 0 to
        8: where a cap's tanh doubles the MUFU work. fp16 kernels keep every
        exponential on the MUFU (slower with a share, measured).
    producer_regs / consumer_regs: setmaxnreg targets.
    """

    tile_m: int = 64
    tile_n: int = 128
    dim_split: int = 1
    keys_on_n: bool = False
    qdo_stages: int = 2
    do_stages: int = 0
    ds_buffers: int = 2
    deterministic: bool = False
    dv_at_ds_barrier: bool = False
    stats_early: bool = False
    dq_one_warpgroup: bool = False
    dq_direct: bool = False
    split_gqa: bool = False
    dynamic_tiles: bool = False
    dkv_via_scores: bool = False
    convert_dq: bool = False
    dq_first_store: bool = False
    exp2_on_fma: int = 0
    producer_regs: int = 24
    consumer_regs: int = 240
    l2_section_mb: int = 16

    @property
    def consumer_warpgroups(self) -> int:
        if self.keys_on_n:
            return 2
        return self.tile_n // WGMMA_M * self.dim_split

    @property
    def dq_warpgroups(self) -> int:
        """The consumer warpgroups that compute a share of dQ (and hand the
        writer warp a slab each)."""
        return 1 if self.dq_one_warpgroup else self.consumer_warpgroups

    def shares_scores(self) -> bool:
        """P and dS reach the dK and dV GEMMs through shared memory (dim_split
        or keys_on_n), not as register A operands."""
        return self.keys_on_n or self.dim_split > 1

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

    def score_buffers(self) -> int:
        """Stages of the 16-bit (tile_n, tile_m) ring: dSᵀ in ds_buffers (two:
        one step's dQ GEMM of another warpgroup may still read it while the
        next step writes), Pᵀ beside them where it goes through shared
        memory: two with dim_split (both warpgroups read all of it), one with
        keys_on_n (only its own warpgroup, whose GEMMs retire within the
        step)."""
        if self.keys_on_n:
            return self.ds_buffers + 1
        return 4 if self.dim_split > 1 else 2

    def dkv_fits_scores(self, head_dim: int, head_dim_v: int) -> bool:
        """Whether dkv_via_scores can stage dK and dV in the dSᵀ buffers."""
        return (not self.shares_scores() and not self.split_gqa
                and max(head_dim, head_dim_v) <= self.score_buffers() * self.tile_m)

    def dkv_at_once(self, head_dim: int, head_dim_v: int) -> bool:
        """With dkv_via_scores: whether dK and dV fit the dSᵀ buffers
        together (else dK goes first, then dV)."""
        return head_dim + head_dim_v <= self.score_buffers() * self.tile_m

    def dO_stages(self) -> int:
        """The dO (+D) ring's depth."""
        return self.do_stages or self.qdo_stages

    def smem_bytes(self, head_dim: int, head_dim_v: int | None = None,
                   elem_bytes: int = 2) -> int:
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        both = head_dim + head_dim_v
        stages = self.qdo_stages + self.dO_stages()
        size = 8 * (2 + 2 * stages) + CONVERT_RING_BYTES                           # mbarriers
        size = _align_1k(size) + self.tile_n * both * elem_bytes                   # K, V
        size = _align_1k(size) + self.tile_m * elem_bytes * (
            self.qdo_stages * head_dim + self.dO_stages() * head_dim_v)             # Q, dO
        size = _align_1k(size) + stages * self.stat_stage_floats() * 4             # LSE, D
        size = _align_1k(size) + self.score_buffers() * self.tile_n * self.tile_m * elem_bytes
        if not self.dq_direct:
            size = _align_1k(size) + self.tile_m * head_dim * 4                    # dQ partial
        if self.convert_dq:
            size = _align_1k(size) + self.tile_m * head_dim * 4 // self.dq_warpgroups  # staging
        return size

    def validate(self, head_dim: int, head_dim_v: int | None = None) -> None:
        bad = _field_error(self, head_dim)
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim: expected one of {SUPPORTED_HEAD_DIMS} for the backward "
                             f"kernel, got {head_dim}")
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if head_dim_v not in SUPPORTED_HEAD_DIMS or head_dim_v > head_dim:
            raise ValueError(f"head_dim_v: expected one of {SUPPORTED_HEAD_DIMS} up to "
                             f"head_dim {head_dim} for the backward kernel, got {head_dim_v}")

        if self.dim_split not in (1, 2):
            raise bad("dim_split", "1 or 2 (consumer warpgroups per 64 keys)")
        if not 0 <= self.exp2_on_fma <= 8:
            raise bad("exp2_on_fma", "an integer in [0, 8] (of every 8 exponentials)")
        if self.keys_on_n:
            self._validate_keys_on_n(bad, head_dim, head_dim_v)
        elif self.dim_split == 1 and head_dim > BACKWARD_OWN_KEYS_MAX_DIM:
            raise bad("dim_split", f"2 at head_dim {head_dim}: one warpgroup holds dK and dV "
                                   f"of its keys up to head_dim {BACKWARD_OWN_KEYS_MAX_DIM}")
        if self.dim_split > 1 and self.tile_n != WGMMA_M:
            raise bad("tile_n", f"{WGMMA_M} with dim_split {self.dim_split} (the warpgroups "
                                f"share one 64-key slice)")
        if not self.keys_on_n and (self.tile_n % WGMMA_M
                                   or not 1 <= self.consumer_warpgroups <= 3):
            raise bad("tile_n", "64, 128 or 192 (one consumer warpgroup per 64 keys)")
        if (self.tile_m // self.dim_split) % 8 or head_dim_v % (8 * self.dim_split):
            raise bad("tile_m", f"a multiple of {8 * self.dim_split} with head_dim_v a "
                                f"multiple of it too (dim_split {self.dim_split} halves the "
                                f"query columns of Sᵀ and the head dims of dK and dV)")
        if self.tile_m % 16 or not WGMMA_M <= self.tile_m <= 192:
            raise bad("tile_m", "a multiple of 16 in [64, 192] (the K of the dV and dK "
                                "GEMMs)")
        if self.dq_transposed():
            if head_dim != WGMMA_M * self.consumer_warpgroups:
                raise bad("tile_m", f"a multiple of 64 at head_dim {head_dim}: other tiles "
                                    f"compute dQᵀ with head_dim = 64 * consumer_warpgroups "
                                    f"({WGMMA_M * self.consumer_warpgroups})")
        elif not self.dq_split_m():
            if self.tile_m != WGMMA_M or (head_dim // self.consumer_warpgroups) % 8 \
                    or head_dim % self.consumer_warpgroups:
                raise bad("tile_m", f"64 * consumer_warpgroups "
                                    f"({WGMMA_M * self.consumer_warpgroups}), or 64 with "
                                    f"head_dim split evenly in multiples of 8 across "
                                    f"{self.consumer_warpgroups} warpgroups")
        if self.dq_one_warpgroup and (self.dq_split_m() or self.dq_transposed()
                                      or self.consumer_warpgroups < 2):
            raise bad("dq_one_warpgroup", "False unless tile_m is 64 with several consumer "
                                          "warpgroups (elsewhere they split dQ's rows, or "
                                          "compute it transposed)")
        if not 1 <= self.qdo_stages <= 4:
            raise bad("qdo_stages", "an integer in [1, 4]")
        if not 0 <= self.do_stages <= 4:
            raise bad("do_stages", "an integer in [0, 4] (0: qdo_stages)")
        if self.ds_buffers not in (1, 2) or (self.ds_buffers == 1 and not self.keys_on_n):
            raise bad("ds_buffers", "2, or 1 with keys_on_n")
        if self.dq_direct and self.deterministic:
            raise bad("dq_direct", "False with deterministic (the dQ writer warp adds the "
                                   "partials in key-block order)")
        if self.convert_dq and self.dq_direct:
            raise bad("convert_dq", "False with dq_direct (the consumers add dQ themselves, "
                                    "and no writer counts the adds)")
        if self.dq_first_store and (self.dq_direct or self.convert_dq):
            raise bad("dq_first_store", "False with dq_direct or convert_dq (the consumers add "
                                        "dQ themselves, or the tiles' slots count the adds)")
        if self.dynamic_tiles and self.deterministic:
            raise bad("dynamic_tiles", "False with deterministic (its semaphore orders the "
                                       "key blocks of one CTA per tile)")
        if self.dkv_via_scores and not self.dkv_fits_scores(head_dim, head_dim_v):
            raise bad("dkv_via_scores", "False with dim_split, keys_on_n or split_gqa (the dSᵀ "
                                        "buffers hold scores there, or dK and dV leave from "
                                        "registers) or where the dSᵀ buffers hold fewer "
                                        f"columns than head dims {head_dim}/{head_dim_v}")
        _check_shared_fields(self, bad)
        if self.smem_bytes(head_dim, head_dim_v) > SMEM_CAPACITY_BYTES:
            raise bad("qdo_stages", f"a shared-memory footprint <= {SMEM_CAPACITY_BYTES} B, "
                                    f"this needs {self.smem_bytes(head_dim, head_dim_v)} B")

    def _validate_keys_on_n(self, bad, head_dim: int, head_dim_v: int) -> None:
        if self.dim_split != 1:
            raise bad("dim_split", "1 with keys_on_n (its two warpgroups split the keys)")
        if self.tile_n % 32 or not 32 <= self.tile_n <= 256:
            raise bad("tile_n", "a multiple of 32 in [32, 256] with keys_on_n (each of its two "
                                "warpgroups a multiple of 16 keys)")
        if self.tile_m != WGMMA_M:
            raise bad("tile_m", f"{WGMMA_M} with keys_on_n (one WGMMA row block of queries)")
        if head_dim % WGMMA_M or head_dim_v % WGMMA_M:
            raise bad("keys_on_n", f"False at head_dim {head_dim}, head_dim_v {head_dim_v}: dKᵀ "
                                   f"and dVᵀ put the head dims on WGMMA's M axis (multiples "
                                   f"of {WGMMA_M})")
        if self.split_gqa:
            raise bad("split_gqa", "False with keys_on_n (the fp32 partials leave from "
                                   "registers in the keys-on-M order)")


# Of every 8 exponentials of P in head dim 64's backward under a cap and a
# causal mask (bf16), those taken to the FMA pipe (BwdConfig.exp2_on_fma).
CAPPED_CAUSAL_BWD_EXP2_ON_FMA = 2


def split_gqa_pays(q_per_kv: int, kv_ctas: int, num_sms: int) -> bool:
    """Whether the backward's default gives each query head of a GQA group its
    own CTAs (BwdConfig.split_gqa): when one CTA per (key block, KV head,
    batch) makes fewer than two waves, SMs idle while the longest CTAs finish.
    With more waves the hardware's CTA dispatch balances them, and the fp32
    dK/dV partials would only add memory traffic."""
    return q_per_kv > 1 and kv_ctas < 2 * num_sms


@functools.lru_cache(maxsize=4096)  # asked on every backward call
def bwd_config_for_problem(head_dim: int, causal: bool, deterministic: bool, batch: int,
                           seqlen_k: int, heads_q: int, heads_kv: int,
                           num_sms: int, features: Features = PLAIN_FEATURES,
                           head_dim_v: int | None = None) -> BwdConfig:
    """The op's backward config for one problem: default_bwd_config, with
    split_gqa where split_gqa_pays for the grid that config would launch. A
    window or a cap takes the causal choices: the wider query tile of the
    full mask spills their bounds or the cap's slope; a block mask too (its
    key blocks differ in length, and 64 queries a step divide its blocks). A
    cap alone keeps the fixed tile order, as its key blocks all walk every
    query; a cap with a causal mask at head dim 64 takes
    CAPPED_CAUSAL_BWD_EXP2_ON_FMA of every 8 exponentials to the FMA pipe
    (without the mask, or at 128, none gained). A packed batch (varlen)
    claims its key blocks and never splits GQA groups."""
    capped_causal = features.softcap and causal and not (features.local or features.varlen
                                                          or features.block_sparse)
    uneven = causal or features.local or features.block_sparse
    causal = uneven or features.softcap
    config = default_bwd_config(head_dim, causal, deterministic, head_dim_v=head_dim_v,
                                block_sparse=features.block_sparse)
    if features.varlen:
        # key blocks differ with their sequences: claimed, unless deterministic
        config = claimed(config, not deterministic, head_dim, head_dim_v)
        if config.shares_scores():
            # the producer's walk over a packed batch spills 8-16 bytes at 24
            return config.replace(producer_regs=32, consumer_regs=232)
        return config
    kv_ctas = -(-seqlen_k // config.tile_n) * heads_kv * batch
    if split_gqa_pays(heads_q // heads_kv, kv_ctas, num_sms):
        config = default_bwd_config(head_dim, causal, deterministic, split_gqa=True,
                                    head_dim_v=head_dim_v)
    if features.softcap and not uneven:
        config = claimed(config, False, head_dim, head_dim_v)
    if capped_causal and head_dim <= 64:
        config = config.replace(exp2_on_fma=CAPPED_CAUSAL_BWD_EXP2_ON_FMA)
    return config


def claimed(config: BwdConfig, on: bool, head_dim: int, head_dim_v: int | None) -> BwdConfig:
    """config with its key blocks claimed by a persistent grid
    (dynamic_tiles) or not, and where they are claimed dK and dV staged in
    the dSᵀ buffers wherever those hold them (dkv_via_scores): the next
    block's K/V load then runs under this block's epilogue; and where they
    are claimed or the dQ adds take turns, each query tile's first dQ
    partial stored (dq_first_store) wherever the writer warp adds them.
    Fixed tiles keep the zeroed accumulator: their CTAs walk the query
    tiles in step, so all but one would wait at each tile for its first
    store (docs/findings.md)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    return config.replace(dynamic_tiles=on,
                          dkv_via_scores=on and config.dkv_fits_scores(head_dim, head_dim_v),
                          dq_first_store=(on or config.deterministic) and not config.dq_direct)


@functools.lru_cache(maxsize=None)
def default_bwd_config(head_dim: int, causal: bool, deterministic: bool = False,
                       split_gqa: bool = False, head_dim_v: int | None = None,
                       block_sparse: bool = False) -> BwdConfig:
    """The op's backward config (_default_tiles, below), its key blocks
    claimed under the causal mask unless deterministic (claimed)."""
    config = _default_tiles(head_dim, causal, deterministic, split_gqa, head_dim_v,
                            block_sparse)
    return claimed(config, causal and not deterministic, head_dim, head_dim_v)


def _default_tiles(head_dim: int, causal: bool, deterministic: bool, split_gqa: bool,
                   head_dim_v: int | None, block_sparse: bool) -> BwdConfig:
    """The op's backward config (chosen with profiling.sweep --kernel bwd on an
    H100; docs/findings.md): 128 keys per CTA in two consumer warpgroups,
    whose dK and dV stay in registers for the whole walk over queries
    (whether key blocks are claimed is default_bwd_config's choice).

    - head dim 64: 128 queries per step, dV at the dQ barrier;
    - head dim 96: 64 queries per step, all of dQ in the first warpgroup,
      dV at the dQ barrier, LSE₂ read at its use;
    - head dim 128: 80 queries per step non-causal (dQ transposed), 64 under
      the causal mask or with split_gqa (80 spills there), dV right after
      dSᵀ, LSE₂ early;
    - head dim 192: 96 keys per CTA with the scores untransposed (keys_on_n),
      64 queries per step, the dQ slabs, Q/dO rings of two stages at
      head_dim_v 128; at 192, where those do not fit in shared memory, one
      dO stage and one dSᵀ buffer; causal L2 sections of 32 MB; with
      split_gqa or a block mask as head dim 256:
    - head dim 256: 64 keys per CTA shared by two warpgroups that split dK
      and dV by head dim (dim_split 2), 64 queries per step, LSE₂ early,
      Q/dO rings of two stages with the dQ slabs where both fit in shared
      memory at dv = head dim, else without them (dq_direct), else (256
      deterministic) of one stage.
    head_dim_v: v's head dim (None: q's).
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if (BACKWARD_OWN_KEYS_MAX_DIM < head_dim <= 192 and not split_gqa and not block_sparse
            and head_dim_v % WGMMA_M == 0):
        config = BwdConfig(tile_m=64, tile_n=96, keys_on_n=True, qdo_stages=2,
                           deterministic=deterministic, stats_early=True, l2_section_mb=32)
        # the dQ slabs over a second dO stage and dSᵀ buffer where not all fit
        # (dv 192)
        for fallback in (config, config.replace(do_stages=1, ds_buffers=1)):
            if fallback.smem_bytes(head_dim, head_dim_v) <= SMEM_CAPACITY_BYTES:
                return fallback
    if head_dim > BACKWARD_OWN_KEYS_MAX_DIM:
        config = BwdConfig(tile_m=64, tile_n=WGMMA_M, dim_split=2, qdo_stages=2,
                           deterministic=deterministic, stats_early=True,
                           split_gqa=split_gqa)
        if config.smem_bytes(head_dim) <= SMEM_CAPACITY_BYTES:
            return config
        # a second Q/dO stage over the dQ slabs: the larger gain where both
        # cannot fit (head dim 256)
        if not deterministic:
            return config.replace(dq_direct=True)
        return config.replace(qdo_stages=1)
    if head_dim <= 64:
        return BwdConfig(tile_m=128, tile_n=128, qdo_stages=2, deterministic=deterministic,
                         dv_at_ds_barrier=True, split_gqa=split_gqa)
    if head_dim == 128:
        return BwdConfig(tile_m=64 if causal or split_gqa else 80, tile_n=128, qdo_stages=2,
                         deterministic=deterministic, stats_early=True, split_gqa=split_gqa)
    return BwdConfig(tile_m=64, tile_n=128, qdo_stages=2, deterministic=deterministic,
                     dv_at_ds_barrier=True, split_gqa=split_gqa, dq_one_warpgroup=True)


@functools.lru_cache(maxsize=None)  # asked on every block-sparse call
def block_sparse_tiles(head_dim: int, head_dim_v: int) -> tuple:
    """The tiles a block mask's lists are packed for (python_api/block_mask.py)
    at these kernel head dims: ((rows, cols) of the forward: query tile, key
    tile), ((rows, cols) of the backward: key tile, query tile)."""
    fwd = block_sparse_fwd_config(head_dim, head_dim_v)
    bwd = default_bwd_config(head_dim, True, head_dim_v=head_dim_v, block_sparse=True)
    return (fwd.tile_m, fwd.tile_n), (bwd.tile_n, bwd.tile_m)
