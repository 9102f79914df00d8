"""The launch plans (csrc/launch_plan.h) from Python, and their Python executor.

A plan says which buffers one call allocates and which kernel launches it
makes with which arguments; it is computed in C (csrc/launch_plan.cpp), the
one description that the op's C++ host layer, this module and the
stand-alone driver all run. This module

- builds that C file into a small shared library on first use (about a
  second, with the C++ compiler that $CXX names, else c++ or g++) into the
  per-version cache folder, and reads it through ctypes;
- says what a kernel variant is, from its config (fwd_variant, bwd_variant):
  the numbers the planner needs, also written into the ahead-of-time
  registry (aot.py);
- runs a plan with torch tensors and the variant's compiled launches
  (execute), for the op's Python path and the profiling tools.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources

import torch

from . import user_cache
from .kernels import tail_plan
from .kernels.bwd_config import BwdConfig
from .kernels.config import WARPGROUP_THREADS, FwdConfig

LAYOUT_VERSION = 10
MAX_BUFFERS, MAX_ARGS, MAX_LAUNCHES, MAX_OUTPUTS = 24, 32, 4, 4
LOG2_E = 1.4426950408889634


class Shape(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("batch", "seqlen_q", "seqlen_k", "heads",
                                               "heads_kv", "head_dim", "head_dim_v")]


class Window(ctypes.Structure):
    _fields_ = [("left", ctypes.c_int64), ("right", ctypes.c_int64)]


class Varlen(ctypes.Structure):
    _fields_ = [("total_q", ctypes.c_int64), ("total_k", ctypes.c_int64),
                ("seqused_q", ctypes.c_int32), ("seqused_k", ctypes.c_int32)]


class BlockSparse(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("batch", "rows", "words")]


class FwdVariant(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in (
        "tile_m", "tile_n", "consumer_warpgroups", "threads_per_warpgroup", "dynamic_tiles",
        "split_tail", "max_parts", "partial_floats", "first_split_counter")]


class BwdVariant(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in (
        "tile_m", "dq_warpgroups", "dynamic_tiles", "deterministic", "split_gqa",
        "convert_dq", "dq_first_store")]


class _Buffer(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int32), ("init", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("tma", ctypes.c_int32), ("shape", ctypes.c_int64 * 4)]


class _Arg(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("index", ctypes.c_int32), ("value", ctypes.c_int64)]


class _Launch(ctypes.Structure):
    _fields_ = [("kernel", ctypes.c_int32), ("num_args", ctypes.c_int32),
                ("args", _Arg * MAX_ARGS)]


class _Plan(ctypes.Structure):
    _fields_ = [("num_inputs", ctypes.c_int32), ("num_buffers", ctypes.c_int32),
                ("num_launches", ctypes.c_int32), ("num_outputs", ctypes.c_int32),
                ("buffers", _Buffer * MAX_BUFFERS), ("launches", _Launch * MAX_LAUNCHES),
                ("outputs", ctypes.c_int32 * MAX_OUTPUTS),
                ("full_tiles", ctypes.c_int64), ("tail_parts", ctypes.c_int64)]


_LAYOUT = (Shape, FwdVariant, BwdVariant, _Buffer, _Arg, _Launch, _Plan, Window, Varlen,
           BlockSparse)

# CuteFaDtype, CuteFaInit, CuteFaArgKind
INPUT_DTYPE, F32, I32, OUTPUT_DTYPE = 0, 1, 2, 3
EMPTY, ZERO, UNUSED = 0, 1, 2
ARG_BUFFER, ARG_SCALE_LOG2, ARG_SCALE, ARG_INT, ARG_PRE_TANH = 0, 1, 2, 3, 4


class PlannerUnavailable(RuntimeError):
    """The planner library cannot be built here; the message says why."""


def _sources() -> list[str]:
    folder = resources.files("cute_fa.csrc")
    return [str(folder.joinpath(name)) for name in ("launch_plan.cpp", "launch_plan.h")]


def compiler() -> str | None:
    """The C++ compiler: $CXX, else c++ or g++ on the PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def library_path() -> str:
    """Where the planner library of these sources lives in the per-version cache."""
    digest = user_cache.files_digest(_sources())
    return str(user_cache.folder(f"plan-{digest[:16]}") / "libcute_fa_plan.so")

