"""flash_attn_with_kvcache on the CPU (the reference path, through the same
host code as the GPU's): outputs against each sequence's attention over its
cache, the in-place append, contiguous and paged caches, cache_batch_idx,
GQA, seqlen_q 1 and more, lengths 0 and full; opcheck (with the mutation),
torch.compile, and the errors of bad inputs."""

import pytest
import torch

from cute_fa import flash_attn_with_kvcache
from cute_fa.kvcache import append_to_cache
from cute_fa.reference import attention_reference

HEADS, HEADS_KV, D = 8, 2, 16


def _randn(gen, *shape):
    return torch.randn(shape, generator=gen).bfloat16()


def _problem(seed, batch=3, seqlen_q=1, capacity=40, new=0, page_size=None):
    gen = torch.Generator().manual_seed(seed)
    q = _randn(gen, batch, seqlen_q, HEADS, D)
    if page_size is None:
        k_cache, v_cache = (_randn(gen, batch, capacity, HEADS_KV, D) for _ in range(2))
        page_table = None
    else:
        pages = capacity // page_size
        k_cache, v_cache = (_randn(gen, batch * pages + 3, page_size, HEADS_KV, D)
                            for _ in range(2))
        order = torch.randperm(batch * pages + 3, generator=gen)[:batch * pages]
        page_table = order.view(batch, pages).int()
    k, v = ((_randn(gen, batch, new, HEADS_KV, D) for _ in range(2)) if new else (None, None))
    return q, k_cache, v_cache, k, v, page_table


def _logical(cache, page_table, row):
    """Sequence `row`'s cache in order (contiguous: the row itself)."""
    if page_table is None:
        return cache[row]
    return cache[page_table[row].long()].flatten(0, 1)


