"""Benchmark output: terminal table, JSON with the environment, PNG plots and
a markdown report (README.md of `bench --report DIR`).

Rows are plain dicts (see bench.py) so recorded runs can be re-rendered and
tested without a GPU.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections import defaultdict

from cute_fa.user_cache import installed_version

from .backends import OURS

PROBLEM_KEYS = ("direction", "dtype", "head_dim", "causal", "seqlen_q", "seqlen_k", "batch",
                "heads", "heads_kv")


def problem_key(row: dict) -> tuple:
    # window, softcap and sink: rows recorded before they existed have none
    return tuple(row[k] for k in PROBLEM_KEYS) + (head_dim_v(row), tuple(row.get(
        "window", (-1, -1))), row.get("softcap", 0.0), row.get("sink", False))


def head_dim_v(row: dict) -> int:
    """v's head dim of a row (rows that have none: that of q and k)."""
    return row.get("head_dim_v") or row["head_dim"]


def head_dims_text(row: dict) -> str:
    """"128", or "192/128" where v's head dim differs from q's."""
    dv = head_dim_v(row)
    return str(row["head_dim"]) if dv == row["head_dim"] else f"{row['head_dim']}/{dv}"


def add_ratios(rows: list[dict]) -> list[dict]:
    """Per problem: best peer TFLOP/s, and each backend's ratio to it."""
    by_problem = defaultdict(list)
    for row in rows:
        by_problem[problem_key(row)].append(row)
    for group in by_problem.values():
        peers = [r for r in group if r["backend"] != OURS and r["status"] == "ok"]
        best = max(peers, key=lambda r: r["tflops"], default=None)
        for row in group:
            row["best_peer"] = best["backend"] if best else None
            row["ratio_to_best_peer"] = (row["tflops"] / best["tflops"]
                                         if best and row["status"] == "ok" else None)
    return rows


def format_table(rows: list[dict]) -> str:
    header = (f"{'dir':<7} {'dtype':<5} {'d':>7} {'causal':>6} {'seqlen':>7} {'batch':>5} "
              f"{'backend':<15} {'ms':>9} {'TFLOP/s':>8} {'vs best peer':>13} {'peak MB':>9}  status")
    lines = [header, "-" * len(header)]
    for row in rows:
        ms = f"{row['median_ms']:.3f}" if row["status"] == "ok" else "-"
        tf = f"{row['tflops']:.1f}" if row["status"] == "ok" else "-"
        ratio = (f"{row['ratio_to_best_peer']:.3f}x" if row.get("ratio_to_best_peer") else "-")
        mem = f"{row['peak_mem_bytes'] / 2**20:.0f}" if row.get("peak_mem_bytes") else "-"
        seqlen = (str(row["seqlen_q"]) if row["seqlen_q"] == row["seqlen_k"]
                  else f"{row['seqlen_q']}/{row['seqlen_k']}")
        lines.append(f"{row['direction']:<7} {row['dtype']:<5} {head_dims_text(row):>7} "
                     f"{str(row['causal']):>6} {seqlen:>7} {row['batch']:>5} "
                     f"{row['backend']:<15} {ms:>9} {tf:>8} {ratio:>13} {mem:>9}  {row['status']}")
    return "\n".join(lines)


# Python distributions whose versions a benchmark depends on: the DSL our
# kernels are written in, and the peer (the peers extra).
PACKAGES = ("nvidia-cutlass-dsl", "flash-attn-4")
# nvidia-smi --query-gpu fields -> environment keys
GPU_QUERY = {"driver_version": "driver", "clocks.max.sm": "sm_clock_max_mhz",
             "clocks.max.memory": "memory_clock_max_mhz",
             "clocks.applications.graphics": "sm_clock_application_mhz"}


def _nvidia_smi(field: str, gpu: str | None) -> str | None:
    """One --query-gpu field of `gpu` (an nvidia-smi -i id; None: the first GPU)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}",
                              "--format=csv,noheader,nounits"] + (["-i", gpu] if gpu else []),
                             capture_output=True, text=True, timeout=10)
    except Exception:
        return None
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    value = lines[0].strip() if lines else ""
    return None if not value or value.startswith("[") else value  # [N/A], [Not Supported]


def _git_commit() -> str | None:
    """The commit of the source tree this package runs from (an editable
    install of a git checkout), '+modified' when the tree has changes."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"],
                                capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except Exception:
        return None
    return commit.stdout.strip() + ("+modified" if dirty else "")


