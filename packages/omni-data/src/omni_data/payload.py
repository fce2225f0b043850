"""Reading and decoding payloads from the byte ranges in :class:`~omni_data.sample.SampleMeta`.

Phase two of the two-phase flow: metadata is everywhere, payloads are read only where consumed
(:class:`omni_data.zero_redundancy.ZeroRedundancyFilter` decides where).
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import soundfile
import torch
from PIL import Image

from omni_data.join import text_members
from omni_data.sample import MemberRef, Modality, SampleMeta
from omni_data.source import AUDIO_EXTS, IMAGE_EXTS
from omni_data.tokens import TextTokenizer

__all__ = ["Payload", "PayloadError", "PayloadReader", "UndecodablePayloadError"]


class PayloadError(RuntimeError):
    """A payload could not be read or decoded; the message names the sample key and shard URL."""


class UndecodablePayloadError(PayloadError):
    """An image or audio member whose header passed the metadata pass but whose body does not decode
    (or decodes to another size or rate than the metadata says): bad *data*, not a bad setup. The
    :class:`~omni_data.zero_redundancy.ZeroRedundancyFilter` skips such a sample's payload and counts it."""


@dataclass(slots=True)
class Payload:
    """A decoded sample.

    Attributes:
        meta: the sample's metadata.
        pixels: ``[3, H, W]`` float32 in ``[0, 1]``, resized to ``meta.shape`` (images).
        waveform: ``[num_samples]`` float32 mono in ``[-1, 1]`` (audio).
        sample_rate: Hz (audio).
        text_ids: ``[meta.text_tokens]`` int64 token ids (text, or caption/transcript when a tokenizer
            is given), else ``None``.
        error: ``None`` for a decoded payload; for a sample whose image/audio did not decode, why, and
            ``pixels``/``waveform`` are zeros of the metadata's shape (a placeholder that keeps the pack
            layout; mask the sample's loss). Set by :class:`~omni_data.zero_redundancy.ZeroRedundancyFilter`.
    """

    meta: SampleMeta
    pixels: torch.Tensor | None = None
    waveform: torch.Tensor | None = None
    sample_rate: int | None = None
    text_ids: torch.Tensor | None = None
    error: str | None = None

    @classmethod
    def placeholder(cls, meta: SampleMeta, error: str) -> Payload:
        """Zeros of ``meta.shape`` in place of an undecodable image (``pixels``) or audio (``waveform``)."""
        out = cls(meta, error=error)
        if meta.modality is Modality.IMAGE:
            out.pixels = torch.zeros(meta.shape, dtype=torch.float32)
        elif meta.modality is Modality.AUDIO:
            out.waveform = torch.zeros(meta.shape, dtype=torch.float32)
            out.sample_rate = meta.sample_rate
        return out


