"""What every profiling command shares on its command line and terminal.

- command_parser: the parser of `python -m cute_fa.profiling.<command>`;
- argument types that turn a bad value into an argparse error (exit code 2,
  a message naming the option, what it accepts and what came): positive
  integers, comma-separated lists of choices, torch devices;
- kernel config assignments (`FIELD=VALUE`), checked against the config
  dataclasses' own fields (cute_fa.kernels.config), so no field is named here;
- messages for what is missing on this machine (a GPU, an optional package);
- Progress / progress: a tqdm bar where tqdm is installed, plain lines else.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

PACKAGE = "cute_fa.profiling"
NEEDS_GPU = "needs an sm_90 CUDA GPU (H100/H200)"
# The optional extras of pyproject.toml, as a user installs them.
INSTALL_PEERS = 'pip install "cute-fa[peers]"'   # flash-attn-4, the peer of the benchmarks
INSTALL_BENCH = 'pip install "cute-fa[bench]"'   # matplotlib, tqdm, pyarrow


def command_parser(command: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of `python -m cute_fa.profiling.<command>`, described by its docstring."""
    return argparse.ArgumentParser(prog=f"python -m {PACKAGE}.{command}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


# ------------------------------------------------------------- argument types

def _names(choices) -> str:
    return ", ".join(str(c) for c in choices)


def int_at_least(minimum: int, what: str | None = None):
    """An argparse type: an integer >= minimum."""
    what = what or ("a positive integer" if minimum == 1 else f"an integer >= {minimum}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def one_of(choices):
    """An argparse type: one of `choices` (ints or strings), matched as text,
    with argparse's own wording for a bad choice."""
    by_text = {str(c): c for c in choices}

    def parse(text: str):
        if text not in by_text:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {_names(choices)})")
        return by_text[text]

    parse.__name__ = "choice"
    return parse


def csv_list(item):
    """An argparse type: 'a,b,c' -> [item('a'), item('b'), item('c')]; item
    is an argparse type (one_of, positive_int, ...), whose error names the
    bad item. Empty items are dropped; an empty list is an error."""

    def parse(text: str) -> list:
        values = [item(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return values

    parse.__name__ = "list"
    return parse


def choice_list(choices):
    """An argparse type: a comma-separated list of items of `choices`."""
    return csv_list(one_of(choices))


def brace(choices) -> str:
    """A metavar listing the choices, as argparse writes them: {a,b,c}."""
    return "{" + ",".join(str(c) for c in choices) + "}"


def device(text: str) -> str:
    """An argparse type: a torch device that exists here (kept as its text)."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected a torch device such as cpu, cuda or cuda:0, got {text!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"no CUDA device is visible here, got {text!r}")
    return text


def add_device_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=device, default=None,
                   help="torch device to run on, e.g. cpu, cuda, cuda:1 "
                        "(default: cuda when a CUDA device is visible, else cpu)")


# --------------------------------------------------- kernel config assignments

KERNELS = ("fwd", "bwd")
_BOOL_TEXT = ("0", "1", "false", "true", "no", "yes")


def add_kernel_option(p: argparse.ArgumentParser, default: str | None = "fwd",
                      help_default: str | None = None) -> None:
    p.add_argument("--kernel", choices=KERNELS, default=default,
                   help="which kernel: fwd (the forward) or bwd (the backward; its "
                        f"config is a BwdConfig) (default: {help_default or default})")


def _assignment(item: str, kind: str, several: bool) -> tuple[str, list]:
    """'field=v' (or 'field=v1,v2' when several) -> (field, [values]);
    ValueError naming the item, the valid fields or the valid values."""
    from cute_fa.kernels.config_fields import KERNEL_CONFIGS, config_fields, parse_field

    name, eq, text = item.partition("=")
    form = "FIELD=V1,V2,..." if several else "FIELD=VALUE, one value per field"
    if not eq or not name or not text:
        raise ValueError(f"expected {form}, got {item!r}")
    fields = config_fields(kind)
    if name not in fields:
        raise ValueError(f"unknown {KERNEL_CONFIGS[kind].__name__} field {name!r} "
                         f"(fields: {', '.join(fields)})")
    values = []
    for part in (text.split(",") if several else [text]):
        value = parse_field(name, part, kind)
        if isinstance(value, bool) and part.lower() not in _BOOL_TEXT:
            raise ValueError(f"{KERNEL_CONFIGS[kind].__name__}.{name}: expected one of "
                             f"{', '.join(_BOOL_TEXT)}, got {part!r}")
        values.append(value)
    return name, values


def config_vary(items: list[str], kind: str = "fwd") -> dict[str, list]:
    """['field=v1,v2', ...] -> {field: [values]}; ValueError for a bad item."""
    out = {}
    for item in items:
        name, values = _assignment(item, kind, several=True)
        if name in out:
            raise ValueError(f"field {name!r} given twice")
        out[name] = values
    return out


def config_overrides(items: list[str], kind: str = "fwd") -> dict:
    """['field=v', 'field2=v2,field3=v3', ...] (one value per field; pairs may
    also be joined by commas) -> {field: value}; ValueError for a bad item."""
    out = {}
    for item in items:
        for pair in filter(None, item.split(",")):
            name, (value,) = _assignment(pair, kind, several=False)
            if name in out:
                raise ValueError(f"field {name!r} given twice")
            out[name] = value
    return out


def config_with(parser: argparse.ArgumentParser, flag: str, kind: str, head_dim: int,
                causal: bool, overrides: dict, head_dim_v: int | None = None):
    """The op's default config for the problem with `overrides`, validated;
    a combination the kernel refuses is a parser error naming `flag`."""
    from cute_fa.kernels.config_fields import default_config

    config = default_config(kind, head_dim, causal, head_dim_v).replace(**overrides)
    try:
        config.validate(head_dim, head_dim_v)
    except ValueError as exc:
        parser.error(f"{flag}: {exc}")
    return config


# ------------------------------------------------------- what is missing here

def require_cuda(command: str) -> None:
    """Exit with a message when no CUDA device is visible."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"profiling.{command}: {NEEDS_GPU}; no CUDA device is visible here")


def require_module(module: str, install: str, purpose: str):
    """import `module`, or exit with a message saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SystemExit(f"{purpose} needs the Python package {module.split('.')[0]}, which "
                         f"is not installed here: {install} ({exc})") from None


# ----------------------------------------------------------------- progress

class Progress:
    """Progress of `total` units of work, on stderr: a tqdm bar where tqdm is
    installed (the bench and test extras), else a plain line every `every`
    units and at the end. `note` texts say what the last unit was (the bar
    shows it beside itself); `write` prints a lasting line to stdout."""

    def __init__(self, total: int, desc: str, unit: str = "item", every: int = 1,
                 position: int | None = None):
        self.total, self.desc, self.unit, self.every = total, desc, unit, max(1, every)
        self.done, self.next_line, self.start = 0, self.every, time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc=desc, unit=unit, position=position,
                            file=sys.stderr, dynamic_ncols=True)

    def working_on(self, note: str) -> None:
        """What the unit now under way is (shown by the bar only)."""
        if self.bar is not None:
            self.bar.set_postfix_str(note)

    def update(self, n: int = 1, note: str | None = None) -> None:
        self.done += n
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)
        elif self.done >= self.next_line or self.done == self.total:
            while self.next_line <= self.done:
                self.next_line += self.every
            print(f"{self.desc}: {self.done}/{self.total} {self.unit}s"
                  + (f", {note}" if note else "")
                  + f" ({time.perf_counter() - self.start:.0f} s)", file=sys.stderr, flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def progress(items, desc: str, unit: str = "item", label=None, every: int = 1):
    """Iterate over `items` with a Progress; label(item): the text that says
    which item is under way."""
    items = list(items)
    with Progress(len(items), desc, unit, every) as bar:
        for item in items:
            note = label(item) if label else None
            if note:
                bar.working_on(note)
            yield item
            bar.update(1, note)
