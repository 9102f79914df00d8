"""Backward kernel on the H100: dQ, dK, dV against fp32 reference gradients,
measured against PyTorch's own low-precision math path on the same inputs."""

import random

import pytest
import torch

from cute_fa.kernels.bwd_config import BwdConfig, claimed, default_bwd_config
from shapes import random_problem
from cute_fa import flash_attn_func
from cute_fa.ops import backward_cuda
from cute_fa.reference import (attention_backward_reference, attention_reference,
                               default_scale)

pytestmark = pytest.mark.gpu


def _inputs(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype, seed,
            head_dim_v=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    head_dim_v = head_dim_v or head_dim

    def randn(*shape):
        return torch.randn(shape, device="cuda", dtype=dtype, generator=gen)

    q = randn(batch, seqlen_q, heads, head_dim)
    k, v = randn(batch, seqlen_k, heads_kv, head_dim), randn(batch, seqlen_k, heads_kv, head_dim_v)
    grad_out = randn(batch, seqlen_q, heads, head_dim_v)
    return q, k, v, grad_out


def _reference_grads(q, k, v, grad_out, causal, compute_dtype, grad_lse=None):
    """Autograd through the reference math: fp32 (compute_dtype=float32) or
    torch's own low-precision path (None)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, None, causal, compute_dtype=compute_dtype)
    loss = (out.float() * grad_out.float()).sum()
    if grad_lse is not None:
        loss = loss + (torch.nan_to_num(lse, neginf=0.0) * grad_lse).sum()
    loss.backward()
    return [t.grad for t in leaves]


def _ours(q, k, v, grad_out, causal, grad_lse=None, deterministic=False):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_func(*leaves, causal=causal, return_lse=True,
                               deterministic=deterministic)
    loss = (out.float() * grad_out.float()).sum()
    if grad_lse is not None:
        loss = loss + (torch.nan_to_num(lse, neginf=0.0) * grad_lse).sum()
    loss.backward()
    return [t.grad for t in leaves]


def _check(q, k, v, grad_out, causal, grad_lse=None):
    """Each gradient within 2x the larger of (a) torch's own low-precision
    error and (b) twice the error of the FlashAttention backward formula
    evaluated in fp32 on our output (attention_backward_reference: D =
    rowsum(dO∘O) from the 16-bit O, apart from dP). (b) is the algorithm's
    own floor: dS = P∘(dP − D) cancels where a row's probability sits on
    few keys (one key: the exact gradient is 0, and torch's path, whose D is
    the sum of its own P∘dP, gets exactly 0), leaving the fp32 rounding of
    dP and D summed over every query; the tensor cores' fp32 accumulation
    rounds about twice as coarsely as IEEE fp32 (measured on the H100: dK at
    one key 3.6e-5 against the formula's 1.3e-5; fa4 3.2e-5)."""
    ours = _ours(q, k, v, grad_out, causal, grad_lse)
    ref = _reference_grads(q, k, v, grad_out, causal, torch.float32, grad_lse)
    low = _reference_grads(q, k, v, grad_out, causal, None, grad_lse)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    formula = attention_backward_reference(grad_out, q, k, v, out, lse,
                                           default_scale(q.shape[-1]), causal, grad_lse)
    for name, g, r, lo, f in zip(("dq", "dk", "dv"), ours, ref, low, formula):
        assert g.dtype == r.dtype == q.dtype and g.shape == r.shape, name
        assert torch.isfinite(g).all(), f"{name} has NaN/Inf"
        err = (g.float() - r.float()).abs().max().item()
        low_err = (lo.float() - r.float()).abs().max().item()
        formula_err = (f.float() - r.float()).abs().max().item()
        bound = 2 * max(low_err, 2 * formula_err) + 1e-5
        assert err <= bound, (f"{name}: max error {err:.3e} > {bound:.3e} (torch low precision "
                              f"{low_err:.3e}, fp32 formula {formula_err:.3e})")


def _check_within_low_precision(grads, q, k, v, grad_out, causal, label=""):
    """dQ, dK, dV within twice torch's own low-precision error (+1e-4) of the
    fp32 reference gradients."""
    ref = _reference_grads(q, k, v, grad_out, causal, torch.float32)
    low = _reference_grads(q, k, v, grad_out, causal, None)
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
        err = (g.float() - r.float()).abs().max().item()
        low_err = (lo.float() - r.float()).abs().max().item()
        assert err <= 2 * low_err + 1e-4, f"{label}{name} error {err:.3e} vs {low_err:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(128, 128), (1, 1), (17, 17), (1000, 1000), (256, 1024),
                                     (1024, 256), (113, 203), (300, 77)])
