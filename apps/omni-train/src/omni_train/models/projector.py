"""Per-encoder projector: [LayerNorm +] two-layer GELU MLP from encoder features to the LLM width.

The default is LLaVA-1.5's ``mlp2x_gelu`` connector (Liu et al., 2023): LayerNorm, ``in_dim -> llm_dim``,
GELU, ``llm_dim -> llm_dim``. ``norm=False, hidden=in_dim`` is the MLP of Qwen2-VL's patch merger
(``merger.mlp``: ``in_dim -> in_dim``, GELU, ``in_dim -> llm_dim``; its LayerNorm ``ln_q`` runs per patch
before the 2x2 merge, i.e. it is the ViT's final norm here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_train.models.encoder_block import init_linear_

__all__ = ["Projector"]


class Projector(nn.Module):
    """``[N, in_dim] -> [N, llm_dim]``.

    Args:
        in_dim: encoder features per token.
        llm_dim: LLM width.
        norm: LayerNorm over ``in_dim`` first.
        hidden: width of the hidden layer (default ``llm_dim``).
    """

    def __init__(
        self, in_dim: int, llm_dim: int, *, seed: int = 0, norm: bool = True, hidden: int | None = None
    ) -> None:
        super().__init__()
        hidden = llm_dim if hidden is None else hidden
        self.norm = nn.LayerNorm(in_dim) if norm else nn.Identity()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, llm_dim)
        init_linear_(self, torch.Generator().manual_seed(seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))
