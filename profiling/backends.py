"""Attention backends the benchmarks compare, behind one calling convention.

Each backend (python_api.attention_backends) is wrapped into a zero-argument
callable running one forward, backward or both on fixed inputs. A backend that
cannot run here raises BackendUnavailable with the reason; the harness reports
it in its row and goes on.
"""

from __future__ import annotations

import torch

from python_api.attention_backends import BACKEND_NAMES, BackendUnavailable, attention  # noqa: F401  (re-exported)

BACKENDS = tuple(b for b in BACKEND_NAMES if b != "sdpa")  # each pinned, plus ours and fa4
OURS = "cute"


def check_items(parser, flag: str, items, allowed) -> None:
    """parser.error naming `flag` for the first item of a list argument that
    is not in `allowed`."""
    for item in items:
        if item not in allowed:
            parser.error(f"{flag}: expected items of {sorted(allowed)}, got {item!r}")


def make_callable(name: str, q, k, v, causal: bool, softmax_scale: float, direction: str):
    """A zero-argument callable running `direction`: 'fwd', 'bwd' (the backward of one
    recorded forward, graph retained) or 'fwd_bwd'."""
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(BACKENDS)}, got {name!r}")
    if direction == "fwd":
        def run_fwd():
            with torch.no_grad():
                return attention(q, k, v, causal, softmax_scale, name)
        return run_fwd
    if direction not in ("bwd", "fwd_bwd"):
        raise ValueError(f"direction: expected 'fwd', 'bwd' or 'fwd_bwd', got {direction!r}")
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    grad_out = torch.randn_like(q)

    def forward():
        return attention(qg, kg, vg, causal, softmax_scale, name)

    if direction == "fwd_bwd":
        return lambda: forward().backward(grad_out)
    out = forward()
    return lambda: out.backward(grad_out, retain_graph=True)
