"""The forward's last, partial round of tiles split along the keys
(FwdConfig.split_tail).

Persistent CTAs take equal non-causal tiles in rounds of `num_sms`. When the
tile count is not a multiple of it, the last round runs on few SMs while the
rest idle: 2048 tiles (bf16, d=128, 16 heads, 16k tokens, any length) on 132
SMs are 15 full rounds and 68 tiles, and the problem ran 1.7-2.1 % below the
rate of 33 heads (4224 tiles, 32 full rounds) on the H100. Here those last
tiles are cut into `parts` key ranges each, so the tail's work spreads over
every SM, and the parts' results are merged by whichever finishes last:

- units: the first `full_tiles` tiles in the scheduler's order are one unit
  each; every later tile is `parts` units, one per contiguous range of its
  K/V blocks. CTAs deal units as they dealt tiles.
- a warpgroup that ends a part writes its rows' O (normalised) and LSE to the
  `partials` workspace in its own register order (the same thread of every
  part reads them back, so no layout is involved), fences, and counts itself
  in with one atomic add on the tile's per-warpgroup counter. The part that
  counts last sums every part's rows in part order (O = sum_p
  O_p·exp(lse_p - lse), lse = log sum_p exp(lse_p); the same bits whichever
  part is last) and runs the ordinary epilogue; the others skip it. A
  learnable sink (Features.sink) enters there, once per row, as one more
  term of that sum with no O.

The launch plan (csrc/launch_plan.cpp) chooses `full_tiles` and `parts` on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .dsl_struct import DslStruct
from .tail_plan import FIRST_COUNTER, MAX_PARTS
from .wgmma import acc_rows_cols

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclass
class TailSplit(DslStruct):
    """The kernel side of a TailPlan, with the call's workspace."""

    full_tiles: Int32
    parts: Int32
    counters: cute.Tensor  # Int32 (1, 1, FIRST_COUNTER + split tiles · warpgroups), zeroed
    partials: cute.Tensor  # Float32 (split tiles · parts, partial_floats, consumer threads)
    consumer_wgs: int

    def num_units(self, num_tiles: Int32) -> Int32:
        return self.full_tiles + (num_tiles - self.full_tiles) * self.parts

    @cute.jit
    def locate(self, unit: Int32):
        """unit -> (tile, part, parts of that tile), warp-uniform."""
        tile, part, parts = unit, Int32(0), Int32(1)
        if unit >= self.full_tiles:
            rest = unit - self.full_tiles
            tile = self.full_tiles + rest // self.parts
            part = rest % self.parts
            parts = self.parts
        uniform = cute.arch.make_warp_uniform
        return uniform(tile), uniform(part), uniform(parts)

    @staticmethod
    def key_range(part: Int32, parts: Int32, n_lo: Int32, n_max: Int32):
        """[lo, hi) of the K/V blocks of one part of the tile's [n_lo, n_max),
        warp-uniform; all of them for a tile in one part."""
        uniform = cute.arch.make_warp_uniform
        # no block (n_max <= n_lo) leaves every part empty: the division is
        # monotone, so hi <= lo
        n_blocks = n_max - n_lo
        return (uniform(n_lo + part * n_blocks // parts),
                uniform(n_lo + (part + 1) * n_blocks // parts))

    @cute.jit
    def merge(self, acc_o: cute.Tensor, lse: cute.Tensor, unit: Int32, wg: Int32, tid: Int32,
              barrier_id: Int32, arrived: cute.Tensor, sink: Float32) -> cutlass.Boolean:
        """One warpgroup's end of a part: publish its O and LSE rows, count in,
        and if it is the tile's last part, merge every part into acc_o and lse
        (in place). Returns whether this warpgroup then writes the tile.

        tid: the thread's index among the consumer threads; barrier_id: a
        named barrier of this warpgroup's 128 threads; arrived: one Int32 per
        warpgroup in shared memory; sink: the row's learnable sink (natural
        log units; -inf: none), which the parts left out."""
        o = acc_rows_cols(acc_o)
        rows, cols = cute.size(o, mode=[0]), cute.size(o, mode=[1])
        rest = unit - self.full_tiles
        split_tile = rest // self.parts
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                self.partials[rest, r * cols + c, tid] = o[r, c]
            self.partials[rest, rows * cols + r, tid] = lse[r]
        # Release: every thread's rows are visible at GPU scope before the
        # count that tells the last part to read them.
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
        if tid % 128 == 0:
            counter = self.counters.iterator + (FIRST_COUNTER + split_tile * self.consumer_wgs
                                                + wg)
            arrived[wg] = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
        is_last = arrived[wg] == self.parts - 1
        if is_last:
            # Acquire: the other parts' rows, counted in before our count.
            cute.arch.fence_acq_rel_gpu()
            self._sum_parts(o, lse, split_tile * self.parts, tid, sink)
        return is_last

    @cute.jit
    def _sum_parts(self, o: cute.Tensor, lse: cute.Tensor, first: Int32, tid: Int32,
                   sink: Float32):
        """o, lse <- the merge of the tile's parts (units first, first + 1, ...),
        all read back from the workspace in part order, this one's too: the
        sum does not depend on which part came last, so the output is the same
        call after call.

        The parts' LSEs are loaded in one batch (slots past `parts` read the
        last part again and weigh 0), then O two parts at a time: with a loop
        over `parts` each load waited for the previous part's sums, one L2
        round trip per part."""
        rows, cols = cute.size(o, mode=[0]), cute.size(o, mode=[1])
        last = self.parts - 1
        part_lse = cute.make_rmem_tensor((MAX_PARTS, rows), Float32)
        for p in cutlass.range_constexpr(MAX_PARTS):
            unit = first + cutlass.min(Int32(p), last)
            for r in cutlass.range_constexpr(rows):
                part_lse[p, r] = self.partials[unit, rows * cols + r, tid]
        top = cute.make_rmem_tensor(rows, Float32)
        total = cute.make_rmem_tensor(rows, Float32)
        weight = cute.make_rmem_tensor((MAX_PARTS, rows), Float32)
        for r in cutlass.range_constexpr(rows):
            top[r] = part_lse[0, r]
            for p in cutlass.range_constexpr(1, MAX_PARTS):
                top[r] = cute.arch.fmax(top[r], part_lse[p, r])
            top[r] = cute.arch.fmax(top[r], sink)
            # Rows every part found empty keep -inf: weigh against 0, not -inf.
            if top[r] == -Float32.inf:
                top[r] = Float32(0.0)
            total[r] = cute.math.exp2((sink - top[r]) * LOG2_E, fastmath=True)
            for p in cutlass.range_constexpr(MAX_PARTS):
                w = cute.math.exp2((part_lse[p, r] - top[r]) * LOG2_E, fastmath=True)
                if p > last:
                    w = Float32(0.0)
                weight[p, r] = w
                total[r] = total[r] + w
        o.fill(0.0)
        for pair in cutlass.range_constexpr(0, MAX_PARTS, 2):
            if pair <= last:
                second = first + cutlass.min(Int32(pair + 1), last)
                for r in cutlass.range_constexpr(rows):
                    for c in cutlass.range_constexpr(cols):
                        a = self.partials[first + pair, r * cols + c, tid]
                        b = self.partials[second, r * cols + c, tid]
                        o[r, c] = o[r, c] + weight[pair, r] * a + weight[pair + 1, r] * b
        for r in cutlass.range_constexpr(rows):
            inv = Float32(0.0)
            lse[r] = -Float32.inf
            if total[r] > Float32(0.0):
                inv = cute.arch.rcp_approx(total[r])
                lse[r] = top[r] + cute.math.log2(total[r], fastmath=True) * LN2
            o[r, None].store(o[r, None].load() * inv)
