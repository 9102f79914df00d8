"""Sliding windows and soft-capped scores on the H100: forward and every
gradient against the fp32 reference, with the bound the dense tests use
(2x PyTorch's own low-precision error on the same inputs)."""

import pytest
import torch

from cute_fa import flash_attn_func
from cute_fa.reference import attention_reference

from bounds import assert_lse_matches, assert_within_low_precision
from shapes import cuda_qkv_grad

pytestmark = pytest.mark.gpu


_inputs = cuda_qkv_grad


def _window(causal, window_size):
    return (window_size[0], 0 if causal else window_size[1])


def _grads(fn, q, k, v, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    (out.float() * grad_out.float()).sum().backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def _check(q, k, v, grad_out, causal, window_size, softcap, backward=True):
    window = _window(causal, window_size)

    def ours(*t):
        return flash_attn_func(*t, causal=causal, window_size=window_size, softcap=softcap,
                               return_lse=True)

    def reference(compute_dtype):
        return lambda *t: attention_reference(*t, None, causal, compute_dtype=compute_dtype,
                                              window=window, softcap=softcap)

    if not backward:
        with torch.no_grad():
            out, lse = ours(q, k, v)
            ref_out, ref_lse = reference(torch.float32)(q, k, v)
            low_out, _ = reference(None)(q, k, v)
        pairs = [("out", out, ref_out, low_out)]
    else:
        out, lse, grads = _grads(ours, q, k, v, grad_out)
        ref_out, ref_lse, ref_grads = _grads(reference(torch.float32), q, k, v, grad_out)
        low_out, _, low_grads = _grads(reference(None), q, k, v, grad_out)
        pairs = [("out", out, ref_out, low_out)] + list(zip(("dq", "dk", "dv"), grads,
                                                             ref_grads, low_grads))
    assert_lse_matches(lse, ref_lse)
    assert_within_low_precision(pairs)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("causal,window_size", [
    (False, (256, 0)), (False, (100, 37)), (True, (300, -1)), (False, (0, 0)),
    (False, (-1, 50)), (False, (513, 513)), (True, (1, -1))])
@pytest.mark.parametrize("seqlens", [(1000, 1000), (300, 777), (777, 300), (1, 513)])
def test_window_forward_backward(head_dim, causal, window_size, seqlens):
    q, k, v, g = _inputs(2, *seqlens, 4, 2, head_dim, torch.bfloat16,
                         seed=seqlens[0] + 3 * window_size[0] + head_dim)
    _check(q, k, v, g, causal, window_size, 0.0)


@pytest.mark.parametrize("causal,window_size", [
    (False, (2048, 0)), (True, (2100, -1)), (False, (1500, 700)), (False, (-1, 1000))])
def test_wide_window_forward_backward(causal, window_size):
    """Windows of 2048 keys or more take head dim 64's 192-row forward tile
    (config.WIDE_WINDOW_KEYS)."""
    q, k, v, g = _inputs(1, 2900, 3100, 4, 2, 64, torch.bfloat16, seed=window_size[0])
    _check(q, k, v, g, causal, window_size, 0.0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,window_size", [(False, (-1, -1)), (True, (-1, -1)),
                                                (False, (200, 64))])
# 5 and 30: the bf16 forward's fixed softmax reference at the cap (P <= 1);
# 50: below it (P up to 2^20); 100: beyond the fixed range, a running maximum
@pytest.mark.parametrize("softcap", [5.0, 30.0, 50.0, 100.0])
def test_softcap_forward_backward(head_dim, dtype, causal, window_size, softcap):
    q, k, v, g = _inputs(2, 700, 900, 4, 1, head_dim, dtype, seed=head_dim + int(softcap))
    # scores that the cap bends: q·k·scale spans several times the cap
    q = q * (softcap / 4) ** 0.5
    _check(q, k, v, g, causal, window_size, softcap)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("softcap", [30.0, 50.0, 65.0, 100.0])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_softcap_rows_saturated_at_either_end(head_dim, softcap, sign):
    """Every score of a row at +cap or at -cap: the ends of the range that a
    fixed softmax reference must keep finite and normal (softcap.py), with
    head dim 64's exponentials partly on the FMA pipe (exp2_fma.py)."""
    q, k, v, g = _inputs(2, 300, 700, 4, 2, head_dim, torch.bfloat16, seed=int(softcap))
    direction = torch.randn(head_dim, device="cuda").to(torch.bfloat16)
    k = direction + 0.05 * k
    q = (sign * 20.0 * direction).expand_as(q) + 0.05 * q
    _check(q, k, v, g, False, (-1, -1), softcap, backward=False)


