"""Side-by-side attention benchmark: ours against every peer, same inputs, one process.

    python -m cute_fa.profiling.bench                                  # default grid
    python -m cute_fa.profiling.bench --head-dims 128 --causal both --seqlens 2048,16384
    python -m cute_fa.profiling.bench --backends cute,fa4,sdpa_cudnn --out bench_out/run1

Writes <out>.json (every row and the environment) and <out>_tflops.png,
<out>_memory.png; prints the table last.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch

from .backends import (BACKENDS, OURS, BackendUnavailable, check_items, csv_list,
                       make_callable)
from .flops import attention_flops, batch_for, tflops
from .problem import DTYPES, MODEL_DIM, default_heads, make_qkv
from .report import add_ratios, environment, format_table, write_json, write_plots
DEFAULT_SEQLENS = "512,1024,2048,4096,8192,16384"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cute_fa.profiling.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", type=csv_list(str), default=["bf16"])
    p.add_argument("--head-dims", type=csv_list(int), default=[64, 128])
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    p.add_argument("--seqlens", type=csv_list(int), default=csv_list(int)(DEFAULT_SEQLENS))
    p.add_argument("--total-tokens", type=int, default=16384,
                   help="batch = total_tokens // seqlen")
    p.add_argument("--model-dim", type=int, default=MODEL_DIM,
                   help="query heads = model_dim // head_dim (unless --heads)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--gqa", type=int, default=1, help="query heads per K/V head")
    p.add_argument("--directions", type=csv_list(str), default=["fwd"])
    p.add_argument("--backends", type=csv_list(str), default=list(BACKENDS))
    p.add_argument("--math-max-seqlen", type=int, default=4096,
                   help="skip sdpa_math above this seqlen (quadratic memory and time)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--include-host-latency", action="store_true",
                   help="time each call from an idle GPU, host work included "
                        "(default: the host queues the call ahead, see timing.py)")
    p.add_argument("--out", default="bench_out/bench")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    check_items(p, "--dtypes", args.dtypes, DTYPES)
    check_items(p, "--backends", args.backends, BACKENDS)
    check_items(p, "--directions", args.directions, ("fwd", "bwd", "fwd_bwd"))
    return args


def problems(args) -> list[dict]:
    causal_values = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    out = []
    for direction in args.directions:
        for dtype in args.dtypes:
            for head_dim in args.head_dims:
                heads = args.heads or default_heads(head_dim, args.model_dim)
                if heads % args.gqa:
                    raise SystemExit(f"--gqa: expected a divisor of heads={heads}, got {args.gqa}")
                for causal in causal_values:
                    for seqlen in args.seqlens:
                        out.append(dict(direction=direction, dtype=dtype, head_dim=head_dim,
                                        causal=causal, seqlen_q=seqlen, seqlen_k=seqlen,
                                        batch=batch_for(args.total_tokens, seqlen), heads=heads,
                                        heads_kv=heads // args.gqa))
    return out


def run_problem(problem: dict, backends: list[str], args) -> list[dict]:
    from .timing import first_call, time_interleaved

    """All backends on the same inputs, timed round-robin (timing.time_interleaved)."""
    b, s, h, hkv, d = (problem[k] for k in ("batch", "seqlen_q", "heads", "heads_kv", "head_dim"))
    q, k, v = make_qkv(b, s, problem["seqlen_k"], h, hkv, d, DTYPES[problem["dtype"]], seed=0)
    flops = attention_flops(b, h, s, problem["seqlen_k"], d, problem["causal"],
                            problem["direction"])
    rows, runnable = {}, {}
    for name in backends:
        rows[name] = dict(problem, backend=name, status="ok", median_ms=None, tflops=None,
                          first_call_ms=None, peak_mem_bytes=None)
        try:
            if name == "sdpa_math" and s > args.math_max_seqlen:
                raise BackendUnavailable(f"skipped above --math-max-seqlen {args.math_max_seqlen}")
            fn = make_callable(name, q, k, v, problem["causal"], d ** -0.5, problem["direction"])
            # The first call (JIT compile included) runs alone; a backend that
            # cannot run this problem fails here, as its own row.
            first_ms, peak = first_call(fn)
            rows[name].update(first_call_ms=first_ms, peak_mem_bytes=peak)
            runnable[name] = fn
        except BackendUnavailable as exc:
            rows[name]["status"] = f"unavailable: {exc}"
        except Exception as exc:  # a failing backend is a row, not the end of the run
            rows[name]["status"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        gc.collect()
        torch.cuda.empty_cache()
    if runnable:
        for name, (median, count) in time_interleaved(runnable, repeats=args.repeats,
                                                    include_host_latency=args.include_host_latency
                                                    ).items():
            rows[name].update(median_ms=median, tflops=tflops(flops, median), repeats=count)
    return [rows[name] for name in backends]


def progress(items, desc: str):
    try:
        from tqdm import tqdm
        return tqdm(items, desc=desc, unit="problem")
    except ImportError:
        return items


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profiling.bench: needs a CUDA GPU (the H100 of the device tool)")

    backends = [OURS] + [b for b in args.backends if b != OURS] if OURS in args.backends \
        else args.backends
    rows = []
    for problem in progress(problems(args), "bench"):
        rows += run_problem(problem, backends, args)
    add_ratios(rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    env = environment()
    write_json(args.out + ".json", rows, env, vars(args))
    plots = [] if args.no_plots else write_plots(args.out, rows)
    print(f"\n{env.get('gpu')} | torch {env.get('torch')} | DSL {env.get('nvidia-cutlass-dsl')}"
          f" | driver {env.get('driver')}")
    print(format_table(rows))
    print(f"\nwrote {args.out}.json" + "".join(f", {p}" for p in plots))
    return rows


if __name__ == "__main__":
    main()
