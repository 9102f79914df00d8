import pytest

from cute_fa.kernels.config import (FP8_HEAD_DIMS, FP8_LONG_CAUSAL_KEYS, FP8_SHORT_ROW_KEYS,
                                    FP8_THREE_WARPGROUP_CAUSAL_KEYS, PLAIN_FEATURES, Features,
                                    FwdConfig, default_fwd_config, fp8_config_for_problem)
from cute_fa.kernels.bwd_config import (bwd_config_for_problem, claimed, default_bwd_config,
                                       split_gqa_pays)


def test_defaults_validate_for_every_head_dim():
    from cute_fa.kernels.config import SUPPORTED_HEAD_DIMS
    for head_dim in SUPPORTED_HEAD_DIMS:
        for head_dim_v in (d for d in SUPPORTED_HEAD_DIMS if d <= head_dim):
            for causal in (False, True):
                default_fwd_config(head_dim, causal, head_dim_v).validate(head_dim, head_dim_v)


def test_short_sequences_take_smaller_tiles_where_they_differ():
    """Up to SHORT_SEQLEN tokens: head dim 64 64 query rows, three CTAs an
    SM causal (caps and sinks too), three tile streams in one CTA
    non-causal, unless the grid has few tiles (then two CTAs an SM, and a
    cap's or a sink's causal tiles 128 rows, as a packed batch's), head
    dim 128 non-causal 128 keys a step, causal tiles of head dims 96-128 a
    second Q stage (not under a cap, with sinks or in a packed batch);
    every other problem the long-sequence config, and each short one
    valid."""
    from cute_fa.kernels.config import (PLAIN_FEATURES, SHORT_SEQLEN, SUPPORTED_HEAD_DIMS,
                                        fwd_config_for_problem)

    def config(head_dim, causal, seqlen, features=PLAIN_FEATURES):
        return fwd_config_for_problem(head_dim, causal, None, features, seqlen, seqlen)

    for causal in (False, True):
        short = config(64, causal, SHORT_SEQLEN)
        # three tiles an SM where the grid is unknown or has many tiles:
        # causal in three CTAs, non-causal in three streams of one
        assert (short.tile_m, short.ctas_per_sm * short.concurrent_tiles,
                short.split_tail) == (64, 3, False)
        assert short.concurrent_tiles == (1 if causal else 3)
        few = fwd_config_for_problem(64, causal, None, PLAIN_FEATURES, 512, 512, 8, 132)
        assert (few.tile_m, few.ctas_per_sm, few.concurrent_tiles) == (64, 2, 1)
        assert config(64, causal, SHORT_SEQLEN + 1) == default_fwd_config(64, causal)
    for features in (Features(softcap=True), Features(sink=True)):
        assert config(64, True, 512, features).ctas_per_sm == 3
    for features in (Features(softcap=True), Features(sink=True),
                     Features(softcap=True, sink=True)):
        assert config(64, False, 512, features).concurrent_tiles == 3
        few = fwd_config_for_problem(64, True, None, features, 512, 512, 8, 132)
        assert (few.tile_m, few.ctas_per_sm) == (128, 1)
    assert config(64, True, 512, Features(varlen=True)).tile_m == 128  # packed: unchanged
    assert config(128, False, 512).tile_n == 128 and config(128, False, 4096).tile_n == 160
    assert config(128, True, 512) == default_fwd_config(128, True).replace(q_stages=2)
    for head_dim in (64, 96, 128):
        # head dim 64 causal: three CTAs' shared memory holds one Q stage
        assert config(head_dim, True, 512).q_stages == (1 if head_dim == 64 else 2)
        # head dim 64 non-causal: three streams' shared memory holds one Q stage
        assert config(head_dim, False, 512).q_stages == (1 if head_dim == 64 else 2)
        assert config(head_dim, True, 2048).q_stages == (2 if head_dim == 64 else 1)
        assert config(head_dim, False, 2048).q_stages == 1
        for features in (Features(softcap=True), Features(sink=True), Features(varlen=True)):
            # head dim 64: three CTAs an SM under a cap or with sinks
            assert config(head_dim, True, 512, features).q_stages == 1
    for features in (Features(softcap=True), Features(sink=True)):
        assert config(64, True, 4096, features).q_stages == 2
    assert config(64, True, 4096, Features(varlen=True)).q_stages == 1
    assert config(64, False, 4096, Features(softcap=True)).q_stages == 1
    # a window ends every row's keys: the Q ring up to head dim 128, sinks
    # and caps too, not in packed batches; none above 128 (no room), nor in
    # head dim 64's wide tile where its warpgroups walk their own key blocks
    for head_dim in (64, 96, 128):
        for features in (Features(local=True), Features(local=True, sink=True),
                         Features(local=True, softcap=True)):
            ranged = head_dim == 64 and not features.softcap
            assert config(head_dim, False, 16384, features).q_stages == (1 if ranged else 2)
        assert config(head_dim, False, 16384, Features(local=True, varlen=True)).q_stages == 1
    assert config(192, False, 16384, Features(local=True)).q_stages == 1
    # a long key side makes the problem long
    assert fwd_config_for_problem(128, False, None, PLAIN_FEATURES, 1, 8192).tile_n == 160
    # a packed batch: head dim 64's 192-row tile, claimed, never split; the
    # short tile where no sequence is longer than SHORT_SEQLEN
    varlen = Features(varlen=True)
    for causal in (False, True):
        packed = config(64, causal, 8192, varlen)
        assert packed.tile_m == 192 and packed.dynamic_tiles and not packed.split_tail
    assert config(64, True, 512, varlen).tile_m == 128
    for head_dim in SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            config(head_dim, causal, 256).validate(head_dim)


def test_two_ctas_an_sm_share_its_registers_and_shared_memory():
    """ctas_per_sm 2: the setmaxnreg targets within half the register file,
    the shared memory within half an SM's (less a KB a CTA), no split tail."""
    from cute_fa.kernels.config import smem_capacity
    two = FwdConfig(tile_m=64, tile_n=128, producer_regs=24, consumer_regs=232, ctas_per_sm=2)
    two.validate(64)
    assert smem_capacity(2) == 113 * 1024 and smem_capacity(1) == 227 * 1024
    for bad, field in ((dict(consumer_regs=240), "consumer_regs"),
                       (dict(split_tail=True), "ctas_per_sm"), (dict(ctas_per_sm=4), "ctas_per_sm"),
                       (dict(ctas_per_sm=3), "consumer_regs"), (dict(kv_stages=4), "kv_stages")):
        with pytest.raises(ValueError, match=f"FwdConfig.{field}: expected"):
            two.replace(**bad).validate(64)
    with pytest.raises(ValueError, match="kv_stages: expected a shared-memory footprint <= "
                                         "115712 B"):
        two.validate(128)  # two stages of 128 keys at head dim 128: 146 KB


