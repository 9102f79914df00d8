"""Packed (varlen) batches on the CPU: argument checks, the reference, the
ops' CPU and fake kernels (opcheck, torch.compile), empty sequences."""

import itertools

import pytest
import torch

from cute_fa import flash_attn_func, flash_attn_varlen_func
from cute_fa.scores import resolve


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _packed(lens_q, lens_k, heads=4, heads_kv=2, head_dim=32, grad=False):
    gen = torch.Generator().manual_seed(sum(lens_q) + 7 * sum(lens_k))

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.bfloat16).requires_grad_(grad)

    return (randn(sum(lens_q), heads, head_dim), randn(sum(lens_k), heads_kv, head_dim),
            randn(sum(lens_k), heads_kv, head_dim))


@pytest.mark.parametrize("causal,window_size,softcap", [
    (False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (3, 2), 0.0), (True, (-1, -1), 5.0)])
def test_packed_equals_each_sequence_alone(causal, window_size, softcap):
    """Each sequence attends on its own, masks aligned to its own lengths:
    the packed call equals flash_attn_func on every sequence, output, LSE and
    gradients."""
    lens_q, lens_k = [5, 0, 9, 1], [7, 3, 9, 4]
    q, k, v = _packed(lens_q, lens_k, grad=True)
    out, lse = flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), causal=causal,
                                      window_size=window_size, softcap=softcap, return_lse=True)
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for (a, b), (c, d) in zip(itertools.pairwise(_cu(lens_q).tolist()),
                              itertools.pairwise(_cu(lens_k).tolist())):
        if a == b:
            continue
        parts = [t.detach()[None, rows].requires_grad_() for t, rows in
                 ((q, slice(a, b)), (k, slice(c, d)), (v, slice(c, d)))]
        o, l = flash_attn_func(*parts, causal=causal, window_size=window_size, softcap=softcap,
                               return_lse=True)
        o.float().square().sum().backward()
        assert torch.equal(o[0], out[a:b]) and torch.equal(l[0], lse[:, a:b])
        for part, grad, rows in zip(parts, grads, (slice(a, b), slice(c, d), slice(c, d))):
            assert torch.allclose(part.grad[0].float(), grad[rows].float(), atol=1e-2)


def test_empty_sequences_and_batches():
    q, k, v = _packed([3, 2], [0, 4])
    out, lse = flash_attn_varlen_func(q, k, v, _cu([3, 2]), _cu([0, 4]), return_lse=True)
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))  # no keys: output 0, LSE -inf
    assert bool((lse[:, :3] == float("-inf")).all()) and bool(torch.isfinite(lse[:, 3:]).all())
    q, k, v = _packed([], [])
    out, lse = flash_attn_varlen_func(q, k, v, _cu([]), _cu([]), return_lse=True)
    assert out.shape == (0, 4, 32) and lse.shape == (4, 0)


def test_seqused_leaves_the_rest_out():
    q, k, v = _packed([6, 5], [6, 5], grad=True)
    used = torch.tensor([4, 5], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, _cu([6, 5]), _cu([6, 5]), seqused_q=used,
                                 seqused_k=used, causal=True)
    alone = flash_attn_func(q[None, :4], k[None, :4], v[None, :4], causal=True)
    assert torch.equal(out[:4], alone[0])
    out[:4].float().sum().backward()
    assert torch.equal(k.grad[4:6], torch.zeros_like(k.grad[4:6]))


def _bad(match, **changes):
    q, k, v = _packed([3, 2], [3, 2])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=_cu([3, 2]), cu_seqlens_k=_cu([3, 2]))
    args.update(changes)
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attn_varlen_func(**args)


def test_bad_arguments_name_themselves():
    q, k, v = _packed([3, 2], [3, 2])
    _bad("cu_seqlens_q: expected a contiguous 1-D torch.int32", cu_seqlens_q=_cu([3, 2]).long())
    _bad("cu_seqlens_k: expected batch \\+ 1 = 3", cu_seqlens_k=_cu([5]))
    _bad("cu_seqlens_q: expected cumulative lengths", cu_seqlens_q=torch.tensor(
        [0, 4, 3], dtype=torch.int32))
    _bad("cu_seqlens_k: expected cumulative lengths", cu_seqlens_k=torch.tensor(
        [0, 3, 9], dtype=torch.int32))
    _bad("seqused_q: expected batch = 2 entries", seqused_q=torch.tensor([1], dtype=torch.int32))
    _bad("seqused_k: expected each in", seqused_k=torch.tensor([4, 1], dtype=torch.int32))
    _bad("q: expected a 3-D packed tensor", q=q[None])
    _bad("k: expected nheads_kv to divide", k=k[:, :1].expand(-1, 3, -1),
         v=v[:, :1].expand(-1, 3, -1))
    _bad("max_seqlen_q: expected an int >= 0", max_seqlen_q=-1, max_seqlen_k=3)
    _bad(r"max_seqlen_q: expected at least the longest sequence \(3\), got 2", max_seqlen_q=2,
         max_seqlen_k=3)
    _bad(r"max_seqlen_q: expected at least the longest sequence \(3\), got 0", max_seqlen_q=0,
         max_seqlen_k=3)
    _bad(r"max_seqlen_k: expected at least the longest sequence \(3\), got 1", max_seqlen_k=1)
    _bad("cu_seqlens_q: expected batch \\+ 1 >= 1 entries", cu_seqlens_q=_cu([])[:0],
         cu_seqlens_k=_cu([])[:0])
    _bad("v: expected headdim a multiple of 8 no larger than that of q", v=v[..., :12])
    _bad("softmax_scale: expected a finite positive float", softmax_scale=float("inf"))
    _bad("window_size\\[0\\]", window_size=(-2, 0))
    _bad("softcap", softcap=-1.0)


def test_opcheck_and_compile():
    q, k, v = _packed([3, 0, 4], [2, 5, 4])
    cu_q, cu_k = _cu([3, 0, 4]), _cu([2, 5, 4])
    torch.library.opcheck(torch.ops.cute_fa.varlen_fwd.default,
                          (q, k, v, cu_q, cu_k, 4, 5), {"causal": True})
    out, lse = torch.ops.cute_fa.varlen_fwd(q, k, v, cu_q, cu_k, 4, 5, causal=True)
    torch.library.opcheck(torch.ops.cute_fa.varlen_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, 4, 5, None, None,
                           0.2, True))

    @torch.compile(fullgraph=True, backend="eager")
    def f(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True)

    assert torch.equal(f(q, k, v), out)


def test_resolve_marks_varlen():
    assert resolve(True, -1, -1, 0.0, 100, 100, varlen=True).features.varlen
    assert resolve(False, 10, 0, 2.0, 100, 100, varlen=True).features.varlen
    assert not resolve(False, -1, -1, 0.0, 100, 100).features.varlen
