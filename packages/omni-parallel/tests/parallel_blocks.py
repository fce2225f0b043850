"""A small pre-norm transformer block over packed tokens ``[T, dim]`` for the package's tests: LLaMA
module names (``attention.wq/wk/wv/wo``, ``feed_forward.w1/w2/w3``: ``llama_tp_plan``'s defaults) and the
two residual branches as methods (``attention_branch``, ``mlp_branch``) that selective recompute wraps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        # -1 heads: under TP each rank runs its local heads unchanged
        q, k, v = (w(x).view(t, -1, self.head_dim).transpose(0, 1) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(0, 1).reshape(t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 4, hidden: int = 24, *, seed: int = 0) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, hidden)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))

    def attention_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(self.attention_norm(x))

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.ffn_norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention_branch(x)
        return x + self.mlp_branch(x)


def blocks(n: int = 2, dtype: torch.dtype = torch.float64, **kwargs) -> nn.Sequential:
    """``n`` blocks in a row, seeded ``0 .. n-1``."""
    return nn.Sequential(*(Block(seed=i, **kwargs) for i in range(n))).to(dtype)
