"""What a call does to its scores beyond q·kᵀ·scale: a causal mask, a sliding
window, a soft cap, learnable sinks; checked once, and resolved into the
kernel variant that serves it.

Conventions (FlashAttention's): window_size = (left, right) in keys around
each query's diagonal, bottom-right aligned like causal: query i sees key j iff
    i + s_k - s_q - left <= j <= i + s_k - s_q + right,
-1 meaning unbounded on that side; causal=True is right = 0 (and with a
window, the window's left side). softcap > 0 replaces each score s·scale by
softcap · tanh(s·scale / softcap); 0 turns it off. learnable_sink (nheads,)
(gpt-oss): one more softmax column per query head, of that logit in the
units of the scaled scores and with no value, so every row's weights sum to
less than 1: out = Σ_j exp(s_j − lse)·v_j with lse = log(Σ_j exp(s_j) +
exp(sink)). A row with no visible key gets out = 0 and lse = sink.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from .kernels.config import Features
from .validate import check_tensor_types

NO_WINDOW = (-1, -1)


def check_score_args(window_left, window_right, softcap) -> None:
    """A clear error for a window side or softcap the ops cannot take."""
    for name, value in (("window_left", window_left), ("window_right", window_right)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int (-1: unbounded), got "
                            f"{type(value).__name__}")
        if value < -1:
            raise ValueError(f"{name}: expected -1 (unbounded) or a size >= 0, got {value}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: expected a float, got {type(softcap).__name__}")
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        raise ValueError(f"softcap: expected a finite value >= 0 (0: no cap), got {softcap}")


SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_sink_type(learnable_sink) -> None:
    """The check the torch dispatcher would otherwise answer with its own message."""
    check_tensor_types(("learnable_sink",), learnable_sink, optional=True)


def check_sink(learnable_sink, nheads: int, device: torch.device) -> None:
    """A clear error for learnable sinks the ops cannot take (None: none)."""
    check_sink_type(learnable_sink)
    if learnable_sink is None:
        return
    if learnable_sink.shape != (nheads,) or learnable_sink.dtype not in SINK_DTYPES \
            or learnable_sink.device != device:
        raise ValueError(f"learnable_sink: expected shape ({nheads},) (one per query head), "
                         f"dtype float32, bfloat16 or float16, on {device} (that of q), got "
                         f"shape {tuple(learnable_sink.shape)}, dtype {learnable_sink.dtype} "
                         f"on {learnable_sink.device}")


def window_from_size(window_size) -> tuple[int, int]:
    """flash_attn_func's window_size (a pair) as (left, right), checked."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size: expected a pair (left, right), got {window_size!r}")
    left, right = window_size
    for name, value in (("window_size[0]", left), ("window_size[1]", right)):
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ValueError(f"{name}: expected -1 (unbounded) or an int >= 0, got {value!r}")
    return int(left), int(right)


@dataclass(frozen=True)
class ScoreVariant:
    """The kernel variant of a call: its causal flag and features (the
    compile-time part), the window it hands the kernels and the cap."""

    causal: bool
    features: Features
    window: tuple[int, int]  # (left, right), -1 unbounded; read by local kernels
    softcap: float

    @property
    def plain(self) -> bool:
        """Neither a window nor a cap nor sinks (full or causal attention)."""
        return not (self.features.local or self.features.softcap or self.features.sink)


PLAIN = {(causal, varlen): ScoreVariant(causal, Features(varlen=varlen), NO_WINDOW, 0.0)
         for causal in (False, True) for varlen in (False, True)}


@functools.lru_cache(maxsize=256)  # a few per model, asked on every call
def _with_flags(variant: ScoreVariant, sink: bool, block_sparse: bool) -> ScoreVariant:
    return replace(variant, features=replace(variant.features, sink=sink,
                                             block_sparse=block_sparse))


def resolve(causal: bool, window_left: int, window_right: int, softcap: float,
            seqlen_q: int, seqlen_k: int, varlen: bool = False,
            sink: bool = False, block_sparse: bool = False) -> ScoreVariant:
    """The variant that serves a call: a side of the window that reaches every
    key is unbounded; a window whose left side is unbounded and whose right
    side is 0 is causal; what remains of a window is a local kernel (causal
    folded into its right side). A packed batch (varlen) passes its longest
    sequences as seqlen_q and seqlen_k; `sink`: the call has learnable sinks;
    `block_sparse`: a block mask (block_sparse_ops.py) holds its limits."""
    if sink or block_sparse:
        return _with_flags(resolve(causal, window_left, window_right, softcap, seqlen_q,
                                   seqlen_k, varlen), sink, block_sparse)
    if window_left == -1 and window_right == -1 and not softcap:
        return PLAIN[bool(causal), bool(varlen)]
    right = 0 if causal else window_right
    # query 0 sees the last key with right >= s_q - 1, the last query the
    # first key with left >= s_k - 1
    left = -1 if window_left < 0 or window_left >= seqlen_k - 1 else window_left
    right = -1 if right < 0 or right >= seqlen_q - 1 else right
    features = Features(softcap=softcap > 0, varlen=bool(varlen))
    if left == -1 and right in (-1, 0):
        return ScoreVariant(right == 0, features, NO_WINDOW, float(softcap))
    return ScoreVariant(False, Features(local=True, softcap=softcap > 0, varlen=bool(varlen)),
                        (left, right), float(softcap))
