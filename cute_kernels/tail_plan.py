"""What the forward's split tail (FwdConfig.split_tail, tail_split.py) fixes
on the kernel side, and the split a host hands it.

Which tiles are split into how many key ranges is the launch plan's choice
(csrc/launch_plan.cpp: a cost model over the last round of tiles); the
numbers here are those the kernel is built with, which the plan reads
(python_api/launch_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# The merge (tail_split.TailSplit) holds this many parts' LSEs in registers.
MAX_PARTS = 8
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


NO_SPLIT = TailPlan(full_tiles=0, parts=1)


def partial_floats(head_dim: int, threads: int = 128) -> int:
    """fp32 values one consumer thread leaves per part: its O accumulator
    (64 x head_dim over a warpgroup's 128 threads) and its two rows' LSE."""
    return 64 * head_dim // threads + 2
