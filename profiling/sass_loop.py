"""A kernel's main loop in SASS: its instruction mix per step, and
flash-attn-4's SM90 kernel's beside it where that package is importable.

    python -m cute_fa.profiling.sass_loop --head-dim 128                 # the op's forward config
    python -m cute_fa.profiling.sass_loop --head-dim 128 --vary tile_n=128 --fa4
    python -m cute_fa.profiling.sass_loop --kernel bwd --head-dim 64 --fa4 --liveness

Runs on a machine without a GPU (kernels compiled for sm_90a, disassembled by
nvdisasm). A forward step (one K/V block) issues head_dim/16 HGMMAs for
S = Q·Kᵀ and tile_n/16 for O += P·V per consumer warpgroup; a backward step
(one query block) head_dim/16 each for Sᵀ and dPᵀ, tile_m/16 each for dV and
dK, tile_n/16 for dQ. The loop is found as the innermost one that issues
exactly that many. The math of a step is fixed by the tile; what differs
between two kernels is the bookkeeping around it (descriptor arithmetic,
barrier waits, index math), which the table shows opcode by opcode.
The `total` row counts the whole loop; `unmasked` leaves out the stretches
a forward branch skips that set scores to -inf (kernel_info.mask_regions):
what a block that needs no mask executes. Ours branches over its mask;
fa4's backward applies its -inf selects on every step, so there the two rows
are equal, and only `unmasked` compares the steady steps.

--liveness adds two rows: the vector registers live on entering the loop
(what it carries from step to step: accumulators plus bookkeeping) and the
most live anywhere in it. Near the consumers' setmaxnreg budget ptxas
spills or serialises the WGMMAs, so a register the loop carries for nothing
can decide which configs fit. It re-assembles the PTX with a standalone
ptxas (CUDA toolkit), since nvdisasm cannot track life ranges in the DSL's
cubins.

fa4 compiles with the tile its interface picks (forward: 128x128 at d=128,
192x128 at d=64; backward: its _tile_size_bwd_sm90): give ours the same with
--vary to compare like with like. --fa4 needs flash-attn-4, the peers extra:
pip install "cute-fa[peers]". Prints the table and writes nothing (the
kernels are compiled in a temporary folder).
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
from collections import Counter

from .backends import require_fa4
from .cli import INSTALL_PEERS, add_kernel_option, command_parser, config_overrides, config_with
from .kernel_info import (loop_liveness, main_loop_mix, nvdisasm_path, ptxas_path, sass_text,
                          unmasked_step_count)
from .problem import add_causal_option, add_head_dim_option

NVDISASM = "nvdisasm (pip install nvidia-cuda-nvdisasm, or the CUDA toolkit's, on PATH)"
PTXAS = "ptxas (the CUDA toolkit's: $CUDA_HOME/bin or PATH)"


def _one(dump_dir: str, suffix: str) -> str:
    found = glob.glob(os.path.join(dump_dir, "**", "*" + suffix), recursive=True)
    if len(found) != 1:
        raise RuntimeError(f"expected one {suffix} under {dump_dir}, found {len(found)}")
    return found[0]


def _compiled(compile_fn, dump_dir: str, kernel_subdir: str = "") -> tuple[str, str]:
    """(SASS, PTX path) of the one kernel compile_fn dumps into dump_dir (or
    into its kernel_subdir, where it dumps several)."""
    os.makedirs(dump_dir, exist_ok=True)
    compile_fn(dump_dir)
    kernel_dir = os.path.join(dump_dir, kernel_subdir)
    sass = sass_text(_one(kernel_dir, ".cubin"))
    if sass is None:
        raise SystemExit(f"profiling.sass_loop: needs {NVDISASM}")
    return sass, _one(kernel_dir, ".ptx")


def hgmmas_per_step(kind: str, head_dim: int, tile_m: int, tile_n: int) -> int:
    if kind == "fwd":
        return (head_dim + tile_n) // 16
    return (2 * head_dim + 2 * tile_m + tile_n) // 16


def ours(kind: str, head_dim: int, causal: bool, config, dump_dir: str):
    """(SASS, PTX path) of our forward, or of our backward's main kernel."""
    import torch

    from cute_fa.compile_cache import compile_bwd, compile_fwd

    if kind == "fwd":
        return _compiled(lambda d: compile_fwd(torch.bfloat16, head_dim, causal, config,
                                               dump_dir=d), dump_dir)

    # The main kernel, beside preprocess/ and postprocess/.
    return _compiled(lambda d: compile_bwd(torch.bfloat16, head_dim, causal, config,
                                           dump_dir=d), dump_dir, "main")


