"""Token accounting after expansion and the encoder cost model used by packing and reordering.

Image: Qwen2-VL dynamic resolution. The image is resized so both sides are multiples of
``patch * merge`` (``smart_resize`` in Qwen2-VL's image processor) and its area lies in
``[min_pixels, max_pixels]``; it becomes ``(H/patch) * (W/patch)`` ViT patches and, after the
``merge x merge`` patch merger, ``patches / merge**2`` LLM tokens.
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
    "count_text_tokens",
    "resampled_length",
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

    def flops(self, seq_len: int) -> float:
        """Forward FLOPs for a sequence of ``seq_len`` tokens (0 for an empty one).

        Raises:
            ValueError: ``seq_len < 0``.
        """
        if seq_len < 0:
            raise ValueError(f"EncoderCost.flops: seq_len must be >= 0 tokens, got {seq_len}")
        return forward_flops(self.shape, [seq_len], causal=False)

    @property
    def shape(self) -> TransformerShape:
        """The encoder as omni-parallel's FLOP model sees it."""
        return TransformerShape(dim=self.hidden, n_layers=self.layers, mlp_ratio=self.mlp_ratio)
