"""Train the llama-like model with one attention backend or several in turn.

    python -m cute_fa.profiling.train --backend cute --steps 1000 --seq 4096 --batch 1
    python -m cute_fa.profiling.train --backends cute,sdpa_cudnn,sdpa_flash,fa4 --steps 1000 --compile
    python -m cute_fa.profiling.train --backends cute,sdpa_cudnn --cuda-graph [--compile]
    python -m cute_fa.profiling.train --backends cute,sdpa_cudnn,sdpa_flash --compile --interleave 10

AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast.
--cuda-graph captures the whole training step (forward, backward, clipping,
optimizer) in one CUDA graph after GRAPH_WARMUP_STEPS eager steps and replays
it: the model's ~1 500 launches per step otherwise cost more host time than
the GPU needs to run them, and the host, not the attention kernel, sets the pace.
Every backend starts from the same seed, the same initial weights and the same
batches. Logged every --log-every steps: loss, tokens/s, TFLOP/s and MFU, with
    model FLOPs per token = 6·N + 6·n_layers·seq·dim
(N: parameters except the input embedding; the second term is causal attention,
QKᵀ and P·V, forward and backward) and MFU against the H100 SXM dense bf16 peak
of 989.4 TFLOP/s. Writes <out>/<backend>.csv (row by row, as each window is
logged), <out>/<backend>.json, <out>/compare.json, <out>/train.png (loss and
tokens/s per backend) and prints the comparison table. A backend that fails is
a row with its error; the run goes on.
--interleave N alternates the backends every N steps instead of running each
to the end in turn, so that the host's drift in speed (the steps are
host-bound without --cuda-graph) falls on all of them alike; the table then
adds the first backend's tokens/s over each one's: the median of the ratios
of windows that end at the same step, with its 95 % confidence interval
(paired_ratios).
--max-minutes M stops the run after about M minutes (the learning-rate
schedule still spans --steps), evaluates every backend where it stopped and
writes the same outputs: a run that must fit a time limit keeps its table.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass

import torch

from cute_fa.attention_backends import BACKEND_NAMES
from cute_fa.model import (DEFAULT, H100_BF16_DENSE_PEAK, TINY, ModelConfig, Transformer,
                              count_parameters, training_flops_per_token)

from .backends import check_items
from .data import TokenStream, ensure_dataset, load_split

CONFIGS = {"default": DEFAULT, "tiny": TINY}
LOG_FIELDS = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "elapsed_s"]
SKIPPED = "skipped: --max-minutes ran out before its first step"
GRAPH_WARMUP_STEPS = 3  # eager steps before capture: JIT compiles, allocator and library warm-up


def model_config(name: str, seq_len: int) -> ModelConfig:
    """The named config, with room for seq_len positions."""
    config = CONFIGS[name]
    return config.replace(max_seq_len=max(seq_len, config.max_seq_len))


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up to base_lr over `warmup` steps, then cosine decay to min_ratio·base_lr."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(path: str, model: Transformer, optimizer=None, step: int = 0,
                    backend: str = "") -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save({"model": model.state_dict(), "config": model.config.__dict__,
                "optimizer": optimizer.state_dict() if optimizer else None,
                "step": step, "backend": backend}, path)


def load_checkpoint(path: str, backend: str, device="cpu") -> tuple[Transformer, dict]:
    """Rebuild the model from a checkpoint under any backend (the state dict is
    backend-independent)."""
    state = torch.load(path, map_location=device, weights_only=False)
    model = Transformer(ModelConfig(**state["config"]), backend=backend).to(device)
    model.load_state_dict(state["model"])
    return model, state


class Trainer:
    """One backend's training run, advanced a chunk of steps at a time (so
    that --interleave can alternate backends). Throughput windows of
    --log-every steps are timed within a chunk only."""

    def __init__(self, backend: str, init_state: dict, args, device,
                 bar_position: int | None = 0, csv_log: bool = True):
        """bar_position: the row of its progress bar; None: no bar. csv_log:
        write <args.out>/<backend>.csv."""
        self.backend, self.args, self.device = backend, args, device
        config = model_config(args.config, args.seq)
        torch.manual_seed(args.seed)
        self.model = Transformer(config, backend=backend).to(device)
        self.model.load_state_dict(init_state)
        n_params = count_parameters(self.model, exclude_embeddings=True)
        self.flops_per_token = training_flops_per_token(config, args.seq, n_params)
        # A captured optimizer reads the learning rate from device memory, so
        # the schedule can change it between replays.
        lr = torch.tensor(args.lr, device=device) if args.cuda_graph else args.lr
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95),
                                           weight_decay=0.1, fused=device.type == "cuda",
                                           capturable=args.cuda_graph)
        self.stream = TokenStream(load_split(args.data, "train"), args.seq, args.batch,
                                  seed=args.seed)
        forward = torch.compile(self.model, fullgraph=True) if args.compile else self.model
        optimizer, model = self.optimizer, self.model

        def train_step(x, y):
            # The autocast weight cache would hold tensors from outside the graph pool.
            with torch.autocast(device.type, dtype=torch.bfloat16,
                                cache_enabled=not args.cuda_graph):
                loss = forward(x, y)[1]
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            # Detached: a loss that kept the autograd graph alive would keep
            # its gradient-accumulation nodes on the stream of this step, and
            # the next step (a CUDA graph capture) would have to sync with it.
            return loss.detach(), grad_norm

        self.step_runner = (GraphedStep(train_step, optimizer) if args.cuda_graph
                            else EagerStep(train_step, optimizer))
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.log, self.step, self.busy_s = [], 0, 0.0
        # Each window's row goes to <out>/<backend>.csv as it is logged, so a
        # run cut short (a time limit, a later backend's crash) keeps its logs.
        self.csv_path = os.path.join(args.out, f"{backend}.csv") if csv_log else None
        if self.csv_path:
            os.makedirs(args.out, exist_ok=True)
            with open(self.csv_path, "w", newline="") as f:
                csv.writer(f).writerow(LOG_FIELDS)
        self.bar = (None if bar_position is None
                    else _progress_bar(args.steps, f"train {backend}", bar_position))

    def run(self, steps: int) -> None:
        """The next `steps` training steps (a multiple of --log-every, or the rest)."""
        args = self.args
        self.sync()
        window_start = chunk_start = time.perf_counter()
        window_tokens = 0
        for step in range(self.step, min(self.step + steps, args.steps)):
            set_lr(self.optimizer, lr_at(step, args.lr, args.warmup, args.steps))
            x, y = self.stream.next_batch(self.device)
            loss, grad_norm = self.step_runner(x, y)
            window_tokens += x.numel()
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                loss_value = loss.item()  # synchronizes
                self.sync()
                now = time.perf_counter()
                tokens_per_s = window_tokens / (now - window_start)
                tflops = self.flops_per_token * tokens_per_s / 1e12
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"loss became {loss_value} at step {step + 1}")
                self.log.append(dict(
                    step=step + 1, loss=loss_value,
                    lr=float(self.optimizer.param_groups[0]["lr"]),
                    grad_norm=float(grad_norm), tokens_per_s=tokens_per_s, tflops=tflops,
                    mfu=tflops * 1e12 / H100_BF16_DENSE_PEAK,
                    elapsed_s=self.busy_s + now - chunk_start))
                if self.csv_path:
                    with open(self.csv_path, "a", newline="") as f:
                        csv.DictWriter(f, fieldnames=LOG_FIELDS).writerow(self.log[-1])
                if self.bar is not None:
                    self.bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_s:,.0f}")
                window_tokens, window_start = 0, time.perf_counter()
            self.step = step + 1
            if self.bar is not None:
                self.bar.update(1)
        self.sync()
        self.busy_s += time.perf_counter() - chunk_start

    @property
    def done(self) -> bool:
        return self.step >= self.args.steps

    def finish(self) -> dict:
        """Validation loss, the optional checkpoint and the summary row (also
        of a run that --max-minutes stopped early: steps_done says where)."""
        if self.bar is not None:
            self.bar.close()
        if self.step == 0:
            return dict(backend=self.backend, status=SKIPPED)
        val = evaluate(self.model, self.args, self.device)
        if self.args.save_checkpoint:
            save_checkpoint(os.path.join(self.args.out, f"{self.backend}.pt"), self.model,
                            self.optimizer, self.step, self.backend)
        log = self.log
        steady = log[1:] or log  # the first window holds compilation and warm-up

        def median(key):
            return sorted(r[key] for r in steady)[len(steady) // 2]

        return dict(backend=self.backend, status="ok", log=log, val_loss=val,
                    final_loss=log[-1]["loss"], params=count_parameters(self.model),
                    tokens_per_s=median("tokens_per_s"), tflops=median("tflops"),
                    mfu=median("mfu"), wall_s=self.busy_s, steps_done=self.step)


_now = time.perf_counter  # the clock --max-minutes is read on


def deadline(args) -> float:
    """_now() time at which --max-minutes runs out (inf without it)."""
    return math.inf if args.max_minutes is None else _now() + 60 * args.max_minutes


def train_one(backend: str, init_state: dict, args, device, stop_at: float = math.inf) -> dict:
    """Train one backend for all --steps, or until stop_at (log window by log
    window, so a stop lands on a logged step)."""
    if _now() >= stop_at:
        return dict(backend=backend, status=SKIPPED)
    trainer = Trainer(backend, init_state, args, device)
    while not trainer.done and _now() < stop_at:
        trainer.run(args.log_every)
    return trainer.finish()


def train_interleaved(init_state: dict, args, device, stop_at: float = math.inf) -> list[dict]:
    """All backends in rounds of --interleave steps each (A, B, C, A, B, C, ...):
    the host's speed drifts during a run (±15 % on the H100 machine), and
    rounds spread that drift over every backend alike instead of letting it
    favour whichever ran in a fast stretch. Every model, optimizer and
    compiled graph stays alive for the whole run. At stop_at the round under
    way finishes and every backend stops there, all at the same step."""
    results, trainers = {}, {}
    for position, backend in enumerate(args.backend_list):
        try:
            trainers[backend] = Trainer(backend, init_state, args, device, position)
        except Exception as exc:
            results[backend] = _failed(backend, exc)
    while trainers:
        stopping = _now() >= stop_at
        for backend, trainer in list(trainers.items()):
            try:
                if not stopping:
                    trainer.run(args.interleave)
                if trainer.done or stopping:
                    results[backend] = trainer.finish()
                    del trainers[backend]
            except Exception as exc:
                results[backend] = _failed(backend, exc)
                if trainer.bar is not None:
                    trainer.bar.close()
                del trainers[backend]
    return [results[b] for b in args.backend_list]


def _progress_bar(total: int, desc: str, position: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="step", position=position)


def _failed(backend: str, exc: Exception) -> dict:
    """A failing backend is a row with its error, not the end of the run."""
    traceback.print_exc()
    return dict(backend=backend, status=f"failed: {type(exc).__name__}: "
                f"{(str(exc).splitlines() or [''])[0][:150]}")


def set_lr(optimizer, value: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(value)  # in place: a captured optimizer step reads it
        else:
            group["lr"] = value


class EagerStep:
    """Run the training step as it is, and free the gradients after it."""

    def __init__(self, train_step, optimizer):
        self.train_step, self.optimizer = train_step, optimizer

    def __call__(self, x, y):
        out = self.train_step(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        return out


class GraphedStep:
    """The training step captured in one CUDA graph and replayed.

    Every batch is copied into the same static buffers, which the graph reads
    (and which keep torch.compile's guards, strides included, the same at
    capture as in warm-up: a recompile cannot run inside a capture). The first
    GRAPH_WARMUP_STEPS calls train eagerly on a side stream (what capture
    needs: kernels JIT-compiled, cuBLAS and the allocator warmed up); the next
    call captures the step and replays it, and every later call replays.
    Gradients are written, not accumulated, by each replay: they were unset
    when the backward was captured."""

    def __init__(self, train_step, optimizer):
        self.train_step, self.optimizer = train_step, optimizer
        self.calls, self.graph, self.static_batch = 0, None, None

    def __call__(self, x, y):
        self.calls += 1
        if self.static_batch is None:
            self.static_batch = (torch.empty_like(x, memory_format=torch.contiguous_format),
                                 torch.empty_like(y, memory_format=torch.contiguous_format))
        for static, new in zip(self.static_batch, (x, y)):
            static.copy_(new)
        if self.graph is None and self.calls <= GRAPH_WARMUP_STEPS:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.train_step(*self.static_batch)
                self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.current_stream().wait_stream(side)
            return out
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_out = self.train_step(*self.static_batch)
        self.graph.replay()
        return self.static_out


@torch.no_grad()
def evaluate(model, args, device, batches: int = 8) -> float:
    stream = TokenStream(load_split(args.data, "val"), args.seq, args.batch, seed=1234)
    losses = []
    for _ in range(batches):
        x, y = stream.next_batch(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            losses.append(model(x, y)[1].item())
    return sum(losses) / len(losses)


def write_outputs(results: list[dict], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    for r in results:
        if r["status"] != "ok":
            continue
        with open(os.path.join(out, f"{r['backend']}.json"), "w") as f:
            json.dump(r, f, indent=1)
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "log"} for r in results], f, indent=1)
    ok = [r for r in results if r["status"] == "ok"]
    if ok:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
        for r in ok:
            steps = [row["step"] for row in r["log"]]
            ax_loss.plot(steps, [row["loss"] for row in r["log"]], label=r["backend"])
            ax_tps.plot(steps, [row["tokens_per_s"] for row in r["log"]], label=r["backend"])
        ax_loss.set(xlabel="step", ylabel="training loss", title="loss")
        ax_tps.set(xlabel="step", ylabel="tokens/s", title="throughput")
        for ax in (ax_loss, ax_tps):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "train.png"), dpi=110)
        plt.close(fig)


@dataclass(frozen=True)
class PairedRatio:
    """The first backend's tokens/s over another's, window by window."""
    median: float
    low: float        # 95 % confidence interval of the median (order statistics,
    high: float       # distribution-free: the windows' spread is the host's noise)
    first_faster: int  # windows in which the first backend was faster
    windows: int

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.low:.3f}, {self.high:.3f}]"


def paired_ratios(logs: dict[str, list[dict]]) -> dict[str, PairedRatio]:
    """Interleaved runs: for each backend, the first backend's tokens/s divided
    by its own in the log windows that end at the same step. Two such windows
    ran one round apart at most, so the host's drift cancels in each ratio,
    which comparing the two backends' medians does not promise. The first
    window of each backend (compilation) is left out."""
    names = list(logs)
    if not names:
        return {}
    first = {row["step"]: row["tokens_per_s"] for row in logs[names[0]][1:]}
    ratios = {}
    for name in names:
        pairs = sorted(first[row["step"]] / row["tokens_per_s"] for row in logs[name][1:]
                       if row["step"] in first)
        if not pairs:
            continue
        n = len(pairs)
        # Ranks n/2 -+ 1.96·sqrt(n)/2 bound the median with ~95 % confidence.
        half_width = 1.96 * math.sqrt(n) / 2
        ratios[name] = PairedRatio(
            median=pairs[n // 2], low=pairs[max(0, math.floor(n / 2 - half_width))],
            high=pairs[min(n - 1, math.ceil(n / 2 + half_width))],
            first_faster=sum(r > 1 for r in pairs), windows=n)
    return ratios


def format_comparison(results: list[dict], steps: int) -> str:
    """The comparison table; steps: --steps, to mark runs stopped short of it."""
    ok = [r for r in results if r["status"] == "ok"]
    paired = {}
    if ok and all("paired_ratio" in r for r in ok):
        paired = {r["backend"]: PairedRatio(**r["paired_ratio"]) for r in ok}
        ratio_title = f"{ok[0]['backend']}/this [95% CI]"
    ratio_width = 24
    lines = [f"{'backend':<15} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'final loss':>10} "
             f"{'val loss':>9}" + (f" {ratio_title:>{ratio_width}}" if paired else "")
             + "  status"]
    for r in results:
        if r["status"] == "ok":
            ratio = f" {str(paired[r['backend']]):>{ratio_width}}" if paired else ""
            status = "ok" if r["steps_done"] == steps else \
                f"ok, stopped at step {r['steps_done']} of {steps} (--max-minutes)"
            lines.append(f"{r['backend']:<15} {r['tokens_per_s']:>10,.0f} {r['tflops']:>8.1f} "
                         f"{r['mfu']:>6.1%} {r['final_loss']:>10.4f} {r['val_loss']:>9.4f}"
                         f"{ratio}  {status}")
        else:
            lines.append(f"{r['backend']:<15} {'-':>10} {'-':>8} {'-':>6} {'-':>10} {'-':>9}"
                         + (f" {'-':>{ratio_width}}" if paired else "") + f"  {r['status']}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cute_fa.profiling.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=None, help="one backend (default: cute)")
    p.add_argument("--backends", default=None, help="comma-separated, run in sequence")
    p.add_argument("--config", choices=sorted(CONFIGS), default="default")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture the whole training step in a CUDA graph and replay it")
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="with several backends, alternate them every N steps (a multiple "
                        "of --log-every) instead of running each to the end in turn")
    p.add_argument("--max-minutes", type=float, default=None, metavar="M",
                   help="stop after about M minutes (at the next log window, or with "
                        "--interleave the next round), evaluate and report the steps done; "
                        "the learning-rate schedule still spans --steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default="data/stdlib.parquet")
    p.add_argument("--out", default="train_out")
    p.add_argument("--save-checkpoint", action="store_true")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = p.parse_args(argv)
    names = (args.backends.split(",") if args.backends else [args.backend or "cute"])
    check_items(p, "--backends", names, BACKEND_NAMES)
    args.backend_list = names
    if args.cuda_graph and args.steps <= GRAPH_WARMUP_STEPS:
        p.error(f"--steps: expected more than {GRAPH_WARMUP_STEPS} with --cuda-graph "
                f"(eager warm-up steps before capture), got {args.steps}")
    if args.interleave and (args.interleave < 0 or args.interleave % args.log_every):
        p.error(f"--interleave: expected a positive multiple of --log-every "
                f"({args.log_every}), got {args.interleave}")
    if args.max_minutes is not None and args.max_minutes <= 0:
        p.error(f"--max-minutes: expected a positive number, got {args.max_minutes}")
    if args.steps < 1 or args.seq < 2 or args.batch < 1:
        p.error(f"--steps, --seq, --batch: expected positive values (seq >= 2), got "
                f"{args.steps}, {args.seq}, {args.batch}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.cuda_graph and device.type != "cuda":
        raise SystemExit(f"--cuda-graph: needs a CUDA device, got --device {device}")
    ensure_dataset(args.data)
    config = model_config(args.config, args.seq)
    torch.manual_seed(args.seed)
    init_state = copy.deepcopy(Transformer(config).state_dict())
    stop_at = deadline(args)
    if args.interleave:
        results = train_interleaved(init_state, args, device, stop_at)
        ratios = paired_ratios({r["backend"]: r["log"] for r in results if r["status"] == "ok"})
        for r in results:
            if r["backend"] in ratios:
                r["paired_ratio"] = asdict(ratios[r["backend"]])
    else:
        results = []
        for backend in args.backend_list:
            try:
                results.append(train_one(backend, init_state, args, device, stop_at))
            except Exception as exc:
                results.append(_failed(backend, exc))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    write_outputs(results, args.out)
    print(format_comparison(results, args.steps))
    return results


if __name__ == "__main__":
    main()