def test_backward_matches_reference(dtype, head_dim, causal, seqlens):
    seqlen_q, seqlen_k = seqlens
    _check(*_inputs(2, seqlen_q, seqlen_k, 4, 2, head_dim, dtype, seed=seqlen_q * 7 + seqlen_k),
           causal)


@pytest.mark.parametrize("head_dim", [8, 40, 72, 80, 112, 136, 232])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(1000, 1000), (113, 203)])
def test_padded_head_dims_match_reference(head_dim, causal, seqlens):
    seqlen_q, seqlen_k = seqlens
    _check(*_inputs(2, seqlen_q, seqlen_k, 4, 2, head_dim, torch.float16, seed=head_dim),
           causal)


@pytest.mark.parametrize("head_dims", [(128, 120), (120, 104), (64, 48)])
def test_value_head_dim_padded_to_that_of_q(head_dims):
    # v narrower than q but padded to the same kernel head dim: the backward
    # kernel runs it, and dV comes back with v's head dim
    head_dim, head_dim_v = head_dims
    _check(*_inputs(2, 500, 700, 4, 2, head_dim, torch.bfloat16, seed=head_dim_v,
                    head_dim_v=head_dim_v), True)


@pytest.mark.parametrize("head_dims", [(128, 64), (128, 96), (96, 64), (120, 56), (192, 128),
                                       (256, 128), (256, 64), (200, 136)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(1000, 1000), (113, 203), (300, 77)])
def test_value_head_dim_below_that_of_q(head_dims, causal, seqlens):
    # dv < d in the kernel itself (V, dO and dV tiles of v's head dim); 120/56
    # pads each to its own kernel head dim (128/64), 200/136 to 256/192
    head_dim, head_dim_v = head_dims
    seqlen_q, seqlen_k = seqlens
    _check(*_inputs(2, seqlen_q, seqlen_k, 4, 2, head_dim, torch.bfloat16,
                    seed=head_dim + head_dim_v + seqlen_q, head_dim_v=head_dim_v), causal)


@pytest.mark.parametrize("split_gqa", [False, True])
@pytest.mark.parametrize("head_dims", [(128, 64), (192, 128)])
def test_value_head_dim_below_that_of_q_in_every_epilogue(split_gqa, head_dims):
    """dK/dV through shared memory and TMA, or as fp32 per-head partials
    summed over the group (split_gqa), with the LSE gradient and
    deterministic dQ."""
    head_dim, head_dim_v = head_dims
    q, k, v, grad_out = _inputs(2, 333, 500, 8, 2, head_dim, torch.bfloat16, seed=21,
                                head_dim_v=head_dim_v)
    config = default_bwd_config(head_dim, True, deterministic=True, split_gqa=split_gqa)
    grad_lse = torch.randn((2, 8, 333), device="cuda")
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    ours = backward_cuda(grad_out, q, k, v, out, lse, default_scale(head_dim), True, grad_lse,
                         config=config)
    ref = _reference_grads(q, k, v, grad_out, True, torch.float32, grad_lse)
    low = _reference_grads(q, k, v, grad_out, True, None, grad_lse)
    for name, g, r, lo in zip(("dq", "dk", "dv"), ours, ref, low):
        assert g.shape == r.shape, name
        err = (g.float() - r.float()).abs().max().item()
        bound = 2 * (lo.float() - r.float()).abs().max().item() + 1e-5
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"
    again = backward_cuda(grad_out, q, k, v, out, lse, default_scale(head_dim), True, grad_lse,
                          config=config)
    assert all(torch.equal(a, b) for a, b in zip(ours, again))


