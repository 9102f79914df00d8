"""The KV-cache forward's host side (python_api/decode.py) on the CPU: the
split count from shapes, when query heads are packed per KV head, the
views that pack them (each kernel row is the query it claims to be, and no
view leaves its tensor), the per-row LSE views, the key lengths of packed
query tokens, and which page sizes the kernel reads in place."""

import pytest
import torch

from cute_fa import decode
from cute_fa.kernels.config import MAX_KV_SPLITS, decode_fwd_config


def test_splits_fill_the_sms_only_when_the_tiles_do_not():
    assert decode.choose_splits(tiles=128, n_blocks=256, sms=132) == 1
    assert decode.choose_splits(tiles=8, n_blocks=1, sms=132) == 1
    for tiles, n_blocks in ((8, 64), (1, 64), (1, 1024), (24, 3), (40, 100)):
        splits = decode.choose_splits(tiles, n_blocks, 132)
        assert 1 <= splits <= min(n_blocks, MAX_KV_SPLITS)
        units = tiles * splits
        # at least 85% of the best wave efficiency any split count reaches
        assert units / (-(-units // 132) * 132) >= 0.85 * max(
            tiles * s / (-(-(tiles * s) // 132) * 132)
            for s in range(1, min(n_blocks, MAX_KV_SPLITS, 132) + 1))
    assert decode.choose_splits(8, 64, 132) > 1  # batch 1 of Llama-3-8B's 8 KV heads


@pytest.mark.parametrize("seqlen_q,heads,heads_kv,packed", [
    (1, 32, 8, True), (1, 8, 8, True), (3, 32, 4, True), (4, 32, 8, False), (5, 32, 32, False)])
def test_query_heads_pack_while_tokens_are_fewer_than_the_group(seqlen_q, heads, heads_kv,
                                                                 packed):
    p = decode.plan(2, seqlen_q, heads, heads_kv, 4096, 128, 0, 132)
    assert p.gqa_packed == packed
    if packed:
        assert (p.sequences, p.rows, p.heads) == (2 * seqlen_q, heads // heads_kv, heads_kv)
    else:
        assert (p.sequences, p.rows, p.heads) == (2, seqlen_q, heads)


def test_forced_splits_are_kept_within_the_blocks_and_the_merge():
    assert decode.plan(1, 1, 32, 8, 4096, 128, 7, 132).num_splits == 7
    assert decode.plan(1, 1, 32, 8, 1000, 128, 64, 132).num_splits == 8  # 8 key blocks
    assert decode.plan(1, 1, 32, 8, 10 ** 6, 128, 500, 132).num_splits == MAX_KV_SPLITS


@pytest.mark.parametrize("batch,seqlen_q,heads,heads_kv", [(3, 1, 32, 8), (2, 3, 16, 2),
                                                            (2, 4, 8, 8), (1, 1, 8, 1)])
def test_row_views_address_the_queries_they_stand_for(batch, seqlen_q, heads, heads_kv):
    """Kernel row r of sequence i and kernel head hk is one query (b, s, h):
    packed, i = b·s_q + s starts at row i·h and h = hk·g + r; plain, row
    i·s_q + s with the heads as they are. A view past its tensor would
    raise in as_strided."""
    d = 8
    p = decode.plan(batch, seqlen_q, heads, heads_kv, 512, 128, 0, 132)
    q = torch.arange(batch * seqlen_q * heads * d, dtype=torch.float32).view(
        batch, seqlen_q, heads, d)
    rows = decode._rows_view(q.unsqueeze(0), p)[0]
    lse = torch.arange(batch * heads * seqlen_q, dtype=torch.float32).view(batch, heads, seqlen_q)
    lse_kernel, lse_bhs = decode._lse_buffer(1, batch, seqlen_q, heads, p, "cpu")
    lse_bhs[0].copy_(lse)
    g = heads // heads_kv
    for b in range(batch):
        for s in range(seqlen_q):
            for h in range(heads):
                if p.gqa_packed:
                    row, head = (b * seqlen_q + s) * heads + h % g, h // g
                else:
                    row, head = b * seqlen_q + s, h
                assert torch.equal(rows[row, head], q[b, s, h])
                assert lse_kernel[0, head, row] == lse[b, h, s]


def test_packed_tokens_see_the_cache_up_to_their_place():
    p = decode.plan(2, 3, 32, 4, 100, 128, 0, 132)
    c = decode._make_constants(p, 2, 3, 100, False, "cpu")
    lengths = torch.tensor([50, 1], dtype=torch.int32)
    _, used = decode._key_sequences(p, c, 3, 100, None, lengths, causal=True)
    assert used.flatten().tolist() == [48, 49, 50, 0, 0, 1]
    _, used = decode._key_sequences(p, c, 3, 100, None, lengths, causal=False)
    assert used.flatten().tolist() == [50, 50, 50, 1, 1, 1]
    cu_k, _ = decode._key_sequences(p, c, 3, 100, torch.tensor([4, 0], dtype=torch.int32),
                                    lengths, causal=True)
    assert cu_k.flatten().tolist()[:6] == [400, 400, 400, 0, 0, 0]
    assert c.cu_q.flatten().tolist() == [32 * i for i in range(7)]  # packed: i · h


@pytest.mark.parametrize("page_size,tile_n,load_rows", [
    (256, 128, 0), (128, 128, 0), (64, 128, 64), (16, 128, 16), (8, 128, 8), (48, 48, 0),
    (24, None, None), (100, None, None)])
def test_which_page_sizes_are_read_in_place(page_size, tile_n, load_rows):
    config = decode.paged_config(decode_fwd_config(128), page_size)
    if tile_n is None:
        assert config is None and not decode.reads_pages_in_place(page_size, 128, 128)
    else:
        assert (config.tile_n, config.kv_load_rows) == (tile_n, load_rows)
        config.validate(128)


def test_page_wise_loads_need_a_paged_kernel():
    from cute_fa.kernels.config import Features
    from cute_fa.kernels.fwd_sm90 import FlashAttentionForwardSm90

    config = decode_fwd_config(128).replace(kv_load_rows=16)
    with pytest.raises(ValueError, match="kv_load_rows"):
        FlashAttentionForwardSm90(None, 128, False, config, features=Features(varlen=True))
    with pytest.raises(ValueError, match="kv_load_rows"):
        config.replace(kv_load_rows=24).validate(128)
