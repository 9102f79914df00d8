"""Learnable attention sinks (gpt-oss) on the CPU: the reference against an
independent definition (the sink as an appended logit column, dropped after
the softmax, differentiated by autograd), the ops' CPU and fake kernels,
opcheck, torch.compile, and the errors of bad sinks."""

import pytest
import torch

from cute_fa import flash_attn_func, flash_attn_varlen_func
from cute_fa.reference import attention_backward_reference, attention_reference


def _appended_column(q, k, v, sink, scale, causal):
    """Attention with the sink as one more logit column of no value, as
    gpt-oss's eager attention writes it (GQA by repetition)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        hidden = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
        logits = logits.masked_fill(hidden, float("-inf"))
    column = sink.view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
    combined = torch.cat([logits, column], dim=-1)
    lse = torch.logsumexp(combined, dim=-1)
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def _problem(seed, batch=2, seqlen_q=37, seqlen_k=53, heads=4, heads_kv=2, head_dim=16,
             dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=gen, dtype=dtype)
    sink = torch.randn(heads, generator=gen, dtype=dtype) * 2
    return q, k, v, sink


@pytest.mark.parametrize("causal", [False, True])
def test_reference_is_the_appended_column(causal):
    q, k, v, sink = _problem(0, seqlen_q=53, seqlen_k=37)  # causal: early rows see no key
    scale = 0.3
    out, lse = attention_reference(q, k, v, scale, causal, compute_dtype=None, sink=sink)
    expected_out, expected_lse = _appended_column(q, k, v, sink, scale, causal)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)
    if causal:  # rows that see no key: O = 0, LSE = the sink
        assert torch.equal(out[:, :16], torch.zeros_like(out[:, :16]))
        torch.testing.assert_close(lse[:, :, :16], sink.view(1, -1, 1).expand(2, -1, 16))


@pytest.mark.parametrize("causal", [False, True])
def test_reference_backward_is_autograd_of_the_appended_column(causal):
    q, k, v, sink = _problem(1, seqlen_q=53, seqlen_k=37)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out, lse = _appended_column(*leaves, 0.3, causal)
    gen = torch.Generator().manual_seed(7)
    grad_out = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    grad_lse = torch.randn(lse.shape, generator=gen, dtype=lse.dtype)
    ((out * grad_out).sum() + (lse * grad_lse).sum()).backward()
    grads = attention_backward_reference(grad_out, q, k, v, out.detach(), lse.detach(), 0.3,
                                         causal, grad_lse, compute_dtype=None, sink=sink)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad)


def _op_problem(seed, **kwargs):
    """bf16 q, k, v (the ops' dtypes) and fp32 sinks."""
    q, k, v, sink = _problem(seed, **kwargs)
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), sink.float()


def _close(got, want):
    """bf16 outputs and gradients of fp32 math."""
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_the_op_differentiates_the_sink():
    q, k, v, sink = _op_problem(2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out, lse = flash_attn_func(*leaves[:3], causal=True, learnable_sink=leaves[3],
                               return_lse=True)
    (out.float().square().sum() + lse.sum()).backward()
    ref = [t.float().requires_grad_() for t in (q, k, v, sink)]
    ref_out, ref_lse = _appended_column(*ref, q.shape[-1] ** -0.5, True)
    (ref_out.square().sum() + ref_lse.sum()).backward()
    _close(out, ref_out)
    _close(lse, ref_lse)
    for got, want in zip(leaves, ref):
        _close(got.grad, want.grad)


def test_a_bf16_sink_gets_a_bf16_gradient():
    q, k, v, sink = _op_problem(3)
    sink = sink.bfloat16().requires_grad_()
    flash_attn_func(q, k, v, learnable_sink=sink).float().sum().backward()
    assert sink.grad.dtype == torch.bfloat16 and sink.grad.shape == (4,)


def test_opcheck_with_sinks():
    q, k, v, sink = _op_problem(4)
    args = (q, k, v, None, True, False, -1, -1, 0.0, sink)
    torch.library.opcheck(torch.ops.cute_fa.fwd.default, args)
    out, lse = torch.ops.cute_fa.fwd(*args)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(torch.ops.cute_fa.bwd.default,
                          (grad_out, q, k, v, out, lse, 0.25, True, None, False, -1, -1, 0.0,
                           sink))
    _, _, _, no_sink = torch.ops.cute_fa.bwd(grad_out, q, k, v, out, lse, 0.25, True)
    assert no_sink.shape == (0,)


def test_compiled_fullgraph_with_sinks():
    q, k, v, sink = _op_problem(5)
    sink.requires_grad_()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, v, sink):
        return flash_attn_func(q, k, v, causal=True, learnable_sink=sink).sum()

    step(q, k, v, sink).backward()
    expected = sink.detach().clone().requires_grad_()
    flash_attn_func(q, k, v, causal=True, learnable_sink=expected).sum().backward()
    torch.testing.assert_close(sink.grad, expected.grad)


