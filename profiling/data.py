"""Training text that every machine has without a download: the Python standard
library's own source files, tokenized at byte level (vocab 256).

    python -m cute_fa.profiling.data                      # into the per-user cache
    python -m cute_fa.profiling.data --out stdlib.parquet

Prepared once into a parquet file (one row per file: path, split, tokens as
bytes); the split is by file, decided by a hash of its relative path, so it
is the same on every machine. `TokenStream` serves random (seq+1)-token
windows of one split as (inputs, targets) batches.

The file is a cache: profiling.train and profiling.step read it from
default_path() (the per-user cache folder of this version of cute_fa:
$CUTE_FA_CACHE_DIR, else $XDG_CACHE_HOME/cute_fa, else ~/.cache/cute_fa) and
prepare it there on first use; their --data PATH reads another file. This
command prepares it explicitly, by default into that same place.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig

import numpy as np
import torch

from .cli import INSTALL_BENCH, command_parser, progress, require_module

SEPARATOR = 0  # NUL byte between files: never appears in Python source
VAL_PERCENT = 2


def stdlib_files(root: str | None = None) -> list[tuple[str, str]]:
    """(relative path, absolute path) of the stdlib's .py files, sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                found.append((os.path.relpath(path, root), path))
    return found


def split_of(relative_path: str) -> str:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return "val" if digest[0] * 100 // 256 < VAL_PERCENT else "train"


def default_path() -> str:
    """Where the training data is cached: <user cache>/<version>/data/stdlib.parquet
    (cute_fa.user_cache; the folder is created)."""
    from cute_fa import user_cache

    return str(user_cache.folder("data") / "stdlib.parquet")


def _parquet():
    return require_module("pyarrow.parquet", INSTALL_BENCH, "the training data (parquet)")


def prepare(out_path: str, root: str | None = None) -> dict:
    """Write the parquet file (whole or not at all: it is written beside and
    renamed); returns token counts per split."""
    pq = _parquet()
    import pyarrow as pa

    paths, splits, blobs = [], [], []
    for rel, path in progress(stdlib_files(root), "preparing training data", "file",
                              every=250):
        with open(path, "rb") as f:
            data = f.read().replace(bytes([SEPARATOR]), b"")
        if data:
            paths.append(rel)
            splits.append(split_of(rel))
            blobs.append(data)
    if not blobs:
        raise RuntimeError(f"no .py files found under {root or sysconfig.get_paths()['stdlib']}")
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    table = pa.table({"path": paths, "split": splits, "tokens": pa.array(blobs, pa.binary())})
    partial = f"{out_path}.{os.getpid()}.partial"
    pq.write_table(table, partial)
    os.replace(partial, out_path)
    return {s: sum(len(b) for b, sp in zip(blobs, splits) if sp == s) for s in ("train", "val")}


def load_split(path: str, split: str) -> np.ndarray:
    """All files of one split joined by SEPARATOR, as uint8 tokens."""
    pq = _parquet()
    if split not in ("train", "val"):
        raise ValueError(f"split: expected 'train' or 'val', got {split!r}")
    table = pq.read_table(path, columns=["split", "tokens"])
    blobs = [t for s, t in zip(table["split"].to_pylist(), table["tokens"].to_pylist())
             if s == split]
    return np.frombuffer(bytes([SEPARATOR]).join(blobs), dtype=np.uint8)


def ensure_dataset(path: str | None = None) -> str:
    """The training data's path (default_path() when None), prepared first if
    the file is not there."""
    path = path or default_path()
    if not os.path.exists(path):
        print(f"preparing the training data (first use): {path}", file=sys.stderr, flush=True)
        prepare(path)
    return path


def add_data_option(p) -> None:
    """--data PATH (train, step)."""
    p.add_argument("--data", default=None, metavar="PATH",
                   help="training data, a parquet file of profiling.data (default: the "
                        "per-user cache, $CUTE_FA_CACHE_DIR or ~/.cache/cute_fa, "
                        "<version>/data/stdlib.parquet, prepared on first use)")


class TokenStream:
    """Random windows of a token array, reproducible from a seed."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, seed: int = 0):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"tokens: expected more than seq_len + 1 = {seq_len + 1} tokens, "
                             f"got {len(tokens)}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.batch = seq_len, batch
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self, device="cpu"):
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch,),
                               generator=self.generator)
        windows = torch.stack([self.tokens[s: s + self.seq_len + 1] for s in starts.tolist()])
        windows = windows.to(device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]


def build_parser():
    p = command_parser("data", __doc__)
    p.add_argument("--out", default=None, metavar="PATH",
                   help="the parquet file to write, its folder created (default: the cache "
                        "path that train and step read, default_path() above)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    out = args.out or default_path()
    counts = prepare(out)
    print(f"wrote {out}: {counts['train']:,} train tokens, {counts['val']:,} val tokens")
    return out


if __name__ == "__main__":
    main()
