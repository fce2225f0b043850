"""The bidirectional transformer block both encoders use (pre-LayerNorm, GELU MLP, RoPE, per-sample attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_parallel.varlen import varlen_attention
from omni_train.models.attention import apply_rope

__all__ = ["EncoderBlock", "init_linear_"]


def init_linear_(module: nn.Module, gen: torch.Generator, std: float = 0.02) -> None:
    """Draw every 2-D ``weight`` from N(0, std^2) with ``gen`` and zero every bias (deterministic init)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("weight") and p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).mul_(std).to(p.dtype))
            elif name.endswith("bias"):
                p.zero_()


class EncoderBlock(nn.Module):
    """``x + attn(ln(x))``, ``x + mlp(ln(x))``; attention is bidirectional inside each packed sample.

    Forward:
        x: ``[T, dim]`` packed tokens of several samples.
        rope: ``(cos, sin)`` each ``[T, head_dim // 2]``.
        cu_seqlens: int64 ``[num_samples + 1]`` sample boundaries (tokens).

    Returns:
        ``[T, dim]``.
    """

    def __init__(self, dim: int, n_heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"encoder dim {dim} not divisible by n_heads {n_heads}")
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).view(t, 3, self.n_heads, self.head_dim).unbind(1)
        a = varlen_attention(apply_rope(q, *rope), apply_rope(k, *rope), v, cu_seqlens, causal=False)
        x = x + self.proj(a.reshape(t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