@pytest.mark.parametrize("tiles", ["three CTAs", "three streams"])
@pytest.mark.parametrize("causal,window_size,softcap,sink", [
    (True, (-1, -1), 0.0, False), (True, (255, -1), 0.0, False), (False, (100, 37), 0.0, False),
    (True, (-1, -1), 30.0, False), (True, (-1, -1), 0.0, True), (False, (300, 0), 30.0, True),
    (False, (-1, -1), 30.0, False), (False, (-1, -1), 0.0, True)])
def test_three_tiles_an_sm_forward(tiles, causal, window_size, softcap, sink):
    """Head dim 64's three tiles an SM, over rounds of claimed tiles (1024
    tiles on 396 CTAs or streams), which the shapes above are too small to
    take: three CTAs (config.three_ctas_an_sm: short causal rows, narrow
    windows) or three tile streams of one CTA (config.three_tile_streams:
    short non-causal rows, block masks); windows, caps and sinks against
    the fp32 reference."""
    from cute_fa.kernels.config import CAPPED_EXP2_ON_FMA, three_ctas_an_sm, three_tile_streams
    from cute_fa.ops import forward_cuda

    q, k, v, _ = _inputs(8, 1000, 1000, 8, 2, 64, torch.bfloat16, seed=17 + window_size[0])
    q = q * (softcap / 4) ** 0.5 if softcap else q
    sink_logits = torch.randn(8, device="cuda") if sink else None
    config = (three_ctas_an_sm(True, rederive_epilogue_coords=causal) if tiles == "three CTAs"
              else three_tile_streams(True))
    if softcap:  # as the op's configs take them (default_fwd_config)
        config = config.replace(exp2_on_fma=CAPPED_EXP2_ON_FMA)
    out, lse = forward_cuda(q, k, v, 64 ** -0.5, causal, config, window_left=window_size[0],
                            window_right=window_size[1], softcap=softcap,
                            learnable_sink=sink_logits)

    def reference(compute_dtype):
        return attention_reference(q, k, v, None, causal, compute_dtype=compute_dtype,
                                   window=_window(causal, window_size), softcap=softcap,
                                   sink=sink_logits)

    ref_out, ref_lse = reference(torch.float32)
    assert_lse_matches(lse, ref_lse)
    assert_within_low_precision([("out", out, ref_out, reference(None)[0])])


@pytest.mark.parametrize("per_8", range(1, 9))
@pytest.mark.parametrize("causal", [False, True])
def test_capped_exponentials_partly_on_the_fma_pipe(per_8, causal):
    """Every share of a bounded softmax's exponentials taken to the FMA pipe
    (FwdConfig.exp2_on_fma: k of every 8 columns of a thread's row; 8: all)
    against the fp32 reference: masked scores, and causal rows that see no
    key (900 queries on 700 keys, bottom-right aligned)."""
    from cute_fa.kernels.config import Features, default_fwd_config
    from cute_fa.ops import forward_cuda

    q, k, v, _ = _inputs(2, 900, 700, 4, 1, 64, torch.bfloat16, seed=per_8)
    q = q * (30.0 / 4) ** 0.5
    config = default_fwd_config(64, causal, features=Features(softcap=True)).replace(
        exp2_on_fma=per_8)
    out, lse = forward_cuda(q, k, v, 64 ** -0.5, causal, config, softcap=30.0)

    def reference(compute_dtype):
        return attention_reference(q, k, v, None, causal, compute_dtype=compute_dtype,
                                   softcap=30.0)

    ref_out, ref_lse = reference(torch.float32)
    assert_lse_matches(lse, ref_lse)
    assert_within_low_precision([("out", out, ref_out, reference(None)[0])])


@pytest.mark.parametrize("head_dim", [192, 256])
@pytest.mark.parametrize("causal,window_size,softcap", [(False, (128, 0), 0.0),
                                                        (True, (-1, -1), 20.0),
                                                        (False, (300, 100), 20.0)])
