"""The C++ host side of the ops' CUDA kernels (csrc/cute_fa_native.cpp).

A compiled training step without a CUDA graph is paced by its host, and the
Python CUDA kernels of cute_fa::fwd / cute_fa::bwd cost more host time per
call than ATen's attention ops (docs/findings.md, "Host path"). The extension does the
same per-call work in C++; what runs once per new problem stays here:

- the planners: the score variant (scores.resolve: window, softcap,
  sinks), device check, config choice and DSL compilation (variants.py)
  and the NVTX range name, handed to C++ as a NativeVariant:
  TVM-FFI function handles and the variant's numbers, from which C++ makes
  the problem's launch plan (csrc/launch_plan.h) and caches it;
- the fallbacks (set by ops.py): a call that fails the C++ fast check goes
  to the op's Python CUDA kernel, which raises the error naming the argument
  (validate.py) or, for a valid call the C++ path does not take (a head dim
  padded to a kernel's), runs it.

It is built with torch.utils.cpp_extension on first use on a CUDA machine
(about a minute) from the C++ sources shipped in the package (cute_fa.csrc),
or with CMake (CMakeLists.txt), into the per-version cache folder
(user_cache.py), under a name that digests the sources, torch and Python, so that two versions of the project, or two
torch installs, never load each other's build. Without a compiler, the
TVM-FFI or NVTX headers, or with CUTE_FA_NATIVE=0, `load` returns None and
ops.py keeps its Python kernels, with a warning saying why.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import os
import sys
import warnings
from dataclasses import dataclass
from importlib import resources

from . import user_cache

ENV_SWITCH = "CUTE_FA_NATIVE"


SOURCES = ("cute_fa_native.cpp", "launch_plan.cpp")
HEADERS = ("launch_plan.h", "plan_launcher.h")


def source_folder() -> str:
    """The extension's C++ sources, shipped as package data."""
    return str(resources.files("cute_fa.csrc"))


def build_folder() -> str:
    """The build's folder in the per-version cache: one per sources, torch and
    Python, since the module links against torch's C++ ABI."""
    import torch

    digest = user_cache.files_digest(
        (os.path.join(source_folder(), name) for name in SOURCES + HEADERS),
        torch.__version__, str(sys.version_info[:2]))
    return str(user_cache.folder(f"native-{digest[:16]}"))


class NativeUnavailable(RuntimeError):
    """The extension cannot be built here; the message says what is missing."""


def _nvtx_include() -> str:
    """A folder holding nvtx3/nvToolsExt.h (header-only NVTX 3): the CUDA
    toolkit's, or that of the nvidia-nvtx wheel."""
    from torch.utils.cpp_extension import CUDA_HOME

    candidates = [os.path.join(p, "include") for p in (CUDA_HOME, "/usr/local/cuda") if p]
    try:
        import nvidia.nvtx  # the CUDA builds of torch depend on it
        candidates += [os.path.join(p, "include") for p in nvidia.nvtx.__path__]
    except ImportError:
        pass
    candidates += glob.glob("/usr/local/cuda-*/include")
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, "nvtx3", "nvToolsExt.h")):
            return folder
    raise NativeUnavailable(f"no nvtx3/nvToolsExt.h in {candidates} (CUDA toolkit or the "
                            f"nvidia-nvtx wheel)")


def prebuilt():
    """The module that CMake built and installed into the package
    (CMakeLists.txt), where it was built for the torch that runs; else None."""
    import torch

    try:
        from . import cute_fa_native as module
    except ImportError:
        return None
    running = torch.__version__.split("+")[0]
    if getattr(module, "built_for_torch", None) != running:
        warnings.warn(f"cute_fa: ignoring the installed C++ op kernels, built for torch "
                      f"{getattr(module, 'built_for_torch', '?')} (this is {running}); "
                      f"building them from source", stacklevel=2)
        return None
    return module


# torch's cpp_extension marks a build in progress by creating this file in the
# build folder and waits, without end, while it exists; a build killed midway
# leaves it behind.
TORCH_BUILD_MARK = "lock"


