"""Online softmax over the rows a thread holds of a 64xN WGMMA accumulator.

Scores stay unscaled; the softmax scale and log2(e) are folded into one
constant so each probability is one FFMA and one ex2:
    p = exp2(s * scale_log2 - m * scale_log2)
A row is shared by the 4 threads of a quad: the running max is reduced with
two butterfly shuffles per update; the running sum stays a per-thread partial
until `finalize`, which reduces it once.

With skip_unmoved, a row whose maximum did not rise on a step has the O
rescale factor 1.0 exactly, and a warp whose rows all kept theirs skips O's
rescale (`rescale_o_where_moved`): dv / 2 multiplies a thread at 64 rows,
an issue slot each, on the path of a softmax-bound step. The plain rescale
multiplies those rows by exp2's approximation of 2^0 (an ulp or so from
1.0), which is all that differs.

Rows with no visible key keep m = -inf and l = 0: they produce O = 0 and
LSE = -inf (the log of an empty sum), never NaN.

A learnable sink (Features.sink, gpt-oss) is one more column of the row,
of logit `sink` in the units of the scaled scores, with no value vector:
finalize_with_sink adds exp(sink) to the normaliser against the larger of
the row's maximum and the sink (a sink far above every score cannot
overflow), so O shrinks by the sink's share and LSE = log(Σ exp(s) + exp(sink)).
A row with no visible key then gets O = 0 and LSE = sink.

Scores with a known bound (soft-capped ones, softcap.py) may skip the
running maximum: with a fixed reference the exponent of every score lies in
a range that fp32 and bf16 hold, so no row maximum is reduced and O is never
rescaled (`fixed_reference`); the row sum alone carries the normaliser.
Such a softmax may take k of every 8 of a row's exponentials as a
polynomial on the FMA pipe (exp2_fma.py): without the maximum's reductions
and O's rescale its issue slots have room for them, which free the MUFU
unit, loaded twice over by a cap's tanh.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .dsl_struct import DslStruct
from .exp2_fma import exp2_row
from .wgmma import acc_rows_cols

LN2 = math.log(2.0)


@dataclass
class OnlineSoftmax(DslStruct):
    """scale_log2: the kernel's scale, or with per_tile_scale a register
    the caller sets for each tile (set_tile_scale: e4m3 descales).
    fixed_offset: None, or (fixed_reference) the exponent offset, log2 units,
    that every row uses in place of its running maximum.
    exp2_on_fma: (fixed_reference) of every 8 exponentials of a row, how
    many exp2_fma makes."""

    scale_log2: Float32
    rows: int
    row_max: cute.Tensor
    row_sum: cute.Tensor
    tile_scale: cute.Tensor | None = None
    fixed_offset: Float32 | None = None
    skip_unmoved: bool = False
    exp2_on_fma: int = 0

    @staticmethod
    def create(scale_log2: Float32, rows: int, per_tile_scale: bool = False,
               skip_unmoved: bool = False) -> "OnlineSoftmax":
        tile_scale = cute.make_rmem_tensor(1, Float32) if per_tile_scale else None
        return OnlineSoftmax(scale_log2, rows, cute.make_rmem_tensor(rows, Float32),
                             cute.make_rmem_tensor(rows, Float32), tile_scale,
                             skip_unmoved=skip_unmoved)

    def set_tile_scale(self, scale_log2: Float32):
        self.tile_scale[0] = scale_log2

    def fixed_reference(self, offset: Float32, exp2_on_fma: int = 0) -> "OnlineSoftmax":
        """This softmax, on the same row state, with p = exp2(s · scale -
        offset) for every score and no running maximum: for scores whose
        exponents stay within fp32's and the P dtype's normal range whatever
        the row (the caller's proof). Each row's reference is set to the
        offset here, once per tile, so that finalize's LSE is the same
        expression; a row with no visible key still ends with a zero sum.
        exp2_on_fma of every 8 exponentials are polynomials (exp2_fma.py)."""
        self.row_max.fill(offset / self.scale)
        return dataclasses.replace(self, fixed_offset=offset, exp2_on_fma=exp2_on_fma)

    @property
    def rescales(self) -> bool:
        """Whether update returns O rescale factors (a running maximum)."""
        return self.fixed_offset is None

    @property
    def scale(self) -> Float32:
        """The scale of the scores (log2 units) that this tile uses."""
        return self.scale_log2 if self.tile_scale is None else self.tile_scale[0]

    @cute.jit
    def update(self, acc_s: cute.Tensor,
               is_first: cutlass.Constexpr[bool]) -> cute.Tensor | None:
        """Turn scores into probabilities in place; return each row's O
        rescale factor (the old maximum's weight against the new one; with
        skip_unmoved exactly 1.0 where it did not rise); with a fixed
        reference, None: O keeps its scale."""
        s = acc_rows_cols(acc_s)
        rescale = None
        if cutlass.const_expr(self.rescales):
            rescale = cute.make_rmem_tensor(self.rows, Float32)
            new_max = cute.make_rmem_tensor(self.rows, Float32)
            for r in cutlass.range_constexpr(self.rows):
                local_max = s[r, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
                if cutlass.const_expr(not is_first):
                    local_max = cute.arch.fmax(local_max, self.row_max[r])
                new_max[r] = cute.arch.warp_reduction_max(local_max, threads_in_group=4)
                self._exponentiate_row(s, r, new_max[r], rescale, is_first)
        else:
            neg_offset = -self.fixed_offset
            for r in cutlass.range_constexpr(self.rows):
                probs = self._exp2(s, r, s[r, None].load() * self.scale + neg_offset)
                self.row_sum[r] = self.row_sum[r] + probs.reduce(cute.ReductionOp.ADD,
                                                                 Float32(0.0), 0)
        return rescale

    @cute.jit
    def _exponentiate_row(self, s: cute.Tensor, r: cutlass.Constexpr[int], ref_max: Float32,
                          rescale: cute.Tensor, is_first: cutlass.Constexpr[bool]):
        """P = exp2((S - ref_max) · scale) for row r; the row's sum and O
        rescale factor move to the reference ref_max."""
        # A row fully masked so far keeps -inf; subtracting 0 instead keeps
        # exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
        safe_max = ref_max if ref_max != -Float32.inf else Float32(0.0)
        neg_max_scaled = -safe_max * self.scale
        probs = self._exp2(s, r, s[r, None].load() * self.scale + neg_max_scaled)
        row_sum = probs.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        if cutlass.const_expr(is_first):
            rescale[r] = Float32(1.0)
            self.row_sum[r] = row_sum
        else:
            factor = cute.math.exp2(self.row_max[r] * self.scale + neg_max_scaled,
                                    fastmath=True)
            if cutlass.const_expr(self.skip_unmoved):
                # exp2's approximation of exp2(0) need not be 1.0 exactly
                factor = Float32(cutlass.select_(ref_max == self.row_max[r], Float32(1.0),
                                                 factor))
            rescale[r] = factor
            self.row_sum[r] = self.row_sum[r] * factor + row_sum
        self.row_max[r] = ref_max

    @cute.jit
    def _exp2(self, s: cute.Tensor, r: cutlass.Constexpr[int], exponents):
        """Row r of s ← 2^exponents; returns the row."""
        if cutlass.const_expr(self.exp2_on_fma == 0):
            s[r, None].store(cute.math.exp2(exponents, fastmath=True))
        else:
            s[r, None].store(exponents)
            exp2_row(s[r, None], self.exp2_on_fma)
        return s[r, None].load()

    @cute.jit
    def rescale_o(self, acc_o: cute.Tensor, rescale: cute.Tensor):
        o = acc_rows_cols(acc_o)
        for r in cutlass.range_constexpr(self.rows):
            o[r, None].store(o[r, None].load() * rescale[r])

    @cute.jit
    def rescale_o_where_moved(self, acc_o: cute.Tensor, rescale: cute.Tensor):
        """With skip_unmoved, rescale_o skipped by a warp none of whose rows
        moved its reference (every factor 1.0: the multiplies would change
        nothing); otherwise rescale_o, which ptxas may interleave with the
        exponentials."""
        if cutlass.const_expr(not self.skip_unmoved):
            self.rescale_o(acc_o, rescale)
        else:
            moved = cutlass.Boolean(False)
            for r in cutlass.range_constexpr(self.rows):
                moved = moved | (rescale[r] != Float32(1.0))
            if cute.arch.vote_any_sync(moved):
                self.rescale_o(acc_o, rescale)

    @cute.jit
    def finalize(self, acc_o: cute.Tensor, o_factor: Float32 | None = None) -> cute.Tensor:
        """Normalise O by the row sums; return the natural-log LSE of each row.
        o_factor (an e4m3 V's descale) joins the normaliser's multiply."""
        lse = cute.make_rmem_tensor(self.rows, Float32)
        inv = cute.make_rmem_tensor(self.rows, Float32)
        for r in cutlass.range_constexpr(self.rows):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            if total == Float32(0.0):
                inv[r] = Float32(0.0)
                lse[r] = -Float32.inf
            else:
                inv[r] = cute.arch.rcp_approx(total)
                if cutlass.const_expr(o_factor is not None):
                    inv[r] = inv[r] * o_factor
                lse[r] = (self.row_max[r] * self.scale + cute.math.log2(total, fastmath=True)) * LN2
        self.rescale_o(acc_o, inv)
        return lse

    @cute.jit
    def finalize_with_sink(self, acc_o: cute.Tensor, sink_log2: Float32,
                           o_factor: Float32 | None = None) -> cute.Tensor:
        """finalize, with the sink column of logit sink_log2 (log2 units, the
        scale applied; -inf: none, as for a part of a split tile, whose
        merge adds it)."""
        lse = cute.make_rmem_tensor(self.rows, Float32)
        inv = cute.make_rmem_tensor(self.rows, Float32)
        for r in cutlass.range_constexpr(self.rows):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            row_top = self.row_max[r] * self.scale  # -inf for a row with no key
            top = cute.arch.fmax(row_top, sink_log2)
            if top == -Float32.inf:
                inv[r] = Float32(0.0)
                lse[r] = -Float32.inf
            else:
                # the row's sum moves from its maximum to `top`
                weight = cute.math.exp2(row_top - top, fastmath=True)
                normaliser = total * weight + cute.math.exp2(sink_log2 - top, fastmath=True)
                inv[r] = weight * cute.arch.rcp_approx(normaliser)
                if cutlass.const_expr(o_factor is not None):
                    inv[r] = inv[r] * o_factor
                lse[r] = (top + cute.math.log2(normaliser, fastmath=True)) * LN2
        self.rescale_o(acc_o, inv)
        return lse
