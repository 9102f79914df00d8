"""Smoke test of the harness on the H100: a tiny grid end to end."""

import json

import pytest

pytestmark = pytest.mark.gpu


def test_bench_tiny_grid(tmp_path):
    from cute_fa.profiling import bench

    out = str(tmp_path / "tiny")
    rows = bench.main(["--head-dims", "64", "--seqlens", "256,512", "--total-tokens", "1024",
                       "--backends", "cute,sdpa_flash,sdpa_math", "--repeats", "5",
                       "--out", out])
    ours = [r for r in rows if r["backend"] == "cute"]
    assert len(ours) == 4 and all(r["status"] == "ok" and r["tflops"] > 0 for r in ours)
    assert all(r["ratio_to_best_peer"] is not None for r in ours)
    data = json.loads(open(out + ".json").read())
    assert data["environment"]["gpu"] and len(data["rows"]) == 12
    assert (tmp_path / "tiny_tflops.png").stat().st_size > 1000


def test_sweep_tiny(tmp_path):
    from cute_fa.profiling import sweep

    results = sweep.main(["--head-dim", "64", "--seqlen", "512", "--total-tokens", "1024",
                          "--vary", "pingpong=0,1", "--check-seqlen", "200", "--repeats", "5",
                          "--out", str(tmp_path / "s")])
    assert [r["status"] for r in results] == ["ok", "ok"]
    assert all(r["max_error"] < 0.05 for r in results)


def test_sweep_backward_tiny(tmp_path):
    from cute_fa.profiling import sweep

    results = sweep.main(["--kernel", "bwd", "--head-dim", "64", "--seqlen", "512",
                          "--total-tokens", "1024", "--causal", "--vary", "qdo_stages=1,2",
                          "tile_n=96", "--check-seqlen", "200", "--repeats", "5",
                          "--out", str(tmp_path / "b")])
    # tile_n=96 is not a multiple of 64: refused by BwdConfig.validate, listed with the reason
    assert [r["status"].split(":")[0] for r in results] == ["ValueError", "ValueError"]
    results = sweep.main(["--kernel", "bwd", "--head-dim", "64", "--seqlen", "512",
                          "--total-tokens", "1024", "--causal", "--vary", "qdo_stages=1,2",
                          "--check-seqlen", "200", "--repeats", "5", "--out", str(tmp_path / "c")])
    assert [r["status"] for r in results] == ["ok", "ok"] and all(r["tflops"] > 0 for r in results)
