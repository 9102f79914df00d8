"""WGMMA building blocks: swizzled shared-memory layouts, tiled MMAs, GEMM
issue, and register views of the accumulator.

Register facts this module relies on (SM90, 16-bit operands):
- A 64xN fp32 accumulator fragment holds, per thread and per 8-column chunk,
  the values (r, 2c), (r, 2c+1), (r+8, 2c), (r+8, 2c+1): its layout is
  ((2 cols, 2 rows, N/8 chunks), MMA_M, MMA_N).
- The register A operand of a 64xNx16 WGMMA holds, per 16-wide K block, the
  same values as two consecutive accumulator chunks, in the same order.
So P = softmax(S) can be converted in place of the accumulator order and
handed to O += P·V without touching shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass._mlir.dialects import llvm
from cutlass.tensor_utils import LayoutEnum


def smem_layout(dtype, rows: int, cols: int, stages: int | None = None,
                atom_cols: int | None = None):
    """Row-major (K-major) swizzled tile, optionally staged: (rows, cols[, stages]).

    The swizzle width is the widest that divides `atom_cols` (default: cols);
    a GEMM that reads the tile MN-major in slices of N needs it to divide N."""
    atom_kind = sm90.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols)
    atom = warpgroup.make_smem_layout_atom(atom_kind, dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """The same shared-memory tensor with its first two modes exchanged
    (V -> Vᵀ for P·V); later modes keep their place."""
    modes = [1, 0] + list(range(2, cute.rank(t)))
    return cute.make_tensor(t.iterator, cute.select(t.layout, modes))


def tiled_mma_ss(dtype, warpgroups: int, n: int):
    """S = Q·Kᵀ: both operands K-major in shared memory."""
    return tiled_mma(dtype, True, True, (warpgroups, 1, 1), n)


def tiled_mma_rs(dtype, warpgroups: int, n: int):
    """O += P·V: P from registers, V read MN-major (Vᵀ view) from shared memory."""
    return tiled_mma(dtype, True, False, (warpgroups, 1, 1), n, a_in_registers=True)


def tiled_mma(dtype, a_major_k: bool, b_major_k: bool, atom_layout_mnk, n: int,
              a_in_registers: bool = False):
    """The general form: operand majorness, warpgroup arrangement and
    per-warpgroup N chosen by the caller (the backward needs all of them)."""
    major = cute.nvgpu.OperandMajorMode
    return sm90.make_trivial_tiled_mma(
        dtype, dtype, major.K if a_major_k else major.MN, major.K if b_major_k else major.MN,
        Float32, atom_layout_mnk=atom_layout_mnk, tiler_mn=(64, n),
        a_source=warpgroup.OperandSource.RMEM if a_in_registers else warpgroup.OperandSource.SMEM)


@dataclass(frozen=True)
class AtomParts:
    """A shared-memory WGMMA operand read through one fragment per swizzle
    atom along K (kernel_base.mma_operand_parts_at), each viewing the whole
    operand from its atom's first column: K block k is block k % n of
    fragment k // n, n being the K blocks of one atom."""

    fragments: tuple[cute.Tensor, ...]

    @property
    def k_blocks(self) -> int:
        return cute.size(self.fragments[0], mode=[2])

    def k_block(self, k: int) -> cute.Tensor:
        per_atom = self.k_blocks // len(self.fragments)
        return self.fragments[k // per_atom][None, None, k % per_atom]


def _k_blocks(operand) -> int:
    if isinstance(operand, AtomParts):
        return operand.k_blocks
    return cute.size(operand.shape[2])


def _k_block(operand, k: int) -> cute.Tensor:
    if isinstance(operand, AtomParts):
        return operand.k_block(k)
    return operand[None, None, k]


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
         zero_init: cutlass.Constexpr[bool], wait_groups: cutlass.Constexpr[int]):
    """acc (+)= a·b over all K blocks, issued as one WGMMA commit group; a
    may be AtomParts.

    zero_init: the first K block overwrites acc instead of adding to it.
    wait_groups < 0 returns with the group in flight; otherwise waits until at
    most `wait_groups` groups are outstanding.
    """
    # The ACCUMULATE flag is a field of the atom, set per K block; the atom is
    # built here, inside the caller's region, because an atom created outside
    # a dynamic loop cannot be modified inside it.
    atom = cute.make_mma_atom(tiled_mma.op)
    warpgroup.fence()
    for k in cutlass.range_constexpr(_k_blocks(a)):
        atom.set(warpgroup.Field.ACCUMULATE, k > 0 or not zero_init)
        cute.gemm(atom, acc, _k_block(a, k), b[None, None, k], acc)
    warpgroup.commit_group()
    if cutlass.const_expr(wait_groups >= 0):
        warpgroup.wait_group(wait_groups)


def rows_cols_layout(acc_shape) -> cute.Layout:
    """(row, column) of a thread's ((2, 2, V), MMA_M, MMA_N) accumulator ->
    its flat register index (static for static coordinates)."""
    shape = cute.make_layout(acc_shape)
    rows_shape = (shape.shape[0][1], shape.shape[1])
    rows_stride = (shape.stride[0][1], shape.stride[1])
    cols_shape = (shape.shape[0][0], shape.shape[0][2], shape.shape[2])
    cols_stride = (shape.stride[0][0], shape.stride[0][2], shape.stride[2])
    return cute.make_layout((rows_shape, cols_shape), stride=(rows_stride, cols_stride))


