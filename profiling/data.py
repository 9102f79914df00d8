"""Training text that every machine has without a download: the Python standard
library's own source files, tokenized at byte level (vocab 256).

    python -m cute_fa.profiling.data --out data/stdlib.parquet

Prepared once into a parquet file (one row per file: path, split, tokens as
bytes); the split is by file, decided by a hash of its relative path, so it
is the same on every machine. `TokenStream` serves random (seq+1)-token
windows of one split as (inputs, targets) batches.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sysconfig

import numpy as np
import torch

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


def prepare(out_path: str, root: str | None = None) -> dict:
    """Write the parquet file; returns counts per split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths, splits, blobs = [], [], []
    for rel, path in stdlib_files(root):
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
    pq.write_table(table, out_path)
    return {s: sum(len(b) for b, sp in zip(blobs, splits) if sp == s) for s in ("train", "val")}


def load_split(path: str, split: str) -> np.ndarray:
    """All files of one split joined by SEPARATOR, as uint8 tokens."""
    import pyarrow.parquet as pq

    if split not in ("train", "val"):
        raise ValueError(f"split: expected 'train' or 'val', got {split!r}")
    table = pq.read_table(path, columns=["split", "tokens"])
    blobs = [t for s, t in zip(table["split"].to_pylist(), table["tokens"].to_pylist())
             if s == split]
    return np.frombuffer(bytes([SEPARATOR]).join(blobs), dtype=np.uint8)


def ensure_dataset(path: str) -> str:
    if not os.path.exists(path):
        prepare(path)
    return path


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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m cute_fa.profiling.data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/stdlib.parquet")
    args = p.parse_args(argv)
    counts = prepare(args.out)
    print(f"wrote {args.out}: {counts['train']:,} train tokens, {counts['val']:,} val tokens")


if __name__ == "__main__":
    main()
