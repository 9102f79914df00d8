"""Sweep the fields of the forward kernel's config over one problem and rank them.

    python -m profiling.sweep --head-dim 128 --seqlen 8192 --causal \\
        --vary persistent=0,1 pingpong=0,1 intra_wg_overlap=0,1 kv_stages=2,3

Every variant is first checked against the fp32 reference on a short version
of the problem (same config, head dim, causal, GQA; seqlen_q/k cut to
--check-seqlen and made ragged) and only timed if it passes. Variants that
fail validation (FwdConfig.validate), compilation or the check are listed
with the reason. Ranked table last; JSON with every variant to <out>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from cute_kernels.config import FwdConfig, default_fwd_config, parse_field

from .flops import attention_flops, batch_for, tflops
from .problem import DTYPES, default_heads, make_qkv


def parse_vary(items: list[str]) -> dict[str, list]:
    out = {}
    for item in items:
        name, _, values = item.partition("=")
        try:
            out[name] = [parse_field(name, v) for v in values.split(",") if v]
        except ValueError as exc:
            raise SystemExit(f"--vary: {exc}") from None
    return out


def variants(base: FwdConfig, vary: dict[str, list]) -> list[FwdConfig]:
    names = list(vary)
    return [base.replace(**dict(zip(names, combo)))
            for combo in itertools.product(*(vary[n] for n in names))]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m profiling.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--total-tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--gqa", type=int, default=1)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--vary", nargs="+", default=["persistent=0,1"],
                   help="FIELD=v1,v2 ... (cartesian product over the default config)")
    p.add_argument("--check-seqlen", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default="bench_out/sweep")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profiling.sweep: needs a CUDA GPU")
    from python_api.ops import forward_cuda
    from python_api.reference import attention_reference
    from .timing import time_cuda

    heads = args.heads or default_heads(args.head_dim)
    batch = batch_for(args.total_tokens, args.seqlen)
    scale = args.head_dim ** -0.5

    def make(b, sq, sk):
        return make_qkv(b, sq, sk, heads, heads // args.gqa, args.head_dim, DTYPES[args.dtype])

    check_inputs = make(1, args.check_seqlen + 7, args.check_seqlen + 29)
    ref, _ = attention_reference(*check_inputs, scale, args.causal)
    low, _ = attention_reference(*check_inputs, scale, args.causal, compute_dtype=None)
    tolerance = 2 * (low.float() - ref.float()).abs().max().item() + 1e-5
    q, k, v = make(batch, args.seqlen, args.seqlen)
    flops = attention_flops(batch, heads, args.seqlen, args.seqlen, args.head_dim, args.causal)

    base = default_fwd_config(args.head_dim, args.causal)
    results = []
    for config in variants(base, parse_vary(args.vary)):
        row = {"config": config.__dict__.copy(), "status": "ok"}
        try:
            config.validate(args.head_dim)
            out, _ = forward_cuda(*check_inputs, scale, args.causal, config)
            err = (out.float() - ref.float()).abs().max().item()
            row["max_error"] = err
            if not err <= tolerance:
                raise AssertionError(f"max error {err:.3e} > tolerance {tolerance:.3e}")
            t = time_cuda(lambda: forward_cuda(q, k, v, scale, args.causal, config),
                          repeats=args.repeats)
            row.update(median_ms=t.median_ms, tflops=tflops(flops, t.median_ms))
        except Exception as exc:
            row["status"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:140]}"
        results.append(row)
        print(f"  {row['status']:<4} {row.get('tflops') or 0:7.1f} TFLOP/s  {row['config']}",
              flush=True)

    ok = sorted((r for r in results if r["status"] == "ok"), key=lambda r: -r["tflops"])
    varied = list(parse_vary(args.vary))
    print(f"\nproblem: {args.dtype} d={args.head_dim} seqlen={args.seqlen} batch={batch} "
          f"heads={heads} gqa={args.gqa} causal={args.causal}; base {base}")
    print(f"{'rank':>4} {'TFLOP/s':>8} {'ms':>8}  " + "  ".join(f"{n:>16}" for n in varied))
    for i, r in enumerate(ok, 1):
        print(f"{i:>4} {r['tflops']:8.1f} {r['median_ms']:8.3f}  "
              + "  ".join(f"{str(r['config'][n]):>16}" for n in varied))
    for r in results:
        if r["status"] != "ok":
            print(f"   -  {r['status']}  " + ", ".join(f"{n}={r['config'][n]}" for n in varied))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"arguments": vars(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
