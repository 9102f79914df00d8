"""Online softmax over the rows a thread holds of a 64xN WGMMA accumulator.

Scores stay unscaled; the softmax scale and log2(e) are folded into one
constant so each probability is one FFMA and one ex2:
    p = exp2(s * scale_log2 - m * scale_log2)
A row is shared by the 4 threads of a quad: the running max is reduced with
two butterfly shuffles per update; the running sum stays a per-thread partial
until `finalize`, which reduces it once.
Rows with no visible key keep m = -inf and l = 0: they produce O = 0 and
LSE = -inf (the log of an empty sum), never NaN.

Lazy rescaling (rescale_threshold > 0): m is the reference the exponentials
are taken against, and any reference works as long as O, l and the LSE use
the same one. A warp moves its rows' references up to the new maxima only
when some row's maximum grew by more than 2^rescale_threshold (log2 units of
the scaled scores); otherwise P stays below 2^rescale_threshold, the rescale
factors are exactly 1 and the O rescale (head_dim / 2 FMULs per row a
thread holds) is skipped. After the first few blocks the maxima rarely
move, so most steps skip it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .dsl_struct import DslStruct
from .wgmma import acc_rows_cols

LN2 = math.log(2.0)


@dataclass
class OnlineSoftmax(DslStruct):
    scale_log2: Float32
    rows: int
    rescale_threshold: int  # log2 units; 0: move the reference at every increase
    row_max: cute.Tensor
    row_sum: cute.Tensor

    @staticmethod
    def create(scale_log2: Float32, rows: int, rescale_threshold: int = 0) -> "OnlineSoftmax":
        return OnlineSoftmax(scale_log2, rows, rescale_threshold,
                             cute.make_rmem_tensor(rows, Float32),
                             cute.make_rmem_tensor(rows, Float32))

    @cute.jit
    def update(self, acc_s: cute.Tensor, is_first: cutlass.Constexpr[bool]):
        """Turn scores into probabilities in place. Returns (rescale, moved):
        each row's O rescale factor, and whether any factor may differ from 1
        (Python True unless rescaling is lazy, else a warp-uniform Boolean)."""
        s = acc_rows_cols(acc_s)
        rescale = cute.make_rmem_tensor(self.rows, Float32)
        lazy = cutlass.const_expr(self.rescale_threshold > 0 and not is_first)
        new_max = cute.make_rmem_tensor(self.rows, Float32)
        grows = cutlass.Boolean(False)
        for r in cutlass.range_constexpr(self.rows):
            local_max = s[r, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
            if cutlass.const_expr(not is_first):
                local_max = cute.arch.fmax(local_max, self.row_max[r])
            new_max[r] = cute.arch.warp_reduction_max(local_max, threads_in_group=4)
            if cutlass.const_expr(lazy):
                # -inf -> finite gives +inf (moves); -inf -> -inf gives NaN (stays).
                growth = (new_max[r] - self.row_max[r]) * self.scale_log2
                grows = grows | (growth > Float32(self.rescale_threshold))
            else:
                self._exponentiate_row(s, r, new_max[r], rescale, is_first)
        moved = True
        if cutlass.const_expr(lazy):
            moved = cute.arch.vote_any_sync(grows)
            for r in cutlass.range_constexpr(self.rows):
                ref_max = new_max[r] if moved else self.row_max[r]
                self._exponentiate_row(s, r, ref_max, rescale, is_first)
        return rescale, moved

    @cute.jit
    def _exponentiate_row(self, s: cute.Tensor, r: cutlass.Constexpr[int], ref_max: Float32,
                          rescale: cute.Tensor, is_first: cutlass.Constexpr[bool]):
        """P = exp2((S - ref_max) · scale) for row r; the row's sum and O
        rescale factor move to the reference ref_max."""
        # A row fully masked so far keeps -inf; subtracting 0 instead keeps
        # exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
        safe_max = ref_max if ref_max != -Float32.inf else Float32(0.0)
        neg_max_scaled = -safe_max * self.scale_log2
        row = s[r, None].load()
        probs = cute.math.exp2(row * self.scale_log2 + neg_max_scaled, fastmath=True)
        s[r, None].store(probs)
        row_sum = probs.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        if cutlass.const_expr(is_first):
            rescale[r] = Float32(1.0)
            self.row_sum[r] = row_sum
        else:
            factor = cute.math.exp2(self.row_max[r] * self.scale_log2 + neg_max_scaled,
                                    fastmath=True)
            rescale[r] = factor
            self.row_sum[r] = self.row_sum[r] * factor + row_sum
        self.row_max[r] = ref_max

    @cute.jit
    def rescale_o(self, acc_o: cute.Tensor, rescale: cute.Tensor):
        o = acc_rows_cols(acc_o)
        for r in cutlass.range_constexpr(self.rows):
            o[r, None].store(o[r, None].load() * rescale[r])

    @cute.jit
    def finalize(self, acc_o: cute.Tensor) -> cute.Tensor:
        """Normalise O by the row sums; return the natural-log LSE of each row."""
        lse = cute.make_rmem_tensor(self.rows, Float32)
        inv = cute.make_rmem_tensor(self.rows, Float32)
        for r in cutlass.range_constexpr(self.rows):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            if total == Float32(0.0):
                inv[r] = Float32(0.0)
                lse[r] = -Float32.inf
            else:
                inv[r] = cute.arch.rcp_approx(total)
                lse[r] = (self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True)) * LN2
        self.rescale_o(acc_o, inv)
        return lse
