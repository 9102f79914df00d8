"""Attention backends the benchmarks compare, behind one calling convention.

Each backend turns (q, k, v) in (batch, seqlen, nheads, headdim) layout into
a callable running one forward (or forward+backward). A backend that cannot
run here raises BackendUnavailable with the reason; the harness reports it in
its row and goes on.
"""

from __future__ import annotations

from typing import Callable

import torch


class BackendUnavailable(Exception):
    pass


def _sdpa(backend_name: str):
    def make(q, k, v, causal: bool, softmax_scale: float):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F

        if q.shape[1] != k.shape[1] and causal:
            # SDPA's is_causal is top-left aligned; ours and flash-attn's are bottom-right.
            raise BackendUnavailable("SDPA causal mask differs when seqlen_q != seqlen_k")
        backend = getattr(SDPBackend, backend_name)
        gqa = q.shape[2] != k.shape[2]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (b, h, s, d) views

        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                      scale=softmax_scale, enable_gqa=gqa)
        return run
    return make


def _cute(q, k, v, causal: bool, softmax_scale: float):
    from python_api import flash_attn_func

    return lambda: flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)


def _fa4(q, k, v, causal: bool, softmax_scale: float):
    try:
        from flash_attn.cute import flash_attn_func as fa4_func
    except Exception as exc:  # ImportError, or a DSL/runtime mismatch at import
        raise BackendUnavailable(f"flash_attn.cute not importable: {exc}") from exc

    def run():
        out = fa4_func(q, k, v, softmax_scale=softmax_scale, causal=causal)
        return out[0] if isinstance(out, tuple) else out
    return run


BACKENDS: dict[str, Callable] = {
    "cute": _cute,
    "fa4": _fa4,
    "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa_flash": _sdpa("FLASH_ATTENTION"),
    "sdpa_efficient": _sdpa("EFFICIENT_ATTENTION"),
    "sdpa_math": _sdpa("MATH"),
}
OURS = "cute"
PEERS = ("fa4", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math")


def make_callable(name: str, q, k, v, causal: bool, softmax_scale: float, direction: str):
    """A zero-argument callable running `direction`: 'fwd', 'bwd' (the backward of one
    recorded forward, graph retained) or 'fwd_bwd'."""
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(BACKENDS)}, got {name!r}")
    if direction == "fwd":
        fwd = BACKENDS[name](q, k, v, causal, softmax_scale)

        def run_fwd():
            with torch.no_grad():
                return fwd()
        return run_fwd
    if direction not in ("bwd", "fwd_bwd"):
        raise ValueError(f"direction: expected 'fwd', 'bwd' or 'fwd_bwd', got {direction!r}")
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    fwd = BACKENDS[name](qg, kg, vg, causal, softmax_scale)
    grad_out = torch.randn_like(q)

    def forward():
        out = fwd()
        if out.shape != q.shape:  # SDPA returns (b, h, s, d)
            out = out.transpose(1, 2)
        return out

    if direction == "fwd_bwd":
        return lambda: forward().backward(grad_out)
    out = forward()
    return lambda: out.backward(grad_out, retain_graph=True)
