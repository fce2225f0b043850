"""Sample metadata and payload references: what every rank knows before any payload is read.

A sample travels through the pipeline as a :class:`SampleMeta` (small, msgpack-serialisable, identical on
every rank that holds the same loader state). Its payload (image pixels, audio waveform, video frames, text
token ids)
is read and decoded only where it is consumed, from the :class:`MemberRef` byte ranges the metadata
carries (DESIGN.md §omni-data: "metadata before payload"; paper §5.2 zero-redundancy loaders).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = ["MemberRef", "Modality", "SampleMeta"]


class Modality(StrEnum):
    """What the encoder of a sample is; text samples have no encoder (only LLM tokens), nor do
    generation samples (a caption, then an image as discrete code tokens the LLM predicts:
    :mod:`omni_data.image_generation`)."""

    IMAGE = "image"
    AUDIO = "audio"
    TEXT = "text"
    VIDEO = "video"
    GENERATION = "generation"

    @property
    def encoded(self) -> bool:
        """Whether samples of this modality have encoder work (image, audio, video)."""
        return self not in (Modality.TEXT, Modality.GENERATION)


@dataclass(frozen=True, slots=True)
class MemberRef:
    """Byte range of one tar member: ``url`` (fsspec), ``offset`` and ``size`` in bytes, ``ext`` (``png``)."""

    url: str
    offset: int
    size: int
    ext: str

    def to_list(self) -> list[Any]:
        return [self.url, self.offset, self.size, self.ext]

    @classmethod
    def from_list(cls, v: list[Any]) -> MemberRef:
        return cls(str(v[0]), int(v[1]), int(v[2]), str(v[3]))


@dataclass(frozen=True, slots=True)
class SampleMeta:
    """Everything known about a sample before its payload is decoded.

    Token layout inside a pack: ``media_tokens`` encoder embeddings first (image or video patches after
    merge, or audio frames after subsampling), then ``text_tokens`` LLM tokens (caption, transcript or text). For a
    text sample split because it is longer than the pack, ``text_range`` is the ``[start, end)`` slice of
    its token ids that this piece holds.

    Attributes:
        key: WebDataset sample key (``__key__``), unique within its source.
        source: name of the source that produced it.
        modality: the sample's :class:`Modality`.
        media_tokens: expanded encoder tokens (0 for text).
        text_tokens: LLM text tokens of this piece (a generation sample's caption, ``boi``, ``h*w`` codes
            and ``eoi``: :mod:`omni_data.image_generation`).
        encoder_flops: forward FLOPs of the encoder for this sample (0 for text); see :mod:`omni_data.tokens`.
        shape: payload shape after decoding: ``(3, H, W)`` resized pixels, ``(T, 3, H, W)`` sampled and
            resized video frames, ``(num_samples,)`` mono waveform at the source sample rate,
            ``(text_tokens,)`` for text, the ``(h, w)`` code grid of a generation sample's image.
        members: byte ranges of the sample's tar members, by extension.
        text_range: ``(start, end)`` token slice for split text, else ``None``.
        epoch: the source epoch the sample was read in.
        sample_rate: audio sample rate in Hz (``None`` for images and text), so a reader can describe
            the waveform without decoding it.
        frames: video only: frames in the whole video (``None`` otherwise); the ``shape[0]`` sampled
            ones are its frames ``omni_data.tokens.sampled_frame_indices(frames, shape[0])``.
        fps: video only: the video's frame rate, frames per second (``None`` otherwise).
    """

    key: str
    source: str
    modality: Modality
    media_tokens: int
    text_tokens: int
    encoder_flops: float
    shape: tuple[int, ...]
    members: dict[str, MemberRef] = field(default_factory=dict)
    text_range: tuple[int, int] | None = None
    epoch: int = 0
    sample_rate: int | None = None
    frames: int | None = None
    fps: float | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens the sample occupies in an LLM sequence (media + text)."""
        return self.media_tokens + self.text_tokens

    @property
    def uid(self) -> str:
        """Identity across sources and split pieces: ``source/key`` plus ``@start`` for a split piece."""
        base = f"{self.source}/{self.key}"
        return base if self.text_range is None else f"{base}@{self.text_range[0]}"

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack-serialisable form (a few hundred bytes; no payload). ``frames`` and ``fps`` only
        for a video, so the states of runs without video are what they were before video existed."""
        out = {
            "key": self.key,
            "source": self.source,
            "modality": str(self.modality),
            "media_tokens": self.media_tokens,
            "text_tokens": self.text_tokens,
            "encoder_flops": self.encoder_flops,
            "shape": list(self.shape),
            "members": {k: m.to_list() for k, m in self.members.items()},
            "text_range": None if self.text_range is None else list(self.text_range),
            "epoch": self.epoch,
            "sample_rate": self.sample_rate,
        }
        if self.frames is not None:
            out["frames"], out["fps"] = self.frames, self.fps
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SampleMeta:
        return cls(
            key=d["key"],
            source=d["source"],
            modality=Modality(d["modality"]),
            media_tokens=int(d["media_tokens"]),
            text_tokens=int(d["text_tokens"]),
            encoder_flops=float(d["encoder_flops"]),
            shape=tuple(int(x) for x in d["shape"]),
            members={k: MemberRef.from_list(v) for k, v in d["members"].items()},
            text_range=None
            if d["text_range"] is None
            else (int(d["text_range"][0]), int(d["text_range"][1])),
            epoch=int(d.get("epoch", 0)),
            sample_rate=None if d.get("sample_rate") is None else int(d["sample_rate"]),
            frames=None if d.get("frames") is None else int(d["frames"]),
            fps=None if d.get("fps") is None else float(d["fps"]),
        )
