"""Video members: their description before any decode, and frame decoding with PyAV (FFmpeg).

Metadata before payload: a video sample's ``key.json`` gives ``frames``, ``fps``, ``width`` and
``height`` (as the bundled shards and :mod:`omni_data.write` write them), so planning reads no payload
byte. Without them the member is read whole and its container header probed (:func:`probe_video`;
an MP4 may keep its index at the end), which counts the frames by demuxing packets, never by decoding.

Decoding (:func:`decode_frames`) runs in the payload reader, on the decode workers of
:class:`~omni_data.zero_redundancy.ZeroRedundancyFilter`: frames are decoded in presentation order up
to the last sampled index (inter-coded video cannot skip ahead without a seek index, and a seek lands on
key frames only), the sampled ones converted to RGB and resized with PIL bicubic exactly as images are
(:meth:`PIL.Image.Image.resize`), and returned ``[T, 3, H, W]`` float32 in ``[0, 1]``.

Hostile input (:mod:`omni_data.media_checks` reasons): a frame declaring more than ``max_pixels``
pixels (``"video over the pixel limit"``) or none (``"empty video"``), a video of no frames or no frame
rate (``"empty video"``), a 0-byte member (``"empty file"``): refused before any frame is decoded.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import av
import numpy as np
from PIL import Image

from omni_data.media_checks import MediaRefusedError

__all__ = [
    "VIDEO_EXTS",
    "VideoInfo",
    "decode_frames",
    "decoded_info",
    "encode_mp4",
    "probe_video",
    "video_info_from_json",
]

VIDEO_EXTS = ("mp4", "webm", "mkv", "mov", "avi", "ogv")


@dataclass(frozen=True, slots=True)
class VideoInfo:
    """A video's description: ``frames`` (count), ``fps`` (frames per second), ``height`` and ``width``
    (pixels of a decoded frame)."""

    frames: int
    fps: float
    height: int
    width: int

    def check(self, max_pixels: int) -> VideoInfo:
        """Itself, when it may be decoded.

        Raises:
            MediaRefusedError: no frames, no frame rate or no pixels (``"empty video"``), or a frame of
                more than ``max_pixels`` pixels (``"video over the pixel limit"``).
        """
        if (
            self.frames < 1
            or not (self.fps > 0 and math.isfinite(self.fps))
            or self.height < 1
            or self.width < 1
        ):
            raise MediaRefusedError(
                "empty video",
                f"{self.frames} frames at {self.fps} fps of {self.width} x {self.height} pixels",
            )
        if self.width * self.height > max_pixels:
            raise MediaRefusedError(
                "video over the pixel limit",
                f"frames of {self.width} x {self.height} = {self.width * self.height} pixels > {max_pixels}",
            )
        return self


def video_info_from_json(info: dict[str, Any]) -> VideoInfo | None:
    """The description ``key.json`` gives (``frames``, ``fps``, ``width``, ``height``), or ``None`` when
    one of them is missing.

    Raises:
        ValueError: a field that is not a number.
    """
    if not all(k in info for k in ("frames", "fps", "width", "height")):
        return None
    return VideoInfo(int(info["frames"]), float(info["fps"]), int(info["height"]), int(info["width"]))


def probe_video(data: bytes, max_pixels: int) -> VideoInfo:
    """Describe a whole video member from its container: frame size and rate from the first video
    stream's header, frames from the header's count or, when it has none, by demuxing every packet
    (no frame is decoded).

    Raises:
        MediaRefusedError: 0 bytes (``"empty file"``), or :meth:`VideoInfo.check`'s reasons.
        ValueError: no video stream, or the bytes are not a container FFmpeg reads (``av.FFmpegError``
            is re-raised as ``ValueError`` naming FFmpeg's message).
    """
    if not data:
        raise MediaRefusedError("empty file", "0 bytes")
    try:
        with av.open(io.BytesIO(data), "r") as c:
            if not c.streams.video:
                raise ValueError("no video stream")
            st = c.streams.video[0]
            rate = st.average_rate or st.guessed_rate
            info = VideoInfo(
                int(st.frames),
                float(rate) if rate else 0.0,
                int(st.codec_context.height),
                int(st.codec_context.width),
            )
            if info.frames < 1 and info.width * info.height <= max_pixels:
                frames = sum(1 for p in c.demux(st) if p.size)
                info = VideoInfo(frames, info.fps, info.height, info.width)
    except av.FFmpegError as e:
        raise ValueError(f"FFmpeg: {e}") from e
    return info.check(max_pixels)


def decoded_info(data: bytes, max_pixels: int) -> VideoInfo:
    """Describe a video by decoding all of it (:mod:`omni_data.write`: a damaged body is found when the
    shard is written, not in training): ``frames`` is the count the decoder produces (what the loader's
    frame indices address), ``fps`` the stream's average rate, the size that of the first frame.

    Raises:
        MediaRefusedError: as :func:`probe_video`, checked on the stream header before decoding.
        ValueError: no video stream, FFmpeg cannot decode it, or frames change size mid-stream.
    """
    head = probe_video(data, max_pixels)  # header checks (and refusals) before the decode
    n, size = 0, None
    try:
        with av.open(io.BytesIO(data), "r") as c:
            for frame in c.decode(c.streams.video[0]):
                if size is None:
                    size = (frame.height, frame.width)
                elif (frame.height, frame.width) != size:
                    raise ValueError(
                        f"frame {n} is {frame.width} x {frame.height}, frame 0 {size[1]} x {size[0]}"
                    )
                n += 1
    except av.FFmpegError as e:
        raise ValueError(f"FFmpeg: {e}") from e
    if size is None:
        raise MediaRefusedError("empty video", "no frame decodes")
    return VideoInfo(n, head.fps, size[0], size[1]).check(max_pixels)


def decode_frames(
    data: bytes, indices: list[int], size: tuple[int, int], max_pixels: int
) -> tuple[np.ndarray, int]:
    """Decode the frames at ``indices`` (increasing, 0-based, in presentation order) of a video member
    and resize each to ``size = (H, W)`` (PIL bicubic on RGB, as images).

    Returns:
        ``([T, 3, H, W] float32 in [0, 1], frames decoded)``: ``T = len(indices)``; frames decoded counts
        every frame the codec produced, up to and including the last sampled one.

    Raises:
        MediaRefusedError: the stream declares frames over ``max_pixels`` or of no pixels, before any
            frame is decoded.
        ValueError: no video stream, FFmpeg cannot decode it, or it has fewer frames than the last index
            needs (named with both counts).
    """
    if not indices:
        raise ValueError("no frame indices to decode")
    h, w = size
    out = np.empty((len(indices), 3, h, w), dtype=np.float32)
    want = iter(enumerate(indices))
    j, nxt = next(want)
    decoded = 0
    try:
        with av.open(io.BytesIO(data), "r") as c:
            if not c.streams.video:
                raise ValueError("no video stream")
            st = c.streams.video[0]
            cw, ch = int(st.codec_context.width), int(st.codec_context.height)
            if cw < 1 or ch < 1:
                raise MediaRefusedError("empty video", f"frames of {cw} x {ch} pixels")
            if cw * ch > max_pixels:
                raise MediaRefusedError(
                    "video over the pixel limit", f"frames of {cw} x {ch} = {cw * ch} pixels > {max_pixels}"
                )
            for frame in c.decode(st):
                i = decoded
                decoded += 1
                if frame.width * frame.height > max_pixels:
                    raise MediaRefusedError(
                        "video over the pixel limit",
                        f"frame {i} of {frame.width} x {frame.height} pixels > {max_pixels}",
                    )
                if i != nxt:
                    continue
                rgb = frame.to_image().resize((w, h), Image.Resampling.BICUBIC)
                # HWC -> CHW on uint8 in numpy, as images (payload.py)
                out[j] = np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
                nxt_item = next(want, None)
                if nxt_item is None:
                    out *= np.float32(1.0 / 255.0)
                    return out, decoded
                j, nxt = nxt_item
    except av.FFmpegError as e:
        raise ValueError(f"FFmpeg: {e}") from e
    raise ValueError(
        f"video decodes to {decoded} frames, frame {nxt} was sampled (index {j} of {len(indices)})"
    )


def encode_mp4(
    frames: np.ndarray | list[np.ndarray], fps: int, *, quality: int = 4, keyframe_interval: int | None = None
) -> bytes:
    """``[T, H, W, 3]`` uint8 RGB frames (``H``, ``W`` even) as an ``.mp4`` at ``fps`` frames per second:
    FFmpeg's own ``mpeg4`` encoder through PyAV, one thread, bit-exact flags (no encoder version string),
    so the same frames give the same bytes with the same PyAV/FFmpeg build.

    Args:
        quality: the fixed quantiser (``qmin = qmax``; PyAV frames carry no per-frame quality for
            FFmpeg's ``+qscale`` mode); lower is better.
        keyframe_interval: frames between key frames (FFmpeg's ``g``); ``None``: the encoder's default.
    """
    height, width = int(frames[0].shape[0]), int(frames[0].shape[1])
    options = {"flags": "+bitexact", "qmin": str(quality), "qmax": str(quality)}
    if keyframe_interval is not None:
        options["g"] = str(keyframe_interval)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4", options={"fflags": "+bitexact"}) as out:
        st = out.add_stream("mpeg4", rate=fps)
        st.width, st.height, st.pix_fmt = width, height, "yuv420p"
        st.thread_type = "NONE"
        st.codec_context.thread_count = 1
        st.codec_context.options = options
        for arr in frames:
            for packet in st.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(arr), format="rgb24")):
                out.mux(packet)
        for packet in st.encode():
            out.mux(packet)
    return buf.getvalue()
