"""A VQ image tokenizer: RGB images <-> a grid of discrete codes, for "understanding with generation".

The LLM predicts images as discrete tokens (Chameleon / Janus style): this module turns an image into
``h x w`` code ids from a codebook of ``K`` entries and back. It is a VQ-VAE (van den Oord et al. 2017,
"Neural Discrete Representation Learning", §3.1-3.2: nearest-neighbour quantisation, straight-through
gradient, codebook + commitment losses) with the encoder/decoder of Esser et al. 2021 ("Taming
Transformers", VQGAN, without the GAN and perceptual losses: residual conv blocks, stride-2 downsampling,
nearest upsampling) and the l2-normalised low-dimensional code lookup of Yu et al. 2022 ("Vector-quantized
Image Modeling with Improved VQGAN", §3.2 "factorized codes" and "l2-normalized codes"), which keeps most
codes in use without EMA updates.

Images enter at ``S x S`` (``S = config.image_size``): :func:`letterbox` scales a decoded image
``[3, H, W]`` so its longer side is ``S`` and pads the rest with white (clip art sits on white). The
encoder downsamples by ``config.downsample`` to a ``h x w`` grid; code ids are raster order (row by row)
when flattened (:meth:`ImageTokenizer.encode_image`).

Weights are safetensors (no pickle) with a JSON sidecar of the same stem (``image-tokenizer.safetensors``
and ``image-tokenizer.json``) holding the config, the file's sha256 and size, and how it was trained;
:meth:`ImageTokenizer.load` checks both before building anything. The committed weights are
:data:`DEFAULT_IMAGE_TOKENIZER_PATH`, trained by ``omni-train prepare-data --source image-tokenizer``
(:mod:`omni_train.prepare.image_tokenizer`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DEFAULT_IMAGE_TOKENIZER_PATH",
    "FORMAT",
    "MAX_SIDECAR_BYTES",
    "MAX_WEIGHTS_BYTES",
    "ImageTokenizer",
    "ImageTokenizerConfig",
    "ImageTokenizerFileError",
    "letterbox",
    "psnr",
    "sidecar_path",
]

FORMAT = "omni-image-tokenizer/1"
"""The ``format`` written in the safetensors metadata and the sidecar; another value is refused."""
MAX_WEIGHTS_BYTES = 64 << 20
"""The largest weights file :meth:`ImageTokenizer.load` reads (64 MiB; the committed one is < 2 MiB)."""
MAX_SIDECAR_BYTES = 1 << 20
"""The largest sidecar JSON :meth:`ImageTokenizer.load` reads (1 MiB)."""
MAX_HEADER_BYTES = 1 << 20
"""The largest safetensors JSON header :meth:`ImageTokenizer.load` parses (1 MiB)."""

DEFAULT_IMAGE_TOKENIZER_PATH = Path(__file__).resolve().parent.parent / "data" / "image-tokenizer.safetensors"
"""The committed weights, trained on the bundled openclipart shards (sidecar beside it)."""


class ImageTokenizerFileError(ValueError):
    """A weights file or its sidecar is missing, too large, damaged, of another checksum or config."""


@dataclass(frozen=True, slots=True)
class ImageTokenizerConfig:
    """Shape of an :class:`ImageTokenizer`.

    Attributes:
        image_size: ``S``, the side of the square input and output images, pixels.
        downsample: ``S / h``, a power of two >= 2 (one stride-2 conv per factor of two); ``S`` must
            be divisible by it.
        channels: conv width (every conv runs at ``S/2`` or below).
        res_blocks: residual blocks per resolution level.
        code_dim: features per code (the l2-normalised lookup space).
        codebook_size: ``K``, codes in the codebook; ids are ``0 .. K-1``.
        beta: commitment loss weight (van den Oord et al. 2017 use 0.25).
    """

    image_size: int = 32
    downsample: int = 4
    channels: int = 64
    res_blocks: int = 1
    code_dim: int = 16
    codebook_size: int = 512
    beta: float = 0.25

    def __post_init__(self) -> None:
        for name in (
            "image_size",
            "downsample",
            "channels",
            "res_blocks",
            "code_dim",
            "codebook_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"ImageTokenizerConfig.{name}: expected an integer, got {value!r}")
        if not 8 <= self.image_size <= 1024:
            raise ValueError(f"ImageTokenizerConfig.image_size: must be in [8, 1024], got {self.image_size}")
        d = self.downsample
        if d < 2 or d & (d - 1) or self.image_size % d:
            raise ValueError(
                f"ImageTokenizerConfig.downsample: must be a power of two >= 2 dividing image_size "
                f"{self.image_size}, got {d}"
            )
        if not 1 <= self.channels <= 1024:
            raise ValueError(f"ImageTokenizerConfig.channels: must be in [1, 1024], got {self.channels}")
        if not 0 <= self.res_blocks <= 16:
            raise ValueError(f"ImageTokenizerConfig.res_blocks: must be in [0, 16], got {self.res_blocks}")
        if not 1 <= self.code_dim <= 1024:
            raise ValueError(f"ImageTokenizerConfig.code_dim: must be in [1, 1024], got {self.code_dim}")
        if not 2 <= self.codebook_size <= 1 << 20:
            raise ValueError(
                f"ImageTokenizerConfig.codebook_size: must be in [2, 2**20], got {self.codebook_size}"
            )
        if not isinstance(self.beta, (int, float)) or not (math.isfinite(self.beta) and self.beta >= 0):
            raise ValueError(f"ImageTokenizerConfig.beta: must be a finite number >= 0, got {self.beta!r}")

    @property
    def grid(self) -> tuple[int, int]:
        """``(h, w)``: the code grid of one image."""
        side = self.image_size // self.downsample
        return side, side

    @property
    def tokens(self) -> int:
        """``h * w``: codes per image."""
        h, w = self.grid
        return h * w

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "config") -> ImageTokenizerConfig:
        """A config from a dict (a sidecar's or safetensors metadata's ``config``).

        Raises:
            ValueError: not a dict, an unknown or missing field, or a value out of range; the message
                starts with ``where``.
        """
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object of config fields, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        missing = sorted(set(names) - set(data))
        if unknown or missing:
            raise ValueError(f"{where}: unknown fields {unknown}, missing fields {missing} (fields: {names})")
        try:
            return cls(**data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from e


class _ResBlock(nn.Module):
    """``x + conv(silu(conv(silu(x))))`` at constant width (VQGAN's ResnetBlock without normalisation)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.silu(self.conv1(F.silu(x))))


class ImageTokenizer(nn.Module):
    """VQ-VAE: ``[n, 3, S, S]`` pixels in ``[0, 1]`` <-> ``[n, h, w]`` int64 codes in ``[0, K)``.

    Encoder: 2x2 pixel unshuffle (``[3, S, S] -> [12, S/2, S/2]``, Shi et al. 2016 "ESPCN") and a 3x3
    conv to ``channels``; per further factor of two, ``res_blocks`` residual blocks and a stride-2 3x3
    conv; ``res_blocks`` more; SiLU and a 1x1 conv to ``code_dim``. Quantiser: the encoder output
    and every codebook row are l2-normalised; each position takes the nearest row (largest cosine; ties
    to the lowest id). Decoder: the mirror image with nearest x2 upsampling + 3x3 conv, ending in SiLU, a
    3x3 conv to 12 channels and a 2x2 pixel shuffle to RGB (``(out + 1) / 2``: pixels).

    Args:
        config: the shape (:class:`ImageTokenizerConfig`; default: S=32, 8x8 grid, K=512).
        seed: seeds the initial weights (a private ``torch.Generator``; same seed, same weights).
    """

    def __init__(self, config: ImageTokenizerConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        self.config = cfg = config if config is not None else ImageTokenizerConfig()
        c, levels = cfg.channels, int(math.log2(cfg.downsample))
        # full resolution only through (un)shuffling 2x2 pixel blocks into channels: no conv at S x S
        enc: list[nn.Module] = [nn.PixelUnshuffle(2), nn.Conv2d(12, c, 3, padding=1)]
        for _ in range(levels - 1):
            enc += [_ResBlock(c) for _ in range(cfg.res_blocks)]
            enc.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
        enc += [_ResBlock(c) for _ in range(cfg.res_blocks)]
        enc += [nn.SiLU(), nn.Conv2d(c, cfg.code_dim, 1)]
        self.encoder = nn.Sequential(*enc)
        self.codebook = nn.Embedding(cfg.codebook_size, cfg.code_dim)
        dec: list[nn.Module] = [nn.Conv2d(cfg.code_dim, c, 3, padding=1)]
        dec += [_ResBlock(c) for _ in range(cfg.res_blocks)]
        for _ in range(levels - 1):
            dec += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(c, c, 3, padding=1)]
            dec += [_ResBlock(c) for _ in range(cfg.res_blocks)]
        dec += [nn.SiLU(), nn.Conv2d(c, 12, 3, padding=1), nn.PixelShuffle(2)]
        self.decoder = nn.Sequential(*dec)
        self._init_weights(torch.Generator().manual_seed(seed))

    def _init_weights(self, gen: torch.Generator) -> None:
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Conv2d):
                    nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=gen)  # torch's default
                    nn.init.zeros_(module.bias)
            for module in self.modules():
                if isinstance(module, _ResBlock):  # residual branches start small: blocks near identity
                    module.conv2.weight.mul_(0.1)
            self.codebook.weight.copy_(torch.randn(self.codebook.weight.shape, generator=gen))

    @property
    def grid(self) -> tuple[int, int]:
        """``(h, w)``: the code grid of one image."""
        return self.config.grid

    @property
    def codebook_size(self) -> int:
        """``K``: code ids are ``0 .. K-1``."""
        return self.config.codebook_size

    def _check_pixels(self, pixels: torch.Tensor) -> None:
        s = self.config.image_size
        if not isinstance(pixels, torch.Tensor) or not pixels.is_floating_point():
            raise ValueError(
                f"ImageTokenizer: pixels must be a float tensor [n, 3, {s}, {s}], got {pixels!r:.80}"
            )
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (3, s, s):
            raise ValueError(f"ImageTokenizer: pixels must be [n, 3, {s}, {s}], got {list(pixels.shape)}")

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """The l2-normalised encoder output ``[n, code_dim, h, w]`` (before quantisation)."""
        self._check_pixels(pixels)
        return F.normalize(self.encoder(pixels * 2.0 - 1.0), dim=1)

    def _nearest(self, z: torch.Tensor) -> torch.Tensor:
        # z: [n, d, h, w] unit vectors -> ids [n, h, w]; largest cosine == smallest l2 distance on the sphere
        book = F.normalize(self.codebook.weight, dim=1)
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        ids = torch.argmax(flat @ book.t(), dim=1)
        return ids.view(z.shape[0], z.shape[2], z.shape[3])

    def _lookup(self, codes: torch.Tensor) -> torch.Tensor:
        # ids [n, h, w] -> unit code vectors [n, d, h, w]
        return F.normalize(self.codebook(codes), dim=-1).permute(0, 3, 1, 2)

    def _decode(self, z_q: torch.Tensor) -> torch.Tensor:
        return (self.decoder(z_q) + 1.0) * 0.5

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encode, quantise, decode: the training pass.

        Args:
            pixels: ``[n, 3, S, S]`` float RGB in ``[0, 1]``.

        Returns:
            ``(recon, vq_loss, codes)``: ``recon`` ``[n, 3, S, S]`` (not clamped, for the reconstruction
            loss), ``vq_loss`` a scalar, ``||sg[z_e] - e||^2 + beta ||z_e - sg[e]||^2`` (codebook +
            commitment, means over positions and features; van den Oord et al. 2017 eq. 3, on the
            l2-normalised vectors), ``codes`` ``[n, h, w]`` int64. The decoder gets the quantised codes
            with the straight-through estimator ``z_e + sg[e - z_e]``, so the reconstruction gradient
            reaches the encoder.

        Raises:
            ValueError: ``pixels`` is not a float tensor of that shape.
        """
        z = self.embed(pixels)
        codes = self._nearest(z.detach())
        z_q = self._lookup(codes)
        vq_loss = F.mse_loss(z_q, z.detach()) + self.config.beta * F.mse_loss(z, z_q.detach())
        recon = self._decode(z + (z_q - z).detach())
        return recon, vq_loss, codes

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[n, 3, S, S]`` float RGB in ``[0, 1]`` -> ``[n, h, w]`` int64 codes in ``[0, K)``.

        Raises:
            ValueError: ``pixels`` is not a float tensor of that shape.
        """
        return self._nearest(self.embed(pixels.to(self.codebook.weight.dtype)))

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``[n, h, w]`` int64 codes -> ``[n, 3, S, S]`` float RGB clamped to ``[0, 1]``.

        Raises:
            ValueError: ``codes`` is not an int64 tensor ``[n, h, w]`` with every id in ``[0, K)``.
        """
        h, w = self.grid
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.int64:
            raise ValueError(
                f"ImageTokenizer.decode: codes must be an int64 tensor [n, {h}, {w}], got {codes!r:.80}"
            )
        if codes.dim() != 3 or tuple(codes.shape[1:]) != (h, w):
            raise ValueError(f"ImageTokenizer.decode: codes must be [n, {h}, {w}], got {list(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(
                f"ImageTokenizer.decode: code ids must be in [0, {self.codebook_size}), got "
                f"[{int(codes.min())}, {int(codes.max())}]"
            )
        return self._decode(self._lookup(codes)).clamp_(0.0, 1.0)

    @torch.no_grad()
    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """One decoded image ``[3, H, W]`` (any size, float RGB in ``[0, 1]``, e.g. ``Payload.pixels``) ->
        its ``h * w`` code ids, int64, raster order (row by row): :func:`letterbox` then :meth:`encode`.

        Raises:
            ValueError: ``pixels`` is not a float tensor ``[3, H, W]``.
        """
        return self.encode(letterbox(pixels, self.config.image_size)[None]).reshape(-1)

    def save(self, path: str | Path, *, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write the weights to ``path`` (safetensors, float32, config in the metadata) and the sidecar
        :func:`sidecar_path` (config, sha256 and size of the weights file, and ``extra``: how it was
        trained, held-out PSNR, ...).

        Returns:
            The sidecar's content.

        Raises:
            ValueError: ``extra`` uses a key the sidecar itself writes.
        """
        path = Path(path)
        sidecar = {"format": FORMAT, "weights": path.name, "config": self.config.to_dict()}
        if extra and set(extra) & {*sidecar, "sha256", "bytes"}:
            raise ValueError(
                f"ImageTokenizer.save: extra may not set {sorted(set(extra) & {*sidecar, 'sha256', 'bytes'})}"
            )
        tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in self.state_dict().items()}
        meta = {"format": FORMAT, "config": json.dumps(self.config.to_dict(), sort_keys=True)}
        data = safetensors.torch.save(tensors, metadata=meta)
        path.parent.mkdir(parents=True, exist_ok=True)
        sidecar |= {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), **(extra or {})}
        _write_atomic(path, data)
        _write_atomic(sidecar_path(path), (json.dumps(sidecar, indent=1, sort_keys=True) + "\n").encode())
        return sidecar

    @classmethod
    def load(cls, path: str | Path = DEFAULT_IMAGE_TOKENIZER_PATH) -> ImageTokenizer:
        """The tokenizer saved at ``path`` (safetensors) with its sidecar, frozen (eval, no gradients).

        Checked before anything is built: both files exist and are within :data:`MAX_WEIGHTS_BYTES` /
        :data:`MAX_SIDECAR_BYTES`; the sidecar is a JSON object of this :data:`FORMAT`; the file's size
        and sha256 equal the sidecar's; the safetensors header parses, its config equals the sidecar's;
        every tensor has the name, shape and dtype (float32) the config gives and finite values.

        Raises:
            ImageTokenizerFileError: any check fails; the message names the file and what is wrong.
        """
        path = Path(path)
        side = sidecar_path(path)
        sidecar = _read_sidecar(side)
        data = _read_bounded(path, MAX_WEIGHTS_BYTES, "weights")
        if len(data) != sidecar.get("bytes") or hashlib.sha256(data).hexdigest() != sidecar.get("sha256"):
            raise ImageTokenizerFileError(
                f"image tokenizer {path}: {len(data)} bytes with sha256 {hashlib.sha256(data).hexdigest()}, "
                f"but {side} says {sidecar.get('bytes')} bytes with sha256 {sidecar.get('sha256')} "
                "(a damaged or replaced file)"
            )
        try:
            config = ImageTokenizerConfig.from_dict(
                sidecar.get("config"), where=f"image tokenizer {side}: config"
            )
        except ValueError as e:
            raise ImageTokenizerFileError(str(e)) from e
        header_config = _header_config(data, path)
        if header_config != config.to_dict():
            raise ImageTokenizerFileError(
                f"image tokenizer {path}: the config in its metadata {header_config} differs from {side}'s "
                f"{config.to_dict()}"
            )
        try:
            tensors = safetensors.torch.load(data)
        except Exception as e:  # safetensors raises its own error types for a damaged body
            raise ImageTokenizerFileError(
                f"image tokenizer {path}: not a readable safetensors file: {e}"
            ) from e
        model = cls(config)
        want = model.state_dict()
        if set(tensors) != set(want):
            raise ImageTokenizerFileError(
                f"image tokenizer {path}: tensors missing {sorted(set(want) - set(tensors))}, "
                f"unexpected {sorted(set(tensors) - set(want))}"
            )
        for name, t in tensors.items():
            if t.dtype != torch.float32 or t.shape != want[name].shape:
                raise ImageTokenizerFileError(
                    f"image tokenizer {path}: tensor {name} is {t.dtype} {list(t.shape)}, "
                    f"expected torch.float32 {list(want[name].shape)}"
                )
            if not torch.isfinite(t).all():
                raise ImageTokenizerFileError(f"image tokenizer {path}: tensor {name} holds NaN or Inf")
        model.load_state_dict(tensors)
        model.eval().requires_grad_(False)
        return model


