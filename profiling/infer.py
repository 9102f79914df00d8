"""Forward (inference) latency of the model per attention backend.

    python -m cute_fa.profiling.infer --backends cute,sdpa,sdpa_cudnn,fa4 --seq 4096 --batch 1
    python -m cute_fa.profiling.infer --config tiny --seq 64 --device cpu --out infer.json

bf16 weights, eval mode, no autograd; the same weights and tokens for every
backend; --warmup untimed forwards, then the mean and standard deviation of
--steps timed forwards (CUDA events on a GPU, wall time on the CPU). A backend
that fails is a row with its error. Prints the table; writes a JSON file only
with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from cute_fa.attention_backends import BACKEND_NAMES
from cute_fa.model import Transformer

from .backends import add_backends_option
from .cli import add_device_option, command_parser, nonnegative_int, positive_int
from .train import add_model_options, model_config


def time_forward(model, tokens, steps: int, warmup: int) -> list[float]:
    cuda = tokens.device.type == "cuda"
    with torch.no_grad():
        for _ in range(warmup):
            model(tokens)
        times = []
        for _ in range(steps):
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                model(tokens)
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            else:
                start = time.perf_counter()
                model(tokens)
                times.append((time.perf_counter() - start) * 1e3)
    return times


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("infer", __doc__)
    add_backends_option(p, ["cute", "sdpa"], BACKEND_NAMES)
    add_model_options(p)
    p.add_argument("--steps", type=positive_int, default=50,
                   help="timed forwards per backend (default: 50)")
    p.add_argument("--warmup", type=nonnegative_int, default=5,
                   help="untimed forwards per backend before them (default: 5)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and the tokens (default: 0)")
    add_device_option(p)
    p.add_argument("--out", default=None, metavar="PATH",
                   help="write the rows and arguments to this JSON file (default: write "
                        "nothing)")
    return p


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = model_config(args.config, args.seq)
    torch.manual_seed(args.seed)
    model = Transformer(config).to(device=device, dtype=torch.bfloat16).eval()
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                           generator=torch.Generator().manual_seed(args.seed)).to(device)
    rows = []
    for backend in args.backends:
        model.set_backend(backend)
        try:
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
    print(f"forward latency, batch {args.batch} x seq {args.seq}, {args.steps} steps, {device}")
    for r in rows:
        if r["status"] == "ok":
            print(f"  {r['backend']:<15} {r['mean_ms']:9.2f} ms ± {r['std_ms']:.2f}")
        else:
            print(f"  {r['backend']:<15} {r['status']}")
    return rows


if __name__ == "__main__":
    main()
