"""Fill the kernel store ahead of time, so that no process pays the JIT.

    python -m cute_fa.precompile                                  # every variant the op may pick
    python -m cute_fa.precompile --head-dims 128 --dtypes bf16 --causal yes --jobs 8

For each dtype, head dim and causal flag: the forward's default kernel and
the backward's default kernels with and without `deterministic`, each with
and without split_gqa (which the op picks for GQA problems too small to fill
the GPU otherwise), and with --lse-grad also the backward variants that
take a gradient through the LSE output. Variants already in the store are
loaded, not compiled. Kernels are stored per architecture: run it on the
machine (or the GPU type) that will use them, or with no GPU for sm_90a.
See kernel_store.py for where they go and how to move or disable the store.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from .profiling.cli import choice_list, positive_int
from .profiling.problem import (CAUSAL_VALUES, DTYPES, add_causal_option, add_dtype_option,
                                add_head_dim_option)


@dataclass(frozen=True)
class Variant:
    direction: str  # "fwd" or "bwd"
    dtype: str  # "bf16" or "fp16"
    head_dim: int
    causal: bool
    deterministic: bool = False
    split_gqa: bool = False
    lse_grad: bool = False

    def label(self) -> str:
        text = f"{self.direction} {self.dtype} d{self.head_dim} {'causal' if self.causal else 'full'}"
        flags = [name for name in ("deterministic", "split_gqa", "lse_grad") if getattr(self, name)]
        return text + "".join(f" {f}" for f in flags)


def variants(head_dims, dtypes, causal_flags, directions, lse_grad: bool) -> list[Variant]:
    out = []
    for dtype, head_dim, causal in itertools.product(dtypes, head_dims, causal_flags):
        if "fwd" in directions:
            out.append(Variant("fwd", dtype, head_dim, causal))
        if "bwd" in directions:
            for det, split, grad in itertools.product((False, True), (False, True),
                                                      (False, True) if lse_grad else (False,)):
                out.append(Variant("bwd", dtype, head_dim, causal, det, split, grad))
    return out


def config_of(variant: Variant):
    """The config the op uses for a variant (FwdConfig or BwdConfig)."""
    from .kernels.config import default_bwd_config, default_fwd_config

    if variant.direction == "fwd":
        return default_fwd_config(variant.head_dim, variant.causal)
    return default_bwd_config(variant.head_dim, variant.causal, variant.deterministic,
                              split_gqa=variant.split_gqa)


def kernels_of(variant: Variant, cached: bool = True):
    """A variant's compiled kernels (CompiledKernel or CompiledBackward): through
    compile_cache's memory and store, or (cached=False) compiled now."""
    from . import compile_cache

    dtype, config = DTYPES[variant.dtype], config_of(variant)
    if variant.direction == "fwd":
        get = compile_cache.get_fwd if cached else compile_cache.compile_fwd
        return get(dtype, variant.head_dim, variant.causal, config)
    get = compile_cache.get_bwd if cached else compile_cache.compile_bwd
    return get(dtype, variant.head_dim, variant.causal, config, variant.lse_grad)


def build(variant: Variant) -> tuple[float, bool]:
    """Load or compile one variant; returns (seconds, loaded from the store)."""
    kernel = kernels_of(variant)
    return kernel.compile_seconds, kernel.from_disk


def add_variant_options(p: argparse.ArgumentParser) -> None:
    """The options that choose kernel variants (also python -m cute_fa.aot's)."""
    from .kernels.config import SUPPORTED_HEAD_DIMS

    add_head_dim_option(p, default=list(SUPPORTED_HEAD_DIMS), multiple=True,
                        help_default="all")
    add_dtype_option(p, default=list(DTYPES), multiple=True)
    add_causal_option(p, default="both", allow_both=True)
    p.add_argument("--directions", type=choice_list(("fwd", "bwd")), default=["fwd", "bwd"],
                   metavar="LIST", help="fwd, bwd or both, comma-separated (default: fwd,bwd)")
    p.add_argument("--lse-grad", action="store_true",
                   help="also the backward variants for a gradient through the returned LSE")
    p.add_argument("--jobs", type=positive_int, default=min(8, os.cpu_count() or 1),
                   help="processes compiling at once (default: the CPU count, at most 8)")


def chosen_variants(args: argparse.Namespace) -> list[Variant]:
    return variants(args.head_dims, args.dtypes, CAUSAL_VALUES[args.causal], args.directions,
                    args.lse_grad)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cute_fa.precompile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_options(p)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from . import kernel_store

    if not kernel_store.enabled():
        parser.error(f"the kernel store is off ({kernel_store.ENABLE_ENV_VAR}="
                     f"{os.environ[kernel_store.ENABLE_ENV_VAR]}): nothing to fill")
    todo = chosen_variants(args)
    print(f"{len(todo)} kernel variants into {kernel_store.folder()}", file=sys.stderr,
          flush=True)
    start, failures = time.perf_counter(), 0
    # spawn: a forked child would inherit the parent's CUDA and DSL state.
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(todo)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(build, v): v for v in todo}
        for done, future in enumerate(as_completed(futures), 1):
            variant = futures[future]
            try:
                seconds, loaded = future.result()
                what = f"{'loaded' if loaded else 'compiled'} in {seconds:.1f} s"
            except Exception as exc:  # report and go on: one variant is not the rest
                failures += 1
                what = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print(f"[{done}/{len(todo)}] {variant.label()}: {what}", file=sys.stderr,
                  flush=True)
    print(f"done in {time.perf_counter() - start:.0f} s"
          + (f", {failures} failed" if failures else ""), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
