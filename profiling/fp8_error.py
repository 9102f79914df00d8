"""FP8 attention error with and without incoherent processing, on the
emulation of the FP8 forward's arithmetic (cute_fa.fp8): RMSE and largest
error of the output against the fp32 attention of the original inputs.

    python -m cute_fa.profiling.fp8_error --out docs/results/fp8/incoherent

Inputs: normal, uniform in [-1, 1], and outlier-heavy (normal, 0.1 % of the
q and k entries x20 and one q/k feature x10), fixed seeds. q, k, v are
quantized per (batch, KV head) (quantize_fp8); with incoherent processing q
and k are first rotated by one random Hadamard matrix (incoherent). Runs on
the CPU (no kernel: the emulation is the reference the FP8 kernel's error
is measured against). Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import itertools
import sys

import torch

from cute_fa.fp8 import fp8_attention_emulation, incoherent, quantize_fp8
from cute_fa.reference import attention_reference

from . import report
from .cli import command_parser, csv_list
from .problem import add_dense_shape_options, check_heads_kv

KINDS = ("normal", "uniform", "outliers")


def inputs(kind: str, batch: int, seqlen: int, heads: int, heads_kv: int, head_dim: int,
           seed: int):
    """q, k, v (fp32) of one input kind (KINDS), from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen, heads, head_dim), (batch, seqlen, heads_kv, head_dim),
              (batch, seqlen, heads_kv, head_dim)]
    if kind == "uniform":
        return tuple(torch.rand(s, generator=gen) * 2 - 1 for s in shapes)
    q, k, v = (torch.randn(s, generator=gen) for s in shapes)
    if kind == "outliers":
        for t in (q, k):
            t[torch.rand(t.shape, generator=gen) < 1e-3] *= 20
            t[..., 3] *= 10
    return q, k, v


def measure(kind, head_dim, causal, rotated, args) -> dict:
    q, k, v = inputs(kind, args.batch, args.seqlen, args.heads, args.heads_kv, head_dim,
                     args.seed)
    exact, _ = attention_reference(q, k, v, None, causal)
    if rotated:
        q, k = incoherent(q, k, seed=args.seed)
    (q8, qs), (k8, ks), (v8, vs) = (quantize_fp8(q, args.heads_kv), quantize_fp8(k),
                                    quantize_fp8(v))
    out, _ = fp8_attention_emulation(q8, k8, v8, qs, ks, vs, causal=causal)
    diff = out - exact
    return dict(kind=kind, head_dim=head_dim, causal=causal, incoherent=rotated,
                rmse=diff.square().mean().sqrt().item(), max_error=diff.abs().max().item(),
                output_rms=exact.square().mean().sqrt().item())


def build_parser():
    p = command_parser("fp8_error", __doc__)
    p.add_argument("--head-dims", type=csv_list(int), default=[64, 128],
                   help="head dims, powers of 2 (default: 64,128)")
    add_dense_shape_options(p, batch=2, seqlen=1024, heads=8, heads_kv=2)
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    report.add_out_option(p)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_heads_kv(p, args)
    for d in args.head_dims:
        if d <= 0 or d & (d - 1):
            p.error(f"--head-dims: expected powers of 2 (incoherent processing), got {d}")
    rows = [measure(kind, d, causal, rotated, args) for kind, d, causal, rotated in
            itertools.product(KINDS, args.head_dims, (False, True), (False, True))]
    env = report.environment()
    argv = sys.argv[1:] if argv is None else argv
    report.write_table_report(args.out, rows, env, vars(args), format_markdown(
        rows, env, report.command_line("fp8_error", argv), args))
    return 0


def format_markdown(rows, env, command, args) -> str:
    lines = ["# FP8 attention error, with and without incoherent processing", "",
             f"- torch {env.get('torch', torch.__version__)}, on the CPU (the emulation: "
             "cute_fa.fp8.fp8_attention_emulation)",
             f"- command: `{command}`",
             f"- batch {args.batch}, seqlen {args.seqlen}, {args.heads} query heads, "
             f"{args.heads_kv} KV heads, seed {args.seed}; error of the output against the "
             "fp32 attention of the original (unquantized) inputs", "",
             "| inputs | head dim | causal | RMSE plain | RMSE incoherent | plain / incoherent "
             "| max error plain | max error incoherent | output RMS |",
             "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["kind"], r["head_dim"], r["causal"], r["incoherent"]): r for r in rows}
    for kind, d, causal in itertools.product(KINDS, args.head_dims, (False, True)):
        plain, rotated = by[kind, d, causal, False], by[kind, d, causal, True]
        lines.append(f"| {kind} | {d} | {int(causal)} | {plain['rmse']:.3e} | "
                     f"{rotated['rmse']:.3e} | {plain['rmse'] / rotated['rmse']:.2f} | "
                     f"{plain['max_error']:.3e} | {rotated['max_error']:.3e} | "
                     f"{plain['output_rms']:.3e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
