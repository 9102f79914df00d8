"""profiling.train on several processes (torchrun): FSDP2, context
parallelism, distributed checkpoints.

    torchrun --nproc-per-node 8 -m cute_fa.profiling.train --fsdp --backend cute ...
    torchrun --nproc-per-node 4 -m cute_fa.profiling.train --context-parallel --seq 32768 ...

--fsdp: data parallel with the parameters, gradients and optimizer state
sharded by PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard, each block
and then the root), bf16 parameters in compute and fp32 gradient reduction
(MixedPrecisionPolicy), each rank on its own batches (the data seed plus
its rank). --context-parallel: the same, with every rank on the same batches
and each holding its part of every sequence (context_parallel.py: ring
attention with the cute_fa ops); FSDP then averages the ranks' gradients,
each the gradient of the mean loss over its tokens, into that of the whole
sequence. --activation-checkpointing recomputes each block's activations
in the backward (torch.utils.checkpoint); --activation-checkpointing N
only every N-th block's (selective: the blocks left alone keep their
activations, trading memory for the recompute's third of a forward).

NCCL on CUDA devices (cuda:LOCAL_RANK), gloo on the CPU. Losses are
averaged over the ranks when logged; tokens/s and TFLOP/s are per GPU
(each rank's own tokens). Checkpoints are torch.distributed.checkpoint
folders holding the model's and the optimizer's state as full-model keys
(get_state_dict), so they load at another world size and under another
attention backend.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from cute_fa.context_parallel import shard_sequence


@dataclass
class DistributedRun:
    rank: int
    world: int
    device: torch.device
    context_parallel: bool

    @property
    def data_rank(self) -> int:
        """Whose batches this rank trains on: its own (data parallel), or
        rank 0's (context parallel: every rank holds a part of them)."""
        return 0 if self.context_parallel else self.rank

    def local_batch(self, x, y):
        if not self.context_parallel:
            return x, y
        return shard_sequence(x, dist.group.WORLD), shard_sequence(y, dist.group.WORLD)

    def mean(self, value: torch.Tensor) -> float:
        """A scalar averaged over the ranks (synchronizes)."""
        total = value.detach().float().clone()
        dist.all_reduce(total)
        return total.item() / self.world


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start(device_kind: str, context_parallel: bool) -> DistributedRun:
    """Join the torchrun job: the process group (NCCL on CUDA, gloo on the
    CPU) and this rank's device."""
    if not launched_by_torchrun():
        raise SystemExit("--fsdp / --context-parallel: run under torchrun (RANK and WORLD_SIZE "
                         "unset), e.g. torchrun --nproc-per-node 2 -m cute_fa.profiling.train "
                         "--fsdp ...")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return DistributedRun(rank, world, device, context_parallel)


def finish() -> None:
    """Leave the job: every rank reaches the barrier before any tears its
    connections down (a rank that left early made gloo abort another's
    exit: "terminate called without an active exception"). The model's
    reference cycles (FSDP's modules, their finished collectives) are
    collected first, while the interpreter is whole: tensors that gloo's
    threads still held at its finalization aborted a rank the same way."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def prepare(model: torch.nn.Module, run: DistributedRun, recompute_every: int = 0,
            compile_blocks: bool = False):
    """The model as the run trains it: context parallel where asked, each
    block (its activations recomputed in the backward for blocks 0,
    recompute_every, 2·recompute_every, ...; none for 0; compiled where
    asked) and the root sharded by FSDP2. Blocks are compiled one by one
    before sharding (FSDP2's hooks stay outside the compiled code; a whole
    sharded model does not compile as one graph); under context parallelism
    the ring's communication is left out of the graphs."""
    if run.context_parallel:
        model.set_context_parallel(dist.group.WORLD)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for index, block in enumerate(model.layers):
        if recompute_every and index % recompute_every == 0:
            block.forward = _recomputed(block.forward)
        if compile_blocks:
            block = torch.compile(block, fullgraph=not run.context_parallel)
            model.layers.register_module(str(index), block)
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _recomputed(forward):
    def run(*args):
        return checkpoint(forward, *args, use_reentrant=False)
    return run


def full_value(t) -> float:
    """A DTensor's (e.g. the clipped gradient norm) or a tensor's value."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def save(path: str, model, optimizer, step: int) -> None:
    """Model and optimizer state (full-model keys) and the step, into the
    checkpoint folder `path`."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state,
              "step": torch.tensor(step)}, checkpoint_id=path)


def load(path: str, model, optimizer) -> int:
    """Load a save()d checkpoint into the (sharded) model and optimizer; the
    step it was saved at."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    return int(state["step"])
