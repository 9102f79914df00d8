"""The fp32 dQ accumulator shared by the backward kernel and its postprocess.

Every key block adds its dQ partial (dS·K over tile_m query rows) into one
fp32 buffer per (batch, head). The addition is a bulk asynchronous
reduce-add from shared memory (`cp.reduce.async.bulk ... .add.f32`): one
instruction per warpgroup per step, issued by one thread, with no atomics in
the main loop's instruction stream; or (BwdConfig.dq_direct) 16-byte vector
reductions from each consumer thread's registers (`red.global.add.v4.f32`),
which need no shared memory.

Layout. The buffer is stored in the order the WGMMA accumulator sits in
registers, not row-major, so that the registers -> shared-memory write is a
conflict-free 16-byte store per thread and the reduce-add is one contiguous
range per warpgroup. Inside one query tile (tile_m * head_dim floats):

    warpgroup w owns [w * R, (w + 1) * R),  R = tile_m * head_dim / warpgroups
    value j of thread t of that warpgroup sits at (j // 4) * 512 + t * 4 + j % 4

so a warp's vector store covers 512 contiguous bytes. The postprocess reads
it with the same view and maps value j back to (row, col) through the same
tiled MMA partition the main kernel used, so the two can never disagree.
Query tiles follow each other, so the buffer holds ceil(seqlen_q / tile_m)
whole tiles per (batch, head).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .config import WARPGROUP_THREADS

VECTOR = 4  # floats per 16-byte store
WARPGROUP_STRIDE = WARPGROUP_THREADS * VECTOR


def values_per_thread(tile_m: int, head_dim: int, warpgroups: int) -> int:
    return tile_m * head_dim // (warpgroups * WARPGROUP_THREADS)


def warpgroup_region(tile_m: int, head_dim: int, warpgroups: int) -> int:
    """Floats one warpgroup adds per query tile."""
    return tile_m * head_dim // warpgroups


def thread_view(base: cute.Pointer, wg: Int32, thread_in_wg: Int32, tile_m: int, head_dim: int,
                warpgroups: int) -> cute.Tensor:
    """The values of one thread inside one tile, indexed by their register order."""
    n = values_per_thread(tile_m, head_dim, warpgroups)
    offset = wg * warpgroup_region(tile_m, head_dim, warpgroups) + thread_in_wg * VECTOR
    return cute.make_tensor(base + offset, cute.make_layout(
        (VECTOR, n // VECTOR), stride=(1, WARPGROUP_STRIDE)))


def register_view(acc: cute.Tensor) -> cute.Tensor:
    """A compact accumulator seen as (4, n/4), to pair with thread_view."""
    n = cute.size(acc)
    return cute.make_tensor(acc.iterator, cute.make_layout((VECTOR, n // VECTOR)))


@dsl_user_op
def bulk_reduce_add_f32(dst_gmem: cute.Pointer, src_smem: cute.Pointer, num_bytes: int, *,
                        loc=None, ip=None) -> None:
    """dst[i] += src[i] for num_bytes / 4 floats, asynchronously, in the
    calling thread's bulk group (cp.async.bulk.commit_group / wait_group)."""
    llvm.inline_asm(
        None,
        [dst_gmem.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
         src_smem.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def _reduce_add_v4(dst_gmem: cute.Pointer, a, b, c, d, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None,
        [dst_gmem.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)]
        + [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@cute.jit
def reduce_add_registers(acc: cute.Tensor, tile_base: cute.Pointer, wg: Int32,
                         thread_in_wg: Int32, tile_m: int, head_dim: int, warpgroups: int):
    """Add one thread's dQ partial (a compact accumulator, register order)
    into its values of the tile at tile_base: one 16-byte reduction per
    vector, a warp's covering 512 contiguous bytes."""
    src = register_view(acc)
    dst = thread_view(tile_base, wg, thread_in_wg, tile_m, head_dim, warpgroups)
    for v in cutlass.range_constexpr(cute.size(src, mode=[1])):
        _reduce_add_v4(dst.iterator + v * WARPGROUP_STRIDE, src[0, v], src[1, v], src[2, v],
                       src[3, v])


@dsl_user_op
def _load_acquire(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(
        T.i32(), [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)],
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def _release_add(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None, [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
               Int32(value).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;", "l,r,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def fence_async_global(*, loc=None, ip=None) -> None:
    # The bulk reduce wrote through the async proxy; the semaphore is
    # released through the generic one.
    llvm.inline_asm(None, [], "fence.proxy.async.global;", "~{memory}",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def wait_turn(semaphore: cute.Pointer, turn: Int32):
    """Deterministic mode: spin until `turn` earlier key blocks have added
    their partial to this tile (one thread calls this)."""
    while _load_acquire(semaphore) != turn:
        pass


@cute.jit
def pass_turn(semaphore: cute.Pointer):
    """Deterministic mode: after this thread's reduce-add has completed
    (cp.async.bulk.wait_group 0), let the next key block add its partial."""
    fence_async_global()
    _release_add(semaphore, Int32(1))

