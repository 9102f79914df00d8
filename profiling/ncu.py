"""Nsight Compute on one attention problem: ours selected by NVTX range, a peer
by kernel name.

    python -m profiling.ncu --head-dim 128 --seqlen 8192 --causal
    python -m profiling.ncu --backend fa4 --seqlen 8192 --out profiling_out/fa4

Writes <out>.ncu-rep and <out>.txt (the metrics that matter for attention:
tensor-pipe utilisation, SM/DRAM throughput, warp stall reasons, shared-memory
bank conflicts, registers, local-memory spills). The same problem, config
and backend names as profiling.bench.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys

import torch

# metric name -> label, in the order of the summary
METRICS = {
    "gpu__time_duration.sum": "duration",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM throughput %",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active":
        "tensor pipe active %",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM throughput %",
    "lts__t_sector_hit_rate.pct": "L2 hit rate %",
    "launch__registers_per_thread": "registers / thread",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": "smem store bank conflicts",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": "smem load bank conflicts",
}
EXTRA_METRICS = {
    "smsp__inst_executed.sum": "instructions executed",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue slots busy %",
    "derived__local_spilling_requests": "local-memory spill requests",
    "dram__bytes_read.sum": "DRAM bytes read",
}
SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis",
            "MemoryWorkloadAnalysis_Tables", "WarpStateStats", "LaunchStats", "Occupancy",
            "SourceCounters", "SchedulerStats", "InstructionStats"]
PEER_KERNEL_REGEX = {"fa4": "regex:.*[Ff]lash.*", "sdpa_cudnn": "regex:.*(cudnn|sm90).*",
                     "sdpa_flash": "regex:.*flash.*"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m profiling.ncu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cute")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--total-tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=None, help="default: 2048 // head_dim")
    p.add_argument("--gqa", type=int, default=1)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--direction", choices=["fwd", "bwd"], default="fwd",
                   help="bwd profiles the backward of one recorded forward")
    p.add_argument("--config", default="", help="config overrides for ours (FwdConfig, or "
                                               "BwdConfig with --direction bwd), e.g. "
                                               "'tile_n=176,kv_stages=2'")
    p.add_argument("--out", default="profiling_out/ncu")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def parse_overrides(text: str, kind: str = "fwd") -> dict:
    from cute_kernels.config import parse_field

    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        try:
            out[name] = parse_field(name, value, kind)
        except ValueError as exc:
            raise SystemExit(f"--config: {exc}") from None
    return out


def run_workload(args) -> None:
    """The profiled process: warm up (compile), then the selected call once."""
    from .backends import make_callable
    from .problem import DTYPES, make_qkv, problem_shape

    batch, heads = problem_shape(args.head_dim, args.seqlen, args.total_tokens, args.heads)
    q, k, v = make_qkv(batch, args.seqlen, args.seqlen, heads, heads // args.gqa,
                       args.head_dim, DTYPES[args.dtype])
    scale = args.head_dim ** -0.5
    if args.backend == "cute" and args.config:
        from cute_kernels.config import default_config
        from python_api.ops import backward_cuda, forward_cuda
        config = default_config(args.direction, args.head_dim, args.causal).replace(
            **parse_overrides(args.config, args.direction))
        if args.direction == "fwd":
            fn = lambda: forward_cuda(q, k, v, scale, args.causal, config)  # noqa: E731
        else:
            out, lse = forward_cuda(q, k, v, scale, args.causal)
            grad_out = torch.randn_like(q)
            fn = lambda: backward_cuda(grad_out, q, k, v, out, lse, scale,  # noqa: E731
                                       args.causal, config=config)
    else:
        fn = make_callable(args.backend, q, k, v, args.causal, scale, args.direction)
    fn()  # compile and warm up outside the profiled launch
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def ncu_command(args, report: str) -> list[str]:
    child = [sys.executable, "-m", "profiling.ncu", "--child"] + [
        a for a in sys.argv[1:] if a != "--child"]
    cmd = ["ncu", "--profile-from-start", "off", "--target-processes", "all", "-f", "-o", report]
    for s in SECTIONS:
        cmd += ["--section", s]
    if args.backend == "cute":
        cmd += ["--nvtx", "--nvtx-include", f"regex:cute_fa\\.{args.direction}.*/"]
    else:
        cmd += ["-k", PEER_KERNEL_REGEX.get(args.backend, "regex:.*")]
    return cmd + child


def summarize(report: str) -> str:
    raw = subprocess.run(["ncu", "--import", report, "--page", "raw", "--csv"],
                         capture_output=True, text=True, check=True).stdout
    rows = list(csv.reader(io.StringIO(raw)))
    if len(rows) < 3:
        return "no kernel was profiled (check the NVTX/kernel filter)\n"
    header, units, data = rows[0], rows[1], rows[2:]
    lines = []
    unit_of = dict(zip(header, units))
    for record in data:
        values = dict(zip(header, record))
        name = values.get("Kernel Name", "?")
        lines.append(f"kernel: {name[:110]}")
        for metric, label in METRICS.items():
            if metric in values:
                lines.append(f"  {label:<32} {values[metric]} {unit_of.get(metric, '')}".rstrip())
        def numeric(v):
            try:
                return float(v.replace(",", ""))
            except ValueError:
                return None
        for k, label in EXTRA_METRICS.items():
            if k in values:
                lines.append(f"  {label:<32} {values[k]}")
        prefix, suffix = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
        stalls = sorted(((numeric(v), k[len(prefix):-len(suffix)]) for k, v in values.items()
                         if k.startswith(prefix) and k.endswith(suffix)
                         and numeric(v) is not None), reverse=True)
        if stalls:
            lines.append("  warp stalls (warps stalled per issued instruction):")
            for ratio, reason in stalls[:10]:
                lines.append(f"    {reason:<28} {ratio:7.3f}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        run_workload(args)
        return
    if shutil.which("ncu") is None:
        raise SystemExit("profiling.ncu: `ncu` (Nsight Compute) is not on PATH")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    report = args.out
    subprocess.run(ncu_command(args, report), check=True)
    summary = summarize(report + ".ncu-rep")
    raw = subprocess.run(["ncu", "--import", report + ".ncu-rep", "--page", "raw", "--csv"],
                         capture_output=True, text=True).stdout
    with open(report + "_raw.csv", "w") as f:
        f.write(raw)
    with open(report + ".txt", "w") as f:
        f.write(summary)
    print(summary)


if __name__ == "__main__":
    main()
