"""Learnable sinks on the H100: forward, every gradient and d(sink) against
the fp32 reference with the bound the dense tests use (2x PyTorch's own
low-precision error on the same inputs), alone and with causal masks,
windows, soft caps, GQA, split tails and packed batches."""

import pytest
import torch

from cute_fa import flash_attn_func, flash_attn_varlen_func
from cute_fa.reference import attention_reference, varlen_attention_reference

from bounds import assert_lse_matches, assert_within_low_precision

pytestmark = pytest.mark.gpu


def _inputs(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, seed, sink_scale=2.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, device="cuda", dtype=dtype, generator=gen)

    return (randn(batch, seqlen_q, heads, head_dim), randn(batch, seqlen_k, heads_kv, head_dim),
            randn(batch, seqlen_k, heads_kv, head_dim), randn(batch, seqlen_q, heads, head_dim),
            randn(heads, dtype=torch.float32) * sink_scale)


def _run(fn, tensors, grad_out, through_lse=False):
    """Outputs and gradients of Σ out·grad_out (+ Σ LSE·½ with through_lse:
    then the LSE's gradient reaches the backward too)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse = fn(*leaves)
    loss = (out.float() * grad_out.float()).sum()
    if through_lse:
        loss = loss + 0.5 * torch.where(torch.isfinite(lse), lse, 0).sum()
    loss.backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def _assert_within(pairs, lse, ref_lse):
    assert_lse_matches(lse, ref_lse)
    assert_within_low_precision(pairs)


def _check(q, k, v, grad_out, sink, causal=False, window_size=(-1, -1), softcap=0.0,
           deterministic=False, through_lse=False):
    window = (window_size[0], 0 if causal else window_size[1])

    def ours(q, k, v, sink):
        return flash_attn_func(q, k, v, causal=causal, window_size=window_size,
                               softcap=softcap, learnable_sink=sink, return_lse=True,
                               deterministic=deterministic)

    def reference(compute_dtype):
        return lambda q, k, v, sink: attention_reference(
            q, k, v, None, causal, compute_dtype=compute_dtype, window=window,
            softcap=softcap, sink=sink)

    out, lse, grads = _run(ours, (q, k, v, sink), grad_out, through_lse)
    ref_out, ref_lse, ref_grads = _run(reference(torch.float32), (q, k, v, sink), grad_out,
                                       through_lse)
    low_out, _, low_grads = _run(reference(None), (q, k, v, sink), grad_out, through_lse)
    _assert_within([("out", out, ref_out, low_out)]
                   + list(zip(("dq", "dk", "dv", "dsink"), grads, ref_grads, low_grads)),
                   lse, ref_lse)
    return grads


@pytest.mark.parametrize("causal", [False, True])
def test_sink_gradient_through_the_lse(causal):
    tensors = _inputs(2, 777, 300, 4, 2, 128, seed=21)
    _check(*tensors, causal=causal, through_lse=True)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(1000, 1000), (300, 777), (777, 300), (1, 513)])
def test_sink_forward_backward(head_dim, causal, seqlens):
    tensors = _inputs(2, *seqlens, 4, 2, head_dim, seed=seqlens[0] + head_dim + causal)
    _check(*tensors, causal=causal)


@pytest.mark.parametrize("causal,window_size,softcap", [
    (False, (256, 0), 0.0), (False, (100, 37), 0.0), (True, (-1, -1), 30.0),
    (False, (300, 300), 20.0)])
@pytest.mark.parametrize("head_dim", [64, 128])  # 64: a cap's exponentials partly polynomials
def test_sink_with_windows_and_caps(causal, window_size, softcap, head_dim):
    tensors = _inputs(2, 1000, 1000, 4, 1, head_dim, seed=window_size[0] + int(softcap))
    _check(*tensors, causal=causal, window_size=window_size, softcap=softcap)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sink_in_a_split_tail(head_dim):
    """16 heads of 4k non-causal leave a last round of tiles that the plan
    splits into key ranges: the sink is added once, by the merge."""
    tensors = _inputs(1, 4096, 4096, 17, 17, head_dim, seed=head_dim)
    _check(*tensors)


def test_sinks_far_above_and_below_every_score():
    """exp(sink) is added against the larger of the row's maximum and the
    sink: a sink 80 above the scores does not overflow."""
    q, k, v, g, _ = _inputs(1, 300, 300, 4, 4, 64, seed=5)
    sink = torch.tensor([80.0, -80.0, 0.0, 5.0], device="cuda")
    _check(q, k, v, g, sink, causal=True)


def test_sink_gradient_is_deterministic():
    tensors = _inputs(2, 2048, 2048, 8, 2, 128, seed=11)
    first = _check(*tensors, causal=True, deterministic=True)
    second = _check(*tensors, causal=True, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_varlen_sinks():
    gen = torch.Generator(device="cuda").manual_seed(3)
    lengths_q, lengths_k = [300, 0, 129, 1, 64, 517], [300, 40, 0, 77, 64, 600]
    cu_q = torch.tensor([0] + lengths_q, device="cuda").cumsum(0).int()
    cu_k = torch.tensor([0] + lengths_k, device="cuda").cumsum(0).int()
    q = torch.randn(sum(lengths_q), 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(sum(lengths_k), 2, 128, device="cuda", dtype=torch.bfloat16,
                        generator=gen) for _ in range(2))
    grad_out = torch.randn_like(q)
    sink = torch.randn(4, device="cuda", generator=gen) * 2

    def ours(q, k, v, sink):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, learnable_sink=sink,
                                      return_lse=True)

    def reference(compute_dtype):
        return lambda q, k, v, sink: varlen_attention_reference(
            q, k, v, cu_q, cu_k, None, True, compute_dtype=compute_dtype, sink=sink)

    out, lse, grads = _run(ours, (q, k, v, sink), grad_out)
    ref_out, ref_lse, ref_grads = _run(reference(torch.float32), (q, k, v, sink), grad_out)
    low_out, _, low_grads = _run(reference(None), (q, k, v, sink), grad_out)
    _assert_within([("out", out, ref_out, low_out)]
                   + list(zip(("dq", "dk", "dv", "dsink"), grads, ref_grads, low_grads)),
                   lse, ref_lse)
    # the sequence with no keys: output 0, LSE the sink
    rows = slice(300, 429)
    assert torch.equal(out[rows], torch.zeros_like(out[rows]))
    torch.testing.assert_close(lse[:, rows], sink[:, None].expand(4, 129))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("with_sink", [False, True])
def test_nan_inputs_reach_their_rows_as_on_the_cpu(head_dim, with_sink):
    """A NaN in q spoils its row, a NaN sink its head, every row of it:
    NaN in O and LSE where the CPU path has them, never a silent 0 or -inf."""
    q, k, v, _, sink = _inputs(1, 300, 300, 4, 2, head_dim, seed=5)
    q[0, 17, 1, 3] = float("nan")
    sink[2] = float("nan")
    sink = sink if with_sink else None
    out, lse = flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_lse=True)
    ref, ref_lse = attention_reference(q.cpu(), k.cpu(), v.cpu(), None, True,
                                       sink=None if sink is None else sink.cpu())
    assert torch.equal(out.isnan().cpu(), ref.isnan()) and ref.isnan().any()
    assert torch.equal(lse.isnan().cpu(), ref_lse.isnan())
