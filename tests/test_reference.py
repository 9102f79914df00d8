"""The reference math every other test leans on, checked against first principles."""

import math

import torch

from cute_fa.reference import attention_reference, causal_mask


def _naive(q, k, v, scale, causal):
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hkv)
            for i in range(sq):
                cols = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not cols:
                    continue
                s = torch.stack([(q[bi, i, hi].double() * k[bi, j, kh].double()).sum() * scale
                                 for j in cols])
                lse[bi, hi, i] = torch.logsumexp(s, 0)
                p = torch.exp(s - lse[bi, hi, i])
                out[bi, i, hi] = sum(p[n] * v[bi, j, kh].double() for n, j in enumerate(cols))
    return out, lse


def test_matches_naive_loops_with_gqa_and_bottom_right_causal():
    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, 8)
    k = torch.randn(2, 3, 2, 8)
    v = torch.randn(2, 3, 2, 8)
    for causal in (False, True):
        out, lse = attention_reference(q, k, v, 0.3, causal, compute_dtype=torch.float64)
        ref_out, ref_lse = _naive(q, k, v, 0.3, causal)
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-6, atol=1e-6)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(finite, torch.isfinite(lse))
        torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-6, atol=1e-6)


def test_causal_mask_is_bottom_right_aligned():
    m = causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    m = causal_mask(4, 2)
    assert m.tolist() == [[False, False], [False, False], [True, False], [True, True]]


def test_rows_without_keys_give_zero_and_minus_inf():
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    out, lse = attention_reference(q, k, v, None, causal=True)
    assert torch.all(out[:, :2] == 0) and not torch.isnan(out).any()
    assert torch.all(lse[..., :2] == -math.inf) and torch.isfinite(lse[..., 2:]).all()


def test_a_nan_input_reaches_its_rows_not_a_zero():
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    q[0, 3, 0, 1] = math.nan
    out, lse = attention_reference(q, k, v, None, causal=True)
    assert out[0, 3, 0].isnan().all() and lse[0, 0, 3].isnan()
    assert torch.all(out[:, :2] == 0) and torch.all(lse[..., :2] == -math.inf)  # no keys
    assert torch.isfinite(out[0, 2]).all() and torch.isfinite(out[0, 3, 1]).all()
    # a NaN sink takes part in every row of its head, those without keys too
    sink = torch.tensor([0.5, math.nan])
    out, lse = attention_reference(q.nan_to_num(), k, v, None, causal=True, sink=sink)
    assert out[0, :, 1].isnan().all() and lse[0, 1].isnan().all()
    assert torch.isfinite(out[0, :, 0]).all() and torch.isfinite(lse[0, 0]).all()


def test_low_precision_path_keeps_dtype():
    q = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    out, lse = attention_reference(q, q, q, None, False, compute_dtype=None)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
