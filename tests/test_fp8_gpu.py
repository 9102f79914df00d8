"""The e4m3 forward on the H100 against the exact attention of the
dequantized inputs (fp32). Its error bound is earned: the emulation of the
kernel's arithmetic (fp8.fp8_attention_emulation: P rounded to e4m3 before
P·V) has some error against that reference, and ours must stay within 1.5x
of it, on normal, uniform and outlier-heavy inputs."""

import pytest
import torch

from cute_fa import flash_attn_func
from cute_fa.fp8 import dequantize_fp8, fp8_attention_emulation, quantize_fp8
from cute_fa.fp8_ops import forward_fp8_cuda
from cute_fa.kernels.config import fp8_fwd_config
from cute_fa.kernels.tail_plan import TailPlan
from cute_fa.reference import attention_reference

pytestmark = pytest.mark.gpu


def _inputs(kind, batch, seqlen_q, seqlen_k, heads, heads_kv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen_q, heads, d), (batch, seqlen_k, heads_kv, d),
              (batch, seqlen_k, heads_kv, d)]
    if kind == "uniform":
        q, k, v = (torch.rand(s, generator=gen) * 2 - 1 for s in shapes)
    else:
        q, k, v = (torch.randn(s, generator=gen) for s in shapes)
    if kind == "outliers":  # 0.1% of the entries x20
        for t in (q, k, v):
            t[torch.rand(t.shape, generator=gen) < 1e-3] *= 20
    (q8, qs), (k8, ks), (v8, vs) = quantize_fp8(q, heads_kv), quantize_fp8(k), quantize_fp8(v)
    return [t.cuda() for t in (q8, k8, v8, qs, ks, vs)]


def _rmse(a, b):
    return (a.float() - b.float()).pow(2).mean().sqrt().item()


