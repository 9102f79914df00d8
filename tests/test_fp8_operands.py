"""The e4m3 operands of P·V (cute_kernels/fp8_operands.py): the key order
that lets P stay in its thread's registers, and a one-tile probe kernel
(V transposed in shared memory, P converted from an fp32 accumulator, one
e4m3 WGMMA) compiled for sm_90a on any machine and checked on a GPU
against P·V of the same e4m3 values."""

import pytest
import torch

from cute_fa.kernels.fp8_operands import KEYS_PER_CHUNK, key_of_position

ROWS = 64


def _accumulator_columns(lane: int, tile_n: int) -> list[tuple[int, int]]:
    """(row, column) of each fp32 register of a 64 x tile_n accumulator, in
    register order (j + 2i + 4g), for one lane of warp 0."""
    t, r = lane % 4, lane // 4
    return [(r + 8 * i, 8 * g + 2 * t + j)
            for g in range(tile_n // 8) for i in range(2) for j in range(2)]


def _a_fragment_positions(lane: int, tile_k: int) -> list[tuple[int, int]]:
    """(row, k-position) of each byte of an e4m3 A fragment (64 x tile_k, k
    32 per instruction), in byte order (b + 4i + 8kk), for one lane."""
    t, r = lane % 4, lane // 4
    return [(r + 8 * i, 32 * blk + 16 * kk + 4 * t + b)
            for blk in range(tile_k // 32) for kk in range(2) for i in range(2)
            for b in range(4)]


def _packing_order(tile_n: int) -> list[int]:
    """Which accumulator register each A-fragment byte takes (convert_p_to_e4m3)."""
    order = []
    for w in range(tile_n // 16):
        order += [8 * w + o for o in (0, 1, 4, 5)] + [8 * w + o for o in (2, 3, 6, 7)]
    return order


@pytest.mark.parametrize("tile_n", [64, 128, 176])
def test_each_p_value_stays_in_its_thread_at_the_position_of_its_key(tile_n):
    """For every lane: the byte convert_p_to_e4m3 puts at A position (row, p)
    comes from the accumulator register of (row, key_of_position(p)); so V's
    row key_of_position(p) must be Vᵀ's column p, and every key is some
    position exactly once."""
    tile_n -= tile_n % 32
    for lane in range(32):
        acc = _accumulator_columns(lane, tile_n)
        frag = _a_fragment_positions(lane, tile_n)
        for byte, register in enumerate(_packing_order(tile_n)):
            row, p = frag[byte]
            assert acc[register] == (row, key_of_position(p))
    assert sorted(map(key_of_position, range(tile_n))) == list(range(tile_n))
    assert all(key_of_position(p) // KEYS_PER_CHUNK == p // KEYS_PER_CHUNK
               for p in range(tile_n))


def _probe(keys: int, dim: int):
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.memory import SmemAllocator

    from cute_fa.kernels import fp8_operands, wgmma

    e4m3 = cutlass.Float8E4M3FN
    threads = 128

    class PvProbe:
        """O (64, d) fp32 = e4m3(P) (64, keys) · V (keys, d) e4m3, one CTA:
        V copied into shared memory, transposed, P converted in registers."""

        @cute.jit
        def __call__(self, mP: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                     stream: cuda.CUstream):
            v_layout = wgmma.smem_layout(e4m3, keys, dim)
            vt_layout = wgmma.smem_layout(e4m3, dim, keys)
            tiled_s = wgmma.tiled_mma(e4m3, True, True, (1, 1, 1), keys)
            tiled_pv = wgmma.tiled_mma(e4m3, True, True, (1, 1, 1), dim, a_in_registers=True)

            @cute.struct
            class Storage:
                v: cute.struct.Align[cute.struct.MemRange[e4m3, keys * dim], 1024]
                vt: cute.struct.Align[cute.struct.MemRange[e4m3, keys * dim], 1024]

            self.kernel(mP, mV, mO, v_layout, vt_layout, tiled_s, tiled_pv, Storage).launch(
                grid=[1, 1, 1], block=[threads, 1, 1], smem=Storage.size_in_bytes(),
                stream=stream)

        @cute.kernel
        def kernel(self, mP: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                   v_layout: cute.ComposedLayout, vt_layout: cute.ComposedLayout,
                   tiled_s: cute.TiledMma, tiled_pv: cute.TiledMma, Storage: cutlass.Constexpr):
            tid = cute.arch.thread_idx()[0]
            storage = SmemAllocator().allocate(Storage)
            s_v = storage.v.get_tensor(v_layout.outer, swizzle=v_layout.inner)
            s_vt = storage.vt.get_tensor(vt_layout.outer, swizzle=vt_layout.inner)
            for i in cutlass.range(keys * dim // threads, unroll=4):
                e = tid + i * threads
                s_v[e // dim, e % dim] = mV[e // dim, e % dim]
            cute.arch.sync_threads()
            fp8_operands.transpose_v(s_v.iterator.toint(), v_layout, s_vt.iterator.toint(),
                                     vt_layout, tid, threads)
            cute.arch.fence_view_async_shared()  # generic-proxy writes, then WGMMA reads
            cute.arch.sync_threads()
            thr_s = tiled_s.get_slice(tid)
            acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((ROWS, keys)), Float32)
            cute.autovec_copy(thr_s.partition_C(mP), acc_s)
            thr_pv = tiled_pv.get_slice(tid)
            p = thr_pv.make_fragment_A(thr_pv.partition_shape_A((ROWS, keys)))
            fp8_operands.convert_p_to_e4m3(acc_s, p)
            vt = thr_pv.make_fragment_B(thr_pv.partition_B(s_vt))
            acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((ROWS, dim)), Float32)
            wgmma.gemm(tiled_pv, acc_o, p, vt, zero_init=True, wait_groups=0)
            cute.autovec_copy(acc_o, thr_pv.partition_C(mO))

    return PvProbe()


def _compile_probe(keys: int, dim: int, dump_dir=None):
    import cutlass
    import cutlass.cute as cute

    from cute_fa.kernel_compile import _compile

    def fake(dtype, rows, cols, align):
        return cute.runtime.make_fake_compact_tensor(dtype, (rows, cols), stride_order=(1, 0),
                                                     assumed_align=align)

    return _compile(_probe(keys, dim), fake(cutlass.Float32, ROWS, keys, 16),
                    fake(cutlass.Float8E4M3FN, keys, dim, 16),
                    fake(cutlass.Float32, ROWS, dim, 16), dump_dir=dump_dir)


@pytest.mark.parametrize("keys,dim", [(128, 128), (128, 64)])
def test_the_probe_compiles_to_e4m3_wgmma_without_spills(tmp_path, keys, dim):
    from cute_fa.profiling.kernel_info import dumped_kernel_info

    _compile_probe(keys, dim, dump_dir=str(tmp_path))
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert "e4m3.e4m3" in ptx and "wgmma.mma_async" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "prmt.b32" in ptx
    info = dumped_kernel_info(str(tmp_path))
    assert info.counts["local_memory"] == 0 and info.stack_bytes == 0


@pytest.mark.gpu
@pytest.mark.parametrize("keys,dim", [(128, 128), (128, 64)])
def test_the_probe_multiplies_e4m3_p_by_v(keys, dim):
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.rand(ROWS, keys, device="cuda", generator=gen) * 4
    v = (torch.randn(keys, dim, device="cuda", generator=gen) * 2).to(torch.float8_e4m3fn)
    out = torch.empty(ROWS, dim, device="cuda")
    _compile_probe(keys, dim)(p, v, out)
    p8 = p.to(torch.float8_e4m3fn).float()
    expected = p8 @ v.float()
    # FP8 WGMMA adds its products with fewer mantissa bits than fp32 keeps
    # (about 14; measured: 2^-13.7 of the sum of magnitudes here). A key
    # order that paired P and V wrongly errs by a large part of that sum.
    magnitude = p8.abs() @ v.float().abs()
    assert ((out - expected).abs() <= magnitude * 2.0**-11).all()
