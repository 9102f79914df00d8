"""Attention backends the benchmarks compare, behind one calling convention.

Each backend (cute_fa.attention_backends) is wrapped into a zero-argument
callable running one forward, backward or both on fixed inputs. A backend that
cannot run here raises BackendUnavailable with the reason; the harness reports
it in its row and goes on.
"""

from __future__ import annotations

import torch

from cute_fa.attention_backends import BACKEND_NAMES, BackendUnavailable, attention  # noqa: F401  (re-exported)

from .cli import INSTALL_PEERS, choice_list
from .problem import input_gradients

BACKENDS = tuple(b for b in BACKEND_NAMES if b != "sdpa")  # each pinned, plus ours and fa4
OURS = "cute"
DIRECTIONS = ("fwd", "bwd", "fwd_bwd")


def backends_help(names=BACKENDS) -> str:
    """What the backend names mean."""
    return ("cute: ours; fa4: flash-attn-4 (the peers extra: " + INSTALL_PEERS + "); flex: "
            "PyTorch's FlexAttention, torch.compile'd (masks as a BlockMask); sdpa_*: "
            "PyTorch's scaled_dot_product_attention pinned to one of its backends"
            + ("; sdpa: PyTorch's own choice" if "sdpa" in names else ""))


def add_backends_option(p, default: list[str], names=BACKENDS) -> None:
    """--backends: a comma-separated list of `names` (BACKENDS, or
    BACKEND_NAMES where "sdpa", PyTorch's own choice, is meant too)."""
    p.add_argument("--backends", type=choice_list(names), default=default, metavar="LIST",
                   help=f"attention backends, comma-separated, from {', '.join(names)} "
                        f"(default: {'all' if list(default) == list(names) else ','.join(default)}"
                        f"). {backends_help(names)}")


def require_fa4(what: str) -> None:
    """Exit with a message saying how to install flash-attn-4 when its CuTe
    kernels (flash_attn.cute) cannot be imported; what: the command path."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as exc:  # ImportError, or a DSL/runtime mismatch at import
        raise SystemExit(f"profiling.{what}: needs flash-attn-4, the peer, but flash_attn.cute "
                         f"cannot be imported here ({type(exc).__name__}: {exc}); install it "
                         f"with: {INSTALL_PEERS}") from None


def add_direction_option(p, default="fwd", choices=DIRECTIONS, multiple: bool = False) -> None:
    """--direction (one) or --directions (a comma-separated list)."""
    what = ("fwd: the forward; bwd: the backward of one recorded forward"
            + ("; fwd_bwd: both" if "fwd_bwd" in choices else ""))
    if multiple:
        p.add_argument("--directions", type=choice_list(choices), default=default,
                       metavar="LIST", help=f"what to time, comma-separated, from "
                       f"{', '.join(choices)} ({what}) (default: {','.join(default)})")
    else:
        p.add_argument("--direction", choices=choices, default=default,
                       help=f"what to run ({what}) (default: {default})")


def make_callable(name: str, q, k, v, causal: bool, softmax_scale: float, direction: str,
                  compiled: bool = False, window_size: tuple = (-1, -1), softcap: float = 0.0,
                  learnable_sink=None):
    """A zero-argument callable running `direction`: 'fwd', 'bwd' (the backward of one
    recorded forward, graph retained) or 'fwd_bwd'. compiled: the attention call
    goes through torch.compile(fullgraph=True). window_size, softcap,
    learnable_sink: as flash_attn_func's (backward: the sinks' gradient too)."""
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(BACKENDS)}, got {name!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: expected 'fwd', 'bwd' or 'fwd_bwd', got {direction!r}")

    sink = learnable_sink
    if sink is not None and direction != "fwd":
        sink = sink.detach().requires_grad_(True)

    def attend(q_, k_, v_):
        return attention(q_, k_, v_, causal, softmax_scale, name, window_size, softcap, sink)

    if compiled:
        attend = torch.compile(attend, fullgraph=True, dynamic=False)
    if direction == "fwd":
        def run_fwd():
            with torch.no_grad():
                return attend(q, k, v)
        return run_fwd
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    inputs = (qg, kg, vg) if sink is None else (qg, kg, vg, sink)
    grad_out = torch.randn(*q.shape[:3], v.shape[3], dtype=q.dtype, device=q.device)
    if direction == "fwd_bwd":
        return lambda: input_gradients(attend(qg, kg, vg), inputs, grad_out)
    out = attend(qg, kg, vg)
    return lambda: input_gradients(out, inputs, grad_out, retain_graph=True)
