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

First touch (BwdConfig.dq_first_store). Zeroing the buffer before the main
kernel writes it whole once more (as many bytes as the preprocess reads of
O and dO), so instead a tile's first partial is stored and later ones are
added. Without the deterministic order the first is whoever claims the
tile: its slot in the semaphore tensor (tile_slot) goes UNTOUCHED ->
CLAIMED (a compare-and-swap by the key block whose partial is staged) ->
WRITTEN (once that store has completed); the other key blocks wait for
WRITTEN before they add. With the deterministic order the first turn
stores. A tile no key block walks is never written: the postprocess reads
its slot (or its turn count) and writes zeros there.
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


def _bulk_shared_to_global(opcode: str, dst_gmem: cute.Pointer, src_smem: cute.Pointer,
                           num_bytes: int, loc, ip) -> None:
    llvm.inline_asm(
        None,
        [dst_gmem.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
         src_smem.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        f"{opcode} [$0], [$1], $2;", "l,r,r,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def bulk_reduce_add_f32(dst_gmem: cute.Pointer, src_smem: cute.Pointer, num_bytes: int, *,
                        loc=None, ip=None) -> None:
    """dst[i] += src[i] for num_bytes / 4 floats, asynchronously, in the
    calling thread's bulk group (cp.async.bulk.commit_group / wait_group)."""
    _bulk_shared_to_global("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32",
                           dst_gmem, src_smem, num_bytes, loc, ip)


@dsl_user_op
def bulk_store_f32(dst_gmem: cute.Pointer, src_smem: cute.Pointer, num_bytes: int, *,
                   loc=None, ip=None) -> None:
    """dst[i] = src[i] for num_bytes / 4 floats: bulk_reduce_add_f32's plain
    copy, for a tile's first partial (first touch, above)."""
    _bulk_shared_to_global("cp.async.bulk.global.shared::cta.bulk_group", dst_gmem, src_smem,
                           num_bytes, loc, ip)


@cute.jit
def bulk_write_f32(dst_gmem: cute.Pointer, src_smem: cute.Pointer, num_bytes: int,
                   first: Int32):
    """A slab into the accumulator: stored where it is the tile's first
    partial (first != 0), else added."""
    if first != 0:
        bulk_store_f32(dst_gmem, src_smem, num_bytes)
    else:
        bulk_reduce_add_f32(dst_gmem, src_smem, num_bytes)


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
def _compare_and_swap(ptr: cute.Pointer, expected: Int32, desired: Int32, *, loc=None,
                      ip=None) -> Int32:
    return Int32(llvm.inline_asm(
        T.i32(), [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
                  Int32(expected).ir_value(loc=loc, ip=ip),
                  Int32(desired).ir_value(loc=loc, ip=ip)],
        "atom.relaxed.gpu.global.cas.b32 $0, [$1], $2, $3;", "=r,l,r,r,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def fence_async_global(*, loc=None, ip=None) -> None:
    # The bulk reduce wrote through the async proxy; the semaphore is
    # released through the generic one.
    llvm.inline_asm(None, [], "fence.proxy.async.global;", "~{memory}",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


# First touch's states of a query tile's slot (slot_index).
UNTOUCHED, CLAIMED, WRITTEN = 0, 1, 2


def slot_index(tile_index):
    """A query tile's slot in the semaphore tensor's last mode, after element
    0, the tile counter of dynamic_tiles. First touch keeps its state there,
    convert_dq its count of adds (dq_convert.py)."""
    return tile_index + 1


def turn_index(tile_index, warpgroup, warpgroups: int):
    """Deterministic mode: the semaphore element that counts the turns of a
    query tile's warpgroup region (how many key blocks have added to it)."""
    return tile_index * warpgroups + warpgroup


def tile_slot(mSemaphore: cute.Tensor, tile_index: Int32, head: Int32,
              buffer_batch: Int32) -> cute.Pointer:
    """A query tile's slot (tile_index: its tile in the per-row buffers, a
    packed sequence's from its padded start) in the main kernel's
    (slot, head, batch) view of the semaphore tensor."""
    return mSemaphore.iterator + cute.crd2idx((slot_index(tile_index), head, buffer_batch),
                                              mSemaphore.layout)


@cute.jit
def peek(slot: cute.Pointer) -> Int32:
    """The slot's state, read ahead of the claim (its latency under the
    consumers' step): a tile seen WRITTEN needs no atomic. An acquire, as
    that sight alone then orders the first partial's store before the adds."""
    return _load_acquire(slot)


@cute.jit
def claim_or_wait(slot: cute.Pointer, seen: Int32) -> Int32:
    """1 if this key block's partial is the tile's first (it stores it, then
    publishes), else 0 once the first's store has completed (it adds). One
    thread calls this, with its partial staged: a claimer never waits on
    another CTA, so the waits cannot form a cycle."""
    state = seen
    first = Int32(0)
    if state == UNTOUCHED:
        state = _compare_and_swap(slot, Int32(UNTOUCHED), Int32(CLAIMED))
        if state == UNTOUCHED:
            first = Int32(1)
    if first == 0:
        while state != WRITTEN:
            state = _load_acquire(slot)
        # the first partial's store, seen through the generic proxy, before
        # this thread's bulk adds, issued through the async one
        fence_async_global()
    return first


@cute.jit
def publish(slot: cute.Pointer):
    """After the first partial's store has completed (cp.async.bulk.wait_group
    0 without .read): CLAIMED -> WRITTEN."""
    fence_async_global()
    _release_add(slot, Int32(WRITTEN - CLAIMED))


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