def _build(target: str) -> None:
    cxx = compiler()
    if cxx is None:
        raise PlannerUnavailable("cute_fa needs a C++ compiler to build its launch planner "
                                 "(csrc/launch_plan.cpp) on first use: none found ($CXX, c++, "
                                 "g++)")
    fd, partial = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run([cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-o", partial,
                               _sources()[0]], capture_output=True, text=True)
        if done.returncode != 0:
            raise PlannerUnavailable(f"cute_fa could not build its launch planner with {cxx}: "
                                     f"{done.stderr.strip()[-2000:]}")
        os.replace(partial, target)  # whole or absent for a process building it at once
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The planner library, built on first use; its struct layout checked
    against this module's mirror of launch_plan.h."""
    path = library_path()
    if not os.path.exists(path):
        _build(path)
    lib = ctypes.CDLL(path)
    lib.cute_fa_plan_fwd.restype = ctypes.c_int
    lib.cute_fa_plan_fwd.argtypes = [ctypes.POINTER(FwdVariant), ctypes.POINTER(Shape),
                                     ctypes.POINTER(Window), ctypes.POINTER(Varlen),
                                     ctypes.c_int32, ctypes.POINTER(BlockSparse),
                                     ctypes.c_int32, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.POINTER(_Plan)]
    lib.cute_fa_plan_bwd.restype = ctypes.c_int
    lib.cute_fa_plan_bwd.argtypes = [ctypes.POINTER(BwdVariant), ctypes.POINTER(Shape),
                                     ctypes.POINTER(Window), ctypes.POINTER(Varlen),
                                     ctypes.c_int32, ctypes.POINTER(BlockSparse),
                                     ctypes.c_int64, ctypes.POINTER(_Plan)]
    lib.cute_fa_tail_parts.restype = ctypes.c_int64
    lib.cute_fa_tail_parts.argtypes = [ctypes.c_int64] * 4
    version = ctypes.c_int64()
    sizes = (ctypes.c_int64 * len(_LAYOUT))()
    lib.cute_fa_plan_layout(ctypes.byref(version), sizes, len(_LAYOUT))
    expected = [ctypes.sizeof(t) for t in _LAYOUT]
    if version.value != LAYOUT_VERSION or list(sizes) != expected:
        raise PlannerUnavailable(f"the planner library {path} has layout {version.value} "
                                 f"{list(sizes)}, this module reads {LAYOUT_VERSION} {expected}")
    return lib


def fwd_variant(config: FwdConfig, head_dim_v: int) -> FwdVariant:
    """What the planner needs of a forward kernel built from `config`, whose
    output has head dim `head_dim_v`."""
    return FwdVariant(tile_m=config.tile_m, tile_n=config.tile_n,
                      consumer_warpgroups=config.consumer_warpgroups,
                      threads_per_warpgroup=WARPGROUP_THREADS,
                      dynamic_tiles=int(config.dynamic_tiles),
                      split_tail=int(config.split_tail), max_parts=tail_plan.MAX_PARTS,
                      partial_floats=tail_plan.partial_floats(head_dim_v, WARPGROUP_THREADS),
                      first_split_counter=tail_plan.FIRST_COUNTER)


def bwd_variant(config: BwdConfig) -> BwdVariant:
    """What the planner needs of a backward built from `config`."""
    return BwdVariant(tile_m=config.tile_m, dq_warpgroups=config.dq_warpgroups,
                      dynamic_tiles=int(config.dynamic_tiles),
                      deterministic=int(config.deterministic), split_gqa=int(config.split_gqa),
                      convert_dq=int(config.convert_dq),
                      dq_first_store=int(config.dq_first_store))


