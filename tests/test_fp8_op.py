"""The FP8 forward op on the CPU (torch.ops.cute_fa.fwd_fp8 and
flash_attn_func with e4m3 inputs): the reference math on the dequantized
inputs, its registration (opcheck, fake kernel, torch.compile), no
backward, and the errors of bad calls."""

import pytest
import torch

from cute_fa import flash_attn_func
from cute_fa.fp8 import E4M3, dequantize_fp8, quantize_fp8
from cute_fa.reference import attention_reference


def _fp8(batch=2, seqlen_q=70, seqlen_k=90, heads=4, heads_kv=2, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, d, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_kv, d, generator=gen)
    v = torch.randn(batch, seqlen_k, heads_kv, d, generator=gen)
    (q8, qs), (k8, ks), (v8, vs) = quantize_fp8(q, heads_kv), quantize_fp8(k), quantize_fp8(v)
    return q8, k8, v8, qs, ks, vs


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("out_dtype", [None, torch.float16])
def test_cpu_path_is_the_attention_of_the_dequantized_inputs(causal, out_dtype):
    q8, k8, v8, qs, ks, vs = _fp8()
    out, lse = flash_attn_func(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks,
                               v_descale=vs, out_dtype=out_dtype, return_lse=True)
    exact, exact_lse = attention_reference(dequantize_fp8(q8, qs), dequantize_fp8(k8, ks),
                                           dequantize_fp8(v8, vs), None, causal)
    assert out.dtype == (out_dtype or torch.bfloat16) and lse.dtype == torch.float32
    torch.testing.assert_close(out, exact.to(out.dtype))
    torch.testing.assert_close(lse, exact_lse)


def test_missing_descales_are_one():
    q8, k8, v8, _, _, _ = _fp8(seed=1)
    ones = torch.ones(2, 2)
    torch.testing.assert_close(
        flash_attn_func(q8, k8, v8),
        flash_attn_func(q8, k8, v8, q_descale=ones, k_descale=ones, v_descale=ones))


def test_the_kernels_descales_are_views_and_shared_ones():
    """What the kernel reads costs a call no launch: the caller's descales
    as (1, b, h_kv) views (a per-tensor scale expanded, stride 0, too), and
    for None one ones tensor per shape, made once."""
    from cute_fa.fp8_ops import kernel_descales

    ks = torch.rand(3, 2).t()  # (2, 3), not contiguous
    vs = torch.tensor(0.5).expand(2, 3)
    first = kernel_descales(2, 3, None, ks, vs, ks.device)
    assert [tuple(d.shape) for d in first] == [(1, 2, 3)] * 3
    assert first[1].data_ptr() == ks.data_ptr() and torch.equal(first[1][0], ks)
    assert first[2].data_ptr() == vs.data_ptr() and first[2].stride()[1:] == (0, 0)
    assert torch.equal(first[0], torch.ones(1, 2, 3))
    again = kernel_descales(2, 3, None, None, None, ks.device)
    assert all(d is first[0] for d in again)


def test_registration_opcheck_and_compile():
    q8, k8, v8, qs, ks, vs = _fp8(seed=2)
    # test_schema compares inputs with arithmetic torch has no e4m3 CPU kernel for
    torch.library.opcheck(torch.ops.cute_fa.fwd_fp8.default, (q8, k8, v8, qs, ks, vs, None, True),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True, q_descale=qs,
                                                             k_descale=ks, v_descale=vs),
                             fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q8, k8, v8), flash_attn_func(
        q8, k8, v8, causal=True, q_descale=qs, k_descale=ks, v_descale=vs))


def test_a_gradient_through_fp8_raises():
    q8, k8, v8, qs, ks, vs = _fp8(seed=3)
    scale = qs.clone().requires_grad_()
    out = flash_attn_func(q8, k8, v8, q_descale=scale, k_descale=ks, v_descale=vs)
    with pytest.raises(NotImplementedError, match="no backward"):
        out.float().sum().backward()


def _bad(**changes):
    q8, k8, v8, qs, ks, vs = _fp8()
    args = dict(q=q8, k=k8, v=v8, q_descale=qs, k_descale=ks, v_descale=vs)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, error, match", [
    (dict(q=torch.zeros(2, 70, 4, 64).to(torch.float8_e5m2)), TypeError,
     "q: expected dtype torch.float8_e4m3fn.*e5m2 is not supported"),
    (dict(k=torch.zeros(2, 90, 2, 64, dtype=torch.bfloat16)), TypeError,
     "k: expected dtype torch.float8_e4m3fn"),
    (dict(q_descale=torch.ones(2, 4)), ValueError, r"q_descale: expected .* shape \(2, 2\)"),
    (dict(k_descale=torch.ones(2, 2, dtype=torch.float64)), ValueError, "k_descale: expected"),
    (dict(q_descale=0.5), TypeError, "q_descale: expected a torch.Tensor or None, got float"),
    (dict(v_descale=torch.ones(2, 2, device="meta")), ValueError, "v_descale: expected"),
    (dict(q=torch.zeros(2, 70, 4, 80).to(E4M3), k=torch.zeros(2, 90, 2, 80).to(E4M3),
          v=torch.zeros(2, 90, 2, 80).to(E4M3)), ValueError, "q: expected headdim one of"),
    (dict(v=torch.zeros(2, 90, 2, 32).to(E4M3)), ValueError, "k, v: expected headdim 64"),
    (dict(out_dtype=torch.float32), TypeError, "out_dtype: expected"),
    (dict(window_size=(8, 0)), ValueError, "window_size: expected"),
    (dict(softcap=5.0), ValueError, "softcap: expected 0.0"),
    (dict(learnable_sink=torch.zeros(4)), ValueError, "learnable_sink: expected None"),
])
def test_bad_fp8_calls_name_the_argument(changes, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(**_bad(**changes))


def test_descales_with_16_bit_inputs_are_an_error():
    q = torch.randn(1, 8, 2, 64)
    with pytest.raises(ValueError, match="q_descale: expected None for torch.float32"):
        flash_attn_func(q, q, q, q_descale=torch.ones(1, 2))
