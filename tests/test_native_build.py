"""The native side as a user builds it: CMake (CMakeLists.txt) building the
planner, the op's extension, the ahead-of-time kernel library and the driver;
a wheel and a non-editable install that carry the C++ sources and build the
native layer from them. On the CPU: everything but running kernels; the
driver's GPU run and the installed package's native op path are GPU tests."""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from cute_fa import launch_plan
from cute_fa.kernels.config import default_fwd_config
from cute_fa.kernels.bwd_config import default_bwd_config

REPO = Path(__file__).resolve().parents[1]
# one small variant set keeps the export short: bf16, d64, non-causal, fwd + bwd
AOT_OPTIONS = "--head-dims;64;--dtypes;bf16;--causal;no"


def _cmake() -> str:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed (pip install cmake)")
    return cmake


@pytest.fixture(scope="module")
def cmake_build(tmp_path_factory):
    """A CMake build of the repository, configured with this interpreter."""
    cmake = _cmake()
    build = tmp_path_factory.mktemp("cmake_build")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run([cmake, "-S", str(REPO), "-B", str(build), *generator,
                    f"-DPython3_EXECUTABLE={sys.executable}",
                    f"-DCUTE_FA_AOT_OPTIONS={AOT_OPTIONS}", "-DCUTE_FA_AOT_JOBS=2",
                    f"-DCUTE_FA_PACKAGE_DIR={build / 'package'}"],
                   check=True, capture_output=True, text=True)
    done = subprocess.run([cmake, "--build", str(build), "-j", "2"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return build


def _driver(build: Path) -> Path:
    path = build / "cute_fa_run"
    if not path.exists():
        pytest.skip("no CUDA toolkit at configure time: the driver was not built")
    return path


def _run(build: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(_driver(build)), *args], capture_output=True, text=True)


def test_cmake_builds_every_target(cmake_build):
    names = os.listdir(cmake_build)
    assert "libcute_fa_plan.so" in names and "libcute_fa_kernels.so" in names
    assert any(re.match(r"cute_fa_native\..*\.so$", n) for n in names)
    kernels = sorted(os.listdir(cmake_build / "kernels"))
    assert kernels == sorted(["cute_fa_fwd_bf16_d64_full_fwd.o",
                              "cute_fa_bwd_bf16_d64_full_preprocess.o",
                              "cute_fa_bwd_bf16_d64_full_main.o",
                              "cute_fa_bwd_bf16_d64_full_postprocess.o",
                              "cute_fa_kernels_registry.c"])
    symbols = subprocess.run(["nm", "-D", "--defined-only",
                              str(cmake_build / "libcute_fa_kernels.so")],
                             capture_output=True, text=True, check=True).stdout
    for name in ("cute_fa_kernel_variants", "__tvm_ffi_cute_fa_fwd_bf16_d64_full_fwd",
                 "__tvm_ffi_cute_fa_bwd_bf16_d64_full_main"):
        assert name in symbols


def test_cmake_install(cmake_build, tmp_path):
    subprocess.run([_cmake(), "--install", str(cmake_build), "--prefix", str(tmp_path)],
                   check=True, capture_output=True, text=True)
    assert next((cmake_build / "package").glob("cute_fa_native.*.so"))  # CUTE_FA_PACKAGE_DIR
    assert (tmp_path / "lib" / "libcute_fa_kernels.so").exists()
    driver = tmp_path / "bin" / "cute_fa_run"
    if driver.exists():  # runs from its install folder (rpaths)
        done = subprocess.run([str(driver), "--list"], capture_output=True, text=True)
        assert done.returncode == 0 and "fwd bf16 d64 full" in done.stdout, done.stderr


def test_the_driver_lists_its_variants_and_names_bad_options(cmake_build):
    listed = _run(cmake_build, "--list")
    assert listed.returncode == 0 and listed.stdout.split("\n")[:2] == [
        "fwd bf16 d64 full", "bwd bf16 d64 full"]
    assert "usage: cute_fa_run" in _run(cmake_build, "--help").stdout
    for args, message in ((["--seqlen", "0"], "--seqlen: expected an integer >= 1, got '0'"),
                          (["--dtype", "fp8"], "--dtype: expected bf16 or fp16, got 'fp8'"),
                          (["--heads", "6", "--heads-kv", "4"], "--heads-kv: expected a divisor"),
                          (["--frobnicate"], "unknown option '--frobnicate'"),
                          (["--head-dim", "128"], "this build holds no variant 'fwd bf16 d128 full'")):
        done = _run(cmake_build, *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


def _parse_plan(text: str):
    """(buffers as (dtype, init, shape), launches as (kernel, args)) from --plan."""
    buffers, launches = [], []
    for line in text.splitlines():
        m = re.match(r"buffer \d+: \w+ (\w+) (\w+) \(([\d, ]+)\)", line)
        if m:
            buffers.append((m[1], m[2], tuple(int(x) for x in m[3].split(", "))))
        m = re.match(r"launch \d+: kernel (\d+) \((.*)\)", line)
        if m:
            launches.append((int(m[1]), m[2].split(", ")))
    return buffers, launches


def _python_plan(plan):
    dtypes, inits = ("input", "f32", "i32"), ("empty", "zero", "unused")
    buffers = [(dtypes[w.dtype], inits[w.init], w.shape) for w in plan.workspaces]
    names = {launch_plan.ARG_SCALE_LOG2: "scale_log2", launch_plan.ARG_SCALE: "scale",
             launch_plan.ARG_PRE_TANH: "pre_tanh"}
    launches = [(kernel, [f"buffer {i}" if kind == launch_plan.ARG_BUFFER
                          else str(value) if kind == launch_plan.ARG_INT else names[kind]
                          for kind, i, value in args]) for kernel, args in plan.launches]
    return buffers, launches


@pytest.mark.parametrize("backward", [False, True])
def test_the_driver_plans_as_the_op_does(cmake_build, backward):
    # batch 3, 1000 queries, 8 heads on 2 KV heads: a split tail forward, a padded backward
    shape = (3, 1000, 1000, 8, 2, 64, 64)
    args = ["--plan", "--head-dim", "64", "--seqlen", "1000", "--batch", "3", "--heads", "8",
            "--heads-kv", "2"] + (["--bwd"] if backward else [])
    done = _run(cmake_build, *args)
    assert done.returncode == 0, done.stderr
    buffers, launches = _parse_plan(done.stdout)
    if backward:
        plan = launch_plan.plan_bwd(default_bwd_config(64, False), shape, 132)
    else:
        plan = launch_plan.plan_fwd(default_fwd_config(64, False), shape, 132)
    expected_buffers, expected_launches = _python_plan(plan)
    assert buffers[plan.num_inputs:] == expected_buffers
    assert launches == expected_launches
    if not backward:  # on 128 SMs: 3 · 8 · 6 = 144 tiles of 192 rows, 16 in the last round
        done = _run(cmake_build, *args, "--plan-sms", "128")
        plan = launch_plan.plan_fwd(default_fwd_config(64, False), shape, 128)
        assert _parse_plan(done.stdout)[1] == _python_plan(plan)[1]


def test_cmake_extension_module_is_taken_when_built_for_this_torch(cmake_build, monkeypatch):
    from cute_fa import native

    module_path = next(cmake_build.glob("cute_fa_native.*.so"))
    code = ("import importlib.util, sys, torch\n"
            f"spec = importlib.util.spec_from_file_location('cute_fa_native', r'{module_path}')\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "print(m.built_for_torch, m.plan_capacity(), m.cached_plans())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == torch.__version__.split("+")[0] and int(out[1]) > 0 and out[2] == "0"

    class Module:
        built_for_torch = out[0]

    monkeypatch.setitem(sys.modules, "cute_fa.cute_fa_native", Module)
    assert native.prebuilt() is Module
    Module.built_for_torch = "1.0.0"
    with pytest.warns(UserWarning, match="built for torch 1.0.0"):
        assert native.prebuilt() is None


def _python_path(site: Path) -> str:
    """The installed copy first, then what the environment already adds."""
    return os.pathsep.join([str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(REPO)],
                   check=True, capture_output=True, text=True)
    return next(out.glob("cute_fa-*.whl"))


def test_the_wheel_carries_the_native_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in ("cute_fa_native.cpp", "launch_plan.cpp", "launch_plan.h", "plan_launcher.h",
                   "cute_fa_kernels.h", "cute_fa_run.cpp"):
        assert f"cute_fa/csrc/{source}" in names
    assert "cute_fa/aot.py" in names and "cute_fa/launch_plan.py" in names
    assert not [n for n in names if n.endswith(".so")]  # built where it runs, not shipped


def _run_installed(wheel: Path, tmp_path: Path, code: str, **env) -> str:
    """Install the wheel (not editable) into a folder of its own and run `code`
    there, from another folder; returns its output."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, text=True)
    done = subprocess.run([sys.executable, "-c", code.replace("SITE", str(site))], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=_python_path(site), **env),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_a_non_editable_install_builds_its_native_layer(wheel, tmp_path):
    code = ("import cute_fa, os\n"
            "from cute_fa import launch_plan, native\n"
            "assert os.path.realpath(cute_fa.__file__).startswith(os.path.realpath(r'SITE'))\n"
            "launch_plan.library()\n"
            "module = native.build()\n"
            "print(module.plan_capacity(), native.build_folder())\n")
    out = _run_installed(wheel, tmp_path, code, CUTE_FA_CACHE_DIR=str(tmp_path / "cache"))
    capacity, folder = out.split()
    assert int(capacity) > 0 and folder.startswith(str(tmp_path / "cache"))


# ------------------------------------------------------------------ GPU

@pytest.mark.gpu
def test_the_driver_runs_a_forward_and_a_backward(cmake_build):
    for extra in ([], ["--bwd"]):
        done = _run(cmake_build, "--head-dim", "64", "--seqlen", "2048", "--iters", "5",
                    *extra)
        assert done.returncode == 0, done.stderr
        m = re.search(r"([\d.]+) ms, ([\d.]+) TFLOP/s", done.stdout)
        assert m and float(m[1]) > 0 and float(m[2]) > 50, done.stdout


@pytest.mark.gpu
def test_an_installed_package_takes_the_native_path(wheel, tmp_path):
    code = ("import os, torch, cute_fa\n"
            "from cute_fa import ops, reference\n"
            "assert os.path.realpath(cute_fa.__file__).startswith(os.path.realpath(r'SITE'))\n"
            "assert ops._native is not None, 'the native path is not taken'\n"
            "q, k, v = (torch.randn(1, 256, 4, 64, device='cuda', dtype=torch.bfloat16) "
            "for _ in range(3))\n"
            "out, lse = torch.ops.cute_fa.fwd(q, k, v)\n"
            "ref, _ = reference.attention_reference(q.float(), k.float(), v.float(), 0.125, False)\n"
            "assert (out.float() - ref).abs().max() < 2e-2\n")
    _run_installed(wheel, tmp_path, code)


# -------------------------------------------------------- python -m cute_fa.aot

def test_aot_command_line(tmp_path):
    import argparse

    from cute_fa import aot

    parser = aot.build_parser()
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction):
            assert action.help and action.help.strip(), action.option_strings
    out = tmp_path / "kernels"
    listed = subprocess.run([sys.executable, "-m", "cute_fa.aot", "--out", str(out), "--list",
                             "--head-dims", "128", "--dtypes", "fp16", "--causal", "yes",
                             "--backward-modes", "plain,deterministic_split_gqa"],
                            capture_output=True, text=True, check=True).stdout.split()
    names = [os.path.basename(p) for p in listed]
    assert names == ["cute_fa_fwd_fp16_d128_causal_fwd.o",
                     "cute_fa_bwd_fp16_d128_causal_preprocess.o",
                     "cute_fa_bwd_fp16_d128_causal_main.o",
                     "cute_fa_bwd_fp16_d128_causal_postprocess.o",
                     "cute_fa_bwd_fp16_d128_causal_deterministic_split_gqa_preprocess.o",
                     "cute_fa_bwd_fp16_d128_causal_deterministic_split_gqa_main.o",
                     "cute_fa_bwd_fp16_d128_causal_deterministic_split_gqa_postprocess.o",
                     "cute_fa_bwd_fp16_d128_causal_deterministic_split_gqa_group_sum.o",
                     "cute_fa_kernels_registry.c"]
    assert not out.exists()  # --list builds nothing
    default = aot.selected(parser.parse_args(["--out", "x"]))
    # fwd and plain bwd: 2 dtypes x 5 head dims x causal each
    assert len(default) == 40 and not any(v.deterministic or v.split_gqa for v in default)
    assert {v.head_dim for v in default if v.direction == "bwd"} == {64, 96, 128, 192, 256}
    for args, option in ((["--out", "x", "--backward-modes", "fast"], "--backward-modes"),
                         (["--out", "x", "--head-dims", "80"], "--head-dims"),
                         (["--list"], "--out")):
        done = subprocess.run([sys.executable, "-m", "cute_fa.aot", *args], capture_output=True,
                              text=True)
        assert done.returncode == 2 and option in done.stderr, (args, done.stderr)


def test_the_registry_records_what_the_planner_needs():
    from cute_fa import aot
    from cute_fa.precompile import Variant

    fwd = Variant("fwd", "bf16", 96, True)
    bwd = Variant("bwd", "fp16", 128, False, deterministic=True, split_gqa=True)
    source = aot.registry_source([fwd, bwd])
    config = default_fwd_config(96, True)
    numbers = launch_plan.fwd_variant(config, 96)
    expected = "{" + ", ".join(str(getattr(numbers, n)) for n, _ in numbers._fields_) + "}"
    assert f'{{"fwd bf16 d96 causal", 0, 0, 96, 96, 1, 0, 0, 0, {expected}, {{0}}, 1,' in source
    bnumbers = launch_plan.bwd_variant(default_bwd_config(128, False, True, split_gqa=True))
    bexpected = "{" + ", ".join(str(getattr(bnumbers, n)) for n, _ in bnumbers._fields_) + "}"
    assert (f'{{"bwd fp16 d128 full deterministic split_gqa", 1, 1, 128, 128, 0, 1, 1, 0, {{0}}, '
            f'{bexpected}, 4,') in source
    assert "__tvm_ffi_cute_fa_bwd_fp16_d128_full_deterministic_split_gqa_group_sum}" in source
