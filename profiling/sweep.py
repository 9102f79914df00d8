"""Sweep the fields of a kernel's config over one problem and rank them.

    python -m cute_fa.profiling.sweep --head-dim 128 --seqlen 8192 --causal \\
        --vary persistent=0,1 pingpong=0,1 intra_wg_overlap=0,1 kv_stages=2,3
    python -m cute_fa.profiling.sweep --kernel bwd --head-dim 64 --vary tile_m=64,128 --out sweep1
    python -m cute_fa.profiling.sweep --dtype e4m3 --head-dim 128 --vary transpose_warps=1,2,3
    python -m cute_fa.profiling.sweep --block-mask random30 --head-dim 64 --vary kv_stages=2,3
    python -m cute_fa.profiling.sweep --softcap 30 --vary pv_wait_after_exp2=0,8 tile_n=128,160

Every variant (the cartesian product of the --vary values over the op's
default config for the problem) is first checked against the fp32 reference
on a short version of the problem (same config, head dim, causal, GQA;
seqlen_q/k cut to --check-seqlen and made ragged): the output (forward) or
dQ, dK, dV (backward) within twice torch's low-precision error; an e4m3
forward (--dtype e4m3: q, k, v quantized per (batch, KV head), the base
config fp8_config_for_problem's) within 1.5x the RMSE of the emulation of its
arithmetic (cute_fa.fp8), both against the dequantized inputs' attention; under
--block-mask, the block-sparse kernels (base config: the op's for a block
mask) on that mask of profiling.sparse_bench, checked against the reference
on the mask_mod's dense mask. Only variants
that pass are timed (the backward: preprocess + main kernel + postprocess, on
a saved forward). Variants that fail validation (FwdConfig/BwdConfig.validate),
compilation or the check are listed with the reason. One line per variant as
it is done, the ranked table last; with --out PREFIX also <PREFIX>.json with
every variant (nothing is written without it). The config fields are those of
cute_fa.kernels.config (FwdConfig, BwdConfig); a bad field name is answered
with the list. Needs an sm_90 CUDA GPU (H100/H200).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from dataclasses import dataclass

import torch

from cute_fa.kernels.config import (FP8_HEAD_DIMS, Features, fp8_config_for_problem,
                                    fwd_config_for_problem)
from cute_fa.kernels.bwd_config import bwd_config_for_problem
from cute_fa.variants import num_sms

from .cli import (Progress, add_kernel_option, command_parser, config_vary, positive_int,
                  require_cuda)
from .flops import attention_flops, tflops
from .problem import (DTYPES, add_causal_option, add_head_dim_option,
                      add_head_dim_v_option, add_size_options, check_gqa, make_qkv,
                      problem_shape, quantized_qkv, resolve_head_dim_v)
from .sparse_bench import MASKS, mask_mod

# What a sweep without --vary compares, per kernel.
DEFAULT_VARY = {"fwd": ["persistent=0,1"], "bwd": ["qdo_stages=1,2"]}


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("sweep", __doc__)
    add_kernel_option(p)
    p.add_argument("--dtype", choices=[*DTYPES, "e4m3"], default="bf16",
                   help="input dtype (default: bf16; e4m3: the FP8 forward)")
    add_head_dim_option(p)
    add_head_dim_v_option(p)
    add_size_options(p, 8192)
    add_causal_option(p)
    p.add_argument("--vary", nargs="+", default=None, metavar="FIELD=V1,V2",
                   help="config fields and the values to try, e.g. kv_stages=2,3 pingpong=0,1 "
                        "(booleans: 0/1); every combination is a variant (default: "
                        + ", ".join(f"{k}: {' '.join(v)}" for k, v in DEFAULT_VARY.items()) + ")")
    p.add_argument("--softcap", type=float, default=0.0, metavar="C",
                   help="soft-cap the scores at C (16-bit kernels; default: 0, none)")
    p.add_argument("--block-mask", choices=MASKS, default=None,
                   help="sweep the block-sparse kernels under this mask of "
                        "profiling.sparse_bench (default: no mask)")
    p.add_argument("--check-seqlen", type=positive_int, default=1000,
                   help="sequence length of the correctness check before timing (queries "
                        "+7, keys +29: ragged) (default: 1000)")
    p.add_argument("--repeats", type=positive_int, default=30,
                   help="timed calls per variant, the median reported (default: 30)")
    p.add_argument("--out", default=None, metavar="PREFIX",
                   help="write every variant to <PREFIX>.json, creating the folder "
                        "(default: write nothing)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_gqa(p, args, [args.head_dim])
    resolve_head_dim_v(p, args)
    if args.dtype == "e4m3" and (args.kernel != "fwd" or args.head_dim not in FP8_HEAD_DIMS
                                 or args.head_dim_v != args.head_dim):
        p.error(f"--dtype e4m3: expected --kernel fwd and --head-dim one of {FP8_HEAD_DIMS} "
                f"(v's the same), got --kernel {args.kernel}, --head-dim {args.head_dim}, "
                f"--head-dim-v {args.head_dim_v}")
    if not (args.softcap >= 0) or (args.softcap and args.dtype == "e4m3"):
        p.error(f"--softcap: expected a value >= 0, and 0 with --dtype e4m3, got "
                f"{args.softcap}")
    if args.block_mask and (args.causal != "no" or args.dtype == "e4m3"):
        p.error(f"--block-mask: expected --causal no and a 16-bit --dtype (the mask holds "
                f"every limit; no e4m3 block-sparse kernel), got --causal {args.causal}, "
                f"--dtype {args.dtype}")
    defaulted = args.vary is None
    if defaulted:
        args.vary = DEFAULT_VARY[args.kernel]
    try:
        args.vary_values = config_vary(args.vary, args.kernel)
    except ValueError as exc:
        p.error(f"--vary: {exc}" + (f" (the default, {' '.join(args.vary)}, no longer fits "
                                    "the config: give --vary)" if defaulted else ""))
    return args


def variants(base, vary: dict[str, list]) -> list:
    names = list(vary)
    return [base.replace(**dict(zip(names, combo)))
            for combo in itertools.product(*(vary[n] for n in names))]


def run_variants(args, configs: list) -> list[dict]:
    """Check and time each config: one result row each, with its status."""
    from .timing import time_cuda

    causal = args.causal == "yes"
    batch, heads = problem_shape(args.head_dim, args.seqlen, args.total_tokens, args.heads)
    scale = args.head_dim ** -0.5

    fp8 = args.dtype == "e4m3"

    def make(b, sq, sk):
        return make_qkv(b, sq, sk, heads, heads // args.gqa, args.head_dim,
                        torch.bfloat16 if fp8 else DTYPES[args.dtype],
                        head_dim_v=args.head_dim_v)

    check_inputs = make(1, args.check_seqlen + 7, args.check_seqlen + 29)
    problem = make(batch, args.seqlen, args.seqlen)
    if fp8:
        case = _fp8_forward_case(check_inputs, problem, scale, causal)
    else:
        masks = _Masks.of(args.block_mask, check_inputs, problem) if args.block_mask else None
        make_case = _forward_case if args.kernel == "fwd" else _backward_case
        case = make_case(check_inputs, problem, scale, causal, args.softcap, masks)
    # a block mask's useful work: the pairs it leaves
    flops = case.work_share * attention_flops(batch, heads, args.seqlen, args.seqlen,
                                              args.head_dim, causal, args.kernel,
                                              head_dim_v=args.head_dim_v)
    varied = list(args.vary_values)
    results = []
    with Progress(len(configs), "sweep", "variant") as bar:
        for config in configs:
            label = ", ".join(f"{n}={getattr(config, n)}" for n in varied)
            bar.working_on(label)
            row = {"config": config.__dict__.copy(), "status": "ok"}
            try:
                config.validate(args.head_dim, args.head_dim_v, **({"fp8": True} if fp8 else {}))
                row["max_error"] = case.check(config)
                t = time_cuda(lambda: case.run(config), repeats=args.repeats)
                row.update(median_ms=t.median_ms, tflops=tflops(flops, t.median_ms))
            except Exception as exc:
                # the DSL's errors can open with a blank line: keep the first words
                first = next((l.strip() for l in str(exc).splitlines() if l.strip()), "")
                row["status"] = f"{type(exc).__name__}: {first[:140]}"
            results.append(row)
            bar.write(f"  {row['status']:<4} {row.get('tflops') or 0:7.1f} TFLOP/s  "
                      f"{row['config']}")
            bar.update(1, label)
    return results


def format_ranking(results: list[dict], varied: list[str]) -> str:
    """The variants that ran, fastest first, then those that did not, with why."""
    ok = sorted((r for r in results if r["status"] == "ok"), key=lambda r: -r["tflops"])
    lines = [f"{'rank':>4} {'TFLOP/s':>8} {'ms':>8}  " + "  ".join(f"{n:>16}" for n in varied)]
    for i, r in enumerate(ok, 1):
        lines.append(f"{i:>4} {r['tflops']:8.1f} {r['median_ms']:8.3f}  "
                     + "  ".join(f"{str(r['config'][n]):>16}" for n in varied))
    for r in results:
        if r["status"] != "ok":
            lines.append(f"   -  {r['status']}  "
                         + ", ".join(f"{n}={r['config'][n]}" for n in varied))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    require_cuda("sweep")
    causal = args.causal == "yes"
    batch, heads = problem_shape(args.head_dim, args.seqlen, args.total_tokens, args.heads)
    # what the op takes for the problem: mask, cap and sequence length included
    features = Features(softcap=args.softcap > 0, block_sparse=bool(args.block_mask))
    if args.kernel == "bwd":
        base = bwd_config_for_problem(args.head_dim, causal, False, batch, args.seqlen, heads,
                                      heads // args.gqa, num_sms(torch.cuda.current_device()),
                                      features, args.head_dim_v)
    elif args.dtype == "e4m3":
        base = fp8_config_for_problem(args.head_dim, causal, features, args.seqlen)
    else:
        base = fwd_config_for_problem(args.head_dim, causal, args.head_dim_v, features,
                                      args.seqlen, args.seqlen, batch * heads,
                                      num_sms(torch.cuda.current_device()))
    results = run_variants(args, variants(base, args.vary_values))
    mask = f" block mask {args.block_mask}" if args.block_mask else ""
    print(f"\nproblem: {args.kernel} {args.dtype} d={args.head_dim} dv={args.head_dim_v} "
          f"seqlen={args.seqlen} "
          f"batch={batch} heads={heads} gqa={args.gqa} causal={causal}{mask}; base {base}")
    print(format_ranking(results, list(args.vary_values)))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        arguments = {k: v for k, v in vars(args).items() if k != "vary_values"}
        with open(args.out + ".json", "w") as f:
            json.dump({"arguments": arguments, "results": results}, f, indent=1)
        print(f"\nwrote {args.out}.json")
    return results


class _Case:
    """check(config) -> max error (raises past tolerance); run(config) -> one timed call;
    work_share: the share of (query, key) pairs the problem computes."""

    def __init__(self, check, run, work_share: float = 1.0):
        self.check, self.run, self.work_share = check, run, work_share


def _errors_within(name_errs, tolerances) -> float:
    for (name, err), tol in zip(name_errs, tolerances):
        if not err <= tol:
            raise AssertionError(f"{name} max error {err:.3e} > tolerance {tol:.3e}")
    return max(err for _, err in name_errs)


@dataclass
class _Masks:
    """A block mask (--block-mask) over the check and the timed problem: their
    tile lists (fwd, bwd), the check's dense mask for the reference, the
    share of pairs the timed problem computes."""

    check: tuple
    problem: tuple
    visible: torch.Tensor
    work_share: float

    @classmethod
    def of(cls, name: str, check_inputs, problem) -> "_Masks":
        from torch.nn.attention.flex_attention import create_block_mask, create_mask

        from cute_fa import BlockSparseMask
        from cute_fa.block_sparse_ops import lists_for

        def masked(inputs):
            seqlen_q, seqlen_k = inputs[0].shape[1], inputs[1].shape[1]
            mod = mask_mod(name, max(seqlen_q, seqlen_k), 0, "cuda")
            mask = BlockSparseMask.from_block_mask(create_block_mask(
                mod, None, None, seqlen_q, seqlen_k, device="cuda"))
            return (lists_for(mask, inputs[0], inputs[2]),
                    create_mask(mod, 1, 1, seqlen_q, seqlen_k, device="cuda"))

        (check, visible), (timed, timed_visible) = masked(check_inputs), masked(problem)
        return cls(check, timed, visible, timed_visible.float().mean().item())


def _mask_args(masks, which: str, direction: int):
    """forward_cuda / backward_cuda's block_lists of the check or the timed problem."""
    return {} if masks is None else {"block_lists": getattr(masks, which)[direction]}