def test_varlen_sinks_match_each_sequence_on_its_own():
    gen = torch.Generator().manual_seed(6)
    lengths_q, lengths_k = [5, 0, 9, 3], [7, 4, 0, 11]
    cu_q = torch.tensor([0, 5, 5, 14, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 11, 11, 22], dtype=torch.int32)
    q = torch.randn(17, 4, 16, generator=gen).bfloat16()
    k = torch.randn(22, 2, 16, generator=gen).bfloat16()
    v = torch.randn(22, 2, 16, generator=gen).bfloat16()
    sink = torch.randn(4, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out, lse = flash_attn_varlen_func(*leaves[:3], cu_q, cu_k, causal=True,
                                      learnable_sink=leaves[3], return_lse=True)
    (out.float().square().sum() + lse.sum()).backward()
    ref = [t.float().requires_grad_() for t in (q, k, v, sink)]
    total = 0
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        if n_q == 0:
            continue
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = _appended_column(ref[0][None, rows], ref[1][None, keys], ref[2][None, keys],
                                ref[3], 0.25, True)
        _close(out[rows], o[0].detach())
        _close(lse[:, rows], l[0].detach())
        total = total + o.square().sum() + l.sum()
    total.backward()
    for got, want in zip(leaves, ref):
        _close(got.grad, want.grad)
    # a sequence with no keys: output 0 and the sink as its LSE
    rows = slice(5, 14)
    assert torch.equal(out[rows], torch.zeros_like(out[rows]))
    torch.testing.assert_close(lse[:, rows], sink[:, None].expand(4, 9))


@pytest.mark.parametrize("sink,message", [
    (torch.zeros(3), r"learnable_sink: expected shape \(4,\)"),
    (torch.zeros(4, dtype=torch.int32), "dtype float32, bfloat16 or float16"),
    (torch.zeros(1, 4), r"got shape \(1, 4\)"),
    ([0.0] * 4, "learnable_sink: expected a torch.Tensor or None, got list")])
def test_bad_sinks_are_clear_errors(sink, message):
    q, k, v, _ = _op_problem(8)
    with pytest.raises((TypeError, ValueError), match=message):
        flash_attn_func(q, k, v, learnable_sink=sink)
    cu = torch.tensor([0, 37], dtype=torch.int32)
    with pytest.raises((TypeError, ValueError), match=message):
        flash_attn_varlen_func(q[0], k[0, :37], v[0, :37], cu, cu, learnable_sink=sink)


@pytest.mark.parametrize("shape", [(0, 5, 7), (2, 0, 7), (2, 5, 0)])
@pytest.mark.parametrize("with_sink", [False, True])
def test_empty_dense_problems(shape, with_sink):
    """No batch, no queries or no keys: no error, no NaN; rows with no key
    give 0 and LSE -inf (or the sink), and every gradient is defined."""
    batch, seqlen_q, seqlen_k = shape
    q = torch.randn(batch, seqlen_q, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, seqlen_k, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, seqlen_k, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    sink = torch.randn(4, requires_grad=True) if with_sink else None
    out, lse = flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_lse=True)
    assert out.shape == (batch, seqlen_q, 4, 16) and lse.shape == (batch, 4, seqlen_q)
    assert torch.equal(out, torch.zeros_like(out))
    expected = sink.detach()[None, :, None] if with_sink else torch.tensor(float("-inf"))
    assert torch.equal(lse, expected.expand_as(lse))
    (out.float().sum() + lse.sum()).backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and not t.grad.abs().sum()
    if with_sink:  # the rows' weight is all the sink's: d(sink) sums dLSE
        assert torch.equal(sink.grad, torch.full((4,), float(batch * seqlen_q)))
    args = (q.detach(), k.detach(), v.detach(), None, True, False, -1, -1, 0.0, sink)
    torch.library.opcheck(torch.ops.cute_fa.fwd.default, args)
    # the CUDA kernels' host code answers these without a kernel (or a GPU)
    from cute_fa import ops
    sink_in = None if sink is None else sink.detach()
    cuda_out, cuda_lse = ops.forward_cuda(q.detach(), k.detach(), v.detach(), 0.25, True,
                                          learnable_sink=sink_in)
    assert torch.equal(cuda_out, out) and torch.equal(cuda_lse, lse)
    grads = ops.backward_cuda(torch.ones_like(out), q.detach(), k.detach(), v.detach(), out,
                              lse, 0.25, True, torch.ones_like(lse), learnable_sink=sink_in)
    for got, t in zip(grads, (q, k, v)):
        assert torch.equal(got, t.grad)
    if with_sink:
        assert torch.equal(grads[3], sink.grad)