@dataclass(frozen=True)
class Workspace:
    index: int  # the buffer's place in the plan
    dtype: int  # INPUT_DTYPE, F32 or I32
    init: int  # EMPTY, ZERO or UNUSED
    shape: tuple


@dataclass(frozen=True)
class Plan:
    """A plan as Python values: the call's inputs (their count), the buffers
    it allocates, the launches ((kernel index, ((kind, index, value), ...)),
    ...) and the buffers it returns."""
    num_inputs: int
    workspaces: tuple  # of Workspace
    launches: tuple
    outputs: tuple
    full_tiles: int
    tail_parts: int

    @property
    def tail(self) -> tail_plan.TailPlan:
        return tail_plan.TailPlan(full_tiles=self.full_tiles, parts=self.tail_parts)

    @classmethod
    def from_c(cls, p: _Plan) -> Plan:
        workspaces = tuple(
            Workspace(i, p.buffers[i].dtype, p.buffers[i].init,
                      tuple(p.buffers[i].shape[:p.buffers[i].ndim]))
            for i in range(p.num_inputs, p.num_buffers))
        launches = tuple(
            (p.launches[j].kernel,
             tuple((a.kind, a.index, a.value) for a in p.launches[j].args[:p.launches[j].num_args]))
            for j in range(p.num_launches))
        return cls(p.num_inputs, workspaces, launches, tuple(p.outputs[:p.num_outputs]),
                   p.full_tiles, p.tail_parts)


def shape_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    batch, seqlen_q, heads, head_dim = q.shape
    return (batch, seqlen_q, k.shape[1], heads, k.shape[2], head_dim, v.shape[3])


def varlen_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int,
                 max_seqlen_q: int, max_seqlen_k: int) -> tuple:
    """A packed batch's shape for the planner: packed q, k, v (total, heads,
    d), its sequence count and longest sequences."""
    return (batch, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1], q.shape[2], v.shape[2])


def _varlen_arg(varlen: tuple | None):
    """(total_q, total_k, seqused_q given, seqused_k given) as the planner's
    CuteFaVarlen; None (a dense batch) as NULL."""
    return None if varlen is None else ctypes.byref(Varlen(*varlen))


def _block_sparse_arg(block_sparse: tuple | None):
    """The tile lists' shape (batch, rows, words) as the planner's
    CuteFaBlockSparse; None (no block mask) as NULL."""
    return None if block_sparse is None else ctypes.byref(BlockSparse(*block_sparse))


@functools.lru_cache(maxsize=1024)  # the Python op path asks it on every call
def plan_fwd(config: FwdConfig, shape: tuple, num_sms: int,
             tail: tail_plan.TailPlan | None = None, window: tuple = (-1, -1),
             varlen: tuple | None = None, sink: bool = False, fp8: bool = False,
             block_sparse: tuple | None = None) -> Plan:
    """The forward's plan for `shape` (shape_of, or for a packed batch
    varlen_shape); `tail` forces the split of the last round
    (profiling.sweep's A/B), else the planner's cost model; `window` (left,
    right; -1 unbounded) is a local kernel's; `varlen` (total_q, total_k,
    seqused_q given, seqused_k given) a packed batch's; `sink`: the call
    hands learnable sinks (an input after the others); `fp8`: e4m3 inputs,
    q's, k's and v's descales (1, b, h_kv) the last three inputs, out of
    execute's out_dtype;
    `block_sparse`: the shape of a block mask's tile lists (an input after
    the sinks)."""
    plan = _Plan()
    forced_full, forced_parts = (tail.full_tiles, tail.parts) if tail is not None else (0, 0)
    status = library().cute_fa_plan_fwd(ctypes.byref(fwd_variant(config, shape[6])),
                                        ctypes.byref(Shape(*shape)),
                                        ctypes.byref(Window(*window)), _varlen_arg(varlen),
                                        int(sink), _block_sparse_arg(block_sparse),
                                        int(fp8), num_sms, forced_full,
                                        forced_parts, ctypes.byref(plan))
    if status != 0:
        raise ValueError(f"no forward launch plan for shape {shape} on {num_sms} SMs with "
                         f"tail {tail} and config {config}")
    return Plan.from_c(plan)


