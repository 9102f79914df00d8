"""Train the llama-like model with one attention backend or several in turn.

    python -m cute_fa.profiling.train --backend cute --steps 1000 --seq 4096 --batch 1
    python -m cute_fa.profiling.train --backends cute,sdpa_cudnn,sdpa_flash,fa4 --steps 1000 --compile
    python -m cute_fa.profiling.train --backends cute,sdpa_cudnn --cuda-graph [--compile]
    python -m cute_fa.profiling.train --backends cute,sdpa_cudnn,sdpa_flash --compile --interleave 10
    python -m cute_fa.profiling.train --config tiny --seq 64 --steps 20 --device cpu --out train_out

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
of 989.4 TFLOP/s. Prints the comparison table; with --out DIR also writes
DIR/<backend>.csv (row by row, as each window is logged), DIR/<backend>.json,
DIR/compare.json, DIR/train.png (loss and tokens/s per backend) and, with
--save-checkpoint, DIR/<backend>.pt. Without --out it writes nothing but the
training data's cache (profiling.data: the Python standard library's source,
prepared on first use into the per-user cache folder). A backend that fails is
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
Under torchrun, --fsdp and --context-parallel train one backend on every
rank (distributed.py: FSDP2, ring attention, distributed checkpoints that
--resume reads); rank 0 logs and writes.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass

import torch

from cute_fa.attention_backends import BACKEND_NAMES
from cute_fa.model import (DEFAULT, H100_BF16_DENSE_PEAK, LLAMA3_8B, ONE_B, TINY, ModelConfig,
                           Transformer, count_parameters, training_flops_per_token)

from . import distributed
from .backends import backends_help
from .cli import (INSTALL_BENCH, Progress, add_device_option, choice_list, command_parser,
                  int_at_least, nonnegative_int, positive_float, positive_int, require_module)
from .data import TokenStream, add_data_option, ensure_dataset, load_split

CONFIGS = {"default": DEFAULT, "tiny": TINY, "1b": ONE_B, "llama3_8b": LLAMA3_8B}
LOG_FIELDS = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "elapsed_s"]
SKIPPED = "skipped: --max-minutes ran out before its first step"
GRAPH_WARMUP_STEPS = 3  # eager steps before capture: JIT compiles, allocator and library warm-up


def model_config(name: str, seq_len: int, layers: int | None = None) -> ModelConfig:
    """The named config, with room for seq_len positions and, where given,
    `layers` blocks instead of its own count."""
    config = CONFIGS[name]
    config = config.replace(max_seq_len=max(seq_len, config.max_seq_len))
    return config if layers is None else config.replace(n_layers=layers)


def initial_state(config: ModelConfig, seed: int, device) -> dict:
    """The weights every backend starts from: drawn from `seed` on `device`
    (on a GPU the draw of Llama-3-8B's 7B weights takes a moment, on one CPU
    thread minutes), kept on the CPU."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(config)
    return {name: value.cpu() for name, value in model.state_dict().items()}


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
        write <args.out>/<backend>.csv (where args.out is given)."""
        self.backend, self.args, self.device = backend, args, device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        config = model_config(args.config, args.seq, args.layers)
        self.model = Transformer.from_state(config, init_state, backend, device)
        n_params = count_parameters(self.model, exclude_embeddings=True)
        run = self.dist = getattr(args, "dist", None)
        if run is not None:
            distributed.prepare(self.model, run, args.activation_checkpointing, args.compile)
        self.flops_per_token = training_flops_per_token(config, args.seq, n_params)
        # A captured optimizer reads the learning rate from device memory, so
        # the schedule can change it between replays.
        lr = torch.tensor(args.lr, device=device) if args.cuda_graph else args.lr
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95),
                                           weight_decay=0.1,
                                           fused=device.type == "cuda" and run is None,
                                           capturable=args.cuda_graph)
        self.stream = TokenStream(load_split(args.data, "train"), args.seq, args.batch,
                                  seed=args.seed + (run.data_rank if run else 0))
        # (distributed: the blocks are compiled one by one, distributed.prepare)
        forward = (torch.compile(self.model, fullgraph=True) if args.compile and run is None
                   else self.model)
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
        if getattr(args, "resume", None):
            self.step = distributed.load(args.resume, self.model, self.optimizer)
            for _ in range(self.step):  # the batches the saved run has trained on
                self.stream.next_batch()
        lead = run is None or run.rank == 0
        csv_log, bar_position = csv_log and lead, bar_position if lead else None
        # Each window's row goes to <out>/<backend>.csv as it is logged, so a
        # run cut short (a time limit, a later backend's crash) keeps its logs.
        self.csv_path = (os.path.join(args.out, f"{backend}.csv") if csv_log and args.out
                         else None)
        if self.csv_path:
            os.makedirs(args.out, exist_ok=True)
            with open(self.csv_path, "w", newline="") as f:
                csv.writer(f).writerow(LOG_FIELDS)
        self.bar = (None if bar_position is None
                    else Progress(args.steps, f"train {backend}", "step", every=args.log_every,
                                  position=bar_position))

    def run(self, steps: int) -> None:
        """The next `steps` training steps (a multiple of --log-every, or the rest)."""
        args = self.args
        self.sync()
        window_start = chunk_start = time.perf_counter()
        window_tokens = 0
        for step in range(self.step, min(self.step + steps, args.steps)):
            note = None
            set_lr(self.optimizer, lr_at(step, args.lr, args.warmup, args.steps))
            x, y = self.stream.next_batch(self.device)
            if self.dist is not None:
                x, y = self.dist.local_batch(x, y)
            loss, grad_norm = self.step_runner(x, y)
            window_tokens += x.numel()
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                # synchronizes
                loss_value = self.dist.mean(loss) if self.dist else loss.item()
                self.sync()
                now = time.perf_counter()
                tokens_per_s = window_tokens / (now - window_start)
                tflops = self.flops_per_token * tokens_per_s / 1e12
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"loss became {loss_value} at step {step + 1}")
                self.log.append(dict(
                    step=step + 1, loss=loss_value,
                    lr=float(self.optimizer.param_groups[0]["lr"]),
                    grad_norm=distributed.full_value(grad_norm), tokens_per_s=tokens_per_s,
                    tflops=tflops,
                    mfu=tflops * 1e12 / H100_BF16_DENSE_PEAK,
                    elapsed_s=self.busy_s + now - chunk_start))
                if self.csv_path:
                    with open(self.csv_path, "a", newline="") as f:
                        csv.DictWriter(f, fieldnames=LOG_FIELDS).writerow(self.log[-1])
                note = f"loss {loss_value:.3f}, {tokens_per_s:,.0f} tokens/s"
                window_tokens, window_start = 0, time.perf_counter()
            self.step = step + 1
            if self.bar is not None:
                self.bar.update(1, note)
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
        val = evaluate(self.model, self.args, self.device, self.dist)
        if self.args.save_checkpoint and self.dist is not None:
            distributed.save(os.path.join(self.args.out, f"{self.backend}.dcp"), self.model,
                             self.optimizer, self.step)
        elif self.args.save_checkpoint:
            save_checkpoint(os.path.join(self.args.out, f"{self.backend}.pt"), self.model,
                            self.optimizer, self.step, self.backend)
        log = self.log
        steady = log[1:] or log  # the first window holds compilation and warm-up

        def median(key):
            return sorted(r[key] for r in steady)[len(steady) // 2]

        # The most this rank's GPU held at once since this trainer was made
        # (with --interleave the other backends' trainers are in it too).
        peak_gib = (torch.cuda.max_memory_allocated(self.device) / 2**30
                    if self.device.type == "cuda" else None)
        return dict(backend=self.backend, status="ok", log=log, val_loss=val,
                    final_loss=log[-1]["loss"], params=count_parameters(self.model),
                    tokens_per_s=median("tokens_per_s"), tflops=median("tflops"),
                    mfu=median("mfu"), wall_s=self.busy_s, steps_done=self.step,
                    peak_gib=peak_gib)


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
    the host's speed drifts during a run (±15 % measured on an H100 host), and
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
def evaluate(model, args, device, run=None, batches: int = 8) -> float:
    """The mean loss of `batches` validation batches (the same on every rank;
    context parallel: each rank's part of them, averaged)."""
    stream = TokenStream(load_split(args.data, "val"), args.seq, args.batch, seed=1234)
    losses = []
    for _ in range(batches):
        x, y = stream.next_batch(device)
        if run is not None:
            x, y = run.local_batch(x, y)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x, y)[1]
        losses.append(run.mean(loss) if run is not None else loss.item())
    return sum(losses) / len(losses)


