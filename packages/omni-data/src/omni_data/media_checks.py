"""Hostile media refused before the expensive decode: declared image sizes, decoded waveforms.

Shards and media folders are untrusted input. A PNG of a few hundred bytes can declare 50,000 x 50,000
pixels (a decompression bomb: 7.5 GB of RGB once decoded, minutes of CPU); an image can declare no pixels
at all; a float WAV of NaN or Inf samples decodes as fast as a good one and turns the first loss that
sees it, then every loss of the run, into NaN (its log-mel features are non-finite). These checks run
where the size or the samples are known but nothing large has been computed: on the image header (PIL's
``Image.open`` parses it without decoding; ``load`` decodes) and on the PCM samples right after
``soundfile`` decodes them, before resampling and mel features.

Used by the metadata pass (:class:`~omni_data.source.WebDatasetSource`, on the header bytes), the payload
reader (:class:`~omni_data.payload.PayloadReader`) and the shard writer (:mod:`omni_data.write`), so a
file refused by one is refused by all, under the same reason.

Source: PIL's own bomb guard (``Image.MAX_IMAGE_PIXELS``, ``DecompressionBombError`` above twice it),
here with an explicit limit per caller instead of PIL's process-wide setting; PNG's IHDR layout (PNG
spec, 11.2.2).
"""

from __future__ import annotations

import io
import struct

import numpy as np
from PIL import Image

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "MAX_AUDIO_AMPLITUDE",
    "MediaRefusedError",
    "open_image",
    "waveform_problem",
]

# 8192 x 8192: above any image a ViT here resizes from in practice; 192 MiB of RGB at most per decode.
# Below PIL's own error bound (2 x Image.MAX_IMAGE_PIXELS = 178,956,970), so this limit decides.
DEFAULT_MAX_IMAGE_PIXELS = 1 << 26
# A float WAV holds [-1, 1] nominally, +-32768 when written on an int16 scale. Larger values are not
# sound: their STFT power overflows float32 (|x| ~ 1e17) into Inf log-mel features.
MAX_AUDIO_AMPLITUDE = 65536.0

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class MediaRefusedError(ValueError):
    """Media refused before decoding; ``reason`` is the short, stable reason skip reports count under
    (``"empty file"``, ``"empty image"``, ``"image over the pixel limit"``, ``"empty audio"``,
    ``"non-finite audio samples"``, ``"audio amplitude over 65536"``), the message says more."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason} ({detail})")
        self.reason = reason


def _png_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` declared by a PNG's IHDR chunk, or ``None`` when ``data`` is not a PNG."""
    if len(data) < 24 or not data.startswith(_PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return None
    w, h = struct.unpack(">II", data[16:24])
    return w, h


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """``Image.open`` on ``data`` (the whole file or its first bytes: only the header is parsed), refusing
    what must not be decoded. The caller closes the image (``with``).

    Args:
        data: the image file's bytes, or a prefix holding its header.
        max_pixels: the most ``width * height`` accepted, >= 1.

    Raises:
        MediaRefusedError: no bytes (``"empty file"``); a width or height of 0 (``"empty image"``: PNG's
            IHDR is read directly, PIL refuses such files as unidentified); more than ``max_pixels``
            pixels, or PIL's ``DecompressionBombError`` (``"image over the pixel limit"``).
        Exception: whatever PIL raises for bytes that are not an image it can parse.
    """
    if not data:
        raise MediaRefusedError("empty file", "0 bytes")
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise MediaRefusedError("image over the pixel limit", str(e)) from e
    except Exception:
        declared = _png_size(data)
        if declared is not None and 0 in declared:
            raise MediaRefusedError("empty image", f"declared {declared[0]} x {declared[1]}") from None
        raise
    w, h = im.size
    if w < 1 or h < 1 or w * h > max_pixels:
        im.close()
        if w < 1 or h < 1:
            raise MediaRefusedError("empty image", f"declared {w} x {h}")
        raise MediaRefusedError(
            "image over the pixel limit", f"declared {w} x {h} = {w * h} pixels > {max_pixels}"
        )
    return im


def waveform_problem(wave: np.ndarray) -> MediaRefusedError | None:
    """Why decoded PCM samples (``[frames]`` or ``[frames, channels]``, float) must not be trained on,
    or ``None``: no frames (``"empty audio"``), a NaN or Inf sample (``"non-finite audio samples"``), a
    sample beyond :data:`MAX_AUDIO_AMPLITUDE` (``"audio amplitude over 65536"``). One pass over the
    samples (a max of absolute values, which NaN propagates through)."""
    if wave.shape[0] == 0:
        return MediaRefusedError("empty audio", "0 frames")
    peak = float(np.max(np.abs(wave)))
    if not np.isfinite(peak):
        bad = int(np.count_nonzero(~np.isfinite(wave)))
        return MediaRefusedError("non-finite audio samples", f"{bad} of {wave.size} samples NaN or Inf")
    if peak > MAX_AUDIO_AMPLITUDE:
        return MediaRefusedError(f"audio amplitude over {MAX_AUDIO_AMPLITUDE:g}", f"peak {peak:g}")
    return None
