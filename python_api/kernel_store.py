"""Compiled kernels kept on disk, so that a new process loads in milliseconds
what took seconds to compile.

An entry holds every launch of one kernel variant (the forward's one, the
backward's three or four), each exported from the DSL and linked into a
shared library that TVM-FFI loads back as a function, so a process whose
kernels all come from here never imports the DSL (about a second). Where no
C compiler is found, the DSL's object file is stored instead and loaded
through the DSL. Its name is a digest of everything that changes
the binaries:

- the kernel key (kind, dtype, head dim, causal, the config's every field, ...);
- the target architecture;
- the versions of cute-fa, nvidia-cutlass-dsl and apache-tvm-ffi, and the
  CUDA toolkit of the DSL's library set that builds them (dsl_toolkit);
- a digest of the kernel sources (cute_fa/kernels/*.py and kernel_compile.py),
  so that an edited checkout never loads a kernel built from older code.

Where: <user cache>/<version>/kernels/ (user_cache.py; $CUTE_FA_CACHE_DIR moves
it). CUTE_FA_KERNEL_CACHE=0 turns the store off (nothing read or written).

Safety: an entry is written whole to a temporary file and renamed into place,
so processes filling the store at once each see a complete entry or none. A
reader checks the entry's magic, its recorded key (so that a digest collision
or an older format is a miss) and each object's length and SHA-256; an entry
that fails any check is rebuilt and overwritten, never loaded.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from . import user_cache

ENABLE_ENV_VAR = "CUTE_FA_KERNEL_CACHE"
_MAGIC = b"cute-fa kernels v1\n"
_SUFFIX = ".kernels"


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def folder() -> Path:
    return user_cache.folder("kernels")


# The CUDA major versions that nvidia-cutlass-dsl ships library sets for
# (nvidia-cutlass-dsl-libs-cu<N>).
DSL_TOOLKITS = (12, 13)


def _driver_cuda_major() -> int | None:
    """The newest CUDA major version the driver supports; None without one."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        ok = libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0
    except (OSError, AttributeError):  # no driver library, or not that entry point
        return None
    return version.value // 1000 if ok else None


@functools.lru_cache(maxsize=None)
def dsl_toolkit() -> int | None:
    """The CUDA major version of the DSL library set that builds and runs
    the kernels in this environment (None: none installed that the driver
    runs): of those installed, the newest that the driver supports, or
    without a driver the newest, as the DSL itself picks when it loads. The
    sets' ptxas builds differ (registers, spills; docs/findings.md) and each
    links its own runtime, so an entry belongs to one set: two environments
    sharing the cache folder, or a cache filled without a GPU, never load
    the other set's kernels."""
    installed = [cuda for cuda in DSL_TOOLKITS
                 if user_cache.installed_version(f"nvidia-cutlass-dsl-libs-cu{cuda}")]
    driver = _driver_cuda_major()
    return max((cuda for cuda in installed if driver is None or cuda <= driver), default=None)


def toolkit_line() -> str:
    """Which library set compiles the kernels here, in a sentence (for
    reports of registers and spills, which are that set's ptxas's)."""
    cuda = dsl_toolkit()
    if cuda is None:
        return "nvidia-cutlass-dsl: no library set installed that this driver runs"
    return f"nvidia-cutlass-dsl compiles the kernels with its CUDA {cuda} libraries"


def _versions() -> tuple:
    return (user_cache.version(), user_cache.installed_version("nvidia-cutlass-dsl"),
            user_cache.installed_version("apache-tvm-ffi"), dsl_toolkit())


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """SHA-256 over the kernel sources and the compile step (names and bytes)."""
    from . import kernels

    files = sorted(Path(kernels.__file__).parent.glob("*.py"))
    files.append(Path(__file__).with_name("kernel_compile.py"))
    return user_cache.files_digest(files)

def describe(key: tuple, arch: str) -> str:
    """The full text of an entry's key: what it was built from."""
    return repr((key, arch, _versions(), source_digest()))


def entry_path(description: str) -> Path:
    name = hashlib.sha256(description.encode()).hexdigest()[:32]
    return folder() / f"{name}{_SUFFIX}"