def test_three_ctas_an_sm_share_its_registers_and_shared_memory():
    """ctas_per_sm 3: the setmaxnreg targets within a third of the register
    file (80 a thread at launch), the shared memory within a third of an
    SM's: 64 keys a step in three K/V stages beside one Q stage; head dim
    64 only."""
    from cute_fa.kernels.config import smem_capacity, three_ctas_an_sm
    three = three_ctas_an_sm(True, False)
    three.validate(64)
    assert (three.tile_m, three.tile_n, three.ctas_per_sm, three.kv_stages) == (64, 64, 3, 3)
    assert smem_capacity(3) == 75 * 1024
    for bad, field in ((dict(consumer_regs=144), "consumer_regs"),
                       (dict(q_stages=2, kv_stages=4), "kv_stages"),
                       (dict(tile_n=128), "kv_stages")):
        with pytest.raises(ValueError, match=f"FwdConfig.{field}: expected"):
            three.replace(**bad).validate(64)
    with pytest.raises(ValueError, match="FwdConfig.kv_stages: expected"):
        three.validate(128)


def test_tile_streams_share_one_cta():
    """concurrent_tiles 3: one producer warpgroup and three consumer
    warpgroups of 64-row tiles (512 threads, 160 registers each), a bank of
    each ring per stream in one SM's shared memory (O in the V banks); the
    combinations it is not built for are named errors."""
    from cute_fa.kernels.config import three_tile_streams
    streams = three_tile_streams(False)
    streams.validate(64)
    assert (streams.threads, streams.launched_warpgroups, streams.consumer_warpgroups) == \
        (512, 3, 1)
    assert streams.smem_bytes(64) <= 227 * 1024 < streams.replace(o_in_v_smem=False).smem_bytes(64)
    for bad, field in ((dict(concurrent_tiles=4), "concurrent_tiles"),
                       (dict(tile_m=128), "concurrent_tiles"),
                       (dict(ctas_per_sm=2), "concurrent_tiles"),
                       (dict(persistent=False, dynamic_tiles=False), "concurrent_tiles"),
                       (dict(split_tail=True), "concurrent_tiles"),
                       (dict(consumer_regs=168), "consumer_regs"),
                       (dict(o_in_v_smem=False), "kv_stages")):
        with pytest.raises(ValueError, match=f"FwdConfig.{field}: expected"):
            streams.replace(**bad).validate(64)
    with pytest.raises(ValueError, match="concurrent_tiles: expected 1 unless"):
        streams.replace(o_in_v_smem=False, tile_n=64).validate(64, fp8=True)


def test_q_ring_depth_and_its_shared_memory():
    """q_stages: 1 or 2 (TileQueue's slots are counted for that), a second
    Q tile in the footprint, and the field named where that stage alone
    breaks the budget."""
    from cute_fa.kernels.config import SMEM_CAPACITY_BYTES
    one, two = FwdConfig(), FwdConfig(q_stages=2)
    assert two.smem_bytes(128) - one.smem_bytes(128) == 128 * 128 * 2
    two.validate(128)
    assert two.smem_bytes(128) <= SMEM_CAPACITY_BYTES
    for depth in (0, 3):
        with pytest.raises(ValueError, match="FwdConfig.q_stages: expected 1 or 2"):
            FwdConfig(q_stages=depth).validate(64)
    wide = default_fwd_config(256, True)
    wide.validate(256)
    with pytest.raises(ValueError, match="FwdConfig.q_stages: expected a shared-memory"):
        wide.replace(q_stages=2).validate(256)
    with pytest.raises(ValueError, match="FwdConfig.kv_stages: expected a shared-memory"):
        wide.replace(q_stages=2, kv_stages=4).validate(256)


def test_head_dim_96_takes_192_rows_beyond_short_sequences():
    """Head dim 96: 192 query rows of 112 keys a step past SHORT_SEQLEN
    tokens, causal only from LONG_SEQLEN (shorter causal rows and packed
    batches and windows keep 128 x 128)."""
    from cute_fa.kernels.config import LONG_SEQLEN, SHORT_SEQLEN, fwd_config_for_problem

    def tiles(causal, seqlen, features=PLAIN_FEATURES, seqlen_q=None):
        config = fwd_config_for_problem(96, causal, None, features, seqlen_q or seqlen,
                                        seqlen)
        config.validate(96)
        return config.tile_m, config.tile_n

    assert tiles(False, SHORT_SEQLEN) == (128, 128)
    assert tiles(False, SHORT_SEQLEN + 1) == tiles(False, 16384) == (192, 112)
    assert tiles(True, LONG_SEQLEN - 1) == (128, 128)
    assert tiles(True, LONG_SEQLEN) == tiles(True, 1, seqlen_q=LONG_SEQLEN) == (192, 112)
    assert tiles(False, 16384, Features(softcap=True)) == (192, 112)
    assert tiles(True, 16384, Features(varlen=True)) == (128, 128)
    assert tiles(False, 16384, Features(sink=True)) == (128, 128)
    assert tiles(False, 16384, Features(local=True)) == (128, 128)
    assert default_fwd_config(96, False).tile_m == 192  # the op's long-sequence default
    assert default_fwd_config(96, True).tile_m == 128


def test_short_problems_short_of_sms_take_narrower_tiles():
    """Batch 1 (a grid short of SMs): head dim 128 takes 64 query rows,
    where the measured batch-1 runs gained (docs/findings.md); a causal grid
    only while all of its tiles start at once, a non-causal one where the
    narrower tiles fill the waves by a tenth more; never for long sequences,
    a full GPU or other features. Head dim 64's short tiles have 64 rows
    (two CTAs an SM) at any grid."""
    from cute_fa.kernels.config import (PLAIN_FEATURES, default_fwd_config,
                                        fwd_config_for_problem, narrow_tiles_pay)

    def tile_m(head_dim, causal, seqlen, query_heads, features=PLAIN_FEATURES):
        return fwd_config_for_problem(head_dim, causal, None, features, seqlen, seqlen,
                                      query_heads, 132).tile_m

    assert tile_m(128, True, 512, 16) == tile_m(128, True, 1024, 16) == 64
    assert tile_m(128, False, 512, 16) == 64
    assert tile_m(128, False, 1024, 16) == 128  # 128 tiles already fill 132 SMs
    for causal in (False, True):
        assert tile_m(64, causal, 512, 32) == tile_m(64, causal, 512, 1024) == 64
    assert tile_m(128, True, 512, 512) == 128
    assert tile_m(128, True, 4096, 1) == 128 and tile_m(64, False, 2048, 1) == 192
    capped = Features(softcap=True)
    assert tile_m(128, True, 512, 16, capped) == default_fwd_config(128, True,
                                                                  features=capped).tile_m
    assert fwd_config_for_problem(128, True, None, PLAIN_FEATURES, 512, 512) == \
        default_fwd_config(128, True, short=True)  # grid unknown
    assert not narrow_tiles_pay(128, 64, True, 1024, 17, 132)  # 136 tiles: some wait
    for head_dim, causal in ((128, False), (128, True)):
        config = fwd_config_for_problem(head_dim, causal, None, PLAIN_FEATURES, 512, 512, 1,
                                        132)
        assert config.tile_m < default_fwd_config(head_dim, causal, short=True).tile_m
        config.validate(head_dim)


