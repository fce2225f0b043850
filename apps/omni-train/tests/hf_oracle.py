"""What the tests against transformers share: the tolerance, a perturbation that makes biases and norm
weights non-trivial (a freshly initialised model has zero biases and unit norms, which would hide a
mis-mapped bias or norm), and the closeness check."""

from __future__ import annotations

import torch

__all__ = ["TOL", "assert_close_at_tol", "perturb"]

TOL = 1e-5


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Biases ~ N(0, 0.1), norm weights ~ N(1, 0.1), everything else as initialised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif p.dim() == 1:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)


def assert_close_at_tol(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """``ours`` equals ``ref`` within :data:`TOL` (absolute), ``ref`` of a real scale (std > 0.1)."""
    assert ours.shape == ref.shape
    assert ref.std() > 0.1  # values of a real scale: a tolerance of 1e-5 means something
    torch.testing.assert_close(ours, ref, rtol=0, atol=TOL)
