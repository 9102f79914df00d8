"""Forward (inference) latency of the model per attention backend.

    python -m cute_fa.profiling.infer --backends cute,sdpa,sdpa_cudnn,fa4 --seq 4096 --batch 1

bf16 weights, eval mode, no autograd; the same weights and tokens for every
backend; --warmup untimed forwards, then the mean and standard deviation of
--steps timed forwards (CUDA events on a GPU; 50 steps by default, as the seed
reports measured). A backend that fails is a row with its error.
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

from .train import CONFIGS, model_config


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


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m cute_fa.profiling.infer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="cute,sdpa")
    p.add_argument("--config", choices=sorted(CONFIGS), default="default")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default="train_out/infer.json")
    args = p.parse_args(argv)
    backends = args.backends.split(",")
    for name in backends:
        if name not in BACKEND_NAMES:
            p.error(f"--backends: expected items of {BACKEND_NAMES}, got {name!r}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = model_config(args.config, args.seq)
    torch.manual_seed(args.seed)
    model = Transformer(config).to(device=device, dtype=torch.bfloat16).eval()
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                           generator=torch.Generator().manual_seed(args.seed)).to(device)
    rows = []
    for backend in backends:
        model.set_backend(backend)
        try:
            times = time_forward(model, tokens, args.steps, args.warmup)
            rows.append(dict(backend=backend, status="ok", mean_ms=statistics.mean(times),
                             std_ms=statistics.pstdev(times), steps=len(times)))
        except Exception as exc:  # a failing backend is a row, not the end of the run
            rows.append(dict(backend=backend, status=f"failed: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:150]}"))
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