def test_short_rows_of_head_dim_96_take_wide_tiles_where_they_fill_the_sms():
    """Non-causal head dim 96 on a batch-1 grid: 21 heads of 1k rows are 168
    tiles of 128 rows (one round and a quarter of 132 SMs) but 126 of 192,
    one round, which ran 21 % faster without split_tail
    (docs/findings.md); where both take the same rounds (512 rows), or the
    wider tiles take rounds as full (a full GPU), the short tile stays; not
    causal, nor head dims 64 and 128."""
    from cute_fa.kernels.config import (PLAIN_FEATURES, default_fwd_config,
                                        fills_waves_better, fwd_config_for_problem,
                                        wide_fwd_config)

    def config(head_dim, causal, seqlen, query_heads):
        return fwd_config_for_problem(head_dim, causal, None, PLAIN_FEATURES, seqlen, seqlen,
                                      query_heads, 132)

    wide = config(96, False, 1024, 21)
    assert wide == wide_fwd_config(96, False)
    assert (wide.tile_m, wide.tile_n, wide.split_tail) == (192, 112, False)
    wide.validate(96)
    assert config(96, False, 512, 42) == wide  # 168 tiles of 128 rows, 126 of 192
    short = default_fwd_config(96, False, short=True)
    assert config(96, False, 512, 21).tile_m == short.tile_m == 128  # one round either way
    assert config(96, False, 1024, 21 * 16).tile_m == 128
    assert config(96, True, 1024, 21).tile_m == default_fwd_config(96, True, short=True).tile_m
    assert wide_fwd_config(96, True) is None
    assert wide_fwd_config(64, False) is wide_fwd_config(128, False) is None
    assert fills_waves_better(192, 128, 1024, 21, 132)
    assert not fills_waves_better(192, 128, 768, 84, 132)


def test_the_shortest_causal_rows_take_tiny_tiles_on_a_full_gpu():
    """Causal, no sequence past TINY_SEQLEN, on a grid of two rounds or
    more (as measured on a full GPU): head dim 64 the 128-row tile (one CTA
    an SM) unless its 64-row tiles run three CTAs an SM (THREE_CTAS_MIN_ROUNDS
    rounds of them), head dim 128 64 keys a step; batch 1 keeps the short
    tiles (head dim 128's narrow ones), and so do longer rows, non-causal
    ones and head dim 96."""
    from cute_fa.kernels.config import (PLAIN_FEATURES, TINY_SEQLEN, fwd_config_for_problem,
                                        three_ctas_an_sm, tiny_fwd_config)

    def config(head_dim, causal, seqlen, query_heads):
        return fwd_config_for_problem(head_dim, causal, None, PLAIN_FEATURES, seqlen, seqlen,
                                      query_heads, 132)

    tiny = tiny_fwd_config(64, True)
    tiny.validate(64)
    assert (tiny.tile_m, tiny.ctas_per_sm, tiny.consumer_warpgroups) == (128, 1, 2)
    # 300 and 320 tiles of 128 rows (three rounds); of 64 rows, two rounds of three CTAs
    assert config(64, True, 128, 300) == config(64, True, TINY_SEQLEN, 160) == tiny
    assert config(64, True, 128, 4096) == config(64, True, TINY_SEQLEN, 2048) == \
        three_ctas_an_sm(True, rederive_epilogue_coords=True)
    # tiles an SM: CTAs times each one's tile streams
    for head_dim, causal, seqlen, query_heads, tiles in ((64, True, 256, 32, 2),
                                                         (64, True, 512, 1024, 3),
                                                         (64, False, 256, 2048, 3),
                                                         (64, False, 256, 32, 2)):
        short = config(head_dim, causal, seqlen, query_heads)
        assert (short.tile_m, short.ctas_per_sm * short.concurrent_tiles) == (64, tiles)
    assert tiny_fwd_config(64, False) is None and tiny_fwd_config(96, True) is None
    keys = tiny_fwd_config(128, True)
    assert (keys.tile_m, keys.tile_n) == (128, 64)
    assert config(128, True, 256, 1024) == keys
    assert config(128, True, 256, 16).tile_m == 64 and config(128, True, 512, 1024).tile_n == 128


def test_large_head_dims_stage_o_in_the_v_ring():
    # 128 query rows at 256: Q 64 KB + two stages of 80 keys of K and V (80 KB
    # each) leave no room for a 64 KB O slab of its own
    from cute_fa.kernels.config import SMEM_CAPACITY_BYTES
    config = default_fwd_config(256, False)
    assert config.o_in_v_smem and config.tile_m == 128 and config.tile_n == 80
    assert config.smem_bytes(256) == 1024 + 64 * 1024 + 2 * 80 * 1024
    assert config.replace(o_in_v_smem=False).smem_bytes(256) > SMEM_CAPACITY_BYTES
    with pytest.raises(ValueError, match="o_in_v_smem saves the O slabs"):
        config.replace(o_in_v_smem=False).validate(256)
    # the V ring holds the O slabs even where they are the larger
    small_v = FwdConfig(tile_n=32, o_in_v_smem=True)
    assert small_v.smem_bytes(64) == 1024 + 16 * 1024 + 2 * 4 * 1024 + 16 * 1024
    assert default_fwd_config(192, True, 128).tile_n == 128  # a 128-wide V leaves room


def test_e4m3_head_dim_256_shares_one_o_slab():
    # Q 32 KB + two stages of 96 keys of K, V and Vᵀ (24 KB each) leave 26 KB:
    # room for one 32 KB O slab of 64 rows, not for the two warpgroups' 64 KB
    from cute_fa.kernels.config import SMEM_CAPACITY_BYTES, fp8_fwd_config
    for causal in (False, True):
        config = fp8_fwd_config(256, causal)
        assert config.shared_o_slab and config.tile_n == 96 and config.consumer_warpgroups == 2
        config.validate(256, fp8=True)
        assert config.smem_bytes(256, fp8=True) == 1024 + 32 * 1024 + 6 * 24 * 1024 + 32 * 1024
        assert config.replace(shared_o_slab=False).smem_bytes(256, fp8=True) > SMEM_CAPACITY_BYTES
        with pytest.raises(ValueError, match="shared_o_slab saves all but one O slab"):
            config.replace(shared_o_slab=False).validate(256, fp8=True)
    assert not fp8_fwd_config(192, False).shared_o_slab  # 128 keys fit with a slab each
    with pytest.raises(ValueError, match="shared_o_slab: expected False with o_in_v_smem"):
        FwdConfig(shared_o_slab=True, o_in_v_smem=True).validate(128)


