"""A tiny speech encoder: log-mel features in torch, x4 convolutional subsampling, a transformer.

The front end follows Whisper (Radford et al., 2022): 25 ms Hann windows every 10 ms at 16 kHz
(``n_fft=400``, ``hop=160``), a triangular mel filterbank on the HTK mel scale (built here, in torch),
``log10`` of the power clamped at 1e-10, then Whisper's dynamic-range clamp and scaling. Two stride-2
convolutions subsample time by 4 (one output frame per 40 ms), as in Conformer/USM front ends; a
bidirectional transformer with 1-D RoPE runs over the clips of a microbatch packed with ``cu_seqlens``.

Whisper's encoder exactly (``WhisperEncoder``, :mod:`omni_train.hf.audio` converts its checkpoints):
``stem="whisper"`` (a stride-1 then a stride-2 convolution, kernel 3, GELU after each, no input
projection; ``subsample = 2``), ``positions="sinusoidal"`` (Whisper's sin/cos table added after the stem,
a buffer of ``max_positions`` rows) and ``mel_scale="slaney"`` (Whisper's feature extractor: Slaney mel
scale, area-normalised filters). Whisper pads every clip to 30 s and attends over the padding; here clips
are packed unpadded and attend only to themselves, which equals Whisper's forward on a clip of exactly
``2 * max_positions`` mel frames. The feature extractor drops the STFT's last frame; :func:`log_mel`
keeps it (``1 + S // hop`` frames), the other frames agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import nn

from omni_train.models.attention import rope_angles
from omni_train.models.encoder_block import Activation, EncoderBlock, init_linear_

__all__ = [
    "AudioConfig",
    "AudioEncoder",
    "AudioPositions",
    "AudioStem",
    "MelScale",
    "log_mel",
    "mel_filterbank",
    "num_mel_frames",
    "num_output_frames",
    "sinusoids",
]


class AudioStem(StrEnum):
    """``stride2``: ``log2(subsample)`` stride-2 convolutions, then a linear projection; ``whisper``: a
    stride-1 then a stride-2 convolution (``subsample = 2``), no projection."""

    STRIDE2 = "stride2"
    WHISPER = "whisper"


class AudioPositions(StrEnum):
    """``rope``: 1-D rotary positions inside attention; ``sinusoidal``: Whisper's table added to the input."""

    ROPE = "rope"
    SINUSOIDAL = "sinusoidal"


class MelScale(StrEnum):
    """``htk``: ``2595 log10(1 + f / 700)``, filters peaking at 1; ``slaney``: linear below 1 kHz, log above,
    area-normalised filters (librosa's default, Whisper's)."""

    HTK = "htk"
    SLANEY = "slaney"


@dataclass(frozen=True)
class AudioConfig:
    """Audio encoder shape; ``sample_rate`` in Hz, ``n_fft``/``hop`` in samples.

    ``mlp_ratio``, ``norm_eps``, ``act`` shape the blocks; ``stem``, ``positions`` (``max_positions``: rows
    of the sinusoidal table, output frames per clip at most) and ``mel_scale`` are described above.
    """

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_mels: int = 40
    sample_rate: int = 16000
    n_fft: int = 400
    hop: int = 160
    subsample: int = 4
    rope_theta: float = 10000.0
    mlp_ratio: int = 4
    norm_eps: float = 1e-5
    act: Activation = Activation.GELU
    stem: AudioStem = AudioStem.STRIDE2
    positions: AudioPositions = AudioPositions.ROPE
    max_positions: int = 1500
    mel_scale: MelScale = MelScale.HTK


# Slaney's mel scale (Auditory Toolbox; librosa's htk=False): linear, 3 mels per 200 Hz, up to 1 kHz
# (15 mels), then logarithmic with 27 mels per factor 6.4.
_SLANEY_HZ, _SLANEY_MEL, _SLANEY_STEP = 1000.0, 15.0, math.log(6.4) / 27.0


def _hz_to_mel(f: torch.Tensor, scale: MelScale) -> torch.Tensor:
    if scale is MelScale.HTK:
        return 2595.0 * torch.log10(1.0 + f / 700.0)
    log = _SLANEY_MEL + torch.log(f.clamp(min=_SLANEY_HZ) / _SLANEY_HZ) / _SLANEY_STEP
    return torch.where(f >= _SLANEY_HZ, log, 3.0 * f / 200.0)


def _mel_to_hz(m: torch.Tensor, scale: MelScale) -> torch.Tensor:
    if scale is MelScale.HTK:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    log = _SLANEY_HZ * torch.exp(_SLANEY_STEP * (m - _SLANEY_MEL))
    return torch.where(m >= _SLANEY_MEL, log, 200.0 * m / 3.0)


