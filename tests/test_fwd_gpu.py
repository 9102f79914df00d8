"""Forward kernel on the H100: accuracy against an fp32 reference, measured
against PyTorch's own low-precision math path on the same inputs."""

import random

import pytest
import torch

from cute_fa import flash_attn_func
from cute_fa.ops import forward_cuda
from cute_fa.reference import attention_reference, default_scale
from cute_fa.kernels.config import (LONG_SEQLEN, Features, FwdConfig, default_fwd_config,
                                    fwd_config_for_problem)
from cute_fa.kernels.tail_plan import TailPlan
from shapes import random_problem

pytestmark = pytest.mark.gpu


def _inputs(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype, seed,
            head_dim_v=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape_q = (batch, seqlen_q, heads, head_dim)
    shape_k = (batch, seqlen_k, heads_kv, head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(shape_k, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn((*shape_k[:3], head_dim_v or head_dim), device="cuda", dtype=dtype,
                    generator=gen)
    return q, k, v


def _check(q, k, v, causal, out, lse, softcap=0.0):
    ref_out, ref_lse = attention_reference(q, k, v, None, causal, compute_dtype=torch.float32,
                                           softcap=softcap)
    low_out, _ = attention_reference(q, k, v, None, causal, compute_dtype=None, softcap=softcap)
    assert torch.isfinite(out).all(), "output has NaN/Inf"
    err = (out.float() - ref_out.float()).abs().max().item()
    low_err = (low_out.float() - ref_out.float()).abs().max().item()
    assert err <= 2 * low_err + 1e-5, f"max error {err:.3e} > 2 x torch low-precision {low_err:.3e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "LSE -inf rows differ from the reference"
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert lse_err < 1e-2, f"LSE max error {lse_err:.3e}"
    return err, low_err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(128, 128), (1, 1), (17, 17), (1000, 1000), (4097, 4097),
                                     (256, 1024), (1024, 256), (113, 203), (300, 77)])
def test_forward_matches_reference(dtype, head_dim, causal, seqlens):
    seqlen_q, seqlen_k = seqlens
    q, k, v = _inputs(2, seqlen_q, seqlen_k, 4, 2, head_dim, dtype, seed=seqlen_q * 7 + seqlen_k)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    _check(q, k, v, causal, out, lse)


@pytest.mark.parametrize("causal,seqlen,softcap", [(False, 2003, 0.0), (False, 2003, 30.0),
                                                   (True, LONG_SEQLEN + 5, 0.0)])
def test_head_dim_96_wide_tiles_match_reference(causal, seqlen, softcap):
    # 192 query rows of 112 keys: past SHORT_SEQLEN, causal from LONG_SEQLEN
    q, k, v = _inputs(1, seqlen, seqlen, 4, 2, 96, torch.bfloat16, seed=seqlen)
    features = Features(softcap=softcap > 0)
    assert fwd_config_for_problem(96, causal, None, features, seqlen, seqlen).tile_m == 192
    out, lse = flash_attn_func(q, k, v, causal=causal, softcap=softcap, return_lse=True)
    _check(q, k, v, causal, out, lse, softcap)


@pytest.mark.parametrize("seqlen,batch", [(1000, 1), (1024, 1), (500, 2)])
def test_head_dim_96_short_rows_in_wide_tiles(seqlen, batch):
    # what a batch-1 grid of 21 heads takes on 132 SMs (config.wide_fwd_config:
    # 192-row tiles fill the waves better), the last tile partly past the rows
    from cute_fa.kernels.config import wide_fwd_config

    q, k, v = _inputs(batch, seqlen, seqlen, 21, 7, 96, torch.bfloat16, seed=seqlen)
    out, lse = forward_cuda(q, k, v, default_scale(96), False, wide_fwd_config(96, False))
    _check(q, k, v, False, out, lse)


@pytest.mark.parametrize("head_dim", [8, 40, 72, 80, 112, 136, 200, 248])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(1000, 1000), (113, 203), (1, 77)])
def test_padded_head_dims_match_reference(head_dim, causal, seqlens):
    # run by the kernel of the next head dim up, q, k, v zero-padded
    seqlen_q, seqlen_k = seqlens
    q, k, v = _inputs(2, seqlen_q, seqlen_k, 4, 2, head_dim, torch.bfloat16, seed=head_dim)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.is_contiguous()
    _check(q, k, v, causal, out, lse)