def fa4(kind: str, head_dim: int, causal: bool, dump_dir: str):
    """(SASS, PTX path, (tile_m, tile_n)) of flash-attn-4's SM90 kernel with
    the tile its interface picks."""
    import cutlass
    import cutlass.cute as cute

    from cute_fa.kernel_compile import _fake_bshd, _fake_rows, _sym

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    b, sq, sk, h = _sym(), _sym(), _sym(), _sym()
    q, o = (_fake_bshd(bf16, b, sq, h, head_dim) for _ in range(2))
    k, v = (_fake_bshd(bf16, b, sk, h, head_dim) for _ in range(2))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)

    def options(d):
        return f"--enable-tvm-ffi --keep-ptx --keep-cubin --dump-dir {d}"

    if kind == "fwd":
        from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

        tile_m, tile_n = (192, 128) if head_dim <= 64 else (128, 128)
        kernel = FlashAttentionForwardSm90(
            bf16, head_dim, head_dim, 1, is_causal=causal, is_local=False, pack_gqa=False,
            tile_m=tile_m, tile_n=tile_n, num_stages=2, num_threads=128 * (tile_m // 64 + 1),
            Q_in_regs=False, intra_wg_overlap=True, mma_pv_is_rs=True)
        lse = _fake_rows(f32, b, h, sq)

        def compile_it(d):
            cute.compile(kernel, q, k, v, o, lse, f32(0.1), stream=stream, options=options(d))
    else:
        from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
        from flash_attn.cute.interface import _tile_size_bwd_sm90
        from flash_attn.cute.utils import AuxData

        cfg = _tile_size_bwd_sm90(head_dim, head_dim, causal, False)
        tile_m, tile_n = cfg.m_block_size, cfg.n_block_size
        kernel = FlashAttentionBackwardSm90(
            bf16, head_dim, head_dim, 1, causal, tile_m=tile_m, tile_n=tile_n,
            Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO, PdS_stage=cfg.num_stages_PdS,
            SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB, dQ_swapAB=cfg.dQ_swapAB,
            AtomLayoutMSdP=cfg.AtomLayoutMSdP, AtomLayoutNdKV=cfg.AtomLayoutNdKV,
            AtomLayoutMdQ=cfg.AtomLayoutMdQ, num_threads=128 * (cfg.num_wg + 1),
            dQ_single_wg=cfg.dQ_single_wg)
        do = _fake_bshd(bf16, b, sq, h, head_dim)
        dk, dv = (_fake_bshd(bf16, b, sk, h, head_dim) for _ in range(2))
        lse2, dsum = (_fake_rows(f32, b, h, _sym()) for _ in range(2))
        dq_accum = _fake_rows(f32, b, h, _sym(), divisibility=4, align=16)

        def compile_it(d):
            # The optional arguments (varlen, windows, semaphores, block
            # sparsity) stay None: the dense, non-deterministic kernel.
            cute.compile(kernel, q, k, v, do, lse2, dsum, dq_accum, dk, dv, f32(0.1),
                         None, None, None, None, None, None, None, None, None, AuxData(),
                         None, None, stream, options=options(d))
    sass, ptx = _compiled(compile_it, dump_dir)
    return sass, ptx, (tile_m, tile_n)


def format_mix(columns: dict, unmasked: dict | None = None) -> str:
    """columns: name -> Counter; one row per opcode, the ones that differ first.
    unmasked: name -> the step's instructions without its masking branch."""
    names = list(columns)
    ops = sorted(set().union(*columns.values()),
                 key=lambda op: (len({c[op] for c in columns.values()}) == 1,
                                 -max(c[op] for c in columns.values()), op))
    lines = [f"{'opcode':<12}" + "".join(f"{n:>14}" for n in names)]
    lines += [f"{op:<12}" + "".join(f"{columns[n][op]:>14}" for n in names) for op in ops]
    lines.append(f"{'total':<12}" + "".join(f"{sum(columns[n].values()):>14}" for n in names))
    if unmasked:
        lines.append(f"{'unmasked':<12}" + "".join(f"{unmasked[n]:>14}" for n in names))
    return "\n".join(lines)


def format_liveness(liveness: dict) -> str:
    names = list(liveness)
    rows = [("live at loop entry", 0), ("live at peak", 1)]
    return "\n".join(f"{label:<20}" + "".join(
        f"{'-' if liveness[n] is None else liveness[n][i]:>14}" for n in names)
        for label, i in rows)


def _measure(label, sass, ptx, steps, columns, bodies, unmasked, liveness, want_liveness):
    mix = main_loop_mix(sass, steps)
    if mix is None:
        raise SystemExit(f"profiling.sass_loop: no loop issuing {steps} HGMMAs in {label}")
    columns[label], bodies[label] = mix
    unmasked[label] = unmasked_step_count(sass, steps)
    if want_liveness:
        liveness[label] = loop_liveness(ptx, steps)


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("sass_loop", __doc__)
    add_kernel_option(p)
    add_head_dim_option(p)
    add_causal_option(p)
    p.add_argument("--vary", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="config fields to set on the op's default config, one value each, "
                        "e.g. tile_n=128 kv_stages=3 (booleans: 0/1) (default: none)")
    p.add_argument("--fa4", action="store_true",
                   help=f"flash-attn-4's loop beside ours (needs the peers extra: "
                        f"{INSTALL_PEERS})")
    p.add_argument("--liveness", action="store_true",
                   help="live registers at the loop's entry and peak (needs ptxas of the "
                        "CUDA toolkit)")
    p.add_argument("--print-loop", action="store_true", help="also print our loop's SASS")
    return p


def main(argv=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    causal = args.causal == "yes"
    kind = args.kernel
    try:
        overrides = config_overrides(args.vary, kind)
    except ValueError as exc:
        p.error(f"--vary: {exc}")
    config = config_with(p, "--vary", kind, args.head_dim, causal, overrides)
    if nvdisasm_path() is None:
        raise SystemExit(f"profiling.sass_loop: needs {NVDISASM}")
    if args.liveness and ptxas_path() is None:
        raise SystemExit(f"profiling.sass_loop: --liveness needs {PTXAS}")
    if args.fa4:
        require_fa4("sass_loop --fa4")
    columns: dict[str, Counter] = {}
    bodies, unmasked, liveness = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        sass, ptx = ours(kind, args.head_dim, causal, config, os.path.join(tmp, "ours"))
        label = f"ours {config.tile_m}x{config.tile_n}"
        _measure(label, sass, ptx, hgmmas_per_step(kind, args.head_dim, config.tile_m,
                                                   config.tile_n),
                 columns, bodies, unmasked, liveness, args.liveness)
        ours_label = label
        if args.fa4:
            sass, ptx, (tile_m, tile_n) = fa4(kind, args.head_dim, causal,
                                              os.path.join(tmp, "fa4"))
            _measure(f"fa4 {tile_m}x{tile_n}", sass, ptx,
                     hgmmas_per_step(kind, args.head_dim, tile_m, tile_n),
                     columns, bodies, unmasked, liveness, args.liveness)
    step = "K/V step" if kind == "fwd" else "query-block step"
    print(f"{'forward' if kind == 'fwd' else 'backward'} main loop, d={args.head_dim}, "
          f"causal={args.causal}, bf16, sm_90a: instructions per {step} and consumer warp")
    print(format_mix(columns, unmasked))
    if args.liveness:
        print(format_liveness(liveness))
    if args.print_loop:
        print("\n".join(bodies[ours_label]))
    return dict(mix=columns, unmasked=unmasked, liveness=liveness)


if __name__ == "__main__":
    main()
