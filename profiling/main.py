"""The main job.

    python -m cute_fa.profiling.main
    python -m cute_fa.profiling.main --dtypes bf16 --head-dims 128

Without a GPU: compiles every forward and backward kernel variant the ops serve
(dtype × head dim × causal, default config) for sm_90a and prints what each one
is: threads and warpgroup roles, registers (at entry, and the setmaxnreg split),
shared memory, and the instruction counts that show TMA, WGMMA, setmaxnreg,
mbarrier waits (and for the backward the bulk reduce-add of dQ) are there.
On an sm_90 GPU it then runs forward and forward+backward on a default problem
and prints TFLOP/s. Writes nothing (each kernel is compiled in a temporary
folder); profiling.kernel_info shows one kernel in more detail.
"""

from __future__ import annotations

import tempfile

import torch

from cute_fa import kernel_store
from cute_fa.compile_cache import compile_bwd, compile_fwd
from cute_fa.kernels.config import SUPPORTED_HEAD_DIMS, default_fwd_config
from cute_fa.kernels.bwd_config import default_bwd_config

from .cli import command_parser, progress
from .kernel_info import dumped_kernel_info
from .problem import DTYPES, add_dtype_option, add_head_dim_option, input_gradients


def describe_kernels(kind: str, dtypes, head_dims, causals, overrides: dict | None = None
                     ) -> list[dict]:
    """Compile each default-config kernel of `kind` ('fwd' or 'bwd') for sm_90a,
    with `overrides` (config fields) where given, and read its PTX and cubin
    (the backward: its main kernel)."""
    default, compile_kernel = ((default_fwd_config, compile_fwd) if kind == "fwd"
                               else (default_bwd_config, compile_bwd))
    selection = [(dtype, head_dim, causal) for dtype in dtypes for head_dim in head_dims
                 for causal in causals]
    rows = []
    for dtype, head_dim, causal in progress(selection, f"compiling {kind} kernels", "kernel",
                                            lambda s: f"{s[0]} d={s[1]} causal={s[2]}"):
        config = default(head_dim, causal).replace(**(overrides or {}))
        with tempfile.TemporaryDirectory() as dump:
            kernel = compile_kernel(DTYPES[dtype], head_dim, causal, config, dump_dir=dump)
            info = dumped_kernel_info(dump if kind == "fwd" else f"{dump}/main")
        rows.append(dict(dtype=dtype, head_dim=head_dim, causal=causal, config=config,
                         info=info, compile_s=kernel.compile_seconds))
    return rows


def _setmaxnreg(info) -> str:
    return "/".join(f"{k[0]}{n}" for k, n in info.setmaxnreg)


def _spills(info) -> int:
    return info.counts["local_memory"] + (info.stack_bytes or 0)


# (header, width, value of a row); the columns both kernels share, then each one's own
_COMMON = [
    ("dtype", -5, lambda r: r["dtype"]), ("d", 4, lambda r: r["head_dim"]),
    ("causal", 6, lambda r: r["causal"]), ("threads", 7, lambda r: r["info"].threads),
]
_TAIL = [
    ("regs", 4, lambda r: r["info"].registers or "?"),
    ("setmaxnreg", -14, lambda r: _setmaxnreg(r["info"])),
    ("smem KB", 7, lambda r: f"{r['config'].smem_bytes(r['head_dim']) / 1024:.1f}"),
    ("TMA ld", 6, lambda r: r["info"].counts["tma_load"]),
    ("WGMMA", 5, lambda r: r["info"].counts["wgmma"]),
    ("async", 5, lambda r: {None: "?", False: "yes", True: "NO"}[r["info"].wgmma_serialized]),
]
COLUMNS = {
    "fwd": _COMMON + [("roles", -22, lambda r: f"1 TMA + {r['config'].launched_warpgroups} "
                                               f"MMA/softmax")] + _TAIL + [
        ("TMA st", 6, lambda r: r["info"].counts["tma_store"]),
        ("mbar wait", 9, lambda r: r["info"].counts["mbarrier_wait"])],
    "bwd": _COMMON + [("roles", -28, lambda r: f"1 TMA+dQ-writer + "
                                               f"{r['config'].consumer_warpgroups} MMA")] + _TAIL + [
        ("dQ red", 6, lambda r: r["info"].counts["dq_reduce"])],
}
TITLES = {
    "fwd": "Forward kernels for sm_90a (one compile each, reused for every batch/heads/seqlen)",
    "bwd": "Backward main kernels for sm_90a (compiled with their preprocess and postprocess)",
}
FOOTNOTES = {
    "fwd": "regs: at kernel entry; setmaxnreg d<n>/i<n>: producer decreases, consumers "
           "increase.\nspills: ld/st.local in PTX + stack frame bytes in the cubin.\n"
           "async: ptxas kept the WGMMAs asynchronous (NO: it serialised them for want of "
           "registers; ?: no nvdisasm).",
    "bwd": "tile: 128 keys per CTA (64 per MMA warpgroup), tile_m queries per step; dQ red: "
           "bulk fp32 reduce-add instructions.",
}


def format_columns(columns, rows) -> str:
    """A table: columns are (header, width, value of a row); a negative width
    aligns left."""
    def cell(value, width):
        return f"{str(value):<{-width}}" if width < 0 else f"{str(value):>{width}}"

    head = " ".join(cell(name, width) for name, width, _ in columns)
    lines = [head, "-" * len(head)]
    lines += [" ".join(cell(value(r), width) for _, width, value in columns) for r in rows]
    return "\n".join(lines)


def print_kernels(kind: str, rows: list[dict]) -> None:
    columns = COLUMNS[kind] + [("spills", 6, lambda r: _spills(r["info"])),
                               ("compile s", 9, lambda r: f"{r['compile_s']:.1f}")]
    print("\n" + TITLES[kind])
    print(format_columns(columns, rows))
    print(FOOTNOTES[kind])


def run_default_problem() -> None:
    from cute_fa import flash_attn_func
    from .flops import attention_flops, tflops
    from .timing import time_cuda

    print(f"\n{torch.cuda.get_device_name(0)}: flash_attn_func, bf16, batch 4, seqlen 4096, "
          f"16 heads, head dim 128")
    for causal in (False, True):
        q, k, v = (torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad_out = torch.randn_like(q)
        with torch.no_grad():
            t = time_cuda(lambda: flash_attn_func(q, k, v, causal=causal))
        t_train = time_cuda(lambda: input_gradients(flash_attn_func(q, k, v, causal=causal),
                                                    (q, k, v), grad_out))
        for name, timing in (("fwd", t), ("fwd+bwd", t_train)):
            flops = attention_flops(4, 16, 4096, 4096, 128, causal,
                                    "fwd" if name == "fwd" else "fwd_bwd")
            print(f"  causal={causal!s:<5} {name:<8} {timing.median_ms:.3f} ms  "
                  f"{tflops(flops, timing.median_ms):.1f} TFLOP/s")


def build_parser():
    p = command_parser("main", __doc__)
    add_dtype_option(p, ["bf16", "fp16"], multiple=True)
    add_head_dim_option(p, list(SUPPORTED_HEAD_DIMS), multiple=True)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    print(kernel_store.toolkit_line())
    for kind in ("fwd", "bwd"):
        print_kernels(kind, describe_kernels(kind, args.dtypes, args.head_dims, (False, True)))
    if torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0):
        run_default_problem()
    else:
        print("\nNo sm_90 GPU here: kernels compiled only. On an H100/H200 this also runs "
              "the op.")


if __name__ == "__main__":
    main()