@pytest.mark.parametrize("head_dims", [(192, 128), (128, 64), (256, 128), (96, 64),
                                       (256, 192), (192, 120), (104, 72)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(1000, 1000), (113, 203), (4097, 4097), (1, 77)])
def test_value_head_dim_matches_reference(head_dims, dtype, causal, seqlens):
    # v narrower than q and k (DeepSeek's MLA prefill: 192/128); the last two
    # pairs are padded, q/k and v each to their own kernel head dim
    head_dim, head_dim_v = head_dims
    seqlen_q, seqlen_k = seqlens
    q, k, v = _inputs(2, seqlen_q, seqlen_k, 6, 2, head_dim, dtype, seed=head_dim_v,
                      head_dim_v=head_dim_v)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (2, seqlen_q, 6, head_dim_v) and out.is_contiguous()
    _check(q, k, v, causal, out, lse)


@pytest.mark.parametrize("trial", range(12))
def test_forward_random_shapes(trial):
    shape = random_problem(random.Random(1234 + trial))
    causal = shape.pop("causal")
    q, k, v = _inputs(**shape, seed=trial)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    _check(q, k, v, causal, out, lse)


@pytest.mark.parametrize("overrides", [
    dict(), dict(pingpong=False), dict(intra_wg_overlap=False), dict(persistent=False),
    dict(kv_stages=3, tile_n=64), dict(tile_m=64), dict(tile_m=192, producer_regs=32,
                                                        consumer_regs=160),
    dict(tile_m=64, ctas_per_sm=2, consumer_regs=232), dict(tile_m=64, ctas_per_sm=2,
                                                            consumer_regs=232, dynamic_tiles=True),
    dict(tile_m=64, tile_n=64, kv_stages=3, ctas_per_sm=3, consumer_regs=136),
    dict(tile_m=64, tile_n=64, kv_stages=3, ctas_per_sm=3, consumer_regs=136, dynamic_tiles=True,
         pv_wait_after_exp2=4),
    dict(tile_m=64, concurrent_tiles=3, o_in_v_smem=True, producer_regs=32, consumer_regs=160,
         rederive_epilogue_coords=True),
    dict(tile_m=64, tile_n=64, kv_stages=3, concurrent_tiles=3, producer_regs=32,
         consumer_regs=160, dynamic_tiles=True),
    dict(tile_m=64, concurrent_tiles=2, dynamic_tiles=True),
    dict(intra_wg_overlap=False, pingpong=False, persistent=False),
    dict(pv_wait_after_exp2=8), dict(pv_wait_after_exp2=32),
    dict(pv_wait_after_exp2=1, tile_m=192, producer_regs=32, consumer_regs=160),
    dict(rederive_epilogue_coords=True),
    dict(dynamic_tiles=True), dict(dynamic_tiles=True, intra_wg_overlap=False, pingpong=False),
    dict(dynamic_tiles=True, tile_m=192, producer_regs=32, consumer_regs=160),
    dict(split_tail=True), dict(split_tail=True, intra_wg_overlap=False, pingpong=False),
    dict(o_in_v_smem=True), dict(o_in_v_smem=True, persistent=False),
    dict(o_in_v_smem=True, dynamic_tiles=True), dict(o_in_v_smem=True, split_tail=True),
    dict(o_in_v_smem=True, intra_wg_overlap=False, pingpong=False),
    dict(o_in_v_smem=True, tile_m=192, producer_regs=32, consumer_regs=160),
    dict(shared_o_slab=True), dict(shared_o_slab=True, dynamic_tiles=True),
    dict(shared_o_slab=True, split_tail=True), dict(shared_o_slab=True, persistent=False),
    dict(shared_o_slab=True, tile_m=192, producer_regs=32, consumer_regs=160),
    dict(rescale_o_before_pv=True), dict(rescale_o_before_pv=True, pv_wait_after_exp2=8),
    dict(rescale_o_before_pv=True, o_in_v_smem=True, dynamic_tiles=True),
    dict(rescale_o_before_pv=True, split_tail=True),
    dict(skip_unmoved_rescale=True), dict(skip_unmoved_rescale=True, rescale_o_before_pv=True),
    dict(skip_unmoved_rescale=True, intra_wg_overlap=False, pingpong=False),
])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_config_variants(overrides, causal):
    if causal and overrides.get("split_tail"):
        pytest.skip("split_tail is for non-causal kernels (test_split_tail_* there)")
    config = FwdConfig().replace(**overrides)
    q, k, v = _inputs(2, 700, 900, 4, 1, 64, torch.bfloat16, seed=5)
    out, lse = forward_cuda(q, k, v, default_scale(64), causal, config)
    _check(q, k, v, causal, out, lse)


