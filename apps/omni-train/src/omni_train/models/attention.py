"""Packed (varlen) attention and rotary position embeddings shared by the ViT, audio encoder and LLM.

Packing puts several documents (samples) into one sequence; ``cu_seqlens`` (cumulative lengths, int64
``[num_docs + 1]``, starting at 0 and ending at the packed length) marks their boundaries. Attention never
crosses a boundary: every token attends only to tokens of its own document (causally for the LLM,
bidirectionally for encoders). The mask is materialised as a ``[T, T]`` boolean block-diagonal matrix,
which is the right trade for the tiny sequence lengths this app trains on (T <= a few thousand).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["apply_rope", "doc_ids", "rope_angles", "varlen_attention"]


def doc_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of every packed position.

    Args:
        cu_seqlens: int64 ``[num_docs + 1]``, non-decreasing, ``cu_seqlens[0] == 0``.
        total: packed length T (tokens).

    Returns:
        int64 ``[T]``: ``doc_ids[t] = d`` where ``cu_seqlens[d] <= t < cu_seqlens[d + 1]``.

    Raises:
        ValueError: ``cu_seqlens`` does not start at 0 or does not end at ``total``.
    """
    if cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the packed length {total}, got {cu_seqlens.tolist()}"
        )
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *, causal: bool
) -> torch.Tensor:
    """Scaled dot-product attention over packed documents, never across a ``cu_seqlens`` boundary.

    Args:
        q: ``[T, heads_q, head_dim]``.
        k, v: ``[T, heads_kv, head_dim]`` with ``heads_q % heads_kv == 0`` (GQA: each KV head serves
            ``heads_q // heads_kv`` consecutive query heads, as in LLaMA).
        cu_seqlens: int64 ``[num_docs + 1]`` document boundaries (tokens).
        causal: mask future positions inside each document.

    Returns:
        ``[T, heads_q, head_dim]``.

    Raises:
        ValueError: head counts not divisible, or ``cu_seqlens`` inconsistent with T.
    """
    t, hq, _ = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not divisible by key/value heads {hkv}")
    ids = doc_ids(cu_seqlens, t)
    mask = ids[:, None] == ids[None, :]
    if causal:
        mask = mask & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if hkv != hq:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


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
