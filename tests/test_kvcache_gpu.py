"""flash_attn_with_kvcache on the H100: each sequence's output against the
fp32 reference over its cache with the GPU tests' bound, contiguous and
paged caches, appends, GQA; and a decode step captured in a CUDA graph and
replayed with new tokens and lengths."""

import pytest
import torch

from bounds import assert_within_low_precision
from cute_fa import flash_attn_with_kvcache
from cute_fa.reference import attention_reference

pytestmark = pytest.mark.gpu


def _problem(seed, batch, seqlen_q, capacity, new, heads=32, heads_kv=8, d=128,
             page_size=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    q = randn(batch, seqlen_q, heads, d)
    page_table = None
    if page_size is None:
        k_cache, v_cache = randn(batch, capacity, heads_kv, d), randn(batch, capacity, heads_kv, d)
    else:
        pages = capacity // page_size
        k_cache = randn(batch * pages, page_size, heads_kv, d)
        v_cache = randn(batch * pages, page_size, heads_kv, d)
        page_table = torch.randperm(batch * pages, device="cuda", generator=gen).view(
            batch, pages).int()
    k, v = (randn(batch, new, heads_kv, d), randn(batch, new, heads_kv, d)) if new else (None,
                                                                                         None)
    return q, k_cache, v_cache, k, v, page_table


def _logical(cache, page_table, row):
    return cache[row] if page_table is None else cache[page_table[row].long()].flatten(0, 1)


@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("seqlen_q,new", [(1, 1), (4, 4), (1, 0)])
def test_kvcache_matches_the_reference(page_size, seqlen_q, new):
    capacity = 1024
    q, k_cache, v_cache, k, v, page_table = _problem(seqlen_q + new, 4, seqlen_q, capacity, new,
                                                     page_size=page_size)
    lengths = torch.tensor([0, 300, 777, capacity - new], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                  page_table=page_table, causal=True)
    for b in range(4):
        n = int(lengths[b]) + new
        keys, values = _logical(k_cache, page_table, b), _logical(v_cache, page_table, b)
        if new:
            assert torch.equal(keys[n - new:n], k[b])
        ref, _ = attention_reference(q[b:b + 1], keys[None, :n], values[None, :n], None, True)
        low, _ = attention_reference(q[b:b + 1], keys[None, :n], values[None, :n], None, True,
                                     compute_dtype=None)
        assert_within_low_precision([(f"out[{b}]", out[b:b + 1], ref, low)])


def test_a_decode_step_replays_in_a_cuda_graph():
    q, k_cache, v_cache, k, v, _ = _problem(1, 8, 1, 2048, 1)
    lengths = torch.full((8,), 100, dtype=torch.int32, device="cuda")
    step = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v,  # noqa: E731
                                           cache_seqlens=lengths, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for token in range(3):  # new inputs and lengths, copied into the captured tensors
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        lengths.add_(1)
        graph.replay()
        expected = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v,
                                           cache_seqlens=lengths, causal=True)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
