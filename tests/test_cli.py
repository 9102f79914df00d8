"""The profiling commands' command lines, on the CPU: every option documented,
--help works, a bad value is an argparse error naming the option, and nothing
is written unless asked."""

import argparse
import importlib
import os
import pkgutil
import subprocess
import sys

import pytest

import cute_fa.profiling

COMMANDS = ("bench", "breakdown", "host", "ncu", "main", "kernel_info", "sass_loop", "sweep",
            "data", "train", "step", "infer", "decode_bench", "fp8_error", "varlen_bench",
            "fp8_bench", "sparse_bench")


def _module(command):
    return importlib.import_module(f"cute_fa.profiling.{command}")


def test_every_command_is_listed():
    # A new command (a module with a parser factory) gets the tests below too.
    found = {m.name for m in pkgutil.iter_modules(cute_fa.profiling.__path__)
             if hasattr(_module(m.name), "build_parser")}
    assert found == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help(command):
    parser = _module(command).build_parser()
    assert parser.prog == f"python -m cute_fa.profiling.{command}"
    assert parser.description and parser.description.strip()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help.strip() and action.help != argparse.SUPPRESS, \
            f"{command} {'/'.join(action.option_strings) or action.dest}: no help text"
    parser.format_help()  # every help text formats (no stray %)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_exits_zero(command):
    done = subprocess.run([sys.executable, "-m", f"cute_fa.profiling.{command}", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"usage: python -m cute_fa.profiling.{command}" in done.stdout


# (command, arguments, the option the error must name)
BAD_ARGUMENTS = [
    ("bench", ["--seqlens", "0"], "--seqlens"),
    ("bench", ["--seqlens", "1024,x"], "--seqlens"),
    ("bench", ["--backends", "cute,nope"], "--backends"),
    ("bench", ["--head-dims", "64,84"], "--head-dims"),
    ("bench", ["--head-dims", "264"], "--head-dims"),
    ("bench", ["--dtypes", "fp8"], "--dtypes"),
    ("bench", ["--directions", "sideways"], "--directions"),
    ("bench", ["--gqa", "3"], "--gqa"),
    ("bench", ["--repeats", "0"], "--repeats"),
    ("breakdown", ["--backends", "cute,nope"], "--backends"),
    ("breakdown", ["--head-dim", "80"], "--head-dim"),
    ("breakdown", ["--repeats", "0"], "--repeats"),
    ("breakdown", ["--direction", "sideways"], "--direction"),
    ("host", ["--modes", "sideways"], "--modes"),
    ("host", ["--backends", "nope"], "--backends"),
    ("host", ["--heads", "8", "--heads-kv", "3"], "--heads-kv"),
    ("ncu", ["--head-dim", "80"], "--head-dim"),
    ("ncu", ["--backend", "nope"], "--backend"),
    ("ncu", ["--config", "tile_k=3"], "--config"),
    ("ncu", ["--backend", "fa4", "--config", "tile_n=128"], "--config"),
    ("ncu", ["--dtype", "e4m3", "--backend", "fa4"], "--dtype e4m3"),
    ("ncu", ["--dtype", "e4m3", "--direction", "bwd"], "--dtype e4m3"),
    ("ncu", ["--dtype", "e4m3", "--config", "tile_n=144"], "--config"),  # e4m3: K steps of 32
    ("main", ["--head-dims", "80"], "--head-dims"),
    ("main", ["--dtypes", "fp8"], "--dtypes"),
    ("kernel_info", ["--head-dim", "80"], "--head-dim"),
    ("kernel_info", ["--config", "tile_n=128"], "--config"),  # needs --kernel
    ("kernel_info", ["--kernel", "fwd", "--config", "tile_k=3"], "--config"),
    ("sass_loop", ["--head-dim", "80"], "--head-dim"),
    ("sass_loop", ["--vary", "tile_k=1"], "--vary"),
    ("sweep", ["--seqlen", "0"], "--seqlen"),
    ("sweep", ["--head-dim", "80"], "--head-dim"),
    ("sweep", ["--vary", "tile_k=1,2"], "--vary"),
    ("sweep", ["--dtype", "e4m3", "--kernel", "bwd"], "--dtype e4m3"),
    ("sweep", ["--dtype", "e4m3", "--head-dim", "128", "--head-dim-v", "64"], "--dtype e4m3"),
    ("sweep", ["--kernel", "bwd", "--vary", "pingpong=0,1"], "--vary"),
    ("sweep", ["--head-dim", "128", "--head-dim-v", "192"], "--head-dim-v"),
    ("ncu", ["--direction", "bwd", "--head-dim", "64", "--head-dim-v", "128"], "--head-dim-v"),
    ("data", ["--out"], "--out"),
    ("train", ["--seq", "1"], "--seq"),
    ("train", ["--backends", "cute,nope"], "--backends"),
    ("train", ["--backend", "cute", "--backends", "sdpa"], "--backends"),
    ("train", ["--steps", "0"], "--steps"),
    ("train", ["--log-every", "2", "--interleave", "3"], "--interleave"),
    ("train", ["--save-checkpoint"], "--save-checkpoint"),
    ("train", ["--device", "nope"], "--device"),
    ("step", ["--backends", "cute,nope"], "--backends"),
    ("step", ["--rounds", "0"], "--rounds"),
    ("step", ["--profile-steps", "-1"], "--profile-steps"),
    ("infer", ["--steps", "0"], "--steps"),
    ("infer", ["--backends", "nope"], "--backends"),
    ("infer", ["--device", "nope"], "--device"),
    ("decode_bench", ["--out", "x", "--batches", "0"], "--batches"),
    ("decode_bench", ["--out", "x", "--shapes", "gpt5"], "--shapes"),
    ("decode_bench", ["--out", "x", "--backends", "cute,nope"], "--backends"),
    ("fp8_error", ["--out", "x", "--heads", "8", "--heads-kv", "3"], "--heads-kv"),
    ("fp8_error", ["--out", "x", "--head-dims", "96"], "--head-dims"),
    ("varlen_bench", ["--out", "x", "--directions", "bwd"], "--directions"),
    ("varlen_bench", ["--out", "x", "--min-len", "100", "--max-len", "50"], "--max-len"),
    ("varlen_bench", ["--out", "x", "--head-dims", "96"], "--head-dims"),
    ("sweep", ["--block-mask", "random30", "--causal", "yes"], "--block-mask"),
    ("sweep", ["--block-mask", "nope"], "--block-mask"),
    ("sweep", ["--softcap", "-1"], "--softcap"),
    ("sweep", ["--softcap", "30", "--dtype", "e4m3"], "--softcap"),
    ("sparse_bench", ["--out", "x", "--masks", "random10,nope"], "--masks"),
    ("sparse_bench", ["--out", "x", "--seqlens", "8192,0"], "--seqlens"),
    ("sparse_bench", ["--out", "x", "--head-dims", "96"], "--head-dims"),
]


@pytest.mark.parametrize("command,argv,option", BAD_ARGUMENTS,
                         ids=[f"{c}:{' '.join(a)}" for c, a, _ in BAD_ARGUMENTS])
def test_bad_argument_is_a_usage_error_naming_the_option(command, argv, option, capsys):
    # main() parses before anything runs (no GPU, compiler or data needed).
    with pytest.raises(SystemExit) as exit_info:
        _module(command).main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: python -m cute_fa.profiling.{command}" in err
    assert option in err.splitlines()[-1], err


def test_backward_sweep_takes_a_narrower_value_head_dim():
    """The backward is swept at d 192, dv 128 (DeepSeek's prefill), not only
    at dv = d: --head-dim-v is accepted with --kernel bwd."""
    from cute_fa.profiling import sweep

    args = sweep.parse_args(["--kernel", "bwd", "--head-dim", "192", "--head-dim-v", "128",
                             "--vary", "tile_n=64,96"])
    assert args.head_dim_v == 128


def test_bad_argument_exit_status_of_the_process():
    done = subprocess.run([sys.executable, "-m", "cute_fa.profiling.bench", "--seqlens", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--seqlens: expected a positive integer, got '0'" in done.stderr
    assert "Traceback" not in done.stderr


def test_bench_report_and_out_together(tmp_path):
    from cute_fa.profiling import bench

    args = bench.parse_args(["--report", str(tmp_path / "r"), "--out", str(tmp_path / "o")])
    assert args.report == str(tmp_path / "r") and args.out == str(tmp_path / "o")
    assert bench.parse_args([]).report is None
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--report", str(tmp_path / "file")])
    assert exit_info.value.code == 2
    assert os.listdir(tmp_path) == ["file"]  # parsing created no folder


def test_infer_writes_nothing_without_out(tmp_path, monkeypatch, capsys):
    from cute_fa.profiling import infer

    monkeypatch.chdir(tmp_path)
    rows = infer.main(["--config", "tiny", "--seq", "64", "--device", "cpu", "--steps", "1",
                       "--warmup", "0", "--backends", "sdpa"])
    assert [r["status"] for r in rows] == ["ok"]
    assert "sdpa" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


def test_infer_generates_with_a_kv_cache(capsys):
    """--generate: a row per backend with the time to first token, per-token
    latency and tokens/s; a backend without a KV-cache path is a failed row."""
    from cute_fa.profiling import infer

    rows = infer.main(["--config", "tiny", "--seq", "16", "--generate", "6", "--device", "cpu",
                       "--backends", "cute,sdpa,fa4", "--page-size", "8"])
    assert [r["status"] for r in rows][:2] == ["ok", "ok"]
    assert rows[2]["status"].startswith("failed") and "backend" in rows[2]["status"]
    for r in rows[:2]:
        assert r["prefill_ms"] > 0 and r["tokens_per_s"] > 0
        assert r["step_p99_ms"] >= r["step_median_ms"]
    assert "first token" in capsys.readouterr().out


def test_train_writes_nothing_without_out_but_the_data_cache(tmp_path, monkeypatch):
    pytest.importorskip("pyarrow")
    from cute_fa import user_cache
    from cute_fa.profiling import train

    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv(user_cache.ENV_VAR, str(cache))
    results = train.main(["--config", "tiny", "--seq", "64", "--steps", "2", "--log-every",
                          "1", "--device", "cpu", "--backends", "sdpa"])
    assert [r["status"] for r in results] == ["ok"]
    assert os.listdir(cwd) == []
    prepared = cache / user_cache.version() / "data" / "stdlib.parquet"
    assert prepared.stat().st_size > 0
    assert [p.name for p in prepared.parent.iterdir()] == ["stdlib.parquet"]  # no partial left
