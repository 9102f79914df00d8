"""Fill the kernel store ahead of time, so that no process pays the JIT.

    python -m cute_fa.precompile                                  # every variant the op may pick
    python -m cute_fa.precompile --head-dims 128 --dtypes bf16 --causal yes --jobs 8
    python -m cute_fa.precompile --head-dims 192 --head-dims-v 128   # q·k 192, v 128
    python -m cute_fa.precompile --directions decode --head-dims 128 --page-sizes 0,16,256
    python -m cute_fa.precompile --directions decode --causal yes --query-groups 4 --page-sizes 0
    python -m cute_fa.precompile --directions block_sparse --head-dims 64,128 --dtypes bf16
    python -m cute_fa.precompile --directions fp8 --head-dims 128 --dtypes bf16  # e4m3 in, bf16 out
    python -m cute_fa.precompile --directions decode_fp8 --head-dims 128 --dtypes bf16

For each dtype, head dim (and value head dim, by default the same) and causal
flag: the forward's default kernel (and those of long and short sequences
where the tiles differ: the long tiles, the short tiles, those of a grid
of few tiles, the narrower or wider ones a grid short of SMs takes, and, where tiles
are claimed, each of these with its tiles dealt by index, as a grid of two
waves or less takes them, and each with a Q ring with one Q stage, as a
grid of one round takes it) and
the backward's default kernels with and without `deterministic`, each with
and without split_gqa (which the op picks for GQA problems too small to fill
the GPU otherwise), and with --lse-grad also the backward variants that
take a gradient through the LSE output. --directions decode (not in the
default): the forwards of flash_attn_with_kvcache (python_api/decode.py),
split and not, for a contiguous cache (page size 0) and each page size of
--page-sizes, causal as asked (the causal kernels mask steps of several
tokens, each token's query heads of a KV head in one group of rows: one
kernel per group size of --query-groups), each for steps whose query rows
(tokens times query heads per KV head) fit one 64-row tile and for longer
ones (many_q_tiles: a prompt's chunk appended to the cache), and the
append of new k, v into the cache. --directions block_sparse (not in
the default): the forward and backward kernels of a block mask
(flash_attn_func's block_mask; no causal flag of their own), the backward
with and without split_gqa. --directions fp8 (not in the default): the
forwards of e4m3 q, k, v (head dims of config.FP8_HEAD_DIMS, --dtypes
naming the output's), one per config that fp8_config_for_problem picks over
row lengths (config.FP8_ROW_CLASS_KEYS). --directions decode_fp8 (not in
the default): the decode kernels (as --directions decode) of e4m3 caches,
whose output is bf16 (--dtypes bf16), each also with the deeper K/V ring of
small grids (decode.E4M3_SMALL_GRID_STAGES), and the e4m3 append. Variants
already in the store are loaded, not compiled. Kernels are stored per architecture and per
CUDA toolkit of the DSL's libraries (kernel_store.dsl_toolkit): run it on the machine (or the
GPU type) that will use them, or with no GPU for sm_90a in an environment with the same DSL library
sets installed (without a driver the DSL builds with the newest, e.g. cu13 where the cu13
extra is installed). See kernel_store.py for where they go and how to move or disable the store.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace

import torch

from .profiling.cli import choice_list, csv_list, positive_int
from .profiling.problem import (CAUSAL_VALUES, DTYPES, add_causal_option, add_dtype_option,
                                add_head_dim_option)


@dataclass(frozen=True)
class Variant:
    direction: str  # "fwd", "bwd", "decode", "fp8" (the e4m3 forward) or "decode_fp8"
    dtype: str  # "bf16" or "fp16" (fp8: the output's)
    head_dim: int
    causal: bool
    deterministic: bool = False
    split_gqa: bool = False
    lse_grad: bool = False
    head_dim_v: int | None = None  # that of v and the output; None: head_dim
    split_kv: bool = False  # decode: key ranges merged after
    page_size: int = 0  # decode: a paged cache's page size; 0: contiguous
    rows_per_query: int = 1  # decode: query heads per KV head (several tokens a step)
    many_q_tiles: bool = False  # decode: more query rows a KV head than one tile
    block_sparse: bool = False  # a block mask's kernels (block_sparse_ops.py)
    short: bool = False  # fwd: the tiles of sequences up to config.SHORT_SEQLEN tokens
    narrow: bool = False  # fwd, short: the narrower tiles of a grid short of SMs
    wide: bool = False  # fwd, short: the wider tiles of a grid they fill better
    tiny: bool = False  # fwd, short: the tiles of sequences up to config.TINY_SEQLEN tokens
    few_tiles: bool = False  # fwd, short: two CTAs an SM where three would run few rounds
    by_index: bool = False  # fwd, causal: tiles dealt by index (two waves at most)
    one_round: bool = False  # fwd: one Q stage, as a grid of one round takes it
    long_rows: bool = False  # fwd: the tiles of sequences from config.LONG_SEQLEN tokens
    row_keys: int = 0  # fp8: a row length (keys) of the class whose config it builds
    small_grid: bool = False  # decode_fp8: the K/V stages of a grid of at most half the SMs
    short_parts: bool = False  # decode: the 64-key steps of parts of a few blocks

    @property
    def value_head_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def label(self) -> str:
        dv = "" if self.value_head_dim == self.head_dim else f" dv{self.value_head_dim}"
        text = (f"{self.direction} {self.dtype} d{self.head_dim}{dv} "
                f"{'causal' if self.causal else 'full'}")
        flags = [name for name in ("deterministic", "split_gqa", "lse_grad", "split_kv",
                                   "block_sparse", "long_rows", "short", "narrow", "wide", "tiny",
                                   "few_tiles", "one_round", "by_index", "small_grid",
                                   "many_q_tiles", "short_parts")
                 if getattr(self, name)]
        if self.page_size:
            flags.append(f"pages{self.page_size}")
        if self.rows_per_query > 1:
            flags.append(f"group{self.rows_per_query}")
        if self.direction == "fp8":
            flags.append(f"keys{self.row_keys}")
        return text + "".join(f" {f}" for f in flags)


def _short_variants(long: Variant) -> list[Variant]:
    """The forwards of short sequences whose configs differ from the long
    one's: the short tiles, those of a grid of few tiles and the narrow and
    wide tiles where a small grid takes them, and the tiny ones of the shortest
    sequences (config.fwd_config_for_problem); then each of these and the
    long one dealt by index where its tiles are claimed."""
    out = _distinct_configs((replace(long, short=True, **flags)
                             for flags in ({}, {"few_tiles": True}, {"narrow": True},
                                           {"wide": True}, {"tiny": True})),
                            seen=[config_of(long)])
    return out + _by_index([long, *out])


def _distinct_configs(candidates, seen=()) -> list[Variant]:
    """Those of `candidates` that have a config, each the first with its
    config (and none of `seen`)."""
    out, configs = [], list(seen)
    for variant in candidates:
        config = config_of(variant)
        if config is not None and config not in configs:
            out.append(variant)
            configs.append(config)
    return out


def _long_variants(base: Variant) -> list[Variant]:
    """The forward of long sequences where its config differs from the
    default one's (config.fwd_config_for_problem), and that with its tiles
    dealt by index where they are claimed (a few heads make two waves)."""
    variant = replace(base, long_rows=True)
    if config_of(variant) == config_of(base):
        return []
    return [variant, *_by_index([variant])]


def _by_index(forwards: list[Variant]) -> list[Variant]:
    """Those of `forwards` whose tiles are claimed, dealt by index instead,
    as a grid of two waves or less takes them (config.fixed_deal_balances);
    not three CTAs an SM, which run config.THREE_CTAS_MIN_ROUNDS rounds or
    more."""
    return [replace(v, by_index=True) for v in forwards
            if (config := config_of(v)).dynamic_tiles and config.ctas_per_sm < 3]


def _one_round(forwards: list[Variant]) -> list[Variant]:
    """Those of `forwards` with a Q ring, with one Q stage as a grid of one
    round takes them (config.grid_rounds), their tiles dealt by index where
    claimed: one round is less than two waves (config.fixed_deal_balances).
    The tiny tiles run two rounds at least."""
    out = []
    for variant in forwards:
        config = config_of(variant)
        if config.q_stages > 1 and not (variant.by_index or variant.tiny):
            out.append(replace(variant, one_round=True, by_index=config.dynamic_tiles))
    return out


def _fp8_variants(dtype: str, head_dim: int, causal: bool) -> list[Variant]:
    """The e4m3 forwards of a head dim (none where it has no e4m3 kernel),
    `dtype` the output's: one per distinct config over the row classes."""
    from .kernels.config import FP8_HEAD_DIMS, FP8_ROW_CLASS_KEYS

    if head_dim not in FP8_HEAD_DIMS:
        return []
    return _distinct_configs(Variant("fp8", dtype, head_dim, causal, row_keys=keys)
                             for keys in FP8_ROW_CLASS_KEYS)


