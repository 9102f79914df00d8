"""Logit soft-capping (Gemma 2): score = softcap · tanh(scale · q·k / softcap).

The kernels keep t = tanh(q·k · scale / softcap) in the score registers
(one FMUL and one MUFU.TANH an element) and hand the softmax softcap · log2(e)
as its exponent factor, so P = exp2(t · softcap · log2(e) − LSE₂) is the same
one FFMA and ex2 as without a cap. The host folds the constants
(launch_plan's scalars). In the backward, the chain rule through the cap is
d score / d(q·k) = scale · (1 − t²): the kernel multiplies dS by 1 − t²
(exp2_with_slope, folded into P as it is made) and the existing scale of dQ and
dK does the rest.

A capped score is bounded: t · softcap · log2(e) lies in [-c, c], c =
softcap · log2(e). The bf16 forward then needs no running maximum
(softmax.OnlineSoftmax.fixed_reference) when one offset o puts every
exp2(t · c - o) in [2^FIXED_EXP_FLOOR, 2^FIXED_EXP_CEIL]: normal in fp32
and bf16 at the bottom (the margin to 2^-126 covers tanh.approx's error), and
at the top far enough from fp32's overflow that a row sum of any length and
P·V stay finite. That holds for c <= 94 (softcap up to ~65: Gemma 2's 50
included); o = c (P <= 1, as with a maximum) up to c = 62, 124 - c above.
fp16 P (down to 2^-24) has no such range: its kernels keep the maximum.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .exp2_fma import exp2_of_column
from .wgmma import acc_rows_cols, write_16bit_pair

FIXED_EXP_FLOOR = -124.0
FIXED_EXP_CEIL = 64.0


@dataclass
class FixedReference:
    """Whether the cap allows a fixed softmax reference, and its offset."""

    fits: cutlass.Boolean
    offset: Float32

    @staticmethod
    def for_cap(cap_log2: Float32) -> "FixedReference":
        """cap_log2 = softcap · log2(e), the forward's softmax_scale_log2."""
        fits = cap_log2 <= Float32((FIXED_EXP_CEIL - FIXED_EXP_FLOOR) / 2)
        offset = cute.arch.fmin(cap_log2, Float32(-FIXED_EXP_FLOOR) - cap_log2)
        return FixedReference(fits, offset)


@cute.jit
def cap_scores(acc_s: cute.Tensor, pre_tanh: Float32):
    """S ← tanh(S · pre_tanh), in place (pre_tanh = scale / softcap)."""
    s = acc_rows_cols(acc_s)
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            s[r, j] = cute.math.tanh(s[r, j] * pre_tanh, approx=True)


@cute.jit
def exp2_with_slope(acc_s: cute.Tensor, scale_log2: Float32, lse2, keys_on_n: cutlass.Constexpr,
                    ds_factor: cute.Tensor, exp2_on_fma: cutlass.Constexpr[int] = 0):
    """The backward's P = exp2(t · scale_log2 − LSE₂) in place of the capped
    scores t, and ds_factor ← P · (1 − t²), the factor of dS, in 16 bits (the
    kernel's dtype, acc_s's layout; read with wgmma.read_16bit_as_f32). Made
    in fp32 while t is at hand and rounded once (P and the slope rounded
    apart were two roundings), a column pair at a time: no fp32 copy is held.
    lse2: this thread's statistic per row (keys_on_n) or per column. A masked
    score is t = -inf (P = 0): the max makes its slope 0, not -inf, whose
    product with P would be NaN. exp2_on_fma of every 8 columns take their
    exponential on the FMA pipe (exp2_fma.py)."""
    p = acc_rows_cols(acc_s)
    for j in cutlass.range_constexpr(0, cute.size(p, mode=[1]), 2):
        for r in cutlass.range_constexpr(cute.size(p, mode=[0])):
            t = (p[r, j], p[r, j + 1])
            for i in cutlass.range_constexpr(2):
                p[r, j + i] = exp2_of_column(
                    t[i] * scale_log2 - (lse2[r] if keys_on_n else lse2[j + i]), j + i,
                    exp2_on_fma)
            write_16bit_pair(ds_factor, acc_s.layout.shape, r, j,
                             p[r, j] * _slope(t[0]), p[r, j + 1] * _slope(t[1]))


def _slope(t: Float32) -> Float32:
    return cute.arch.fmax(Float32(1.0) - t * t, Float32(0.0))
