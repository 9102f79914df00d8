"""Packed (varlen) batches on the H100: output, LSE and every gradient
against the fp32 reference of each sequence, with the bound the dense tests
use (2x PyTorch's own low-precision error on the same inputs), over ragged
batches: empty and one-token sequences, lengths that are no tile multiple,
seqused shorter than its segment, causal, windows, softcap, GQA."""

import itertools

import pytest
import torch

from cute_fa import flash_attn_varlen_func
from cute_fa.reference import varlen_attention_reference

from bounds import assert_lse_matches, assert_within_low_precision

pytestmark = pytest.mark.gpu


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


def _packed(lens_q, lens_k, heads, heads_kv, head_dim, seed, dtype=torch.bfloat16,
            head_dim_v=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    head_dim_v = head_dim_v or head_dim

    def randn(*shape):
        return torch.randn(shape, device="cuda", dtype=dtype, generator=gen)

    total_q, total_k = sum(lens_q), sum(lens_k)
    return (randn(total_q, heads, head_dim), randn(total_k, heads_kv, head_dim),
            randn(total_k, heads_kv, head_dim_v), randn(total_q, heads, head_dim_v))


def _run(fn, q, k, v, grad_out, backward):
    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    with torch.set_grad_enabled(backward):
        out, lse = fn(*leaves)
        if backward:
            (out.float() * grad_out.float()).sum().backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves] if backward else []


def _check(lens_q, lens_k, heads=4, heads_kv=2, head_dim=128, causal=False,
           window_size=(-1, -1), softcap=0.0, used=None, backward=True, deterministic=False,
           seed=0, head_dim_v=None):
    q, k, v, g = _packed(lens_q, lens_k, heads, heads_kv, head_dim, seed, head_dim_v=head_dim_v)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    used_q = used_k = None
    if used is not None:
        used_q = torch.tensor(used[0], dtype=torch.int32, device="cuda")
        used_k = torch.tensor(used[1], dtype=torch.int32, device="cuda")
    window = (window_size[0], 0 if causal else window_size[1])

    def ours(*t):
        return flash_attn_varlen_func(*t, cu_q, cu_k, seqused_q=used_q, seqused_k=used_k,
                                      causal=causal, window_size=window_size, softcap=softcap,
                                      deterministic=deterministic, return_lse=True)

    def reference(compute_dtype):
        return lambda *t: varlen_attention_reference(
            *t, cu_q, cu_k, None, causal, used_q, used_k, compute_dtype, window, softcap)

    out, lse, grads = _run(ours, q, k, v, g, backward)
    ref_out, ref_lse, ref_grads = _run(reference(torch.float32), q, k, v, g, backward)
    low_out, _, low_grads = _run(reference(None), q, k, v, g, backward)
    # rows outside every sequence (past seqused) are undefined in the output
    rows = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    starts = cu_q.tolist()
    for b, n in enumerate(used[0] if used is not None else [y - x for x, y in
                                                            zip(starts, starts[1:])]):
        rows[starts[b]:starts[b] + n] = True
    assert_lse_matches(lse[:, rows], ref_lse[:, rows])
    pairs = [("out", out[rows], ref_out[rows], low_out[rows])]
    pairs += list(zip(("dq", "dk", "dv"), grads, ref_grads, low_grads))
    assert_within_low_precision(pairs)
    return grads


RAGGED = [
    ([300, 0, 1, 513, 64, 1000], [300, 0, 1, 513, 64, 1000]),  # self-attention, 0 and 1
    ([17, 250, 129], [900, 3, 130]),                            # cross lengths
    ([1, 1, 1, 1], [700, 1, 0, 65]),                            # decode-like, a 0-key one
    ([2048], [2048]),
]


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", RAGGED)
def test_varlen_forward_backward(head_dim, causal, lens):
    _check(*lens, head_dim=head_dim, causal=causal, seed=head_dim + len(lens[0]))