def test_backward_kernel_head_dims():
    from cute_fa.kernels.bwd_config import BwdConfig
    with pytest.raises(ValueError, match="head_dim: expected one of .64, 96, 128, 192, 256. "
                                         "for the backward kernel"):
        BwdConfig().validate(320)
    BwdConfig().validate(128, 64)  # v narrower than q
    with pytest.raises(ValueError, match="head_dim_v: expected one of .64, 96, 128, 192, 256. "
                                         "up to head_dim 96"):
        BwdConfig().validate(96, 128)
    with pytest.raises(ValueError, match="head_dim_v"):
        BwdConfig().validate(128, 48)
    # above 128, dK and dV of 64 keys need two warpgroups
    with pytest.raises(ValueError, match="BwdConfig.dim_split: expected 2 at head_dim 192"):
        BwdConfig(tile_m=64).validate(192, 128)
    with pytest.raises(ValueError, match="BwdConfig.tile_n: expected 64 with dim_split 2"):
        BwdConfig(tile_m=64, dim_split=2).validate(192)
    with pytest.raises(ValueError, match="BwdConfig.dim_split: expected 1 or 2"):
        BwdConfig(tile_m=64, tile_n=64, dim_split=3).validate(256)
    with pytest.raises(ValueError, match="BwdConfig.qdo_stages: expected a shared-memory"):
        BwdConfig(tile_m=64, tile_n=64, dim_split=2, qdo_stages=2).validate(256)
    BwdConfig(tile_m=64, tile_n=64, dim_split=2, qdo_stages=2, dq_direct=True).validate(256)
    with pytest.raises(ValueError, match="BwdConfig.dq_direct: expected False with determ"):
        BwdConfig(tile_m=64, dq_direct=True, deterministic=True).validate(128)


def test_backward_defaults_above_128_split_the_head_dims():
    """Head dim 256 (and 192 with split_gqa, where dK and dV leave as fp32
    partials from registers): dK and dV split between two warpgroups of 64
    shared keys, with two Q/dO stages, in place of the dQ slabs unless
    deterministic (at dv = d)."""
    for head_dim, deterministic, split_gqa, stages, direct in (
            (192, False, True, 2, False), (192, True, True, 2, False),
            (256, False, False, 2, True), (256, True, False, 1, False)):
        for causal in (False, True):
            config = default_bwd_config(head_dim, causal, deterministic, split_gqa=split_gqa)
            assert (config.tile_n, config.dim_split, config.consumer_warpgroups) == (64, 2, 2)
            assert not config.keys_on_n
            assert (config.qdo_stages, config.dq_direct) == (stages, direct)
            config.validate(head_dim)
            config.validate(head_dim, 128)
    # Pᵀ's two buffers beside dSᵀ's
    split = default_bwd_config(256, False, True)
    assert split.smem_bytes(256) - split.replace(dim_split=1).smem_bytes(256) == 2 * 64 * 64 * 2


def test_backward_defaults_at_192_put_96_keys_on_n():
    """Head dim 192: 96 keys a CTA, two warpgroups of 48 with the scores
    untransposed, the dQ slabs; two Q/dO stages at v's head dim 128, one dO
    stage and one dSᵀ buffer at 192 (where both do not fit); a block mask
    (its bits are in Sᵀ order) keeps the split head dims."""
    for causal in (False, True):
        narrow = default_bwd_config(192, causal, head_dim_v=128)
        assert (narrow.keys_on_n, narrow.tile_n, narrow.tile_m) == (True, 96, 64)
        assert narrow.consumer_warpgroups == 2 and narrow.threads == 384
        assert (narrow.qdo_stages, narrow.dq_direct) == (2, False)
        narrow.validate(192, 128)
        assert default_bwd_config(192, causal, True, head_dim_v=128).keys_on_n
        for deterministic in (False, True):
            full = default_bwd_config(192, causal, deterministic)
            assert (full.keys_on_n, full.qdo_stages, full.dq_direct) == (True, 2, False)
            assert (full.dO_stages(), full.ds_buffers, full.score_buffers()) == (1, 1, 2)
            full.validate(192)
        assert default_bwd_config(192, causal, head_dim_v=128, block_sparse=True).dim_split == 2
    # dSᵀ in two buffers, Pᵀ (read by its own warpgroup only) in one
    assert narrow.score_buffers() == 3
    with pytest.raises(ValueError, match="BwdConfig.qdo_stages: expected a shared-memory"):
        narrow.validate(192)  # dv 192 with the slabs
    with pytest.raises(ValueError, match="BwdConfig.tile_n: expected a multiple of 32"):
        narrow.replace(tile_n=80).validate(192, 128)
    with pytest.raises(ValueError, match="BwdConfig.tile_m: expected 64 with keys_on_n"):
        narrow.replace(tile_m=128).validate(192, 128)
    with pytest.raises(ValueError, match="BwdConfig.dim_split: expected 1 with keys_on_n"):
        narrow.replace(dim_split=2).validate(192, 128)
    with pytest.raises(ValueError, match="BwdConfig.split_gqa: expected False with keys_on_n"):
        narrow.replace(split_gqa=True).validate(192, 128)
    with pytest.raises(ValueError, match="BwdConfig.keys_on_n: expected False at head_dim 96"):
        narrow.replace(tile_n=64).validate(96)
    with pytest.raises(ValueError, match="BwdConfig.ds_buffers: expected 2, or 1 with keys_on_n"):
        narrow.replace(keys_on_n=False, tile_n=128, ds_buffers=1).validate(128)
    with pytest.raises(ValueError, match="BwdConfig.do_stages: expected an integer in .0, 4."):
        narrow.replace(do_stages=5).validate(192, 128)
    # one dO stage and one dSᵀ buffer free 64 x 192 and 96 x 64 16-bit values
    # (with D's stage and a barrier pair, within the 1 KB alignment of each part)
    freed = full.replace(do_stages=0, ds_buffers=2).smem_bytes(192) - full.smem_bytes(192)
    assert 0 <= freed - (64 * 192 + 96 * 64) * 2 < 1024


