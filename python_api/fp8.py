"""FP8 (e4m3) inputs for attention: scaling, incoherent processing, and the
emulation that defines the FP8 forward's error.

Scaling convention (FlashAttention-3's): a tensor (batch, seqlen, nheads, d)
is stored as e4m3 values x8 with one fp32 descale per (batch, KV head), so
that x ≈ x8 · descale. quantize_fp8 takes the scale from the absolute
maximum (amax) of each (batch, KV head) group, the query heads of a group
together, mapping it to e4m3's largest value (448): the whole e4m3 range is
used and nothing saturates. Per (batch, KV head) is what the FP8 kernel
folds in: q's and k's descales multiply the softmax scale, v's the output.

Incoherent processing (the FlashAttention-3 paper, after QuIP): q and k
are both multiplied by one random orthogonal matrix, a Hadamard matrix with
random signs on its columns, H = diag(±1)·Hadamard/√d, so q·kᵀ = (qH)·(kH)ᵀ
exactly while an outlier feature's mass is spread over all d coordinates,
which lowers amax and so the quantization error of everything else.
Head dims that are powers of 2 (64, 128, 256: the FP8 kernel's).

fp8_attention_emulation is the FP8 forward's arithmetic in fp32: dequantized
q·kᵀ, a softmax whose probabilities P = exp(s − max) (in [0, 1]) are rounded
to e4m3 before P·V, as the kernel feeds them to its FP8 WGMMA, while the row
sums use P unrounded; V's descale applied to the output. Its error against
the exact attention of the dequantized inputs is the bound the FP8 tests
earn against.
"""

from __future__ import annotations

import math

import torch

from .validate import describe

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def quantize_fp8(x: torch.Tensor, heads_kv: int | None = None) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """x (batch, seqlen, nheads, d), any float dtype -> (e4m3 values, fp32
    descale (batch, heads_kv)). heads_kv: the KV heads (nheads a multiple of
    it; default nheads): a query tensor's heads are grouped as GQA groups
    them, one descale per group. The scale comes from the finite entries:
    ±inf saturates to ±448 · descale (e4m3 has no infinity) and NaN stays
    NaN, so a non-finite entry spoils neither its group's other entries nor
    its descale."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.dtype.is_floating_point:
        raise ValueError(f"x: expected a float tensor (batch, seqlen, nheads, d), got "
                         f"{describe(x)}")
    batch, seqlen, heads, d = x.shape
    heads_kv = heads if heads_kv is None else heads_kv
    if isinstance(heads_kv, bool) or not isinstance(heads_kv, int) or heads_kv <= 0 \
            or heads % heads_kv:
        raise ValueError(f"heads_kv: expected a positive divisor of nheads = {heads}, got "
                         f"{heads_kv!r}")
    grouped = x.float().view(batch, seqlen, heads_kv, heads // heads_kv, d)
    if grouped.numel():
        finite = grouped.abs().masked_fill(~torch.isfinite(grouped), 0.0)
        amax = finite.amax(dim=(1, 3, 4))  # (batch, heads_kv)
    else:  # no values (seqlen or d 0): descale 1
        amax = torch.zeros((batch, heads_kv), device=x.device)
    scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))
    values = (grouped * scale[:, None, :, None, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return values.to(E4M3).view(batch, seqlen, heads, d), (1.0 / scale).contiguous()


def dequantize_fp8(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """e4m3 (batch, seqlen, nheads, d) and descale (batch, heads_kv) -> fp32."""
    if not isinstance(x8, torch.Tensor) or x8.dim() != 4 or x8.dtype != E4M3:
        raise ValueError(f"x8: expected a float8_e4m3fn tensor (batch, seqlen, nheads, d), "
                         f"got {describe(x8)}")
    batch, seqlen, heads, d = x8.shape
    if not isinstance(descale, torch.Tensor) or descale.dim() != 2 \
            or descale.shape[0] != batch or not descale.dtype.is_floating_point \
            or descale.shape[1] == 0 or heads % descale.shape[1] \
            or descale.device != x8.device:
        raise ValueError(f"descale: expected a float tensor (batch={batch}, heads_kv) with "
                         f"heads_kv dividing nheads = {heads}, on {x8.device}, got "
                         f"{describe(descale)}")
    heads_kv = descale.shape[1]
    grouped = x8.float().view(batch, seqlen, heads_kv, heads // heads_kv, d)
    return (grouped * descale[:, None, :, None, None]).view(batch, seqlen, heads, d)


def random_hadamard(head_dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """An orthogonal (head_dim, head_dim) fp32 matrix: Sylvester's Hadamard
    matrix / √head_dim with the signs of its rows drawn from `seed`."""
    if head_dim <= 0 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim: expected a power of 2 (64, 128, 256), got {head_dim}")
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < head_dim:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1),
                              torch.cat([hadamard, -hadamard], 1)], 0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1
    return (signs[:, None] * hadamard / math.sqrt(head_dim)).to(device)


def incoherent(q: torch.Tensor, k: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """(q·H, k·H) in q's dtype, H = random_hadamard(d, seed): the same scores
    q·kᵀ (exactly, in exact arithmetic), outlier features spread out; apply
    before quantize_fp8."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k: expected one head dim, got {q.shape[-1]} and {k.shape[-1]}")
    h = random_hadamard(q.shape[-1], seed, q.device)
    return (q.float() @ h).to(q.dtype), (k.float() @ h).to(k.dtype)


def fp8_attention_emulation(q8, k8, v8, q_descale, k_descale, v_descale,
                            softmax_scale: float | None = None, causal: bool = False):
    """The FP8 forward's arithmetic in fp32 (see the module's docstring):
    q8, k8, v8 e4m3 (batch, seqlen, heads, d) with their descales (batch,
    heads_kv). Returns (out fp32 (batch, seqlen_q, heads, d), LSE (batch,
    heads, seqlen_q)); rows that see no key give 0 and -inf."""
    q, k = dequantize_fp8(q8, q_descale), dequantize_fp8(k8, k_descale)
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v_values = v8.float().repeat_interleave(group, dim=2)  # its descale: on the output
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        hidden = torch.arange(seqlen_k)[None, :] > torch.arange(seqlen_q)[:, None] + (
            seqlen_k - seqlen_q)
        scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    probs = torch.exp(scores - top)
    row_sum = probs.sum(-1)
    probs8 = probs.to(E4M3).float()
    out = torch.einsum("bhqk,bkhd->bqhd", probs8, v_values)
    v_scale = v_descale.repeat_interleave(group, dim=1)  # per query head
    norm = torch.where(row_sum > 0, 1.0 / row_sum, torch.zeros_like(row_sum))
    out = out * (norm * v_scale[:, :, None]).transpose(1, 2)[..., None]
    lse = torch.where(row_sum > 0, top.squeeze(-1) + torch.log(row_sum),
                      torch.full_like(row_sum, float("-inf")))
    return out, lse


