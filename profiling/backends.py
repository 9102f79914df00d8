"""Attention backends the benchmarks compare, behind one calling convention.

Each backend (cute_fa.attention_backends) is wrapped into a zero-argument
callable running one forward, backward or both on fixed inputs. A backend that
cannot run here raises BackendUnavailable with the reason; the harness reports
it in its row and goes on.
"""

from __future__ import annotations

import torch

from cute_fa.attention_backends import BACKEND_NAMES, BackendUnavailable, attention  # noqa: F401  (re-exported)

BACKENDS = tuple(b for b in BACKEND_NAMES if b != "sdpa")  # each pinned, plus ours and fa4
OURS = "cute"


def csv_list(kind=str):
    """An argparse type: 'a,b,c' -> [kind(a), kind(b), kind(c)], empty items dropped."""
    return lambda text: [kind(x) for x in text.split(",") if x]


def check_items(parser, flag: str, items, allowed) -> None:
    """parser.error naming `flag` for the first item of a list argument that
    is not in `allowed`."""
    for item in items:
        if item not in allowed:
            parser.error(f"{flag}: expected items of {sorted(allowed)}, got {item!r}")


def make_callable(name: str, q, k, v, causal: bool, softmax_scale: float, direction: str,
                  compiled: bool = False):
    """A zero-argument callable running `direction`: 'fwd', 'bwd' (the backward of one
    recorded forward, graph retained) or 'fwd_bwd'. compiled: the attention call
    goes through torch.compile(fullgraph=True)."""
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(BACKENDS)}, got {name!r}")
    if direction not in ("fwd", "bwd", "fwd_bwd"):
        raise ValueError(f"direction: expected 'fwd', 'bwd' or 'fwd_bwd', got {direction!r}")

    def attend(q_, k_, v_):
        return attention(q_, k_, v_, causal, softmax_scale, name)

    if compiled:
        attend = torch.compile(attend, fullgraph=True, dynamic=False)
    if direction == "fwd":
        def run_fwd():
            with torch.no_grad():
                return attend(q, k, v)
        return run_fwd
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    grad_out = torch.randn_like(q)
    if direction == "fwd_bwd":
        return lambda: attend(qg, kg, vg).backward(grad_out)
    out = attend(qg, kg, vg)
    return lambda: out.backward(grad_out, retain_graph=True)