def _forward_case(check_inputs, problem, scale, causal, softcap, masks=None) -> _Case:
    from cute_fa.ops import forward_cuda
    from cute_fa.reference import attention_reference

    visible = None if masks is None else masks.visible
    ref, _ = attention_reference(*check_inputs, scale, causal, softcap=softcap, visible=visible)
    low, _ = attention_reference(*check_inputs, scale, causal, compute_dtype=None,
                                 softcap=softcap, visible=visible)
    tolerance = 2 * (low.float() - ref.float()).abs().max().item() + 1e-5

    def check(config):
        out, _ = forward_cuda(*check_inputs, scale, causal, config, softcap=softcap,
                              **_mask_args(masks, "check", 0))
        return _errors_within([("out", (out.float() - ref.float()).abs().max().item())],
                              [tolerance])

    return _Case(check, lambda config: forward_cuda(*problem, scale, causal, config,
                                                    softcap=softcap,
                                                    **_mask_args(masks, "problem", 0)),
                 1.0 if masks is None else masks.work_share)


def _fp8_forward_case(check_inputs, problem, scale, causal) -> _Case:
    from cute_fa.fp8 import dequantize_fp8, fp8_attention_emulation
    from cute_fa.fp8_ops import forward_fp8_cuda
    from cute_fa.reference import attention_reference

    q8, qs, k8, ks, v8, vs = quantized_qkv(*check_inputs)
    exact, _ = attention_reference(dequantize_fp8(q8, qs), dequantize_fp8(k8, ks),
                                   dequantize_fp8(v8, vs), scale, causal)
    emulated, _ = fp8_attention_emulation(q8, k8, v8, qs, ks, vs, scale, causal)
    tolerance = 1.5 * (emulated - exact).pow(2).mean().sqrt().item() + 1e-6

    def check(config):
        out, _ = forward_fp8_cuda(q8, k8, v8, qs, ks, vs, scale, causal, None, config)
        rmse = (out.float() - exact).pow(2).mean().sqrt().item()
        return _errors_within([("out RMSE", rmse)], [tolerance])

    p8, ps, pk8, pks, pv8, pvs = quantized_qkv(*problem)
    return _Case(check, lambda config: forward_fp8_cuda(p8, pk8, pv8, ps, pks, pvs, scale,
                                                        causal, None, config))


