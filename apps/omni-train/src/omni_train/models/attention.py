"""Rotary position embeddings shared by the ViT, the audio encoder and the LLM.

Packed (varlen) attention itself has one entry point for every model: ``omni_parallel.varlen.varlen_attention``
(one attention per ``cu_seqlens`` document, never across a boundary).
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_angles"]


def rope_angles(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding cos/sin for integer positions (Su et al., RoFormer, 2021).

    Args:
        positions: int64 ``[T]`` (restarting at 0 per packed document for the LLM).
        dim: rotated width (even).
        theta: base wavelength.

    Returns:
        ``(cos, sin)``, each float ``[T, dim // 2]`` in float64 (cast by :func:`apply_rope`).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim))
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[..., i], x[..., i + d/2])`` by the given angles (the LLaMA "rotate half" layout).

    Args:
        x: ``[T, heads, d]``.
        cos, sin: ``[T, d // 2]``.

    Returns:
        ``[T, heads, d]`` in ``x``'s dtype.
    """
    half = x.shape[-1] // 2
    c = cos.to(x.dtype)[:, None, :]
    s = sin.to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
