"""Block-sparse benchmark: ours under a FlexAttention BlockMask against
FlexAttention (torch.compile'd) with the same BlockMask, and against our own
dense kernel (no mask) on the same inputs.

    python -m cute_fa.profiling.sparse_bench --head-dims 64,128 --seqlens 8192,16384 \\
        --out docs/results/block_sparse/block_sparse

Masks (--masks), each a mask_mod through create_block_mask (128 x 128 blocks):
  random10, random30  blocks kept at random with that density (every block
                      full or empty: no element mask), the diagonal block kept;
  document            causal attention inside documents of lengths drawn
                      log-uniform from 256 to 4096 (a fixed seed): packed
                      training's mask, with partial blocks on the diagonal and
                      at document edges;
  sliding2048         causal sliding window of 2048 keys.
Throughput counts the useful work only, the (query, key) pairs the mask
leaves (4·b·h·d per pair forward, 2.5x that backward); the dense kernel's row
counts every pair. "speedup" is dense time over masked time, against the
issue's target 0.8 / density (density: the share of 128 x 128 blocks
computed). Implementations run round-robin in one process
(timing.time_interleaved). Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import itertools
import sys

import torch

from . import report
from .cli import choice_list, command_parser, csv_list, positive_int, require_cuda
from .problem import (add_head_dim_option, add_throughput_options, check_heads_dim_total,
                      packed_lengths, timed_step)
from .timing import time_interleaved

MASKS = ("random10", "random30", "document", "sliding2048")
BACKENDS = ("cute", "flex", "cute_dense")


def mask_mod(name: str, seqlen: int, seed: int, device: str):
    """The mask_mod of one named mask over seqlen x seqlen."""
    gen = torch.Generator().manual_seed(seed)
    if name.startswith("random"):
        density = int(name[len("random"):]) / 100
        blocks = -(-seqlen // 128)
        kept = torch.rand((blocks, blocks), generator=gen) < density
        kept |= torch.eye(blocks, dtype=torch.bool)  # every row sees a block
        kept = kept.to(device)
        return lambda b, h, q, k: kept[q // 128, k // 128]
    if name == "document":
        lengths = packed_lengths(seqlen, 256, 4096, seed)
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        doc = doc.to(device)
        return lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k)
    if name.startswith("sliding"):
        window = int(name[len("sliding"):])
        return lambda b, h, q, k: (q >= k) & (q - k < window)
    raise ValueError(f"mask: expected one of {MASKS}, got {name!r}")


def _callables(name, batch, seqlen, heads, head_dim, direction, backends, seed):
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

    from cute_fa import BlockSparseMask, flash_attn_func

    dev, dtype = "cuda", torch.bfloat16
    grad = direction == "fwd_bwd"
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=dev, dtype=dtype,
                           requires_grad=grad) for _ in range(3))
    do = torch.randn(batch, seqlen, heads, head_dim, device=dev, dtype=dtype)
    mod = mask_mod(name, seqlen, seed, dev)
    block_mask = create_block_mask(mod, None, None, seqlen, seqlen, device=dev)
    mask = BlockSparseMask.from_block_mask(block_mask)
    pairs = int(create_mask(mod, 1, 1, seqlen, seqlen, device=dev).sum())

    fns = {}
    if "cute" in backends:
        fns["cute"] = timed_step(lambda: flash_attn_func(q, k, v, block_mask=mask),
                                 do if grad else None, (q, k, v))
    if "flex" in backends:
        # a fresh compile per problem: each mask_mod is a new closure, and the
        # recompiles would otherwise reach dynamo's limit and run eagerly
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        fns["flex"] = timed_step(lambda: compiled(qt, kt, vt, block_mask=block_mask),
                                 do.transpose(1, 2) if grad else None, (q, k, v))
    if "cute_dense" in backends:
        fns["cute_dense"] = timed_step(lambda: flash_attn_func(q, k, v), do if grad else None,
                                       (q, k, v))
    return fns, pairs, mask.density()


def build_parser():
    p = command_parser("sparse_bench", __doc__)
    add_head_dim_option(p, [64, 128], multiple=True)
    p.add_argument("--seqlens", type=csv_list(int), default=[8192, 16384],
                   help="sequence lengths, comma-separated (default: 8192,16384)")
    p.add_argument("--tokens", type=positive_int, default=16384,
                   help="tokens per batch: batch = tokens / seqlen, at least 1 (default: 16384)")
    p.add_argument("--masks", type=choice_list(MASKS), default=list(MASKS),
                   help=f"masks, comma-separated, from {', '.join(MASKS)} (default: all)")
    add_throughput_options(p)
    p.add_argument("--backends", type=choice_list(BACKENDS), default=list(BACKENDS),
                   help="cute (ours, block-sparse), flex (FlexAttention, torch.compile'd, the "
                        "same BlockMask), cute_dense (ours without a mask) (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the masks (default: 0)")
    report.add_out_option(p)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if any(n < 1 for n in args.seqlens):
        p.error(f"--seqlens: expected positive integers, got {args.seqlens}")
    check_heads_dim_total(p, args)
    require_cuda("sparse_bench")
    rows = []
    for head_dim, seqlen, name, direction in itertools.product(
            args.head_dims, args.seqlens, args.masks, args.directions):
        heads = args.heads_dim_total // head_dim
        batch = max(args.tokens // seqlen, 1)
        fns, pairs, density = _callables(name, batch, seqlen, heads, head_dim, direction,
                                         args.backends, args.seed)
        times = time_interleaved(fns, repeats=args.repeats)
        scale = 4.0 * batch * heads * head_dim * (3.5 if direction == "fwd_bwd" else 1.0)
        for backend, (ms, repeats) in times.items():
            work = seqlen * seqlen if backend == "cute_dense" else pairs
            rows.append(dict(backend=backend, direction=direction, head_dim=head_dim,
                             heads=heads, batch=batch, seqlen=seqlen, mask=name,
                             density=density, pair_share=pairs / seqlen ** 2, ms=ms,
                             repeats=repeats, tflops=scale * work / ms / 1e9))
        line = "  ".join(f"{r['backend']} {r['ms']:.3f} ms" for r in rows[-len(times):])
        print(f"d={head_dim} s={seqlen} {name} (blocks {density:.3f}) {direction}: {line}")
    report.write_command_report("sparse_bench", argv, args, rows, format_markdown)
    return 0


def format_markdown(rows: list[dict], env: dict, command: str) -> str:
    """One table: per problem and direction, ours and FlexAttention (useful
    TFLOP/s and ms), ours over FlexAttention, and our speedup over our dense
    kernel against the target 0.8 / density."""
    lines = ["# Block-sparse attention (FlexAttention BlockMask)", "",
             *report.machine_lines(env),
             f"- command: `{command}`",
             "- useful FLOPs only (the pairs the mask leaves); density: the share of "
             "128 x 128 blocks computed; speedup: our dense time / our masked time", "",
             "| head dim | seqlen (batch) | mask | density | direction | ours ms | ours "
             "TFLOP/s | flex ms | flex TFLOP/s | ours / flex | speedup over dense | target "
             "0.8 / density |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    key = lambda r: (r["head_dim"], r["seqlen"], r["mask"], r["direction"])  # noqa: E731
    for (head_dim, seqlen, name, direction), group in itertools.groupby(
            sorted(rows, key=key), key):
        by = {r["backend"]: r for r in group}
        ours, flex, dense = by.get("cute"), by.get("flex"), by.get("cute_dense")
        if ours is None:
            continue

        def cells(r):
            return f"{r['ms']:.3f} | {r['tflops']:.1f}" if r else "n/a | n/a"

        vs_flex = f"{flex['ms'] / ours['ms']:.2f}" if flex else "n/a"
        speedup = f"{dense['ms'] / ours['ms']:.2f}" if dense else "n/a"
        lines.append(f"| {head_dim} | {seqlen} ({ours['batch']}) | {name} | "
                     f"{ours['density']:.3f} | {direction} | {cells(ours)} | {cells(flex)} | "
                     f"{vs_flex} | {speedup} | {0.8 / ours['density']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