def mel_filterbank(
    n_mels: int, n_fft: int, sample_rate: int, scale: MelScale | str = MelScale.HTK
) -> torch.Tensor:
    """Triangular filters evenly spaced on a mel scale from 0 Hz to Nyquist.

    Returns:
        float64 ``[n_fft // 2 + 1, n_mels]`` (FFT bins x mel bands): ``htk`` filters peak at 1, ``slaney``
        filters are divided by half their width in Hz (area normalisation, librosa's ``norm="slaney"``).

    Raises:
        ValueError: an unknown ``scale``.
    """
    scale = MelScale(scale)
    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    hi = _hz_to_mel(torch.tensor(sample_rate / 2, dtype=torch.float64), scale)
    edges = _mel_to_hz(torch.linspace(0.0, float(hi), n_mels + 2, dtype=torch.float64), scale)
    lower, center, upper = edges[:-2], edges[1:-1], edges[2:]
    up = (freqs[:, None] - lower[None, :]) / (center - lower)[None, :]
    down = (upper[None, :] - freqs[:, None]) / (upper - center)[None, :]
    filters = torch.clamp(torch.minimum(up, down), min=0.0)
    if scale is MelScale.SLANEY:
        filters = filters * (2.0 / (upper - lower))[None, :]
    return filters


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's sinusoidal position table (Radford et al., 2022; Vaswani et al., 2017), float32.

    Returns:
        ``[length, channels]``: ``[sin(p * w_i) | cos(p * w_i)]`` with ``w_i = max_timescale ** (-i /
        (channels / 2 - 1))``, ``i < channels / 2``, computed as Whisper computes it.

    Raises:
        ValueError: ``channels`` odd or below 4.
    """
    if channels % 2 or channels < 4:
        raise ValueError(f"sinusoidal positions need an even channel count >= 4, got {channels}")
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2))
    scaled = torch.arange(length).view(-1, 1) * inv_timescales.view(1, -1)
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


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
    mel = mel_filterbank(cfg.n_mels, cfg.n_fft, cfg.sample_rate, cfg.mel_scale).to(wave.dtype).T @ power
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
        ValueError: lengths that do not sum to ``F_total``; a clip longer than ``max_positions`` output
            frames with sinusoidal positions; (construction) a subsample the stem cannot do.
    """

    def __init__(self, cfg: AudioConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.subsample not in (1, 2, 4, 8):
            raise ValueError(f"audio subsample must be a power of two <= 8, got {cfg.subsample}")
        convs, c = [], cfg.n_mels
        if AudioStem(cfg.stem) is AudioStem.WHISPER:
            if cfg.subsample != 2:
                raise ValueError(f"the whisper audio stem subsamples by 2, got subsample {cfg.subsample}")
            convs = [nn.Conv1d(c, cfg.dim, 3, padding=1), nn.Conv1d(cfg.dim, cfg.dim, 3, stride=2, padding=1)]
            self.in_proj: nn.Module = nn.Identity()
        else:
            for _ in range(int(math.log2(cfg.subsample))):
                convs.append(nn.Conv1d(c, cfg.dim, kernel_size=3, stride=2, padding=1))
                c = cfg.dim
            self.in_proj = nn.Linear(c, cfg.dim)
        self.convs = nn.ModuleList(convs)
        self.blocks = nn.ModuleList(
            EncoderBlock(cfg.dim, cfg.n_heads, cfg.mlp_ratio, norm_eps=cfg.norm_eps, act=cfg.act)
            for _ in range(cfg.n_layers)
        )
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.sinusoidal = AudioPositions(cfg.positions) is AudioPositions.SINUSOIDAL
        if self.sinusoidal:
            # A buffer, not a parameter (Whisper freezes it): saved with the model, never trained.
            self.register_buffer("pos_embed", sinusoids(cfg.max_positions, cfg.dim))
        init_linear_(self, torch.Generator().manual_seed(seed), std=0.05)

    def forward(self, mels: torch.Tensor, mel_lengths: torch.Tensor) -> torch.Tensor:
        if int(mel_lengths.sum()) != mels.shape[0]:
            raise ValueError(f"mel_lengths {mel_lengths.tolist()} do not sum to {mels.shape[0]} frames")
        outs = []
        # Convolutions run clip by clip so no kernel window ever spans two clips.
        for clip in torch.split(mels, mel_lengths.tolist()):
            x = clip.T.unsqueeze(0)
            for conv in self.convs:
                x = F.gelu(conv(x))  # Whisper too: exact GELU after each convolution
            outs.append(x.squeeze(0).T)
        lengths = torch.tensor([o.shape[0] for o in outs], dtype=torch.int64)
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lengths, 0)
        pos = torch.cat([torch.arange(n) for n in lengths.tolist()])
        x = self.in_proj(torch.cat(outs))
        rope = None
        if self.sinusoidal:
            if int(lengths.max()) > self.cfg.max_positions:
                raise ValueError(
                    f"audio clip of {int(lengths.max())} output frames exceeds max_positions "
                    f"{self.cfg.max_positions} (sinusoidal positions)"
                )
            x = x + self.pos_embed[pos.to(x.device)].to(x.dtype)
        else:
            rope = rope_angles(pos.to(x.device), self.cfg.dim // self.cfg.n_heads, self.cfg.rope_theta)
        for blk in self.blocks:
            x = blk(x, rope, cu)
        return self.norm(x)