def test_large_head_dims_forward_backward(head_dim, causal, window_size, softcap):
    q, k, v, g = _inputs(1, 1000, 1200, 4, 2, head_dim, torch.bfloat16, seed=head_dim)
    _check(q, k, v, g, causal, window_size, softcap)


@pytest.mark.parametrize("causal,window_size", [(False, (200, 64)), (True, (333, -1))])
def test_window_deterministic_is_bitwise_reproducible(causal, window_size):
    q, k, v, g = _inputs(2, 1500, 1500, 8, 2, 128, torch.bfloat16, seed=5)

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=causal, window_size=window_size,
                              deterministic=True)
        (out.float() * g.float()).sum().backward()
        return [t.grad for t in leaves]

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _wide_tile(head_dim, causal, features):
    """The forward config of three consumer warpgroups a tile for the case."""
    from cute_fa.kernels.config import default_fwd_config

    if head_dim == 96:
        return default_fwd_config(96, causal, features=features, long_rows=True)
    return default_fwd_config(head_dim, causal, features=features, wide_window=features.local)


@pytest.mark.parametrize("head_dim,dtype,causal,window,softcap,sink,seqlens", [
    (64, torch.bfloat16, True, (-1, -1), 0.0, False, (900, 700)),
    (64, torch.bfloat16, True, (-1, -1), 0.0, False, (1000, 1000)),
    (64, torch.float16, True, (-1, -1), 0.0, False, (777, 1000)),
    (64, torch.bfloat16, True, (-1, -1), 30.0, False, (1000, 1000)),
    (64, torch.bfloat16, False, (256, 0), 0.0, False, (1000, 1000)),
    (64, torch.bfloat16, False, (100, 37), 0.0, False, (1000, 1200)),
    (64, torch.bfloat16, False, (0, 0), 0.0, False, (700, 700)),
    (64, torch.bfloat16, False, (300, 0), 0.0, True, (1000, 900)),
    (96, torch.bfloat16, True, (-1, -1), 0.0, False, (1000, 1000)),
    (128, torch.bfloat16, True, (-1, -1), 30.0, False, (1000, 1000)),
])
def test_warpgroup_key_ranges(head_dim, dtype, causal, window, softcap, sink, seqlens):
    """Three warpgroups a tile, each computing only the key blocks its own
    rows see (FwdConfig.warpgroup_key_ranges), against the fp32 reference:
    causal rows that see no key (bottom-right, more queries than keys) and
    warpgroups whose whole walk is masked, windows cut on both sides and a
    window of one key, a cap (the bounded softmax) and a sink. The blocks a
    warpgroup passes hold no score its rows see, so the output and LSE are
    those of the kernel that computes them, up to fp32 rounding (an LSE
    ulp, as the compiled sums differ; the causal ones are bitwise equal)."""
    from cute_fa.kernels.config import Features
    from cute_fa.ops import forward_cuda

    seqlen_q, seqlen_k = seqlens
    q, k, v, _ = _inputs(2, seqlen_q, seqlen_k, 6, 2, head_dim, dtype, seed=head_dim)
    sinks = torch.randn(6, device="cuda") if sink else None
    features = Features(local=not causal, softcap=softcap > 0, sink=sink)
    config = _wide_tile(head_dim, causal, features)
    assert config.tile_m == 192
    runs = [forward_cuda(q, k, v, head_dim ** -0.5, causal,
                         config.replace(warpgroup_key_ranges=ranges), window_left=window[0],
                         window_right=window[1], softcap=softcap, learnable_sink=sinks)
            for ranges in (True, False)]
    (out, lse), (full_out, full_lse) = runs
    torch.testing.assert_close(lse, full_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out, full_out, rtol=2 ** -7, atol=1e-5)

    def reference(compute_dtype):
        return attention_reference(q, k, v, None, causal, compute_dtype=compute_dtype,
                                   window=window, softcap=softcap, sink=sinks)

    ref_out, ref_lse = reference(torch.float32)
    assert_lse_matches(lse, ref_lse)
    assert_within_low_precision([("out", out, ref_out, reference(None)[0])])
