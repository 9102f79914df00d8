"""Gradients of the op on the CPU: the closed-form backward the kernel will
implement, checked against autograd of the reference math, and the autograd
registration checked by opcheck and torch.compile."""

import pytest
import torch

from cute_fa import flash_attn_func
from cute_fa.reference import attention_backward_reference, attention_reference


def _leaf(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype).requires_grad_(True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens, heads, heads_kv", [((7, 7), 4, 4), ((9, 5), 4, 2),
                                                     ((3, 11), 8, 1), ((12, 4), 2, 2)])
def test_closed_form_backward_matches_autograd(causal, seqlens, heads, heads_kv):
    torch.manual_seed(sum(seqlens) + heads)
    sq, sk = seqlens
    q, k, v = _leaf(2, sq, heads, 16), _leaf(2, sk, heads_kv, 16), _leaf(2, sk, heads_kv, 16)
    out, lse = attention_reference(q, k, v, 0.3, causal, compute_dtype=torch.float64)
    grad_out = torch.randn_like(out)
    grad_lse = torch.randn_like(lse).masked_fill(~torch.isfinite(lse), 0.0)
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    (out * grad_out).sum().add((finite_lse * grad_lse).sum()).backward()
    grads = attention_backward_reference(grad_out, q.detach(), k.detach(), v.detach(),
                                         out.detach(), lse.detach(), 0.3, causal, grad_lse,
                                         compute_dtype=torch.float64)
    for mine, ref in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_trains_on_cpu(causal):
    torch.manual_seed(0)
    q, k, v = _leaf(2, 13, 4, 64, dtype=torch.bfloat16), _leaf(2, 9, 2, 64, dtype=torch.bfloat16), \
        _leaf(2, 9, 2, 64, dtype=torch.bfloat16)
    flash_attn_func(q, k, v, causal=causal).float().square().sum().backward()
    q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, _ = attention_reference(q2, k2, v2, None, causal, compute_dtype=torch.float64)
    out.square().sum().backward()
    for mine, ref in zip((q.grad, k.grad, v.grad), (q2.grad, k2.grad, v2.grad)):
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine.double(), ref, rtol=0.05, atol=0.05)


def test_opcheck_with_autograd():
    q = torch.randn(1, 6, 2, 64, dtype=torch.float16, requires_grad=True)
    k = torch.randn(1, 5, 1, 64, dtype=torch.float16, requires_grad=True)
    v = torch.randn(1, 5, 1, 64, dtype=torch.float16, requires_grad=True)
    for causal in (False, True):
        torch.library.opcheck(torch.ops.cute_fa.fwd.default, (q, k, v, None, causal))
    out, lse = torch.ops.cute_fa.fwd(q, k, v, None, False)
    torch.library.opcheck(torch.ops.cute_fa.bwd.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(),
                           out.detach(), lse.detach(), 0.125, False, None))


def test_torch_compile_fullgraph_training_step_on_cpu():
    torch.manual_seed(0)
    proj = torch.nn.Linear(128, 384, dtype=torch.float32)

    def step(x):
        b, s, _ = x.shape
        q, k, v = proj(x).to(torch.bfloat16).view(b, s, 3, 2, 64).unbind(2)
        return flash_attn_func(q, k, v, causal=True).float().square().mean()

    x = torch.randn(2, 16, 128)
    step(x).backward()
    eager = proj.weight.grad.clone()
    proj.weight.grad = None
    torch.compile(step, fullgraph=True, backend="aot_eager")(x).backward()
    torch.testing.assert_close(proj.weight.grad, eager)


def test_head_dims_padded_on_cuda_run_on_cpu_too():
    # any multiple of 8 up to 128: the CPU kernel is the reference math itself
    q = torch.randn(1, 6, 2, 40, dtype=torch.float16, requires_grad=True)
    k = torch.randn(1, 5, 1, 40, dtype=torch.float16, requires_grad=True)
    v = torch.randn(1, 5, 1, 40, dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(torch.ops.cute_fa.fwd.default, (q, k, v, None, True))
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == q.shape
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
