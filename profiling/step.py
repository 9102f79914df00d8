"""Where the host time of one training step goes, every backend side by side.

    python -m cute_fa.profiling.step --compile                      # the default model's step
    python -m cute_fa.profiling.step --compile --backends cute,sdpa_cudnn --top 30

Without a CUDA graph the model's training step is paced by its host (its host
work outlasts its kernels), so two backends whose kernels differ by a few ms
per step can rank the other way round in tokens/s. This command runs the step
of `profiling.train` (the same Trainer: model, AdamW, clipping, bf16 autocast,
optional torch.compile) for each backend and reports:
- ms/step: wall time per step, median of --rounds interleaved rounds of
  --steps-per-round steps (backends take turns, so the host's drift falls on
  all of them alike); the ratio is to the first backend;
- under torch.profiler, --profile-rounds interleaved rounds of
  --profile-steps steps (each figure the median over rounds): the host's own
  time per step (self CPU of every recorded op and launch, Python included where it
  runs inside an op), the GPU time per step, kernel launches and allocations
  per step, and each attention op's host time per call (CPU total, launches
  and allocations inside it included) and GPU time per call.
--top N also prints the N ops with the most self CPU time per backend.
Prints its tables and writes nothing but the training data's cache (see
profiling.data; --data reads another file).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType

from cute_fa.attention_backends import BACKEND_NAMES

from .backends import add_backends_option
from .cli import add_device_option, command_parser, nonnegative_int, positive_int
from .data import add_data_option, ensure_dataset
from .train import Trainer, add_model_options, add_step_options, initial_state, model_config
from .train import parse_args as train_args

# Host-side records of a kernel launch, by API (driver, runtime).
LAUNCH_EVENTS = ("cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernel", "cudaLaunchKernelExC")
ALLOC_EVENTS = ("aten::empty", "aten::empty_strided")
# The attention ops as the profiler names them: ours, and SDPA's per backend.
ATTENTION_OP_PREFIXES = ("cute_fa::", "aten::_scaled_dot_product_", "aten::_flash_attention",
                         "aten::_efficient_attention", "aten::_cudnn_attention")


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("step", __doc__)
    add_backends_option(p, ["cute", "sdpa_cudnn", "sdpa_flash"], BACKEND_NAMES)
    add_model_options(p)
    add_step_options(p)
    p.add_argument("--warmup-steps", type=positive_int, default=5,
                   help="untimed steps per backend first: compilation, allocator warm-up "
                        "(default: 5)")
    p.add_argument("--rounds", type=positive_int, default=6,
                   help="timed rounds, backends taking turns (default: 6)")
    p.add_argument("--steps-per-round", type=positive_int, default=10,
                   help="steps per backend and timed round (default: 10)")
    p.add_argument("--profile-steps", type=positive_int, default=5,
                   help="steps per backend and profiled round (default: 5)")
    p.add_argument("--profile-rounds", type=positive_int, default=3,
                   help="profiled rounds under torch.profiler, backends taking turns "
                        "(default: 3)")
    p.add_argument("--top", type=nonnegative_int, default=0, metavar="N",
                   help="also print the N ops with the most self CPU time per backend "
                        "(default: 0, none)")
    add_data_option(p)
    add_device_option(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _trainer_args(args) -> argparse.Namespace:
    """profiling.train's arguments for the same step, with room for every step
    this command runs and one log window per round."""
    total = (args.warmup_steps + args.rounds * args.steps_per_round
             + args.profile_rounds * args.profile_steps)
    argv = ["--config", args.config, "--seq", str(args.seq), "--batch", str(args.batch),
            "--steps", str(total), "--log-every", str(args.steps_per_round),
            "--data", args.data, "--backends", ",".join(args.backends)]
    argv += ["--compile"] * args.compile + ["--cuda-graph"] * args.cuda_graph
    argv += [] if args.layers is None else ["--layers", str(args.layers)]
    return train_args(argv)


@dataclass
class OpCost:
    """One attention op: host time per call (CPU total) and GPU time per call, in us."""
    name: str
    calls_per_step: float
    host_us: float
    gpu_us: float


@dataclass
class StepCost:
    backend: str
    ms_per_step: float | None = None
    host_ms: float | None = None   # self CPU of every recorded event, per step
    gpu_ms: float | None = None
    launches: float | None = None  # per step
    allocations: float | None = None
    attention_ops: list[OpCost] = field(default_factory=list)
    top_table: str = ""
    status: str = "ok"


def _device_us(event, inclusive: bool = False) -> float:
    # torch >= 2.4 names it device time; older releases call it CUDA time.
    total = "device_time_total" if inclusive else "self_device_time_total"
    return getattr(event, total, None) or getattr(event, total.replace("device", "cuda"), 0.0)


def summarize_profile(events, steps: int, top: int = 0) -> dict:
    """StepCost's profiled fields from torch.profiler's key_averages()."""
    by_name = {e.key: e for e in events}

    def per_step(names):
        return sum(by_name[n].count for n in names if n in by_name) / steps

    # Totals include what runs beneath an op: an SDPA call records a wrapper
    # and the kernel op inside it, and the wrapper's row is the whole call.
    ops = [OpCost(e.key, e.count / steps, e.cpu_time_total / e.count,
                  _device_us(e, inclusive=True) / e.count)
           for e in events if e.key.startswith(ATTENTION_OP_PREFIXES) and e.count]
    # Kernels are events of their own (device type CUDA); an op's self device
    # time repeats theirs, so only the kernels are summed (as torch's table does).
    kernels = [e for e in events
               if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    out = dict(host_ms=sum(e.self_cpu_time_total for e in events) / steps / 1e3,
               gpu_ms=sum(_device_us(e) for e in kernels) / steps / 1e3,
               launches=per_step(LAUNCH_EVENTS), allocations=per_step(ALLOC_EVENTS),
               attention_ops=sorted(ops, key=lambda o: o.name))
    if top:
        out["top_table"] = events.table(sort_by="self_cpu_time_total", row_limit=top,
                                        max_name_column_width=60)
    return out


def measure(args) -> list[StepCost]:
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.data = ensure_dataset(args.data)
    targs = _trainer_args(args)
    init_state = initial_state(model_config(args.config, args.seq, args.layers), 0, device)
    results = {b: StepCost(b) for b in args.backends}
    trainers = {}
    for backend in args.backends:
        try:
            trainers[backend] = Trainer(backend, init_state, targs, device, bar_position=None,
                                        csv_log=False)
            trainers[backend].run(args.warmup_steps)  # compiles, warms the allocator
        except Exception as exc:  # a failing backend is a row, not the end of the run
            results[backend].status = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
            trainers.pop(backend, None)
    samples = {b: [] for b in trainers}
    for _ in range(args.rounds):
        for backend, trainer in trainers.items():
            start = time.perf_counter()
            trainer.run(args.steps_per_round)  # synchronizes before and after
            samples[backend].append((time.perf_counter() - start) / args.steps_per_round * 1e3)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    # The host drifts within minutes: profiles taken one backend after the
    # other would compare different hosts, so they are interleaved too.
    profiles = {b: [] for b in trainers}
    for _ in range(args.profile_rounds):
        for backend, trainer in trainers.items():
            with profile(activities=activities) as prof:
                trainer.run(args.profile_steps)
            profiles[backend].append(summarize_profile(prof.key_averages(), args.profile_steps,
                                                       args.top))
    for backend in trainers:
        result = results[backend]
        result.ms_per_step = statistics.median(samples[backend])
        for name, value in median_profile(profiles[backend]).items():
            setattr(result, name, value)
    return [results[b] for b in args.backends]


def median_profile(rounds: list[dict]) -> dict:
    """Each figure of summarize_profile's rounds, the median over rounds
    (attention ops by name; the top table of the last round)."""
    out = {key: statistics.median(r[key] for r in rounds)
           for key in ("host_ms", "gpu_ms", "launches", "allocations")}
    by_name: dict[str, list[OpCost]] = {}
    for r in rounds:
        for op in r["attention_ops"]:
            by_name.setdefault(op.name, []).append(op)
    out["attention_ops"] = [
        OpCost(name, statistics.median(o.calls_per_step for o in ops),
               statistics.median(o.host_us for o in ops), statistics.median(o.gpu_us for o in ops))
        for name, ops in sorted(by_name.items())]
    out["top_table"] = rounds[-1].get("top_table", "")
    return out


def format_table(results: list[StepCost]) -> str:
    def num(value, fmt):
        return format(value, fmt) if value is not None else "-"

    base = results[0].ms_per_step if results else None
    lines = [f"{'backend':<12} {'ms/step':>8} {'vs first':>8} {'host ms':>8} {'GPU ms':>7} "
             f"{'launches':>8} {'allocs':>7}  status"]
    for r in results:
        ratio = r.ms_per_step / base if r.ms_per_step and base else None
        lines.append(f"{r.backend:<12} {num(r.ms_per_step, '8.2f')} {num(ratio, '8.3f')} "
                     f"{num(r.host_ms, '8.2f')} {num(r.gpu_ms, '7.2f')} "
                     f"{num(r.launches, '8.0f')} {num(r.allocations, '7.0f')}  {r.status}")
    lines.append("")
    lines.append(f"{'backend':<12} {'attention op':<56} {'calls/step':>10} {'host us/call':>12} "
                 f"{'GPU us/call':>11}")
    for r in results:
        for op in r.attention_ops:
            lines.append(f"{r.backend:<12} {op.name:<56} {op.calls_per_step:>10.0f} "
                         f"{op.host_us:>12.1f} {op.gpu_us:>11.1f}")
    return "\n".join(lines)


def main(argv=None) -> list[StepCost]:
    args = parse_args(argv)
    results = measure(args)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"training step, config {args.config}, seq {args.seq}, batch {args.batch}, "
          f"compile={args.compile}, cuda_graph={args.cuda_graph}, {where}; ms/step: median of "
          f"{args.rounds} interleaved rounds of {args.steps_per_round}; profiled: median of "
          f"{args.profile_rounds} interleaved rounds of {args.profile_steps} steps (host ms: "
          f"self CPU of all recorded ops, per step)")
    print(format_table(results))
    for r in results:
        if r.top_table:
            print(f"\n{r.backend}: top self-CPU ops over {args.profile_steps} steps (last round)\n"
                  f"{r.top_table}")
    return results


if __name__ == "__main__":
    main()