def acc_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View a ((2, 2, V), MMA_M, MMA_N) accumulator as (rows, cols) of this thread."""
    return cute.make_tensor(acc.iterator,
                            cute.composition(acc.layout, rows_cols_layout(acc.layout.shape)))


def static_coords(tiled_mma: cute.TiledMma, shape) -> cute.Tensor:
    """The accumulator coordinates of thread 0 as compile-time values: every
    thread's columns are these plus one shift of its own."""
    return tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(shape))


def _ptx(result_type, body: str, constraints: str, operands, loc, ip):
    """One pure inline-PTX expression over DSL scalars."""
    return llvm.inline_asm(result_type, [x.ir_value(loc=loc, ip=ip) for x in operands], body,
                           constraints, has_side_effects=False, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def pack_rounded(lo: Float32, hi: Float32, dtype, *, loc=None, ip=None) -> cutlass.Int32:
    # Two fp32 values rounded to nearest even into one word, lo in bits 0-15:
    # cvt's first source operand fills the upper half. Inline PTX rather than
    # a vector truncation so that the conversion stays where the kernel puts
    # it relative to its barrier waits.
    pair = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return cutlass.Int32(_ptx(T.i32(), f"cvt.rn.{pair}.f32 $0, $1, $2;", "=r,f,f",
                              (Float32(hi), Float32(lo)), loc, ip))


@dsl_user_op
def _unpack_half(word: cutlass.Int32, high: bool, bf16: bool, *, loc=None, ip=None) -> Float32:
    # One operation on the whole word, so that no register is half-written:
    # extracting a half with PRMT merges it into the destination's old value,
    # which keeps that register live across the whole loop.
    if bf16:  # a bf16 is the top half of the fp32 with the same value
        op = "and.b32 t, $1, 0xffff0000;" if high else "shl.b32 t, $1, 16;"
        body = f"{{ .reg .b32 t; {op} mov.b32 $0, t; }}"
    else:
        part = "hi" if high else "lo"
        body = f"{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, $1; cvt.f32.f16 $0, {part}; }}"
    return Float32(_ptx(T.f32(), body, "=f,r", (cutlass.Int32(word),), loc, ip))


@cute.jit
def read_16bit_as_f32(packed: cute.Tensor, acc_shape: cutlass.Constexpr, r: cutlass.Constexpr[int],
                      c: cutlass.Constexpr[int]) -> Float32:
    """Element (row r, column c) of an accumulator that convert_to_16bit packed
    into `packed`, back as fp32."""
    words = cute.recast_tensor(packed, cutlass.Int32)
    k = cute.crd2idx((r, c), rows_cols_layout(acc_shape))
    return _unpack_half(words[k // 2], k % 2 == 1,
                        packed.element_type is cutlass.BFloat16)


@cute.jit
def write_16bit_pair(packed: cute.Tensor, acc_shape: cutlass.Constexpr,
                     r: cutlass.Constexpr[int], c: cutlass.Constexpr[int], lo: Float32,
                     hi: Float32):
    """Elements (r, c) and (r, c + 1) of an accumulator, packed into the word
    of `packed` that convert_to_16bit would give them (c even: a column pair
    is one word), so that no fp32 copy of the whole accumulator is held."""
    words = cute.recast_tensor(packed, cutlass.Int32)
    k = cute.crd2idx((r, c), rows_cols_layout(acc_shape))
    if cutlass.const_expr(k % 2 != 0 or cute.crd2idx((r, c + 1), rows_cols_layout(acc_shape))
                          != k + 1):
        raise ValueError(f"write_16bit_pair: columns {c}, {c + 1} of row {r} are not one word")
    words[k // 2] = pack_rounded(lo, hi, packed.element_type)


@cute.jit
def convert_to_16bit(src: cute.Tensor, dst: cute.Tensor):
    """fp32 registers -> bf16/fp16 registers of the same layout (round to
    nearest even, two neighbours per cvt)."""
    words = cute.recast_tensor(dst, cutlass.Int32)
    for w in cutlass.range_constexpr(cute.size(words)):
        words[w] = pack_rounded(src[2 * w], src[2 * w + 1], dst.element_type)


@cute.jit
def store_acc_tile(values: cute.Tensor, thr_mma, g_tile: cute.Tensor, rows_valid: cutlass.Int32):
    """Write a thread's 16-bit values (accumulator order) into its part of a
    global (rows, cols) tile. Whole tiles take vectorised stores (column pairs
    are adjacent); the ragged last tile stores row-checked elements."""
    dst = thr_mma.partition_C(g_tile)
    if rows_valid >= cute.size(g_tile, mode=[0]):
        cute.autovec_copy(values, dst)
    else:
        coords = thr_mma.partition_C(cute.make_identity_tensor(g_tile.shape))
        for i in cutlass.range_constexpr(cute.size(values)):
            if coords[i][0] < rows_valid:
                dst[i] = values[i]


@cute.jit
def stmatrix_store(dtype, values: cute.Tensor, slab: cute.Tensor, thread_in_wg,
                   transpose: cutlass.Constexpr[bool] = False):
    """One warpgroup's 16-bit accumulator values (64 x n, accumulator order) into
    its (64, n) shared-memory slab with stmatrix. Inside a warpgroup the
    accumulator layout is that of a one-warpgroup MMA, whatever the tiled MMA
    that produced it. transpose: the slab is a transposed view, contiguous
    along its rows (stmatrix .trans writes each 8x8 block's columns as rows)."""
    atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=transpose, num_matrices=4),
                               dtype)
    thr_copy = cute.make_tiled_copy_C(
        atom, tiled_mma_ss(dtype, 1, cute.size(slab, mode=[1]))).get_slice(thread_in_wg)
    cute.copy(atom, thr_copy.retile(values), thr_copy.partition_D(slab))
