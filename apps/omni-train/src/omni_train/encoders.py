"""The encoders of a run: one tower per modality, routed by omni-pipeline's
:class:`~omni_pipeline.ModalityRouter`, and the model-specific preprocessing of each tower's inputs.

Videos go through the image tower (Wang et al., "Qwen2-VL", 2024, §2.1 "unified image and video
understanding": one ViT, the same weights, for images and videos): the router sends ``video`` samples to
the ``image`` tower, whose input builder patchifies images and clips together (``ViTConfig.temporal_patch``
frames per patch; an image is its one frame repeated), grids ``[n, 3]`` ``(t, h, w)``.

Encoder parameters live on every pipeline rank (decoupled layout: encoder data parallelism spans every
rank); each rank runs the encoder microbatches the data flow places on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omni_data.payload import Payload
from omni_data.tokens import AudioTokens
from omni_pipeline import ModalityRouter, TowerBatch, TowerInputs
from omni_train.models.audio import AudioConfig, log_mel
from omni_train.models.multimodal import AudioTower, ImageTower
from omni_train.models.vit import ViTConfig, patchify_video

__all__ = ["VISION_ROUTES", "Encoders", "audio_inputs", "image_inputs"]

# modalities encoded by another modality's tower: videos by the image tower (Qwen2-VL's one ViT)
VISION_ROUTES = {"video": "image"}


def image_inputs(payloads: Sequence[Payload], vit: ViTConfig) -> TowerBatch:
    """The image tower's inputs for images and videos, in the given order:
    ``(patches [N, 3 * temporal_patch * patch**2], grids int64 [n, 3])`` and ``t * grid_h * grid_w /
    merge**2`` rows per sample.

    An image (``pixels [3, H, W]``) is one frame repeated ``vit.temporal_patch`` times, grid ``(1, h, w)``;
    a video (``frames [F, 3, H, W]``) is :func:`~omni_train.models.vit.patchify_video`'s
    ``ceil(F / temporal_patch)`` temporal slices (the last frame repeated up to a multiple).

    Raises:
        ValueError: a sample that is neither an image nor a video (no pixels, no frames), or whose patch
            grid does not give its metadata's media tokens (names it).
    """
    patches, grids, rows = [], [], []
    for p in payloads:
        m = p.meta
        if p.frames is not None:
            frames = p.frames
        elif p.pixels is not None:
            frames = p.pixels[None]
        else:
            raise ValueError(f"sample {m.uid}: {m.modality} has no pixels or frames for the image tower")
        x, grid = patchify_video(frames, vit.patch, vit.merge, vit.temporal_patch)
        if grid[0] * grid[1] * grid[2] // vit.merge**2 != m.media_tokens:
            raise ValueError(f"sample {m.uid}: {grid} patch grid does not give {m.media_tokens} tokens")
        patches.append(x)
        grids.append(grid)
        rows.append(m.media_tokens)
    return TowerBatch((torch.cat(patches), torch.tensor(grids, dtype=torch.int64)), rows)


def audio_inputs(payloads: Sequence[Payload], audio: AudioConfig, tokens: AudioTokens) -> TowerBatch:
    """The audio tower's inputs: ``(mels [F, n_mels], mel_lengths int64 [n_clips])``, and
    ``ceil(frames / subsample)`` rows per clip.

    Raises:
        ValueError: a clip whose sample rate is not the encoder's (names it).
    """
    mels, lengths = [], []
    for p in payloads:
        m = p.meta
        if p.sample_rate != audio.sample_rate:
            raise ValueError(
                f"sample {m.uid}: sample rate {p.sample_rate} Hz, the encoder takes {audio.sample_rate}"
            )
        frames = tokens.frames(p.waveform.numel(), p.sample_rate)
        # The STFT yields 1 + S // hop frames; the token accounting counts floor(S / hop).
        mel = log_mel(p.waveform.to(torch.float32), audio)[:frames]
        mels.append(mel)
        lengths.append(mel.shape[0])
    rows = [-(-n // audio.subsample) for n in lengths]
    return TowerBatch((torch.cat(mels), torch.tensor(lengths, dtype=torch.int64)), rows)


class Encoders(ModalityRouter):
    """``image`` (ViT + projector; also encodes ``video`` samples, :data:`VISION_ROUTES`) and ``audio``
    (speech encoder + projector) towers, either optional.

    Forward (:class:`~omni_pipeline.ModalityRouter`): ``(payloads, long=None) -> [sum media_tokens,
    llm_dim]``, each sample's embeddings in the given order; with ``long`` (long-short SP:
    :mod:`omni_pipeline.encoder_parallel`), then this rank's ``ceil(L / sp)`` rows of the long images'
    ``L`` merged tokens (``VisionTransformer``'s ``sp_group``).
    """

    def __init__(self, vit: ViTConfig | None, audio: AudioConfig | None, llm_dim: int, *, seed: int) -> None:
        towers: dict[str, torch.nn.Module] = {}
        inputs: dict[str, TowerInputs] = {}
        if vit is not None:
            towers["image"] = ImageTower(vit, llm_dim, seed=seed + 100)
            inputs["image"] = lambda payloads: image_inputs(payloads, vit)
        if audio is not None:
            tokens = AudioTokens(frame_ms=1000.0 * audio.hop / audio.sample_rate, subsample=audio.subsample)
            towers["audio"] = AudioTower(audio, llm_dim, seed=seed + 200)
            inputs["audio"] = lambda payloads: audio_inputs(payloads, audio, tokens)
        routes = {m: t for m, t in VISION_ROUTES.items() if t in towers}
        super().__init__(towers, inputs, llm_dim, routes=routes)