def sidecar_path(path: str | Path) -> Path:
    """The sidecar JSON of a weights file: same folder and stem, ``.json``."""
    return Path(path).with_suffix(".json")


def _write_atomic(path: Path, data: bytes) -> None:
    # a reader never sees a half-written file: write beside it, then rename over it
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    if not path.is_file():
        raise ImageTokenizerFileError(f"image tokenizer {what} {path}: no such file")
    size = path.stat().st_size
    if size > limit:
        raise ImageTokenizerFileError(
            f"image tokenizer {what} {path}: {size} bytes, more than the {limit} allowed"
        )
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while being read
        raise ImageTokenizerFileError(f"image tokenizer {what} {path}: more than the {limit} bytes allowed")
    return data


def _read_sidecar(side: Path) -> dict[str, Any]:
    raw = _read_bounded(side, MAX_SIDECAR_BYTES, "sidecar")
    try:
        sidecar = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ImageTokenizerFileError(f"image tokenizer sidecar {side}: not JSON: {e}") from e
    if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT:
        got = sidecar.get("format") if isinstance(sidecar, dict) else type(sidecar).__name__
        raise ImageTokenizerFileError(f"image tokenizer sidecar {side}: format {got!r}, expected {FORMAT!r}")
    return sidecar


def _header_config(data: bytes, path: Path) -> Any:
    # safetensors layout: u64 little-endian header length, then that many bytes of JSON
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 < n <= min(MAX_HEADER_BYTES, len(data) - 8):
        raise ImageTokenizerFileError(f"image tokenizer {path}: not a safetensors file (header length {n})")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
        meta = header["__metadata__"]
        if meta["format"] != FORMAT:
            raise ValueError(f"format {meta['format']!r}, expected {FORMAT!r}")
        return json.loads(meta["config"])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, KeyError, TypeError, ValueError) as e:
        raise ImageTokenizerFileError(f"image tokenizer {path}: bad safetensors metadata: {e}") from e