def write_outputs(results: list[dict], out: str) -> None:
    """<out>/<backend>.json, <out>/compare.json and the plot <out>/train.png."""
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
        matplotlib = require_module("matplotlib", INSTALL_BENCH, "train's plot (--out)")
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
             f"{'val loss':>9} {'peak GiB':>8}"
             + (f" {ratio_title:>{ratio_width}}" if paired else "") + "  status"]
    for r in results:
        if r["status"] == "ok":
            ratio = f" {str(paired[r['backend']]):>{ratio_width}}" if paired else ""
            status = "ok" if r["steps_done"] == steps else \
                f"ok, stopped at step {r['steps_done']} of {steps} (--max-minutes)"
            peak = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}"
            lines.append(f"{r['backend']:<15} {r['tokens_per_s']:>10,.0f} {r['tflops']:>8.1f} "
                         f"{r['mfu']:>6.1%} {r['final_loss']:>10.4f} {r['val_loss']:>9.4f} "
                         f"{peak:>8}{ratio}  {status}")
        else:
            lines.append(f"{r['backend']:<15} {'-':>10} {'-':>8} {'-':>6} {'-':>10} {'-':>9} "
                         f"{'-':>8}"
                         + (f" {'-':>{ratio_width}}" if paired else "") + f"  {r['status']}")
    return "\n".join(lines)


