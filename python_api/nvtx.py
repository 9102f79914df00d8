"""NVTX ranges around every op call, so Nsight Compute can select exactly them.

Range names are `cute_fa.<op>` followed by the problem in brackets, e.g.
    cute_fa.fwd[b=2,sq=4096,sk=4096,hq=16,hkv=16,d=128,causal=1,bf16]
Select every forward kernel with
    ncu --nvtx --nvtx-include "regex:cute_fa\\.fwd.*/" python ...
"""

from __future__ import annotations

import contextlib

import nvtx as _nvtx

_SHORT_DTYPE = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}


def range_name(op: str, q, k, causal: bool) -> str:
    b, sq, hq, d = q.shape
    return (f"cute_fa.{op}[b={b},sq={sq},sk={k.shape[1]},hq={hq},hkv={k.shape[2]},d={d},"
            f"causal={int(causal)},{_SHORT_DTYPE.get(str(q.dtype), str(q.dtype))}]")


@contextlib.contextmanager
def op_range(name: str):
    # The default domain keeps the range name selectable as `name/` in ncu.
    _nvtx.push_range(name)
    try:
        yield
    finally:
        _nvtx.pop_range()
