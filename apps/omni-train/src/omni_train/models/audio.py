"""A tiny speech encoder: log-mel features in torch, x4 convolutional subsampling, a transformer.

The front end follows Whisper (Radford et al., 2022): 25 ms Hann windows every 10 ms at 16 kHz
(``n_fft=400``, ``hop=160``), a triangular mel filterbank on the HTK mel scale (built here, in torch),
``log10`` of the power clamped at 1e-10, then Whisper's dynamic-range clamp and scaling. Two stride-2
convolutions subsample time by 4 (one output frame per 40 ms), as in Conformer/USM front ends; a
bidirectional transformer with 1-D RoPE runs over the clips of a microbatch packed with ``cu_seqlens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omni_train.models.attention import rope_angles
from omni_train.models.encoder_block import EncoderBlock, init_linear_

__all__ = ["AudioConfig", "AudioEncoder", "log_mel", "mel_filterbank", "num_mel_frames", "num_output_frames"]


@dataclass(frozen=True)
class AudioConfig:
    """Audio encoder shape; ``sample_rate`` in Hz, ``n_fft``/``hop`` in samples."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_mels: int = 40
    sample_rate: int = 16000
    n_fft: int = 400
    hop: int = 160
    subsample: int = 4
    rope_theta: float = 10000.0


def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    return 2595.0 * torch.log10(1.0 + f / 700.0)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


def mel_filterbank(n_mels: int, n_fft: int, sample_rate: int) -> torch.Tensor:
    """Triangular filters evenly spaced on the HTK mel scale from 0 Hz to Nyquist.

    Returns:
        float64 ``[n_fft // 2 + 1, n_mels]`` (FFT bins x mel bands), each filter peaking at 1.
    """
    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    hi = _hz_to_mel(torch.tensor(sample_rate / 2, dtype=torch.float64))
    edges = _mel_to_hz(torch.linspace(0.0, float(hi), n_mels + 2, dtype=torch.float64))
    lower, center, upper = edges[:-2], edges[1:-1], edges[2:]
    up = (freqs[:, None] - lower[None, :]) / (center - lower)[None, :]
    down = (upper[None, :] - freqs[:, None]) / (upper - center)[None, :]
    return torch.clamp(torch.minimum(up, down), min=0.0)


def num_mel_frames(num_samples: int, hop: int = 160) -> int:
    """Frames :func:`log_mel` yields for ``num_samples`` samples (centered STFT: ``1 + S // hop``)."""
    return 1 + num_samples // hop


def num_output_frames(num_mel: int, subsample: int = 4) -> int:
    """Encoder output frames (LLM ``<|audio|>`` tokens) for ``num_mel`` mel frames: each stride-2 conv
    (kernel 3, padding 1) maps F to ``ceil(F / 2)``."""
    f = num_mel
    for _ in range(int(math.log2(subsample))):
        f = (f + 1) // 2
    return f


def log_mel(wave: torch.Tensor, cfg: AudioConfig) -> torch.Tensor:
    """Whisper-style log-mel spectrogram.

    Args:
        wave: ``[S]`` mono samples at ``cfg.sample_rate`` Hz, float in [-1, 1].

    Returns:
        ``[num_mel_frames(S), n_mels]`` in ``wave``'s dtype, roughly in [-1, 1].

    Raises:
        ValueError: ``wave`` is not 1-D or is empty.
    """
    if wave.dim() != 1 or wave.numel() == 0:
        raise ValueError(f"log_mel expects a non-empty 1-D waveform, got shape {tuple(wave.shape)}")
    window = torch.hann_window(cfg.n_fft, dtype=wave.dtype)
    spec = torch.stft(wave, cfg.n_fft, cfg.hop, window=window, center=True, return_complex=True)
    power = spec.abs().pow(2)  # [freq, frames]
    mel = mel_filterbank(cfg.n_mels, cfg.n_fft, cfg.sample_rate).to(wave.dtype).T @ power
    logm = torch.log10(mel.clamp(min=1e-10))
    logm = torch.maximum(logm, logm.max() - 8.0)
    return ((logm + 4.0) / 4.0).T.contiguous()


class AudioEncoder(nn.Module):
    """Conv subsampling (x4) + bidirectional transformer over packed clips.

    Forward:
        mels: ``[F_total, n_mels]`` log-mel frames of several clips, concatenated.
        mel_lengths: int64 ``[num_clips]`` frames per clip.

    Returns:
        ``[sum_i num_output_frames(mel_lengths[i]), dim]``: one embedding per LLM ``<|audio|>``
        placeholder, clips in order.

    Raises:
        ValueError: lengths that do not sum to ``F_total``.
    """

    def __init__(self, cfg: AudioConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.subsample not in (1, 2, 4, 8):
            raise ValueError(f"audio subsample must be a power of two <= 8, got {cfg.subsample}")
        convs, c = [], cfg.n_mels
        for _ in range(int(math.log2(cfg.subsample))):
            convs.append(nn.Conv1d(c, cfg.dim, kernel_size=3, stride=2, padding=1))
            c = cfg.dim
        self.convs = nn.ModuleList(convs)
        self.in_proj = nn.Linear(c, cfg.dim)
        self.blocks = nn.ModuleList(EncoderBlock(cfg.dim, cfg.n_heads) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        init_linear_(self, torch.Generator().manual_seed(seed), std=0.05)

    def forward(self, mels: torch.Tensor, mel_lengths: torch.Tensor) -> torch.Tensor:
        if int(mel_lengths.sum()) != mels.shape[0]:
            raise ValueError(f"mel_lengths {mel_lengths.tolist()} do not sum to {mels.shape[0]} frames")
        outs = []
        # Convolutions run clip by clip so no kernel window ever spans two clips.
        for clip in torch.split(mels, mel_lengths.tolist()):
            x = clip.T.unsqueeze(0)
            for conv in self.convs:
                x = F.gelu(conv(x))
            outs.append(x.squeeze(0).T)
        lengths = torch.tensor([o.shape[0] for o in outs], dtype=torch.int64)
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lengths, 0)
        pos = torch.cat([torch.arange(n) for n in lengths.tolist()])
        rope = rope_angles(pos, self.cfg.dim // self.cfg.n_heads, self.cfg.rope_theta)
        x = self.in_proj(torch.cat(outs))
        for blk in self.blocks:
            x = blk(x, rope, cu)
        return self.norm(x)
