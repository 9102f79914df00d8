"""The KV-cache forward's host side (python_api/decode.py) on the CPU: the
split count from shapes, the packing of query heads per KV head (each
kernel row is the query it claims to be, no view leaves its tensor, O and
LSE come back in the caller's order), the sequences' rows and keys, and
which page sizes the kernel reads in place."""

import pytest
import torch

from cute_fa import decode
from cute_fa.kernels.config import MAX_KV_SPLITS, decode_fwd_config


def test_splits_fill_the_sms_in_powers_of_two():
    # measured on the H200 (docs/findings.md, "Decode"): a sequence of a few
    # query rows fills all the SMs; one of many rows (past
    # SHORT_CACHE_SPLIT_MAX_ROWS) fills half of them with parts shorter than
    # FULL_GRID_PART_KEYS; no split takes fewer than MIN_SPLIT_SAVED_KEYS
    # keys off a tile
    def splits(tiles, n_blocks, sms=132, block_keys=128, **kw):
        return decode.choose_splits(tiles, n_blocks, block_keys, sms, **kw)

    assert splits(tiles=128, n_blocks=256) == 1
    assert splits(tiles=8, n_blocks=1) == 1
    assert splits(tiles=8, n_blocks=64) == 16  # Llama-3-8B, batch 1, 8k
    assert splits(tiles=8, n_blocks=256) == 16  # 32k
    assert splits(tiles=16, n_blocks=256) == 8  # one KV head, batch 16
    assert splits(tiles=64, n_blocks=64) == 2
    assert splits(tiles=1, n_blocks=1024) == 64  # one KV head: a tile's merge of 64 parts
    assert splits(tiles=1, n_blocks=1024, sms=1024) == MAX_KV_SPLITS
    # a 1k cache at batch 4: 4 parts save 768 keys; at batch 8 the full
    # grid's 2 parts would save 512, and it runs unsplit
    assert splits(tiles=32, n_blocks=8) == 4
    assert splits(tiles=64, n_blocks=8) == 1
    assert splits(tiles=1, n_blocks=6) == 1
    assert splits(tiles=8, n_blocks=16, block_keys=64) == 16  # 64-key blocks: 1k, batch 1
    assert splits(tiles=64, n_blocks=16, block_keys=64) == 1
    # many rows (4 tokens of 32 heads a KV head: 128): parts of 512 keys fill
    # the SMs, shorter ones half of them, which at a 1k cache saves too few
    assert splits(tiles=8, n_blocks=64, rows=128) == 16
    assert splits(tiles=8, n_blocks=32, rows=128) == 8
    assert splits(tiles=32, n_blocks=8, rows=32) == 4
    assert splits(tiles=32, n_blocks=8, rows=128) == 1
    for block_keys in (64, 128):
        for rows in (1, 128):
            for tiles in range(1, 200):
                for n_blocks in (1, 3, 7, 8, 12, 16, 64, 100, 256, 1024):
                    parts = splits(tiles, n_blocks, block_keys=block_keys, rows=rows)
                    assert parts & (parts - 1) == 0
                    assert 1 <= parts <= min(n_blocks, MAX_KV_SPLITS)
                    assert parts == 1 or (tiles * parts <= 132 and parts <= 66)
                    saved = (n_blocks - -(-n_blocks // parts)) * block_keys
                    if parts > 1:
                        assert saved >= decode.MIN_SPLIT_SAVED_KEYS
                        short = n_blocks // parts * block_keys < decode.FULL_GRID_PART_KEYS
                        many_rows = rows > decode.SHORT_CACHE_SPLIT_MAX_ROWS
                        share = 66 if many_rows and short else 132
                        assert tiles * parts <= share
                        # the next power of two would pass that share or the blocks
                        doubled = 2 * parts
                        assert (tiles * doubled > share or doubled > 66 or doubled > n_blocks
                                or (many_rows and n_blocks // doubled * block_keys
                                    < decode.FULL_GRID_PART_KEYS))


@pytest.mark.parametrize("batch,seqlen_q,heads,heads_kv,capacity,tile_n,parts", [
    (1, 1, 32, 8, 1024, 64, 16), (1, 1, 8, 1, 1024, 64, 16), (4, 1, 32, 8, 1024, 64, 4),
    (1, 1, 32, 8, 4096, 64, 16), (1, 1, 8, 1, 8192, 64, 64), (4, 1, 32, 1, 8192, 64, 32),
    (1, 1, 32, 8, 8192, 128, 16), (2, 1, 32, 8, 4096, 128, 8), (1, 1, 8, 1, 32768, 128, 64),
    (4, 4, 32, 1, 8192, 128, 16), (16, 4, 32, 1, 1024, 128, 1), (64, 1, 8, 1, 1024, 128, 1),
    (16, 1, 32, 8, 8192, 128, 1), (1, 1, 32, 8, 100, 64, 1)])
def test_short_parts_take_64_key_steps(batch, seqlen_q, heads, heads_kv, capacity, tile_n,
                                       parts):
    """16-bit caches whose parts (planned over 128-key blocks) hold at most
    SHORT_PART_KEYS keys run 64-key steps, planned again over those blocks;
    longer parts, and e4m3 caches, keep 128 (docs/findings.md, "Decode")."""
    config, p = decode.config_and_plan(batch, seqlen_q, heads, heads_kv, capacity, 128, 128,
                                       None, 0, 132)
    assert (config.tile_n, p.num_splits) == (tile_n, parts)
    assert config == decode.kernel_config(128, 128, None, short_parts=tile_n == 64)
    e4m3, _ = decode.config_and_plan(batch, seqlen_q, heads, heads_kv, capacity, 128, 128,
                                     None, 0, 132, True)
    assert e4m3.tile_n == 128
    # head dims above 128 take 64 keys a step either way
    config, _ = decode.config_and_plan(batch, seqlen_q, heads, heads_kv, capacity, 256, 256,
                                       None, 0, 132)
    assert config.tile_n == 64


def test_e4m3_caches_split_over_all_the_sms():
    """An e4m3 part streams half the bytes of a 16-bit one in about the same
    time, so e4m3 caches split up to every SM (E4M3_SPLIT_TARGET_SM_SHARE)
    whatever their rows, where a 16-bit sequence of many query rows fills
    half of them with short parts: measured on the H100 and the H200,
    docs/findings.md, "Decode"."""
    for batch, seqlen_q, heads, heads_kv, capacity, parts_16, parts_e4m3 in [
            (1, 1, 32, 8, 8192, 16, 16), (4, 1, 8, 1, 8192, 32, 32), (4, 1, 32, 8, 1024, 4, 4),
            (16, 1, 8, 1, 32768, 8, 8), (16, 1, 32, 8, 8192, 1, 1), (1, 1, 8, 1, 8192, 64, 64),
            (1, 1, 8, 1, 32768, 64, 64),  # a tile's merge of 128 parts costs more than it saves
            (16, 4, 32, 1, 1024, 1, 4), (8, 4, 32, 1, 1024, 4, 8)]:
        args = (batch, seqlen_q, heads, heads_kv, capacity, 128, 128, None, 0, 132)
        assert decode.config_and_plan(*args)[1].num_splits == parts_16
        e4m3 = decode.config_and_plan(*args, True)[1]
        assert e4m3.num_splits == parts_e4m3 and e4m3.ctas <= 132


@pytest.mark.parametrize("seqlen_q,heads,heads_kv", [
    (1, 32, 8), (1, 8, 8), (3, 32, 4), (4, 32, 8), (5, 32, 32), (2, 24, 4), (2, 128, 1)])
def test_every_kv_head_is_one_sequence_of_all_its_query_rows(seqlen_q, heads, heads_kv):
    """Keys and values are read once per (batch row, KV head): its s_q · g
    query rows are one sequence of the kernel, in place for one token."""
    p = decode.plan(2, seqlen_q, heads, heads_kv, 4096, 128, 0, 132)
    g = heads // heads_kv
    assert (p.sequences, p.rows, p.heads, p.group) == (2, seqlen_q * g, heads_kv, g)
    expected = (decode.Rows.VIEW if seqlen_q == 1 else
                decode.Rows.IN_KERNEL if g in (2, 4, 8, 16, 32, 64) else decode.Rows.COPY)
    assert p.layout is expected


def test_forced_splits_are_kept_within_the_blocks_and_the_merge():
    assert decode.plan(1, 1, 32, 8, 4096, 128, 7, 132).num_splits == 7
    assert decode.plan(1, 1, 32, 8, 1000, 128, 64, 132).num_splits == 8  # 8 key blocks
    assert decode.plan(1, 1, 32, 8, 10 ** 6, 128, 500, 132).num_splits == MAX_KV_SPLITS


@pytest.mark.parametrize("batch,seqlen_q,heads,heads_kv", [(3, 1, 32, 8), (2, 4, 8, 8),
                                                            (1, 1, 8, 1), (2, 5, 12, 4)])
def test_row_views_address_the_queries_they_stand_for(batch, seqlen_q, heads, heads_kv):
    """Kernel row r of sequence b and kernel head k is query head h = k·g + r
    % g of token s = r // g: one token, the view's sequence b starts at row
    b·h; several (copied), the packed copy's at b·s_q·g. The LSE the kernel
    leaves per row comes back as (b, h, s_q) and O as (b, s_q, h, x). A view
    past its tensor would raise in as_strided."""
    d = 8
    p = decode.plan(batch, seqlen_q, heads, heads_kv, 512, 128, 0, 132)
    assert p.layout is not decode.Rows.IN_KERNEL
    viewed = p.layout is decode.Rows.VIEW
    g = heads // heads_kv
    q = torch.arange(batch * seqlen_q * heads * d, dtype=torch.float32).view(
        batch, seqlen_q, heads, d)
    packed = q if viewed else decode._pack_tokens(q, p)
    rows = decode._rows_view(packed.unsqueeze(0), p)[0]
    lse_kernel, lse_combine = decode._lse_buffer(1, batch, p, "cpu")
    sequence_start = heads if viewed else seqlen_q * g
    expected_lse = torch.empty(batch, heads, seqlen_q)
    for b in range(batch):
        for s in range(seqlen_q):
            for h in range(heads):
                row, head = b * sequence_start + s * g + h % g, h // g
                assert torch.equal(rows[row, head], q[b, s, h])
                lse_kernel[0, head, row] = expected_lse[b, h, s] = float(row * 1000 + head)
    lse = lse_combine[0]
    if not viewed:
        out, lse = decode._unpack_tokens(packed, lse, seqlen_q, p)
        assert torch.equal(out, q)
    assert torch.equal(lse.reshape(batch, heads, seqlen_q), expected_lse)


@pytest.mark.parametrize("splits", [1, 3])
def test_several_tokens_of_whole_groups_are_read_in_place(splits):
    """g dividing the 64-row tile: the kernel takes q and O as the caller's
    tensors, token-major (1, b · s_q, h, d) views of them, and LSE (or each
    part's) as (b, h, s_q): nothing is copied before or after it; the split
    merge reads and writes the caller's order."""
    batch, seqlen_q, heads, heads_kv, d = 2, 3, 16, 2, 8
    p = decode.plan(batch, seqlen_q, heads, heads_kv, 512, 128, splits, 132)
    assert p.layout is decode.Rows.IN_KERNEL and p.num_splits == splits
    q = torch.randn(batch, seqlen_q, heads, d)
    b = decode._buffers(q, p, seqlen_q, d, q.dtype)
    assert b.q.shape == (1, batch * seqlen_q, heads, d) and b.q.data_ptr() == q.data_ptr()
    assert torch.equal(b.q[0, 1 * seqlen_q + 2], q[1, 2])  # token t of sequence b: b · s_q + t
    assert b.out.shape == (batch, seqlen_q, heads, d) and b.lse.shape == (batch, heads, seqlen_q)
    assert b.out_kernel.data_ptr() == b.out.data_ptr() and b.out_kernel.shape == b.q.shape
    assert decode.kernel_features(splits > 1, False, heads // heads_kv).heads_in_rows
    if splits == 1:
        assert b.lse_kernel is b.lse and b.o_parts is None
    else:
        assert b.o_parts.shape == (splits, batch, seqlen_q, heads, d)
        assert b.o_parts_kernel.shape == (splits, batch * seqlen_q, heads, d)
        assert b.o_parts_kernel.data_ptr() == b.o_parts.data_ptr()
        assert b.lse_parts.shape == (splits, batch, heads, seqlen_q)
        assert b.lse_kernel.shape == (splits * batch, heads, seqlen_q)
        assert b.lse_kernel.data_ptr() == b.lse_parts.data_ptr()
    assert not decode.kernel_features(False, False, 6).heads_in_rows  # copied: 6 ∤ 64


def test_sequences_start_at_their_rows_and_cache_rows():
    p = decode.plan(2, 3, 32, 4, 100, 128, 0, 132)
    c = decode._make_constants(p, 100, False, "cpu")
    assert c.cu_q.flatten().tolist() == [0, 24, 48]  # s_q · g rows each
    assert c.used_q.flatten().tolist() == [24, 24]
    lengths = torch.tensor([50, 1], dtype=torch.int32)
    cu_k, used = decode._key_sequences(c, 100, None, lengths)
    assert (cu_k.flatten().tolist(), used.flatten().tolist()) == ([0, 100, 200], [50, 1])
    cu_k, used = decode._key_sequences(c, 100, torch.tensor([4, 0], dtype=torch.int32), None)
    assert (cu_k.flatten().tolist()[:2], used.flatten().tolist()) == ([400, 0], [100, 100])
    one = decode.plan(2, 1, 32, 4, 100, 128, 0, 132)
    assert decode._make_constants(one, 100, True, "cpu").cu_q.flatten().tolist() == [0, 32, 64]


@pytest.mark.parametrize("page_size,short_parts,tile_n,load_rows", [
    (256, False, 128, 0), (128, False, 128, 0), (64, False, 128, 64), (16, False, 128, 16),
    (8, False, 128, 8), (48, False, 48, 0), (96, False, 96, 0), (24, False, None, None),
    (100, False, None, None), (256, True, 64, 0), (64, True, 64, 0), (32, True, 64, 32),
    (16, True, 64, 16), (48, True, 48, 0), (96, True, 96, 0), (112, True, 112, 0),
    (24, True, None, None)])
def test_which_page_sizes_are_read_in_place(page_size, short_parts, tile_n, load_rows):
    """Pages that divide a block (128 keys; short parts' 64) come one TMA
    load each, pages it divides a block at a time, other WGMMA widths below
    128 one page a step, with either block."""
    config = decode.kernel_config(128, 128, page_size, short_parts=short_parts)
    if tile_n is None:
        assert config is None and not decode.reads_pages_in_place(page_size, 128, 128)
    else:
        assert (config.tile_n, config.kv_load_rows) == (tile_n, load_rows)
        config.validate(128)


def test_pages_wider_than_the_block_stay_in_place_only_where_they_fit():
    """Above head dim 128 a one-page step of 96 keys would not fit two
    stages beside Q: such pages are gathered there."""
    assert decode.kernel_config(256, 256, 96) is None
    assert decode.kernel_config(192, 128, 112) is None
    assert decode.kernel_config(256, 256, 48).tile_n == 48


def test_page_wise_loads_need_a_paged_kernel():
    from cute_fa.kernels.config import Features
    from cute_fa.kernels.fwd_sm90 import FlashAttentionForwardSm90

    config = decode_fwd_config(128).replace(kv_load_rows=16)
    with pytest.raises(ValueError, match="kv_load_rows"):
        FlashAttentionForwardSm90(None, 128, False, config, features=Features(varlen=True))
    with pytest.raises(ValueError, match="kv_load_rows"):
        config.replace(kv_load_rows=24).validate(128)


def test_one_query_tile_per_sequence_is_a_packed_forward_feature():
    """Features.one_q_tile finds a tile's sequence by division, which only a
    packed batch's forward needs: a dense forward and the backward name it
    as an error. The op asks for it where a step's s_q · g rows fit a tile."""
    import cutlass

    from cute_fa.kernels.bwd_config import default_bwd_config
    from cute_fa.kernels.bwd_sm90 import FlashAttentionBackwardSm90
    from cute_fa.kernels.config import Features
    from cute_fa.kernels.fwd_sm90 import FlashAttentionForwardSm90

    with pytest.raises(ValueError, match="features.one_q_tile: expected a varlen kernel"):
        FlashAttentionForwardSm90(cutlass.BFloat16, 128, False, decode_fwd_config(128),
                                  features=Features(one_q_tile=True))
    with pytest.raises(ValueError, match="one_q_tile: expected 1 and False for the backward"):
        FlashAttentionBackwardSm90(cutlass.BFloat16, 128, False, default_bwd_config(128, False),
                                   features=Features(varlen=True, one_q_tile=True))
    assert decode.kernel_features(True, True, 4, one_tile=True).one_q_tile
    assert not decode.kernel_features(True, True, 4).one_q_tile  # the scan is always right
    tile_m = decode_fwd_config(128).tile_m
    for seqlen_q, heads, heads_kv, fits in [(1, 32, 8, True), (1, 64, 1, True),
                                            (1, 128, 1, False), (8, 64, 8, True),
                                            (9, 64, 8, False), (3, 64, 1, False)]:
        p = decode.plan(2, seqlen_q, heads, heads_kv, 4096, 128, 0, 132)
        assert p.one_tile(tile_m) == fits == (p.tiles == 2 * heads_kv)


def test_contiguous_rows_of_whole_blocks_are_read_as_pages():
    """A contiguous cache is read as one page per cache row where its rows
    hold whole K/V blocks (the kernel then cuts the lengths itself)."""
    def cache(rows, capacity, d=128):
        return torch.empty(rows, capacity, 8, d, dtype=torch.bfloat16)

    assert decode.reads_rows_as_pages(cache(2, 1024), cache(2, 1024), 128)
    assert not decode.reads_rows_as_pages(cache(2, 1000), cache(2, 1000), 128)
    assert not decode.reads_rows_as_pages(cache(2, 0), cache(2, 0), 128)
    # head dim 256: blocks of 64 keys
    assert decode.reads_rows_as_pages(cache(2, 320, 256), cache(2, 320, 256), 256)
    strided = cache(4, 1024)[::2]
    assert not decode.reads_rows_as_pages(strided, strided, 128)
    rows = torch.tensor([3, 0], dtype=torch.int32)
    assert torch.equal(decode.row_pages(rows, 2, rows.device), rows.view(2, 1))
    assert decode.row_pages(None, 3, torch.device("cpu")).flatten().tolist() == [0, 1, 2]


def test_e4m3_small_grids_keep_more_stages_in_flight():
    """e4m3 caches on a grid of at most half the SMs take
    E4M3_SMALL_GRID_STAGES K/V stages (a stage holds half the bytes of a
    16-bit one); full grids and 16-bit caches keep decode_fwd_config's."""
    assert decode.plan(64, 1, 8, 1, 8192, 128, 1, 132).ctas == 64  # one tile a sequence
    assert decode.plan(1, 1, 32, 8, 8192, 128, 0, 132).ctas == 128  # 8 tiles x 16 parts
    assert decode.plan(1, 1, 32, 8, 8192, 128, 8, 132).ctas == 64
    assert decode.plan(16, 1, 32, 8, 8192, 128, 0, 132).ctas == 128
    assert decode.plan(1, 4, 32, 1, 8192, 128, 1, 132).ctas == 2  # 128 rows: two tiles
    base = decode_fwd_config(128)
    for page in (None, 16, 256):
        small = decode.kernel_config(128, 128, page, True, True)
        assert small.kv_stages == decode.E4M3_SMALL_GRID_STAGES != base.kv_stages
        assert decode.kernel_config(128, 128, page, True).kv_stages == base.kv_stages
        assert decode.kernel_config(128, 128, page, False, True).kv_stages == base.kv_stages
    for d in (64, 96, 128, 192, 256):
        decode.kernel_config(d, d, None, True, True).validate(d, d, fp8=True)
