"""Correctness of the model across attention backends on an sm_90 GPU."""

import math

import pytest
import torch

from cute_fa.profiling import train

from cute_fa.attention_backends import BACKEND_NAMES
from cute_fa.model import ModelConfig, Transformer

pytestmark = pytest.mark.gpu

CONFIG = ModelConfig(dim=512, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=1408,
                     max_seq_len=1024)
PEERS = [b for b in BACKEND_NAMES if b != "cute"]


def _model(backend, dtype):
    torch.manual_seed(0)
    return Transformer(CONFIG, backend=backend).to(device="cuda", dtype=dtype)


def _tokens():
    return torch.randint(0, 256, (2, 1024), device="cuda",
                         generator=torch.Generator(device="cuda").manual_seed(3))


def _logits(backend, dtype):
    try:
        with torch.no_grad():
            return _model(backend, dtype)(_tokens()).float()
    except Exception as exc:
        if "flash_attn.cute not importable" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_efficient"])
def test_fp32_logits_match_across_sdpa_backends(backend):
    # fp32 model: only backends with an fp32 path (ours, FA2, cuDNN and fa4 are
    # 16-bit only; they are compared in the bf16 test).
    torch.testing.assert_close(_logits(backend, torch.float32),
                               _logits("sdpa_math", torch.float32), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("backend", ["cute"] + PEERS)
def test_bf16_logits_within_low_precision_error(backend):
    # Tolerance: 4x the distance between the bf16 math path and the fp32 model;
    # each bf16 backend rounds attention outputs to bf16 the same way.
    exact = _logits("sdpa_math", torch.float32)
    base = (_logits("sdpa_math", torch.bfloat16) - exact).abs().max().item()
    mine = _logits(backend, torch.bfloat16)
    assert torch.isfinite(mine).all()
    assert (mine - exact).abs().max().item() <= 4 * base


def test_loss_agrees_within_half_a_percent():
    tokens = _tokens()
    losses = {}
    for backend in ("cute", "sdpa_math", "sdpa_cudnn"):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            losses[backend] = _model(backend, torch.float32)(tokens[:, :-1], tokens[:, 1:])[1].item()
    for backend, loss in losses.items():
        assert abs(loss - losses["sdpa_math"]) <= 0.005 * losses["sdpa_math"], losses


def test_gradients_agree_and_are_finite():
    tokens = _tokens()
    grads = {}
    for backend in ("cute", "sdpa_math"):
        model = _model(backend, torch.float32)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(tokens[:, :-1], tokens[:, 1:])[1].backward()
        grads[backend] = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert torch.isfinite(grads[backend]).all()
    cos = torch.nn.functional.cosine_similarity(grads["cute"], grads["sdpa_math"], dim=0)
    assert cos > 0.999


def test_checkpoint_moves_between_backends(tmp_path):
    from cute_fa.profiling.train import load_checkpoint, save_checkpoint

    path = str(tmp_path / "m.pt")
    save_checkpoint(path, _model("sdpa_cudnn", torch.bfloat16), backend="sdpa_cudnn")
    model, _ = load_checkpoint(path, "cute", device="cuda")
    with torch.no_grad():
        mine = model.to(torch.bfloat16)(_tokens()).float()
    torch.testing.assert_close(mine, _logits("sdpa_cudnn", torch.bfloat16), rtol=5e-2,
                               atol=5e-2)


@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_training_matches_eager(dataset, tmp_path, compile):
    """--cuda-graph replays the captured step: after the eager warm-up steps
    and the capture, every step's loss is that of the eager run (the dQ
    accumulation order is free, so not bitwise)."""
    path, _ = dataset
    common = ["--config", "tiny", "--backend", "cute", "--steps", "8", "--seq", "64",
              "--batch", "2", "--lr", "1e-3", "--warmup", "2", "--log-every", "1",
              "--data", path] + (["--compile"] if compile else [])
    eager = train.main(common + ["--out", str(tmp_path / "eager")])[0]
    graphed = train.main(common + ["--cuda-graph", "--out", str(tmp_path / "graphed")])[0]
    assert eager["status"] == "ok" and graphed["status"] == "ok", (eager["status"],
                                                                   graphed["status"])
    assert len(graphed["log"]) == 8
    for a, b in zip(eager["log"], graphed["log"]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=2e-3), (a, b)
        assert math.isclose(a["lr"], b["lr"], rel_tol=1e-6)
