"""Context parallelism on the CPU: ring attention over 2 and 3 processes
(gloo) against the single-process op on the whole sequence, forward and
every gradient, causal and not, GQA; the sharding round trip."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cute_fa import flash_attn_func
from cute_fa.context_parallel import ring_attention, shard_sequence, unshard_sequence



def _all_done():
    """Every rank has finished before any tears its gloo connections down (a
    rank that left early aborted another's exit, as
    profiling.distributed.finish says)."""
    dist.barrier()

def _problem(seqlen, causal):
    gen = torch.Generator().manual_seed(seqlen + causal)
    q = torch.randn(2, seqlen, 4, 16, generator=gen).bfloat16()
    k = torch.randn(2, seqlen, 2, 16, generator=gen).bfloat16()
    v = torch.randn(2, seqlen, 2, 16, generator=gen).bfloat16()
    grad = torch.randn(2, seqlen, 4, 16, generator=gen).bfloat16()
    return q, k, v, grad


def _rank_main(rank, world, init_file, seqlen, causal, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        q, k, v, grad = _problem(seqlen, causal)
        assert torch.equal(unshard_sequence(shard_sequence(q)), q)
        leaves = [shard_sequence(t).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, causal=causal)
        out.backward(shard_sequence(grad))
        full = [unshard_sequence(t) for t in (out.detach(), *(t.grad for t in leaves))]
        if rank == 0:
            torch.save(full, results)
        _all_done()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_matches_one_process(tmp_path, world, causal):
    seqlen = 12 * world
    results = str(tmp_path / "results.pt")
    mp.spawn(_rank_main, args=(world, str(tmp_path / "init"), seqlen, causal, results),
             nprocs=world, join=True)
    out, dq, dk, dv = torch.load(results)
    q, k, v, grad = _problem(seqlen, causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = flash_attn_func(*leaves, causal=causal)
    expected.backward(grad)
    for name, got, want in (("out", out, expected.detach()), ("dq", dq, leaves[0].grad),
                            ("dk", dk, leaves[1].grad), ("dv", dv, leaves[2].grad)):
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2,
                                   msg=lambda m: f"{name}: {m}")


def test_sequences_that_do_not_split_are_refused(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match="divisible by 2 x world size = 2"):
            shard_sequence(torch.zeros(1, 5, 2, 8))
        x = torch.randn(1, 8, 2, 16).bfloat16()
        out = ring_attention(x, x[:, :, :1], x[:, :, :1], causal=True)
        # one rank still computes its two chunks apart and merges them in fp32
        torch.testing.assert_close(out, flash_attn_func(x, x[:, :, :1], x[:, :, :1],
                                                        causal=True), atol=2e-2, rtol=2e-2)
        _all_done()
    finally:
        dist.destroy_process_group()


def test_the_ring_sends_bytes_every_backend_carries(monkeypatch):
    """What the ring hands to point-to-point transfers is uint8 (NCCL has no
    int16, gloo no bfloat16: a 16-bit view failed on NCCL), the received
    tensors have the sender's dtype and shape."""
    from cute_fa import context_parallel

    sent = []
    monkeypatch.setattr(context_parallel, "_world", lambda group: (0, 2))
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group: sent.append(tensor))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [])
    tensors = [torch.randn(2, 3, 4).to(dtype) for dtype in
               (torch.bfloat16, torch.float16, torch.float32)]
    tensors.append(tensors[0].transpose(1, 2))  # not contiguous
    _, received = context_parallel._Ring(group=object()).start(tensors)
    assert [t.dtype for t in sent] == [torch.uint8] * 2 * len(tensors)
    assert all(t.is_contiguous() for t in sent)
    assert [(r.dtype, r.shape) for r in received] == [(t.dtype, t.shape) for t in tensors]
