"""Nsight Compute on one attention problem: ours selected by NVTX range, a peer
by kernel name.

    python -m cute_fa.profiling.ncu --head-dim 128 --seqlen 8192 --causal
    python -m cute_fa.profiling.ncu --backend fa4 --seqlen 8192 --out ncu_out/fa4
    python -m cute_fa.profiling.ncu --direction bwd --causal --clocks none --source
    python -m cute_fa.profiling.ncu --dtype e4m3 --seqlen 2048 --config tile_n=128

Writes <out>.ncu-rep, <out>_raw.csv and <out>.txt (the metrics that matter
for attention: tensor-pipe utilisation, SM/DRAM throughput, warp stall
reasons, shared-memory bank conflicts, registers, local-memory spills) and
prints the summary. The report is this command's product: without --out it
goes into a fresh temporary folder, whose path is printed. The same problem,
config and backend names as profiling.bench; --dtype e4m3 profiles our FP8
forward (q, k, v quantized per (batch, KV head) as profiling.sweep does, the
base config fp8_config_for_problem's). --source adds the per-instruction view
(which SASS instruction each stall sits at); --clocks none profiles at the
GPU's own clocks, where the benchmarks run (ncu otherwise locks the base
clock, which can reorder two close kernels). Needs Nsight Compute (`ncu` on
PATH) and an sm_90 CUDA GPU (H100/H200).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from .backends import BACKENDS, add_direction_option, backends_help, require_fa4
from .cli import command_parser, config_overrides, config_with, require_cuda
from .kernel_info import opcode
from .problem import (DTYPES, add_causal_option, add_head_dim_option, add_head_dim_v_option,
                      add_size_options, check_gqa, quantized_qkv, resolve_head_dim_v)

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


# Set in the environment of the process that ncu profiles: it runs the workload.
WORKLOAD_ENV = "CUTE_FA_NCU_WORKLOAD"


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("ncu", __doc__)
    p.add_argument("--backend", choices=BACKENDS, default="cute",
                   help=f"the attention backend to profile (default: cute). "
                        f"{backends_help(BACKENDS)}")
    p.add_argument("--dtype", choices=[*DTYPES, "e4m3"], default="bf16",
                   help="input dtype (default: bf16; e4m3: our FP8 forward)")
    add_head_dim_option(p)
    add_head_dim_v_option(p)
    add_size_options(p, 8192)
    add_causal_option(p)
    add_direction_option(p, "fwd", ("fwd", "bwd"))
    p.add_argument("--config", default="", metavar="FIELD=VALUE,...",
                   help="config overrides for ours (FwdConfig, or BwdConfig with --direction "
                        "bwd), e.g. 'tile_n=176,kv_stages=2' (booleans: 0/1) (default: the "
                        "op's config for the problem)")
    p.add_argument("--clocks", choices=["base", "none"], default="base",
                   help="ncu --clock-control: base locks the SM clock to its base "
                        "(repeatable); none leaves the GPU's own boost and power "
                        "management, as the benchmarks run (default: base)")
    p.add_argument("--source", action="store_true",
                   help="also write <PREFIX>_source.csv (ncu's source page: per SASS "
                        "instruction, executions and warp stall samples by reason) and "
                        "<PREFIX>_source.txt, the instructions warps wait at most")
    p.add_argument("--out", default=None, metavar="PREFIX",
                   help="the report's path without suffix: <PREFIX>.ncu-rep, <PREFIX>.txt, "
                        "...; its folder is created (default: <a new temporary folder>/ncu)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_gqa(p, args, [args.head_dim])
    resolve_head_dim_v(p, args)
    if args.dtype == "e4m3":
        from cute_fa.kernels.config import FP8_HEAD_DIMS
        if (args.backend != "cute" or args.direction != "fwd"
                or args.head_dim not in FP8_HEAD_DIMS or args.head_dim_v != args.head_dim):
            p.error(f"--dtype e4m3: expected --backend cute, --direction fwd and --head-dim one "
                    f"of {FP8_HEAD_DIMS} (v's the same), got --backend {args.backend}, "
                    f"--direction {args.direction}, --head-dim {args.head_dim}, --head-dim-v "
                    f"{args.head_dim_v}")
    args.overrides = {}
    if args.config:
        if args.backend != "cute":
            p.error(f"--config: applies to --backend cute only, got --backend {args.backend}")
        try:
            args.overrides = config_overrides([args.config], args.direction)
        except ValueError as exc:
            p.error(f"--config: {exc}")
        if args.dtype == "e4m3":
            try:
                _fp8_config(args).validate(args.head_dim, args.head_dim_v, fp8=True)
            except ValueError as exc:
                p.error(f"--config: {exc}")
        else:
            config_with(p, "--config", args.direction, args.head_dim, args.causal == "yes",
                        args.overrides, args.head_dim_v)
    return args


def _fp8_config(args):
    """The e4m3 forward's config for the problem, with --config's overrides."""
    from cute_fa.kernels.config import PLAIN_FEATURES, fp8_config_for_problem

    return fp8_config_for_problem(args.head_dim, args.causal == "yes", PLAIN_FEATURES,
                                  args.seqlen).replace(**args.overrides)


def _fp8_forward(q, k, v, scale, causal, config):
    """Our e4m3 forward on q, k, v quantized per (batch, KV head)."""
    from cute_fa.fp8_ops import forward_fp8_cuda

    q8, qs, k8, ks, v8, vs = quantized_qkv(q, k, v)
    return lambda: forward_fp8_cuda(q8, k8, v8, qs, ks, vs, scale, causal, None, config)


def run_workload(args) -> None:
    """The profiled process: warm up (compile), then the selected call once."""
    from .backends import make_callable
    from .problem import make_qkv, problem_shape

    causal = args.causal == "yes"
    batch, heads = problem_shape(args.head_dim, args.seqlen, args.total_tokens, args.heads)
    fp8 = args.dtype == "e4m3"
    q, k, v = make_qkv(batch, args.seqlen, args.seqlen, heads, heads // args.gqa,
                       args.head_dim, torch.bfloat16 if fp8 else DTYPES[args.dtype],
                       head_dim_v=args.head_dim_v)
    scale = args.head_dim ** -0.5
    if fp8:
        fn = _fp8_forward(q, k, v, scale, causal, _fp8_config(args) if args.overrides else None)
    elif args.backend == "cute" and args.overrides:
        from cute_fa.kernels.config_fields import default_config
        from cute_fa.ops import backward_cuda, forward_cuda
        config = default_config(args.direction, args.head_dim, causal,
                                args.head_dim_v).replace(**args.overrides)
        if args.direction == "fwd":
            fn = lambda: forward_cuda(q, k, v, scale, causal, config)  # noqa: E731
        else:
            out, lse = forward_cuda(q, k, v, scale, causal)
            grad_out = torch.randn_like(out)
            fn = lambda: backward_cuda(grad_out, q, k, v, out, lse, scale,  # noqa: E731
                                       causal, config=config)
    else:
        fn = make_callable(args.backend, q, k, v, causal, scale, args.direction)
    fn()  # compile and warm up outside the profiled launch
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def ncu_command(args, report: str, argv: list[str]) -> list[str]:
    """ncu's command line: this command again, with `argv`, as the profiled
    process (WORKLOAD_ENV set in its environment)."""
    child = [sys.executable, "-m", "cute_fa.profiling.ncu"] + list(argv)
    cmd = ["ncu", "--profile-from-start", "off", "--target-processes", "all",
           "--clock-control", args.clocks, "-f", "-o", report]
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
        for k, label in EXTRA_METRICS.items():
            if k in values:
                lines.append(f"  {label:<32} {values[k]}")
        prefix, suffix = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
        stalls = sorted(((ratio, k[len(prefix):-len(suffix)]) for k, v in values.items()
                         if k.startswith(prefix) and k.endswith(suffix)
                         and (ratio := _number(v, None)) is not None), reverse=True)
        if stalls:
            lines.append("  warp stalls (warps stalled per issued instruction):")
            for ratio, reason in stalls[:10]:
                lines.append(f"    {reason:<28} {ratio:7.3f}")
    return "\n".join(lines) + "\n"


def _number(text: str, default: float | None = 0.0) -> float | None:
    """A number as ncu's CSV writes it ("1,234.5"); default when it is not one."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return default


