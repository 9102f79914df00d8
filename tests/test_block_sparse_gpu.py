"""Block-sparse attention on the H100: FlexAttention BlockMasks through
flash_attn_func, forward and every gradient against the fp32 reference on the
dense mask of the same mask_mod, with the bound the dense tests use (2x
PyTorch's own low-precision error on the same inputs)."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from cute_fa import BlockSparseMask, flash_attn_func
from cute_fa.reference import attention_reference

from bounds import assert_lse_matches, assert_within_low_precision
from shapes import cuda_qkv_grad

pytestmark = pytest.mark.gpu


def _inputs(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, seed, dtype=torch.bfloat16):
    return cuda_qkv_grad(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype, seed)


def _masks(seqlen_q, seqlen_k):
    """mask_mods of the patterns models use, aligned bottom-right where causal."""
    shift = seqlen_k - seqlen_q
    gen = torch.Generator().manual_seed(seqlen_q + seqlen_k)
    doc_q = torch.randint(0, 5, (seqlen_q,), generator=gen).sort().values.cuda()
    doc_k = torch.randint(0, 5, (seqlen_k,), generator=gen).sort().values.cuda()
    blocks = (torch.rand((-(-seqlen_q // 128), -(-seqlen_k // 128)), generator=gen) < 0.3).cuda()

    def causal(b, h, q, k):
        return q + shift >= k

    def sliding(b, h, q, k):
        return (q + shift >= k) & (q + shift - k < 300)

    def document(b, h, q, k):
        return (doc_q[q] == doc_k[k]) & (q + shift >= k)

    def random_blocks(b, h, q, k):
        return blocks[q // 128, k // 128]

    def per_head(b, h, q, k):
        return ((q + shift - k) % (h + 2) != 1) | (b == 1)

    return {"causal": causal, "sliding": sliding, "document": document,
            "random_blocks": random_blocks, "per_head": per_head}


def _grads(fn, q, k, v, g, sink):
    """(out, lse, [dq, dk, dv (, dsink)]) of fn(q, k, v, sink) -> (out, lse)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sink is None else sink.detach().clone().requires_grad_()
    out, lse = fn(*leaves, sink_leaf)
    (out.float() * g.float()).sum().backward()
    grads = [t.grad for t in leaves] + ([sink_leaf.grad] if sink is not None else [])
    return out.detach(), lse.detach(), grads


def _run(q, k, v, g, mask, softcap=0.0, sink=None):
    return _grads(lambda q, k, v, s: flash_attn_func(q, k, v, block_mask=mask, softcap=softcap,
                                                     learnable_sink=s, return_lse=True),
                  q, k, v, g, sink)


def _reference(q, k, v, g, visible, compute_dtype, softcap=0.0, sink=None):
    return _grads(lambda q, k, v, s: attention_reference(q, k, v, compute_dtype=compute_dtype,
                                                         softcap=softcap, sink=s,
                                                         visible=visible),
                  q, k, v, g, sink)


def _check(q, k, v, g, mask_mod, batch_m, heads_m, softcap=0.0, sink=None, convert=False):
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    block_mask = create_block_mask(mask_mod, batch_m, heads_m, seqlen_q, seqlen_k, device="cuda")
    visible = create_mask(mask_mod, batch_m or 1, heads_m or 1, seqlen_q, seqlen_k,
                          device="cuda")
    mask = BlockSparseMask.from_block_mask(block_mask) if convert else block_mask
    out, lse, grads = _run(q, k, v, g, mask, softcap, sink)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, g, visible, torch.float32, softcap, sink)
    low_out, _, low_grads = _reference(q, k, v, g, visible, None, softcap, sink)
    names = ("dq", "dk", "dv", "dsink")
    assert_lse_matches(lse, ref_lse)
    assert_within_low_precision([("out", out, ref_out, low_out)] + list(
        zip(names, grads, ref_grads, low_grads)))


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("name", ["causal", "sliding", "document", "random_blocks"])
@pytest.mark.parametrize("seqlens", [(1000, 1000), (777, 1300), (1300, 777)])
def test_block_mask_forward_backward(head_dim, name, seqlens):
    q, k, v, g = _inputs(2, *seqlens, 4, 2, head_dim, seed=head_dim + seqlens[0])
    _check(q, k, v, g, _masks(*seqlens)[name], None, None)