@contextlib.contextmanager
def _sole_builder(folder: str):
    """Hold the build folder's flock for the build. The kernel drops it when
    its holder dies, so a process holding it is the only one of ours
    building there, and a TORCH_BUILD_MARK it finds was left by a build that
    was killed: removed, with a warning, instead of waited on forever."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "build.flock"), "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        try:
            mark = os.path.join(folder, TORCH_BUILD_MARK)
            if os.path.exists(mark):
                warnings.warn(f"cute_fa: removing {mark}, left by a build of the C++ op "
                              f"layer that did not finish; building again", stacklevel=3)
                os.remove(mark)
            yield
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)


def build(verbose: bool = False):
    """Compile (or load the cached build of) the extension module, one of our
    processes at a time (_sole_builder)."""
    import tvm_ffi
    from torch.utils.cpp_extension import load

    ffi_root = os.path.dirname(tvm_ffi.__file__)
    ffi_lib = os.path.join(ffi_root, "lib")
    folder = source_folder()
    build_directory = build_folder()
    with _sole_builder(build_directory):
        return load(name="cute_fa_native", sources=[os.path.join(folder, n) for n in SOURCES],
                    build_directory=build_directory,
                    extra_include_paths=[folder, os.path.join(ffi_root, "include"),
                                         _nvtx_include()],
                    extra_cflags=["-O2"],
                    extra_ldflags=[f"-L{ffi_lib}", "-ltvm_ffi", f"-Wl,-rpath,{ffi_lib}"],
                    verbose=verbose)


def _ffi_handle(compiled) -> int:
    """The TVM-FFI function handle of a DSL-compiled kernel launcher. The DSL
    wraps it for keyword arguments where the signature has any (ours: the
    stream, which the launchers take from TVM-FFI's environment instead)."""
    inner = getattr(compiled, "__tvm_ffi_object__", None)
    return (inner() if inner is not None else compiled).__chandle__()


@dataclass(frozen=True)
class NativeVariant:
    """What the C++ host layer asks of Python once per new problem: the
    compiled launches of the problem's kernel variant and the planner's view
    of that variant (launch_plan.h); C++ plans the launches itself."""
    kernels: object  # the compiled kernels (CompiledKernel / CompiledBackward), kept alive
    handles: tuple  # their TVM-FFI function handles, in the plan's kernel order
    variant: bytes  # a CuteFaFwdVariant / CuteFaBwdVariant
    num_sms: int
    nvtx_name: str
    window: tuple  # (left, right) the kernels get (scores.resolve; -1: unbounded)


def _fwd_plan(q, k, v, causal, window_left, window_right, softcap, sink) -> NativeVariant:
    from . import launch_plan, variants
    from . import nvtx as nvtx_ranges
    from .scores import resolve

    scores = resolve(causal, window_left, window_right, softcap, q.shape[1], k.shape[1],
                     sink=sink)
    kernel, config, device_index = variants.fwd_kernel_for(q, v, scores.causal,
                                                           features=scores.features,
                                                           window=scores.window)
    return NativeVariant(kernel, (_ffi_handle(kernel.fn),),
                         bytes(launch_plan.fwd_variant(config, v.shape[3])),
                         variants.num_sms(device_index),
                         nvtx_ranges.range_name("fwd", q, v, causal, scores), scores.window)


def _bwd_plan(q, k, v, causal, deterministic, has_grad_lse, window_left, window_right, softcap,
              sink) -> NativeVariant:
    from . import launch_plan, variants
    from . import nvtx as nvtx_ranges
    from .scores import resolve

    scores = resolve(causal, window_left, window_right, softcap, q.shape[1], k.shape[1],
                     sink=sink)
    kernels, config, device_index = variants.bwd_kernels_for(q, k, scores.causal, deterministic,
                                                             has_grad_lse, None, scores.features,
                                                             head_dim_v=v.shape[3])
    return NativeVariant(kernels, tuple(_ffi_handle(f) for f in kernels.launch_list),
                         bytes(launch_plan.bwd_variant(config)), variants.num_sms(device_index),
                         nvtx_ranges.range_name("bwd", q, v, causal, scores), scores.window)


@functools.lru_cache(maxsize=None)
def load():
    """The extension with its callbacks set, or None (and a warning) where it
    cannot be built; CUTE_FA_NATIVE=0 turns it off without a warning."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        module = prebuilt() or build()
    except Exception as exc:  # no compiler, headers or ninja: the Python kernels serve
        warnings.warn(f"cute_fa: the C++ op kernels could not be built ({type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); "
                      f"using the Python ones (more host time per call). "
                      f"{ENV_SWITCH}=0 silences this.", stacklevel=2)
        return None
    module.set_planners(_fwd_plan, _bwd_plan)
    return module