@pytest.mark.parametrize("head_dims", [(192, 128), (128, 64)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_value_head_dim_below_that_of_q(head_dims, deterministic):
    _check(*RAGGED[0], head_dim=head_dims[0], head_dim_v=head_dims[1], causal=True,
           deterministic=deterministic, seed=head_dims[1])


@pytest.mark.parametrize("causal,window_size,softcap", [
    (False, (128, 0), 0.0), (True, (300, -1), 0.0), (False, (50, 77), 0.0),
    (False, (-1, -1), 30.0), (True, (200, -1), 20.0), (True, (-1, -1), 30.0)])
@pytest.mark.parametrize("head_dim", [64, 128])  # 64: a cap's exponentials partly polynomials
def test_varlen_window_softcap(causal, window_size, softcap, head_dim):
    _check(*RAGGED[0], head_dim=head_dim, causal=causal, window_size=window_size,
           softcap=softcap, seed=7)


def test_varlen_wide_window():
    """A window of 2048 keys or more at head dim 64 (the 192-row forward tile)."""
    lens = [3000, 517, 2500]
    _check(lens, lens, head_dim=64, causal=True, window_size=(2100, -1), seed=21)


@pytest.mark.parametrize("heads,heads_kv", [(8, 1), (6, 6)])
def test_varlen_gqa(heads, heads_kv):
    _check(*RAGGED[1], heads=heads, heads_kv=heads_kv, causal=True, seed=heads)


def test_varlen_seqused():
    lens = [300, 200, 513]
    _check(lens, lens, used=([250, 0, 400], [300, 17, 129]), causal=True, seed=3)


def test_rows_outside_every_sequence_get_zero_gradients():
    """Rows before a sequence's start, past its seqused and past
    cu_seqlens[-1] take no part: their gradients are exactly 0, also where
    the allocator hands the gradients memory full of NaN (the gradients are
    not zeroed whole; a kernel writes the gaps)."""
    lens = [300, 200, 513]
    used = ([250, 0, 400], [300, 17, 129])
    q, k, v, g = _packed(lens + [77], lens + [45], 4, 2, 128, seed=13)  # rows past the last
    cu_q, cu_k = _cu(lens), _cu(lens)
    used_q, used_k = (torch.tensor(u, dtype=torch.int32, device="cuda") for u in used)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_seqlen_q=513, max_seqlen_k=513,
                                 seqused_q=used_q, seqused_k=used_k, causal=True)
    # freed NaN blocks of the gradients' sizes, for the backward to reuse
    dirty = [torch.full_like(t, float("nan")) for t in leaves for _ in range(4)]
    del dirty
    (out.float() * g.float()).sum().backward()
    for t, cu, u in zip(leaves, (cu_q, cu_k, cu_k), (used[0], used[1], used[1])):
        inside = torch.zeros(t.shape[0], dtype=torch.bool, device="cuda")
        for start, n in zip(cu.tolist(), u):
            inside[start:start + n] = True
        assert torch.isfinite(t.grad).all()
        assert (t.grad[~inside] == 0).all() and (~inside).sum() > 0
        assert t.grad[inside].abs().amax() > 0


def test_varlen_head_dim_v_forward():
    q, k, v, _ = _packed([100, 300], [100, 300], 4, 4, 192, seed=5)
    out = flash_attn_varlen_func(q, k, v[..., :128].contiguous(), _cu([100, 300]),
                                 _cu([100, 300]), causal=True)
    ref, _ = varlen_attention_reference(q, k, v[..., :128], _cu([100, 300]), _cu([100, 300]),
                                        None, True)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


def test_varlen_deterministic():
    first = _check(*RAGGED[0], causal=True, deterministic=True, seed=11)
    second = _check(*RAGGED[0], causal=True, deterministic=True, seed=11)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_varlen_empty():
    q, k, v, _ = _packed([0, 0], [5, 0], 2, 2, 64, seed=1)
    out, lse = flash_attn_varlen_func(q, k, v, _cu([0, 0]), _cu([5, 0]), return_lse=True)
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)
    q, k, v, _ = _packed([3, 4], [0, 0], 2, 2, 64, seed=2)
    out, lse = flash_attn_varlen_func(q, k, v, _cu([3, 4]), _cu([0, 0]), return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())


def test_varlen_long_tail_mix():
    """Lengths log-uniform over 64..8k packed into 16k tokens: the scheduler's
    scan over many sequences."""
    gen = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < 16384:
        lengths.append(int(torch.exp(torch.empty(1).uniform_(4.16, 9.0, generator=gen))))
    _check(lengths, lengths, heads=2, heads_kv=2, causal=True, seed=13)


def test_varlen_many_sequences():
    """More sequences than a warp scans at once (32), some empty."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 200, (70,), generator=gen).tolist()
    _check(lengths, lengths, heads=2, heads_kv=1, causal=False, seed=17)
