"""One calling convention for every attention implementation the project
compares: q, k, v in (batch, seqlen, nheads, headdim), GQA allowed, causal
bottom-right aligned (SDPA's is_causal is top-left aligned, identical when
seqlen_q == seqlen_k; other shapes are refused there). Used by the model's
`Attention(backend=...)` and by the benchmarks.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

SDPA_BACKENDS = {
    "sdpa": None,  # PyTorch's own choice
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}
BACKEND_NAMES = ("cute", "fa4", "flex", *SDPA_BACKENDS)
# SDPA backends that refuse enable_gqa ("No available kernel", torch 2.11 on
# the H100): K/V are expanded to the query heads for them.
NO_NATIVE_GQA = ("EFFICIENT_ATTENTION",)


class BackendUnavailable(Exception):
    """The backend cannot run here; the message says why."""


def _sdpa(q, k, v, causal, softmax_scale, backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if causal and q.shape[1] != k.shape[1]:
        raise BackendUnavailable("SDPA's causal mask is top-left aligned; "
                                 "seqlen_q != seqlen_k would differ from ours")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[2] != k.shape[2]
    if gqa and backend_name in NO_NATIVE_GQA:
        group = q.shape[2] // k.shape[2]
        kt, vt = (t.repeat_interleave(group, dim=1) for t in (kt, vt))
        gqa = False
    kwargs = dict(is_causal=causal, scale=softmax_scale, enable_gqa=gqa)
    if backend_name is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, **kwargs)
    else:
        with sdpa_kernel([getattr(SDPBackend, backend_name)]):
            out = F.scaled_dot_product_attention(qt, kt, vt, **kwargs)
    return out.transpose(1, 2)


def _fa4(q, k, v, causal, softmax_scale, window_size, softcap, learnable_sink):
    try:
        from flash_attn.cute import flash_attn_func as fa4_func
    except Exception as exc:  # ImportError, or a DSL/runtime mismatch at import
        raise BackendUnavailable(f"flash_attn.cute not importable (flash-attn-4, the peers "
                                 f"extra: pip install \"cute-fa[peers]\"): {exc}") from exc
    if q.device.type != "cuda":
        raise BackendUnavailable(f"flash_attn.cute runs on CUDA tensors only, got {q.device}")
    extra = {}
    if window_size != (-1, -1):  # its unbounded side is None
        extra["window_size"] = tuple(None if w < 0 else w for w in window_size)
    if softcap:
        extra["softcap"] = softcap
    if learnable_sink is not None:
        extra["learnable_sink"] = learnable_sink
    out = fa4_func(q, k, v, softmax_scale=softmax_scale, causal=causal, **extra)
    return out[0] if isinstance(out, tuple) else out


def _flex(q, k, v, causal, softmax_scale, window_size, softcap, learnable_sink):
    """PyTorch's FlexAttention, torch.compile'd: the mask (bottom-right
    causal, a window) as a BlockMask, so blocks it hides are skipped; the
    cap as a score_mod."""
    if learnable_sink is not None:
        raise BackendUnavailable("FlexAttention has no learnable sinks")
    from torch.nn.attention.flex_attention import flex_attention

    left, right = window_size
    right = 0 if causal else right
    block_mask = (None if left < 0 and right < 0 else
                  _flex_block_mask(q.shape[1], k.shape[1], left, right, str(q.device)))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out = _compiled(flex_attention)(qt, kt, vt, score_mod=_softcap_mod(float(softcap)),
                                    block_mask=block_mask, scale=softmax_scale,
                                    enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    return torch.compile(fn)


@functools.lru_cache(maxsize=64)
def _flex_block_mask(seqlen_q: int, seqlen_k: int, left: int, right: int, device: str):
    """FlashAttention's window (left, right; -1 unbounded), bottom-right
    aligned, as a FlexAttention BlockMask; built once per problem."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = seqlen_k - seqlen_q

    def visible(b, h, q_idx, kv_idx):
        diagonal = q_idx + offset
        seen = kv_idx <= diagonal + right if right >= 0 else kv_idx >= 0
        return seen & (kv_idx >= diagonal - left) if left >= 0 else seen

    return create_block_mask(visible, None, None, seqlen_q, seqlen_k, device=device)


@functools.lru_cache(maxsize=None)
def _softcap_mod(softcap: float):
    """softcap · tanh(score / softcap) (None: no cap); one function per cap,
    so the compiled kernel is reused."""
    if not softcap:
        return None

    def capped(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return capped


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None,
              backend: str = "cute", window_size: tuple = (-1, -1),
              softcap: float = 0.0, learnable_sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale)·v with the chosen implementation; (b, s, h, d) out.
    window_size, softcap and learnable_sink as flash_attn_func's (SDPA has
    none, FlexAttention no sinks)."""
    if backend == "cute":
        from . import flash_attn_func
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap,
                               learnable_sink=learnable_sink)
    if backend == "fa4":
        return _fa4(q, k, v, causal, softmax_scale, tuple(window_size), softcap, learnable_sink)
    if backend == "flex":
        return _flex(q, k, v, causal, softmax_scale, tuple(window_size), softcap,
                     learnable_sink)
    if backend in SDPA_BACKENDS and (tuple(window_size) != (-1, -1) or softcap
                                     or learnable_sink is not None):
        raise BackendUnavailable("SDPA has no sliding window, softcap or sinks (a dense mask "
                                 "would be another problem)")
    if backend in SDPA_BACKENDS:
        return _sdpa(q, k, v, causal, softmax_scale, SDPA_BACKENDS[backend])
    raise ValueError(f"backend: expected one of {BACKEND_NAMES}, got {backend!r}")
