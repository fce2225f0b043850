"""Per-encoder projector: LayerNorm + two-layer GELU MLP from encoder features to the LLM width
(LLaVA-1.5's ``mlp2x_gelu`` connector, Liu et al., 2023)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_train.models.encoder_block import init_linear_

__all__ = ["Projector"]


class Projector(nn.Module):
    """``[N, in_dim] -> [N, llm_dim]``."""

    def __init__(self, in_dim: int, llm_dim: int, *, seed: int = 0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(in_dim)
        self.fc1 = nn.Linear(in_dim, llm_dim)
        self.fc2 = nn.Linear(llm_dim, llm_dim)
        init_linear_(self, torch.Generator().manual_seed(seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))