@functools.lru_cache(maxsize=1024)
def plan_bwd(config: BwdConfig, shape: tuple, num_sms: int,
             window: tuple = (-1, -1), varlen: tuple | None = None, sink: bool = False,
             block_sparse: tuple | None = None) -> Plan:
    """The backward's plan for `shape`, `window`, `varlen`, `sink` and
    `block_sparse` as plan_fwd's; with a sink its fourth output holds
    d(sink)'s partials."""
    plan = _Plan()
    status = library().cute_fa_plan_bwd(ctypes.byref(bwd_variant(config)),
                                        ctypes.byref(Shape(*shape)),
                                        ctypes.byref(Window(*window)), _varlen_arg(varlen),
                                        int(sink), _block_sparse_arg(block_sparse), num_sms,
                                        ctypes.byref(plan))
    if status != 0:
        raise ValueError(f"no backward launch plan for shape {shape} on {num_sms} SMs "
                         f"with config {config}")
    return Plan.from_c(plan)


def tail_parts(num_tiles: int, num_sms: int, n_blocks: int) -> int:
    """The planner's key ranges per tile for a forward's last round (1: no split)."""
    return library().cute_fa_tail_parts(num_tiles, num_sms, n_blocks, tail_plan.MAX_PARTS)


_TORCH_DTYPE = {F32: torch.float32, I32: torch.int32}


@functools.lru_cache(maxsize=None)
def _stand_in(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # One tiny tensor per device and dtype for the buffers a variant never reads.
    return torch.empty((1, 1, 1), dtype=dtype, device=device)


_by_shape: dict = {}  # cached_per_shape


def cached_per_shape(key: tuple, make):
    """make(), once per key (shapes and device): kept unless made while a
    CUDA graph is captured (a tensor made there holds its values only at
    replay)."""
    found = _by_shape.get(key)
    if found is None:
        found = make()
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            _by_shape[key] = found
    return found


def execute(plan: Plan, launches: list, inputs: list, softmax_scale: float,
            softcap: float = 0.0, out_dtype: torch.dtype | None = None) -> tuple:
    """Run `plan`: allocate its buffers next to inputs[0], call `launches`
    (the variant's compiled launches, in order) with their arguments (the
    scalars from softmax_scale and softcap, 0: none, as plan_launcher.h makes
    them), return the output buffers. Inputs must already be TMA-ready
    (ops.tma_ready). out_dtype: that of OUTPUT_DTYPE buffers (e4m3 inputs)."""
    first = inputs[0]
    device = first.device
    buffers = list(inputs)
    for w in plan.workspaces:
        dtype = (first.dtype if w.dtype == INPUT_DTYPE else out_dtype if w.dtype == OUTPUT_DTYPE
                 else _TORCH_DTYPE[w.dtype])
        if w.init == UNUSED:
            buffers.append(_stand_in(device, dtype))
        elif w.init == ZERO:
            buffers.append(torch.zeros(w.shape, dtype=dtype, device=device))
        else:
            buffers.append(torch.empty(w.shape, dtype=dtype, device=device))
    scalars = {ARG_SCALE_LOG2: (softcap or softmax_scale) * LOG2_E, ARG_SCALE: softmax_scale,
               ARG_PRE_TANH: softmax_scale / softcap if softcap else 0.0}
    for kernel, args in plan.launches:
        launches[kernel](*[buffers[index] if kind == ARG_BUFFER
                           else value if kind == ARG_INT else scalars[kind]
                           for kind, index, value in args])
    return tuple(buffers[i] for i in plan.outputs)
