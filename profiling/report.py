"""Benchmark output: terminal table, JSON with the environment, PNG plots.

Rows are plain dicts (see bench.py) so recorded runs can be re-rendered and
tested without a GPU.
"""

from __future__ import annotations

import json
import platform
from collections import defaultdict

from .backends import OURS

PROBLEM_KEYS = ("direction", "dtype", "head_dim", "causal", "seqlen_q", "seqlen_k", "batch",
                "heads", "heads_kv")


def problem_key(row: dict) -> tuple:
    return tuple(row[k] for k in PROBLEM_KEYS)


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
    header = (f"{'dir':<7} {'dtype':<5} {'d':>4} {'causal':>6} {'seqlen':>7} {'batch':>5} "
              f"{'backend':<15} {'ms':>9} {'TFLOP/s':>8} {'vs best peer':>13} {'peak MB':>9}  status")
    lines = [header, "-" * len(header)]
    for row in rows:
        ms = f"{row['median_ms']:.3f}" if row["status"] == "ok" else "-"
        tf = f"{row['tflops']:.1f}" if row["status"] == "ok" else "-"
        ratio = (f"{row['ratio_to_best_peer']:.3f}x" if row.get("ratio_to_best_peer") else "-")
        mem = f"{row['peak_mem_bytes'] / 2**20:.0f}" if row.get("peak_mem_bytes") else "-"
        seqlen = (str(row["seqlen_q"]) if row["seqlen_q"] == row["seqlen_k"]
                  else f"{row['seqlen_q']}/{row['seqlen_k']}")
        lines.append(f"{row['direction']:<7} {row['dtype']:<5} {row['head_dim']:>4} "
                     f"{str(row['causal']):>6} {seqlen:>7} {row['batch']:>5} "
                     f"{row['backend']:<15} {ms:>9} {tf:>8} {ratio:>13} {mem:>9}  {row['status']}")
    return "\n".join(lines)


def environment() -> dict:
    env = {"python": platform.python_version()}
    try:
        import torch
        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    except ImportError:
        pass
    try:
        import importlib.metadata as md
        env["nvidia-cutlass-dsl"] = md.version("nvidia-cutlass-dsl")
    except Exception:
        env["nvidia-cutlass-dsl"] = None
    try:
        import subprocess
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        env["driver"] = None
    return env


def write_json(path: str, rows: list[dict], env: dict, args: dict) -> None:
    with open(path, "w") as f:
        json.dump({"environment": env, "arguments": args, "rows": rows}, f, indent=1)


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
        panel = (row["direction"], row["dtype"], row["head_dim"], row["causal"])
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
