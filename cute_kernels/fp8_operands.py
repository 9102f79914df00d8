"""The e4m3 operands of the forward's O += P·V: P from the fp32 accumulator
in registers, Vᵀ built in shared memory.

FP8 WGMMA reads both operands K-major, and P·V's K is the keys: P is
(rows, keys) as it comes, V arrives (keys, d) from global memory and must
be transposed into (d, keys). Both sides agree on an order of the keys
inside each 16-key chunk, so that neither needs data from another thread:

- The accumulator of S holds, per thread (lane l, t = l % 4), columns
  2t + j + 8g (j in 0..1, g the 8-column chunk) of rows r and r + 8, in
  register order j + 2·i + 4·g (i: the row half).
- The A fragment of an e4m3 64xNx32 WGMMA holds, per thread, k-positions
  4t + b + 16·kk (b in 0..3, kk in 0..1) of the same rows, in byte order
  b + 4·i + 8·kk.
Let k-position p = 16·kk + 4t + 2h + j stand for key s = 16·kk + 8h + 2t + j
(h = g % 2, kk = g // 2): every value then stays with its thread, and the
bytes of a 32-key block come from its 16 accumulator registers as
    word 2·w     = e4m3(c[8w], c[8w+1], c[8w+4], c[8w+5])
    word 2·w + 1 = e4m3(c[8w+2], c[8w+3], c[8w+6], c[8w+7])
(c: the block's registers, w = kk): the permutation into the A layout is
the choice of which registers each conversion packs, not a pass of byte
permutes after it. V's transpose writes row s of V into column p of Vᵀ
(key_of_position), and since P·V sums over the keys, the product is that
of the unpermuted P and V.

The transpose (transpose_v): a warp takes 16 keys x 32 columns of d at a
time, one ldmatrix.x4.trans (its fragment holds, per lane, the 4 keys of
4 consecutive positions for 2 columns), one byte permute per column and
one stmatrix.x4 into Vᵀ's rows; the offsets come from the tiles'
swizzled layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .dsl_struct import DslStruct


KEYS_PER_CHUNK = 16  # the key permutation repeats every 16 keys


@dataclass
class Descales(DslStruct):
    """An e4m3 kernel's descales (x ≈ x8 · descale), fp32 (1, b, h_kv) each,
    any strides: three tensors as the caller has them, so that a call needs
    no launch to gather them (a scale given once per tensor may come
    expanded, stride 0). Other kernels take stand-ins they never read."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor

    def score_factor(self, batch: Int32, head_kv: Int32) -> Float32:
        """What multiplies a tile's scores: Q's and K's descales."""
        return self.q[0, batch, head_kv] * self.k[0, batch, head_kv]

    def o_factor(self, batch: Int32, head_kv: Int32) -> Float32:
        """What multiplies a tile's output: V's descale."""
        return self.v[0, batch, head_kv]


def key_of_position(p: int) -> int:
    """The key (in its tile) that k-position p of the e4m3 P·V stands for."""
    base, r = divmod(p, KEYS_PER_CHUNK)
    return KEYS_PER_CHUNK * base + 8 * ((r % 4) // 2) + 2 * (r // 4) + r % 2


def _asm(result_type, body: str, constraints: str, operands, loc, ip, side_effects=False):
    return llvm.inline_asm(result_type, [x.ir_value(loc=loc, ip=ip) for x in operands], body,
                           constraints, has_side_effects=side_effects, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def pack_e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None,
                ip=None) -> Int32:
    """Four fp32 values rounded to e4m3 (saturating), a in bits 0-7 ... d in
    bits 24-31. cvt's first source operand fills the upper byte of a pair."""
    body = ("{ .reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi}; }")
    return Int32(_asm(T.i32(), body, "=r,f,f,f,f",
                      (Float32(a), Float32(b), Float32(c), Float32(d)), loc, ip))


@cute.jit
def convert_p_to_e4m3(acc: cute.Tensor, frag_a: cute.Tensor):
    """The fp32 accumulator of S (one warpgroup's 64 x N, accumulator order)
    into the e4m3 A fragment of P·V (module docstring: keys in position
    order)."""
    words = cute.recast_tensor(frag_a, Int32)
    for w in cutlass.range_constexpr(cute.size(acc) // 8):
        words[2 * w] = pack_e4m3x4(acc[8 * w], acc[8 * w + 1], acc[8 * w + 4], acc[8 * w + 5])
        words[2 * w + 1] = pack_e4m3x4(acc[8 * w + 2], acc[8 * w + 3], acc[8 * w + 6],
                                       acc[8 * w + 7])


@dsl_user_op
def _prmt(x: Int32, y: Int32, selector: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                      (Int32(x), Int32(y), Int32(selector)), loc, ip))


@dsl_user_op
def _load_shared(address: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), "ld.shared.b32 $0, [$1];", "=r,r,~{memory}",
                      (Int32(address),), loc, ip, side_effects=True))


