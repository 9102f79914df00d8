"""GPU timing: CUDA events around each call, median of repeats, L2 flushed
between repeats, first call (JIT compile included) timed on its own."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024  # > 50 MB L2 of an H100, with margin


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    first_call_ms: float
    repeats: int
    peak_mem_bytes: int


_flush_buffer = None


def _flush_l2():
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    _flush_buffer.zero_()


def time_cuda(fn, warmup: int = 3, repeats: int = 30, max_seconds: float = 3.0) -> Timing:
    """Median time of fn() in milliseconds; fn must launch work on the current stream."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    peak = torch.cuda.max_memory_allocated() - base
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    budget_start = time.perf_counter()
    for i in range(repeats):
        _flush_l2()
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
        if i >= 4 and time.perf_counter() - budget_start > max_seconds:
            break
    return Timing(statistics.median(times), min(times), first_ms, len(times), peak)
