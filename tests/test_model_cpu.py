"""The llama-like model, its data pipeline, training and inference scripts on the CPU."""

import csv
from dataclasses import asdict
import json
import math
import os

import numpy as np
import pytest
import torch

from cute_fa.model import (DEFAULT, TINY, Transformer, apply_rope, count_parameters,
                              rope_tables, training_flops_per_token)
from cute_fa.profiling import data, infer, train


def _tiny_model(backend="cute", seed=0):
    torch.manual_seed(seed)
    return Transformer(TINY, backend=backend).to(torch.bfloat16)


def test_default_model_has_a_few_hundred_million_parameters():
    with torch.device("meta"):
        model = Transformer(DEFAULT)
    assert 150e6 < count_parameters(model) < 500e6
    assert DEFAULT.head_dim == 128 and DEFAULT.n_heads % DEFAULT.n_kv_heads == 0


def test_state_dict_is_backend_independent():
    states = [_tiny_model(b).state_dict() for b in ("cute", "sdpa_math", "fa4")]
    for other in states[1:]:
        assert list(other) == list(states[0])
        assert all(torch.equal(other[k], states[0][k]) for k in states[0])


def test_backends_give_the_same_logits_on_cpu():
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    ref = _tiny_model("sdpa_math")(tokens).float()
    ours = _tiny_model("cute")(tokens).float()
    # bf16 model: both paths round attention outputs to bf16 (relative 2^-8).
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-2)


def test_bad_backend_and_config_errors():
    with pytest.raises(ValueError, match="backend: expected one of"):
        Transformer(TINY, backend="flashy")
    with pytest.raises(ValueError, match="ModelConfig.n_kv_heads: expected a divisor"):
        Transformer(TINY.replace(n_kv_heads=3))
    with pytest.raises(ValueError, match="tokens: expected seq <= max_seq_len=64"):
        _tiny_model()(torch.zeros(1, 65, dtype=torch.long))


def test_rope_is_a_rotation():
    cos, sin = rope_tables(64, 16, 10000.0)
    x = torch.randn(2, 16, 3, 64)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0 is not rotated


def test_flop_and_lr_arithmetic():
    flops = training_flops_per_token(DEFAULT, 4096, 100_000_000)
    assert flops == 6e8 + 6 * DEFAULT.n_layers * 4096 * DEFAULT.dim
    assert train.lr_at(0, 1.0, 10, 100) == pytest.approx(0.1)
    assert train.lr_at(9, 1.0, 10, 100) == pytest.approx(1.0)
    assert train.lr_at(10, 1.0, 10, 100) == pytest.approx(1.0)
    assert train.lr_at(100, 1.0, 10, 100) == pytest.approx(0.1)
    assert train.lr_at(55, 1.0, 10, 100) == pytest.approx(0.55)


def test_data_pipeline(dataset):
    path, counts = dataset
    train_tokens, val_tokens = data.load_split(path, "train"), data.load_split(path, "val")
    assert counts["train"] > 0 and len(train_tokens) >= counts["train"]
    assert train_tokens.dtype == np.uint8
    assert b"ignored" not in train_tokens.tobytes() + val_tokens.tobytes()
    assert data.split_of("mod3.py") == data.split_of("mod3.py")
    stream = data.TokenStream(train_tokens, seq_len=32, batch=4, seed=7)
    x, y = stream.next_batch()
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    again = data.TokenStream(train_tokens, seq_len=32, batch=4, seed=7).next_batch()[0]
    assert torch.equal(x, again)
    with pytest.raises(ValueError, match="split: expected"):
        data.load_split(path, "test")


def test_stdlib_is_found():
    files = data.stdlib_files()
    assert len(files) > 500 and all(rel.endswith(".py") for rel, _ in files)


