"""FP8 inputs on the CPU: per-(batch, KV head) e4m3 scaling, the random
Hadamard rotation of incoherent processing (exact scores, smaller FP8 error
on outlier-heavy inputs), and the emulation of the FP8 forward's arithmetic
that the FP8 kernel's error bound comes from."""

import pytest
import torch

from cute_fa.fp8 import (E4M3, E4M3_MAX, dequantize_fp8, fp8_attention_emulation, incoherent,
                         quantize_fp8, random_hadamard)
from cute_fa.profiling import fp8_error
from cute_fa.reference import attention_reference


def _inputs(seed, kind="normal", batch=2, seqlen=200, heads=8, heads_kv=2, d=64):
    """profiling.fp8_error's inputs: normal, uniform, or outlier-heavy."""
    return fp8_error.inputs(kind, batch, seqlen, heads, heads_kv, d, seed)


def _rmse(a, b):
    return ((a.float() - b.float()) ** 2).mean().sqrt().item()


def test_quantize_uses_the_whole_range_per_kv_head_group():
    q, _, _ = _inputs(0)
    q8, descale = quantize_fp8(q, heads_kv=2)
    assert q8.dtype == E4M3 and descale.shape == (2, 2) and descale.dtype == torch.float32
    groups = q.view(2, 200, 2, 4, 64).abs().amax(dim=(1, 3, 4))
    torch.testing.assert_close(descale, groups / E4M3_MAX)
    assert q8.float().view(2, 200, 2, 4, 64).abs().amax(dim=(1, 3, 4)).eq(E4M3_MAX).all()
    # e4m3 keeps 3 mantissa bits: a relative error of at most 1/16 above its
    # subnormals (2^-6 of the scale), whose step is 2^-9
    error = (dequantize_fp8(q8, descale) - q).abs()
    bound = q.abs() / 16 + (descale.repeat_interleave(4, 1)[:, None, :, None] * 2 ** -9)
    assert (error <= bound).all()


def test_hadamard_is_orthogonal_and_keeps_the_scores():
    for d in (64, 128, 256):
        h = random_hadamard(d, seed=d)
        torch.testing.assert_close(h @ h.T, torch.eye(d), atol=1e-6, rtol=0)
    q, k, _ = _inputs(1, "outliers")
    qi, ki = incoherent(q, k, seed=3)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(4, 2))
    rotated = torch.einsum("bqhd,bkhd->bhqk", qi.double(), ki.double().repeat_interleave(4, 2))
    torch.testing.assert_close(rotated, scores, atol=1e-3, rtol=1e-5)
    assert qi.abs().amax() < q.abs().amax() / 2  # the outliers are spread out


@pytest.mark.parametrize("causal", [False, True])
def test_the_emulation_rounds_only_what_the_kernel_rounds(causal):
    """Against the exact attention of the dequantized inputs, the emulation's
    only error is P in e4m3 (relative 1/16 at most per probability); rows
    that see no key give 0 and -inf."""
    q, _, _ = _inputs(2, seqlen=170)  # 170 queries, 150 keys: causal rows with no key
    _, k, v = _inputs(3, seqlen=150)
    (q8, qs), (k8, ks), (v8, vs) = quantize_fp8(q, 2), quantize_fp8(k), quantize_fp8(v)
    out, lse = fp8_attention_emulation(q8, k8, v8, qs, ks, vs, causal=causal)
    exact, exact_lse = attention_reference(dequantize_fp8(q8, qs), dequantize_fp8(k8, ks),
                                           dequantize_fp8(v8, vs), None, causal)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(lse, exact_lse, atol=1e-5, rtol=1e-5)
    v_scale = dequantize_fp8(v8, vs).abs().amax()
    assert (out - exact).abs().max() <= v_scale / 16
    assert 0 < _rmse(out, exact)  # P is rounded