def _decode_variants(dtype: str, head_dim: int, dv: int | None, causal: bool, page_sizes,
                     query_groups, fp8: bool = False) -> list[Variant]:
    """The KV-cache forwards of a head dim: split and not, per page size read
    in place (a page size these head dims' kernels gather first has no
    kernel of its own) and query group, of one query tile per KV head and
    of more; 16-bit caches each also with the 64-key steps of short parts
    (decode.SHORT_PART_KEYS), e4m3 caches (fp8: direction decode_fp8,
    `dtype` the output's, head dims of the FP8 forward) with the stages of
    a small grid. A variant whose config equals another's is left out."""
    from .decode import kernel_rows_per_query, reads_pages_in_place
    from .kernels.config import FP8_HEAD_DIMS

    if fp8 and head_dim not in FP8_HEAD_DIMS:
        return []
    head_dim_v = dv or head_dim
    pages = [p for p in page_sizes if not p or reads_pages_in_place(p, head_dim, head_dim_v, fp8)]
    groups = [g for g in query_groups if kernel_rows_per_query(g, g > 1, causal) == g]
    variants = [Variant("decode_fp8" if fp8 else "decode", dtype, head_dim, causal,
                        head_dim_v=dv, split_kv=split, page_size=page, rows_per_query=group,
                        small_grid=small, many_q_tiles=many, short_parts=short)
                for split, page, group, small, short, many in itertools.product(
                    (False, True), pages, groups, (False, True) if fp8 else (False,),
                    (False,) if fp8 else (False, True), (False, True))]
    # a short part's config is the long one's where the page size sets the step
    return [v for v in variants if not v.short_parts
            or config_of(v) != config_of(replace(v, short_parts=False))]