@dsl_user_op
def _store_shared(address: Int32, value: Int32, *, loc=None, ip=None) -> None:
    _asm(None, "st.shared.b32 [$0], $1;", "r,r,~{memory}", (Int32(address), Int32(value)),
         loc, ip, side_effects=True)


@dsl_user_op
def _opaque(x: Int32, *, loc=None, ip=None) -> Int32:
    """x, as a value the compiler may not hoist out of the loop it is in."""
    return Int32(_asm(T.i32(), "mov.b32 $0, $1;", "=r,r", (Int32(x),), loc, ip,
                      side_effects=True))


@dsl_user_op
def _ldmatrix_x4_trans(address: Int32, *, loc=None, ip=None):
    words = llvm.StructType.get_literal([T.i32()] * 4)
    result = _asm(words, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
                  "=r,=r,=r,=r,r,~{memory}", (Int32(address),), loc, ip, side_effects=True)
    return [Int32(llvm.extractvalue(T.i32(), result, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def _stmatrix_x4(address: Int32, w0: Int32, w1: Int32, w2: Int32, w3: Int32, *, loc=None,
                 ip=None) -> None:
    _asm(None, "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};",
         "r,r,r,r,r,~{memory}", (Int32(address), Int32(w0), Int32(w1), Int32(w2), Int32(w3)),
         loc, ip, side_effects=True)


KEYS_PER_ITEM = 16  # one key chunk
DIMS_PER_ITEM = 32  # two 16-byte columns of V
LOADS_IN_FLIGHT = 2  # items per batch (4: ptxas spilled 8 bytes at head dim 192)


def _ldmatrix_row(matrix, row):
    """(key, column) in its item of the V row that row `row` of matrix
    `matrix` of ldmatrix.x4.trans reads (lane 8·matrix + row gives its
    address): matrix j is keys 8(j % 2) .. + 7 of columns 16(j // 2) .. + 15.
    For Python ints and Int32 alike."""
    return 8 * (matrix % 2) + row, 16 * (matrix // 2)


def _stmatrix_row(matrix, row):
    """The row of Vᵀ (column of d) in its item that row `row` of matrix
    `matrix` of stmatrix.x4 writes: matrix j holds rows
    16(j // 2) + 2i + (j % 2), except that lanes with c = lane // 4 >= 4
    give the odd rows to the even matrices and back (`swap` in
    transpose_v), so that each matrix's 8 rows cover every residue mod 8:
    the swizzles xor the 16-byte column with the row, and 8 distinct
    residues are 8 distinct bank groups."""
    return 16 * (matrix // 2) + 2 * row + ((matrix % 2) ^ (row // 4))


def _xor_separable(layout, lane_coords, item_coords) -> bool:
    """Whether offset(lane + item) = offset(lane) xor offset(item) for every
    pair: true where the lane's and the item's unswizzled offsets share no
    bit (the swizzle is linear over GF(2)), which lets a thread compute its
    own offset once and each item's offset at compile time."""
    return all(cute.crd2idx((a + c, b + e), layout)
               == cute.crd2idx((a, b), layout) ^ cute.crd2idx((c, e), layout)
               for a, b in lane_coords for c, e in item_coords)


@cute.jit
def transpose_v(src_base: Int32, src_layout: cute.ComposedLayout, dst_base: Int32,
                dst_layout: cute.ComposedLayout, thread: Int32,
                threads: cutlass.Constexpr[int]):
    """dst[x, p] = src[key_of_position(p), x] for one stage: src (keys, d)
    e4m3 as TMA leaves it, dst (d, keys) as the e4m3 P·V reads it, both in
    shared memory at the given byte addresses, offsets from their swizzled
    one-stage layouts. The `threads` callers (whole warps, thread in
    0 .. threads - 1) share the work.

    A warp's work item: one 16-key chunk by 32 columns of d (512 bytes),
    one ldmatrix.x4.trans, four byte permutes and one stmatrix.x4.
    ldmatrix.trans of 8 keys x 8 16-bit pairs of d gives lane (c = lane/4,
    t = lane % 4) keys 2t, 2t + 1 of columns 2c, 2c + 1: with the
    matrix of keys + 8, exactly the keys of positions 4t .. 4t + 3
    (key_of_position), so one permute per column of d makes the 4-byte
    word of Vᵀ that stmatrix wants from that lane, in row 2c or 2c + 1.

    Each warp's items are fixed at compile time, and every address is the
    thread's offset (computed once) xor the item's (a constant): the
    transposer runs between the V and Vᵀ barriers of every stage, so its
    latency, not its instruction count, is what the consumers may wait on."""
    lane = thread % 32
    warp = thread // 32
    warps = threads // 32
    keys = cute.size(src_layout, mode=[0])
    dims = cute.size(src_layout, mode=[1])
    groups = dims // DIMS_PER_ITEM
    items = [(KEYS_PER_ITEM * (i // groups), DIMS_PER_ITEM * (i % groups))
             for i in range(keys // KEYS_PER_ITEM * groups)]
    src_lanes = [_ldmatrix_row(*divmod(x, 8)) for x in range(32)]
    dst_lanes = [(_stmatrix_row(*divmod(x, 8)), 0) for x in range(32)]
    if cutlass.const_expr(not (_xor_separable(src_layout, src_lanes, items) and _xor_separable(
            dst_layout, dst_lanes, [(d, k) for k, d in items]))):
        raise ValueError(f"transpose_v: the V layout {src_layout} or the Vᵀ layout "
                         f"{dst_layout} does not separate lane and item offsets")
    matrix = lane // 8
    row = lane % 8
    src_lane = cute.crd2idx(_ldmatrix_row(matrix, row), src_layout)
    dst_lane = cute.crd2idx((_stmatrix_row(matrix, row), 0), dst_layout)
    swap = lane // 16  # c >= 4
    even = 0x6420 + swap * (0x7531 - 0x6420)
    odd = 0x7531 - swap * (0x7531 - 0x6420)
    src_lane_max = max(cute.crd2idx(c, src_layout) for c in src_lanes)
    dst_lane_max = max(cute.crd2idx(c, dst_layout) for c in dst_lanes)
    for w in cutlass.range_constexpr(warps):
        if warp == w:
            mine = items[w::warps]
            src_at = _ItemAddresses(src_base, _opaque(src_lane), src_lane_max)
            dst_at = _ItemAddresses(dst_base, _opaque(dst_lane), dst_lane_max)
            # the loads of a batch first: a load may not pass an earlier
            # store (neither the compiler nor ptxas knows V and Vᵀ apart),
            # so one load per store would wait out every load's latency
            for first in cutlass.range_constexpr(0, len(mine), LOADS_IN_FLIGHT):
                batch = mine[first:first + LOADS_IN_FLIGHT]
                loaded = [_ldmatrix_x4_trans(src_at(cute.crd2idx((key, column), src_layout)))
                          for key, column in batch]
                for (key, column), v in zip(batch, loaded):
                    # v[0], v[1]: keys 2t, 2t + 1 / 2t + 8, 2t + 9 of columns
                    # 2c, 2c + 1 (bytes: key 2t col 2c, key 2t col 2c + 1, key
                    # 2t + 1 col 2c, ...); v[2], v[3]: the next 16 columns
                    _stmatrix_x4(dst_at(cute.crd2idx((column, key), dst_layout)),
                                 _prmt(v[0], v[1], even), _prmt(v[0], v[1], odd),
                                 _prmt(v[2], v[3], even), _prmt(v[2], v[3], odd))


class _ItemAddresses:
    """base + (lane ^ item) for a thread's offset `lane` (below 2^k, k the
    bits of `lane_max`) and an item's compile-time offset: the item's bits
    from k up add (an immediate of the ld/st), only the bits below k xor,
    so a stage needs one register per distinct low part, not one per item.
    transpose_v passes `lane` through _opaque: the xors do not change from
    stage to stage, and hoisted out of the stream loop (every warp's
    branch's) they held more registers than the producer warpgroup's 56,
    and spilled."""

    def __init__(self, base: Int32, lane: Int32, lane_max: int):
        self.base, self.lane = base, lane
        self.low_mask = (1 << int(lane_max).bit_length()) - 1
        self.xored = {}

    def __call__(self, item: int) -> Int32:
        low = item & self.low_mask
        if low not in self.xored:
            self.xored[low] = self.base + (self.lane ^ low)
        return self.xored[low] + (item - low)


@dataclass
class VTransposeRing:
    """Where the transposer meets its neighbours: the V ring that TMA fills
    (it consumes) and the Vᵀ ring the P·V GEMMs read (it produces), as
    their mbarriers (stage 0's; one per stage after it), shared-memory
    bases and one-stage layouts; both rings have `stages` stages and
    advance together. `done`: one word per V stage, which the producer sets
    for the stage of its last arrival on the V ring (end of stream). Per
    stage, not one word: the producer may end the stream on stage s while
    the transposer still has stage s - 1 to read, full from TMA; one word
    would end the stream there, and the consumers would wait forever for
    that stage's Vᵀ."""

    v_full: cute.Pointer
    v_empty: cute.Pointer
    vt_full: cute.Pointer
    vt_empty: cute.Pointer
    v_base: Int32
    v_stage: cute.ComposedLayout
    vt_base: Int32
    vt_stage: cute.ComposedLayout
    done: Int32  # shared-memory address of stage 0's word
    stages: int

    @staticmethod
    def create(v_pipe, vt_pipe, v_base: Int32, v_stage, vt_base: Int32, vt_stage, done: Int32,
               stages: int) -> "VTransposeRing":
        first = Int32(0)
        return VTransposeRing(v_pipe.sync_object_full.get_barrier(first),
                              v_pipe.sync_object_empty.get_barrier(first),
                              vt_pipe.sync_object_full.get_barrier(first),
                              vt_pipe.sync_object_empty.get_barrier(first),
                              v_base, v_stage, vt_base, vt_stage, done, stages)


@cute.jit
def transpose_v_stream(ring: VTransposeRing, thread: Int32, threads: cutlass.Constexpr[int]):
    """Every V stage TMA fills, in ring order, into the Vᵀ stage of the same
    place in its ring, until the producer's end-of-stream arrival. The
    transposer needs no tiles nor blocks of its own: it follows the ring.
    Its waits and arrivals are on the rings' mbarriers directly: a
    pipeline object carried through this loop would carry values the
    loop cannot see defined."""
    v_bytes = cute.cosize(ring.v_stage)
    vt_bytes = cute.cosize(ring.vt_stage)
    stage = Int32(0)
    phase = Int32(0)  # of the full barriers; the empty ones wait for the other
    cute.arch.mbarrier_wait(ring.v_full + stage, phase)
    streaming = _load_shared(ring.done) == 0  # stage 0's word
    while streaming:
        cute.arch.mbarrier_wait(ring.vt_empty + stage, phase ^ 1)
        transpose_v(ring.v_base + stage * v_bytes, ring.v_stage, ring.vt_base + stage * vt_bytes,
                    ring.vt_stage, thread, threads)
        # generic-proxy stores, read next by WGMMA through the async proxy
        cute.arch.fence_view_async_shared()
        cute.arch.mbarrier_arrive(ring.vt_full + stage)
        cute.arch.mbarrier_arrive(ring.v_empty + stage)
        stage += 1
        if stage == ring.stages:
            stage = Int32(0)
            phase ^= 1
        cute.arch.mbarrier_wait(ring.v_full + stage, phase)
        # written (if at all) before the arrival just awaited, and only for this stage
        streaming = _load_shared(ring.done + 4 * stage) == 0


@cute.jit
def start_v_stream(done: Int32, stages: cutlass.Constexpr[int]):
    """The end-of-stream words cleared (one thread, before the CTA's barrier
    initialisation sync)."""
    for stage in cutlass.range_constexpr(stages):
        _store_shared(done + 4 * stage, Int32(0))


@cute.jit
def end_v_stream(v_pipe, state, done: Int32):
    """The producer's last word to the transposer: once the V stage of
    `state` is free, set that stage's end-of-stream word and arrive on its
    full barrier without a load (the arrival releases the write)."""
    v_pipe.sync_object_empty.wait(state.index, state.phase)
    with cute.arch.elect_one():  # the full barrier counts one producer arrival
        _store_shared(done + 4 * state.index, Int32(1))
        cute.arch.mbarrier_arrive(v_pipe.producer_get_barrier(state))
