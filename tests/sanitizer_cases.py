"""Small problems through every kernel family, run by test_sanitizer_gpu.py
under compute-sanitizer: `python tests/sanitizer_cases.py FAMILY`. Partial
tiles everywhere (lengths that are not tile multiples, empty sequences,
ragged caches). `planted_race` and `planted_store` launch a kernel with a
shared-memory race, the second with an out-of-bounds store too, so that a
sanitizer that instruments nothing fails the test instead of passing it."""

import sys

import torch

from cute_fa import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

DEVICE = "cuda"


def _randn(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_(grad)


def _forward_backward(q, k, v, **kwargs):
    out = flash_attn_func(q, k, v, **kwargs)
    out.float().square().sum().backward()


def dense():
    for d, dv, causal, seqlen in [(64, 64, True, 333), (128, 128, False, 517),
                                  (96, 96, True, 200), (192, 128, True, 300),
                                  (256, 256, False, 260)]:
        _forward_backward(_randn(2, seqlen, 4, d, grad=True), _randn(2, seqlen, 2, d, grad=True),
                          _randn(2, seqlen, 2, dv, grad=True), causal=causal)
    q, k, v = (_randn(1, 300, 2, 128, grad=True) for _ in range(3))
    _forward_backward(q, k, v, causal=True, deterministic=True)


def scores():
    sink = torch.randn(4, device=DEVICE, requires_grad=True)
    for d in (64, 128):
        _forward_backward(_randn(2, 333, 4, d, grad=True), _randn(2, 333, 2, d, grad=True),
                          _randn(2, 333, 2, d, grad=True), causal=True, window_size=(100, 0),
                          softcap=30.0, learnable_sink=sink)


def varlen():
    lengths = torch.tensor([0, 1, 130, 333, 64])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).int().to(DEVICE)
    total, longest = int(cu[-1]), int(lengths.max())
    for d, causal in ((64, True), (128, False)):
        q, k, v = (_randn(total, 4, d, grad=True) for _ in range(3))
        out = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)
        out.float().square().sum().backward()


def kvcache():
    batch, heads_kv, heads, d, capacity = 3, 2, 8, 128, 1024
    for page in (None, 16, 256):
        for seqlen_q, splits in ((1, 0), (4, 3), (1, 1)):
            lengths = torch.tensor([0, 700, capacity - seqlen_q], dtype=torch.int32,
                                   device=DEVICE)
            if page is None:
                k_cache, v_cache, table = (_randn(batch, capacity, heads_kv, d),
                                           _randn(batch, capacity, heads_kv, d), None)
            else:
                pages = batch * capacity // page
                k_cache, v_cache = (_randn(pages, page, heads_kv, d) for _ in range(2))
                table = torch.randperm(pages, device=DEVICE).int().view(batch, capacity // page)
            flash_attn_with_kvcache(_randn(batch, seqlen_q, heads, d), k_cache, v_cache,
                                    _randn(batch, seqlen_q, heads_kv, d),
                                    _randn(batch, seqlen_q, heads_kv, d), cache_seqlens=lengths,
                                    page_table=table, causal=seqlen_q > 1, num_splits=splits)


def fp8():
    for d, causal in ((128, True), (64, False)):
        q, k, v = (_randn(2, 333, 2, d).to(torch.float8_e4m3fn) for _ in range(3))
        flash_attn_func(q, k, v, causal=causal)


def tile_streams():
    """The head-dim-64 short-row configs the op takes on full GPUs only."""
    from cute_fa.kernels.config import three_ctas_an_sm, three_tile_streams, two_ctas_an_sm
    from cute_fa.ops import forward_cuda

    q, k, v = (_randn(4, 333, 2, 64) for _ in range(3))
    for config in (three_tile_streams(False), three_tile_streams(True),
                   two_ctas_an_sm(2, True, 8), three_ctas_an_sm(True, True)):
        for causal in (False, True):
            forward_cuda(q, k, v, 0.125, causal, config)


def block_sparse():
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx < 300) | (kv_idx % 3 == 0))

    mask = create_block_mask(visible, None, None, 1000, 1000, device=DEVICE)
    for d in (64, 128):
        _forward_backward(_randn(1, 1000, 2, d, grad=True), _randn(1, 1000, 2, d, grad=True),
                          _randn(1, 1000, 2, d, grad=True), block_mask=mask)


def _planted(far: int):
    """Thread 0 writes shared memory that thread 32 reads with no barrier
    between, and thread 1 stores element `far` of a 4-element tensor."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack
    from cutlass.memory import SmemAllocator

    @cute.struct
    class Storage:
        words: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 64], 128]

    @cute.kernel
    def racy(dst: cute.Tensor, far: cutlass.Int32):
        tid = cute.arch.thread_idx()[0]
        words = SmemAllocator().allocate(Storage).words.get_tensor(cute.make_layout(64))
        if tid == 0:
            words[0] = tid + 7
        if tid == 32:
            dst[0] = words[0]
        if tid == 1:
            dst[far] = 5

    @cute.jit
    def launch(dst: cute.Tensor, far: cutlass.Int32):
        racy(dst, far).launch(grid=[1, 1, 1], block=[64, 1, 1])

    dst = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    launch(from_dlpack(dst), cutlass.Int32(far))


def planted_race():
    _planted(far=1)  # in bounds: the store's fault would end the kernel before the report


def planted_store():
    _planted(far=1 << 20)


FAMILIES = {f.__name__: f for f in (dense, scores, varlen, kvcache, fp8, tile_streams,
                                    block_sparse, planted_race, planted_store)}

if __name__ == "__main__":
    torch.manual_seed(0)
    FAMILIES[sys.argv[1]]()
    torch.cuda.synchronize()
    print(f"family {sys.argv[1]} done", flush=True)
