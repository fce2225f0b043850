"""Reading and decoding payloads from the byte ranges in :class:`~omni_data.sample.SampleMeta`.

Phase two of the two-phase flow: metadata is everywhere, payloads are read only where consumed
(:class:`omni_data.zero_redundancy.ZeroRedundancyFilter` decides where).
"""

from __future__ import annotations

import io
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import soundfile
import soxr
import torch
from fsspec.implementations.local import LocalFileSystem
from PIL import Image

from omni_data.compressed import compression_of
from omni_data.image_generation import ImageCodes, generation_targets
from omni_data.join import text_members
from omni_data.media_checks import DEFAULT_MAX_IMAGE_PIXELS, MediaRefusedError, open_image, waveform_problem
from omni_data.sample import MemberRef, Modality, SampleMeta
from omni_data.source import AUDIO_EXTS, IMAGE_EXTS, open_shard
from omni_data.tokens import TextTokenizer, resampled_length, sampled_frame_indices
from omni_data.video import VIDEO_EXTS, decode_frames

__all__ = [
    "Payload",
    "PayloadError",
    "PayloadReader",
    "RefusedPayloadError",
    "SkippedPayloadError",
    "UndecodablePayloadError",
    "UnreadablePayloadError",
    "to_rgb",
]


class PayloadError(RuntimeError):
    """A payload could not be read or decoded; the message names the sample key and shard URL."""


class SkippedPayloadError(PayloadError):
    """Bad *data*, not a bad setup: the :class:`~omni_data.zero_redundancy.ZeroRedundancyFilter` puts a
    placeholder in the sample's place, counts it with its key under :meth:`skip_reason` and goes on."""

    kind = "undecodable"

    def skip_reason(self, modality: Modality | str) -> str:
        """What skip reports count this under, e.g. ``"undecodable image payload"``."""
        return f"{self.kind} {Modality(modality)} payload"


class UndecodablePayloadError(SkippedPayloadError):
    """An image, audio or video member whose header passed the metadata pass but whose body does not
    decode (or decodes to another size, length or frame count than the metadata says)."""


class UnreadablePayloadError(SkippedPayloadError):
    """A member whose bytes could not be read (an ``OSError`` other than a missing file) after the
    reader's bounded retries."""

    kind = "unreadable"


