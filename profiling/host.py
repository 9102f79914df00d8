"""Host time per attention call, every backend side by side.

    python -m cute_fa.profiling.host                        # the default model's attention
    python -m cute_fa.profiling.host --seqlen 8192 --heads 16 --heads-kv 16 --head-dim 64
    python -m cute_fa.profiling.host --modes fwd --window 1024,0 --softcap 30   # score mods

A training step that is not captured in a CUDA graph is paced by its host (the
default model's compiled step on an H100 took ~51 ms of wall time for ~30 ms
of GPU work under torch.profiler), so the Python and dispatcher cost of each
attention call matters there as much as its kernels. This command measures
that cost alone: a long GPU spin is queued first, so every launch of the timed
calls waits on the device while the host runs ahead, and the wall time of the
calls is host time only. It is checked that the spin outlasted the calls (the
GPU was still busy at the end), else the run says so.

Modes, each over the same inputs:
- fwd:              forward, no autograd graph;
- fwd_bwd:          eager forward + backward through autograd;
- compiled_fwd_bwd: the same through torch.compile(fullgraph=True) (compiled
                    forward and backward graphs calling each backend's ops).
Rounds are interleaved over backends; the table gives the median per call.
Prints the table and writes nothing. Needs an sm_90 CUDA GPU (H100/H200).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .backends import (BACKENDS, OURS, BackendUnavailable, add_backends_option,
                       make_callable)
from .cli import choice_list, command_parser, positive_int, require_cuda
from .problem import (DTYPES, add_causal_option, add_dense_shape_options, add_dtype_option,
                      add_head_dim_option, add_score_options, check_heads_kv,
                      check_score_options, make_qkv, make_sinks)

MODES = ("fwd", "fwd_bwd", "compiled_fwd_bwd")
# ~0.5 s at H100 clocks: longer than any batch of timed calls below.
SPIN_CYCLES = 1_000_000_000


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("host", __doc__)
    add_backends_option(p, [OURS, "fa4", "sdpa_cudnn", "sdpa_flash"], BACKENDS)
    p.add_argument("--modes", type=choice_list(MODES), default=list(MODES), metavar="LIST",
                   help=f"what one call is, comma-separated, from {', '.join(MODES)} (see "
                        f"above) (default: all)")
    # The attention of the default model (cute_fa.model.DEFAULT): 8 query
    # heads, 4 K/V heads, head dim 128, causal.
    add_dense_shape_options(p, batch=1, seqlen=4096, heads=8, heads_kv=4)
    add_head_dim_option(p)
    add_causal_option(p, "yes")
    add_dtype_option(p)
    add_score_options(p)
    p.add_argument("--calls", type=positive_int, default=20,
                   help="timed calls per round, all queued behind one GPU spin (default: 20)")
    p.add_argument("--rounds", type=positive_int, default=7,
                   help="rounds per backend and mode, interleaved; the median is reported "
                        "(default: 7)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_heads_kv(p, args)
    check_score_options(p, args)
    return args


def make_call(backend: str, mode: str, q, k, v, causal: bool, window_size=(-1, -1),
              softcap: float = 0.0, learnable_sink=None):
    """A zero-argument callable running one call of `mode` with `backend`."""
    direction = "fwd" if mode == "fwd" else "fwd_bwd"
    return make_callable(backend, q, k, v, causal, q.shape[-1] ** -0.5, direction,
                         compiled=mode == "compiled_fwd_bwd", window_size=window_size,
                         softcap=softcap, learnable_sink=learnable_sink)


def host_us_per_call(fn, calls: int) -> float:
    """Wall time of `calls` calls queued behind a GPU spin, in us per call."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if torch.cuda.current_stream().query():
        raise RuntimeError("profiling.host: the GPU spin ended before the timed calls; "
                           "lower --calls")
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def measure(args) -> list[dict]:
    q, k, v = make_qkv(args.batch, args.seqlen, args.seqlen, args.heads, args.heads_kv,
                       args.head_dim, DTYPES[args.dtype], seed=0)
    causal = args.causal == "yes"
    sinks = make_sinks(args.heads, q.device) if args.sink else None
    rows = []
    for mode in args.modes:
        calls, status = {}, {}
        for backend in args.backends:
            try:
                fn = make_call(backend, mode, q, k, v, causal, args.window, args.softcap,
                               sinks)
                for _ in range(3):  # JIT compile, torch.compile, allocator warm-up
                    fn()
                torch.cuda.synchronize()
                calls[backend] = fn
                status[backend] = "ok"
            except BackendUnavailable as exc:
                status[backend] = f"unavailable: {exc}"
            except Exception as exc:  # a failing backend is a row, not the end of the run
                status[backend] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        samples = {b: [] for b in calls}
        for _ in range(args.rounds):
            for backend, fn in calls.items():
                if status[backend] == "ok":
                    try:
                        samples[backend].append(host_us_per_call(fn, args.calls))
                    except RuntimeError as exc:  # the host waited on the GPU
                        status[backend] = f"failed: {exc}"
        for backend in args.backends:
            ok = status[backend] == "ok" and samples.get(backend)
            us = statistics.median(samples[backend]) if ok else None
            rows.append(dict(mode=mode, backend=backend, host_us=us, status=status[backend]))
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'mode':<17} {'backend':<12} {'host us/call':>12} {'vs ours':>8}  status"]
    ours = {r["mode"]: r["host_us"] for r in rows if r["backend"] == OURS}
    for r in rows:
        us = f"{r['host_us']:.1f}" if r["host_us"] is not None else "-"
        ratio = (f"{r['host_us'] / ours[r['mode']]:.2f}"
                 if r["host_us"] is not None and ours.get(r["mode"]) else "-")
        lines.append(f"{r['mode']:<17} {r['backend']:<12} {us:>12} {ratio:>8}  {r['status']}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    require_cuda("host")
    rows = measure(args)
    print(f"host time per call (median of {args.rounds} rounds of {args.calls}), "
          f"b={args.batch} s={args.seqlen} h={args.heads}/{args.heads_kv} d={args.head_dim} "
          f"causal={args.causal} {args.dtype}, {torch.cuda.get_device_name()}")
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
