"""The C++ host side of the CUDA op kernels (csrc/cute_fa_native.cpp) against
the Python one (ops.forward_cuda / backward_cuda): same launches, so the same
bits; the same named errors; torch's current stream honoured."""

import pytest
import torch

from cute_fa import ops
from cute_fa.reference import default_scale

pytestmark = pytest.mark.gpu

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, causal)
SHAPES = [
    (2, 1000, 1000, 4, 2, 128, torch.bfloat16, True),
    (1, 17, 33, 8, 1, 64, torch.bfloat16, False),
    (3, 300, 77, 6, 6, 96, torch.float16, True),
    (1, 512, 512, 8, 4, 128, torch.bfloat16, True),   # a KV grid under two waves: split_gqa
    (2, 1000, 1000, 4, 4, 128, torch.bfloat16, False),  # the backward's 80-row tile: padding
]


def _inputs(b, sq, sk, hq, hkv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def _native():
    assert ops._native is not None, "the C++ op kernels did not build on this GPU machine"
    return ops._native


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_native_matches_python_bitwise(shape, deterministic):
    native = _native()
    *dims, dtype, causal = shape
    q, k, v = _inputs(*dims, dtype)
    scale = default_scale(q.shape[-1])
    out, lse = native.fwd(q, k, v, None, causal)
    out_py, lse_py = ops.forward_cuda(q, k, v, scale, causal)
    assert torch.equal(out, out_py) and torch.equal(lse, lse_py)
    grad_out = torch.randn_like(out)
    grad_lse = torch.randn_like(lse)
    for glse in (None, grad_lse):
        grads = native.bwd(grad_out, q, k, v, out, lse, scale, causal, glse, deterministic)
        grads_py = ops.backward_cuda(grad_out, q, k, v, out, lse, scale, causal, glse,
                                     deterministic)
        if deterministic:  # otherwise dQ sums its partials in whatever order CTAs finish
            for g, g_py in zip(grads, grads_py):
                assert torch.equal(g, g_py)
        else:
            for g, g_py in zip(grads[1:], grads_py[1:]):
                assert torch.equal(g, g_py)
            torch.testing.assert_close(grads[0], grads_py[0], rtol=1e-2, atol=1e-2)


# (causal, window_left, window_right, softcap, sinks): a local kernel, a
# window that resolves to causal, a cap, sinks, and all of them at once
SCORES = [(False, 200, 64, 0.0, False), (False, -1, 0, 0.0, False), (True, -1, -1, 20.0, False),
          (False, -1, -1, 0.0, True), (True, 300, -1, 15.0, True)]


@pytest.mark.parametrize("scores", SCORES, ids=str)
def test_native_serves_windows_caps_and_sinks(scores):
    """The C++ path plans windows, caps and sinks itself (a new plan each, no
    fallback) and launches what the Python path does: the same bits."""
    native = _native()
    causal, left, right, softcap, with_sink = scores
    q, k, v = _inputs(2, 700, 900, 8, 2, 128, torch.bfloat16, seed=left + 7)
    sink = torch.randn(8, device="cuda") if with_sink else None
    scale = default_scale(128)
    before = native.cached_plans()
    out, lse = native.fwd(q, k, v, None, causal, False, left, right, softcap, sink)
    out_py, lse_py = ops.forward_cuda(q, k, v, scale, causal, window_left=left,
                                      window_right=right, softcap=softcap, learnable_sink=sink)
    assert native.cached_plans() == before + 1
    assert torch.equal(out, out_py) and torch.equal(lse, lse_py)
    grad_out = torch.randn_like(out)
    grads = native.bwd(grad_out, q, k, v, out, lse, scale, causal, None, True, left, right,
                       softcap, sink)
    grads_py = ops.backward_cuda(grad_out, q, k, v, out, lse, scale, causal, None, True,
                                 left, right, softcap, sink)
    assert native.cached_plans() == before + 2
    for g, g_py in zip(grads, grads_py):
        assert torch.equal(g, g_py)
    assert grads[3].shape == ((8,) if with_sink else (0,))


def test_native_serves_the_ops_and_the_public_function():
    native = _native()
    from cute_fa import flash_attn_func

    q, k, v = _inputs(2, 256, 256, 4, 2, 64, torch.bfloat16, seed=1)
    before = native.cached_plans()
    out_op, _ = torch.ops.cute_fa.fwd(q, k, v, 0.1, True)
    out_py, _ = ops.forward_cuda(q, k, v, 0.1, True)
    assert torch.equal(out_op, out_py)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = flash_attn_func(qg, kg, vg, softmax_scale=0.1, causal=True)
    assert torch.equal(out.detach(), out_py)
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (qg, kg, vg))
    assert native.cached_plans() > before


