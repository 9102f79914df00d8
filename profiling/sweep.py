"""Sweep the fields of a kernel's config over one problem and rank them.

    python -m cute_fa.profiling.sweep --head-dim 128 --seqlen 8192 --causal \\
        --vary persistent=0,1 pingpong=0,1 intra_wg_overlap=0,1 kv_stages=2,3
    python -m cute_fa.profiling.sweep --kernel bwd --head-dim 64 --vary tile_m=64,128

Every variant is first checked against the fp32 reference on a short version
of the problem (same config, head dim, causal, GQA; seqlen_q/k cut to
--check-seqlen and made ragged): the output (forward) or dQ, dK, dV
(backward) within twice torch's low-precision error. Only variants that pass
are timed (the backward: preprocess + main kernel + postprocess, on a saved
forward). Variants that fail validation (FwdConfig/BwdConfig.validate),
compilation or the check are listed with the reason. Ranked table last; JSON
with every variant to <out>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from cute_fa.kernels.config import default_config, parse_field

from .flops import attention_flops, tflops
from .problem import DTYPES, make_qkv, problem_shape


def parse_vary(items: list[str], kind: str = "fwd") -> dict[str, list]:
    out = {}
    for item in items:
        name, _, values = item.partition("=")
        try:
            out[name] = [parse_field(name, v, kind) for v in values.split(",") if v]
        except ValueError as exc:
            raise SystemExit(f"--vary: {exc}") from None
    return out


def variants(base, vary: dict[str, list]) -> list:
    names = list(vary)
    return [base.replace(**dict(zip(names, combo)))
            for combo in itertools.product(*(vary[n] for n in names))]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m cute_fa.profiling.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", default="fwd", choices=["fwd", "bwd"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--total-tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--gqa", type=int, default=1)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--vary", nargs="+", default=None,
                   help="FIELD=v1,v2 ... (cartesian product over the default config)")
    p.add_argument("--check-seqlen", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default="bench_out/sweep")
    args = p.parse_args(argv)
    if args.vary is None:
        args.vary = ["persistent=0,1"] if args.kernel == "fwd" else ["qdo_stages=1,2"]
    vary = parse_vary(args.vary, args.kernel)
    if not torch.cuda.is_available():
        raise SystemExit("profiling.sweep: needs a CUDA GPU")
    from .timing import time_cuda

    batch, heads = problem_shape(args.head_dim, args.seqlen, args.total_tokens, args.heads)
    scale = args.head_dim ** -0.5

    def make(b, sq, sk):
        return make_qkv(b, sq, sk, heads, heads // args.gqa, args.head_dim, DTYPES[args.dtype])

    check_inputs = make(1, args.check_seqlen + 7, args.check_seqlen + 29)
    problem = make(batch, args.seqlen, args.seqlen)
    case = (_forward_case if args.kernel == "fwd" else _backward_case)(
        check_inputs, problem, scale, args.causal)
    flops = attention_flops(batch, heads, args.seqlen, args.seqlen, args.head_dim, args.causal,
                            "fwd" if args.kernel == "fwd" else "bwd")

    base = default_config(args.kernel, args.head_dim, args.causal)
    results = []
    for config in variants(base, vary):
        row = {"config": config.__dict__.copy(), "status": "ok"}
        try:
            config.validate(args.head_dim)
            row["max_error"] = case.check(config)
            t = time_cuda(lambda: case.run(config), repeats=args.repeats)
            row.update(median_ms=t.median_ms, tflops=tflops(flops, t.median_ms))
        except Exception as exc:
            # the DSL's errors can open with a blank line: keep the first words
            first = next((l.strip() for l in str(exc).splitlines() if l.strip()), "")
            row["status"] = f"{type(exc).__name__}: {first[:140]}"
        results.append(row)
        print(f"  {row['status']:<4} {row.get('tflops') or 0:7.1f} TFLOP/s  {row['config']}",
              flush=True)

    ok = sorted((r for r in results if r["status"] == "ok"), key=lambda r: -r["tflops"])
    varied = list(vary)
    print(f"\nproblem: {args.kernel} {args.dtype} d={args.head_dim} seqlen={args.seqlen} batch={batch} "
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


class _Case:
    """check(config) -> max error (raises past tolerance); run(config) -> one timed call."""

    def __init__(self, check, run):
        self.check, self.run = check, run


def _errors_within(name_errs, tolerances) -> float:
    for (name, err), tol in zip(name_errs, tolerances):
        if not err <= tol:
            raise AssertionError(f"{name} max error {err:.3e} > tolerance {tol:.3e}")
    return max(err for _, err in name_errs)


def _forward_case(check_inputs, problem, scale, causal) -> _Case:
    from cute_fa.ops import forward_cuda
    from cute_fa.reference import attention_reference

    ref, _ = attention_reference(*check_inputs, scale, causal)
    low, _ = attention_reference(*check_inputs, scale, causal, compute_dtype=None)
    tolerance = 2 * (low.float() - ref.float()).abs().max().item() + 1e-5

    def check(config):
        out, _ = forward_cuda(*check_inputs, scale, causal, config)
        return _errors_within([("out", (out.float() - ref.float()).abs().max().item())],
                              [tolerance])

    return _Case(check, lambda config: forward_cuda(*problem, scale, causal, config))


def _backward_case(check_inputs, problem, scale, causal) -> _Case:
    from cute_fa.ops import backward_cuda, forward_cuda
    from cute_fa.reference import attention_backward_reference

    def saved(inputs):
        out, lse = forward_cuda(*inputs, scale, causal)
        return torch.randn_like(inputs[0]), out, lse

    grad_out, out, lse = saved(check_inputs)
    args = (grad_out, *check_inputs, out, lse, scale, causal)
    ref = attention_backward_reference(*args)
    low = attention_backward_reference(*args, compute_dtype=None)
    tolerances = [2 * (lo.float() - r.float()).abs().max().item() + 1e-4
                  for lo, r in zip(low, ref)]

    def check(config):
        grads = backward_cuda(*args, config=config)
        return _errors_within([(n, (g.float() - r.float()).abs().max().item())
                               for n, g, r in zip(("dq", "dk", "dv"), grads, ref)], tolerances)

    p_grad_out, p_out, p_lse = saved(problem)
    return _Case(check, lambda config: backward_cuda(p_grad_out, *problem, p_out, p_lse, scale,
                                                     causal, config=config))


if __name__ == "__main__":
    main()
