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
Prints its report and writes nothing. Needs an sm_90 CUDA GPU (H100/H200).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from .backends import (BACKENDS, BackendUnavailable, add_backends_option, add_direction_option,
                       make_callable)
from .cli import command_parser, positive_int, require_cuda
from .flops import attention_flops, tflops
from .problem import (DTYPES, add_causal_option, add_dtype_option, add_head_dim_option,
                      add_size_options, check_gqa, make_qkv, problem_shape)


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("breakdown", __doc__)
    add_backends_option(p, ["cute", "fa4", "sdpa_cudnn"], BACKENDS)
    add_direction_option(p, "bwd")
    add_dtype_option(p)
    add_head_dim_option(p)
    add_size_options(p, 8192)
    add_causal_option(p)
    p.add_argument("--repeats", type=positive_int, default=10,
                   help="calls per backend, profiled and timed (default: 10)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_gqa(p, args, [args.head_dim])
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
    require_cuda("breakdown")
    from .timing import first_call, time_interleaved

    causal = args.causal == "yes"
    batch, heads = problem_shape(args.head_dim, args.seqlen, args.total_tokens, args.heads)
    q, k, v = make_qkv(batch, args.seqlen, args.seqlen, heads, heads // args.gqa, args.head_dim,
                       DTYPES[args.dtype], seed=0)
    flops = attention_flops(batch, heads, args.seqlen, args.seqlen, args.head_dim, causal,
                            args.direction)
    print(f"{args.direction} {args.dtype} d={args.head_dim} seqlen={args.seqlen} batch={batch} "
          f"heads={heads} gqa={args.gqa} causal={causal}; per call, mean of {args.repeats}")
    fns = {}
    for name in args.backends:
        try:
            fn = make_callable(name, q, k, v, causal, args.head_dim ** -0.5, args.direction)
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
