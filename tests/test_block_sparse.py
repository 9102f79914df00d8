"""Block-sparse masks on the CPU: FlexAttention BlockMasks converted to the
kernels' blocks and tile lists exactly (against FlexAttention's own dense
mask), the ops' CPU path, fake impl, opcheck and torch.compile, and the
errors of every argument that does not fit."""

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

import cute_fa
from cute_fa import BlockSparseMask, flash_attn_func
from cute_fa.block_mask import EMPTY, FULL, PARTIAL, lists_dense
from cute_fa.block_sparse_ops import lists_for
from cute_fa.reference import attention_reference

# the tiles the kernels pack lists for (kernels.bwd_config.block_sparse_tiles)
TILES = [(128, 128, False), (64, 128, False), (128, 64, False), (128, 64, True), (128, 128, True),
         (64, 64, True)]


def _doc_mask(seqlen, seed=0):
    doc = torch.randint(0, 5, (seqlen,), generator=torch.Generator().manual_seed(seed)).sort()
    doc = doc.values

    def document(b, h, q, k):
        return (doc[q] == doc[k]) & (q >= k)
    return document


def _masks():
    def causal(b, h, q, k):
        return q >= k

    def sliding(b, h, q, k):
        return (q >= k) & (q - k < 200)

    def per_head(b, h, q, k):
        return ((q - k) % (h + 2) != 1) | (b == 1)

    def nothing_early(b, h, q, k):  # rows < 300 see no key
        return (q >= 300) & (k < q)

    return dict(causal=causal, sliding=sliding, per_head=per_head,
                nothing_early=nothing_early, document=_doc_mask(1000))


@pytest.mark.parametrize("name", ["causal", "sliding", "per_head", "nothing_early", "document"])
@pytest.mark.parametrize("seqlens", [(1000, 1000), (300, 777), (777, 300)])
@pytest.mark.parametrize("block_size", [128, 64, 256, (64, 256)])
def test_conversion_matches_flex_attention_dense_mask(name, seqlens, block_size):
    batch, heads = (2, 3) if name == "per_head" else (None, None)
    mod = _masks()[name]
    block_mask = create_block_mask(mod, batch, heads, *seqlens, device="cpu",
                                   BLOCK_SIZE=block_size)
    mask = BlockSparseMask.from_block_mask(block_mask)
    dense = create_mask(mod, batch or 1, heads or 1, *seqlens, device="cpu")
    assert torch.equal(mask.dense(), dense)
    for rows, cols, transposed in TILES:
        lists = mask.tile_lists(rows, cols, transposed)
        assert torch.equal(lists_dense(lists, rows, cols, transposed, *seqlens), dense)


def test_full_blocks_need_no_mask_mod_and_refined_blocks_leave_the_lists():
    """A BlockMask of blocks alone (noop mask_mod): every listed block full,
    the ragged key edge partial, unlisted ones absent from the lists."""
    seqlen = 1000
    kv_num = torch.tensor([[[1, 2, 0, 3, 1, 1, 1, 2]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 0, 0, 0, 0, 0, 0, 0], [1, 7, 0, 0, 0, 0, 0, 0],
                             [0] * 8, [2, 3, 4, 0, 0, 0, 0, 0], [4] + [0] * 7,
                             [5] + [0] * 7, [6] + [0] * 7, [7, 0] + [0] * 6]]],
                          dtype=torch.int32)
    block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, seq_lengths=(seqlen, seqlen))
    mask = BlockSparseMask.from_block_mask(block_mask)
    expected = torch.zeros(8, 8, dtype=torch.int8)
    for row in range(8):
        for j in kv_idx[0, 0, row, :kv_num[0, 0, row]].tolist():
            expected[row, j] = FULL
    expected[:, 7][expected[:, 7] == FULL] = PARTIAL  # keys past 1000 in block 7
    assert torch.equal(mask.state[0, 0], expected)
    lists = mask.tile_lists(128, 128, False).view(8, -1)
    assert lists[2, 0] == 0 and lists[2, 1] == 0  # query tile 2 visits nothing
    assert lists[1, :4].tolist()[:2] == [1, 1]  # block 7 partial first, then block 1
    assert lists[1, 4:6].tolist() == [7, 1]