def test_incoherent_processing_lowers_the_fp8_error_on_outliers():
    results = {}
    for kind in ("normal", "outliers"):
        q, k, v = _inputs(4, kind)
        ref, _ = attention_reference(q, k, v, None, True)
        for rotated in (False, True):
            qi, ki = incoherent(q, k) if rotated else (q, k)
            (q8, qs), (k8, ks), (v8, vs) = quantize_fp8(qi, 2), quantize_fp8(ki), quantize_fp8(v)
            out, _ = fp8_attention_emulation(q8, k8, v8, qs, ks, vs, causal=True)
            results[kind, rotated] = _rmse(out, ref)
    assert results["outliers", True] < results["outliers", False] / 2
    assert results["normal", True] < results["normal", False] * 1.1


@pytest.mark.parametrize("call,message", [
    (lambda: quantize_fp8(torch.zeros(2, 3, 6, 8), heads_kv=4), "heads_kv: expected a positive "
                                                              "divisor of nheads = 6"),
    (lambda: quantize_fp8(torch.zeros(2, 3, 8)), r"x: expected a float tensor \(batch, seqlen"),
    (lambda: quantize_fp8(torch.zeros(1, 2, 2, 8, dtype=torch.int32)), "x: expected a float"),
    (lambda: random_hadamard(96), "head_dim: expected a power of 2"),
    (lambda: dequantize_fp8(torch.zeros(2, 3, 4, 8).to(E4M3), torch.ones(2, 3)),
     r"descale: expected a float tensor \(batch=2, heads_kv\) with heads_kv dividing "
     r"nheads = 4"),
    (lambda: dequantize_fp8(torch.zeros(2, 3, 4, 8).to(E4M3), torch.ones(3, 2)),
     r"descale: expected a float tensor \(batch=2"),
    (lambda: dequantize_fp8(torch.zeros(3, 4, 8).to(E4M3), torch.ones(3, 2)),
     r"x8: expected a float8_e4m3fn tensor \(batch, seqlen, nheads, d\)"),
    (lambda: dequantize_fp8(torch.zeros(2, 3, 4, 8), torch.ones(2, 2)), "x8: expected"),
    (lambda: incoherent(torch.zeros(1, 2, 2, 64), torch.zeros(1, 2, 2, 32)),
     "q, k: expected one head dim"),
])
def test_bad_inputs_are_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_an_empty_tensor_quantizes_to_empty_values_and_unit_descales():
    x8, descale = quantize_fp8(torch.zeros(2, 0, 4, 64), heads_kv=2)
    assert x8.shape == (2, 0, 4, 64) and x8.dtype == E4M3
    assert torch.equal(descale, torch.ones(2, 2))
    assert dequantize_fp8(x8, descale).shape == (2, 0, 4, 64)


def test_all_zero_groups_quantize_to_zero():
    x = torch.zeros(1, 4, 2, 64)
    x8, descale = quantize_fp8(x)
    assert torch.equal(dequantize_fp8(x8, descale), x) and torch.equal(descale,
                                                                       torch.ones(1, 2))


def test_non_finite_entries_leave_their_group_scaled_by_the_finite_ones():
    x = torch.randn(1, 16, 2, 64, generator=torch.Generator().manual_seed(0))
    spots = (0, 3, 0, 5), (0, 7, 0, 9), (0, 2, 1, 1)
    for spot in spots:
        x[spot] = 0.0
    clean8, clean_descale = quantize_fp8(x)
    for spot, value in zip(spots, ("inf", "-inf", "nan")):
        x[spot] = float(value)
    x8, descale = quantize_fp8(x)
    torch.testing.assert_close(descale, clean_descale)  # finite, from the finite entries
    back = dequantize_fp8(x8, descale)
    assert back[0, 3, 0, 5] == E4M3_MAX * descale[0, 0]  # inf saturates
    assert back[0, 7, 0, 9] == -E4M3_MAX * descale[0, 0]
    assert back[0, 2, 1, 1].isnan() and back.isnan().sum() == 1  # NaN stays, alone
    finite = torch.isfinite(x)
    assert torch.equal(back[finite], dequantize_fp8(clean8, clean_descale)[finite])
