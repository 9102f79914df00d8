"""flash_attn_with_kvcache on the H100: each sequence's output against the
fp32 reference over its cache with the GPU tests' bound, contiguous and
paged caches, appends, GQA ratios and query tokens, cache_batch_idx; split
key ranges against one; and a decode step captured in a CUDA graph and
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


def _check_against_reference(q, k_cache, v_cache, k, page_table, lengths, new, causal, out,
                             lse, cache_batch_idx=None):
    for b in range(q.shape[0]):
        n = int(lengths[b]) + new
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        keys, values = _logical(k_cache, page_table, row), _logical(v_cache, page_table, row)
        if new:
            assert torch.equal(keys[n - new:n], k[b])
        ref, ref_lse = attention_reference(q[b:b + 1], keys[None, :n], values[None, :n], None,
                                           causal)
        low, _ = attention_reference(q[b:b + 1], keys[None, :n], values[None, :n], None, causal,
                                     compute_dtype=None)
        assert_within_low_precision([(f"out[{b}]", out[b:b + 1], ref, low)])
        torch.testing.assert_close(lse[b:b + 1], ref_lse, atol=1e-2, rtol=0)


@pytest.mark.parametrize("page_size", [None, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("seqlen_q,new", [(1, 1), (4, 4), (1, 0)])
def test_kvcache_matches_the_reference(page_size, seqlen_q, new):
    capacity = 1024
    q, k_cache, v_cache, k, v, page_table = _problem(seqlen_q + new, 4, seqlen_q, capacity, new,
                                                     page_size=page_size)
    lengths = torch.tensor([0, 300, 777, capacity - new], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                       page_table=page_table, causal=True,
                                       return_softmax_lse=True)
    _check_against_reference(q, k_cache, v_cache, k, page_table, lengths, new, True, out, lse)


# GQA ratios 1, 4, 8, 6 and 64; 1 and several query tokens (each KV head's
# rows packed, decode.py: read in place where the group divides the 64-row
# tile, copied for 6; a group of 64 fills a tile a token); causal and not;
# head dims 64 and 128.
@pytest.mark.parametrize("heads,heads_kv", [(32, 32), (32, 8), (32, 4), (24, 4), (64, 1)])
@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (3, True), (6, True), (5, False)])
@pytest.mark.parametrize("d", [64, 128])
def test_gqa_packing_and_query_tokens(heads, heads_kv, seqlen_q, causal, d):
    capacity = 2048
    q, k_cache, v_cache, _, _, _ = _problem(heads_kv + seqlen_q + d, 3, seqlen_q, capacity, 0,
                                            heads=heads, heads_kv=heads_kv, d=d)
    lengths = torch.tensor([5, capacity, 1000], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=causal,
                                       return_softmax_lse=True)
    _check_against_reference(q, k_cache, v_cache, None, None, lengths, 0, causal, out, lse)


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("seqlen_q,splits", [(1, 0), (1, 5), (3, 0), (3, 4)])
def test_paged_packed_and_split(page_size, seqlen_q, splits):
    """Pages read in place with GQA packing (g = 8, so 3 query tokens are 3
    packed sequences sharing a page table row) and split key ranges."""
    capacity = 4096
    q, k_cache, v_cache, _, _, page_table = _problem(page_size + seqlen_q, 2, seqlen_q,
                                                     capacity, 0, heads_kv=4,
                                                     page_size=page_size)
    lengths = torch.tensor([capacity, 1500], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                       page_table=page_table, causal=True,
                                       num_splits=splits, return_softmax_lse=True)
    _check_against_reference(q, k_cache, v_cache, None, page_table, lengths, 0, True, out, lse)


@pytest.mark.parametrize("page_size", [48, 24, 8])  # a 48-key step; 24: gathered; 8: loads
def test_pages_of_other_sizes(page_size):
    capacity = 40 * page_size
    q, k_cache, v_cache, k, v, page_table = _problem(page_size, 3, 1, capacity, 1,
                                                     page_size=page_size)
    lengths = torch.tensor([0, capacity // 2, capacity - 1], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                       page_table=page_table, causal=True,
                                       return_softmax_lse=True)
    _check_against_reference(q, k_cache, v_cache, k, page_table, lengths, 1, True, out, lse)


def test_cache_batch_idx_reads_the_named_rows():
    q, k_cache, v_cache, _, _, _ = _problem(7, 3, 1, 512, 0)
    k_cache, v_cache = torch.cat([k_cache, k_cache.flip(0)]), torch.cat([v_cache, v_cache])
    rows = torch.tensor([5, 0, 3], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([512, 17, 300], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                       cache_batch_idx=rows, return_softmax_lse=True)
    _check_against_reference(q, k_cache, v_cache, None, None, lengths, 0, False, out, lse, rows)


@pytest.mark.parametrize("batch,heads_kv,seqlen_q", [(1, 8, 1), (2, 1, 1), (1, 8, 4), (3, 32, 2)])
def test_split_keys_agree_with_one_range(batch, heads_kv, seqlen_q):
    """Forced split counts (and the automatic one) against num_splits=1: the
    same result up to the fp32 merge's rounding; lengths 0, short and full."""
    capacity = 8192
    q, k_cache, v_cache, _, _, _ = _problem(batch + heads_kv, batch, seqlen_q, capacity, 0,
                                            heads_kv=heads_kv)
    lengths = torch.tensor([capacity, 0, 200][:batch], dtype=torch.int32, device="cuda")
    whole, whole_lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                               causal=True, num_splits=1,
                                               return_softmax_lse=True)
    assert torch.isfinite(whole).all()
    for splits in (0, 2, 3, 7, 16, 64, 128):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                           causal=True, num_splits=splits,
                                           return_softmax_lse=True)
        torch.testing.assert_close(out, whole, atol=4e-3, rtol=1.6e-2,
                                   msg=lambda m: f"num_splits={splits}: {m}")
        torch.testing.assert_close(lse, whole_lse, atol=1e-4, rtol=1e-5,
                                   msg=lambda m: f"num_splits={splits}: {m}")


