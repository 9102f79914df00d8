"""The host side of the forward's split tail (FwdConfig.split_tail): which
tiles are split into how many key ranges, and the workspace that takes.
Plain Python (no DSL import), for the op's per-call path; the kernel side
and the whole scheme are in tail_split.py.

plan() chooses `parts` from a cost model in units of one K/V block: a tail
of R tiles on P SMs costs UNSPLIT_TAIL_SHARE · n_blocks without the split and
ceil(R·parts / P) · (n_blocks / parts + UNIT_OVERHEAD_BLOCKS) with it. Both
constants are fitted to forced plans timed on the H100 (bf16, 16k tokens,
TFLOP/s, unsplit -> the chosen parts): d128 4k (26 blocks of 160 keys) no
split helps (720.2; 3 parts 719.3), d128 8k 743.7 -> 748.2 (3), 16k 762.0
-> 769.3 (5), d96 8k 636.5 -> 646.8 (5), d64 2k 511.9 -> 523.0 (3), d64 4k
546.2 -> 566.1 (3).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# The merge (tail_split.TailSplit) holds this many parts' LSEs in registers.
MAX_PARTS = 8
# A unit's cost beyond its blocks: its first block (no softmax overlap), the
# partial's write, fence and count, and for the last part the merge.
UNIT_OVERHEAD_BLOCKS = 4.0
# A last round on few SMs runs faster than a full one (d128 8k on the H100:
# ~79 against ~93 us, from 16 heads against 33).
UNSPLIT_TAIL_SHARE = 0.85
# counters[0] is the forward's tile counter (dynamic_tiles); the split
# counters follow it.
FIRST_COUNTER = 1


@dataclass(frozen=True)
class TailPlan:
    full_tiles: int  # tiles computed whole, first in the order
    parts: int  # key ranges per later tile; 1: no split

    @property
    def split(self) -> bool:
        return self.parts > 1

    def split_tiles(self, num_tiles: int) -> int:
        return num_tiles - self.full_tiles if self.split else 0

    def units(self, num_tiles: int) -> int:
        if not self.split:
            return num_tiles
        return self.full_tiles + self.split_tiles(num_tiles) * self.parts


NO_SPLIT = TailPlan(full_tiles=0, parts=1)


def tail_cost(tail_tiles: int, num_sms: int, n_blocks: int, parts: int) -> float:
    """The tail round's length in K/V blocks, split into `parts` (the model above)."""
    if parts == 1:
        return UNSPLIT_TAIL_SHARE * n_blocks
    rounds = -(-tail_tiles * parts // num_sms)
    return rounds * (n_blocks / parts + UNIT_OVERHEAD_BLOCKS)


@functools.lru_cache(maxsize=1024)  # the Python op path asks it at every call
def plan(num_tiles: int, num_sms: int, n_blocks: int) -> TailPlan:
    """How to cut the tail of `num_tiles` equal tiles of `n_blocks` K/V
    blocks each on a persistent grid of `num_sms` CTAs."""
    tail = num_tiles % num_sms
    if tail == 0 or n_blocks < 2:
        return NO_SPLIT
    best = min(range(1, min(MAX_PARTS, n_blocks) + 1),
               key=lambda p: (tail_cost(tail, num_sms, n_blocks, p), p))
    return NO_SPLIT if best == 1 else TailPlan(full_tiles=num_tiles - tail, parts=best)


def partial_floats(head_dim: int, threads: int = 128) -> int:
    """fp32 values one consumer thread leaves per part: its O accumulator
    (64 x head_dim over a warpgroup's 128 threads) and its two rows' LSE."""
    return 64 * head_dim // threads + 2