@pytest.mark.parametrize("changes, field", [
    (dict(tile_m=96), "tile_m"), (dict(tile_m=256), "tile_m"), (dict(tile_n=20), "tile_n"),
    (dict(kv_stages=0), "kv_stages"), (dict(kv_stages=1), "kv_stages"),
    (dict(consumer_regs=250), "consumer_regs"), (dict(producer_regs=16), "producer_regs"),
    (dict(tile_m=192, consumer_regs=240), "consumer_regs"), (dict(kv_stages=4), "kv_stages"),
    # 64 + 2 x 224 = 512 fits the file (65536 / 128) but not the 3 x 168 that
    # 384 threads get at launch: the consumers' setmaxnreg.inc would wait forever
    (dict(producer_regs=64, consumer_regs=224), "consumer_regs"),
    (dict(pv_wait_after_exp2=33), "pv_wait_after_exp2"),  # tile_n 128: 32 columns a row
    (dict(pv_wait_after_exp2=-1), "pv_wait_after_exp2"),
    (dict(pv_wait_after_exp2=1, intra_wg_overlap=False), "pv_wait_after_exp2"),
    (dict(rescale_o_before_pv=True, intra_wg_overlap=False), "rescale_o_before_pv"),
    (dict(dynamic_tiles=True, persistent=False), "dynamic_tiles"),
    (dict(split_tail=True, persistent=False), "split_tail"),
    (dict(split_tail=True, dynamic_tiles=True), "split_tail"),
])
def test_invalid_configs_name_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"FwdConfig\.{field}: expected"):
        FwdConfig().replace(**changes).validate(128)


def test_every_default_fits_the_registers_of_its_launch():
    """producer + consumers' setmaxnreg targets within the CTA's launch share
    (what an increase beyond would hang on), for every config the op picks."""
    from cute_fa.kernels.config import decode_fwd_config
    from cute_fa.kernels.bwd_config import default_bwd_config

    for head_dim in (64, 96, 128, 192, 256):
        for causal in (False, True):
            default_fwd_config(head_dim, causal).validate(head_dim)
        decode_fwd_config(head_dim).validate(head_dim)
        decode_fwd_config(head_dim, short_parts=True).validate(head_dim)
        decode_fwd_config(head_dim).validate(head_dim, fp8=True)
    for head_dim in (64, 96, 128):
        for causal in (False, True):
            default_bwd_config(head_dim, causal).validate(head_dim)


def test_smem_accounts_for_every_buffer():
    config = FwdConfig()
    # 2 stages of K and V (32 KB each) + Q + O (32 KB each) + 1 KB of barriers
    assert config.smem_bytes(128) == 1024 + 6 * 32 * 1024


def test_backward_defaults_validate_and_fit():
    from cute_fa.kernels.config import SMEM_CAPACITY_BYTES
    from cute_fa.kernels.bwd_config import default_bwd_config
    for head_dim in (64, 96, 128):
        for causal in (False, True):
            for deterministic in (False, True):
                config = default_bwd_config(head_dim, causal, deterministic)
                config.validate(head_dim)
                assert config.deterministic is deterministic
                assert config.smem_bytes(head_dim) <= SMEM_CAPACITY_BYTES


@pytest.mark.parametrize("changes, field", [
    (dict(tile_n=96), "tile_n"), (dict(tile_n=256), "tile_n"), (dict(tile_m=32), "tile_m"),
    (dict(tile_m=128, tile_n=192), "tile_m"), (dict(qdo_stages=0), "qdo_stages"),
    (dict(qdo_stages=4), "qdo_stages"), (dict(consumer_regs=252), "consumer_regs"),
    (dict(tile_n=192, consumer_regs=240, tile_m=192), "consumer_regs"),
    (dict(tile_m=72), "tile_m"), (dict(tile_m=80, tile_n=192, consumer_regs=160), "tile_m"),
    (dict(dynamic_tiles=True, deterministic=True), "dynamic_tiles"),
    (dict(tile_m=128, dq_one_warpgroup=True), "dq_one_warpgroup"),
    (dict(tile_m=80, dq_one_warpgroup=True), "dq_one_warpgroup"),
    (dict(tile_m=64, tile_n=64, dq_one_warpgroup=True), "dq_one_warpgroup"),
    (dict(dq_first_store=True, dq_direct=True), "dq_first_store"),
    (dict(dq_first_store=True, convert_dq=True), "dq_first_store"),
])
def test_invalid_backward_configs_name_the_field(changes, field):
    from cute_fa.kernels.bwd_config import BwdConfig
    with pytest.raises(ValueError, match=rf"BwdConfig\.{field}: expected"):
        BwdConfig().replace(**changes).validate(128)


def test_backward_dq_split_follows_the_tile():
    from cute_fa.kernels.bwd_config import BwdConfig
    assert BwdConfig(tile_m=128, tile_n=128).dq_split_m()      # one 64-row slice per warpgroup
    assert not BwdConfig(tile_m=64, tile_n=128).dq_split_m()   # warpgroups split head_dim
    BwdConfig(tile_m=64, tile_n=192, consumer_regs=160, producer_regs=32).validate(96)
    with pytest.raises(ValueError, match="BwdConfig.tile_m"):  # 64 / 3 is not a WGMMA N
        BwdConfig(tile_m=64, tile_n=192, consumer_regs=160, producer_regs=32).validate(64)
    # rows that are no multiple of 64: dQ transposed, head_dim on M, 64 per warpgroup
    transposed = BwdConfig(tile_m=80, tile_n=128)
    assert transposed.dq_transposed() and not transposed.dq_split_m()
    transposed.validate(128)
    with pytest.raises(ValueError, match="BwdConfig.tile_m"):
        transposed.validate(64)
    assert not BwdConfig(tile_m=64).dq_transposed() and not BwdConfig(tile_m=128).dq_transposed()
    # one warpgroup may take all of a 64-row dQ: one slab, N = head_dim
    single = BwdConfig(tile_m=64, tile_n=128, dq_one_warpgroup=True)
    single.validate(96)
    assert single.dq_warpgroups == 1 and BwdConfig(tile_m=64, tile_n=128).dq_warpgroups == 2


def test_backward_statistics_stages_start_128_byte_aligned():
    """Each LSE₂/D stage is a TMA destination: 80 rows (320 bytes) gave the
    H100 a misaligned address (cudaErrorMisalignedAddress) before the stride
    was rounded up."""
    from cute_fa.kernels.bwd_config import BwdConfig
    for tile_m in (16, 64, 80, 112, 128):
        assert BwdConfig(tile_m=tile_m).stat_stage_floats() * 4 % 128 == 0
        assert BwdConfig(tile_m=tile_m).stat_stage_floats() >= tile_m
    assert BwdConfig(tile_m=80).stat_stage_floats() == 96


