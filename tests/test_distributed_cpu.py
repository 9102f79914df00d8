"""Training on several processes, on the CPU (gloo): the FSDP2 and
context-parallel paths of profiling.train give the loss and gradients of
the single-process model (tiny config), a distributed checkpoint resumes
the next step bitwise and loads at another world size, and the torchrun
command line runs."""

import csv
import functools
import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cute_fa.model import TINY, Transformer

SEQ, BATCH = 32, 2


def _rank(work):
    """A spawned rank: joins the gloo group, runs work(rank, world, *args),
    and leaves only once every rank is done (a rank that left early made
    gloo abort another's exit). FSDP's modules and gloo's finished works are
    released while the interpreter is whole, and the rank then exits without
    the interpreter's teardown: gloo's worker threads can still hold
    tensors there, and freeing them at finalization can abort the process
    (the likeliest cause of a rank that aborted in CI with 'terminate called
    without an active exception')."""

    @functools.wraps(work)
    def main(rank, world, init_file, *args):
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        try:
            work(rank, world, *args)
            gc.collect()
            dist.barrier()
        finally:
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    return main


def _batches(seed, batch=BATCH):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY.vocab_size, (batch, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _model():
    torch.manual_seed(0)
    return Transformer(TINY.replace(max_seq_len=SEQ))


def _loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x, y)[1]


def _full_grads(model):
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
            for name, p in model.named_parameters()}


@_rank
def _parallel_rank(rank, world, context_parallel, out):
    from cute_fa.profiling.distributed import DistributedRun, prepare

    run = DistributedRun(rank, world, torch.device("cpu"), context_parallel)
    # every block recomputed (context parallel) or block 0 of 2 (selective)
    model = prepare(_model(), run, recompute_every=1 if context_parallel else 2)
    x, y = _batches(run.data_rank)
    loss = _loss(model, *run.local_batch(x, y))
    loss.backward()
    mean_loss = run.mean(loss)
    grads = _full_grads(model)
    if rank == 0:
        torch.save((mean_loss, grads), out)


