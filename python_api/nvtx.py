"""NVTX ranges around every op call, so Nsight Compute can select exactly them.

Range names are `cute_fa.<op>` followed by the problem in brackets, e.g.
    cute_fa.fwd[b=2,sq=4096,sk=4096,hq=16,hkv=16,d=128,causal=1,bf16]
(with `dv=` after `d=` where v's head dim differs from q's, and `window=l:r`,
`softcap=c`, `sink` before the dtype where the call has them); a packed batch's, e.g.
    cute_fa.varlen_fwd[b=12,total_q=16384,total_k=16384,max_sq=8000,max_sk=8000,...]
Select every forward kernel with
    ncu --nvtx --nvtx-include "regex:cute_fa\\.fwd.*/" python ...
"""

from __future__ import annotations

import contextlib

import nvtx as _nvtx

_SHORT_DTYPE = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float8_e4m3fn": "e4m3"}
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
        name = (f"cute_fa.{op}[b={b},sq={sq},sk={v.shape[1]},hq={hq},hkv={v.shape[2]},d={d},"
                f"{dv}causal={int(causal)},{_score_mods(scores)}"
                f"{_SHORT_DTYPE.get(str(q.dtype), str(q.dtype))}]")
        if len(_names) < _MAX_NAMES:  # bounded: varying sequence lengths would grow it forever
            _names[key] = name
    return name


def _score_mods(scores) -> str:
    mods = ""
    if scores is not None and scores.features.local:
        mods += f"window={scores.window[0]}:{scores.window[1]},"
    if scores is not None and scores.features.softcap:
        mods += f"softcap={scores.softcap:g},"
    if scores is not None and scores.features.sink:
        mods += "sink,"
    return mods


def varlen_range_name(op: str, q, v, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                      causal: bool, scores) -> str:
    """A packed batch's range: q, v packed (total, heads, d); its sequence
    count and longest sequences. Not cached: totals vary from call to call."""
    total_q, hq, d = q.shape
    dv = "" if v.shape[2] == d else f"dv={v.shape[2]},"
    return (f"cute_fa.{op}[b={batch},total_q={total_q},total_k={v.shape[0]},"
            f"max_sq={max_seqlen_q},max_sk={max_seqlen_k},hq={hq},hkv={v.shape[1]},d={d},{dv}"
            f"causal={int(causal)},{_score_mods(scores)}"
            f"{_SHORT_DTYPE.get(str(q.dtype), str(q.dtype))}]")


def kvcache_range_name(q, k_cache, page_table, causal: bool) -> str:
    """A KV-cache call's range: q (batch, seqlen_q, heads, d), the cache's
    length (tokens, or per page), its pages per sequence (0: contiguous).
    Cached: a decoder asks for the same few at every step."""
    pages = 0 if page_table is None else page_table.shape[1]
    key = ("fwd_kvcache", q.shape, k_cache.shape, pages, causal, q.dtype)
    name = _names.get(key)
    if name is None:
        b, sq, hq, d = q.shape
        name = (f"cute_fa.fwd_kvcache[b={b},sq={sq},cache={k_cache.shape[1]},pages={pages},"
                f"hq={hq},hkv={k_cache.shape[2]},d={d},causal={int(causal)},"
                f"{_SHORT_DTYPE.get(str(q.dtype), str(q.dtype))}]")
        if len(_names) < _MAX_NAMES:
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