# contiguous rows of whole K/V blocks are read as pages (cut by the kernel);
# of 1000 tokens as one token axis (cut by the host)
@pytest.mark.parametrize("page_size,capacity", [(None, 1024), (None, 1000), (16, 1024),
                                                (256, 1024)])
def test_lengths_beyond_the_cache_are_cut_at_its_end(page_size, capacity):
    """Lengths are not read on the host: one past the cache is the full
    cache, a negative one none (the op's documented cut)."""
    q, k_cache, v_cache, _, _, page_table = _problem(11, 3, 1, capacity, 0,
                                                     page_size=page_size)
    wild = torch.tensor([capacity + 300, -5, 700], dtype=torch.int32, device="cuda")
    cut = wild.clamp(0, capacity)
    got = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=wild, page_table=page_table,
                                  return_softmax_lse=True)
    want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cut, page_table=page_table,
                                   return_softmax_lse=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("e4m3", [False, True])
@pytest.mark.parametrize("splits", [0, 4])
def test_a_decode_step_replays_in_a_cuda_graph(splits, e4m3):
    """New tokens, lengths and (e4m3) descales copied into the captured
    tensors between replays reach the replayed kernels: nothing of them is
    baked into the capture."""
    q, k_cache, v_cache, k, v, _ = _problem(1, 8, 1, 2048, 1)
    lengths = torch.full((8,), 100, dtype=torch.int32, device="cuda")
    descales = {}
    if e4m3:
        q, k_cache, v_cache, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k_cache, v_cache, k,
                                                                         v))
        descales = {f"{x}_descale": torch.ones(8, 8, device="cuda") for x in "qkv"}
    step = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v,  # noqa: E731
                                           cache_seqlens=lengths, causal=True,
                                           num_splits=splits, **descales)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for token in range(3):  # new inputs and lengths, copied into the captured tensors
        q.copy_(torch.randn(q.shape, device="cuda").to(q.dtype))
        k.copy_(torch.randn(k.shape, device="cuda").to(k.dtype))
        for d in descales.values():
            d.copy_(torch.rand_like(d) + 0.5)
        lengths.add_(1)
        graph.replay()
        expected = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v,
                                           cache_seqlens=lengths, causal=True,
                                           num_splits=splits, **descales)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("page_size,rows", [(None, None), (None, [2, 0, 1]), (16, None),
                                            (256, None)])
@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128), (64, 64)])
def test_one_launch_append_writes_what_the_index_writes_do(monkeypatch, page_size, rows, d,
                                                           dv):
    """The append kernel (cute_kernels/cache_append.py) against the fixed-shape
    index writes it replaces, on k, v sliced from one fused projection (row
    strides not their own): the same caches bit for bit, positions past the
    end or below 0 left alone, and the lengths after the new tokens."""
    from cute_fa import kvcache

    batch, capacity, new, heads_kv = 3, 512, 5, 4
    gen = torch.Generator(device="cuda").manual_seed(3)
    if page_size is None:
        k_cache = torch.randn(batch, capacity, heads_kv, d, device="cuda", generator=gen)
        v_cache = torch.randn(batch, capacity, heads_kv, dv, device="cuda", generator=gen)
        table = None
    else:
        pages = batch * capacity // page_size
        k_cache = torch.randn(pages, page_size, heads_kv, d, device="cuda", generator=gen)
        v_cache = torch.randn(pages, page_size, heads_kv, dv, device="cuda", generator=gen)
        table = torch.randperm(pages, device="cuda", generator=gen).view(batch, -1).int()
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    fused = torch.randn(batch, new, heads_kv, d + dv, device="cuda", generator=gen).bfloat16()
    k, v = fused[..., :d], fused[..., d:]
    cache_rows = None if rows is None else torch.tensor(rows, dtype=torch.int32, device="cuda")
    lengths = torch.tensor([capacity - 2, -3, 100], dtype=torch.int32, device="cuda")
    assert kvcache._appends_in_one_launch(k_cache, v_cache, k, v)

    caches = (k_cache.clone(), v_cache.clone())
    got = kvcache.append_to_cache(*caches, k, v, lengths, table, cache_rows)
    # the index writes, as for tensors the kernel does not take
    monkeypatch.setattr(kvcache, "_appends_in_one_launch", lambda *tensors: False)
    want_caches = (k_cache.clone(), v_cache.clone())
    want = kvcache.append_to_cache(*want_caches, k, v, lengths, table, cache_rows)
    assert torch.equal(got, lengths + new) and torch.equal(want, lengths + new)
    for a, b in zip(caches, want_caches):
        assert torch.equal(a, b)
    assert not torch.equal(caches[0], k_cache)  # something was written