@pytest.mark.parametrize("page_size", [None, 4, 8])
@pytest.mark.parametrize("seqlen_q,new", [(1, 0), (1, 1), (4, 4), (3, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_each_sequence_on_its_cache(page_size, seqlen_q, new, causal):
    q, k_cache, v_cache, k, v, page_table = _problem(seqlen_q + 7 * new, seqlen_q=seqlen_q,
                                                     new=new, page_size=page_size)
    capacity = 40
    cache_seqlens = torch.tensor([0, 17, capacity - new], dtype=torch.int32)
    before_k = k_cache.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                       page_table=page_table, causal=causal,
                                       return_softmax_lse=True)
    for b in range(3):
        n = int(cache_seqlens[b]) + new
        keys = _logical(k_cache, page_table, b)
        if new:  # appended in place at the sequence's end
            assert torch.equal(keys[n - new:n], k[b])
            assert torch.equal(_logical(v_cache, page_table, b)[n - new:n], v[b])
        ref_out, ref_lse = attention_reference(q[b:b + 1], keys[None, :n],
                                               _logical(v_cache, page_table, b)[None, :n],
                                               None, causal)
        torch.testing.assert_close(out[b:b + 1], ref_out, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[b:b + 1], ref_lse, atol=1e-3, rtol=1e-3)
    untouched = torch.ones(k_cache.shape[:2], dtype=torch.bool)
    for b in range(3):  # nothing else of the caches changed
        start = int(cache_seqlens[b])
        for pos in range(start, start + new):
            page = b if page_table is None else int(page_table[b, pos // k_cache.shape[1]])
            untouched[page, pos % k_cache.shape[1]] = False
    assert torch.equal(k_cache[untouched], before_k[untouched])


def test_cache_batch_idx_and_int_lengths():
    q, k_cache, v_cache, k, v, _ = _problem(5, batch=2, new=2)
    k_cache = torch.cat([k_cache, k_cache.flip(0)])  # 4 rows; sequences use rows 3 and 1
    v_cache = torch.cat([v_cache, v_cache.flip(0)])
    idx = torch.tensor([3, 1], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=10,
                                  cache_batch_idx=idx, causal=True)
    for b, row in enumerate((3, 1)):
        assert torch.equal(k_cache[row, 10:12], k[b])
        ref, _ = attention_reference(q[b:b + 1], k_cache[row:row + 1, :12],
                                     v_cache[row:row + 1, :12], None, True)
        torch.testing.assert_close(out[b:b + 1], ref, atol=2e-2, rtol=2e-2)


def test_full_caches_without_lengths():
    q, k_cache, v_cache, _, _, _ = _problem(6, seqlen_q=2)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, causal=True)
    ref, _ = attention_reference(q, k_cache, v_cache, None, True)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page_size", [None, 8])
@pytest.mark.parametrize("lengths", [[39, 0, 40], [-3, 38, -1]])
def test_appends_outside_the_cache_are_not_written(page_size, lengths):
    """The GPU path does not read cache_seqlens on the host: a position past
    a cache's end or below 0 is dropped, every other slot unchanged, and
    the lengths after the new tokens come back."""
    _, k_cache, v_cache, k, v, page_table = _problem(7, new=3, page_size=page_size)
    before = k_cache.clone()
    starts = torch.tensor(lengths, dtype=torch.int32)
    after = append_to_cache(k_cache, v_cache, k, v, starts, page_table, None)
    assert torch.equal(after, starts + 3)
    for b, start in enumerate(lengths):
        expected = _logical(before, page_table, b).clone()
        for t in range(3):
            if 0 <= start + t < expected.shape[0]:
                expected[start + t] = k[b, t]
        assert torch.equal(_logical(k_cache, page_table, b), expected)


def test_opcheck_declares_the_mutation():
    q, k_cache, v_cache, k, v, page_table = _problem(8, seqlen_q=2, new=2, page_size=8)
    lengths = torch.tensor([3, 0, 20], dtype=torch.int32)
    torch.library.opcheck(torch.ops.cute_fa.fwd_kvcache.default,
                          (q, k_cache, v_cache, k, v, lengths, page_table, None, None, True, 0))


def test_compiled_decode_step():
    q, k_cache, v_cache, k, v, _ = _problem(9, new=1)
    lengths = torch.tensor([5, 6, 7], dtype=torch.int32)
    expected_cache = k_cache.clone()
    expected = flash_attn_with_kvcache(q, expected_cache, v_cache.clone(), k, v,
                                       cache_seqlens=lengths, causal=True)
    step = torch.compile(flash_attn_with_kvcache, fullgraph=True, backend="aot_eager")
    out = step(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True)
    assert torch.equal(out, expected) and torch.equal(k_cache, expected_cache)


@pytest.mark.parametrize("change,message", [
    (dict(cache_seqlens=torch.tensor([1, 2, 3])), "cache_seqlens: expected an int32 tensor"),
    (dict(cache_seqlens=torch.tensor([1, 2, 40], dtype=torch.int32)),
     r"cache_seqlens: expected each in \[0, 39\]"),
    (dict(page_table=torch.tensor([[0] * 5, [1] * 5, [99] * 5], dtype=torch.int32)),
     r"page_table: expected entries in \[0, 18\)"),
    (dict(k=None), "k, v: expected both or neither"),
    (dict(cache_batch_idx=torch.zeros(3, dtype=torch.int32)),
     "cache_batch_idx: expected None with a page_table"),
    (dict(q=torch.zeros(3, 1, 7, D, dtype=torch.bfloat16)), "nheads_kv to divide nheads = 7"),
    (dict(q=torch.zeros(3, 1, HEADS, D)), "q: expected dtype bfloat16, float16 or float8"),
    (dict(q=torch.zeros(3, 1, HEADS, D, dtype=torch.float8_e4m3fn)),
     "k_cache: expected dtype bfloat16, float16 or float8_e4m3fn, that of q"),
    (dict(q_descale=torch.ones(3, HEADS_KV)), "q_descale: expected None for torch.bfloat16"),
    (dict(num_splits=-1), "num_splits: expected an int >= 0"),
    (dict(num_splits=1.5), "num_splits: expected an int >= 0"),
    (dict(cache_seqlens=[1, 2, 3]), "cache_seqlens: expected an int32 tensor .*got list"),
    (dict(q_descale=0.5), "q_descale: expected a torch.Tensor or None, got float"),
    (dict(softmax_scale=float("nan")), "softmax_scale: expected a finite positive float"),
    (dict(softmax_scale=-1.0), "softmax_scale: expected a finite positive float"),
    (dict(softmax_scale="0.1"), "softmax_scale: expected a float or None, got str"),
])
def test_bad_inputs_are_clear_errors(change, message):
    q, k_cache, v_cache, k, v, page_table = _problem(10, new=1, page_size=8)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32), page_table=page_table)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=message):
        flash_attn_with_kvcache(**args)


def test_non_contiguous_pages_are_refused():
    q, k_cache, v_cache, _, _, page_table = _problem(11, page_size=8)
    strided = k_cache.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="expected contiguous pages"):
        flash_attn_with_kvcache(q, strided, v_cache, page_table=page_table)


E4M3 = torch.float8_e4m3fn


def _fp8_problem(seed, batch, seqlen_q, capacity, heads, heads_kv, d, new=0, page_size=None):
    """e4m3 q, caches and new k, v with their descales (fp8.quantize_fp8)."""
    from cute_fa.fp8 import quantize_fp8

    gen = torch.Generator().manual_seed(seed)
    q8, q_descale = quantize_fp8(torch.randn(batch, seqlen_q, heads, d, generator=gen),
                                 heads_kv)
    k8, k_descale = quantize_fp8(torch.randn(batch, capacity, heads_kv, d, generator=gen))
    v8, v_descale = quantize_fp8(torch.randn(batch, capacity, heads_kv, d, generator=gen))
    k_new = v_new = None
    if new:
        k_new, v_new = (torch.randn(batch, new, heads_kv, d, generator=gen).to(E4M3)
                        for _ in range(2))
    page_table = None
    if page_size:  # the same tokens as pages, in a shuffled page order
        pages = capacity // page_size
        order = torch.randperm(batch * pages, generator=gen)
        page_table = order.view(batch, pages).int()
        paged = [torch.empty(batch * pages, page_size, heads_kv, d, dtype=E4M3) for _ in (k8, v8)]
        for cache, dense in zip(paged, (k8, v8)):
            cache.view(torch.uint8)[order] = dense.view(torch.uint8).reshape(
                batch * pages, page_size, heads_kv, d)
        k8, v8 = paged
    return q8, k8, v8, k_new, v_new, page_table, (q_descale, k_descale, v_descale)