class RefusedPayloadError(UndecodablePayloadError):
    """Hostile media refused before the expensive decode (:mod:`omni_data.media_checks`): audio whose
    decoded samples are NaN, Inf or absurdly large, or that has no frames, checked before resampling;
    an image over the pixel limit or of no pixels, checked on its header before decoding. ``reason``
    (:attr:`MediaRefusedError.reason <omni_data.media_checks.MediaRefusedError>`, e.g.
    ``"non-finite audio samples"``) is what skip reports count it under."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    def skip_reason(self, modality: Modality | str) -> str:
        return self.reason


@dataclass(slots=True)
class Payload:
    """A decoded sample.

    Attributes:
        meta: the sample's metadata.
        pixels: ``[3, H, W]`` float32 RGB in ``[0, 1]``, resized to ``meta.shape`` (images of any mode:
            transparency composited over white, CMYK/palette/grey/16-bit converted).
        waveform: ``[num_samples]`` float32 mono in ``[-1, 1]`` at ``meta.sample_rate`` (audio of any
            channel count, averaged; of any rate, resampled with soxr).
        sample_rate: Hz (audio).
        frames: ``[T, 3, H, W]`` float32 RGB in ``[0, 1]``: the ``T = meta.shape[0]`` sampled frames
            (:func:`omni_data.tokens.sampled_frame_indices`) of a video, each resized to ``meta.shape[2:]``
            as images are.
        text_ids: ``[meta.text_tokens]`` int64 token ids (text, or caption/transcript when a tokenizer
            is given; a generation sample's caption, ``boi``, codes and ``eoi``,
            :class:`~omni_data.image_generation.GenerationVocab`), else ``None``.
        error: ``None`` for a decoded payload; for a sample whose image/audio could not be read or
            decoded, why, and ``pixels``/``waveform``/``frames`` are zeros of the metadata's shape (a
            placeholder that keeps the pack layout; mask the sample's loss). Set by
            :class:`~omni_data.zero_redundancy.ZeroRedundancyFilter`.
    """

    meta: SampleMeta
    pixels: torch.Tensor | None = None
    waveform: torch.Tensor | None = None
    sample_rate: int | None = None
    text_ids: torch.Tensor | None = None
    error: str | None = None
    frames: torch.Tensor | None = None

    @classmethod
    def placeholder(cls, meta: SampleMeta, error: str) -> Payload:
        """Zeros of ``meta.shape`` in place of an undecodable image (``pixels``), video (``frames``) or
        audio (``waveform``)."""
        out = cls(meta, error=error)
        if meta.modality is Modality.IMAGE:
            out.pixels = torch.zeros(meta.shape, dtype=torch.float32)
        elif meta.modality is Modality.VIDEO:
            out.frames = torch.zeros(meta.shape, dtype=torch.float32)
        elif meta.modality is Modality.AUDIO:
            out.waveform = torch.zeros(meta.shape, dtype=torch.float32)
            out.sample_rate = meta.sample_rate
        return out


def to_rgb(im: Image.Image) -> Image.Image:
    """An RGB copy of a PIL image of any mode: transparency (RGBA, LA, PA, P or L with a transparent
    colour) composited over white, 16/32-bit grey scaled to 8 bits, CMYK/YCbCr/palette/grey converted."""
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        arr = np.asarray(im, dtype=np.float64)
        top = 65535.0 if im.mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        im = Image.fromarray(np.clip(np.rint(arr * (255.0 / top)), 0, 255).astype(np.uint8), "L")
    elif im.mode == "F":
        arr = np.asarray(im, dtype=np.float64)
        im = Image.fromarray(np.clip(np.rint(arr * 255.0), 0, 255).astype(np.uint8), "L")
    if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")


def _is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


class PayloadReader:
    """Reads payload members by byte range through fsspec and decodes them.

    Safe to share between threads (several filters' decode pools, or a pool and the main thread): each
    thread keeps its own LRU of open shard handles, because a seek followed by a read on a shared file
    object is not atomic, and two threads interleaving them read each other's bytes.

    Transient read errors (an ``OSError`` that is not a missing file, a permission or a directory) are
    retried ``retries`` times with exponential backoff from ``backoff_s`` on a freshly opened handle;
    after that :class:`UnreadablePayloadError`. For remote stores (any fsspec filesystem but the local
    one, with ``batched="auto"``) :meth:`fetch` gets a whole step's members in one
    ``fs.cat_ranges`` call, which async filesystems (s3, gcs, http) run concurrently.

    A text longer than a pack is split over several packs (``SampleMeta.text_range``); its pieces are
    read one by one, often steps apart, and each needs the whole document tokenized to find its slice
    (token boundaries depend on the text around them). The reader keeps the ids of the split documents
    it tokenized last (LRU, at most ``split_cache_tokens`` ids in all), so a document of ``n`` pieces is
    read and tokenized once, not ``n`` times (``stats["split_text_hits"]`` counts the pieces served).

    Args:
        tokenizer: turns ``txt`` members into ids; required to read text samples.
        max_open_files: open shard handles kept per thread (LRU).
        retries: extra attempts after a transient read error, >= 0.
        backoff_s: wait before the first retry, seconds (doubled each time).
        batched: ``"auto"`` (``cat_ranges`` for non-local filesystems), ``"always"`` or ``"never"``.
        split_cache_tokens: token ids of split documents kept (int64, 8 bytes each; a document with
            more is not kept); 0 turns the cache off.
        max_image_pixels: the most ``width * height`` an image may declare (>= 1); checked on the header
            before decoding (:func:`omni_data.media_checks.open_image`).
        image_codes: turns a generation sample's decoded image into its code tokens
            (:class:`~omni_data.image_generation.ImageCodes`: the token layout and a frozen image
            tokenizer); required to read the ids of generation samples. Their images are decoded at
            their own size (RGB as images are) and handed to ``image_codes.to_input``.

    Counters (:attr:`stats`, thread-safe): ``bytes``, ``retries``, ``batched_calls``, ``batched_ranges``,
    ``split_text_hits``; for video, ``videos`` (decoded), ``video_frames`` (sampled frames returned) and
    ``video_frames_decoded`` (frames the codec produced to reach them); for generation samples,
    ``image_code_encodes`` (images this reader turned into codes with ``image_codes``: every reader that
    reads a generation sample's ids encodes its image, i.e. the first and the last pipeline stage, as
    both tokenize its caption).

    Raises:
        ValueError: ``retries``, ``backoff_s`` or ``split_cache_tokens`` < 0, ``max_image_pixels`` < 1, or
            an unknown ``batched``.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer | None = None,
        *,
        max_open_files: int = 8,
        retries: int = 3,
        backoff_s: float = 0.05,
        batched: str = "auto",
        split_cache_tokens: int = 1 << 20,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        image_codes: ImageCodes | None = None,
    ) -> None:
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"PayloadReader: retries ({retries}) and backoff_s ({backoff_s}) must be >= 0")
        if split_cache_tokens < 0:
            raise ValueError(f"PayloadReader: split_cache_tokens must be >= 0, got {split_cache_tokens}")
        if max_image_pixels < 1:
            raise ValueError(f"PayloadReader: max_image_pixels must be >= 1, got {max_image_pixels}")
        if batched not in ("auto", "always", "never"):
            raise ValueError(f"PayloadReader: batched must be 'auto', 'always' or 'never', got {batched!r}")
        self.tokenizer = tokenizer
        self.image_codes = image_codes
        self.max_open_files = max_open_files
        self.max_image_pixels = max_image_pixels
        self.retries, self.backoff_s, self.batched = retries, backoff_s, batched
        self._local = threading.local()
        self._lock = threading.Lock()  # guards _caches and stats
        self._caches: list[OrderedDict[str, Any]] = []
        self.stats = {
            "bytes": 0,
            "retries": 0,
            "batched_calls": 0,
            "batched_ranges": 0,
            "split_text_hits": 0,
            "videos": 0,
            "video_frames": 0,
            "video_frames_decoded": 0,
            "image_code_encodes": 0,
        }
        self.split_cache_tokens = split_cache_tokens
        # split document (its txt members' url, offset, size) -> all its ids, least recently used first
        self._split_ids: OrderedDict[tuple[tuple[str, int, int], ...], torch.Tensor] = OrderedDict()
        self._split_held = 0  # ids in _split_ids
        self._plain: dict[str, bool] = {}  # shard url -> not compressed (batched reads allowed)

    @property
    def bytes_read(self) -> int:
        return self.stats["bytes"]

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.stats[k] += v

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

    def _retrying(self, what: str, fn: Any) -> Any:
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except (FileNotFoundError, PermissionError, IsADirectoryError):
                raise
            except OSError as e:
                if attempt == self.retries:
                    raise UnreadablePayloadError(
                        f"{what}: {type(e).__name__}: {e} (after {self.retries} retries)"
                    ) from e
                self._count(retries=1)
                time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def uses_batches(self, url: str) -> bool:
        """Whether :meth:`fetch` batches reads of this shard's members (``batched`` and its filesystem;
        never for a compressed shard, whose first bytes are read once per URL to tell)."""
        if self.batched == "never" or (self.batched == "auto" and _is_local(fsspec.core.url_to_fs(url)[0])):
            return False
        return self._plain_shard(url)

    def _plain_shard(self, url: str) -> bool:
        """Whether the shard is an uncompressed tar (a compressed shard's member ranges are offsets in its
        decompressed stream: read through a handle, never by byte range). A first-bytes read that fails
        answers ``False`` (uncached): the per-handle read then retries and reports the error."""
        with self._lock:
            plain = self._plain.get(url)
        if plain is None:
            fs, path = fsspec.core.url_to_fs(url)
            try:
                plain = compression_of(bytes(fs.cat_file(path, start=0, end=6))) is None
            except OSError:
                return False
            with self._lock:
                self._plain[url] = plain
        return plain

    def fetch(self, refs: Sequence[MemberRef]) -> dict[tuple[str, int], bytes]:
        """The bytes of many members, ``{(url, offset): bytes}``, in one ``fs.cat_ranges`` call per
        filesystem (retried as a whole on a transient error); pass it to :meth:`read` as ``fetched``.

        Raises:
            UnreadablePayloadError: the batch failed after the retries.
            PayloadError: a shard is compressed (its ranges are not byte ranges of the file; see
                :meth:`uses_batches`) or its first bytes cannot be read.
            PayloadError: a shard is missing, or a member comes back short.
        """
        out: dict[tuple[str, int], bytes] = {}
        by_fs: dict[int, tuple[Any, list[tuple[str, MemberRef]]]] = {}
        for ref in refs:
            fs, path = fsspec.core.url_to_fs(ref.url)
            by_fs.setdefault(id(fs), (fs, []))[1].append((path, ref))
        for url in sorted({ref.url for ref in refs}):
            if not self._plain_shard(url):
                raise PayloadError(f"{url}: compressed or unreadable shard: read its members with read_bytes")
        for fs, items in by_fs.values():

            def batch(fs: Any = fs, items: list[tuple[str, MemberRef]] = items) -> list[Any]:
                got = fs.cat_ranges(
                    [p for p, _ in items],
                    [r.offset for _, r in items],
                    [r.offset + r.size for _, r in items],
                    on_error="return",
                )
                for g in got:
                    if isinstance(g, BaseException):
                        raise g
                return got

            try:
                got = self._retrying(f"batched read of {len(items)} members", batch)
            except FileNotFoundError as e:
                raise PayloadError(f"batched read: shard missing: {e}") from e
            self._count(batched_calls=1, batched_ranges=len(items))
            for (_, ref), data in zip(items, got):
                if len(data) != ref.size:
                    raise PayloadError(
                        f"{ref.url}: member .{ref.ext} at byte {ref.offset} cut short ({len(data)}/{ref.size})"
                    )
                out[(ref.url, ref.offset)] = data
                self._count(bytes=len(data))
        return out

    def read_bytes(self, ref: MemberRef, fetched: Mapping[tuple[str, int], bytes] | None = None) -> bytes:
        """Raw bytes of one tar member (``ref.size`` bytes), from ``fetched`` if it holds them.

        Raises:
            PayloadError: the shard cannot be opened (missing), or the member is cut short.
            UnreadablePayloadError: a read kept failing after the retries.
        """
        if fetched is not None and (ref.url, ref.offset) in fetched:
            return fetched[(ref.url, ref.offset)]
        files = self._files()

        def attempt() -> bytes:
            f = files.pop(ref.url, None)
            if f is None:
                f = open_shard(ref.url)
                if len(files) >= self.max_open_files:
                    files.popitem(last=False)[1].close()
            try:
                f.seek(ref.offset)
                data = f.read(ref.size)
            except OSError:
                f.close()  # a handle that failed mid-read is not reused
                raise
            files[ref.url] = f
            return data

        try:
            data = self._retrying(f"{ref.url}: member .{ref.ext} at byte {ref.offset}", attempt)
        except (FileNotFoundError, PermissionError, IsADirectoryError, ValueError) as e:
            raise PayloadError(f"{ref.url}: cannot open shard for member .{ref.ext}: {e}") from e
        self._count(bytes=len(data))
        if len(data) != ref.size:
            raise PayloadError(
                f"{ref.url}: member .{ref.ext} at byte {ref.offset} cut short ({len(data)}/{ref.size})"
            )
        return data

    def refs(self, meta: SampleMeta, *, media: bool = True, text: bool = True) -> list[MemberRef]:
        """The members :meth:`read` reads for ``meta`` (its image, video or audio member, its ``txt``): the
        ``txt`` of a split document whose ids are cached is left out (:meth:`fetch` would read it again;
        if it is evicted before the read, :meth:`read_bytes` reads it then). A generation sample's image
        belongs to its ids (``text``), not to ``media``."""
        out = []
        if text and meta.modality is Modality.GENERATION:
            ext = next((e for e in IMAGE_EXTS if e in meta.members), None)
            if ext is not None:
                out.append(meta.members[ext])
        if media and meta.modality.encoded:
            exts = {Modality.IMAGE: IMAGE_EXTS, Modality.VIDEO: VIDEO_EXTS}.get(meta.modality, AUDIO_EXTS)
            ext = next((e for e in exts if e in meta.members), None)
            if ext is not None:
                out.append(meta.members[ext])
        if text and "txt" in meta.members and meta.text_tokens and not self._split_cached(meta):
            out.extend(text_members(meta))  # every part of a joined document (omni_data.join)
        return out

    @staticmethod
    def _split_key(meta: SampleMeta) -> tuple[tuple[str, int, int], ...]:
        return tuple((r.url, r.offset, r.size) for r in text_members(meta))

    def _split_cached(self, meta: SampleMeta) -> bool:
        if meta.text_range is None:
            return False
        with self._lock:
            return self._split_key(meta) in self._split_ids

    def read(self, meta: SampleMeta, fetched: Mapping[tuple[str, int], bytes] | None = None) -> Payload:
        """Read and decode ``meta``'s payload (members from ``fetched`` where it holds them, see :meth:`fetch`).

        Raises:
            RefusedPayloadError: hostile media, refused before the expensive decode: an image over
                ``max_image_pixels`` or of no pixels (from its header), a video whose frames are
                over that bound or of no pixels (from its stream header), audio with no frames or a
                NaN, Inf or absurdly large sample (after decoding the PCM, before resampling).
            UndecodablePayloadError: the image/audio/video member does not decode, or decodes to another
                size or length than ``meta`` says (a video: fewer frames than its sampled indices need).
            UnreadablePayloadError: a member read kept failing after the retries.
            PayloadError: a member is missing or cut short, the text does not match ``meta``, or a text
                sample has no tokenizer.
        """
        try:
            return self._read(meta, fetched)
        except PayloadError:
            raise
        except Exception as e:
            url = next(iter(meta.members.values())).url if meta.members else "?"
            raise PayloadError(f"sample {meta.source}/{meta.key} in {url}: {type(e).__name__}: {e}") from e

    def read_text_ids(
        self, meta: SampleMeta, fetched: Mapping[tuple[str, int], bytes] | None = None
    ) -> torch.Tensor | None:
        """``[meta.text_tokens]`` int64 ids of the sample's text (caption, transcript or text), or ``None``
        when it has none (``meta.text_tokens == 0``) or there is no tokenizer. Reads only the ``txt`` member
        (every part of a joined document, :func:`omni_data.join.text_members`); for a generation sample
        also its image, decoded and turned into codes by ``image_codes`` (caption, ``boi``, codes, ``eoi``).

        Raises:
            RefusedPayloadError, UndecodablePayloadError: a generation sample's image is refused or does
                not decode (as :meth:`read` for an image).
            PayloadError: the member cannot be read or decoded, or gives another token count than ``meta``;
                a generation sample without ``image_codes``, or whose code grid differs from its metadata.
        """
        try:
            if meta.modality is Modality.GENERATION:
                return self._generation_ids(meta, fetched)
            return self._ids(meta, fetched)
        except PayloadError:
            raise
        except Exception as e:
            raise PayloadError(f"sample {meta.source}/{meta.key}: text: {type(e).__name__}: {e}") from e

    def _ids(self, meta: SampleMeta, fetched: Mapping[tuple[str, int], bytes] | None) -> torch.Tensor | None:
        if "txt" not in meta.members or self.tokenizer is None or meta.text_tokens == 0:
            return None  # no text slots in the pack (e.g. the source counted captions without a tokenizer)
        if meta.text_range is None:
            ids = self._tokenize(meta, fetched)
        else:
            a, b = meta.text_range
            ids = self._split_document(meta, fetched)[a:b].clone()  # not a view: the document may go
        if len(ids) != meta.text_tokens:  # a pack's layout was planned with meta.text_tokens slots
            raise PayloadError(
                f"sample {meta.source}/{meta.key}: text gives {len(ids)} tokens, metadata says {meta.text_tokens} "
                "(was the metadata built with another tokenizer?)"
            )
        return ids

    def _generation_ids(
        self, meta: SampleMeta, fetched: Mapping[tuple[str, int], bytes] | None
    ) -> torch.Tensor | None:
        where = f"sample {meta.source}/{meta.key}"
        codes = self.image_codes
        if codes is None or self.tokenizer is None:
            raise PayloadError(f"{where}: reading a generation sample needs a tokenizer and image_codes")
        first, _ = generation_targets(meta)
        if tuple(meta.shape) != tuple(codes.vocab.grid):
            raise PayloadError(
                f"{where}: metadata grid {tuple(meta.shape)}, the image tokenizer's is {codes.vocab.grid} "
                "(was the metadata built with another image tokenizer?)"
            )
        caption = self._tokenize(meta, fetched)
        if len(caption) != first:
            raise PayloadError(
                f"{where}: caption gives {len(caption)} tokens, metadata says {first} "
                "(was the metadata built with another tokenizer?)"
            )
        ref = self.refs(meta, media=False)[0]
        pixels = self._decode_image(self.read_bytes(ref, fetched), f"{where} in {ref.url}", None)
        try:
            grid = codes.codes(pixels)
        except ValueError as e:
            raise PayloadError(f"{where}: {e}") from e
        self._count(image_code_encodes=1)
        return codes.vocab.sample_ids(caption, grid)

    def _decode_image(self, data: bytes, where: str, size: tuple[int, int] | None) -> torch.Tensor:
        """float32 ``[3, H, W]`` RGB in ``[0, 1]`` of an image member, resized to ``size = (H, W)`` (bicubic)
        or at its own size (``None``)."""
        try:
            with open_image(data, self.max_image_pixels) as im:  # header only, then the size check
                rgb = to_rgb(im)
                if size is not None:
                    rgb = rgb.resize((size[1], size[0]), Image.Resampling.BICUBIC)
        except MediaRefusedError as e:
            raise RefusedPayloadError(f"{where}: {e}", e.reason) from e
        except Exception as e:  # PIL raises many types for a damaged body
            raise UndecodablePayloadError(f"{where}: undecodable image: {type(e).__name__}: {e}") from e
        # HWC -> CHW in numpy on uint8: a torch permute-copy of float32 spins up intra-op threads
        chw = np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1))
        return torch.from_numpy(chw.astype(np.float32) * np.float32(1.0 / 255.0))

    def _tokenize(self, meta: SampleMeta, fetched: Mapping[tuple[str, int], bytes] | None) -> torch.Tensor:
        tokenizer = self.tokenizer
        if tokenizer is None:  # _ids' callers check first; kept so a new caller cannot skip it
            raise PayloadError(f"sample {meta.source}/{meta.key}: reading text needs a tokenizer")
        ids: list[int] = []  # a joined document (omni_data.join) has several txt parts: tokenized one by one
        for ref in text_members(meta):
            ids += tokenizer.encode(self.read_bytes(ref, fetched).decode("utf-8")).ids
        return torch.tensor(ids, dtype=torch.int64)

    def _split_document(
        self, meta: SampleMeta, fetched: Mapping[tuple[str, int], bytes] | None
    ) -> torch.Tensor:
        """All ids of the document ``meta`` is a piece of, from the cache or read and tokenized (and kept)."""
        key = self._split_key(meta)
        with self._lock:
            ids = self._split_ids.get(key)
            if ids is not None:
                self._split_ids.move_to_end(key)
                self.stats["split_text_hits"] += 1
                return ids
        ids = self._tokenize(meta, fetched)  # outside the lock: two threads may both tokenize; same ids
        if 0 < len(ids) <= self.split_cache_tokens:  # empty ones hold 0 ids: they would pile up at bound 0
            with self._lock:
                if key not in self._split_ids:
                    self._split_ids[key] = ids
                    self._split_held += len(ids)
                while self._split_held > self.split_cache_tokens:
                    self._split_held -= len(self._split_ids.popitem(last=False)[1])
        return ids

    def _read(self, meta: SampleMeta, fetched: Mapping[tuple[str, int], bytes] | None) -> Payload:
        out = Payload(meta)
        if meta.modality is Modality.GENERATION:  # its payload is token ids: caption, boi, codes, eoi
            out.text_ids = self._generation_ids(meta, fetched)
            return out
        if meta.modality is Modality.TEXT:
            if self.tokenizer is None:
                raise PayloadError(f"sample {meta.source}/{meta.key}: reading text needs a tokenizer")
            out.text_ids = self._ids(meta, fetched)
            return out
        if meta.text_tokens:
            out.text_ids = self._ids(meta, fetched)
        ref = self.refs(meta, text=False)[0]
        data = self.read_bytes(ref, fetched)
        where = f"sample {meta.source}/{meta.key} in {ref.url}"
        if meta.modality is Modality.IMAGE:
            out.pixels = self._decode_image(data, where, (meta.shape[1], meta.shape[2]))
            return out
        if meta.modality is Modality.VIDEO:
            if meta.frames is None or len(meta.shape) != 4:
                raise PayloadError(f"{where}: video metadata without a frame count or a [T, 3, H, W] shape")
            indices = sampled_frame_indices(meta.frames, meta.shape[0])
            try:
                frames, decoded = decode_frames(
                    data, indices, (meta.shape[2], meta.shape[3]), self.max_image_pixels
                )
            except MediaRefusedError as e:
                raise RefusedPayloadError(f"{where}: {e}", e.reason) from e
            except ValueError as e:  # FFmpeg errors, or fewer frames than the metadata says
                raise UndecodablePayloadError(f"{where}: undecodable video: {e}") from e
            self._count(videos=1, video_frames=len(indices), video_frames_decoded=decoded)
            out.frames = torch.from_numpy(frames)
            return out
        try:
            wave, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        except Exception as e:  # libsndfile errors on a damaged body
            raise UndecodablePayloadError(f"{where}: undecodable audio: {type(e).__name__}: {e}") from e
        # before soxr and the encoder's log-mel: one NaN/Inf sample makes the whole run's loss NaN
        bad = waveform_problem(wave)
        if bad is not None:
            raise RefusedPayloadError(f"{where}: {bad}", bad.reason)
        target = meta.sample_rate or int(rate)
        want = resampled_length(wave.shape[0], int(rate), target) if wave.shape[0] else 0
        if want != meta.shape[0]:
            raise UndecodablePayloadError(
                f"{where}: {wave.shape[0]} audio samples at {rate} Hz give {want} at {target} Hz, "
                f"metadata says {meta.shape[0]}"
            )
        mono = wave.mean(axis=1, dtype=np.float32)
        if int(rate) != target:
            mono = soxr.resample(mono, int(rate), target, quality="HQ")[:want]
            mono = np.pad(mono, (0, want - mono.shape[0]))  # soxr's length may differ by one sample
        out.waveform = torch.from_numpy(np.ascontiguousarray(mono, dtype=np.float32))
        out.sample_rate = target
        return out
