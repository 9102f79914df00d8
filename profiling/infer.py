"""Inference latency of the model per attention backend: one forward, or
generation with a KV cache (--generate).

    python -m cute_fa.profiling.infer --backends cute,sdpa,sdpa_cudnn,fa4 --seq 4096 --batch 1
    python -m cute_fa.profiling.infer --config tiny --seq 64 --device cpu --out infer.json
    python -m cute_fa.profiling.infer --config 1b --seq 2048 --generate 128 --batch 32 \
        --backends cute,sdpa

bf16 weights, eval mode, no autograd; the same weights and tokens for every
backend; --warmup untimed forwards, then the mean and standard deviation of
--steps timed forwards (CUDA events on a GPU, wall time on the CPU).
--generate N: a prompt of --seq tokens (prefill), then N - 1 greedy decode
steps of one token per sequence against the cache (generation.py: our op's
paged cache, or SDPA's contiguous one); the decode step captured in a CUDA
graph on a GPU unless --no-cuda-graph. With --warmup > 0 an untimed
generation of two tokens runs first (kernel compilation, library set-up).
Reported: time to first token (the prefill), per-token latency (median
and p99 of the steps) and tokens/s (batch · steps / their time). A backend that fails is a row with its
error. Prints the table; writes a JSON file only with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from cute_fa.attention_backends import BACKEND_NAMES
from cute_fa.generation import CACHE_BACKENDS, KVCache, greedy_generate, timed_call
from cute_fa.model import Transformer

from .backends import add_backends_option
from .cli import add_device_option, command_parser, nonnegative_int, positive_int
from .train import add_model_options, model_config


def time_forward(model, tokens, steps: int, warmup: int) -> list[float]:
    cuda = tokens.device.type == "cuda"
    with torch.no_grad():
        for _ in range(warmup):
            model(tokens)
        return [timed_call(cuda, lambda: model(tokens))[0] for _ in range(steps)]


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("infer", __doc__)
    add_backends_option(p, ["cute", "sdpa"], BACKEND_NAMES)
    add_model_options(p)
    p.add_argument("--steps", type=positive_int, default=50,
                   help="timed forwards per backend (default: 50)")
    p.add_argument("--warmup", type=nonnegative_int, default=5,
                   help="untimed forwards per backend before them; with --generate, 0 "
                        "skips the untimed generation before the timed one (default: 5)")
    p.add_argument("--generate", type=nonnegative_int, default=0, metavar="N",
                   help="generate N tokens after a --seq prompt with a KV cache (backends "
                        f"{', '.join(CACHE_BACKENDS)}); 0: time one forward (default: 0)")
    p.add_argument("--page-size", type=positive_int, default=256,
                   help="tokens per page of our paged KV cache with --generate (default: 256)")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="with --generate: run the decode steps eagerly instead of replaying "
                        "a captured CUDA graph")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and the tokens (default: 0)")
    add_device_option(p)
    p.add_argument("--out", default=None, metavar="PATH",
                   help="write the rows and arguments to this JSON file (default: write "
                        "nothing)")
    return p


def generation_row(model, config, prompt, args, backend: str) -> dict:
    """One backend's generation: time to first token, per-token latency, tokens/s."""
    cache = KVCache.allocate(config, prompt.shape[0], args.seq + args.generate, backend,
                             page_size=args.page_size, device=prompt.device)
    if args.warmup:  # first calls (compiling, library set-up) out of the first token's time
        greedy_generate(model, prompt, 2, cache)
        cache.lengths.zero_()
    result = greedy_generate(model, prompt, args.generate, cache, cuda_graph=args.cuda_graph)
    steps = sorted(result.step_ms)
    row = dict(backend=backend, status="ok", prefill_ms=result.prefill_ms,
               generated=args.generate)
    if steps:
        row.update(step_median_ms=statistics.median(steps),
                   step_p99_ms=steps[min(len(steps) - 1, int(0.99 * len(steps)))],
                   tokens_per_s=prompt.shape[0] * len(steps) / (sum(steps) / 1e3))
    return row


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = model_config(args.config, args.seq + args.generate, args.layers)
    torch.manual_seed(args.seed)
    model = Transformer(config).to(device=device, dtype=torch.bfloat16).eval()
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                           generator=torch.Generator().manual_seed(args.seed)).to(device)
    rows = []
    for backend in args.backends:
        model.set_backend(backend)
        try:
            if args.generate:
                rows.append(generation_row(model, config, tokens, args, backend))
                continue
            times = time_forward(model, tokens, args.steps, args.warmup)
            rows.append(dict(backend=backend, status="ok", mean_ms=statistics.mean(times),
                             std_ms=statistics.pstdev(times), steps=len(times)))
        except Exception as exc:  # a failing backend is a row, not the end of the run
            rows.append(dict(backend=backend, status=f"failed: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:150]}"))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"arguments": vars(args), "device": str(device), "rows": rows}, f, indent=1)
    if args.generate:
        print(f"generation, batch {args.batch}, prompt {args.seq}, {args.generate} tokens, "
              f"{device}")
    else:
        print(f"forward latency, batch {args.batch} x seq {args.seq}, {args.steps} steps, "
              f"{device}")
    for r in rows:
        if r["status"] != "ok":
            print(f"  {r['backend']:<15} {r['status']}")
        elif args.generate:
            steps = (f"  per token {r['step_median_ms']:.3f} ms (p99 {r['step_p99_ms']:.3f}), "
                     f"{r['tokens_per_s']:.1f} tokens/s" if "tokens_per_s" in r else "")
            print(f"  {r['backend']:<15} first token {r['prefill_ms']:9.2f} ms{steps}")
        else:
            print(f"  {r['backend']:<15} {r['mean_ms']:9.2f} ms ± {r['std_ms']:.2f}")
    return rows


if __name__ == "__main__":
    main()