@pytest.mark.parametrize("page_size,new,seqlen_q", [(None, 0, 1), (None, 2, 3), (8, 1, 4)])
def test_e4m3_caches_match_the_dequantized_attention(page_size, new, seqlen_q):
    """e4m3 q and caches with descales (batch, nheads_kv): a bf16 out equal to
    the attention of the dequantized values, LSE too; new e4m3 k, v land in
    the cache as bytes."""
    from cute_fa.fp8 import dequantize_fp8

    batch, capacity, d = 2, 32, 64
    q8, k8, v8, k_new, v_new, table, (qs, ks, vs) = _fp8_problem(
        12, batch, seqlen_q, capacity, HEADS, HEADS_KV, d, new, page_size)
    lengths = torch.tensor([5, capacity - new], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q8, k8, v8, k_new, v_new, cache_seqlens=lengths,
                                       page_table=table, causal=True, return_softmax_lse=True,
                                       q_descale=qs, k_descale=ks, v_descale=vs)
    assert out.dtype == torch.bfloat16 and out.shape == (batch, seqlen_q, HEADS, d)
    for b in range(batch):
        n = int(lengths[b]) + new
        keys, values = _logical(k8, table, b), _logical(v8, table, b)
        if new:
            assert torch.equal(keys[n - new:n].view(torch.uint8), k_new[b].view(torch.uint8))
        ref, ref_lse = attention_reference(
            dequantize_fp8(q8[b:b + 1], qs[b:b + 1]), dequantize_fp8(keys[None, :n], ks[b:b + 1]),
            dequantize_fp8(values[None, :n], vs[b:b + 1]), None, True)
        torch.testing.assert_close(out[b:b + 1].float(), ref.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse[b:b + 1], ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("change,message", [
    (dict(k_descale=torch.ones(2, HEADS)), r"k_descale: expected None or an fp32 tensor of "
                                           r"shape \(2, 2\)"),
    (dict(v_descale=torch.ones(2, HEADS_KV, dtype=torch.float64)), "v_descale: expected"),
    (dict(q=torch.zeros(2, 1, HEADS, 80, dtype=E4M3)), "expected \\(\\*, \\*, nheads_kv, 80\\)"),
])
def test_e4m3_bad_inputs_are_clear_errors(change, message):
    q8, k8, v8, _, _, _, (qs, ks, vs) = _fp8_problem(13, 2, 1, 16, HEADS, HEADS_KV, 64)
    args = dict(q=q8, k_cache=k8, v_cache=v8, q_descale=qs, k_descale=ks, v_descale=vs)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=message):
        flash_attn_with_kvcache(**args)


def test_e4m3_head_dims_are_those_of_the_fp8_forward():
    from cute_fa.kernels.config import FP8_HEAD_DIMS

    q8, k8, v8, _, _, _, _ = _fp8_problem(14, 1, 1, 16, HEADS, HEADS_KV, 32)
    assert 32 not in FP8_HEAD_DIMS
    with pytest.raises(ValueError, match="expected headdim one of"):
        flash_attn_with_kvcache(q8, k8, v8)


def test_e4m3_opcheck_and_fake_out_dtype():
    q8, k8, v8, k_new, v_new, table, (qs, ks, vs) = _fp8_problem(15, 2, 2, 16, HEADS, HEADS_KV,
                                                                  64, new=1, page_size=8)
    lengths = torch.tensor([3, 0], dtype=torch.int32)
    # test_schema (the mutation declaration, checked with 16-bit caches above)
    # perturbs the inputs with arithmetic torch has no e4m3 kernel for
    torch.library.opcheck(torch.ops.cute_fa.fwd_kvcache.default,
                          (q8, k8, v8, k_new, v_new, lengths, table, None, None, True, 0, qs, ks,
                           vs),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    with torch._subclasses.FakeTensorMode() as mode:
        fq, fk, fv, ftable = (mode.from_tensor(t) for t in (q8, k8, v8, table))
        out, lse = torch.ops.cute_fa.fwd_kvcache(fq, fk, fv, page_table=ftable)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize("head_dim,head_dim_v,message", [
    (60, 60, "q: expected headdim a multiple of 8 up to 256"),
    (264, 264, "q: expected headdim a multiple of 8 up to 256"),
    (0, 0, "q: expected headdim a multiple of 8"),
    (64, 36, "v_cache: expected headdim a multiple of 8 no larger than that of q"),
])
def test_head_dims_the_kernels_cannot_take_are_named(head_dim, head_dim_v, message):
    q = torch.zeros(2, 1, 4, head_dim, dtype=torch.bfloat16)
    k_cache = torch.zeros(2, 16, 2, head_dim, dtype=torch.bfloat16)
    v_cache = torch.zeros(2, 16, 2, head_dim_v, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3)