def _rmse(a, b):
    return (a.float() - b.float()).pow(2).mean().sqrt().item()


# e4m3 caches: contiguous (read as pages of a cache row, and not), paged in
# place (16, 256) and gathered (24), one token and several (in place: g 4 and
# 8; copied: g 6), appended tokens, split and not; head dims 64 and 128.
@pytest.mark.parametrize("page_size,capacity", [(None, 1024), (None, 1000), (16, 1024),
                                                (256, 1024), (24, 984)])
@pytest.mark.parametrize("seqlen_q,new,heads,heads_kv,splits", [
    (1, 0, 32, 8, 0), (1, 1, 32, 8, 1), (4, 4, 32, 8, 0), (3, 0, 32, 4, 3), (2, 0, 24, 4, 0)])
@pytest.mark.parametrize("d", [64, 128])
def test_e4m3_cache_within_the_emulations_error(page_size, capacity, seqlen_q, new, heads,
                                                heads_kv, splits, d):
    """Against the exact attention of the dequantized values, within 1.5x of
    the error of the FP8 forward's emulation (P rounded to e4m3: the bound
    of tests/test_fp8_gpu.py), over all sequences; LSE to the FP8 WGMMA's
    accumulation; out bf16."""
    from cute_fa.fp8 import dequantize_fp8, fp8_attention_emulation, quantize_fp8

    batch = 3
    gen = torch.Generator(device="cuda").manual_seed((page_size or 0) + seqlen_q + d)

    def randn(*shape):
        return torch.randn(shape, device="cuda", generator=gen)

    q8, qs = quantize_fp8(randn(batch, seqlen_q, heads, d), heads_kv)
    k8, ks = quantize_fp8(randn(batch, capacity, heads_kv, d))
    v8, vs = quantize_fp8(randn(batch, capacity, heads_kv, d))
    k_new = v_new = page_table = None
    if new:
        k_new, v_new = (randn(batch, new, heads_kv, d).to(torch.float8_e4m3fn) for _ in "kv")
    k_cache, v_cache = k8, v8
    if page_size:
        pages = capacity // page_size
        order = torch.randperm(batch * pages, device="cuda", generator=gen)
        page_table = order.view(batch, pages).int()
        k_cache, v_cache = (torch.empty(batch * pages, page_size, heads_kv, d, device="cuda",
                                        dtype=torch.float8_e4m3fn) for _ in "kv")
        for cache, dense in ((k_cache, k8), (v_cache, v8)):
            cache.view(torch.uint8)[order] = dense.view(torch.uint8).reshape(
                batch * pages, page_size, heads_kv, d)
    lengths = torch.tensor([300, capacity - new, 555], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q8, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                       page_table=page_table, causal=True, num_splits=splits,
                                       return_softmax_lse=True, q_descale=qs, k_descale=ks,
                                       v_descale=vs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    outs, emulated, exact, lses, exact_lses = [], [], [], [], []
    for b in range(batch):
        n = int(lengths[b]) + new
        keys, values = (_logical(c, page_table, b)[None, :n] for c in (k_cache, v_cache))
        if new:
            assert torch.equal(keys[0, n - new:].view(torch.uint8), k_new[b].view(torch.uint8))
        sel = slice(b, b + 1)
        emu, _ = fp8_attention_emulation(q8[sel], keys, values, qs[sel], ks[sel], vs[sel],
                                         causal=True)
        ref, ref_lse = attention_reference(dequantize_fp8(q8[sel], qs[sel]),
                                           dequantize_fp8(keys, ks[sel]),
                                           dequantize_fp8(values, vs[sel]), None, True)
        outs.append(out[sel]), emulated.append(emu), exact.append(ref)
        lses.append(lse[sel]), exact_lses.append(ref_lse)
    ours, bound = _rmse(torch.cat(outs), torch.cat(exact)), _rmse(torch.cat(emulated),
                                                                 torch.cat(exact))
    assert ours <= 1.5 * bound + 1e-6, f"RMSE {ours:.3e} > 1.5 x the emulation's {bound:.3e}"
    torch.testing.assert_close(torch.cat(lses), torch.cat(exact_lses), atol=2e-2, rtol=2e-3)
