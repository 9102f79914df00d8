"""Context parallelism: one long sequence split over the ranks of a process
group, attention computed ring-style with the cute_fa ops.

    local = shard_sequence(x, group)                # each rank's part of (batch, seqlen, ...)
    out = ring_attention(q_local, k_local, v_local, group, causal=True)
    full = unshard_sequence(out, group)             # back to (batch, seqlen, ...)

Layout: the sequence is cut into 2·W chunks (W ranks) and rank r holds
chunks r and 2W−1−r, so under a causal mask every rank has the same amount
of work (the early chunk sees few keys, the late one many).

Forward: the K/V shards go round the ring, one hop per step, the next hop's
transfer in flight while the current block is computed. For each pair of a
local query chunk i and a visiting key chunk j the op cute_fa::fwd gives the
block's output and LSE (under a causal mask: j < i full, j = i causal,
j > i skipped); the blocks are merged exactly through the LSE in fp32,
O = Σ_j O_j·exp(LSE_j − LSE), LSE = log Σ_j exp(LSE_j).

Backward: each block's gradients come from cute_fa::bwd given the final
output and LSE of its query chunk (P = exp(S − LSE) and D = rowsum(dO∘O) are
then the full softmax's), dQ summed locally; K/V go round the ring again
with their dK/dV accumulators (fp32), which end back on their owner after
one more hop. Tensors are sent as raw 16-bit words, so any backend (NCCL,
gloo) carries them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .reference import resolve_scale


def _world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _chunk_ids(rank: int, world: int) -> tuple[int, int]:
    return rank, 2 * world - 1 - rank


def shard_sequence(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """This rank's part of a full sequence (dim: the sequence's), chunks r
    and 2W−1−r of 2W; the length must divide into 2W chunks."""
    rank, world = _world(group)
    if x.shape[dim] % (2 * world):
        raise ValueError(f"x: expected a sequence length divisible by 2 x world size = "
                         f"{2 * world}, got {x.shape[dim]}")
    chunks = x.chunk(2 * world, dim=dim)
    first, second = _chunk_ids(rank, world)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(local: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's part (an all-gather)."""
    rank, world = _world(group)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    chunks = [None] * (2 * world)
    for r, part in enumerate(parts):
        first, second = _chunk_ids(r, world)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


class _Ring:
    """Sends this rank's tensors to the next rank and receives the previous
    rank's, asynchronously."""

    def __init__(self, group):
        self.group = group
        rank, world = _world(group)
        self.to_next = dist.get_global_rank(group, (rank + 1) % world) if group else \
            (rank + 1) % world
        self.from_prev = dist.get_global_rank(group, (rank - 1) % world) if group else \
            (rank - 1) % world

    def start(self, tensors: list) -> tuple[list, list]:
        """(requests, received tensors); the received ones are valid after wait()."""
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = []
        for t, r in zip(tensors, received):
            ops.append(dist.P2POp(dist.isend, _bytes(t.contiguous()), self.to_next, self.group))
            ops.append(dist.P2POp(dist.irecv, _bytes(r), self.from_prev, self.group))
        return dist.batch_isend_irecv(ops), received


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes: uint8 is carried by every backend (gloo
    has no bfloat16, NCCL no int16)."""
    return t.view(torch.uint8)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _blocks(rank: int, world: int, source: int, causal: bool):
    """(local query chunk a, visiting key chunk b, the block's causal flag)
    for every pair in which the queries see some key: under a causal mask a
    later key chunk is skipped, the same chunk is causal, earlier ones full."""
    for a, i in enumerate(_chunk_ids(rank, world)):
        for b, j in enumerate(_chunk_ids(source, world)):
            if not causal or j < i:
                yield a, b, False
            elif j == i:
                yield a, b, True


def _merge(out, lse, block_out, block_lse):
    """Running (out fp32, LSE) merged with a block's, exactly."""
    if out is None:
        return block_out.float(), block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    # rows that no block has seen yet keep -inf: weigh them 0, not NaN
    keep = torch.exp(torch.where(torch.isinf(new_lse), 0, lse - new_lse))
    take = torch.exp(torch.where(torch.isinf(new_lse), 0, block_lse - new_lse))
    return (out * keep.transpose(1, 2)[..., None]
            + block_out.float() * take.transpose(1, 2)[..., None]), new_lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale):
        rank, world = _world(group)
        ring = _Ring(group)
        q_chunks = q.chunk(2, dim=1)
        outs, lses = [None, None], [None, None]
        kv = [k, v]
        for step in range(world):
            source = (rank - step) % world
            pending = ring.start(kv) if step < world - 1 else None
            k_chunks, v_chunks = kv[0].chunk(2, dim=1), kv[1].chunk(2, dim=1)
            for a, b, block_causal in _blocks(rank, world, source, causal):
                o, l = torch.ops.cute_fa.fwd(q_chunks[a], k_chunks[b], v_chunks[b], scale,
                                             block_causal)
                outs[a], lses[a] = _merge(outs[a], lses[a], o, l)
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        out = torch.cat([o.to(q.dtype) for o in outs], dim=1)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, *lses = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        rank, world = _world(group)
        ring = _Ring(group)
        q_chunks, out_chunks = q.chunk(2, dim=1), out.chunk(2, dim=1)
        grad_chunks = grad_out.contiguous().chunk(2, dim=1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dq_chunks = dq.chunk(2, dim=1)
        kv = [k, v]
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
               torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        for step in range(world):
            source = (rank - step) % world
            pending_kv = ring.start(kv) if step < world - 1 else None
            k_chunks, v_chunks = kv[0].chunk(2, dim=1), kv[1].chunk(2, dim=1)
            dk_chunks, dv_chunks = dkv[0].chunk(2, dim=1), dkv[1].chunk(2, dim=1)
            for a, b, block_causal in _blocks(rank, world, source, causal):
                dq_ij, dk_ij, dv_ij, _ = torch.ops.cute_fa.bwd(
                    grad_chunks[a].contiguous(), q_chunks[a], k_chunks[b], v_chunks[b],
                    out_chunks[a].contiguous(), lses[a].contiguous(), scale, block_causal)
                dq_chunks[a].add_(dq_ij.float())
                dk_chunks[b].add_(dk_ij.float())
                dv_chunks[b].add_(dv_ij.float())
            # the accumulators follow their K/V: one hop per step, the last
            # hop taking them home
            if world > 1:
                pending_dkv = ring.start(dkv)
                _wait(pending_dkv[0])
                dkv = pending_dkv[1]
            if pending_kv is not None:
                _wait(pending_kv[0])
                kv = pending_kv[1]
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None)


@torch.compiler.disable  # point-to-point communication: run eagerly between graphs
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                   causal: bool = False, softmax_scale: float | None = None) -> torch.Tensor:
    """Attention over a sequence sharded by shard_sequence across `group`
    (default: the whole world): q (batch, local_len, nheads, d), k, v
    (batch, local_len, nheads_kv, d) this rank's parts; returns this rank's
    part of the output. Differentiable (q, k, v). causal: over the full
    sequence's positions."""
    if q.shape[1] != k.shape[1] or q.shape[1] % 2:
        raise ValueError(f"q, k: expected the same even local length (two chunks), got "
                         f"{q.shape[1]} and {k.shape[1]}")
    return _RingAttention.apply(q, k, v, group, bool(causal), resolve_scale(q, softmax_scale))