def test_lists_drop_tiles_past_the_sequences():
    mod = _masks()["causal"]
    mask = BlockSparseMask.from_block_mask(create_block_mask(mod, None, None, 300, 300,
                                                             device="cpu"))
    for rows, cols, transposed in TILES:
        lists = mask.tile_lists(rows, cols, transposed)
        outer, inner = -(-300 // rows), -(-300 // cols)
        assert lists.shape[1] == outer
        counts = lists[0, :, 0] + lists[0, :, 1]
        for o in range(outer):
            indices = lists[0, o, 4:4 + counts[o]]
            assert (indices < inner).all()


def test_density_and_state_codes():
    mask = BlockSparseMask.from_dense(torch.ones(1, 1, 256, 384, dtype=torch.bool).tril())
    assert mask.state.shape == (1, 1, 2, 3)
    assert mask.state[0, 0].tolist() == [[PARTIAL, EMPTY, EMPTY], [FULL, PARTIAL, EMPTY]]
    assert mask.density() == pytest.approx(3 / 6)


@pytest.mark.parametrize("head_dim", [64, 128, 200])
def test_op_cpu_matches_reference_with_gradients(head_dim):
    torch.manual_seed(head_dim)
    q, k, v = (torch.randn(2, 500, 4, head_dim, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    sink = torch.randn(4, requires_grad=True)
    mod = _masks()["sliding"]
    block_mask = create_block_mask(mod, None, None, 500, 500, device="cpu")
    visible = create_mask(mod, 1, 1, 500, 500, device="cpu")
    out = flash_attn_func(q, k, v, block_mask=block_mask, softcap=10.0, learnable_sink=sink)
    out.float().square().sum().backward()
    grads = [t.grad for t in (q, k, v, sink)]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sink)]
    ref, _ = attention_reference(*leaves[:3], softcap=10.0, sink=leaves[3], visible=visible)
    ref.float().square().sum().backward()
    assert torch.allclose(out.float(), ref.float(), atol=1e-2)
    for got, want in zip(grads, (t.grad for t in leaves)):
        assert torch.allclose(got.float(), want.float(), atol=5e-2, rtol=1e-2)


def _op_args(seqlen=300, head_dim=64, heads=2):
    q, k, v = (torch.randn(1, seqlen, heads, head_dim, dtype=torch.bfloat16) for _ in range(3))
    mask = BlockSparseMask.from_block_mask(create_block_mask(
        _masks()["causal"], None, None, seqlen, seqlen, device="cpu"))
    return q, k, v, *lists_for(mask, q, v)


def test_opcheck_and_compile():
    q, k, v, fwd_lists, bwd_lists = _op_args()
    torch.library.opcheck(torch.ops.cute_fa.block_sparse_fwd, (q, k, v, fwd_lists, bwd_lists))
    out, lse = torch.ops.cute_fa.block_sparse_fwd(q, k, v, fwd_lists, bwd_lists)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(torch.ops.cute_fa.block_sparse_bwd,
                          (grad_out, q, k, v, out, lse, fwd_lists, bwd_lists, 0.125))
    compiled = torch.compile(lambda *a: torch.ops.cute_fa.block_sparse_fwd(*a)[0],
                             fullgraph=True)
    assert torch.equal(compiled(q, k, v, fwd_lists, bwd_lists), out)


def test_bad_calls_name_the_argument():
    q, k, v, fwd_lists, bwd_lists = _op_args()
    block_mask = create_block_mask(_masks()["causal"], None, None, 300, 300, device="cpu")
    with pytest.raises(ValueError, match="causal, window_size"):
        flash_attn_func(q, k, v, causal=True, block_mask=block_mask)
    with pytest.raises(ValueError, match="causal, window_size"):
        flash_attn_func(q, k, v, window_size=(10, 0), block_mask=block_mask)
    with pytest.raises(ValueError, match="deterministic"):
        flash_attn_func(q, k, v, deterministic=True, block_mask=block_mask)
    with pytest.raises(TypeError, match="block_mask: expected a FlexAttention BlockMask"):
        flash_attn_func(q, k, v, block_mask=torch.ones(300, 300, dtype=torch.bool))
    other = create_block_mask(_masks()["causal"], None, None, 300, 400, device="cpu")
    with pytest.raises(ValueError, match="block_mask: expected a mask for batch 1"):
        flash_attn_func(q, k, v, block_mask=other)
    with pytest.raises(TypeError, match="block_mask: expected a FlexAttention BlockMask "
                                        r"\(create_block_mask's\), got object"):
        BlockSparseMask.from_block_mask(object())
    with pytest.raises(ValueError, match="block_mask: expected a Q block size"):
        BlockSparseMask.from_block_mask(create_block_mask(
            _masks()["causal"], None, None, 300, 300, device="cpu", BLOCK_SIZE=(96, 128)))
    with pytest.raises(ValueError, match="fwd_lists: expected the int32 tile lists"):
        torch.ops.cute_fa.block_sparse_fwd(q, k, v, fwd_lists.long(), bwd_lists)
    with pytest.raises(ValueError, match="bwd_lists: expected the int32 tile lists"):
        torch.ops.cute_fa.block_sparse_fwd(q, k, v, fwd_lists, fwd_lists[:, :1])
    with pytest.raises(ValueError, match="visible: expected a boolean tensor"):
        BlockSparseMask.from_dense(torch.ones(300, 300))


def test_public_names():
    assert "BlockSparseMask" in cute_fa.__all__


@pytest.mark.parametrize("seqlens", [(0, 100), (100, 0), (0, 0)])
def test_empty_sequences(seqlens):
    """No query or no key: output 0 and LSE -inf (as the dense op), gradients 0."""
    seqlen_q, seqlen_k = seqlens
    q = torch.randn(1, seqlen_q, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, seqlen_k, 2, 64, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    mask = BlockSparseMask.from_dense(torch.ones(1, 1, seqlen_q, seqlen_k, dtype=torch.bool))
    out, lse = flash_attn_func(q, k, v, block_mask=mask, return_lse=True)
    assert out.shape == (1, seqlen_q, 2, 64) and lse.shape == (1, 2, seqlen_q)
    assert (out == 0).all() and (lse == float("-inf")).all()
    out.float().sum().backward()
    assert all((t.grad == 0).all() for t in (q, k, v))


def test_flash_attn_func_with_a_converted_mask_under_compile():
    q, k, v = (torch.randn(1, 300, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    mask = BlockSparseMask.from_block_mask(create_block_mask(
        _masks()["sliding"], None, None, 300, 300, device="cpu"))
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, block_mask=mask),
                             fullgraph=True)
    assert torch.equal(compiled(q, k, v), flash_attn_func(q, k, v, block_mask=mask))
