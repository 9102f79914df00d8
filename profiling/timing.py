"""GPU timing: CUDA events around each call, median of repeats, L2 flushed
between repeats, first call (JIT compile included) timed on its own.

`time_interleaved` times several callables round-robin (each repeat runs every
one once), so clock and power drift during a run land on all of them alike and
the ratios between them stay meaningful.

Host latency: after the flush the GPU is idle, and without care the start
event fires at once and the GPU then waits for the call's host work (Python,
autograd, argument checks) before its first kernel: up to 0.7 ms per call,
measured with profiling.breakdown. By default a GPU spin (torch.cuda._sleep)
is queued between the flush and the start event, long enough for the host to
queue the whole call behind it, so the events time the GPU's work: kernels and
the gaps between them, as inside a training step whose host runs ahead.
`include_host_latency=True` times the isolated call instead.

The L2 flush (l2_flush): "write" zeroes a buffer larger than the L2, whose
dirty lines the timed call's own misses then write back, as after a layer
that wrote its outputs; "read" reads one and leaves clean lines, as after a
layer that read its weights. Large calls do not tell them apart; a small,
memory-bound one does (a batch-1 decode step: 1-3 µs, and not alike for every
backend; docs/findings.md, "Decode").
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024  # > 50 MB L2 of an H100, with margin
# GPU spin before each timed call: 4M cycles, ~2 ms at H100 clocks, more than
# the host needs to queue one attention call (forward + backward included).
HOST_AHEAD_CYCLES = 4_000_000
L2_FLUSHES = ("write", "read")


@dataclass
class Timing:
    median_ms: float
    first_call_ms: float
    repeats: int
    peak_mem_bytes: int


_flush_buffer = None
_flush_read_result = None


def _flush_l2(mode: str = "write"):
    global _flush_buffer, _flush_read_result
    if _flush_buffer is None:
        _flush_buffer = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        _flush_read_result = torch.empty((), dtype=torch.int64, device="cuda")
    if mode == "read":
        torch.amax(_flush_buffer.view(torch.int64), dim=0, out=_flush_read_result)
    else:
        _flush_buffer.zero_()


def first_call(fn) -> tuple[float, int]:
    """(milliseconds, peak bytes allocated) of one call, JIT compile included."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, torch.cuda.max_memory_allocated() - base


def time_interleaved(fns: dict, warmup: int = 3, repeats: int = 30,
                     max_seconds: float = 10.0,
                     include_host_latency: bool = False,
                     l2_flush: str = "write") -> dict[str, tuple[float, int]]:
    """(median ms, repeats) of each callable, measured round-robin, the L2
    flushed before each call as l2_flush says (one of L2_FLUSHES)."""
    if l2_flush not in L2_FLUSHES:
        raise ValueError(f"l2_flush: expected one of {', '.join(L2_FLUSHES)}, got {l2_flush!r}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    budget_start = time.perf_counter()
    for i in range(repeats):
        for name, fn in fns.items():
            _flush_l2(l2_flush)
            if not include_host_latency:
                torch.cuda._sleep(HOST_AHEAD_CYCLES)
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(begin.elapsed_time(end))
        if i >= 4 and time.perf_counter() - budget_start > max_seconds:
            break
    return {name: (statistics.median(t), len(t)) for name, t in times.items()}


def time_cuda(fn, warmup: int = 3, repeats: int = 30, max_seconds: float = 3.0) -> Timing:
    """Median time of fn() in milliseconds; fn must launch work on the current stream."""
    first_ms, peak = first_call(fn)
    median, count = time_interleaved({"fn": fn}, warmup, repeats, max_seconds)["fn"]
    return Timing(median, first_ms, count, peak)