class PayloadReader:
    """Reads payload members by byte range through fsspec and decodes them.

    Safe to share between threads (several filters' prefetch threads, or a prefetch thread and the main
    thread): each thread keeps its own LRU of open shard handles, because a seek followed by a read on a
    shared file object is not atomic, and two threads interleaving them read each other's bytes.

    Args:
        tokenizer: turns ``txt`` members into ids; required to read text samples.
        max_open_files: open shard handles kept per thread (LRU).
    """

    def __init__(self, tokenizer: TextTokenizer | None = None, *, max_open_files: int = 8) -> None:
        self.tokenizer = tokenizer
        self.max_open_files = max_open_files
        self._local = threading.local()
        self._lock = threading.Lock()  # guards _caches and bytes_read
        self._caches: list[OrderedDict[str, Any]] = []
        self.bytes_read = 0

    def _files(self) -> OrderedDict[str, Any]:
        files = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = OrderedDict()
            with self._lock:
                self._caches.append(files)
        return files

    def close(self) -> None:
        """Close every thread's open shard handles (a thread that reads again reopens what it needs)."""
        with self._lock:
            caches = list(self._caches)
        for files in caches:
            while files:
                files.popitem()[1].close()

    def read_bytes(self, ref: MemberRef) -> bytes:
        """Raw bytes of one tar member (``ref.size`` bytes).

        Raises:
            PayloadError: the shard cannot be opened, or the member is cut short.
        """
        files = self._files()
        f = files.pop(ref.url, None)
        if f is None:
            try:
                f = fsspec.open(ref.url, "rb").open()
            except (OSError, ValueError) as e:
                raise PayloadError(f"{ref.url}: cannot open shard for member .{ref.ext}: {e}") from e
            if len(files) >= self.max_open_files:
                files.popitem(last=False)[1].close()
        files[ref.url] = f
        f.seek(ref.offset)
        data = f.read(ref.size)
        with self._lock:
            self.bytes_read += len(data)
        if len(data) != ref.size:
            raise PayloadError(
                f"{ref.url}: member .{ref.ext} at byte {ref.offset} cut short ({len(data)}/{ref.size})"
            )
        return data

    def read(self, meta: SampleMeta) -> Payload:
        """Read and decode ``meta``'s payload.

        Raises:
            UndecodablePayloadError: the image/audio member does not decode, or decodes to another
                size or sample rate than ``meta`` says.
            PayloadError: a member is missing or cut short, the text does not match ``meta``, or a text
                sample has no tokenizer.
        """
        try:
            return self._read(meta)
        except PayloadError:
            raise
        except Exception as e:
            url = next(iter(meta.members.values())).url if meta.members else "?"
            raise PayloadError(f"sample {meta.source}/{meta.key} in {url}: {type(e).__name__}: {e}") from e

    def read_text_ids(self, meta: SampleMeta) -> torch.Tensor | None:
        """``[meta.text_tokens]`` int64 ids of the sample's text (caption, transcript or text), or ``None``
        when it has none (``meta.text_tokens == 0``) or there is no tokenizer. Reads only the ``txt`` member
        (every part of a joined document, :func:`omni_data.join.text_members`).

        Raises:
            PayloadError: the member cannot be read or decoded, or gives another token count than ``meta``.
        """
        try:
            return self._ids(meta)
        except PayloadError:
            raise
        except Exception as e:
            raise PayloadError(f"sample {meta.source}/{meta.key}: text: {type(e).__name__}: {e}") from e

    def _ids(self, meta: SampleMeta) -> torch.Tensor | None:
        if "txt" not in meta.members or self.tokenizer is None or meta.text_tokens == 0:
            return None  # no text slots in the pack (e.g. the source counted captions without a tokenizer)
        ids = []  # a joined document (omni_data.join) has several txt parts: tokenized one by one
        for ref in text_members(meta):
            ids += self.tokenizer.encode(self.read_bytes(ref).decode("utf-8")).ids
        if meta.text_range is not None:
            ids = ids[meta.text_range[0] : meta.text_range[1]]
        if len(ids) != meta.text_tokens:  # a pack's layout was planned with meta.text_tokens slots
            raise PayloadError(
                f"sample {meta.source}/{meta.key}: text gives {len(ids)} tokens, metadata says {meta.text_tokens} "
                "(was the metadata built with another tokenizer?)"
            )
        return torch.tensor(ids, dtype=torch.int64)

    def _read(self, meta: SampleMeta) -> Payload:
        out = Payload(meta)
        if meta.modality is Modality.TEXT:
            if self.tokenizer is None:
                raise PayloadError(f"sample {meta.source}/{meta.key}: reading text needs a tokenizer")
            out.text_ids = self._ids(meta)
            return out
        if meta.text_tokens:
            out.text_ids = self._ids(meta)
        if meta.modality is Modality.IMAGE:
            ext = next(e for e in IMAGE_EXTS if e in meta.members)
            data = self.read_bytes(meta.members[ext])
            try:
                with Image.open(io.BytesIO(data)) as im:
                    rgb = im.convert("RGB").resize((meta.shape[2], meta.shape[1]), Image.Resampling.BICUBIC)
            except Exception as e:  # PIL raises many types for a damaged body
                raise UndecodablePayloadError(
                    f"sample {meta.source}/{meta.key} in {meta.members[ext].url}: undecodable image: "
                    f"{type(e).__name__}: {e}"
                ) from e
            # HWC -> CHW in numpy on uint8: a torch permute-copy of float32 spins up intra-op threads
            chw = np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1))
            out.pixels = torch.from_numpy(chw.astype(np.float32) * np.float32(1.0 / 255.0))
            return out
        ext = next(e for e in AUDIO_EXTS if e in meta.members)
        raw = self.read_bytes(meta.members[ext])
        where = f"sample {meta.source}/{meta.key} in {meta.members[ext].url}"
        try:
            data, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
        except Exception as e:  # libsndfile errors on a damaged body
            raise UndecodablePayloadError(f"{where}: undecodable audio: {type(e).__name__}: {e}") from e
        out.waveform = torch.from_numpy(data.mean(axis=1).astype(np.float32))
        out.sample_rate = int(rate)
        if out.waveform.shape[0] != meta.shape[0]:
            raise UndecodablePayloadError(
                f"{where}: {out.waveform.shape[0]} audio samples, metadata says {meta.shape[0]}"
            )
        if meta.sample_rate is not None and out.sample_rate != meta.sample_rate:
            raise UndecodablePayloadError(
                f"{where}: {out.sample_rate} Hz, metadata says {meta.sample_rate} Hz"
            )
        return out
