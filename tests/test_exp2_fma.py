"""exp2 on the FMA pipe (cute_kernels/exp2_fma.py): its arithmetic emulated
in fp32 on the CPU with the module's constants, and the share of a row's
columns that takes it."""

import numpy as np
import pytest

from cute_fa.kernels.bwd_config import (CAPPED_CAUSAL_BWD_EXP2_ON_FMA, BwdConfig,
                                        bwd_config_for_problem)
from cute_fa.kernels.config import (CAPPED_EXP2_ON_FMA, Features, FwdConfig,
                                    default_fwd_config)
from cute_fa.kernels.exp2_fma import (CLAMP, POLY_C1, POLY_C2, POLY_C3, ROUNDING_SHIFT,
                                      on_fma)


def _f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def _fma(a, b, c):
    # a·b of two fp32 values is exact in fp64; one rounding to fp32 after the add
    return (a.astype(np.float64) * b + c).astype(np.float32)


def exp2_poly(x: np.ndarray) -> np.ndarray:
    """The PTX sequence of exp2_fma._BODY, step by step in fp32."""
    shift = _f32(ROUNDING_SHIFT)
    x = np.maximum(x.astype(np.float32), _f32(CLAMP))
    t = (x + shift).astype(np.float32)
    f = (x - (t - shift).astype(np.float32)).astype(np.float32)
    p = _fma(f, _f32(POLY_C3), _f32(POLY_C2))
    p = _fma(p, f, _f32(POLY_C1))
    p = _fma(p, f, np.float32(1.0))
    bits = p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))
    return bits.view(np.float32)


def test_relative_error_over_the_softmax_exponents():
    """1.0e-4 at most over every exponent a softmax makes (a bf16 P rounds
    at 2^-9): down to fp32's smallest normal, up to the fixed reference's
    ceiling (softcap.FIXED_EXP_CEIL)."""
    x = np.concatenate([np.linspace(-126.0, 64.0, 2_000_001, dtype=np.float32),
                        np.float32(-1.0) * np.random.default_rng(0).random(100_000, np.float32)])
    got = exp2_poly(x).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1.0)
    assert rel.max() <= 1.05e-4


def test_masked_scores_give_zero_and_integers_exact_powers():
    x = np.array([-np.inf, -1e30, -200.0, -127.0], dtype=np.float32)
    assert np.array_equal(exp2_poly(x).view(np.uint32), np.zeros(4, np.uint32))  # +0.0
    ints = np.arange(-126, 64, dtype=np.float32)
    assert np.array_equal(exp2_poly(ints), np.exp2(ints))
    # just above the clamp: a value below fp32's smallest normal, never more
    tiny = exp2_poly(np.array([-126.9, -126.6], dtype=np.float32))
    assert (tiny >= 0).all() and (tiny < np.float32(2.0 ** -126)).all()


@pytest.mark.parametrize("per_8", range(9))
def test_the_share_is_spread_over_each_8_columns(per_8):
    taken = [c for c in range(8) if on_fma(c, per_8)]
    assert len(taken) == per_8
    assert all(on_fma(c + 8 * n, per_8) == on_fma(c, per_8) for c in range(8) for n in (1, 5))
    if 0 < per_8 <= 4:  # no two neighbours: the MUFU's ops stay between them
        assert all(b - a >= 2 for a, b in zip(taken, taken[1:]))


def test_configs_take_the_share_only_under_a_cap_at_head_dim_64():
    """(but a wide window's)"""
    for features in (Features(softcap=True), Features(softcap=True, local=True),
                     Features(softcap=True, varlen=True), Features(softcap=True, sink=True),
                     Features(softcap=True, block_sparse=True)):
        for causal in (False, True):
            for short in (False, True):
                config = default_fwd_config(64, causal, features=features, short=short)
                assert config.exp2_on_fma == CAPPED_EXP2_ON_FMA and config.bounded_softmax
                config.validate(64)
                if features.local:  # a wide window's tile spills with the share
                    assert default_fwd_config(64, causal, features=features, short=short,
                                              wide_window=True).exp2_on_fma == 0
                for head_dim in (96, 128, 256):
                    assert default_fwd_config(head_dim, causal, features=features,
                                              short=short).exp2_on_fma == 0
    assert default_fwd_config(64, False).exp2_on_fma == 0


def test_backward_configs_take_the_share_under_a_cap_and_a_causal_mask_at_head_dim_64():
    cap = Features(softcap=True)

    def share(head_dim, causal, features):
        config = bwd_config_for_problem(head_dim, causal, False, 2, 8192, 32, 32, 132, features)
        config.validate(head_dim)
        return config.exp2_on_fma

    assert share(64, True, cap) == CAPPED_CAUSAL_BWD_EXP2_ON_FMA
    assert share(64, False, cap) == share(128, True, cap) == share(64, True, Features()) == 0
    for other in (Features(softcap=True, local=True), Features(softcap=True, varlen=True),
                  Features(softcap=True, block_sparse=True)):  # not measured there
        assert share(64, True, other) == 0


@pytest.mark.parametrize("config", [FwdConfig(), BwdConfig()], ids=["fwd", "bwd"])
@pytest.mark.parametrize("share", [9, -1])
def test_shares_outside_0_to_8_name_the_field(config, share):
    with pytest.raises(ValueError, match=r"exp2_on_fma.*\[0, 8\]"):
        config.replace(exp2_on_fma=share).validate(64)


@pytest.mark.parametrize("changes,match", [
    (dict(exp2_on_fma=2, bounded_softmax=False), r"exp2_on_fma.*bounded_softmax"),
])
def test_a_forward_share_needs_the_bounded_softmax(changes, match):
    with pytest.raises(ValueError, match=match):
        FwdConfig().replace(**changes).validate(64)
