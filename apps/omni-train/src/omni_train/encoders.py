"""The encoders of a run (one tower per modality) and how an encoder microbatch is computed.

Encoder parameters live on every pipeline rank (decoupled layout: encoder data parallelism spans every
rank); each rank runs the encoder microbatches the data flow places on it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from omni_data.payload import Payload
from omni_data.tokens import AudioTokens
from omni_train.batch import encoder_inputs
from omni_train.models.audio import AudioConfig
from omni_train.models.multimodal import AudioTower, ImageTower
from omni_train.models.vit import ViTConfig

__all__ = ["Encoders"]


class Encoders(nn.Module):
    """``image`` (ViT + projector) and ``audio`` (speech encoder + projector) towers, either optional.

    Forward:
        payloads: decoded samples of one encoder microbatch (images and/or audio), in output order.
        long: long-short SP (:mod:`omni_train.encoder_parallel`): the long images of this rank's encoder
            SP group, packed in this order, and the group; this rank encodes its chunk of them
            (``VisionTransformer``'s ``sp_group``) after the ``payloads``. Every rank of the group
            calls it with the same long images.

    Returns:
        ``[sum media_tokens, llm_dim]``: each sample's embeddings, samples in the given order; with
        ``long``, then this rank's ``ceil(L / sp)`` rows of the long images' ``L`` merged tokens
        (padding rows last on the last ranks).
    """

    def __init__(self, vit: ViTConfig | None, audio: AudioConfig | None, llm_dim: int, *, seed: int) -> None:
        super().__init__()
        self.vit_cfg, self.audio_cfg, self.llm_dim = vit, audio, llm_dim
        self.towers = nn.ModuleDict()
        if vit is not None:
            self.towers["image"] = ImageTower(vit, llm_dim, seed=seed + 100)
        if audio is not None:
            self.towers["audio"] = AudioTower(audio, llm_dim, seed=seed + 200)
        frame_ms = 1000.0 * (audio.hop if audio else 160) / (audio.sample_rate if audio else 16000)
        self.audio_tokens = AudioTokens(frame_ms=frame_ms, subsample=audio.subsample if audio else 4)

    def forward(
        self, payloads: list[Payload], long: tuple[list[Payload], dist.ProcessGroup] | None = None
    ) -> torch.Tensor:
        p0 = next(self.parameters())
        dtype, dev = p0.dtype, p0.device
        out = torch.zeros(0, self.llm_dim, dtype=dtype, device=dev)
        if payloads:
            out = self._whole(payloads, dtype, dev)
        if long is not None:
            images, group = long
            x = encoder_inputs(images, self.vit_cfg, self.audio_cfg, self.audio_tokens)
            chunk = self.towers["image"](x["patches"].to(dev, dtype), x["grids"], group)
            out = torch.cat([out, chunk])
        return out

    def _whole(self, payloads: list[Payload], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
        x = encoder_inputs(payloads, self.vit_cfg, self.audio_cfg, self.audio_tokens)
        outs, lengths = [], []
        if "patches" in x:
            outs.append(self.towers["image"](x["patches"].to(dev, dtype), x["grids"]))
            lengths += (x["grids"][:, 0] * x["grids"][:, 1] // self.vit_cfg.merge**2).tolist()
        if "mels" in x:
            outs.append(self.towers["audio"](x["mels"].to(dev, dtype), x["mel_lengths"]))
            lengths += [-(-n // self.audio_cfg.subsample) for n in x["mel_lengths"].tolist()]
        pieces = torch.cat(outs).split(lengths)
        return torch.cat([pieces[i] for i in x["order"].tolist()])