def environment() -> dict:
    """What a benchmark ran on: GPU (name, SMs, clocks), driver, CUDA, torch,
    cuDNN, the DSL and the peer's versions (None where unknown or absent)."""
    env = {"python": platform.python_version()}
    gpu = None
    try:
        import torch
        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() \
            else None
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env["gpu"] = props.name
            env["sms"] = props.multi_processor_count
            env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            uuid = str(getattr(props, "uuid", "") or "")
            gpu = (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}") if uuid else None
    except ImportError:
        pass
    for name in ("cute-fa",) + PACKAGES:
        env[name] = installed_version(name)
    env["cute-fa commit"] = _git_commit()
    for field, key in GPU_QUERY.items():
        env[key] = _nvidia_smi(field, gpu)
        if env[key] is None and gpu is not None:  # an nvidia-smi that cannot take the UUID
            env[key] = _nvidia_smi(field, None)
    return env


def write_json(path: str, rows: list[dict], env: dict, args: dict) -> None:
    with open(path, "w") as f:
        json.dump({"environment": env, "arguments": args, "rows": rows}, f, indent=1)


def command_line(command: str, argv) -> str:
    """The shell command that runs profiling.<command> with `argv` again."""
    return shlex.join(["python", "-m", f"cute_fa.profiling.{command}", *argv])


def add_out_option(p) -> None:
    """--out PREFIX of the commands that write <PREFIX>.json and <PREFIX>.md."""
    p.add_argument("--out", required=True, metavar="PREFIX",
                   help="write <PREFIX>.json and <PREFIX>.md")


def write_table_report(prefix: str, rows: list[dict], env: dict, args: dict,
                       markdown: str) -> None:
    """<prefix>.json (the rows, machine and arguments) and <prefix>.md."""
    write_json(prefix + ".json", rows, env, args)
    with open(prefix + ".md", "w") as f:
        f.write(markdown)


def write_command_report(command: str, argv, args, rows: list[dict], markdown) -> None:
    """A table command's report at args.out (write_table_report): the rows,
    the machine, the arguments, and markdown(rows, env, the command line)."""
    env = environment()
    line = command_line(command, sys.argv[1:] if argv is None else argv)
    write_table_report(args.out, rows, env, vars(args), markdown(rows, env, line))


def write_plots(prefix: str, rows: list[dict]) -> list[str]:
    """TFLOP/s and peak memory vs seqlen, one line per backend, one panel per
    (direction, dtype, head_dim, causal). Returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["status"] != "ok":
            continue
        panel = (row["direction"], row["dtype"], head_dims_text(row), row["causal"])
        panels[panel][row["backend"]].append(row)
    written = []
    for metric, ylabel, scale, suffix in (("tflops", "TFLOP/s", 1.0, "tflops"),
                                          ("peak_mem_bytes", "peak memory (MiB)", 2**-20, "memory")):
        if not panels:
            break
        keys = sorted(panels)
        fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
        for ax, key in zip(axes[0], keys):
            for backend, brows in sorted(panels[key].items()):
                brows = sorted(brows, key=lambda r: r["seqlen_q"])
                ax.plot([r["seqlen_q"] for r in brows], [r[metric] * scale for r in brows],
                        marker="o", label=backend, linewidth=2.5 if backend == OURS else 1.2)
            ax.set_xscale("log", base=2)
            if metric == "peak_mem_bytes":
                ax.set_yscale("log")
            direction, dtype, head_dim, causal = key
            ax.set_title(f"{direction} {dtype} d={head_dim} causal={causal}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = f"{prefix}_{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# ------------------------------------------------------------ markdown report

def _cell(text) -> str:
    """Text safe inside a markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _shape(row: dict) -> str:
    heads = (str(row["heads"]) if row["heads_kv"] == row["heads"]
             else f"{row['heads']} (K/V {row['heads_kv']})")
    seqlen = (str(row["seqlen_q"]) if row["seqlen_q"] == row["seqlen_k"]
              else f"{row['seqlen_q']}/{row['seqlen_k']}")
    return f"{row['batch']}×{heads}×{seqlen}"


def machine_lines(env: dict) -> list[str]:
    """The machine section: one bullet per line of what was measured on."""
    def v(key, unknown="unknown"):
        value = env.get(key)
        return unknown if value in (None, "") else str(value)

    gpu = v("gpu", "no CUDA GPU visible")
    if env.get("sms"):
        gpu += f", {env['sms']} SMs"
    if env.get("gpu_memory_gib"):
        gpu += f", {env['gpu_memory_gib']} GiB"
    clocks = [f"{label} {env[key]} MHz" for key, label in (
        ("sm_clock_max_mhz", "SM max"), ("sm_clock_application_mhz", "SM application"),
        ("memory_clock_max_mhz", "memory max")) if env.get(key)]
    lines = [f"- GPU: {gpu}"]
    if clocks:
        lines.append(f"- clocks: {', '.join(clocks)}")
    lines.append(f"- driver {v('driver')}, CUDA {v('cuda')} (torch's), cuDNN {v('cudnn')}")
    lines.append(f"- torch {v('torch')}, Python {v('python')}")
    commit = f" (commit {env['cute-fa commit']})" if env.get("cute-fa commit") else ""
    lines.append(f"- cute-fa {v('cute-fa')}{commit}, nvidia-cutlass-dsl "
                 f"{v('nvidia-cutlass-dsl')}, flash-attn-4 {v('flash-attn-4', 'not installed')}")
    return lines