def test_causal_backward_claims_key_blocks_unless_deterministic():
    # BwdConfig.dynamic_tiles: won at every causal head dim and length timed
    # on the H100, even non-causal; the deterministic semaphore counts turns
    from cute_fa.kernels.bwd_config import default_bwd_config
    for head_dim in (64, 96, 128):
        for causal in (False, True):
            for deterministic in (False, True):
                for split_gqa in (False, True):
                    config = default_bwd_config(head_dim, causal, deterministic, split_gqa)
                    assert config.dynamic_tiles is (causal and not deterministic)
                    # measured (H200): each query tile's first dQ partial stored
                    # won with claimed key blocks (2.6-7 % of the backward at 1-2k
                    # tokens) and in deterministic mode, lost with fixed tiles
                    # (d 128 non-causal 1k 12 %)
                    assert config.dq_first_store is (causal or deterministic)
                    config.validate(head_dim)


def test_parse_field_per_kernel():
    from cute_fa.kernels.config_fields import parse_field
    assert parse_field("deterministic", "yes", "bwd") is True
    assert parse_field("qdo_stages", "3", "bwd") == 3
    assert parse_field("pingpong", "off") is False and parse_field("pingpong", "On") is True
    with pytest.raises(ValueError, match=r"FwdConfig\.pingpong: expected one of"):
        parse_field("pingpong", "ture")
    with pytest.raises(ValueError, match=r"FwdConfig\.tile_m: expected an integer"):
        parse_field("tile_m", "big")
    with pytest.raises(ValueError, match="unknown BwdConfig field 'kv_stages'"):
        parse_field("kv_stages", "2", "bwd")


def test_default_config_by_kind():
    from cute_fa.kernels.config import FwdConfig, default_fwd_config
    from cute_fa.kernels.bwd_config import BwdConfig, default_bwd_config
    from cute_fa.kernels.config_fields import default_config
    assert default_config("fwd", 128, True) == default_fwd_config(128, True)
    assert default_config("bwd", 64, False) == default_bwd_config(64, False)
    assert isinstance(default_config("fwd", 64, False), FwdConfig)
    assert isinstance(default_config("bwd", 64, False), BwdConfig)
    with pytest.raises(ValueError, match="kind: expected one of"):
        default_config("sideways", 64, False)


def test_split_gqa_pays_only_for_gqa_grids_under_two_waves():
    assert split_gqa_pays(q_per_kv=2, kv_ctas=128, num_sms=132)
    assert not split_gqa_pays(q_per_kv=1, kv_ctas=128, num_sms=132)   # nothing to split
    assert not split_gqa_pays(q_per_kv=2, kv_ctas=264, num_sms=132)   # two waves already
    config = default_bwd_config(128, True, split_gqa=True)
    assert config.split_gqa and config == default_bwd_config(128, True).replace(
        split_gqa=True, dkv_via_scores=False)  # dK and dV leave from registers there


def test_bwd_config_for_problem_splits_small_gqa_grids():
    # the training benchmark's attention: 32 key blocks x 4 KV heads = 128 CTAs on 132 SMs
    assert bwd_config_for_problem(128, True, False, 1, 4096, 8, 4, 132).split_gqa
    assert not bwd_config_for_problem(128, True, False, 2, 8192, 16, 8, 132).split_gqa
    assert bwd_config_for_problem(64, False, True, 1, 4096, 8, 8, 132) == \
        default_bwd_config(64, False, True)


def test_claimed_key_blocks_stage_dk_and_dv_in_the_score_buffers():
    """Where a CTA walks several key blocks (claimed), dK and dV leave
    through the dSᵀ buffers so that the next block's K/V load need not wait
    for the epilogue; not where those buffers hold scores (192, 256), nor
    where nothing loads after the block."""
    for head_dim in (64, 96, 128):
        config = default_bwd_config(head_dim, True)
        assert config.dynamic_tiles and config.dkv_via_scores
        config.validate(head_dim)
        assert not default_bwd_config(head_dim, True, deterministic=True).dkv_via_scores
        assert not default_bwd_config(head_dim, False).dkv_via_scores
    assert default_bwd_config(64, True).dkv_at_once(64, 64)
    assert not default_bwd_config(128, True).dkv_at_once(128, 128)  # dK, then dV
    for head_dim in (192, 256):
        assert not default_bwd_config(head_dim, True).dkv_via_scores
    packed = bwd_config_for_problem(128, False, False, 1, 16384, 16, 16, 132,
                                    Features(varlen=True))
    assert packed.dynamic_tiles and packed.dkv_via_scores
    with pytest.raises(ValueError, match="dkv_via_scores"):
        default_bwd_config(256, True).replace(dkv_via_scores=True).validate(256)
    with pytest.raises(ValueError, match="dkv_via_scores"):
        default_bwd_config(128, True, split_gqa=True).replace(dkv_via_scores=True).validate(128)


def test_a_cap_takes_the_causal_tile_but_keeps_the_fixed_tile_order():
    # measured (H100, d 128, 8k, non-causal, softcap 30): 64 queries a step
    # and no claimed tiles fastest; the 80-query tile spills the cap's slope
    cap = Features(softcap=True)
    for head_dim in (64, 128, 256):
        assert bwd_config_for_problem(head_dim, False, False, 2, 8192, 16, 16, 132, cap) == \
            claimed(default_bwd_config(head_dim, True), False, head_dim, None)
        # (with a share of P's exponentials on the FMA pipe at head dim 64, test_exp2_fma)
        assert bwd_config_for_problem(head_dim, True, False, 2, 8192, 16, 16, 132,
                                      cap).replace(exp2_on_fma=0) == \
            default_bwd_config(head_dim, True)
    window = Features(local=True, softcap=True)
    assert bwd_config_for_problem(128, False, False, 2, 8192, 16, 16, 132, window) == \
        default_bwd_config(128, True)


def test_causal_forward_claims_tiles_dynamically():
    # FwdConfig.dynamic_tiles: won at every causal head dim and length on the
    # H100 (against both one CTA per tile and the fixed deal); tied
    # non-causal, where it is off and no counter is zeroed per call
    for head_dim in (64, 96, 128):
        for causal in (False, True):
            config = default_fwd_config(head_dim, causal)
            assert config.persistent
            assert config.dynamic_tiles is causal


def test_head_dims_the_ops_take():
    from cute_fa.kernels.config import kernel_head_dim

    assert [kernel_head_dim(d) for d in (64, 96, 128)] == [64, 96, 128]  # as they are
    assert [kernel_head_dim(d) for d in (8, 56, 72, 80, 88, 104, 112, 120)] == \
        [64, 64, 96, 96, 96, 128, 128, 128]  # zero-padded to the next kernel head dim
    assert [kernel_head_dim(d) for d in (136, 192, 200, 256)] == [192, 192, 256, 256]
    assert [kernel_head_dim(d) for d in (0, 4, 36, 100, 264, 512)] == [None] * 6


