"""Where one benchmark call's GPU time goes, kernel by kernel, per backend.

    python -m cute_fa.profiling.breakdown --direction bwd --head-dim 128 --seqlen 8192
    python -m cute_fa.profiling.breakdown --backends cute,fa4 --direction fwd_bwd --causal

The same callables as profiling.bench (same problem, same inputs), each run
--repeats times under torch.profiler. For every backend: each CUDA kernel's
launches per call and mean time, the sum of kernel time per call, and the
median CUDA-event time per call (timing.time_interleaved, L2 flushed), once
with the call queued ahead of the GPU (what profiling.bench reports: kernels
plus the gaps between them) and once from an idle GPU (host latency
included). The profiled calls run back to back without the L2 flush.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from .backends import BACKENDS, BackendUnavailable, check_items, make_callable
from .flops import attention_flops, tflops
from .problem import DTYPES, make_qkv, problem_shape


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cute_fa.profiling.breakdown", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="cute,fa4,sdpa_cudnn")
    p.add_argument("--direction", default="bwd", choices=["fwd", "bwd", "fwd_bwd"])
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--total-tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    check_items(p, "--backends", args.backends, BACKENDS)
    if args.repeats < 1:
        p.error(f"--repeats: expected a positive integer, got {args.repeats}")
    return args


def kernel_times(fn, repeats: int) -> dict[str, tuple[int, float]]:
    """{kernel name: (launches, total microseconds)} over `repeats` calls."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            out[event.name][0] += 1
            out[event.name][1] += event.device_time
    return {name: (n, us) for name, (n, us) in out.items()}


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profiling.breakdown: needs a CUDA GPU")
    from .timing import first_call, time_interleaved

    batch, heads = problem_shape(args.head_dim, args.seqlen, args.total_tokens, args.heads)
    q, k, v = make_qkv(batch, args.seqlen, args.seqlen, heads, heads, args.head_dim,
                       DTYPES[args.dtype], seed=0)
    flops = attention_flops(batch, heads, args.seqlen, args.seqlen, args.head_dim, args.causal,
                            args.direction)
    print(f"{args.direction} {args.dtype} d={args.head_dim} seqlen={args.seqlen} batch={batch} "
          f"heads={heads} causal={args.causal}; per call, mean of {args.repeats}")
    fns = {}
    for name in args.backends:
        try:
            fn = make_callable(name, q, k, v, args.causal, args.head_dim ** -0.5, args.direction)
            first_call(fn)
            fns[name] = fn
        except BackendUnavailable as exc:
            print(f"\n{name}: unavailable: {exc}")
    queued = time_interleaved(fns, repeats=args.repeats)
    isolated = time_interleaved(fns, repeats=args.repeats, include_host_latency=True)
    for name, fn in fns.items():
        times = kernel_times(fn, args.repeats)
        total_ms = sum(us for _, us in times.values()) / args.repeats / 1e3
        queued_ms, isolated_ms = queued[name][0], isolated[name][0]
        print(f"\n{name}: kernels {total_ms:.3f} ms ({tflops(flops, total_ms):.1f} TFLOP/s); "
              f"events, queued ahead {queued_ms:.3f} ms ({tflops(flops, queued_ms):.1f}), "
              f"gaps {queued_ms - total_ms:+.3f}; events from idle {isolated_ms:.3f} ms "
              f"({tflops(flops, isolated_ms):.1f}), host latency {isolated_ms - queued_ms:+.3f}")
        for kname, (n, us) in sorted(times.items(), key=lambda kv: -kv[1][1]):
            print(f"  {us / args.repeats / 1e3:8.3f} ms  {n / args.repeats:4.1f}x  {kname[:110]}")


if __name__ == "__main__":
    main()
