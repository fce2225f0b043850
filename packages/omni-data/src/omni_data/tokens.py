"""Token accounting after expansion and the encoder cost model used by packing and reordering.

Image: Qwen2-VL dynamic resolution. The image is resized so both sides are multiples of
``patch * merge`` (``smart_resize`` in Qwen2-VL's image processor) and its area lies in
``[min_pixels, max_pixels]``; it becomes ``(H/patch) * (W/patch)`` ViT patches and, after the
``merge x merge`` patch merger, ``patches / merge**2`` LLM tokens.
Video: Qwen2-VL's video path. Frames are sampled at ``fps`` per second (at least ``min_frames``, at most
``max_frames`` and the video's own count, rounded down to a multiple of the temporal patch; Hugging Face
``Qwen2VLVideoProcessor.sample_frames``), each resized like an image (``smart_resize`` with the video
pixel bounds), and every ``temporal_patch`` frames become one grid step: ``(T/2) * (H/14) * (W/14)``
ViT patches, ``(T/2) * (H/28) * (W/28)`` LLM tokens after the merger.
Audio: a mel front end at ``frame_ms`` hop, then a convolutional subsampler by ``subsample``.
Cost: forward FLOPs of a transformer encoder over its sequence, with the quadratic attention term, from
omni-parallel's one FLOP model (:mod:`omni_parallel.flops`; Kaplan et al. 2020 counting: 2 FLOPs per
multiply-add), so the balancer ranks work as the pipeline planner and the MFU count it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from omni_parallel.flops import TransformerShape, forward_flops

__all__ = [
    "AudioTokens",
    "EncoderCost",
    "ImageTokens",
    "TextTokenizer",
    "VideoTokens",
    "count_text_tokens",
    "resampled_length",
    "sampled_frame_indices",
]


class TextTokenizer(Protocol):
    """Anything with ``encode(str).ids`` (a ``tokenizers.Tokenizer`` is one)."""

    def encode(self, text: str): ...


def count_text_tokens(tokenizer: TextTokenizer, text: str) -> int:
    """Number of token ids ``tokenizer`` gives ``text`` (tokens)."""
    return len(tokenizer.encode(text).ids)


@dataclass(frozen=True, slots=True)
class ImageTokens:
    """Dynamic-resolution image token count (Qwen2-VL ``smart_resize``).

    Args:
        patch: ViT patch side, pixels.
        merge: patch-merger side (``merge x merge`` patches become one LLM token).
        min_pixels: smallest resized area, pixels.
        max_pixels: largest resized area, pixels.
    """

    patch: int = 14
    merge: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 14 * 14 * 4 * 1280

    def __post_init__(self) -> None:
        if self.patch < 1 or self.merge < 1:
            raise ValueError(f"ImageTokens: patch ({self.patch}) and merge ({self.merge}) must be >= 1")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"ImageTokens: need 0 < min_pixels ({self.min_pixels}) <= max_pixels ({self.max_pixels})"
            )

    def resize(self, height: int, width: int) -> tuple[int, int]:
        """Resized ``(H, W)`` in pixels, both multiples of ``patch * merge``.

        Raises:
            ValueError: a side is < 1 pixel.
        """
        if height < 1 or width < 1:
            raise ValueError(f"image size must be positive, got {height}x{width}")
        factor = self.patch * self.merge
        h = max(factor, round(height / factor) * factor)
        w = max(factor, round(width / factor) * factor)
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return h, w

    def patches(self, height: int, width: int) -> int:
        """ViT patches (encoder sequence length) of an image of ``height x width`` pixels."""
        h, w = self.resize(height, width)
        return (h // self.patch) * (w // self.patch)

    def tokens(self, height: int, width: int) -> int:
        """LLM tokens after the patch merger."""
        return self.patches(height, width) // (self.merge * self.merge)


@dataclass(frozen=True, slots=True)
class VideoTokens:
    """Video token count and frame sampling, as Qwen2-VL (Wang et al. 2024, §2.1 "unified image and
    video understanding"; Hugging Face ``Qwen2VLVideoProcessor``: ``sample_frames``, ``resize``,
    ``patchify``).

    Args:
        fps: frames sampled per second of video.
        min_frames: fewest frames sampled (before the video's own count and the temporal patch bound it).
        max_frames: most frames sampled.
        temporal_patch: frames per ViT patch along time (Qwen2-VL: 2; a shorter tail is padded by
            repeating the last frame, so ``ceil(T / temporal_patch)`` grid steps).
        frame: per-frame resize (``smart_resize``: sides multiples of ``patch * merge``, area within
            ``[min_pixels, max_pixels]``); defaults are Qwen2-VL's video bounds, 128 and 768 tokens of
            28 x 28 pixels. Images and videos share ``patch`` and ``merge`` (the same ViT).

    Raises:
        ValueError: ``fps`` <= 0, ``min_frames`` < 1, ``max_frames`` < ``min_frames``, or
            ``temporal_patch`` < 1.
    """

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    temporal_patch: int = 2
    frame: ImageTokens = ImageTokens(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28)

    def __post_init__(self) -> None:
        if not self.fps > 0 or self.min_frames < 1 or self.max_frames < self.min_frames:
            raise ValueError(
                f"VideoTokens: need fps ({self.fps}) > 0 and 1 <= min_frames ({self.min_frames}) "
                f"<= max_frames ({self.max_frames})"
            )
        if self.temporal_patch < 1:
            raise ValueError(f"VideoTokens: temporal_patch must be >= 1, got {self.temporal_patch}")

    def num_sampled(self, frames: int, fps: float) -> int:
        """Frames sampled from a video of ``frames`` frames at ``fps`` frames per second:
        ``n = frames / fps * self.fps`` clamped to ``[min_frames, min(max_frames, frames)]`` (the upper
        bound rounded down to a multiple of ``temporal_patch``) and rounded down to a multiple of
        ``temporal_patch``; a video of fewer frames than ``temporal_patch`` keeps all of them.

        Raises:
            ValueError: ``frames`` < 1 or ``fps`` <= 0.
        """
        if frames < 1 or not fps > 0:
            raise ValueError(f"video must have frames and a frame rate, got {frames} frames at {fps} fps")
        tp = self.temporal_patch
        top = math.floor(min(self.max_frames, frames) / tp) * tp
        n = min(max(frames / fps * self.fps, self.min_frames), top, frames)
        n = math.floor(n / tp) * tp
        return n if n >= 1 else frames

    def indices(self, frames: int, fps: float) -> list[int]:
        """Indices of the sampled frames: :func:`sampled_frame_indices` of :meth:`num_sampled` frames."""
        return sampled_frame_indices(frames, self.num_sampled(frames, fps))

    def grid(self, frames: int, fps: float, height: int, width: int) -> tuple[int, int, int]:
        """``(t, h, w)`` ViT patch grid (``video_grid_thw``) of a video of ``frames`` frames of
        ``height x width`` pixels at ``fps``."""
        t = -(-self.num_sampled(frames, fps) // self.temporal_patch)
        rh, rw = self.frame.resize(height, width)
        return t, rh // self.frame.patch, rw // self.frame.patch

    def patches(self, frames: int, fps: float, height: int, width: int) -> int:
        """ViT patches (encoder sequence length): ``t * h * w`` of :meth:`grid`."""
        t, h, w = self.grid(frames, fps, height, width)
        return t * h * w

    def tokens(self, frames: int, fps: float, height: int, width: int) -> int:
        """LLM tokens after the ``merge x merge`` patch merger."""
        return self.patches(frames, fps, height, width) // (self.frame.merge * self.frame.merge)


def sampled_frame_indices(frames: int, n: int) -> list[int]:
    """Indices (0-based, increasing) of ``n`` frames sampled uniformly from ``frames``:
    ``arange(0, frames, frames / n)`` truncated to ints, computed as Hugging Face's
    ``Qwen2VLVideoProcessor.sample_frames`` does (a float32 ``torch.arange``), so the same frames. Only
    ``frames`` and ``n`` matter, so a reader needs no sampling settings (``SampleMeta.frames`` and
    ``shape[0]``).

    Raises:
        ValueError: not ``1 <= n <= frames``.
    """
    if not 1 <= n <= frames:
        raise ValueError(f"cannot sample {n} of {frames} video frames")
    import torch  # a dependency of the package; imported here so the token counters stay light

    return [int(i) for i in torch.arange(0, frames, frames / n).int().tolist()][:n]


def resampled_length(num_samples: int, rate: int, target: int) -> int:
    """Samples of a clip of ``num_samples`` at ``rate`` Hz after resampling to ``target`` Hz:
    ``round(num_samples * target / rate)`` (half up, integer arithmetic), at least 1. The metadata
    pass and the reader both use it, so token counts match the decoded waveform exactly."""
    return max(1, (num_samples * target + rate // 2) // rate)


@dataclass(frozen=True, slots=True)
class AudioTokens:
    """Audio token count: mel frames at ``frame_ms`` hop, then subsampling by ``subsample``.

    Args:
        frame_ms: mel hop, milliseconds.
        subsample: convolutional subsampling factor (frames per LLM token).
    """

    frame_ms: float = 10.0
    subsample: int = 4

    def __post_init__(self) -> None:
        if self.frame_ms <= 0 or self.subsample < 1:
            raise ValueError(
                f"AudioTokens: frame_ms ({self.frame_ms}) > 0 and subsample ({self.subsample}) >= 1"
            )

    def frames(self, num_samples: int, sample_rate: int) -> int:
        """Mel frames of a clip of ``num_samples`` at ``sample_rate`` Hz (at least 1).

        Raises:
            ValueError: ``num_samples < 1`` or ``sample_rate < 1``.
        """
        if num_samples < 1 or sample_rate < 1:
            raise ValueError(
                f"audio must have samples and a rate, got {num_samples} samples at {sample_rate} Hz"
            )
        hop = sample_rate * self.frame_ms / 1000.0
        return max(1, math.floor(num_samples / hop))

    def tokens(self, num_samples: int, sample_rate: int) -> int:
        """LLM tokens (= encoder sequence length after subsampling)."""
        return -(-self.frames(num_samples, sample_rate) // self.subsample)


@dataclass(frozen=True, slots=True)
class EncoderCost:
    """Forward FLOPs of a pre-norm transformer encoder (multi-head attention, two-matmul GELU MLP,
    bidirectional attention) over one sample: :func:`omni_parallel.flops.forward_flops`.

    Per layer over ``n`` tokens of width ``d``: ``2*n*(4*d^2)`` for Q, K, V and output projections,
    ``2*n*(2*mlp_ratio*d^2)`` for the MLP, ``2*2*n^2*d`` for ``Q K^T`` and ``A V`` (the quadratic term).

    Args:
        hidden: model width ``d``.
        layers: number of transformer layers.
        mlp_ratio: MLP hidden width over ``d``.

    Raises:
        ValueError: ``hidden`` or ``layers`` < 1, or ``mlp_ratio`` < 0.
    """

    hidden: int = 1024
    layers: int = 24
    mlp_ratio: float = 4.0

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.layers < 1 or not self.mlp_ratio >= 0:
            raise ValueError(
                f"EncoderCost: hidden ({self.hidden}) and layers ({self.layers}) must be >= 1, "
                f"mlp_ratio ({self.mlp_ratio}) >= 0"
            )

    def flops(self, seq_len: int, slices: int = 1) -> float:
        """Forward FLOPs for a sequence of ``seq_len`` tokens (0 for an empty one) whose attention runs
        within ``slices`` equal parts (a video's temporal slices: Qwen2-VL's vision tower attends within
        each temporal patch step; 1 for an image or a clip).

        Raises:
            ValueError: ``seq_len < 0``, ``slices < 1`` or ``slices`` not dividing ``seq_len``.
        """
        if seq_len < 0 or slices < 1 or seq_len % slices:
            raise ValueError(
                f"EncoderCost.flops: seq_len must be >= 0 tokens in slices >= 1 equal parts, got {seq_len} "
                f"tokens in {slices}"
            )
        return forward_flops(self.shape, [seq_len // slices] * slices, causal=False)

    @property
    def shape(self) -> TransformerShape:
        """The encoder as omni-parallel's FLOP model sees it."""
        return TransformerShape(dim=self.hidden, n_layers=self.layers, mlp_ratio=self.mlp_ratio)