def test_windows_at_head_dim_64_take_several_tiles_an_sm_or_the_wide_tile():
    """A local kernel whose rows see WIDE_WINDOW_KEYS keys or more (an
    unbounded side counting every key) takes head dim 64's 192-row tile,
    claimed and never split; narrower windows three CTAs an SM of 64-row
    tiles, claimed, with caps, sinks and in packed batches too, or two
    where three would run fewer than THREE_CTAS_MIN_ROUNDS rounds; between
    them windows of STREAMED_WINDOW_KEYS or more three tile streams of one
    CTA (not under a cap nor in a packed batch); other head dims keep their
    tiles. The wide tile's warpgroups walk their own key blocks, except
    under a cap or in a packed batch."""
    from cute_fa.kernels.config import (STREAMED_WINDOW_KEYS, WIDE_WINDOW_KEYS,
                                        fwd_config_for_problem, window_keys)

    local = Features(local=True)
    assert window_keys((1024, 0), 8192) == 1025 and window_keys((-1, 100), 8192) == 8293

    def config(head_dim, window, features=local, query_heads=0):
        return fwd_config_for_problem(head_dim, False, None, features, 8192, 8192,
                                      query_heads, 132 if query_heads else 0, window=window)

    def tiles(head_dim, window, features=local):  # tile rows, tiles an SM
        c = config(head_dim, window, features)
        return c.tile_m, c.ctas_per_sm * c.concurrent_tiles * c.consumer_warpgroups

    first, end = STREAMED_WINDOW_KEYS, WIDE_WINDOW_KEYS
    assert first < end
    assert tiles(64, (first - 2, 0)) == (64, 3) and config(64, (first - 2, 0)).ctas_per_sm == 3
    for window in ((first - 1, 0), (512, 511), (end - 2, 0)):
        assert config(64, window).concurrent_tiles == 3 and tiles(64, window) == (64, 3)
    for window in ((end - 1, 0), (-1, 64), (1024, 1024), (4096, 0)):
        assert tiles(64, window) == (192, 3) and config(64, window).warpgroup_key_ranges
    assert tiles(128, (4096, 0))[0] == 128
    assert tiles(128, (1024, 0))[0] == 128 and tiles(96, (1024, 0))[0] == 128
    for window, features, rows in (((1023, 0), Features(local=True, softcap=True), 64),
                                   ((1023, 0), Features(local=True, varlen=True), 64),
                                   ((2047, 0), Features(local=True, softcap=True), 192),
                                   ((2047, 0), Features(local=True, varlen=True), 192)):
        assert tiles(64, window, features) == (rows, 3)
        assert config(64, window, features).concurrent_tiles == 1
        assert config(64, window, features).warpgroup_key_ranges == (
            rows == 192 and not features.softcap)
    assert config(64, (1023, 0), Features(local=True, sink=True)).concurrent_tiles == 3
    for features in (local, Features(local=True, softcap=True), Features(local=True, sink=True),
                     Features(local=True, varlen=True)):
        narrow = config(64, (first - 2, 0), features, 32)  # 4096 tiles: 11 rounds of three
        assert (narrow.tile_m, narrow.ctas_per_sm, narrow.consumer_warpgroups) == (64, 3, 1)
        assert narrow.dynamic_tiles and not narrow.split_tail and narrow.q_stages == 1
        narrow.validate(64)
        streamed = config(64, (first - 1, 0), features, 32)
        assert streamed.concurrent_tiles == (1 if features.softcap or features.varlen else 3)
        assert streamed.dynamic_tiles and not streamed.split_tail
        streamed.validate(64)
        for window in ((first - 2, 0), (first - 1, 0)):
            few = config(64, window, features, 4)  # 512 tiles: two rounds of three
            assert (few.tile_m, few.ctas_per_sm, few.concurrent_tiles) == (64, 2, 1)
            assert few.dynamic_tiles and not few.split_tail
            assert few.q_stages == (1 if features.varlen else 2)
            few.validate(64)
    wide = config(64, (end, 0))
    assert wide.dynamic_tiles and not wide.split_tail
    wide.validate(64)


@pytest.mark.parametrize("head_dim", FP8_HEAD_DIMS)
def test_fp8_configs_give_a_long_softmax_three_warpgroups(head_dim):
    """The e4m3 configs run: valid for e4m3 inputs at every row length, in
    shared memory; three consumer warpgroups, without ping-pong, where the
    softmax outlasts the FP8 GEMMs most (head dims up to 128 non-causal, 64
    causal) on rows long enough to fill their stages; two at the large head
    dims, whose 64-row O alone takes 128 registers a thread or more; at
    head dim 128 causal too, over rows of FP8_THREE_WARPGROUP_CAUSAL_KEYS or
    more."""
    for causal in (False, True):
        for seqlen_k in (1, 512, 4096, 8192, 1 << 20):
            config = fp8_config_for_problem(head_dim, causal, PLAIN_FEATURES, seqlen_k)
            config.validate(head_dim, fp8=True)
            short = seqlen_k <= FP8_SHORT_ROW_KEYS
            three = (not (causal and short) if head_dim <= 64
                     else head_dim <= 128 and not (causal or short)
                     or head_dim == 128 and causal
                     and seqlen_k >= FP8_THREE_WARPGROUP_CAUSAL_KEYS)
            assert config.consumer_warpgroups == (3 if three else 2)
            # ping-pong only on short non-causal rows at 96 and 128, where a
            # warp's skipped rescale would be a branch between the turns
            turns = 64 < head_dim <= 128 and not causal and short
            assert config.pingpong == turns != config.skip_unmoved_rescale
            assert config.split_tail == (not causal) and config.dynamic_tiles == causal
            # a claimed tile's Q loads under the tile before, where shared memory
            # has room for a second stage (not at 192 and 256), except in three
            # warpgroups over the longest rows
            q_ring = causal and head_dim <= 128 and not (
                three and seqlen_k >= FP8_LONG_CAUSAL_KEYS)
            assert config.q_stages == (2 if q_ring else 1)


def test_a_grid_of_one_round_takes_one_q_stage():
    """A Q ring's second stage loads the next tile's Q: where every CTA has
    one tile at most there is none, and the config keeps one stage."""
    from cute_fa.kernels.config import PLAIN_FEATURES, fwd_config_for_problem

    def q_stages(head_dim, causal, seqlen, query_heads):
        return fwd_config_for_problem(head_dim, causal, None, PLAIN_FEATURES, seqlen, seqlen,
                                      query_heads, 132).q_stages

    assert q_stages(128, False, 1024, 16) == 1  # 128 tiles of 128 rows
    assert q_stages(128, False, 1024, 17) == 2  # 136 tiles
    assert q_stages(64, False, 512, 33) == 1  # 264 tiles of 64 rows, two CTAs an SM
    assert q_stages(64, False, 512, 34) == 2
    assert q_stages(64, True, 2048, 12) == 1  # 132 tiles of 192 rows
    assert q_stages(64, True, 2048, 13) == 2
    assert q_stages(64, True, 2048, 0) == 2  # an unknown grid keeps the ring