def _encode(description: str, objects: dict[str, bytes]) -> bytes:
    header = {"key": description,
              "objects": [{"name": name, "bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()}
                          for name, data in objects.items()]}
    return _MAGIC + json.dumps(header).encode() + b"\n" + b"".join(objects.values())


def _decode(blob: bytes, description: str) -> dict[str, bytes] | None:
    """The entry's objects by name, or None when it is not a whole, matching entry."""
    if not blob.startswith(_MAGIC):
        return None
    end = blob.find(b"\n", len(_MAGIC))
    if end < 0:
        return None
    try:
        header = json.loads(blob[len(_MAGIC):end])
    except ValueError:
        return None
    if not isinstance(header, dict) or header.get("key") != description:
        return None
    objects, pos = {}, end + 1
    for item in header.get("objects", []):
        data = blob[pos:pos + item["bytes"]]
        if len(data) != item["bytes"] or hashlib.sha256(data).hexdigest() != item["sha256"]:
            return None
        objects[item["name"]] = data
        pos += item["bytes"]
    if pos != len(blob) or not objects:
        return None
    return objects


def read(description: str) -> dict[str, bytes] | None:
    """The stored objects of an entry, or None (absent, unreadable, corrupt,
    or built from another key)."""
    try:
        blob = entry_path(description).read_bytes()
    except OSError:
        return None
    return _decode(blob, description)


def write(description: str, objects: dict[str, bytes]) -> Path:
    """Store an entry atomically (temporary file in the same folder, then rename)."""
    path = entry_path(description)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_encode(description, objects))
        os.replace(partial, path)
    except BaseException:
        try:
            os.unlink(partial)
        except OSError:
            pass
        raise
    return path


def _symbol(name: str) -> str:
    return f"cute_fa_{name}"


def _is_shared_library(data: bytes) -> bool:
    # ELF header: e_type (bytes 16-17, little-endian) is 3 for a shared object,
    # 1 for the relocatable object that the DSL exports.
    return data[:4] == b"\x7fELF" and data[16:18] == b"\x03\x00"


def _link_shared(object_path: str, library_path: str) -> bool:
    """Link an exported object into a shared library that TVM-FFI loads without
    the DSL. False (and the object is stored as it is) where no C compiler
    is found or the link fails."""
    from cutlass.cute.export import aot_config

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return False
    command = [compiler, "-shared", "-o", library_path, object_path]
    for lib in aot_config.get_lib_paths(enable_tvm_ffi=True):
        folder_, name = os.path.split(lib)
        command += [f"-L{folder_}", f"-Wl,-rpath,{folder_}",
                    "-l" + name.removeprefix("lib").split(".so")[0]]
    done = subprocess.run(command, capture_output=True, text=True)
    return done.returncode == 0


def export(function, name: str) -> bytes:
    """A compiled DSL function as the bytes of a shared library (or, where it
    cannot be linked, of the object file the DSL exports)."""
    with tempfile.TemporaryDirectory(prefix="cute_fa_export") as tmp:
        object_path = os.path.join(tmp, f"{name}.o")
        library_path = os.path.join(tmp, f"{name}.so")
        function.export_to_c(object_path, function_name=_symbol(name))
        path = library_path if _link_shared(object_path, library_path) else object_path
        with open(path, "rb") as f:
            return f.read()


# Loaded libraries stay loaded: the functions taken from them are handed to
# the C++ launchers, which keep only their handles.
_libraries: list = []


def load(name: str, data: bytes):
    """An exported kernel back as a callable TVM-FFI function: a shared library
    through TVM-FFI alone, an object file through the DSL's loader."""
    with tempfile.TemporaryDirectory(prefix="cute_fa_load") as tmp:
        shared = _is_shared_library(data)
        path = os.path.join(tmp, f"{name}.so" if shared else f"{name}.o")
        with open(path, "wb") as f:
            f.write(data)
        if shared:
            import tvm_ffi

            module = tvm_ffi.load_module(path)
            function = module[_symbol(name)]
        else:
            import cutlass

            module = cutlass.runtime.load_module(path, enable_tvm_ffi=True)
            function = getattr(module, _symbol(name))
    _libraries.append(module)
    return function


def load_or_build(key: tuple, arch: str, build):
    """The functions of one kernel variant, by launch name.

    build() -> {name: compiled function}; called only when the store has no
    valid entry (or is off), its result exported and stored.
    Returns (functions, loaded_from_disk)."""
    if not enabled():
        return build(), False
    try:
        description = describe(key, arch)
        objects = read(description)
    except OSError as exc:  # the cache folder cannot be made: work without it
        warnings.warn(f"cute_fa: the kernel cache is unavailable: {exc}", stacklevel=3)
        return build(), False
    if objects is not None:
        try:
            return {name: load(name, data) for name, data in objects.items()}, True
        except Exception as exc:  # a valid file the runtime cannot load: rebuild it
            warnings.warn(f"cute_fa: rebuilding the kernel cache entry {entry_path(description)}"
                          f" (it did not load: {type(exc).__name__}: {exc})", stacklevel=3)
    functions = build()
    try:
        write(description, {name: export(fn, name) for name, fn in functions.items()})
    except OSError as exc:  # a read-only or full disk costs the cache, not the call
        warnings.warn(f"cute_fa: could not write the kernel cache: {exc}", stacklevel=3)
    return functions, False