@pytest.mark.parametrize("head_dim", [192, 256])
@pytest.mark.parametrize("name", ["causal", "document"])
def test_large_head_dims(head_dim, name):
    q, k, v, g = _inputs(1, 1000, 1000, 4, 2, head_dim, seed=head_dim)
    _check(q, k, v, g, _masks(1000, 1000)[name], None, None, convert=True)


@pytest.mark.parametrize("head_dim", [64, 128])  # 64: a cap's exponentials partly polynomials
def test_mask_per_batch_and_head_with_softcap_and_sink(head_dim):
    q, k, v, g = _inputs(2, 900, 900, 4, 4, head_dim, seed=3)
    q = q * 2
    sink = torch.randn(4, device="cuda")
    _check(q, k, v, g, _masks(900, 900)["per_head"], 2, 4, softcap=20.0, sink=sink)


def test_rows_that_see_nothing():
    """Query tiles with no block and rows inside partial blocks with no key:
    output 0, LSE -inf, zero gradients, no NaN."""
    q, k, v, g = _inputs(1, 600, 600, 2, 2, 128, seed=9)

    def late_keys(b, h, q_idx, k_idx):
        return (q_idx >= 300) & (k_idx >= q_idx - 50) & (k_idx < q_idx)

    _check(q, k, v, g, late_keys, None, None)


def test_fp16_and_block_size_64():
    q, k, v, g = _inputs(1, 1024, 1024, 4, 4, 64, seed=4, dtype=torch.float16)
    mask_mod = _masks(1024, 1024)["sliding"]
    block_mask = create_block_mask(mask_mod, None, None, 1024, 1024, device="cuda",
                                   BLOCK_SIZE=64)
    visible = create_mask(mask_mod, 1, 1, 1024, 1024, device="cuda")
    out, lse, grads = _run(q, k, v, g, block_mask)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, g, visible, torch.float32)
    low_out, _, low_grads = _reference(q, k, v, g, visible, None)
    assert_lse_matches(lse, ref_lse)
    assert_within_low_precision([("out", out, ref_out, low_out)] + list(
        zip(("dq", "dk", "dv"), grads, ref_grads, low_grads)))


def test_gqa_groups_walked_by_one_cta():
    """Enough key tiles that the backward keeps one CTA per (key tile, KV
    head) and walks each query head of the group with its own list."""
    from cute_fa.kernels.config import Features
    from cute_fa.kernels.bwd_config import bwd_config_for_problem

    batch, seqlen, heads, heads_kv = 3, 4096, 8, 4
    config = bwd_config_for_problem(64, False, False, batch, seqlen, heads, heads_kv,
                                    torch.cuda.get_device_properties(0).multi_processor_count,
                                    Features(block_sparse=True))
    assert not config.split_gqa
    q, k, v, g = _inputs(batch, seqlen, seqlen, heads, heads_kv, 64, seed=11)
    _check(q, k, v, g, _masks(seqlen, seqlen)["per_head"], batch, heads)


@pytest.mark.parametrize("seqlens", [(0, 300), (300, 0)])
def test_empty_sequences(seqlens):
    q, k, v, _ = _inputs(2, *seqlens, 2, 2, 128, seed=1)
    mask = BlockSparseMask.from_dense(torch.ones(1, 1, *seqlens, dtype=torch.bool,
                                                 device="cuda"))
    out, lse = flash_attn_func(q, k, v, block_mask=mask, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_corrupted_lists_stay_inside_the_tensors():
    """The ops do not read the lists' values on the host: garbage lists give
    wrong values, never an access outside the tensors (the kernels clamp)."""
    from cute_fa.block_sparse_ops import lists_for

    q, k, v, g = _inputs(2, 700, 900, 4, 2, 128, seed=21)
    mask = BlockSparseMask.from_block_mask(create_block_mask(
        _masks(700, 900)["document"], None, None, 700, 900, device="cuda"))
    fwd_lists, bwd_lists = (t.clone() for t in lists_for(mask, q, v))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in (fwd_lists, bwd_lists):
        t.copy_(torch.randint(-3000, 3000, t.shape, generator=gen, device="cuda",
                              dtype=torch.int32))
    out, lse = torch.ops.cute_fa.block_sparse_fwd(q, k, v, fwd_lists, bwd_lists)
    grads = torch.ops.cute_fa.block_sparse_bwd(g, q, k, v, out, lse, fwd_lists, bwd_lists,
                                               128 ** -0.5)
    torch.cuda.synchronize()
    assert out.shape == q.shape and grads[0].shape == q.shape
