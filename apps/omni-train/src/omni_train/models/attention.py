"""Rotary position embeddings shared by the ViT, the audio encoder and the LLM.

Packed (varlen) attention itself has one entry point for every model: ``omni_parallel.varlen.varlen_attention``
(one attention per ``cu_seqlens`` document, never across a boundary).
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "mrope_angles", "rope_angles"]


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


def mrope_angles(
    positions: torch.Tensor, dim: int, theta: float, section: tuple[int, ...] | list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary embedding cos/sin (M-RoPE; Wang et al., "Qwen2-VL", 2024, §2.1; ``transformers``'
    ``Qwen2VLRotaryEmbedding``): frequency ``i`` of the ``dim // 2`` rotates with the temporal position
    for the first ``section[0]`` frequencies, with the height position for the next ``section[1]`` and
    with the width position for the last ``section[2]``.

    Args:
        positions: int64 ``[3, T]`` (temporal, height, width); for text all three rows are equal, which
            gives 1-D RoPE exactly (:func:`rope_angles`). An int64 ``[T]`` is taken as text.
        dim: rotated width (even).
        theta: base wavelength.
        section: frequencies per axis, ``sum(section) == dim // 2`` (Qwen2-VL's ``mrope_section``).

    Returns:
        ``(cos, sin)``, each float64 ``[T, dim // 2]`` (the layout :func:`apply_rope` takes).

    Raises:
        ValueError: ``section`` does not have 3 non-negative entries summing to ``dim // 2``, or
            ``positions`` is not ``[3, T]`` / ``[T]``.
    """
    if len(section) != 3 or min(section) < 0 or sum(section) != dim // 2:
        raise ValueError(
            f"model.llm.mrope_section {list(section)} must be 3 non-negative counts summing to "
            f"head_dim / 2 = {dim // 2}"
        )
    if positions.dim() == 1:
        positions = positions[None].expand(3, -1)
    if positions.dim() != 2 or positions.shape[0] != 3:
        raise ValueError(f"M-RoPE positions must be [3, T] or [T], got {tuple(positions.shape)}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim))
    axis = torch.repeat_interleave(
        torch.arange(3, device=positions.device), torch.tensor(list(section)).to(positions.device)
    )
    # angle of frequency i at token t: positions[axis[i], t] * inv_freq[i]
    ang = positions.to(torch.float64)[axis].T * inv_freq[None, :]
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