def variants(head_dims, dtypes, causal_flags, directions, lse_grad: bool,
             head_dims_v=None, page_sizes=(0,), query_groups=(1,),
             length_tiles: bool = False) -> list[Variant]:
    """The variants of every combination; head_dims_v None: each head dim's
    value head dim is its own, else every one of them no larger than it;
    length_tiles: also the forwards of long and short sequences where their
    tiles differ (config.fwd_config_for_problem);
    page_sizes: the decode variants' (0: a contiguous cache); query_groups:
    the decode variants' query heads per KV head (a step of several tokens
    masks g rows per token where causal, and reads them in place where g
    divides the tile, causal or not; 1 also serves one token)."""
    pairs = [(d, dv) for d in head_dims for dv in (head_dims_v or [d]) if dv <= d]
    out = []
    for dtype, (head_dim, head_dim_v), causal in itertools.product(dtypes, pairs, causal_flags):
        dv = None if head_dim_v == head_dim else head_dim_v
        if "fwd" in directions:
            base = Variant("fwd", dtype, head_dim, causal, head_dim_v=dv)
            out.append(base)
            if length_tiles:
                lengths = _long_variants(base) + _short_variants(base)
                out += lengths + _one_round([base, *lengths])
        if "decode" in directions:
            out += _decode_variants(dtype, head_dim, dv, causal, page_sizes, query_groups)
        if "decode_fp8" in directions and dtype == "bf16" and dv is None:
            out += _decode_variants(dtype, head_dim, dv, causal, page_sizes, query_groups,
                                    fp8=True)
        if "bwd" in directions:
            for det, split, grad in itertools.product((False, True), (False, True),
                                                      (False, True) if lse_grad else (False,)):
                out.append(Variant("bwd", dtype, head_dim, causal, det, split, grad,
                                   head_dim_v=dv))
        if "fp8" in directions and dv is None:
            out += _fp8_variants(dtype, head_dim, causal)
        if "block_sparse" in directions and not causal:  # the mask holds every limit
            out.append(Variant("fwd", dtype, head_dim, False, head_dim_v=dv, block_sparse=True))
            for split, grad in itertools.product((False, True),
                                                 (False, True) if lse_grad else (False,)):
                out.append(Variant("bwd", dtype, head_dim, False, False, split, grad,
                                   head_dim_v=dv, block_sparse=True))
    return out