def letterbox(pixels: torch.Tensor, size: int) -> torch.Tensor:
    """A decoded image ``[3, H, W]`` (float RGB in ``[0, 1]``) -> ``[3, size, size]``: scaled so its longer
    side is ``size`` (bilinear, antialiased; aspect ratio kept, each side at least 1 pixel), centred on
    white, clamped to ``[0, 1]``. float32 out.

    Raises:
        ValueError: ``pixels`` is not a float tensor ``[3, H, W]`` with ``H, W >= 1``, or ``size`` < 1.
    """
    if not isinstance(pixels, torch.Tensor) or not pixels.is_floating_point():
        raise ValueError(f"letterbox: pixels must be a float tensor [3, H, W], got {pixels!r:.80}")
    if pixels.dim() != 3 or pixels.shape[0] != 3 or pixels.shape[1] < 1 or pixels.shape[2] < 1:
        raise ValueError(f"letterbox: pixels must be [3, H, W] with H, W >= 1, got {list(pixels.shape)}")
    if size < 1:
        raise ValueError(f"letterbox: size must be >= 1, got {size}")
    _, h, w = pixels.shape
    scale = size / max(h, w)
    nh, nw = min(size, max(1, round(h * scale))), min(size, max(1, round(w * scale)))
    img = pixels.to(torch.float32)[None]
    if (nh, nw) != (h, w):
        img = F.interpolate(img, size=(nh, nw), mode="bilinear", align_corners=False, antialias=True)
    out = torch.ones(3, size, size, dtype=torch.float32)
    top, left = (size - nh) // 2, (size - nw) // 2
    out[:, top : top + nh, left : left + nw] = img[0].clamp(0.0, 1.0)
    return out


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Peak signal-to-noise ratio of ``a`` against ``b`` (pixels in ``[0, 1]``, peak 1), in dB:
    ``10 log10(1 / MSE)`` with the MSE over every element (a whole set pooled, not a mean of per-image
    values); capped at 100 dB for identical inputs.

    Raises:
        ValueError: the shapes differ or the tensors are empty.
    """
    if a.shape != b.shape or a.numel() == 0:
        raise ValueError(
            f"psnr: need two non-empty tensors of one shape, got {list(a.shape)} and {list(b.shape)}"
        )
    mse = float(torch.mean((a.double() - b.double()) ** 2))
    return 100.0 if mse <= 1e-10 else 10.0 * math.log10(1.0 / mse)