def _method(arguments: dict) -> str:
    repeats = arguments.get("repeats")
    host = arguments.get("include_host_latency", False)
    return (
        "Every backend runs on the same inputs (random normal, seed 0) in one process. "
        "Each call is timed with CUDA events around it; a row's time is the median of "
        + (f"{repeats} timed calls" if repeats else "the timed calls")
        + " (--repeats; fewer when a problem's rounds pass 10 s), after 3 untimed warm-up "
        "calls, and the first call (JIT compilation included) is timed on its own and left "
        "out. The L2 cache is flushed (a 256 MiB buffer zeroed) before every timed call. "
        "Backends are timed round-robin, each repeat running every backend once, so clock "
        "and power drift fall on all of them alike. "
        + ("Each call is timed from an idle GPU, its host latency included "
           "(--include-host-latency). " if host else
           "A GPU spin queued before each call lets the host queue the whole call ahead, so "
           "the events time the GPU's work (kernels and the gaps between them), not host "
           "latency. ")
        + "A backward returns the inputs' gradients (torch.autograd.grad), as a layer's "
        "backward hands them on, instead of adding them into the inputs' .grad. "
        + "TFLOP/s counts 4·batch·heads·seqlen_q·seqlen_k·head_dim FLOPs for the forward "
        "(2·batch·heads·seqlen_q·seqlen_k·(head_dim + head_dim_v) where v's head dim "
        "differs; half of it when causal), 2.5 times that for the backward and 3.5 times for "
        "fwd_bwd; ours / best peer is our TFLOP/s over the fastest other backend that ran "
        "on the same problem.")


def format_markdown(rows: list[dict], env: dict, command: str, arguments: dict | None = None,
                    plots: list[str] = (), date: datetime.datetime | None = None) -> str:
    """The benchmark report in markdown: title, date, machine, command line,
    method, one table per (direction, dtype) with each backend's TFLOP/s (a
    row that did not run shows its status) and ours / best peer, then the
    plots (paths relative to the report). rows: after add_ratios."""
    date = date or datetime.datetime.now(datetime.timezone.utc)
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    lines = ["# Attention benchmark: cute_fa against its peers", "",
             f"Date: {date.astimezone(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             "## Machine", "", *machine_lines(env), "",
             "## Command", "", "```", command, "```", "",
             "## How it was measured", "", _method(arguments or {}), "",
             "## Results (TFLOP/s)", ""]
    tables = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        tables[(row["direction"], row["dtype"])][problem_key(row)][row["backend"]] = row
    ratio_column = OURS in backends
    header = (["head dim", "causal", "batch×heads×seqlen"] + backends
              + ["ours / best peer"] * ratio_column)
    for (direction, dtype), problems in tables.items():
        lines += [f"### {direction}, {dtype}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join(["---:", ":---:", "---:"]
                                 + ["---:"] * (len(backends) + ratio_column)) + "|"]
        for by_backend in problems.values():
            first = next(iter(by_backend.values()))
            cells = [head_dims_text(first), "yes" if first["causal"] else "no", _shape(first)]
            for name in backends:
                row = by_backend.get(name)
                if row is None:
                    cells.append("")
                elif row["status"] == "ok":
                    cells.append(f"{row['tflops']:.1f}")
                else:
                    cells.append(_cell(row["status"]))
            if ratio_column:
                ours = by_backend.get(OURS)
                ratio = ours.get("ratio_to_best_peer") if ours else None
                cells.append(f"{ratio:.3f} ({ours['best_peer']})" if ratio else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if plots:
        lines += ["## Plots", ""]
        for path in plots:
            name = os.path.basename(path)
            what = ("peak memory" if name.endswith("_memory.png") else
                    "TFLOP/s" if name.endswith("_tflops.png") else name)
            lines += [f"![{what} against sequence length]({name})", ""]
    return "\n".join(lines)


def write_markdown(path: str, rows: list[dict], env: dict, command: str,
                   arguments: dict | None = None, plots: list[str] = (),
                   date: datetime.datetime | None = None) -> None:
    """format_markdown's report into `path` (plots linked by file name: they
    lie beside it)."""
    with open(path, "w") as f:
        f.write(format_markdown(rows, env, command, arguments, plots, date))