def _backward_case(check_inputs, problem, scale, causal, softcap, masks=None) -> _Case:
    from cute_fa.ops import backward_cuda, forward_cuda
    from cute_fa.reference import attention_backward_reference

    def saved(inputs, which):
        out, lse = forward_cuda(*inputs, scale, causal, softcap=softcap,
                                **_mask_args(masks, which, 0))
        return torch.randn_like(out), out, lse

    grad_out, out, lse = saved(check_inputs, "check")
    args = (grad_out, *check_inputs, out, lse, scale, causal)
    visible = None if masks is None else masks.visible
    ref = attention_backward_reference(*args, softcap=softcap, visible=visible)
    low = attention_backward_reference(*args, compute_dtype=None, softcap=softcap,
                                       visible=visible)
    tolerances = [2 * (lo.float() - r.float()).abs().max().item() + 1e-4
                  for lo, r in zip(low, ref)]

    def check(config):
        grads = backward_cuda(*args, softcap=softcap, config=config,
                              **_mask_args(masks, "check", 1))
        return _errors_within([(n, (g.float() - r.float()).abs().max().item())
                               for n, g, r in zip(("dq", "dk", "dv"), grads, ref)], tolerances)

    p_grad_out, p_out, p_lse = saved(problem, "problem")
    return _Case(check, lambda config: backward_cuda(p_grad_out, *problem, p_out, p_lse, scale,
                                                     causal, softcap=softcap, config=config,
                                                     **_mask_args(masks, "problem", 1)),
                 1.0 if masks is None else masks.work_share)


if __name__ == "__main__":
    main()