def config_of(variant: Variant):
    """The config the op uses for a variant (FwdConfig or BwdConfig)."""
    from .kernels.config import (block_sparse_fwd_config, dealt_by_index, default_fwd_config,
                                 narrow_fwd_config, one_q_stage, tiny_fwd_config,
                                 wide_fwd_config)
    from .kernels.bwd_config import default_bwd_config

    if variant.direction in ("decode", "decode_fp8"):
        from . import decode
        return decode.kernel_config(variant.head_dim, variant.value_head_dim,
                                    variant.page_size or None, variant.direction == "decode_fp8",
                                    variant.small_grid, variant.short_parts)
    if variant.direction == "fp8":
        from .kernels.config import PLAIN_FEATURES, fp8_config_for_problem
        return fp8_config_for_problem(variant.head_dim, variant.causal, PLAIN_FEATURES,
                                      variant.row_keys)
    if variant.direction == "fwd":
        if variant.block_sparse:
            return block_sparse_fwd_config(variant.head_dim, variant.value_head_dim)
        if variant.narrow:
            config = narrow_fwd_config(variant.head_dim, variant.causal, variant.value_head_dim)
        elif variant.wide:
            config = wide_fwd_config(variant.head_dim, variant.causal, variant.value_head_dim)
        elif variant.tiny:
            config = tiny_fwd_config(variant.head_dim, variant.causal, variant.value_head_dim)
        else:
            config = default_fwd_config(variant.head_dim, variant.causal,
                                        variant.value_head_dim, short=variant.short,
                                        long_rows=variant.long_rows,
                                        few_tiles=variant.few_tiles)
        if variant.one_round:
            config = one_q_stage(config)
        return dealt_by_index(config) if variant.by_index else config
    # a block mask's backward takes the causal choices (bwd_config.bwd_config_for_problem)
    return default_bwd_config(variant.head_dim, variant.causal or variant.block_sparse,
                              variant.deterministic, split_gqa=variant.split_gqa,
                              head_dim_v=variant.value_head_dim,
                              block_sparse=variant.block_sparse)


def kernels_of(variant: Variant, cached: bool = True):
    """A variant's compiled kernels (CompiledKernel or CompiledBackward): through
    compile_cache's memory and store, or (cached=False) compiled now."""
    from . import compile_cache
    from .kernels.config import PLAIN_FEATURES, Features

    dtype, config = DTYPES[variant.dtype], config_of(variant)
    features = Features(block_sparse=True) if variant.block_sparse else PLAIN_FEATURES
    if variant.direction in ("decode", "decode_fp8"):
        from . import decode
        features = decode.kernel_features(variant.split_kv, variant.page_size > 0,
                                          variant.rows_per_query, not variant.many_q_tiles)
    if variant.direction in ("fp8", "decode_fp8"):  # `dtype` is the output's
        if cached:
            return compile_cache.get_fwd(torch.float8_e4m3fn, variant.head_dim, variant.causal,
                                         config, variant.head_dim, features, dtype)
        return compile_cache.compile_fwd(torch.float8_e4m3fn, variant.head_dim, variant.causal,
                                         config, head_dim_v=variant.head_dim, features=features,
                                         out_dtype=dtype)
    if variant.direction in ("fwd", "decode"):
        if cached:
            return compile_cache.get_fwd(dtype, variant.head_dim, variant.causal, config,
                                         variant.value_head_dim, features)
        return compile_cache.compile_fwd(dtype, variant.head_dim, variant.causal, config,
                                         head_dim_v=variant.value_head_dim, features=features)
    if cached:
        return compile_cache.get_bwd(dtype, variant.head_dim, variant.causal, config,
                                     variant.lse_grad, features,
                                     head_dim_v=variant.value_head_dim)
    return compile_cache.compile_bwd(dtype, variant.head_dim, variant.causal, config,
                                     variant.lse_grad, features=features,
                                     head_dim_v=variant.value_head_dim)


