"""The one place cute_fa writes files the user did not name: a per-user cache
folder with one subfolder per installed version, so two versions of the
project never share (or overwrite) what they built.

    $CUTE_FA_CACHE_DIR               if set
    $XDG_CACHE_HOME/cute_fa          else, if that is set
    ~/.cache/cute_fa                 else
        <version>/native-<digest>/   the C++ host layer's build (native.py)
        <version>/kernels/           compiled kernels (kernel_store.py)
        <version>/data/              prepared training data (profiling.data)

Everything else a command writes goes where its --out says.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

ENV_VAR = "CUTE_FA_CACHE_DIR"


@functools.lru_cache(maxsize=None)
def installed_version(distribution: str) -> str | None:
    """An installed distribution's version, None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def version() -> str:
    """This project's installed version ("0+unknown" when not installed)."""
    return installed_version("cute-fa") or "0+unknown"


def root() -> Path:
    """The cache folder shared by every version (not created here)."""
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cute_fa"


def folder(*parts: str) -> Path:
    """root()/<version>/<parts...>, created."""
    path = root().joinpath(version(), *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def files_digest(paths, *extra: str) -> str:
    """SHA-256 (hex) over files' names and bytes, then `extra` texts: what a
    cached build is named after, so edited sources never load an older build."""
    digest = hashlib.sha256()
    for path in map(Path, paths):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for text in extra:
        digest.update(text.encode() + b"\0")
    return digest.hexdigest()

