"""Windows and soft caps on the host: argument checks, the variant a call
resolves to, the reference's mask, the CPU op, opcheck and torch.compile."""

import pytest
import torch

from cute_fa import flash_attn_func
from cute_fa.kernels.config import Features
from cute_fa.reference import attention_backward_reference, attention_reference, visible_mask
from cute_fa.scores import check_score_args, resolve


def _qkv(seqlen_q=33, seqlen_k=47, heads=4, heads_kv=2, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, h, head_dim, generator=gen, dtype=torch.bfloat16)
            for s, h in ((seqlen_q, heads), (seqlen_k, heads_kv), (seqlen_k, heads_kv))]


@pytest.mark.parametrize("kwargs,error,names", [
    (dict(window_size=(-2, 0)), ValueError, "window_size[0]"),
    (dict(window_size=(0, 1.5)), ValueError, "window_size[1]"),
    (dict(window_size=5), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap="1"), TypeError, "softcap"),
])
def test_bad_arguments_name_themselves(kwargs, error, names):
    with pytest.raises(error, match=f"^{names.replace('[', '.').replace(']', '.')}"):
        flash_attn_func(*_qkv(), **kwargs)


def test_op_checks_its_score_arguments():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="^window_left"):
        torch.ops.cute_fa.fwd(q, k, v, None, False, False, -3, 0, 0.0)
    with pytest.raises(ValueError, match="^softcap"):
        check_score_args(-1, -1, -0.5)


@pytest.mark.parametrize("causal,left,right,seqlens,expected", [
    (False, -1, -1, (100, 100), (False, Features(), (-1, -1))),
    (True, -1, -1, (100, 100), (True, Features(), (-1, -1))),
    (False, -1, 0, (100, 100), (True, Features(), (-1, -1))),       # a causal window
    (True, 40, 7, (100, 100), (False, Features(local=True), (40, 0))),
    (False, 99, 99, (100, 100), (False, Features(), (-1, -1))),     # reaches every key
    (False, 98, -1, (100, 100), (False, Features(local=True), (98, -1))),
    (True, 200, 3, (10, 300), (False, Features(local=True), (200, 0))),
    (True, -1, -1, (1, 300), (True, Features(), (-1, -1))),
])
def test_resolve_picks_the_smallest_variant(causal, left, right, seqlens, expected):
    got = resolve(causal, left, right, 0.0, *seqlens)
    assert (got.causal, got.features, got.window) == expected
    assert resolve(causal, left, right, 2.0, *seqlens).features.softcap


@pytest.mark.parametrize("seqlens", [(5, 5), (3, 8), (8, 3)])
@pytest.mark.parametrize("window", [(-1, 0), (2, 0), (1, 1), (0, -1), (3, 2)])
def test_visible_mask_is_the_window_definition(seqlens, window):
    seqlen_q, seqlen_k = seqlens
    mask = visible_mask(seqlen_q, seqlen_k, window)
    for i in range(seqlen_q):
        for j in range(seqlen_k):
            diag = i + seqlen_k - seqlen_q
            inside = ((window[1] < 0 or j <= diag + window[1])
                      and (window[0] < 0 or j >= diag - window[0]))
            assert mask[i, j].item() == inside, (i, j)


@pytest.mark.parametrize("causal,window_size,softcap", [
    (False, (5, 3), 0.0), (True, (9, -1), 0.0), (False, (-1, -1), 2.5), (True, (4, 7), 1.5)])
def test_cpu_op_matches_autograd_of_the_reference(causal, window_size, softcap):
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = flash_attn_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap)
    (out.float() ** 2).sum().backward()
    window = (window_size[0], 0 if causal else window_size[1])
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(*leaves, None, causal, compute_dtype=None, window=window,
                                 softcap=softcap)
    (ref ** 2).sum().backward()
    assert (out.double() - ref).abs().max().item() < 2e-2
    for ours, leaf in zip((q, k, v), leaves):
        assert (ours.grad.double() - leaf.grad).abs().max().item() < 5e-2


def test_softcap_bends_scores_and_window_hides_keys():
    q, k, v = _qkv(seqlen_q=16, seqlen_k=16)
    plain, _ = attention_reference(q, k, v)
    capped, _ = attention_reference(q, k, v, softcap=0.1)
    assert not torch.allclose(plain, capped)
    # a window of one key per query returns that key's value
    out, _ = attention_reference(q, k, v, window=(0, 0))
    assert torch.allclose(out.float(), v.repeat_interleave(2, dim=2).float(), atol=1e-2)
    grads = attention_backward_reference(torch.ones_like(out), q, k, v, out, _, 0.125, False,
                                         window=(0, 0))
    assert grads[0].abs().max().item() == 0  # one visible key: the scores get no gradient


def test_opcheck_with_window_and_softcap():
    q, k, v = (t.half() for t in _qkv(seqlen_q=17, seqlen_k=9, heads_kv=1))
    for args in ((0.125, False, False, 3, 2, 0.0), (0.125, True, False, 4, -1, 1.5),
                 (0.125, False, False, -1, -1, 2.0)):
        torch.library.opcheck(torch.ops.cute_fa.fwd.default, (q, k, v, *args))


def test_compiles_fullgraph_with_window_and_softcap():
    q, k, v = _qkv()

    @torch.compile(fullgraph=True, backend="eager")
    def attend(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(8, 0), softcap=3.0)

    expected = flash_attn_func(q, k, v, causal=True, window_size=(8, 0), softcap=3.0)
    assert torch.equal(attend(q, k, v), expected)
