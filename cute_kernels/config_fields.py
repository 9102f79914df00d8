"""Config fields by kernel kind ('fwd', 'bwd'), as command lines name and
parse them (profiling's --config and --vary)."""

from __future__ import annotations

import dataclasses

from .bwd_config import BwdConfig, default_bwd_config
from .config import FwdConfig, default_fwd_config

KERNEL_CONFIGS = {"fwd": FwdConfig, "bwd": BwdConfig}
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def default_config(kind: str, head_dim: int, causal: bool, head_dim_v: int | None = None):
    """The op's default FwdConfig ('fwd') or BwdConfig ('bwd') for a problem."""
    if kind not in KERNEL_CONFIGS:
        raise ValueError(f"kind: expected one of {sorted(KERNEL_CONFIGS)}, got {kind!r}")
    if kind == "fwd":
        return default_fwd_config(head_dim, causal, head_dim_v)
    return default_bwd_config(head_dim, causal, head_dim_v=head_dim_v)


def config_fields(kind: str = "fwd") -> list[str]:
    return [f.name for f in dataclasses.fields(KERNEL_CONFIGS[kind])]


def parse_field(name: str, text: str, kind: str = "fwd"):
    """A config field value from text (1/true/yes/on or 0/false/no/off for
    booleans), for command lines; ValueError names the field."""
    cls = KERNEL_CONFIGS[kind]
    if name not in config_fields(kind):
        raise ValueError(f"unknown {cls.__name__} field {name!r}; fields: {config_fields(kind)}")
    if isinstance(getattr(cls(), name), bool):
        word = text.strip().lower()
        if word in _TRUE_WORDS or word in _FALSE_WORDS:
            return word in _TRUE_WORDS
        raise ValueError(f"{cls.__name__}.{name}: expected one of "
                         f"{sorted(_TRUE_WORDS + _FALSE_WORDS)}, got {text!r}")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{cls.__name__}.{name}: expected an integer, got {text!r}") from None