def test_train_two_backends_and_checkpoint_cross_load(dataset, tmp_path):
    path, _ = dataset
    out = str(tmp_path / "run")
    results = train.main(["--config", "tiny", "--backends", "cute,sdpa_math,fa4",
                          "--steps", "6", "--seq", "32", "--batch", "2", "--lr", "1e-3",
                          "--warmup", "2", "--log-every", "3", "--data", path, "--out", out,
                          "--save-checkpoint", "--device", "cpu"])
    ok = {r["backend"]: r for r in results if r["status"] == "ok"}
    assert set(ok) == {"cute", "sdpa_math"}
    assert results[2]["status"].startswith("failed: BackendUnavailable")
    assert math.isclose(ok["cute"]["final_loss"], ok["sdpa_math"]["final_loss"], rel_tol=5e-3)
    assert all(math.isfinite(r["loss"]) for r in ok["cute"]["log"])
    for name in ("cute.csv", "cute.json", "sdpa_math.csv", "compare.json", "train.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    assert len(json.load(open(os.path.join(out, "compare.json")))) == 3

    model_a, state = train.load_checkpoint(os.path.join(out, "cute.pt"), "cute")
    model_b, _ = train.load_checkpoint(os.path.join(out, "cute.pt"), "sdpa_math")
    assert state["step"] == 6 and state["backend"] == "cute"
    tokens = torch.randint(0, 256, (1, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(model_a(tokens).float(), model_b(tokens).float(),
                                   rtol=2e-2, atol=2e-2)


def test_infer_rows(tmp_path):
    rows = infer.main(["--config", "tiny", "--seq", "32", "--steps", "2", "--warmup", "1",
                       "--backends", "cute,sdpa_math", "--device", "cpu",
                       "--out", str(tmp_path / "i.json")])
    assert [r["status"] for r in rows] == ["ok", "ok"] and rows[0]["mean_ms"] > 0


def test_cuda_graph_arguments(dataset):
    path, _ = dataset
    with pytest.raises(SystemExit, match="--cuda-graph: needs a CUDA device"):
        train.main(["--config", "tiny", "--steps", "8", "--cuda-graph", "--device", "cpu",
                    "--data", path])
    with pytest.raises(SystemExit):  # argparse: too few steps to warm up and capture
        train.parse_args(["--steps", "3", "--cuda-graph"])
    assert train.parse_args(["--steps", "4", "--cuda-graph"]).cuda_graph


def test_interleaved_training_matches_sequential(dataset, tmp_path):
    # Each backend keeps its own model, optimizer and batch stream, so taking
    # turns every 3 steps must not change what any of them computes.
    path, _ = dataset
    common = ["--config", "tiny", "--backends", "cute,sdpa_math,fa4", "--steps", "7",
              "--seq", "32", "--batch", "2", "--lr", "1e-3", "--warmup", "2",
              "--log-every", "3", "--data", path, "--device", "cpu"]
    sequential = train.main(common + ["--out", str(tmp_path / "seq")])
    interleaved = train.main(common + ["--interleave", "3", "--out", str(tmp_path / "int")])
    assert [r["status"] for r in interleaved] == [r["status"] for r in sequential]
    assert interleaved[2]["status"].startswith("failed: BackendUnavailable")
    for seq_row, int_row in zip(sequential[:2], interleaved[:2]):
        assert [r["step"] for r in int_row["log"]] == [3, 6, 7]
        assert [r["loss"] for r in int_row["log"]] == [r["loss"] for r in seq_row["log"]]
        assert int_row["val_loss"] == seq_row["val_loss"]
        assert int_row["wall_s"] > 0
    # Only the interleaved run pairs windows; the first backend is 1 against itself.
    assert interleaved[0]["paired_ratio"]["median"] == 1.0
    assert interleaved[1]["paired_ratio"]["windows"] == 2  # steps 6 and 7
    assert "paired_ratio" not in sequential[1]
    # The CSV holds every logged window, written as it was logged.
    with open(tmp_path / "int" / "sdpa_math.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [3, 6, 7]
    assert float(rows[-1]["loss"]) == interleaved[1]["log"][-1]["loss"]


def test_paired_ratios_divide_windows_of_the_same_step():
    def log(*tps):
        return [dict(step=10 * (i + 1), tokens_per_s=t) for i, t in enumerate(tps)]

    # The first window (compilation) is left out; windows pair by step, so a
    # slow stretch that hits both backends in the same round cancels out.
    ratios = train.paired_ratios({"a": log(1, 100, 50, 100, 100),
                                  "b": log(9, 80, 40, 80, 100)})
    assert ratios["a"].median == 1.0 and ratios["a"].first_faster == 0
    b = ratios["b"]
    assert b.median == pytest.approx(1.25) and (b.first_faster, b.windows) == (3, 4)
    assert b.low <= b.median <= b.high
    assert train.paired_ratios({}) == {}
    # Many windows: the interval narrows around the median.
    wide = train.paired_ratios({"a": log(*[1.0] * 401),
                                "b": log(1.0, *[1 / (0.9 + 0.001 * i) for i in range(400)])})
    assert wide["b"].median == pytest.approx(1.1, abs=1e-9)
    # ranks 200 -+ 1.96·sqrt(400)/2 = 19.6 → 180 and 220
    assert (wide["b"].low, wide["b"].high) == (pytest.approx(1.08), pytest.approx(1.12))
    row = dict(status="ok", tokens_per_s=1.0, tflops=1.0, mfu=0.1, final_loss=1.0,
               val_loss=1.0)
    table = train.format_comparison([
        dict(row, backend="a", paired_ratio=asdict(ratios["a"]), steps_done=50),
        dict(row, backend="b", paired_ratio=asdict(b), steps_done=40),
        dict(backend="c", status="failed: X")], steps=50)
    assert "a/this [95% CI]" in table and "1.250 [" in table and "failed: X" in table
    assert "stopped at step 40 of 50 (--max-minutes)" in table


def test_max_minutes_stops_every_backend_at_the_same_round(dataset, tmp_path, monkeypatch):
    # A clock that ticks once per reading: the deadline is read at 0 and
    # lands at 2.5, so rounds start at 1 and 2 and the third (at 3) stops,
    # every backend after 2 rounds of 3 steps; each is still evaluated and
    # reported, and the table says where it stopped.
    path, _ = dataset
    ticks = iter(range(1000))
    monkeypatch.setattr(train, "_now", lambda: next(ticks))
    common = ["--config", "tiny", "--backends", "cute,sdpa_math", "--steps", "30",
              "--seq", "32", "--batch", "2", "--log-every", "3", "--data", path,
              "--device", "cpu", "--max-minutes", str(2.5 / 60)]
    results = train.main(common + ["--interleave", "3", "--out", str(tmp_path / "int")])
    assert [r["steps_done"] for r in results] == [6, 6]
    assert all(r["status"] == "ok" and r["val_loss"] > 0 for r in results)
    assert "stopped at step 6 of 30" in train.format_comparison(results, 30)
    # Sequential: the first backend takes log windows until the deadline,
    # the next one finds it passed and is skipped without being built.
    ticks = iter(range(1000))
    results = train.main(common + ["--out", str(tmp_path / "seq")])
    assert results[0]["steps_done"] == 3 and results[1]["status"] == train.SKIPPED
    with pytest.raises(SystemExit):
        train.parse_args(["--max-minutes", "0"])


def test_interleave_must_be_a_multiple_of_log_every():
    with pytest.raises(SystemExit):
        train.parse_args(["--backends", "cute,sdpa_math", "--interleave", "15",
                          "--log-every", "10"])
    assert train.parse_args(["--interleave", "20", "--log-every", "10"]).interleave == 20


@pytest.mark.parametrize("window_size,softcap", [((-1, -1), 0.0), ((20, -1), 5.0)])
def test_flexattention_peer_matches_the_reference(window_size, softcap):
    """The FlexAttention backend (compiled on the CPU too): bottom-right
    causal with a window as its BlockMask, the cap as its score_mod, GQA;
    it has no sinks."""
    from cute_fa.attention_backends import BackendUnavailable, attention
    from cute_fa.reference import attention_reference

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 100, 4, 64, generator=gen).bfloat16()
    k, v = (torch.randn(1, 130, 2, 64, generator=gen).bfloat16() for _ in range(2))
    out = attention(q, k, v, causal=True, backend="flex", window_size=window_size,
                    softcap=softcap)
    ref, _ = attention_reference(q, k, v, None, True, window=window_size, softcap=softcap)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(BackendUnavailable, match="no learnable sinks"):
        attention(q, k, v, backend="flex", learnable_sink=torch.zeros(4))
