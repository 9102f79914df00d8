"""NVTX ranges around every op call, so Nsight Compute can select exactly them.

Range names are `cute_fa.<op>` followed by the problem in brackets, e.g.
    cute_fa.fwd[b=2,sq=4096,sk=4096,hq=16,hkv=16,d=128,causal=1,bf16]
(with `dv=` after `d=` where v's head dim differs from q's, and `window=l:r`,
`softcap=c` before the dtype where the call has them).
Select every forward kernel with
    ncu --nvtx --nvtx-include "regex:cute_fa\\.fwd.*/" python ...
"""

from __future__ import annotations

import contextlib

import nvtx as _nvtx

_SHORT_DTYPE = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}
# A model repeats a handful of problems: the names are built once each, since
# formatting one costs more host time than the push and pop together.
_names: dict[tuple, str] = {}
_MAX_NAMES = 4096

push = _nvtx.push_range  # the default domain keeps the name selectable as `name/` in ncu
pop = _nvtx.pop_range


def range_name(op: str, q, v, causal: bool, scores=None) -> str:
    """`scores`: the call's scores.ScoreVariant (None or plain: no window, no cap)."""
    if scores is not None and scores.plain:
        scores = None  # plain calls share their names and keys with callers that pass none
    key = (op, q.shape, v.shape, causal, q.dtype, scores)
    name = _names.get(key)
    if name is None:
        b, sq, hq, d = q.shape
        dv = "" if v.shape[3] == d else f"dv={v.shape[3]},"
        mods = ""
        if scores is not None and scores.mods.local:
            mods += f"window={scores.window[0]}:{scores.window[1]},"
        if scores is not None and scores.mods.softcap:
            mods += f"softcap={scores.softcap:g},"
        name = (f"cute_fa.{op}[b={b},sq={sq},sk={v.shape[1]},hq={hq},hkv={v.shape[2]},d={d},"
                f"{dv}causal={int(causal)},{mods}"
                f"{_SHORT_DTYPE.get(str(q.dtype), str(q.dtype))}]")
        if len(_names) < _MAX_NAMES:  # bounded: varying sequence lengths would grow it forever
            _names[key] = name
    return name


@contextlib.contextmanager
def op_range(name: str):
    """The range as a context manager, for paths whose host time does not matter."""
    push(name)
    try:
        yield
    finally:
        pop()