def add_model_options(p, seq: int = 4096, batch: int = 1) -> None:
    """The model and its input: --config, --seq, --batch (train, step, infer)."""
    p.add_argument("--config", choices=sorted(CONFIGS), default="default",
                   help="model size: default (24 layers, dim 1024, 8 query and 4 K/V heads of "
                        "128), tiny (2 layers, dim 128, for the CPU), 1b (16 layers, dim 2048, "
                        "16 and 8 heads of 128, FFN 8192) or llama3_8b (Llama-3-8B's shape: 32 "
                        "layers, dim 4096, 32 and 8 heads, FFN 14336; 7.0B parameters with "
                        "the byte vocabulary) (default: default)")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="blocks in the model instead of the config's count (a few of "
                        "llama3_8b's layers fit one GPU: memory and time per layer) "
                        "(default: the config's)")
    p.add_argument("--seq", type=int_at_least(2), default=seq,
                   help=f"tokens per sequence (default: {seq})")
    p.add_argument("--batch", type=positive_int, default=batch,
                   help=f"sequences per step (default: {batch})")


def add_step_options(p) -> None:
    """How the training step runs: --compile, --cuda-graph (train, step)."""
    p.add_argument("--compile", action="store_true",
                   help="run the model through torch.compile(fullgraph=True)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture the whole training step in a CUDA graph after "
                        f"{GRAPH_WARMUP_STEPS} eager steps and replay it (host time then all "
                        "but vanishes; needs a CUDA device)")


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("train", __doc__)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--backend", choices=BACKEND_NAMES, default=None,
                       help="the one attention backend to train with (default: cute). "
                            + backends_help(BACKEND_NAMES))
    which.add_argument("--backends", type=choice_list(BACKEND_NAMES), default=None,
                       metavar="LIST", help="several backends, comma-separated, from "
                       f"{', '.join(BACKEND_NAMES)}: trained one after the other (or in turns, "
                       "--interleave), each from the same weights and batches")
    add_model_options(p)
    p.add_argument("--steps", type=positive_int, default=1000,
                   help="training steps per backend; the learning-rate schedule spans them "
                        "(default: 1000)")
    p.add_argument("--lr", type=positive_float, default=5e-5,
                   help="peak learning rate of AdamW (default: 5e-5)")
    p.add_argument("--warmup", type=nonnegative_int, default=100,
                   help="steps of linear learning-rate warm-up before the cosine decay "
                        "(default: 100)")
    p.add_argument("--clip", type=positive_float, default=1.0,
                   help="gradient clipping: the largest gradient norm (default: 1.0)")
    p.add_argument("--log-every", type=positive_int, default=10,
                   help="steps per log window: loss, tokens/s, TFLOP/s, MFU (default: 10)")
    add_step_options(p)
    p.add_argument("--interleave", type=nonnegative_int, default=0, metavar="N",
                   help="with several backends, alternate them every N steps (a multiple "
                        "of --log-every) instead of running each to the end in turn "
                        "(default: 0, in turn)")
    p.add_argument("--max-minutes", type=positive_float, default=None, metavar="M",
                   help="stop after about M minutes (at the next log window, or with "
                        "--interleave the next round), evaluate and report the steps done; "
                        "the learning-rate schedule still spans --steps (default: no limit)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights and the batches (default: 0)")
    add_data_option(p)
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write the logs, summaries and plot into this folder, creating it "
                        "(default: write nothing, print the table only)")
    p.add_argument("--save-checkpoint", action="store_true",
                   help="also write each backend's weights and optimizer state to "
                        "<DIR>/<backend>.pt (needs --out; distributed: the checkpoint folder "
                        "<DIR>/<backend>.dcp)")
    add_device_option(p)
    parallel = p.add_argument_group("several processes (under torchrun; distributed.py)")
    parallel.add_argument("--fsdp", action="store_true",
                          help="data parallel, parameters sharded by FSDP2")
    parallel.add_argument("--context-parallel", action="store_true",
                          help="every sequence split over the ranks, ring attention with "
                               "the cute_fa ops (parameters sharded by FSDP2)")
    parallel.add_argument("--activation-checkpointing", type=positive_int, nargs="?", const=1,
                          default=0, metavar="EVERY",
                          help="recompute the blocks' activations in the backward: every "
                               "block's, or with EVERY only every EVERY-th block's (selective: "
                               "the others keep theirs, less recompute for more memory)")
    parallel.add_argument("--resume", default=None, metavar="DIR",
                          help="continue from a distributed checkpoint folder (written by "
                               "--save-checkpoint), at another world size or backend too")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    args.backend_list = args.backends or [args.backend or "cute"]
    if args.cuda_graph and args.steps <= GRAPH_WARMUP_STEPS:
        p.error(f"--steps: expected more than {GRAPH_WARMUP_STEPS} with --cuda-graph "
                f"(eager warm-up steps before capture), got {args.steps}")
    if args.interleave % args.log_every:
        p.error(f"--interleave: expected a multiple of --log-every "
                f"({args.log_every}), got {args.interleave}")
    if args.save_checkpoint and not args.out:
        p.error("--save-checkpoint: needs --out DIR, the folder of <backend>.pt")
    args.parallel = args.fsdp or args.context_parallel
    if args.parallel and (len(args.backend_list) > 1 or args.interleave or args.cuda_graph):
        p.error("--fsdp / --context-parallel: one --backend, without --interleave or "
                "--cuda-graph")
    if (args.resume or args.activation_checkpointing) and not args.parallel:
        p.error("--resume / --activation-checkpointing: with --fsdp or --context-parallel")
    if args.context_parallel and args.seq % 2:
        p.error(f"--seq: expected an even length to split (2 chunks per rank), got {args.seq}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.cuda_graph and device.type != "cuda":
        raise SystemExit(f"--cuda-graph: needs a CUDA device, got --device {device}")
    args.dist = None
    if args.parallel:
        args.dist = distributed.start(device.type, args.context_parallel)
        device = args.dist.device
        try:
            return _main(args, device)
        finally:
            distributed.finish()
    return _main(args, device)


def _main(args, device) -> list[dict]:
    args.data = ensure_dataset(args.data)
    init_state = initial_state(model_config(args.config, args.seq, args.layers), args.seed,
                               device)
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
    if args.dist is None or args.dist.rank == 0:
        if args.out:
            write_outputs(results, args.out)
        print(format_comparison(results, args.steps))
    return results


if __name__ == "__main__":
    main()