@pytest.mark.parametrize("overrides", [
    dict(), dict(dynamic_tiles=True), dict(o_in_v_smem=False, tile_n=64, kv_stages=3),
    dict(concurrent_tiles=2, producer_regs=24, consumer_regs=240, dynamic_tiles=True,
         pv_wait_after_exp2=8),
])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_streams_over_many_rounds(overrides, causal):
    """Several tiles at once in one CTA (concurrent_tiles; the config of head
    dim 64's short non-causal rows, config.three_tile_streams): each stream's
    own banks of the Q, K and V rings, tile slots and O staging in its V bank
    hold over rounds of tiles (4096 tiles on 396 streams), dealt and
    claimed. Their arithmetic is the one-stream kernel's: its bits."""
    from cute_fa.kernels.config import three_tile_streams

    config = three_tile_streams(False).replace(**overrides)
    q, k, v = _inputs(8, 1000, 1000, 32, 8, 64, torch.bfloat16, seed=29)
    out, lse = forward_cuda(q, k, v, default_scale(64), causal, config)
    _check(q, k, v, causal, out, lse)
    one = config.replace(concurrent_tiles=1, consumer_regs=240, producer_regs=24,
                         ctas_per_sm=1)
    out_one, lse_one = forward_cuda(q, k, v, default_scale(64), causal, one)
    assert torch.equal(out, out_one) and torch.equal(lse, lse_one)


@pytest.mark.parametrize("overrides", [
    dict(), dict(split_tail=True), dict(dynamic_tiles=True),
    dict(tile_m=192, producer_regs=32, consumer_regs=160),
])
@pytest.mark.parametrize("causal", [False, True])
def test_shared_o_slab_over_many_rounds(overrides, causal):
    """One O slab that the consumer warpgroups take in turn, several tiles a
    CTA: the turn passes from tile to tile, and split_tail's earlier parts
    pass it on unused."""
    if causal and overrides.get("split_tail"):
        pytest.skip("split_tail is for non-causal kernels")
    config = FwdConfig(shared_o_slab=True).replace(**overrides)
    q, k, v = _inputs(4, 1500, 1500, 16, 4, 64, torch.bfloat16, seed=17)
    out, lse = forward_cuda(q, k, v, default_scale(64), causal, config)
    _check(q, k, v, causal, out, lse)


@pytest.mark.parametrize("head_dim,heads,seqlens,tiles", [
    (64, 64, (200, 200), "three CTAs"), (64, 64, (128, 128), "three CTAs"),
    (64, 64, (256, 77), "three CTAs"), (64, 20, (200, 200), "tiny"),
    (128, 64, (200, 200), "tiny"), (128, 64, (128, 128), "tiny"), (128, 64, (256, 77), "tiny")])