def build(variant: Variant) -> tuple[float, bool]:
    """Load or compile one variant; returns (seconds, loaded from the store).
    A decode variant brings the KV-cache append of its head dims (new k, v)."""
    kernels = [kernels_of(variant)]
    if variant.direction in ("decode", "decode_fp8"):
        from . import compile_cache

        fp8 = variant.direction == "decode_fp8"
        cache_dtype = torch.float8_e4m3fn if fp8 else DTYPES[variant.dtype]
        kernels.append(compile_cache.get_append(cache_dtype, variant.head_dim,
                                                variant.value_head_dim))
    return (sum(k.compile_seconds for k in kernels), all(k.from_disk for k in kernels))


def add_variant_options(p: argparse.ArgumentParser, directions=("fwd", "bwd")) -> None:
    """The options that choose kernel variants (also python -m cute_fa.aot's,
    whose directions are the ops' fwd and bwd)."""
    from .kernels.config import SUPPORTED_HEAD_DIMS

    add_head_dim_option(p, default=list(SUPPORTED_HEAD_DIMS), multiple=True,
                        help_default="all")
    p.add_argument("--head-dims-v", type=choice_list(SUPPORTED_HEAD_DIMS), default=None,
                   metavar="LIST",
                   help="value head dims, comma-separated: each one no larger than a head dim "
                        "of --head-dims makes variants with it (default: each head dim's own)")
    add_dtype_option(p, default=list(DTYPES), multiple=True)
    add_causal_option(p, default="both", allow_both=True)
    p.add_argument("--directions", type=choice_list(directions), default=["fwd", "bwd"],
                   metavar="LIST", help=f"from {', '.join(directions)}, comma-separated "
                                        f"(default: fwd,bwd)")
    p.add_argument("--lse-grad", action="store_true",
                   help="also the backward variants for a gradient through the returned LSE")
    p.add_argument("--jobs", type=positive_int, default=min(8, os.cpu_count() or 1),
                   help="processes compiling at once (default: the CPU count, at most 8)")


def chosen_variants(args: argparse.Namespace, length_tiles: bool = False) -> list[Variant]:
    return variants(args.head_dims, args.dtypes, CAUSAL_VALUES[args.causal], args.directions,
                    args.lse_grad, args.head_dims_v, getattr(args, "page_sizes", (0,)),
                    getattr(args, "query_groups", (1,)), length_tiles)


def _page_sizes(text: str) -> list[int]:
    """--page-sizes: 0 or page sizes the decode kernels read in place."""
    from . import decode

    sizes = []
    for item in text.split(","):
        try:
            size = int(item)
        except ValueError:
            size = -1
        if size < 0 or (size and not decode.reads_pages_in_place(size, 128, 128)):
            raise argparse.ArgumentTypeError(
                f"expected 0 (a contiguous cache) or page sizes the kernels read in place "
                f"(multiples of 128, divisors of 128 from 8, multiples of 16 below it), "
                f"got {item!r}")
        sizes.append(size)
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cute_fa.precompile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_options(p, ("fwd", "bwd", "decode", "block_sparse", "fp8", "decode_fp8"))
    p.add_argument("--page-sizes", type=_page_sizes, default=[0, 16, 256], metavar="LIST",
                   help="with --directions decode: page sizes of the paged-cache kernels, 0 "
                        "for a contiguous cache, comma-separated (default: 0,16,256)")
    p.add_argument("--query-groups", type=csv_list(positive_int), default=[1, 4, 8],
                   metavar="LIST",
                   help="with --directions decode: query heads per KV head of the models "
                        "served, comma-separated; a step of several new tokens reads each "
                        "token's group of rows in place where the group divides 64, and "
                        "masks it where causal (default: 1,4,8)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from . import kernel_store

    if not kernel_store.enabled():
        parser.error(f"the kernel store is off ({kernel_store.ENABLE_ENV_VAR}="
                     f"{os.environ[kernel_store.ENABLE_ENV_VAR]}): nothing to fill")
    todo = chosen_variants(args, length_tiles=True)
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