def _check(q8, k8, v8, qs, ks, vs, causal, out, lse):
    emulated, _ = fp8_attention_emulation(q8, k8, v8, qs, ks, vs, causal=causal)
    exact, exact_lse = attention_reference(dequantize_fp8(q8, qs), dequantize_fp8(k8, ks),
                                           dequantize_fp8(v8, vs), None, causal)
    assert torch.isfinite(out).all(), "output has NaN/Inf"
    ours, bound = _rmse(out, exact), _rmse(emulated, exact)
    assert ours <= 1.5 * bound + 1e-6, f"RMSE {ours:.3e} > 1.5 x the emulation's {bound:.3e}"
    finite = torch.isfinite(exact_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "LSE -inf rows differ from the reference"
    assert not torch.isnan(lse).any()
    # Q·Kᵀ of e4m3 values is exact up to the FP8 WGMMA's accumulation (about
    # 14 bits): the LSE matches the reference's to that
    scale = exact_lse[finite].abs().max().item() if finite.any() else 1.0
    lse_err = (lse[finite] - exact_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert lse_err <= 2e-3 * max(scale, 1.0), f"LSE error {lse_err:.3e}"
    if (~finite).any():  # rows that see no key: 0
        rows = (~finite).transpose(1, 2)  # (b, s_q, h)
        assert (out[rows] == 0).all()


SHAPES = [  # batch, seqlen_q, seqlen_k, heads, heads_kv, d, causal
    (2, 1000, 1000, 4, 4, 128, False),
    (2, 1000, 1000, 8, 2, 128, True),
    (1, 333, 777, 6, 3, 64, True),
    (3, 257, 129, 4, 1, 64, False),
    (1, 300, 200, 2, 2, 128, True),  # bottom-right causal: the first 100 rows see no key
    (1, 500, 700, 4, 2, 256, True),
    (2, 129, 640, 2, 1, 256, False),
    (1, 190, 190, 4, 2, 96, False),
    (1, 511, 400, 2, 2, 192, True),
    (1, 4097, 4097, 2, 2, 128, True),  # rows long enough for the wide causal tile
    (1, 300, 4600, 2, 1, 128, True),
    (1, 500, 9000, 2, 1, 128, True),  # three warpgroups
    (1, 600, 16400, 2, 1, 128, True),  # three warpgroups, one Q stage
]


@pytest.mark.parametrize("kind", ["normal", "uniform", "outliers"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_fp8_forward_within_the_emulations_error(shape, kind):
    batch, seqlen_q, seqlen_k, heads, heads_kv, d, causal = shape
    q8, k8, v8, qs, ks, vs = _inputs(kind, batch, seqlen_q, seqlen_k, heads, heads_kv, d,
                                     seed=sum(shape))
    out, lse = flash_attn_func(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks,
                               v_descale=vs, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == (batch, seqlen_q, heads, d)
    _check(q8, k8, v8, qs, ks, vs, causal, out, lse)


def test_fp8_forward_fp16_output_and_unit_descales():
    """No descales: the e4m3 values are the inputs themselves (scaled ones,
    read at descale 1, would give logits of order 448² · d, where no
    attention is meaningful)."""
    gen = torch.Generator().manual_seed(5)
    q8, k8, v8 = (torch.randn(s, generator=gen).to(torch.float8_e4m3fn).cuda()
                  for s in ((2, 300, 4, 128), (2, 300, 2, 128), (2, 300, 2, 128)))
    ones = torch.ones(2, 2, device="cuda")
    out, lse = flash_attn_func(q8, k8, v8, causal=True, out_dtype=torch.float16,
                               return_lse=True)
    assert out.dtype == torch.float16
    _check(q8, k8, v8, ones, ones, ones, True, out, lse)


def test_fp8_forward_reads_descales_in_any_layout():
    """Descales reach the kernel as the caller's tensors: one scale per tensor
    expanded to (batch, nheads_kv) (stride 0) and a transposed view give
    the bits that contiguous copies give."""
    gen = torch.Generator().manual_seed(6)
    q8, k8, v8 = (torch.randn(s, generator=gen).to(torch.float8_e4m3fn).cuda()
                  for s in ((3, 200, 8, 64), (3, 200, 4, 64), (3, 200, 4, 64)))
    expanded = torch.tensor(0.75, device="cuda").expand(3, 4)
    transposed = (torch.rand(4, 3, generator=gen) + 0.5).cuda().t()
    per_tensor = torch.tensor(1.25, device="cuda").expand(3, 4)
    got = flash_attn_func(q8, k8, v8, causal=True, q_descale=expanded, k_descale=transposed,
                          v_descale=per_tensor, return_lse=True)
    want = flash_attn_func(q8, k8, v8, causal=True, q_descale=expanded.contiguous(),
                           k_descale=transposed.contiguous(), v_descale=per_tensor.contiguous(),
                           return_lse=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    _check(q8, k8, v8, expanded.contiguous(), transposed.contiguous(), per_tensor.contiguous(),
           True, *got)


@pytest.mark.parametrize("split", [False, True])
def test_fp8_forward_persistent_tail_split(split):
    """Non-causal tiles of a partial last round, split into key ranges and
    merged (split_tail), or not: the same result within the bound."""
    q8, k8, v8, qs, ks, vs = _inputs("normal", 3, 1100, 2000, 8, 2, 128, seed=11)
    config = fp8_fwd_config(128, False)
    assert config.split_tail
    num_tiles = -(-1100 // config.tile_m) * 8 * 3
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tail = TailPlan(full_tiles=num_tiles - num_tiles % sms, parts=4) if split else TailPlan(0, 1)
    out, lse = forward_fp8_cuda(q8, k8, v8, qs, ks, vs, None, False, None, config, tail)
    _check(q8, k8, v8, qs, ks, vs, False, out, lse)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward_q_ring_of_two_stages(causal):
    """Short tiles on the e4m3 kernel with a second Q stage: within the bound,
    and the one-stage kernel's bits."""
    q8, k8, v8, qs, ks, vs = _inputs("normal", 12, 300, 300, 8, 2, 128, seed=13)
    config = fp8_fwd_config(128, causal).replace(q_stages=2, split_tail=False)
    out, lse = forward_fp8_cuda(q8, k8, v8, qs, ks, vs, None, causal, None, config)
    _check(q8, k8, v8, qs, ks, vs, causal, out, lse)
    one_stage = forward_fp8_cuda(q8, k8, v8, qs, ks, vs, None, causal, None,
                                 config.replace(q_stages=1))
    assert torch.equal(out, one_stage[0]) and torch.equal(lse, one_stage[1])


def test_fp8_forward_under_torch_compile_and_no_backward():
    q8, k8, v8, qs, ks, vs = _inputs("normal", 1, 256, 256, 2, 2, 64, seed=3)
    f = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True, q_descale=qs,
                                                      k_descale=ks, v_descale=vs),
                      fullgraph=True)
    out = f(q8, k8, v8)
    _check(q8, k8, v8, qs, ks, vs, True, out, flash_attn_func(
        q8, k8, v8, causal=True, q_descale=qs, k_descale=ks, v_descale=vs, return_lse=True)[1])
    scale = qs.clone().requires_grad_()
    out = flash_attn_func(q8, k8, v8, q_descale=scale, k_descale=ks, v_descale=vs)
    with pytest.raises(NotImplementedError, match="no backward"):
        out.float().sum().backward()