def test_padded_head_dims_with_lse_gradient_and_determinism():
    q, k, v, grad_out = _inputs(2, 333, 500, 4, 1, 80, torch.bfloat16, seed=11)
    _check(q, k, v, grad_out, True, torch.randn((2, 4, 333), device="cuda"))
    first = _ours(q, k, v, grad_out, True, deterministic=True)
    again = _ours(q, k, v, grad_out, True, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("trial", range(12))
def test_backward_random_shapes(trial):
    shape = random_problem(random.Random(4321 + trial), group=[1, 2, 8][trial % 3])
    causal = shape.pop("causal")
    _check(*_inputs(**shape, seed=trial), causal)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_with_lse_gradient(causal):
    q, k, v, grad_out = _inputs(2, 333, 500, 4, 4, 128, torch.bfloat16, seed=9)
    grad_lse = torch.randn((2, 4, 333), device="cuda")
    _check(q, k, v, grad_out, causal, grad_lse)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_mode_is_bitwise_reproducible(head_dim, causal):
    q, k, v, grad_out = _inputs(2, 2048, 2048, 8, 2, head_dim, torch.bfloat16, seed=3)
    first = _ours(q, k, v, grad_out, causal, deterministic=True)
    for _ in range(3):
        again = _ours(q, k, v, grad_out, causal, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between runs in deterministic mode"
    _check(q, k, v, grad_out, causal)


@pytest.mark.parametrize("overrides", [dict(tile_m=64), dict(qdo_stages=1),
                                       dict(tile_n=64, tile_m=64), dict(deterministic=True),
                                       dict(split_gqa=True), dict(stats_early=True),
                                       dict(tile_m=64, stats_early=True),
                                       dict(dv_at_ds_barrier=True),
                                       dict(tile_m=64, split_gqa=True, deterministic=True),
                                       dict(tile_m=64, head_dim=128),
                                       dict(tile_m=64, head_dim=128, split_gqa=True),
                                       dict(tile_m=80, head_dim=128),
                                       dict(tile_m=80, head_dim=128, deterministic=True,
                                            stats_early=True),
                                       dict(tile_m=80, head_dim=128, dv_at_ds_barrier=True),
                                       dict(tile_m=64, head_dim=128, dv_at_ds_barrier=True),
                                       dict(dynamic_tiles=True),
                                       dict(dynamic_tiles=True, split_gqa=True),
                                       dict(dynamic_tiles=True, tile_m=64, head_dim=128,
                                            stats_early=True),
                                       dict(tile_n=64, tile_m=64, dim_split=2),
                                       dict(tile_n=64, tile_m=128, dim_split=2),
                                       dict(tile_n=64, tile_m=64, dim_split=2, head_dim=128,
                                            stats_early=True, split_gqa=True),
                                       dict(tile_n=64, tile_m=64, dim_split=2, head_dim=192,
                                            dynamic_tiles=True),
                                       dict(tile_n=64, tile_m=64, dim_split=2, head_dim=256,
                                            qdo_stages=1, deterministic=True),
                                       dict(tile_n=64, tile_m=64, dim_split=2, head_dim=256,
                                            dq_direct=True),
                                       dict(tile_n=96, tile_m=64, keys_on_n=True, head_dim=128,
                                            deterministic=True),
                                       dict(tile_n=64, tile_m=64, keys_on_n=True, head_dim=192,
                                            dq_direct=True, dynamic_tiles=True,
                                            stats_early=True),
                                       dict(tile_n=64, tile_m=64, keys_on_n=True, head_dim=128,
                                            qdo_stages=1, dv_at_ds_barrier=True),
                                       dict(tile_n=96, tile_m=64, keys_on_n=True, head_dim=192,
                                            do_stages=1, ds_buffers=1, stats_early=True),
                                       dict(tile_n=96, tile_m=64, keys_on_n=True, head_dim=192,
                                            do_stages=1, ds_buffers=1, deterministic=True),
                                       dict(dq_direct=True),
                                       dict(dq_direct=True, dynamic_tiles=True,
                                            split_gqa=True),
                                       dict(tile_m=64, dq_one_warpgroup=True),
                                       dict(tile_m=64, head_dim=96, dq_one_warpgroup=True,
                                            deterministic=True),
                                       dict(tile_m=64, head_dim=96, dq_one_warpgroup=True,
                                            dq_direct=True, dynamic_tiles=True, split_gqa=True),
                                       dict(convert_dq=True), dict(convert_dq=True,
                                                                   dynamic_tiles=True),
                                       dict(convert_dq=True, deterministic=True),
                                       dict(convert_dq=True, split_gqa=True),
                                       dict(tile_m=64, head_dim=128, convert_dq=True,
                                            dynamic_tiles=True, stats_early=True),
                                       dict(tile_m=64, head_dim=96, dq_one_warpgroup=True,
                                            convert_dq=True, fp16=True),
                                       dict(dq_first_store=True, tile_n=64, tile_m=64),
                                       dict(dq_first_store=True, dynamic_tiles=True,
                                            split_gqa=True),
                                       dict(dq_first_store=True, tile_m=80, head_dim=128,
                                            deterministic=True),
                                       dict(dq_first_store=True, tile_n=64, tile_m=64,
                                            dim_split=2, head_dim=192, dynamic_tiles=True),
                                       dict(dq_first_store=True, tile_n=96, tile_m=64,
                                            keys_on_n=True, head_dim=192, do_stages=1,
                                            ds_buffers=1, deterministic=True)])
def test_backward_config_variants(overrides):
    overrides = dict(overrides)
    head_dim = overrides.pop("head_dim", 64)
    dtype = torch.float16 if overrides.pop("fp16", False) else torch.bfloat16
    config = BwdConfig(tile_m=128).replace(**overrides)
    q, k, v, grad_out = _inputs(2, 700, 900, 4, 1, head_dim, dtype, seed=5)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    ours = backward_cuda(grad_out, q, k, v, out, lse, default_scale(head_dim), True,
                         config=config)
    _check_within_low_precision(ours, q, k, v, grad_out, True, f"{config}: ")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_accumulator_never_read_unwritten(head_dim, deterministic):
    """Nothing zeroes the fp32 dQ accumulator (BwdConfig.dq_first_store):
    each query tile's first partial is stored. Memory the allocator hands
    back full of NaN must not reach dQ, neither through a tile's adds nor
    through the tiles no key block walks (causal with more queries than
    keys: the first 1,300 rows see no key, and their dQ is exactly 0)."""
    assert default_bwd_config(head_dim, True, deterministic).dq_first_store
    q, k, v, grad_out = _inputs(2, 1700, 400, 8, 2, head_dim, torch.bfloat16, seed=head_dim)
    for _ in range(2):
        torch.cuda.empty_cache()
        poison = torch.full((1 << 28,), float("nan"), device="cuda")  # 1 GiB, then freed
        del poison
        dq, dk, dv = _ours(q, k, v, grad_out, True, deterministic=deterministic)
        assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
        assert torch.count_nonzero(dq[:, :1300]) == 0
    _check(q, k, v, grad_out, True)


@pytest.mark.parametrize("overrides", [dict(dynamic_tiles=False), dict(dynamic_tiles=True),
                                       dict(dynamic_tiles=False, deterministic=True)])
def test_causal_multi_section_schedule(overrides):
    # A 1 MB section holds 2 (batch, head) pairs of 1000 x 64 Q, dO and dQ
    # accumulator: 15 pairs make seven whole sections and one of a single
    # pair, which is dealt first; every key block is still walked once.
    config = default_bwd_config(64, True).replace(l2_section_mb=1, **overrides)
    q, k, v, grad_out = _inputs(3, 1000, 1000, 5, 5, 64, torch.bfloat16, seed=15)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    ours = backward_cuda(grad_out, q, k, v, out, lse, default_scale(64), True, config=config)
    _check_within_low_precision(ours, q, k, v, grad_out, True, f"{config}: ")


@pytest.mark.parametrize("head_dim,causal", [(64, True), (96, True), (128, True), (128, False),
                                             (256, True)])
def test_claimed_key_blocks_match_one_cta_per_block(head_dim, causal):
    # BwdConfig.dynamic_tiles: with many more key blocks than SMs most are
    # claimed, by CTAs that drew short or long ones; dK and dV (each from
    # one tile, and staged in the dSᵀ buffers with the K/V buffers released
    # early: dkv_via_scores) are bit-identical to one CTA per key block's,
    # staged in the K/V buffers, call after call (each call's counter is
    # zeroed by its preprocess), and dQ (added across tiles in no fixed
    # order) matches the reference.
    q, k, v, grad_out = _inputs(4, 2048, 2048, 16, 8, head_dim, torch.bfloat16, seed=head_dim)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    fixed = claimed(default_bwd_config(head_dim, causal), False, head_dim, None)
    dynamic = claimed(fixed, True, head_dim, None)
    assert dynamic.dkv_via_scores == (head_dim <= 128) and not fixed.dkv_via_scores
    scale = default_scale(head_dim)
    _, dk_ref, dv_ref = backward_cuda(grad_out, q, k, v, out, lse, scale, causal, config=fixed)
    for _ in range(3):
        dq, dk, dv = backward_cuda(grad_out, q, k, v, out, lse, scale, causal, config=dynamic)
        assert torch.equal(dk, dk_ref) and torch.equal(dv, dv_ref)
    _check_within_low_precision((dq, dk, dv), q, k, v, grad_out, causal)


def test_backward_under_torch_compile():
    q, k, v, grad_out = _inputs(2, 256, 256, 4, 4, 64, torch.bfloat16, seed=11)

    @torch.compile(fullgraph=True)
    def loss_fn(q, k, v):
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out.float() * grad_out.float()).sum()

    # compiled: the custom ops; eager: the lower-overhead autograd.Function;
    # deterministic mode makes the comparison bitwise
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    loss_fn(*leaves).backward()
    eager = _ours(q, k, v, grad_out, True, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), [t.grad for t in leaves], eager):
        assert torch.equal(a, b), f"{name}: compiled and eager gradients differ"