def test_claimed_tiles_of_two_waves_or_less_are_dealt_by_index():
    """A causal grid of at most two waves of tiles claims nothing: the fixed
    deal's snake balances it, without the claim counter and its zeroing
    launch. More tiles, an unknown grid, packed batches and windows keep
    claiming."""
    from cute_fa.kernels.config import (PLAIN_FEATURES, fixed_deal_balances,
                                        fwd_config_for_problem)

    def config(head_dim, seqlen, query_heads, features=PLAIN_FEATURES, num_sms=132):
        return fwd_config_for_problem(head_dim, True, None, features, seqlen, seqlen,
                                      query_heads, num_sms)

    by_index = config(64, 512, 40)  # 8 tiles of 64 rows x 40 heads, two CTAs an SM
    assert (by_index.tile_m, by_index.dynamic_tiles, by_index.ctas_per_sm) == (64, False, 2)
    assert by_index == default_fwd_config(64, True, short=True,
                                          few_tiles=True).replace(dynamic_tiles=False)
    assert not config(128, 8192, 4).dynamic_tiles  # long rows, few heads: 256 tiles
    assert not config(64, 512, 66).dynamic_tiles  # 528 tiles on 264 CTAs: two waves
    assert config(64, 512, 67).dynamic_tiles  # 536 tiles
    assert config(128, 2048, 17).dynamic_tiles  # 272 tiles on 132
    assert config(64, 512, 32, num_sms=0).dynamic_tiles  # grid unknown
    assert config(64, 512, 32, Features(local=True)).dynamic_tiles
    assert config(64, 512, 32, Features(varlen=True)).dynamic_tiles
    assert not config(64, 512, 32, Features(softcap=True)).dynamic_tiles
    assert not fixed_deal_balances(config(128, 512, 1).replace(dynamic_tiles=False),
                                   PLAIN_FEATURES, 512, 1, 132)  # nothing is claimed
    assert fwd_config_for_problem(64, False, None, PLAIN_FEATURES, 8192, 8192, 2,
                                  132) == default_fwd_config(64, False)  # non-causal: fixed


def test_block_masks_take_the_narrow_tiles_at_head_dim_64():
    """Under a block mask head dim 64 runs three 64-row tiles at once in one
    CTA an SM (a query tile walks its few listed blocks; two CTAs under a
    cap with sinks), claimed; head
    dims 96 and 128 keep 128 rows; the lists are packed for the forward's
    tile."""
    from cute_fa.kernels.bwd_config import block_sparse_tiles
    from cute_fa.kernels.config import block_sparse_fwd_config

    narrow = block_sparse_fwd_config(64, 64)
    assert (narrow.tile_m, narrow.tile_n, narrow.ctas_per_sm, narrow.concurrent_tiles) == \
        (64, 128, 1, 3)
    # a cap with sinks spills at three streams' 160 registers: two CTAs, the same tile
    capped = block_sparse_fwd_config(64, 64, capped_with_sink=True)
    assert (capped.tile_m, capped.tile_n, capped.ctas_per_sm, capped.concurrent_tiles) == \
        (64, 128, 2, 1)
    assert narrow.dynamic_tiles and not narrow.split_tail
    narrow.validate(64)
    assert block_sparse_tiles(64, 64)[0] == (64, 128)
    for head_dim in (96, 128):
        assert block_sparse_fwd_config(head_dim, head_dim).tile_m == 128
        assert block_sparse_fwd_config(head_dim, head_dim).ctas_per_sm == 1


def test_three_warpgroup_tiles_walk_their_own_key_ranges_where_measured_faster():
    """warpgroup_key_ranges: head dim 64's 192-row tile under a causal mask or
    a wide window (with one Q stage), packed batches too, head dim 96's long
    causal one, the e4m3 causal head dim 64 tile; not under a cap, at e4m3
    head dim 128, nor where no limit cuts the tile's keys. validate refuses
    it with O staged in the V ring or without intra_wg_overlap, naming the
    field."""
    from cute_fa.kernels.config import (FP8_THREE_WARPGROUP_CAUSAL_KEYS, fp8_config_for_problem,
                                        fwd_config_for_problem)

    def config(head_dim, causal, features=PLAIN_FEATURES, seqlen=8192, window=(-1, -1)):
        return fwd_config_for_problem(head_dim, causal, None, features, seqlen, seqlen,
                                      window=window)

    for head_dim, causal, features, seqlen, window in (
            (64, True, PLAIN_FEATURES, 8192, (-1, -1)), (64, True, PLAIN_FEATURES, 2048, (-1, -1)),
            (64, True, Features(sink=True), 8192, (-1, -1)),
            (64, False, Features(local=True), 8192, (4095, 0)),
            (96, True, PLAIN_FEATURES, 16384, (-1, -1))):
        c = config(head_dim, causal, features, seqlen, window)
        assert c.tile_m == 192 and c.warpgroup_key_ranges, (head_dim, causal, features)
    assert config(64, True, Features(varlen=True)).warpgroup_key_ranges
    wide = config(64, False, Features(local=True), 8192, (4095, 0))
    assert (wide.q_stages, wide.pv_wait_after_exp2) == (1, 8)
    for head_dim, causal, features, seqlen in (
            (64, True, Features(softcap=True), 8192),
            (64, False, PLAIN_FEATURES, 8192), (128, True, PLAIN_FEATURES, 8192),
            (128, True, Features(softcap=True), 8192), (64, True, PLAIN_FEATURES, 1024)):
        assert not config(head_dim, causal, features, seqlen).warpgroup_key_ranges
    fp8 = fp8_config_for_problem(64, True, PLAIN_FEATURES, 16384)
    assert fp8.tile_m == 192 and fp8.warpgroup_key_ranges
    fp8.validate(64, fp8=True)
    fp8_128 = fp8_config_for_problem(128, True, PLAIN_FEATURES, FP8_THREE_WARPGROUP_CAUSAL_KEYS)
    assert fp8_128.tile_m == 192 and not fp8_128.warpgroup_key_ranges
    assert not fp8_config_for_problem(64, False, PLAIN_FEATURES, 16384).warpgroup_key_ranges
    ranged = config(64, True)
    for change in (dict(intra_wg_overlap=False), dict(o_in_v_smem=True)):
        with pytest.raises(ValueError, match="warpgroup_key_ranges"):
            ranged.replace(**change).validate(64)
