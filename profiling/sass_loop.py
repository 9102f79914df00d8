"""The forward's main loop in SASS: its instruction mix per K/V step, and
flash-attn-4's SM90 forward's beside it where that package is importable.

    python -m profiling.sass_loop --head-dim 128                 # the op's config
    python -m profiling.sass_loop --head-dim 128 --vary tile_n=128 --fa4

Runs on a machine without a GPU (kernels compiled for sm_90a, disassembled by
nvdisasm). A K/V step issues head_dim/16 HGMMAs for S = Q·Kᵀ and tile_n/16 for
O += P·V per consumer warpgroup, and the loop is found as the innermost one
that issues exactly that many. The math of a step is fixed by the tile; what
differs between two kernels is the bookkeeping around it (descriptor
arithmetic, barrier waits, index math), which this table shows opcode by
opcode. fa4 compiles with its own tile for the head dim (128x128 at d=128,
192x128 at d=64): give ours the same tile with --vary to compare like with like.
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile

from .kernel_info import main_loop_mix, sass_text
from .sweep import parse_vary


def _compiled_sass(compile_fn, dump_dir: str) -> str:
    os.makedirs(dump_dir, exist_ok=True)
    compile_fn(dump_dir)
    cubins = glob.glob(os.path.join(dump_dir, "**", "*.cubin"), recursive=True)
    if len(cubins) != 1:
        raise RuntimeError(f"expected one cubin under {dump_dir}, found {len(cubins)}")
    sass = sass_text(cubins[0])
    if sass is None:
        raise SystemExit("profiling.sass_loop: needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
    return sass


def ours_sass(head_dim: int, causal: bool, config, dump_dir: str) -> str:
    import torch

    from python_api.compile_cache import compile_fwd

    return _compiled_sass(lambda d: compile_fwd(torch.bfloat16, head_dim, causal, config,
                                                dump_dir=d), dump_dir)


def fa4_sass(head_dim: int, causal: bool, dump_dir: str) -> tuple[str, tuple[int, int]]:
    """flash-attn-4's SM90 forward with the tile its interface picks."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    from python_api.compile_cache import _fake_bshd, _fake_rows, _sym

    tile_m, tile_n = (192, 128) if head_dim <= 64 else (128, 128)
    kernel = FlashAttentionForwardSm90(
        cutlass.BFloat16, head_dim, head_dim, 1, is_causal=causal, is_local=False,
        pack_gqa=False, tile_m=tile_m, tile_n=tile_n, num_stages=2,
        num_threads=128 * (tile_m // 64 + 1), Q_in_regs=False, intra_wg_overlap=True,
        mma_pv_is_rs=True)
    b, sq, sk, h = _sym(), _sym(), _sym(), _sym()
    q, o = (_fake_bshd(cutlass.BFloat16, b, sq, h, head_dim) for _ in range(2))
    k, v = (_fake_bshd(cutlass.BFloat16, b, sk, h, head_dim) for _ in range(2))
    lse = _fake_rows(cutlass.Float32, b, h, sq)

    def compile_it(d):
        cute.compile(kernel, q, k, v, o, lse, cutlass.Float32(0.1),
                     stream=cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                     options=f"--enable-tvm-ffi --keep-cubin --dump-dir {d}")
    return _compiled_sass(compile_it, dump_dir), (tile_m, tile_n)


def format_mix(columns: dict) -> str:
    """columns: name -> Counter; one row per opcode, the ones that differ first."""
    names = list(columns)
    ops = sorted(set().union(*columns.values()),
                 key=lambda op: (len({c[op] for c in columns.values()}) == 1,
                                 -max(c[op] for c in columns.values()), op))
    lines = [f"{'opcode':<12}" + "".join(f"{n:>14}" for n in names)]
    lines += [f"{op:<12}" + "".join(f"{columns[n][op]:>14}" for n in names) for op in ops]
    lines.append(f"{'total':<12}" + "".join(f"{sum(columns[n].values()):>14}" for n in names))
    return "\n".join(lines)


def main(argv=None) -> dict:
    from cute_kernels.config import fwd_config_for_problem

    p = argparse.ArgumentParser(prog="python -m profiling.sass_loop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", choices=["no", "yes"], default="no")
    p.add_argument("--seqlen", type=int, default=8192, help="for the op's per-problem config")
    p.add_argument("--vary", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="FwdConfig fields to set (one value each)")
    p.add_argument("--fa4", action="store_true", help="flash-attn-4's loop beside ours")
    p.add_argument("--print-loop", action="store_true", help="also print our loop's SASS")
    args = p.parse_args(argv)
    causal = args.causal == "yes"
    config = fwd_config_for_problem(args.head_dim, causal, args.seqlen)
    for field, values in parse_vary(args.vary).items():
        if len(values) != 1:
            p.error(f"--vary {field}: expected one value, got {values}")
        config = config.replace(**{field: values[0]})
    columns, bodies = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        sass = ours_sass(args.head_dim, causal, config, os.path.join(tmp, "ours"))
        mix = main_loop_mix(sass, (args.head_dim + config.tile_n) // 16)
        if mix is None:
            raise SystemExit("profiling.sass_loop: no loop with one K/V step's HGMMAs in ours")
        columns[f"ours {config.tile_m}x{config.tile_n}"], bodies["ours"] = mix
        if args.fa4:
            sass, (tile_m, tile_n) = fa4_sass(args.head_dim, causal, os.path.join(tmp, "fa4"))
            mix = main_loop_mix(sass, (args.head_dim + tile_n) // 16)
            if mix is None:
                raise SystemExit("profiling.sass_loop: no loop with one K/V step's HGMMAs in fa4")
            columns[f"fa4 {tile_m}x{tile_n}"], bodies["fa4"] = mix
    print(f"forward main loop, d={args.head_dim}, causal={args.causal}, bf16, sm_90a: "
          f"instructions per K/V step and consumer warp")
    print(format_mix(columns))
    if args.print_loop:
        print("\n".join(bodies["ours"]))
    return columns


if __name__ == "__main__":
    main()
