"""Encoder + projector per modality: what an encoder microbatch runs to produce LLM-width embeddings."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from omni_train.models.audio import AudioConfig, AudioEncoder
from omni_train.models.projector import Projector
from omni_train.models.vit import VisionTransformer, ViTConfig

__all__ = ["AudioTower", "ImageTower"]


class ImageTower(nn.Module):
    """ViT then projector. Forward: ``(patches [N, 3*p*p], grids [n_img, 2]) -> [N / merge**2, llm_dim]``;
    with ``sp_group`` this rank's chunk of the packed images (``VisionTransformer``'s long-short SP)."""

    def __init__(self, cfg: ViTConfig, llm_dim: int, *, seed: int = 0) -> None:
        super().__init__()
        self.encoder = VisionTransformer(cfg, seed=seed)
        self.projector = Projector(
            cfg.out_dim, llm_dim, seed=seed + 1, norm=cfg.projector_norm, hidden=cfg.projector_hidden
        )

    def forward(
        self, patches: torch.Tensor, grids: torch.Tensor, sp_group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        return self.projector(self.encoder(patches, grids, sp_group))


class AudioTower(nn.Module):
    """Audio encoder then projector. Forward: ``(mels [F, n_mels], mel_lengths [n_clips]) -> [F', llm_dim]``."""

    def __init__(self, cfg: AudioConfig, llm_dim: int, *, seed: int = 0) -> None:
        super().__init__()
        self.encoder = AudioEncoder(cfg, seed=seed)
        self.projector = Projector(cfg.dim, llm_dim, seed=seed + 1)

    def forward(self, mels: torch.Tensor, mel_lengths: torch.Tensor) -> torch.Tensor:
        return self.projector(self.encoder(mels, mel_lengths))