def test_padded_head_dims_take_the_python_kernel_from_cpp():
    # d=80 fails the C++ fast check, is valid, and comes back to ops._fwd_cuda /
    # _bwd_cuda, which pad to 96: the same bits as the Python path, and served
    # through the dispatcher as well.
    native = _native()
    q, k, v = _inputs(2, 300, 300, 4, 2, 80, torch.bfloat16, seed=6)
    out, lse = native.fwd(q, k, v, None, True)
    out_py, lse_py = ops.forward_cuda(q, k, v, default_scale(80), True)
    assert out.shape == q.shape and torch.equal(out, out_py) and torch.equal(lse, lse_py)
    assert torch.equal(torch.ops.cute_fa.fwd(q, k, v, None, True)[0], out)
    grad_out = torch.randn_like(out)
    grads = native.bwd(grad_out, q, k, v, out, lse, default_scale(80), True, None, True)
    grads_py = ops.backward_cuda(grad_out, q, k, v, out, lse, default_scale(80), True, None, True)
    for g, g_py, t in zip(grads, grads_py, (q, k, v)):
        assert g.shape == t.shape and g.is_contiguous() and torch.equal(g, g_py)


def test_the_plan_cache_is_bounded():
    # A server meets ever new sequence lengths: the C++ host layer keeps the
    # plans of the most recent problems only, and replans an evicted one.
    native = _native()
    capacity = native.plan_capacity()
    q0, k0, v0 = _inputs(1, 8, 8, 2, 2, 64, torch.bfloat16, seed=4)
    first = native.fwd(q0, k0, v0, None, False)[0]
    q, k, v = _inputs(1, 8, capacity + 40, 2, 2, 64, torch.bfloat16, seed=5)
    for seqlen_k in range(9, capacity + 40):  # a new problem each
        native.fwd(q, k[:, :seqlen_k], v[:, :seqlen_k], None, False)
        assert native.cached_plans() <= capacity
    assert native.cached_plans() == capacity
    assert torch.equal(native.fwd(q0, k0, v0, None, False)[0], first)


def test_native_copies_inputs_tma_cannot_read():
    # A q whose base is 2 bytes past a 16-byte boundary, and a packed q/k/v
    # whose head stride is fine: the first is copied, the second read in place.
    native = _native()
    q, k, v = _inputs(1, 128, 128, 2, 2, 64, torch.bfloat16, seed=2)
    flat = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
    q_odd = flat[1:].view(q.shape).copy_(q)
    assert q_odd.data_ptr() % 16 != 0
    assert torch.equal(native.fwd(q_odd, k, v, None, False)[0], native.fwd(q, k, v, None, False)[0])
    qkv = torch.cat([q, k, v], dim=2)
    out_packed = native.fwd(qkv[:, :, :2], qkv[:, :, 2:4], qkv[:, :, 4:], None, False)[0]
    assert torch.equal(out_packed, native.fwd(q, k, v, None, False)[0])


def test_native_runs_on_the_current_stream():
    native = _native()
    q, k, v = _inputs(2, 2048, 2048, 8, 8, 128, torch.bfloat16, seed=3)
    expected = native.fwd(q, k, v, None, True)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the side stream is busy: a launch on the
        out = native.fwd(q, k, v, None, True)[0]  # default stream would run first
        done = torch.cuda.Event()
        done.record(side)
    assert not done.query()  # the kernel is queued behind the sleep, on `side`
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("change, error, pattern", [
    (dict(k=lambda k: k.float()), TypeError, r"k: expected dtype"),
    (dict(q=lambda q: q[..., :36].contiguous()), ValueError, r"q: expected headdim"),
    (dict(q=lambda q: q[:, :, :3]), ValueError, r"k: expected nheads_kv to divide"),
    (dict(v=lambda v: v.transpose(-1, -2).contiguous().transpose(-1, -2)), ValueError,
     r"v: expected the last dimension"),
    (dict(window_left=-2), ValueError, r"window_left: expected -1"),
    (dict(softcap=-1.0), ValueError, r"softcap: expected a finite value >= 0"),
    (dict(learnable_sink=lambda: torch.zeros(3, device="cuda")), ValueError,
     r"learnable_sink: expected shape \(4,\)"),
])
def test_native_raises_the_named_errors(change, error, pattern):
    _native()
    args = dict(zip("qkv", _inputs(1, 64, 64, 4, 2, 64, torch.bfloat16)))
    scores = dict(window_left=-1, window_right=-1, softcap=0.0, learnable_sink=None)
    for name, fn in change.items():
        if name in scores:  # a value, or for a tensor its maker
            scores[name] = fn() if callable(fn) else fn
        else:
            args[name] = fn(args[name])
    with pytest.raises(error, match=pattern):
        torch.ops.cute_fa.fwd(args["q"], args["k"], args["v"], None, True, False,
                              **scores)
