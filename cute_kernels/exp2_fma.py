"""exp2 on the FMA pipe, for a share of a softmax's exponentials.

An SM90 SM retires 16 MUFU lanes a clock against 128 FP32 lanes. A warp's
ex2 holds the MUFU of its sub-partition 8 cycles; the same value from a
polynomial takes 8 issue slots on the FMA and integer pipes. That trade
pays where the MUFU is loaded and issue slots are free: a bf16 softmax
under a cap at head dim 64, whose MUFU carries a tanh and an ex2 a score
(twice its GEMMs' time) and which keeps no running maximum (no reductions,
no O rescale). Where a maximum is kept, issue is the limit and every share
lost (docs/findings.md). The share, k of every 8, is a config field.

2^x = 2^j · 2^f with j = round(x), f = x - j in [-1/2, 1/2]:
- j comes from adding 1.5 · 2^23 (the sum's last mantissa bits are j, the
  rounding done by the FADD), f from subtracting the rounded value back;
- 2^f = 1 + f·(c1 + f·(c2 + f·c3)), a minimax fit of relative error 1.0e-4
  with the constant fixed at 1 (three FFMAs; fp32 ex2.approx: 2^-22; a
  bf16 P rounds at 2^-9, an e4m3 one at 2^-4);
- 2^j enters as j added to the exponent field: the sum's bits shifted left
  by 23 are j · 2^23 modulo 2^32 (its upper bits shift out).
x is clamped to -127 first: -inf (a masked score) and everything below
give f = 0, p = 1.0 and an exponent field of 127 - 127: +0.0 exactly, as
ex2 gives for -inf. In (-127, -126.5) the result is a denormal pattern below
2^-126 instead of the true value (an error below 1.2e-38). Valid for
x < 127.5 (the softmax's exponents are at most FIXED_EXP_CEIL = 64); a NaN
x gives 0 where ex2 gives NaN.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass._mlir.dialects import llvm

# 2^f on [-1/2, 1/2] = 1 + f·(C1 + f·(C2 + f·C3)) (fp32 bit patterns)
POLY_C1 = 0x3F317AFD  # 0.69328290
POLY_C2 = 0x3E780629  # 0.24221100
POLY_C3 = 0x3D61510C  # 0.05500893
ROUNDING_SHIFT = 0x4B400000  # 1.5 · 2^23
CLAMP = 0xC2FE0000  # -127.0

_BODY = (
    "{ .reg .f32 x, t, r, f, p; .reg .b32 tb, pb, j;\n"
    f"max.f32 x, $1, 0f{CLAMP:08X};\n"
    f"add.rn.f32 t, x, 0f{ROUNDING_SHIFT:08X};\n"
    f"sub.rn.f32 r, t, 0f{ROUNDING_SHIFT:08X};\n"
    "sub.rn.f32 f, x, r;\n"
    f"fma.rn.f32 p, f, 0f{POLY_C3:08X}, 0f{POLY_C2:08X};\n"
    f"fma.rn.f32 p, p, f, 0f{POLY_C1:08X};\n"
    "fma.rn.f32 p, p, f, 0f3F800000;\n"
    "mov.b32 tb, t;\n"
    "mov.b32 pb, p;\n"
    "shl.b32 j, tb, 23;\n"
    "add.s32 pb, pb, j;\n"
    "mov.b32 $0, pb; }"
)


@dsl_user_op
def exp2_poly(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x from FADDs, FFMAs and an integer add (module docstring)."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], _BODY,
                                   "=f,f", has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


def on_fma(column: int, per_8: int) -> bool:
    """Whether a thread's column `column` of a row takes exp2_poly when per_8
    of every 8 do: spread over the 8 (per_8 = 2: columns 3 and 7), so that
    the MUFU's queue never waits behind a run of polynomials."""
    c = column % 8
    return (c + 1) * per_8 // 8 > c * per_8 // 8


def exp2_of_column(x: Float32, column: int, per_8: int) -> Float32:
    """2^x for a thread's column `column` of a row: exp2_poly where per_8 of
    every 8 columns take it (on_fma), ex2 otherwise (a compile-time choice)."""
    if on_fma(column, per_8):
        return exp2_poly(x)
    return cute.math.exp2(x, fastmath=True)


@cute.jit
def exp2_row(values: cute.Tensor, per_8: cutlass.Constexpr[int]):
    """values ← 2^values in place (a thread's row of scores, log2 units)."""
    for j in cutlass.range_constexpr(cute.size(values)):
        values[j] = exp2_of_column(values[j], j, per_8)
