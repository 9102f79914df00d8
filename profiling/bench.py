"""Side-by-side attention benchmark: ours against every peer, same inputs, one process.

    python -m cute_fa.profiling.bench                                  # default grid
    python -m cute_fa.profiling.bench --head-dims 128 --causal both --seqlens 2048,16384
    python -m cute_fa.profiling.bench --backends cute,fa4,sdpa_cudnn --out bench_out/run1
    python -m cute_fa.profiling.bench --report reports/h100              # a shareable report

Prints the table (one row per problem and backend: median time, TFLOP/s,
ratio to the best peer, peak memory, status). Writes files only when asked:
--out PREFIX: <PREFIX>.json (every row and the environment) and the plots
<PREFIX>_tflops.png, <PREFIX>_memory.png;
--report DIR: DIR/README.md, a markdown report (date, machine: GPU, SMs,
clocks, driver, CUDA, torch, DSL and peer versions; the command line; how it
was measured; one table per direction and dtype with each backend's TFLOP/s
and ours / best peer), DIR/bench.json (the rows) and the plots
DIR/bench_tflops.png, DIR/bench_memory.png, linked from the README.
Both may be given; --no-plots leaves the plots out of either. Needs an sm_90
CUDA GPU (H100/H200); a backend that cannot run (e.g. fa4 without the peers
extra) is a row saying why.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

from .backends import (BACKENDS, OURS, BackendUnavailable, add_backends_option,
                       add_direction_option, make_callable)
from .cli import INSTALL_BENCH, command_parser, positive_int, progress, require_cuda, require_module
from .flops import attention_flops, batch_for, tflops
from .problem import (CAUSAL_VALUES, DTYPES, add_causal_option, add_dtype_option,
                      add_head_dim_option, add_head_dim_v_option, add_score_options,
                      add_size_options, check_gqa, check_score_options, heads_for, make_qkv,
                      make_sinks)
from . import report
from .report import (add_ratios, environment, format_table, head_dims_text, write_json,
                     write_markdown, write_plots)

DEFAULT_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("bench", __doc__)
    add_dtype_option(p, ["bf16"], multiple=True)
    add_head_dim_option(p, [64, 128], multiple=True, padded=True)
    add_head_dim_v_option(p, "v's head dim at every head dim of --head-dims at least as "
                             "large (the others are skipped), e.g. --head-dims 192 "
                             "--head-dim-v 128 (default: each head dim's own)")
    add_causal_option(p, "both", allow_both=True)
    add_size_options(p, DEFAULT_SEQLENS, multiple=True, model_dim=True)
    add_direction_option(p, ["fwd"], multiple=True)
    # FlexAttention compiles per problem shape: a peer to ask for (--backends ...,flex)
    add_backends_option(p, [b for b in BACKENDS if b != "flex"])
    add_score_options(p, "TFLOP/s count the pairs it lets through")
    p.add_argument("--math-max-seqlen", type=positive_int, default=4096,
                   help="skip sdpa_math above this sequence length: its memory and time are "
                        "quadratic in it (default: 4096)")
    p.add_argument("--repeats", type=positive_int, default=30,
                   help="timed calls per backend and problem, the median reported; fewer when "
                        "a problem's rounds pass 10 s (default: 30)")
    p.add_argument("--include-host-latency", action="store_true",
                   help="time each call from an idle GPU, host work included "
                        "(default: the host queues the call ahead, see timing.py)")
    p.add_argument("--out", default=None, metavar="PREFIX",
                   help="write <PREFIX>.json and the plots <PREFIX>_tflops.png, "
                        "<PREFIX>_memory.png, creating the folder (default: none)")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="write a markdown report DIR/README.md (machine, command line, "
                        "method, TFLOP/s tables), DIR/bench.json and the plots "
                        "DIR/bench_*.png, creating the folder (default: no report)")
    p.add_argument("--no-plots", action="store_true",
                   help="with --out or --report: no PNG plots (and no need for matplotlib)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_gqa(p, args, args.head_dims)
    check_score_options(p, args)
    if args.report is not None and os.path.exists(args.report) \
            and not os.path.isdir(args.report):
        p.error(f"--report: expected a folder, got {args.report!r}, an existing file")
    return args


def command_line(argv) -> str:
    """The shell command that runs bench with `argv` again."""
    return report.command_line("bench", argv)


def problems(args) -> list[dict]:
    out = []
    for direction in args.directions:
        for dtype in args.dtypes:
            for head_dim in args.head_dims:
                head_dim_v = args.head_dim_v or head_dim
                if head_dim_v > head_dim:
                    continue
                heads = heads_for(args, head_dim)
                for causal in CAUSAL_VALUES[args.causal]:
                    for seqlen in args.seqlens:
                        out.append(dict(direction=direction, dtype=dtype, head_dim=head_dim,
                                        head_dim_v=head_dim_v, causal=causal, seqlen_q=seqlen, seqlen_k=seqlen,
                                        batch=batch_for(args.total_tokens, seqlen), heads=heads,
                                        heads_kv=heads // args.gqa, window=args.window,
                                        softcap=args.softcap, sink=args.sink))
    return out


def run_problem(problem: dict, backends: list[str], args) -> list[dict]:
    """All backends on the same inputs, timed round-robin (timing.time_interleaved)."""
    from .timing import first_call, time_interleaved

    b, s, h, hkv, d, dv = (problem[k] for k in ("batch", "seqlen_q", "heads", "heads_kv",
                                                "head_dim", "head_dim_v"))
    q, k, v = make_qkv(b, s, problem["seqlen_k"], h, hkv, d, DTYPES[problem["dtype"]], seed=0,
                       head_dim_v=dv)
    flops = attention_flops(b, h, s, problem["seqlen_k"], d, problem["causal"],
                            problem["direction"], head_dim_v=dv, window=problem["window"])
    sinks = make_sinks(h, q.device) if problem.get("sink") else None
    rows, runnable = {}, {}
    for name in backends:
        rows[name] = dict(problem, backend=name, status="ok", median_ms=None, tflops=None,
                          first_call_ms=None, peak_mem_bytes=None)
        try:
            if name == "sdpa_math" and s > args.math_max_seqlen:
                raise BackendUnavailable(f"skipped above --math-max-seqlen {args.math_max_seqlen}")
            fn = make_callable(name, q, k, v, problem["causal"], d ** -0.5, problem["direction"],
                               window_size=problem["window"], softcap=problem["softcap"],
                               learnable_sink=sinks)
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


def _label(problem: dict) -> str:
    mods = "" if problem["window"] == (-1, -1) else f" window={problem['window']}"
    mods += f" softcap={problem['softcap']:g}" if problem["softcap"] else ""
    mods += " sink" if problem.get("sink") else ""
    return (f"{problem['direction']} {problem['dtype']} d={head_dims_text(problem)} "
            f"causal={problem['causal']}{mods} seqlen={problem['seqlen_q']}")


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    require_cuda("bench")
    if (args.out or args.report) and not args.no_plots:  # before the run, not after it
        require_module("matplotlib", INSTALL_BENCH, "bench's plots (--no-plots: none)")

    backends = [OURS] + [b for b in args.backends if b != OURS] if OURS in args.backends \
        else args.backends
    rows = []
    for problem in progress(problems(args), "bench", "problem", _label):
        rows += run_problem(problem, backends, args)
    add_ratios(rows)
    env = environment()
    command = command_line(argv)
    arguments = dict(vars(args), command=command)
    written = []
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        write_json(args.out + ".json", rows, env, arguments)
        written += [args.out + ".json"] + ([] if args.no_plots else write_plots(args.out, rows))
    if args.report:
        os.makedirs(args.report, exist_ok=True)
        data = os.path.join(args.report, "bench.json")
        write_json(data, rows, env, arguments)
        plots = [] if args.no_plots else write_plots(os.path.join(args.report, "bench"), rows)
        readme = os.path.join(args.report, "README.md")
        write_markdown(readme, rows, env, command, arguments, plots)
        written += [readme, data] + plots
    print(f"\n{env.get('gpu')} | torch {env.get('torch')} | DSL {env.get('nvidia-cutlass-dsl')}"
          f" | driver {env.get('driver')}")
    print(format_table(rows))
    if written:
        print("\nwrote " + ", ".join(written))
    return rows


if __name__ == "__main__":
    main()