@pytest.mark.parametrize("context_parallel", [False, True])
def test_parallel_training_matches_one_process(tmp_path, context_parallel):
    """FSDP (each rank its own batch) and context parallel (each rank a part
    of every sequence): the averaged loss and the gradients of one process
    on all of the data."""
    world, out = 2, str(tmp_path / "out.pt")
    mp.spawn(_parallel_rank, args=(world, str(tmp_path / "init"), context_parallel, out),
             nprocs=world, join=True)
    loss, grads = torch.load(out)
    model = _model()
    if context_parallel:
        x, y = _batches(0)
    else:  # the ranks' batches together
        parts = [_batches(r) for r in range(world)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    expected = _loss(model, x, y)
    expected.backward()
    # FSDP computes in bf16 parameters (MixedPrecisionPolicy), one process
    # under autocast: bf16 rounding apart
    assert abs(loss - expected.item()) < 2e-2 * expected.item()
    for name, p in model.named_parameters():
        scale = p.grad.abs().max().item()
        err = (grads[name] - p.grad).abs().max().item()
        assert err <= 0.05 * scale + 1e-6, f"{name}: {err:.3e} of {scale:.3e}"


@_rank
def _recompute_rank(rank, world, out):
    from cute_fa.profiling.distributed import DistributedRun, prepare

    run = DistributedRun(rank, world, torch.device("cpu"), False)
    model = Transformer(TINY.replace(max_seq_len=SEQ, n_layers=4))
    calls = [0] * len(model.layers)
    for index, block in enumerate(model.layers):
        block.attention.register_forward_pre_hook(
            lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    model = prepare(model, run, recompute_every=2)
    _loss(model, *_batches(0)).backward()
    torch.save(calls, out)


def test_selective_recompute_runs_every_nth_block_again(tmp_path):
    """--activation-checkpointing 2: blocks 0 and 2 run their forward again in
    the backward, blocks 1 and 3 keep their activations."""
    out = str(tmp_path / "calls.pt")
    mp.spawn(_recompute_rank, args=(1, str(tmp_path / "init"), out), nprocs=1, join=True)
    assert torch.load(out) == [2, 1, 2, 1]


@_rank
def _checkpoint_rank(rank, world, folder, out):
    from cute_fa.profiling import distributed
    from cute_fa.profiling.distributed import DistributedRun, prepare

    run = DistributedRun(rank, world, torch.device("cpu"), False)

    def trained(steps, resume=None):
        model = prepare(_model(), run, recompute_every=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        start = distributed.load(resume, model, optimizer) if resume else 0
        losses = []
        for step in range(start, steps):
            loss = _loss(model, *_batches(100 * step + rank))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return model, optimizer, losses

    model, optimizer, _ = trained(2)
    distributed.save(folder, model, optimizer, 2)
    saved = {n: p.full_tensor() for n, p in model.named_parameters()}
    _, _, straight = trained(3)
    _, _, resumed = trained(3, resume=folder)
    if rank == 0:
        torch.save((straight[-1], resumed[-1], saved), out)


@_rank
def _load_at_one_rank(rank, world, folder, out):
    from cute_fa.profiling import distributed
    from cute_fa.profiling.distributed import DistributedRun, prepare

    run = DistributedRun(rank, world, torch.device("cpu"), False)
    model = prepare(_model(), run, recompute_every=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = distributed.load(folder, model, optimizer)
    torch.save((step, {n: p.full_tensor() for n, p in model.named_parameters()}), out)


def test_a_checkpoint_resumes_bitwise_and_loads_at_another_world_size(tmp_path):
    folder, out = str(tmp_path / "ckpt"), str(tmp_path / "out.pt")
    mp.spawn(_checkpoint_rank, args=(2, str(tmp_path / "init"), folder, out), nprocs=2,
             join=True)
    straight, resumed, saved = torch.load(out)
    assert torch.equal(straight, resumed)  # the step after the checkpoint, bitwise
    one = str(tmp_path / "one.pt")
    mp.spawn(_load_at_one_rank, args=(1, str(tmp_path / "init1"), folder, one), nprocs=1,
             join=True)
    step, weights = torch.load(one)
    assert step == 2 and set(weights) == set(saved)
    for name, w in weights.items():  # two ranks' shards, one rank's whole tensors
        assert torch.equal(w, saved[name]), name


@pytest.mark.parametrize("mode", ["--fsdp", "--context-parallel"])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_torchrun_command_trains_and_logs(tmp_path, mode, compiled):
    """The command of the issue, eager and with --compile (blocks compiled
    one by one under FSDP2; the ring's communication between graphs)."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "-m", "cute_fa.profiling.train", "--config", "tiny", "--seq", "64",
               "--steps", "5", "--warmup", "1", "--log-every", "1", "--device", "cpu",
               mode, "--out", str(out), "--save-checkpoint", *(["--compile"] if compiled else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "cute.csv")))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    assert all(float(r["loss"]) > 0 for r in rows)
    assert (out / "cute.dcp").is_dir()


def test_parallel_options_need_torchrun():
    from cute_fa.profiling import train

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-m", "cute_fa.profiling.train", "--fsdp",
                           "--config", "tiny", "--device", "cpu"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode != 0 and "run under torchrun" in done.stderr
    with pytest.raises(SystemExit):
        train.parse_args(["--fsdp", "--backends", "cute,sdpa"])


def test_the_large_configs_have_their_shapes():
    """Llama-3-8B's shape and the ~1B model, counted on the meta device."""
    from cute_fa.model import LLAMA3_8B, ONE_B, count_parameters
    from cute_fa.profiling.train import CONFIGS

    assert CONFIGS["llama3_8b"] is LLAMA3_8B and CONFIGS["1b"] is ONE_B
    with torch.device("meta"):
        big, small = Transformer(LLAMA3_8B), Transformer(ONE_B)
    assert abs(count_parameters(big) - 6.98e9) < 0.01e9
    assert abs(count_parameters(small) - 1.008e9) < 0.001e9
