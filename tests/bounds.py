"""The error bound of the GPU tests, in one place: each output and gradient
within twice PyTorch's own low-precision error against the fp32 reference
(the same inputs through the reference math in the inputs' dtype), the LSE
within 1e-2 where finite, -inf exactly where the reference has it."""

import torch


def assert_lse_matches(lse: torch.Tensor, ref_lse: torch.Tensor) -> None:
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "LSE -inf rows differ from the reference"
    if finite.any():
        assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-2


def assert_within_low_precision(pairs, slack: float = 2e-5) -> None:
    """pairs: (name, ours, fp32 reference, reference in the inputs' dtype)."""
    for name, got, ref, low in pairs:
        assert torch.isfinite(got).all(), f"{name} has NaN/Inf"
        if got.numel() == 0:
            continue
        err = (got.float() - ref.float()).abs().max().item()
        low_err = (low.float() - ref.float()).abs().max().item()
        assert err <= 2 * low_err + slack, (f"{name}: max error {err:.3e} > 2 x torch low "
                                            f"precision {low_err:.3e}")
