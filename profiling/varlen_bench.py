"""Packed-batch (varlen) benchmark: ours against flash-attn-4's varlen
forward, and against our own dense kernels at the batch's mean length.

    python -m cute_fa.profiling.varlen_bench --head-dims 64,128 --tokens 16384,65536 \\
        --causal --out docs/results/varlen/varlen

Each problem packs sequences whose lengths are drawn log-uniform from
--min-len to --max-len (a fixed seed) until --tokens tokens are filled, the
last one cut to fit. Throughput counts the useful work only, the pairs each
sequence's mask leaves (4·h·d per pair forward, 2.5x that backward), so
the varlen rows and the dense row at the same mean length compare directly.
Implementations run round-robin in one process on the same inputs
(timing.time_interleaved). Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import itertools
import sys

import torch

from . import report
from .cli import choice_list, command_parser, csv_list, positive_int, require_cuda
from .problem import (add_head_dim_option, add_throughput_options, check_heads_dim_total,
                      packed_lengths, timed_step)
from .timing import time_interleaved


def useful_flops(lengths: list[int], heads: int, head_dim: int, causal: bool,
                 direction: str) -> float:
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lengths)
    return 4.0 * heads * head_dim * pairs * (3.5 if direction == "fwd_bwd" else 1.0)


def _callables(lengths, heads, head_dim, causal, direction, backends):
    from cute_fa import flash_attn_func, flash_attn_varlen_func

    dev, dtype = "cuda", torch.bfloat16
    total, max_len = sum(lengths), max(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)
    grad = direction == "fwd_bwd"
    q, k, v = (torch.randn(total, heads, head_dim, device=dev, dtype=dtype, requires_grad=grad)
               for _ in range(3))
    do = torch.randn(total, heads, head_dim, device=dev, dtype=dtype)
    mean_len = max(round(total / len(lengths)), 1)
    dense = [torch.randn(total // mean_len, mean_len, heads, head_dim, device=dev, dtype=dtype,
                         requires_grad=grad) for _ in range(3)]

    fns = {}
    if "cute" in backends:
        fns["cute"] = timed_step(lambda: flash_attn_varlen_func(q, k, v, cu, cu, max_len,
                                                                max_len, causal=causal),
                                 do if grad else None, (q, k, v))
    if "fa4" in backends:
        try:
            from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
            fns["fa4"] = timed_step(lambda: fa4_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                       max_seqlen_q=max_len,
                                                       max_seqlen_k=max_len, causal=causal),
                                    do if grad else None, (q, k, v))
        except Exception as exc:  # noqa: BLE001 (reported, not fatal)
            print(f"fa4: unavailable ({exc})", file=sys.stderr)
    if "cute_dense" in backends:
        fns["cute_dense"] = timed_step(
            lambda: flash_attn_func(*dense, causal=causal),
            do[: dense[0].shape[0] * mean_len].view(dense[0].shape) if grad else None,
            tuple(dense))
    dense_lengths = [mean_len] * dense[0].shape[0]
    return fns, dense_lengths, mean_len


BACKENDS = ("cute", "fa4", "cute_dense")


def build_parser():
    p = command_parser("varlen_bench", __doc__)
    add_head_dim_option(p, [64, 128], multiple=True)
    p.add_argument("--tokens", type=csv_list(int), default=[16384, 65536],
                   help="tokens per packed batch, comma-separated (default: 16384,65536)")
    p.add_argument("--min-len", type=positive_int, default=64,
                   help="shortest sequence drawn (default: 64)")
    p.add_argument("--max-len", type=positive_int, default=8192,
                   help="longest sequence drawn (default: 8192)")
    p.add_argument("--causal", action="store_true", help="causal masks (default: full)")
    add_throughput_options(p)
    p.add_argument("--backends", type=choice_list(BACKENDS), default=list(BACKENDS),
                   help="cute (ours, packed), fa4 (flash-attn-4's varlen), cute_dense (ours "
                        "on a dense batch at the mean length) (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths (default: 0)")
    report.add_out_option(p)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.min_len > args.max_len:
        p.error(f"--max-len: expected at least --min-len {args.min_len}, got {args.max_len}")
    check_heads_dim_total(p, args)
    require_cuda("varlen_bench")
    backends = args.backends
    rows = []
    for head_dim, tokens, direction in itertools.product(args.head_dims, args.tokens,
                                                         args.directions):
        heads = args.heads_dim_total // head_dim
        lengths = packed_lengths(tokens, args.min_len, args.max_len, args.seed)
        fns, dense_lengths, mean_len = _callables(lengths, heads, head_dim, args.causal,
                                                  direction, backends)
        times = time_interleaved(fns, repeats=args.repeats)
        for name, (ms, repeats) in times.items():
            work = dense_lengths if name == "cute_dense" else lengths
            flops = useful_flops(work, heads, head_dim, args.causal, direction)
            rows.append(dict(backend=name, direction=direction, head_dim=head_dim, heads=heads,
                             tokens=tokens, sequences=len(work), mean_len=mean_len,
                             max_len=max(work), causal=args.causal, ms=ms, repeats=repeats,
                             tflops=flops / ms / 1e9))
        line = "  ".join(f"{r['backend']} {r['tflops']:.1f}" for r in rows[-len(times):])
        print(f"d={head_dim} tokens={tokens} seqs={len(lengths)} {direction}: {line} TFLOP/s")
    report.write_command_report(
        "varlen_bench", argv, args, rows,
        lambda rows, env, command: format_markdown(rows, env, command, vars(args)))
    return 0


def format_markdown(rows: list[dict], env: dict, command: str, arguments: dict) -> str:
    """One table: per problem and direction, each implementation's useful
    TFLOP/s, ours over flash-attn-4, ours over our dense kernel at the mean
    length."""
    lines = [f"# Packed batches (varlen), {'causal' if arguments['causal'] else 'full'}", "",
             *report.machine_lines(env),
             f"- command: `{command}`",
             f"- lengths log-uniform in [{arguments['min_len']}, {arguments['max_len']}], "
             f"seed {arguments['seed']}; useful FLOPs only (each sequence's own pairs)", "",
             "| head dim | tokens | sequences (mean len) | direction | ours TFLOP/s | fa4 "
             "TFLOP/s | ours / fa4 | ours dense at mean len | ours / dense |",
             "|---|---|---|---|---|---|---|---|---|"]
    key = lambda r: (r["head_dim"], r["tokens"], r["direction"])  # noqa: E731
    for (head_dim, tokens, direction), group in itertools.groupby(sorted(rows, key=key), key):
        by = {r["backend"]: r for r in group}
        ours, fa4, dense = by.get("cute"), by.get("fa4"), by.get("cute_dense")
        if ours is None:
            continue

        def cell(r):
            return f"{r['tflops']:.1f}" if r else "n/a"

        def ratio(r):
            return f"{ours['tflops'] / r['tflops']:.3f}" if r else "n/a"

        lines.append(f"| {head_dim} | {tokens} | {ours['sequences']} ({ours['mean_len']}) | "
                     f"{direction} | {cell(ours)} | {cell(fa4)} | {ratio(fa4)} | {cell(dense)} | "
                     f"{ratio(dense)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
