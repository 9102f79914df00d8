"""Every bad input gets an error naming the argument, what was expected and what came."""

import pytest
import torch

from cute_fa import flash_attn_func


def _qkv(shape_q=(2, 16, 4, 64), shape_k=(2, 16, 2, 64), dtype=torch.bfloat16):
    return (torch.randn(shape_q, dtype=dtype), torch.randn(shape_k, dtype=dtype),
            torch.randn(shape_k, dtype=dtype))


@pytest.mark.parametrize("mutate, error, pattern", [
    (lambda q, k, v: (q.float(), k.float(), v.float()), TypeError,
     r"q: expected dtype torch.bfloat16 or torch.float16, got torch.float32"),
    (lambda q, k, v: (q, k.half(), v), TypeError, r"q, k, v: expected one dtype"),
    (lambda q, k, v: (q[..., :36].contiguous(), k[..., :36].contiguous(),
                      v[..., :36].contiguous()), ValueError,
     r"q: expected headdim a multiple of 8 up to 256 \(64, 96, 128, 192, 256 run as they are, "
     r"the others zero-padded to the next of those\), got 36"),
    (lambda q, k, v: (torch.cat([q] * 5, -1), torch.cat([k] * 5, -1), torch.cat([v] * 5, -1)),
     ValueError, r"q: expected headdim a multiple of 8 up to 256 .*got 320"),
    (lambda q, k, v: (q, k, torch.cat([v] * 2, -1)), ValueError,
     r"v: expected headdim a multiple of 8 no larger than that of q \(64\), got 128"),
    (lambda q, k, v: (q, k, v[..., :36].contiguous()), ValueError,
     r"v: expected headdim a multiple of 8 no larger than that of q \(64\), got 36"),
    (lambda q, k, v: (q.transpose(1, 3).contiguous().transpose(1, 3), k, v), ValueError,
     r"q: expected the last dimension \(headdim\) to be contiguous"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"k: expected batch 2 \(that of q\), got 1"),
    (lambda q, k, v: (q, torch.cat([k, k[:, :, :1]], 2), torch.cat([v, v[:, :, :1]], 2)),
     ValueError, r"k: expected nheads_kv to divide nheads_q = 4 \(GQA/MQA\), got nheads_kv = 3"),
    (lambda q, k, v: (q[0], k, v), ValueError,
     r"q: expected a 4-D tensor \(batch, seqlen, nheads, headdim\), got 3-D"),
    (lambda q, k, v: (q[:, :, :0], k, v), ValueError, r"q: expected at least one head"),
    (lambda q, k, v: (q, k, v[:, :8]), ValueError,
     r"k, v: expected equal \(batch, seqlen, nheads\)"),
    (lambda q, k, v: (q, k[..., :32].contiguous(), v[..., :32].contiguous()), ValueError,
     r"k: expected headdim 64 \(that of q\), got 32"),
    (lambda q, k, v: (q, k, v.to("meta")), ValueError, r"q, k, v: expected one device"),
    (lambda q, k, v: (q.float().numpy(), k, v), TypeError,
     r"q: expected a torch.Tensor, got ndarray"),
])
def test_bad_inputs_raise_named_errors(mutate, error, pattern):
    q, k, v = mutate(*_qkv())
    with pytest.raises(error, match=pattern):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("scale, error, pattern", [
    (float("nan"), ValueError, r"softmax_scale: expected a finite positive float, got nan"),
    (-1.0, ValueError, r"softmax_scale: expected a finite positive float, got -1.0"),
    ("0.1", TypeError, r"softmax_scale: expected a float or None, got str"),
])
def test_bad_softmax_scale(scale, error, pattern):
    with pytest.raises(error, match=pattern):
        flash_attn_func(*_qkv(), softmax_scale=scale)


def test_unsupported_cuda_device_error_names_device(monkeypatch):
    from cute_fa import validate

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"cuda:0 \(NVIDIA A100, compute capability 8.0\) "
                                           r"is not supported.*sm_90"):
        validate.check_cuda_device(torch.device("cuda", 0))


def _bwd_args():
    q, k, v = _qkv()
    out = torch.randn_like(q)
    lse = torch.randn(2, 4, 16)
    return dict(grad_out=torch.randn_like(q), q=q, k=k, v=v, out=out, lse=lse,
                softmax_scale=0.125, causal=False)


@pytest.mark.parametrize("change, error, pattern", [
    (dict(grad_out=torch.randn(2, 16, 4, 32)), ValueError,
     r"grad_out: expected shape \(2, 16, 4, 64\), dtype torch.bfloat16, device cpu \(q's, "
     r"with v's headdim\)"),
    (dict(out=torch.randn(2, 16, 4, 64)), ValueError, r"out: expected shape .* got shape"),
    (dict(lse=torch.randn(2, 16, 4)), ValueError,
     r"lse: expected shape \(2, 4, 16\), dtype torch.float32"),
    (dict(lse=torch.randn(2, 4, 16).double()), ValueError, r"lse: expected .*float64"),
    (dict(grad_lse=torch.randn(2, 4, 15)), ValueError, r"grad_lse: expected shape \(2, 4, 16\)"),
    # the dispatcher's own message names the argument for a wrong type
    (dict(out=[1.0]), RuntimeError, r"Expected a value of type 'Tensor' for argument 'out'"),
])
def test_backward_op_bad_inputs_raise_named_errors(change, error, pattern):
    args = _bwd_args()
    args.update(change)
    with pytest.raises(error, match=pattern):
        torch.ops.cute_fa.bwd(**args)


def _packed_qkv(heads=4, head_dim=64, dtype=torch.bfloat16):
    """q, k, v as views of one projection (seq and head strides not compact)."""
    qkv = torch.randn(2, 16, 3 * heads, head_dim, dtype=dtype)
    return qkv[:, :, :heads], qkv[:, :, heads:2 * heads], qkv[:, :, 2 * heads:]


@pytest.mark.parametrize("args", [
    lambda: (*_qkv(), None),                                            # GQA 2:1
    lambda: (*_qkv((1, 7, 8, 128), (1, 33, 1, 128), torch.float16), 0.1),  # MQA, fp16
    lambda: (*_qkv((2, 16, 4, 96), (2, 16, 4, 96)), 1),                 # int scale
    lambda: (*_packed_qkv(), 0.125),
])
def test_valid_calls_are_accepted_by_the_fast_checks(args):
    # Every op call runs the checks; a valid call must not fall to the slow
    # path that spells out the error (it would pass, but cost host time).
    from cute_fa.validate import _attention_tensors_ok, _backward_inputs_ok

    q, k, v, scale = args()
    assert _attention_tensors_ok(q, k, v, scale)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1])
    assert _backward_inputs_ok(torch.randn_like(q), q, k, v, out, lse, float(scale or 0.125),
                               None)
    assert _backward_inputs_ok(torch.randn_like(q), q, k, v, out, lse, float(scale or 0.125),
                               torch.zeros_like(lse))