def source_kernels(csv_text: str) -> dict[str, list[dict]]:
    """ncu's source page (--page source --csv --print-source sass) by kernel:
    each kernel's block starts with a "Kernel Name" line, then a header and
    one row per SASS instruction."""
    kernels, name, rows = {}, None, []
    for record in csv.reader(io.StringIO(csv_text)):
        if record and record[0] == "Kernel Name":
            name = record[1] if len(record) > 1 else "?"
            kernels[name] = rows = []
        elif name is not None and record:
            rows.append(record)
    out = {}
    for kname, records in kernels.items():
        if records:
            header = records[0]
            out[kname] = [dict(zip(header, r)) for r in records[1:] if len(r) == len(header)]
    return out


_SAMPLES = "Warp Stall Sampling (All Samples)"


def _largest(samples_by_reason) -> str:
    """The three largest of (reason, samples) pairs as "reason:samples ..."."""
    worst = sorted(((v, name) for name, v in samples_by_reason), reverse=True)[:3]
    return " ".join(f"{name}:{v:.0f}" for v, name in worst if v)


def source_hotspots(rows: list[dict], top: int = 25) -> str:
    """Where a kernel's warps wait: stall samples by reason, by opcode, and the
    `top` instructions with the most samples, each with its three largest
    reasons. (An instruction's samples are the cycles a warp sat at it: a
    short-scoreboard wait on an FFMA is the load or MUFU feeding it.)"""
    if not rows:
        return "no instructions\n"
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(_number(r.get(_SAMPLES, "0")) for r in rows) or 1.0
    lines = [f"stall samples: {total:.0f}, instructions executed: "
             f"{sum(_number(r.get('Instructions Executed', '0')) for r in rows):.0f}"]
    by_reason = sorted(((sum(_number(r[c]) for r in rows), c[6:]) for c in reasons),
                       reverse=True)
    lines += [f"  {name:<20} {v:10.0f} {100 * v / total:5.1f}%" for v, name in by_reason[:10]]
    # per opcode: samples, executions and samples by reason (fa4's d64
    # backward and ours differed most in MUFU's fixed-latency waits)
    by_op: dict[str, list] = {}
    for r in rows:
        source = r.get("Source", "").strip()
        entry = by_op.setdefault(opcode(source) if source else "?", [0.0, 0.0, {}])
        entry[0] += _number(r.get(_SAMPLES, "0"))
        entry[1] += _number(r.get("Instructions Executed", "0"))
        for c in reasons:
            entry[2][c[6:]] = entry[2].get(c[6:], 0.0) + _number(r[c])
    lines.append(f"{'opcode':<12} {'samples':>9} {'%':>6} {'executed':>14}  largest reasons")
    for op, (samples, executed, why) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:15]:
        lines.append(f"{op:<12} {samples:9.0f} {100 * samples / total:5.1f}% {executed:14.0f}"
                     f"  {_largest(why.items())}")
    lines.append(f"top {top} instructions by stall samples:")
    for r in sorted(rows, key=lambda r: -_number(r.get(_SAMPLES, "0")))[:top]:
        samples = _number(r.get(_SAMPLES, "0"))
        why = _largest((c[6:], _number(r[c])) for c in reasons)
        lines.append(f"  {r.get('Address', '?'):>16} {samples:7.0f} {100 * samples / total:5.1f}%  "
                     f"{r.get('Source', '').strip()[:64]:<64} {why}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if os.environ.get(WORKLOAD_ENV):
        run_workload(args)
        return
    if shutil.which("ncu") is None:
        raise SystemExit("profiling.ncu: needs Nsight Compute: `ncu` is not on PATH (it comes "
                         "with the CUDA toolkit, or from developer.nvidia.com/nsight-compute)")
    require_cuda("ncu")
    if args.backend == "fa4":
        require_fa4("ncu --backend fa4")
    report = args.out or os.path.join(tempfile.mkdtemp(prefix="cute_fa_ncu_"), "ncu")
    os.makedirs(os.path.dirname(report) or ".", exist_ok=True)
    print(f"profiling.ncu: writing the report to {report}.ncu-rep", flush=True)
    subprocess.run(ncu_command(args, report, argv), check=True,
                   env=dict(os.environ, **{WORKLOAD_ENV: "1"}))
    summary = summarize(report + ".ncu-rep")
    raw = subprocess.run(["ncu", "--import", report + ".ncu-rep", "--page", "raw", "--csv"],
                         capture_output=True, text=True).stdout
    written = [report + ".ncu-rep", report + "_raw.csv", report + ".txt"]
    with open(report + "_raw.csv", "w") as f:
        f.write(raw)
    with open(report + ".txt", "w") as f:
        f.write(summary)
    if args.source:
        source = subprocess.run(["ncu", "--import", report + ".ncu-rep", "--page", "source",
                                 "--csv", "--print-source", "sass"],
                                capture_output=True, text=True, check=True).stdout
        with open(report + "_source.csv", "w") as f:
            f.write(source)
        hotspots = "".join(f"kernel: {name[:110]}\n{source_hotspots(rows)}"
                           for name, rows in source_kernels(source).items())
        with open(report + "_source.txt", "w") as f:
            f.write(hotspots)
        written += [report + "_source.csv", report + "_source.txt"]
        print(hotspots)
    print(summary)
    print("wrote " + ", ".join(written))


if __name__ == "__main__":
    main()
