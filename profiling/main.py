"""The main job.

    python -m profiling.main

Without a GPU: compiles every forward kernel variant the op serves (dtype ×
head dim × causal, default config) for sm_90a and prints what each one is:
threads and warpgroup roles, registers (at entry, and the setmaxnreg split),
shared memory, and the instruction counts that show TMA, WGMMA, setmaxnreg
and mbarrier waits are there.
On an sm_90 GPU it then runs the op on a default problem and prints TFLOP/s.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from python_api.compile_cache import compile_fwd
from cute_kernels.config import default_fwd_config

from .kernel_info import dumped_kernel_info
from .problem import DTYPES


def describe_kernels(dtypes, head_dims, causals) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for head_dim in head_dims:
            for causal in causals:
                config = default_fwd_config(head_dim, causal)
                with tempfile.TemporaryDirectory() as dump:
                    kernel = compile_fwd(DTYPES[dtype], head_dim, causal, config, dump_dir=dump)
                    info = dumped_kernel_info(dump)
                rows.append(dict(dtype=dtype, head_dim=head_dim, causal=causal, config=config,
                                 info=info, compile_s=kernel.compile_seconds))
    return rows


def print_kernels(rows: list[dict]) -> None:
    print("Forward kernels for sm_90a (one compile each, reused for every batch/heads/seqlen)")
    head = (f"{'dtype':<5} {'d':>4} {'causal':>6}  {'threads':>7}  {'roles':<22} {'regs':>4} "
            f"{'setmaxnreg':<14} {'smem KB':>7}  {'TMA ld/st':>9} {'WGMMA':>5} "
            f"{'mbar wait':>9} {'spills':>6} {'compile s':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        info, cfg = r["info"], r["config"]
        roles = f"1 TMA + {cfg.consumer_warpgroups} MMA/softmax"
        nreg = "/".join(f"{k[0]}{n}" for k, n in info.setmaxnreg)
        spills = info.counts["local_memory"] + (info.stack_bytes or 0)
        print(f"{r['dtype']:<5} {r['head_dim']:>4} {str(r['causal']):>6}  {info.threads:>7}  "
              f"{roles:<22} {info.registers or '?':>4} {nreg:<14} "
              f"{cfg.smem_bytes(r['head_dim']) / 1024:>7.1f}  "
              f"{info.counts['tma_load']:>4}/{info.counts['tma_store']:<4} "
              f"{info.counts['wgmma']:>5} {info.counts['mbarrier_wait']:>9} {spills:>6} "
              f"{r['compile_s']:>9.1f}")
    print("regs: at kernel entry; setmaxnreg d<n>/i<n>: producer decreases, consumers increase."
          "\nspills: ld/st.local in PTX + stack frame bytes in the cubin.")


def run_default_problem() -> None:
    from python_api import flash_attn_func
    from .flops import attention_flops, tflops
    from .timing import time_cuda

    print(f"\n{torch.cuda.get_device_name(0)}: flash_attn_func, bf16, batch 4, seqlen 4096, "
          f"16 heads, head dim 128")
    for causal in (False, True):
        q, k, v = (torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        t = time_cuda(lambda: flash_attn_func(q, k, v, causal=causal))
        flops = attention_flops(4, 16, 4096, 4096, 128, causal)
        print(f"  causal={causal!s:<5}  {t.median_ms:.3f} ms  {tflops(flops, t.median_ms):.1f} TFLOP/s")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m profiling.main", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--head-dims", default="64,96,128")
    args = p.parse_args(argv)
    rows = describe_kernels(args.dtypes.split(","), [int(d) for d in args.head_dims.split(",")],
                            (False, True))
    print_kernels(rows)
    if torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0):
        run_default_problem()
    else:
        print("\nNo sm_90 GPU here: kernels compiled only. On an H100 this also runs the op.")


if __name__ == "__main__":
    main()