def test_tiny_causal_rows_on_a_full_gpu(head_dim, heads, seqlens, tiles):
    """Causal rows of up to TINY_SEQLEN on a grid of several rounds take the
    tiny tiles (config.tiny_fwd_config), claimed; at head dim 64 three CTAs
    an SM where those run THREE_CTAS_MIN_ROUNDS rounds (the grids of 64
    heads; 20 heads run two)."""
    from cute_fa.kernels.config import PLAIN_FEATURES, three_ctas_an_sm, tiny_fwd_config
    from cute_fa.variants import num_sms

    q, k, v = _inputs(8, *seqlens, heads, heads // 4, head_dim, torch.bfloat16, seed=13)
    config = fwd_config_for_problem(head_dim, True, None, PLAIN_FEATURES, *seqlens, 8 * heads,
                                    num_sms(q.device.index))
    assert config == (tiny_fwd_config(head_dim, True) if tiles == "tiny"
                      else three_ctas_an_sm(True, rederive_epilogue_coords=True))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    _check(q, k, v, True, out, lse)


@pytest.mark.parametrize("overrides", [
    dict(), dict(dynamic_tiles=True), dict(dynamic_tiles=True, pingpong=False,
                                           intra_wg_overlap=False),
    dict(tile_m=64, ctas_per_sm=2, consumer_regs=232, dynamic_tiles=True),
    dict(tile_m=64, tile_n=64, ctas_per_sm=3, consumer_regs=136, dynamic_tiles=True),
    dict(tile_m=192, kv_stages=3, producer_regs=32, consumer_regs=160, dynamic_tiles=True),
    dict(split_tail=True),
])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_q_ring_of_two_stages(overrides, causal):
    """Tiles of one or two key blocks, several rounds a CTA: the producer runs
    rounds ahead of the consumers (what TileQueue's slots are counted for).
    A second Q stage changes no arithmetic: the one-stage kernel's bits."""
    if causal and overrides.get("split_tail"):
        pytest.skip("split_tail is for non-causal kernels")
    config = FwdConfig(q_stages=2).replace(**overrides)
    q, k, v = _inputs(16, 200, 200, 16, 4, 64, torch.bfloat16, seed=11)
    out, lse = forward_cuda(q, k, v, default_scale(64), causal, config)
    _check(q, k, v, causal, out, lse)
    one_stage = forward_cuda(q, k, v, default_scale(64), causal, config.replace(q_stages=1))
    assert torch.equal(out, one_stage[0]) and torch.equal(lse, one_stage[1])


@pytest.mark.parametrize("heads, heads_kv, batch", [(5, 5, 3), (8, 2, 3), (7, 1, 2)])
def test_causal_multi_section_schedule(heads, heads_kv, batch):
    # A 1 MB section holds 4 (batch, head) pairs of 1000 x 64 K/V: several
    # sections, the last one partial, each walked longest-first.
    config = FwdConfig(l2_section_mb=1, persistent=False)
    q, k, v = _inputs(batch, 1000, 1000, heads, heads_kv, 64, torch.bfloat16, seed=heads)
    for cfg in (config, config.replace(persistent=True),
                config.replace(persistent=True, dynamic_tiles=True)):
        out, lse = forward_cuda(q, k, v, default_scale(64), True, cfg)
        _check(q, k, v, True, out, lse)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_claimed_tiles_match_the_fixed_deal(head_dim):
    # dynamic_tiles changes which CTA computes a tile, not how: with many
    # more tiles than SMs (so most are claimed, some by CTAs that drew short
    # ones) the output and LSE are bit-identical to the fixed deal's, call
    # after call (each call gets a fresh counter).
    q, k, v = _inputs(4, 2048, 2048, 16, 4, head_dim, torch.bfloat16, seed=head_dim)
    fixed = default_fwd_config(head_dim, True).replace(dynamic_tiles=False)
    ref_out, ref_lse = forward_cuda(q, k, v, default_scale(head_dim), True, fixed)
    for _ in range(3):
        out, lse = forward_cuda(q, k, v, default_scale(head_dim), True,
                                fixed.replace(dynamic_tiles=True))
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    _check(q, k, v, True, ref_out, ref_lse)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("seqlens, parts", [((1000, 1000), 3), ((300, 4097), 8),
                                            ((77, 203), 2), ((129, 17), 3)])
def test_split_tail_matches_reference(head_dim, seqlens, parts):
    # FwdConfig.split_tail with forced plans: every tile split, or the second
    # half of them; ragged key ends inside the last part; parts with no K/V
    # block at all (17 keys are one block) count in with an empty result.
    # The parts are summed in part order: the same bits call after call.
    seqlen_q, seqlen_k = seqlens
    q, k, v = _inputs(2, seqlen_q, seqlen_k, 6, 2, head_dim, torch.bfloat16, seed=parts)
    config = default_fwd_config(head_dim, False)
    assert config.split_tail
    num_tiles = -(-seqlen_q // config.tile_m) * 6 * 2
    for full_tiles in (0, num_tiles // 2):
        tail = TailPlan(full_tiles=full_tiles, parts=parts)
        out, lse = forward_cuda(q, k, v, default_scale(head_dim), False, config, tail)
        _check(q, k, v, False, out, lse)
        again, again_lse = forward_cuda(q, k, v, default_scale(head_dim), False, config, tail)
        assert torch.equal(out, again) and torch.equal(lse, again_lse)


@pytest.mark.parametrize("head_dims", [(192, 128), (256, 256)])
def test_split_tail_with_o_in_v(head_dims):
    # the large head dims' kernels with split_tail forced on: the merged
    # parts hold v's head dim, and O is staged in the V ring
    head_dim, head_dim_v = head_dims
    q, k, v = _inputs(2, 1000, 1000, 6, 2, head_dim, torch.bfloat16, seed=3,
                      head_dim_v=head_dim_v)
    config = default_fwd_config(head_dim, False, head_dim_v).replace(split_tail=True)
    assert config.o_in_v_smem
    out, lse = forward_cuda(q, k, v, default_scale(head_dim), False, config,
                            TailPlan(full_tiles=0, parts=3))
    _check(q, k, v, False, out, lse)


def test_split_tail_refuses_a_plan_it_cannot_run():
    q, k, v = _inputs(1, 256, 256, 2, 2, 128, torch.bfloat16, seed=0)
    config = default_fwd_config(128, False)
    with pytest.raises(ValueError, match="tail: expected"):
        forward_cuda(q, k, v, 1.0, False, config.replace(split_tail=False), TailPlan(0, 2))
    with pytest.raises(ValueError, match="tail: expected"):
        forward_cuda(q, k, v, 1.0, False, config, TailPlan(full_tiles=5, parts=2))
    for parts in (0, 9):  # the merge holds at most tail_plan.MAX_PARTS parts
        with pytest.raises(ValueError, match="tail: expected"):
            forward_cuda(q, k, v, 1.0, False, config, TailPlan(full_tiles=0, parts=parts))


def test_no_visible_key_rows_are_zero():
    # causal with seqlen_q > seqlen_k: the first rows see no key at all.
    q, k, v = _inputs(1, 300, 100, 2, 2, 128, torch.bfloat16, seed=3)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :200] == 0)
    assert torch.all(lse[:, :, :200] == float("-inf"))
    _check(q, k, v, True, out, lse)


def test_deterministic():
    q, k, v = _inputs(3, 1531, 1531, 8, 2, 128, torch.bfloat16, seed=11)
    a = flash_attn_func(q, k, v, causal=True)
    b = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(a, b)


def test_non_contiguous_and_strided_inputs():
    # q sliced out of a packed qkv tensor: strided, still 16-byte aligned.
    qkv = torch.randn(2, 333, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)
    out = flash_attn_func(q, k, v)
    _check(q, k, v, False, out, flash_attn_func(q, k, v, return_lse=True)[1])



@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_when_maxima_grow(causal, head_dim):
    # The main loop walks key blocks from the last one down. Key norms that
    # grow toward the first key make each row's maximum climb as the walk
    # goes on, by about 40 in log2 units of the scaled scores in all, so the
    # O rescale factors move far from 1 at many steps. A kernel that skips
    # the rescale where no row of a warp moved must skip it only there: its
    # O may differ from the plain rescale's by the fp32 ulps of exp2(0),
    # which can flip a bf16 rounding, not more.
    q, k, v = _inputs(2, 1000, 1000, 4, 2, head_dim, torch.bfloat16, seed=17)
    ramp = torch.linspace(12.0, 0.5, 1000, device="cuda").view(1, -1, 1, 1)
    k = (k.float() * ramp).to(torch.bfloat16)
    config = FwdConfig(tile_n=64, kv_stages=3)
    out, lse = forward_cuda(q, k, v, default_scale(head_dim), causal, config)
    _check(q, k, v, causal, out, lse)
    skipping, skipping_lse = forward_cuda(q, k, v, default_scale(head_dim), causal,
                                          config.replace(skip_unmoved_rescale=True))
    bf16_ulp = out.float().abs().max().item() * 2.0 ** -7
    assert (skipping.float() - out.float()).abs().max().item() <= bf16_ulp
    assert (skipping_lse - lse).abs().max().item() <= 1e-4
