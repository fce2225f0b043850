"""``WebDatasetSource``: WebDataset-convention tar shards read through fsspec, metadata first.

The source walks each tar's headers (seeking, not reading, over payload members), groups members into
samples by WebDataset's key convention (``webdataset.tariterators.base_plus_ext``) and yields a
:class:`~omni_data.sample.SampleMeta` per sample. Only small members are read for metadata: ``key.json``
(``width``/``height``, ``num_frames``/``sample_rate`` or ``duration_s``), ``key.txt`` when a tokenizer
counts its tokens, the first bytes of an image (PIL parses the header lazily), when ``key.json``
lacks the audio length, the first 4 KiB of a FLAC (its STREAMINFO) or the whole WAV/OGG
(``soundfile.info``), and, when ``key.json`` lacks a video's ``frames``/``fps``/``width``/``height``, the
whole video member (its container header, :func:`omni_data.video.probe_video`). Payloads are read later,
where they are consumed (:class:`omni_data.payload.PayloadReader`).

Gzip-compressed shards (told by content, :mod:`omni_data.compressed`) are walked through a seekable view
of their decompressed tar, so offsets, resume points and damage handling are those of a plain shard; the
walk inflates the shard once and takes members up to 16 MiB inline on the way. zstd, bzip2 and xz
shards raise :class:`~omni_data.compressed.UnsupportedCompressionError`, never counted as damage.

Splitting (paper §5.1, decentralized loaders): there are ``R = world_size * num_workers`` readers, reader
``r = rank * num_workers + worker``. With at least ``R`` shards, reader ``r`` reads shards ``r, r+R, ...``
of the epoch's shard order; with fewer, every reader walks every shard's headers and keeps samples
``r, r+R, ...`` of the epoch's sample sequence. Either way each sample is read by exactly one reader.

Re-splitting (another DP size or worker count): :meth:`WebDatasetSource.load_resplit` takes the states
of *every* old reader, turns what each had left of its epochs into work items (a shard from a byte
offset, or a walk keeping every ``m``-th sample), deals them out over the new readers, and starts the
new split at the first epoch no old reader had begun. Every sample is read exactly once per epoch; a
state that does not fit (another shard list, a missing reader) is refused before anything is read.

Bad data is skipped, never fatal, never silent: a member cut off by a truncated shard (and the rest of
the shard), a damaged tar header (the walk resynchronises at the next valid header; the samples on both
sides of the damage are skipped), a damaged PAX record, a key that is not UTF-8, an image whose header
PIL cannot parse, declares no pixels or more than ``max_image_pixels`` (a decompression bomb, refused
undecoded), a 0-byte image, a tar member with an absolute or ``..`` name and a link or device member
(:class:`~omni_data.tar_index.TarRefused`, keyed ``shard:URL@BYTE:NAME``), audio ``soundfile`` cannot
read, a video of no frames, rate or pixels, of frames over ``max_image_pixels``, with a ``key.json`` whose
video fields are not numbers, or (without them) that FFmpeg cannot read, a sample missing its main
member, an empty or unreadable shard, and a read that keeps failing (an ``OSError`` is retried ``retries`` times with
backoff, from the start of the sample, before the rest of the shard is given up). Each is counted per
reason with its key in :attr:`WebDatasetSource.ledger` (:class:`~omni_data.skips.SkipLedger`) and logged
once per reason. The resume position counts skipped samples, so resume stays exact.
"""

from __future__ import annotations

import io
import itertools
import json
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import soundfile
from fsspec.implementations.memory import MemoryFile
from webdataset.shardlists import expand_urls
from webdataset.tariterators import base_plus_ext

from omni_data.compressed import GzipShard, UnsupportedCompressionError, wrap_compressed
from omni_data.image_generation import GenerationVocab
from omni_data.media_checks import DEFAULT_MAX_IMAGE_PIXELS, MediaRefusedError, open_image
from omni_data.node import LayoutMismatchError, StatefulNode
from omni_data.sample import MemberRef, Modality, SampleMeta
from omni_data.skips import SkipLedger
from omni_data.tar_index import TarDamage, TarMember, TarRefused, iter_members
from omni_data.tokens import (
    AudioTokens,
    EncoderCost,
    ImageTokens,
    TextTokenizer,
    VideoTokens,
    count_text_tokens,
    resampled_length,
)
from omni_data.video import VIDEO_EXTS, VideoInfo, probe_video, video_info_from_json

__all__ = [
    "AUDIO_EXTS",
    "IMAGE_EXTS",
    "VIDEO_EXTS",
    "EmptySourceError",
    "LayoutMismatchError",
    "UnsupportedCompressionError",
    "WebDatasetSource",
]

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
AUDIO_EXTS = ("flac", "wav", "ogg")
# member extension -> media kind, to say what a sample holds when it lacks the member its source reads
_MEDIA_KINDS = {
    **dict.fromkeys(IMAGE_EXTS, "image"),
    **dict.fromkeys(VIDEO_EXTS, "video"),
    **dict.fromkeys(AUDIO_EXTS, "audio"),
}
# what one sample of each modality needs (EmptySourceError names it)
_NEEDS = {
    "text": "a .txt member",
    "image": "an image member (.jpg/.jpeg/.png/.webp)",
    "video": "a video member (.mp4/.webm/.mkv/.mov/.avi/.ogv)",
    "audio": "an audio member (.flac/.wav/.ogg)",
    "generation": "an image member (.jpg/.jpeg/.png/.webp) and a .txt caption: image shards",
}
_IMAGE_HEADER_BYTES = 1 << 16  # enough for PNG IHDR and JPEG SOF behind typical EXIF blocks
_AUDIO_HEADER_BYTES = 1 << 12  # FLAC STREAMINFO (and any leading metadata blocks of test files)
_INLINE_BYTES = 1 << 13  # json/txt and small members come with the header walk, no seek back
# a gzip shard is inflated front to back by the header walk anyway: members up to this size come with it
_GZIP_INLINE_BYTES = 1 << 24
_UNKNOWN_END = 1 << 62  # a gzip shard's length before its end has been inflated
_PERSISTENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def open_shard(url: str) -> Any:
    """A binary handle of its own on the shard at ``url`` (any fsspec URL).

    fsspec's ``memory://`` hands every ``open`` the one shared buffer of the file (and seeks it to 0), so
    two handles would move each other; there the bytes are copied into a private buffer.
    A gzip shard (by content: magic ``1f 8b``) comes back as a :class:`~omni_data.compressed.GzipShard`,
    a seekable handle on its decompressed tar, so offsets everywhere are offsets in the tar.

    Raises:
        UnsupportedCompressionError: the shard is zstd, bzip2 or xz compressed (named in the message).
    """
    f = fsspec.open(url, "rb").open()
    if isinstance(f, MemoryFile):
        f = io.BytesIO(bytes(f.getbuffer()))
    return wrap_compressed(f, url)


class EmptySourceError(RuntimeError):
    """A cycling source produced no usable sample in a whole epoch on this reader."""


def _fresh_pos() -> dict[str, Any]:
    return {"shard": 0, "offset": 0, "seq": 0, "sample_in_shard": 0, "damaged": None}


@dataclass(slots=True)
class _Walk:
    """A reader's work in one epoch: ``shards`` (indices into the source's URL list) walked in order
    from ``pos``, keeping samples whose epoch sequence number ``seq % mod == residue`` when ``split``
    (else every sample). Shard-level damage is counted by the walk with ``shard_pos % mod == residue``."""

    epoch: int
    shards: list[int]
    split: bool
    mod: int
    residue: int
    pos: dict[str, Any]

    def to_list(self) -> list[Any]:
        return [self.epoch, list(self.shards), self.split, self.mod, self.residue, dict(self.pos)]

    @classmethod
    def from_list(cls, v: list[Any]) -> _Walk:
        return cls(int(v[0]), [int(x) for x in v[1]], bool(v[2]), int(v[3]), int(v[4]), dict(v[5]))

    @property
    def started(self) -> bool:
        return bool(self.pos["shard"] or self.pos["offset"])


class WebDatasetSource(StatefulNode[SampleMeta]):
    """Metadata stream over WebDataset tar shards, split over ranks and workers, exactly resumable.

    Args:
        urls: fsspec URLs or local paths of tar shards, plain or gzip-compressed (``.tar.gz``, ``.tgz``,
            told by content); brace patterns (``shard-{000..009}.tar``) expand.
        modality: what each sample is; image samples need an image member, audio an audio member,
            video a video member (``mp4 webm mkv mov avi ogv``), text a ``txt`` member.
        name: source name in metadata and counters (default: first URL).
        tokenizer: counts ``txt`` tokens (required for text; captions/transcripts count 0 without it).
        image_tokens, audio_tokens, video_tokens: token accounting (:mod:`omni_data.tokens`); a video's
            frames are sampled by ``video_tokens`` (``fps``, ``min_frames``, ``max_frames``) from the
            ``frames`` and ``fps`` its ``key.json`` gives, so no payload is read to plan.
        generation: generation sources (``modality="generation"``, on image shards with captions): the
            token layout (:class:`~omni_data.image_generation.GenerationVocab`), whose grid gives each
            sample ``caption + 2 + h*w`` tokens and ``shape = (h, w)``; the image's header is checked as
            an image source's, its pixels are decoded and tokenized only where ids are read
            (:class:`~omni_data.payload.PayloadReader` with ``image_codes``).
        encoder_cost: FLOPs model of this modality's encoder (image and video: over ViT patches; audio:
            over subsampled frames).
        sample_rate: audio only: the rate (Hz) the encoder takes. Clips at another rate are described as
            resampled to it (``shape``, ``sample_rate`` and token counts after resampling, see
            :func:`omni_data.tokens.resampled_length`); :class:`~omni_data.payload.PayloadReader`
            resamples them. ``None``: keep each clip's own rate.
        rank, world_size: this rank's DP position (readers split data over DP ranks only; TP/PP peers of
            a DP rank hold the same metadata stream).
        worker, num_workers: this reader's worker slot within the rank. A slot is a partition of the data,
            not a process: :class:`~omni_data.workers.RoundRobinWorkers` runs a rank's slots in the
            calling thread (the metadata pass is cheap; payload decoding runs on the
            :class:`~omni_data.zero_redundancy.ZeroRedundancyFilter`'s decode pool). Slots let a run
            change how it parallelises reading without changing which reader owns which sample.
        shuffle_shards: shuffle the shard order each epoch with a private RNG seeded by ``(seed, epoch)``.
        seed: shuffle seed.
        epochs: epochs to run; ``None`` cycles forever (the epoch counter is in the state).
        max_skipped_keys: how many skipped keys to keep by name (the counts are always complete).
        retries: extra attempts after an ``OSError`` while reading a shard (>= 0), from the start of the
            sample being read; then the rest of the shard is skipped and counted.
        backoff_s: wait before the first retry, seconds (doubled each time).
        max_image_pixels: image sources: the most ``width * height`` an image may declare (>= 1); a larger
            one (a decompression bomb), one of no pixels or a 0-byte member is skipped and counted from
            its header, never decoded (:mod:`omni_data.media_checks`). Video sources: the same bound per
            frame (``"video over the pixel limit"``).

    Raises:
        ValueError: no URLs, an unknown modality, a text source without a tokenizer, a generation source
            without a tokenizer or ``generation``, or a bad split.
        UnsupportedCompressionError: (from ``next``) a shard is zstd, bzip2 or xz compressed; the
            message names the file.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        modality: Modality | str,
        name: str | None = None,
        tokenizer: TextTokenizer | None = None,
        image_tokens: ImageTokens | None = None,
        audio_tokens: AudioTokens | None = None,
        encoder_cost: EncoderCost | None = None,
        sample_rate: int | None = None,
        video_tokens: VideoTokens | None = None,
        generation: GenerationVocab | None = None,
        rank: int = 0,
        world_size: int = 1,
        worker: int = 0,
        num_workers: int = 1,
        shuffle_shards: bool = False,
        seed: int = 0,
        epochs: int | None = 1,
        max_skipped_keys: int = 1000,
        retries: int = 3,
        backoff_s: float = 0.05,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> None:
        super().__init__()
        self.urls: list[str] = (
            expand_urls(urls) if isinstance(urls, str) else [u for x in urls for u in expand_urls(x)]
        )
        if not self.urls:
            raise ValueError(f"WebDatasetSource: no shard URLs in {urls!r}")
        self.modality = Modality(modality)
        self.name = name if name is not None else self.urls[0]
        if self.modality is Modality.TEXT and tokenizer is None:
            raise ValueError(f"WebDatasetSource {self.name!r}: a text source needs a tokenizer")
        if self.modality is Modality.GENERATION and (tokenizer is None or generation is None):
            raise ValueError(
                f"WebDatasetSource {self.name!r}: a generation source needs a tokenizer (captions) and a "
                "GenerationVocab (its code grid)"
            )
        self.generation = generation
        if not (0 <= rank < world_size and 0 <= worker < num_workers):
            raise ValueError(f"bad split: rank {rank} of {world_size}, worker {worker} of {num_workers}")
        if sample_rate is not None and sample_rate < 1:
            raise ValueError(
                f"WebDatasetSource {self.name!r}: sample_rate must be >= 1 Hz, got {sample_rate}"
            )
        if retries < 0 or backoff_s < 0:
            raise ValueError(
                f"WebDatasetSource: retries ({retries}) and backoff_s ({backoff_s}) must be >= 0"
            )
        self.tokenizer = tokenizer
        self.image_tokens = image_tokens or ImageTokens()
        self.audio_tokens = audio_tokens or AudioTokens()
        self.video_tokens = video_tokens or VideoTokens()
        self.encoder_cost = encoder_cost or EncoderCost()
        self.sample_rate = sample_rate
        self.rank, self.world_size, self.worker, self.num_workers = rank, world_size, worker, num_workers
        self.shuffle_shards, self.seed, self.epochs = shuffle_shards, seed, epochs
        self.retries, self.backoff_s = retries, backoff_s
        if max_image_pixels < 1:
            raise ValueError(
                f"WebDatasetSource {self.name!r}: max_image_pixels must be >= 1, got {max_image_pixels}"
            )
        self.max_image_pixels = max_image_pixels
        self.ledger = SkipLedger(f"source {self.name!r}", max_keys=max_skipped_keys)
        self._it: Iterator[SampleMeta] | None = None
        self._epoch = 0
        self._own: _Walk | None = None  # the current epoch of this reader's own split
        self._carry: list[_Walk] = []  # work handed over by a re-split, done first
        self._walk: _Walk | None = None  # the walk being read

    # --- counters --------------------------------------------------------------------------------
    @property
    def skipped(self) -> dict[str, int]:
        """Reason -> count of what this source skipped."""
        return self.ledger.of(self.name)[0]

    @property
    def skipped_keys(self) -> list[tuple[str, str]]:
        """``(key, reason)`` of the first skipped items (shard-level ones as ``shard:URL[@byte]``)."""
        return self.ledger.of(self.name)[1]

    def _skip(self, key: str, reason: str) -> None:
        self.ledger.add(self.name, key, reason)

    # --- split -----------------------------------------------------------------------------------
    @property
    def num_readers(self) -> int:
        return self.world_size * self.num_workers

    @property
    def reader(self) -> int:
        return self.rank * self.num_workers + self.worker

    @property
    def layout(self) -> list[int]:
        """``[world_size, num_workers, reader]``."""
        return [self.world_size, self.num_workers, self.reader]

    def epoch_shards(self, epoch: int) -> list[str]:
        """Shard order of ``epoch`` (every reader computes the same one)."""
        return [self.urls[i] for i in self._epoch_order(epoch)]

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.urls)))
        if self.shuffle_shards:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def _plan(self, epoch: int, readers: int, reader: int) -> _Walk:
        """Reader ``reader`` of ``readers``' walk of ``epoch`` under that split."""
        order = self._epoch_order(epoch)
        if len(order) >= readers:
            return _Walk(epoch, order[reader::readers], False, readers, reader, _fresh_pos())
        return _Walk(epoch, order, True, readers, reader, _fresh_pos())  # fewer shards than readers

    # --- state (torchdata.nodes conventions) -----------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._carry = []
        if initial_state is None:
            self.ledger.load_state_dict(None)
            self._epoch, pos = 0, _fresh_pos()
        else:
            self._check_layout(initial_state)
            self.ledger.load_state_dict(initial_state["ledger"])
            self._epoch = int(initial_state["epoch"])
            pos = {**_fresh_pos(), **{k: initial_state[k] for k in _fresh_pos() if k in initial_state}}
            self._carry = [_Walk.from_list(w) for w in initial_state.get("carry", [])]
        self._own = self._plan(self._epoch, self.num_readers, self.reader)
        self._own.pos = pos
        self._it = self._iterate()

    def _check_layout(self, state: dict[str, Any]) -> None:
        layout, shards = list(state["layout"]), int(state.get("shards", len(self.urls)))
        if layout == self.layout and shards == len(self.urls):
            return
        raise LayoutMismatchError(
            f"source {self.name!r}: state saved by reader {layout[2]} of {layout[0]} ranks x {layout[1]} "
            f"workers over {shards} shards, loaded into reader {self.reader} of {self.world_size} ranks x "
            f"{self.num_workers} workers over {len(self.urls)} shards; to change the layout pass every old "
            "reader's state to load_resplit() (shards must not change)"
        )

    def get_state(self) -> dict[str, Any]:
        assert self._own is not None
        return {
            "epoch": self._epoch,
            **{k: self._own.pos[k] for k in _fresh_pos()},
            "carry": [w.to_list() for w in self._carry],
            "layout": self.layout,
            "shards": len(self.urls),
            "ledger": self.ledger.state_dict(),
        }

    def load_resplit(
        self, states: Sequence[dict[str, Any]], rank: int | None = None, world_size: int | None = None
    ) -> None:
        """Take this reader's share of the work left by *every* reader of another layout.

        ``states`` are the :meth:`state_dict` of all old readers (any order; every old reader exactly
        once). What each had left of its epochs (up to the first epoch none of them had begun) becomes
        work items, dealt round-robin over the new readers (a sample-splitting walk is halved into two
        with twice the stride while there are fewer items than readers); the new split starts after.
        The skip counts of all old readers go to new reader 0 (so sums over readers stay right).

        Args:
            states: every old reader's state.
            rank, world_size: the new DP position, if the caller knows it (checked against the source's).

        Raises:
            LayoutMismatchError: the states do not cover one layout's readers exactly once, another shard
                list, or ``rank``/``world_size`` disagree with this source's; nothing is read.
        """
        if (rank is not None and rank != self.rank) or (
            world_size is not None and world_size != self.world_size
        ):
            raise LayoutMismatchError(
                f"source {self.name!r}: load_resplit for rank {rank} of {world_size}, but the source is "
                f"rank {self.rank} of {self.world_size}"
            )
        old = _old_layout(self.name, states, len(self.urls), self.layout)
        readers = old[0][0] * old[0][1]
        work: list[list[_Walk]] = [[] for _ in range(readers)]
        begun = 0
        for st in states:
            r = int(st["layout"][2])
            own = self._plan(int(st["epoch"]), readers, r)
            own.pos = {**_fresh_pos(), **{k: st[k] for k in _fresh_pos() if k in st}}
            work[r] = [_Walk.from_list(w) for w in st.get("carry", [])] + [own]
            begun = max(begun, own.epoch + (1 if own.started else 0))
        items: list[_Walk] = []
        for r in range(readers):
            for w in work[r]:
                if w is work[r][-1]:  # the old reader's own split: the rest of its epoch and later ones
                    for e in range(w.epoch, begun):
                        if self.epochs is not None and e >= self.epochs:
                            break
                        walk = w if e == w.epoch else self._plan(e, readers, r)
                        items += _by_shard(walk)
                else:
                    items += _by_shard(w)
        n = self.num_readers
        while len(items) < n and any(w.split for w in items):
            k = max((i for i, w in enumerate(items) if w.split), key=lambda i: -items[i].mod)
            w = items.pop(k)
            items[k:k] = [
                _Walk(w.epoch, w.shards, True, 2 * w.mod, w.residue, dict(w.pos)),
                _Walk(w.epoch, w.shards, True, 2 * w.mod, w.residue + w.mod, dict(w.pos)),
            ]
        super().reset(None)
        self.ledger.load_state_dict(None)
        if self.reader == 0:
            for st in states:
                self.ledger.merge(st["ledger"])
        self._carry = items[self.reader :: n]
        self._epoch = begun
        self._own = self._plan(begun, n, self.reader)
        self._it = self._iterate()

    def next(self) -> SampleMeta:
        assert self._it is not None
        return next(self._it)

    # --- iteration -------------------------------------------------------------------------------
    def _iterate(self) -> Iterator[SampleMeta]:
        while self._carry:
            yield from self._run(self._carry[0])
            self._carry.pop(0)
        while self.epochs is None or self._epoch < self.epochs:
            own = self._own
            assert own is not None
            whole_epoch = not own.started
            kept = 0
            for meta in self._run(own):
                kept += 1
                yield meta
            if self.epochs is None and whole_epoch and kept == 0:
                first = f", the first {self.urls[own.shards[0]]}" if own.shards else ""
                raise EmptySourceError(
                    f"source {self.name!r}: reader {self.reader} of {self.num_readers} found no usable sample in "
                    f"a whole epoch ({len(own.shards)} shards{first}); skipped: {self.skipped}; a "
                    f"{self.modality.value} sample needs {_NEEDS.get(self.modality.value, '?')}"
                )
            self._epoch += 1
            self._own = self._plan(self._epoch, self.num_readers, self.reader)

    def _run(self, walk: _Walk) -> Iterator[SampleMeta]:
        self._walk = walk
        pos = walk.pos
        while pos["shard"] < len(walk.shards):
            url = self.urls[walk.shards[pos["shard"]]]
            # with split samples every reader walks every shard: one of them counts shard-level damage
            counts = not walk.split or pos["shard"] % walk.mod == walk.residue
            yield from self._retrying(url, counts)
            pos.update(shard=pos["shard"] + 1, offset=0, sample_in_shard=0, damaged=None)

    def _retrying(self, url: str, counts: bool) -> Iterator[SampleMeta]:
        """The shard's samples; an ``OSError`` restarts the walk at the current sample (the resume point,
        so nothing is read twice) up to ``retries`` times, then the rest of the shard is skipped."""
        pos = self._walk.pos if self._walk is not None else {}
        for attempt in range(self.retries + 1):
            try:
                yield from self._iterate_shard(url, counts)
                return
            except _PERSISTENT as e:
                if pos["offset"] == 0 and counts:
                    self._skip(f"shard:{url}", f"unreadable shard ({type(e).__name__})")
                return
            except OSError as e:
                if attempt == self.retries:
                    self._skip(
                        f"shard:{url}@{pos['offset']}",
                        f"read error, rest of shard skipped ({type(e).__name__} after {self.retries} retries)",
                    )
                    return
                time.sleep(self.backoff_s * 2**attempt)

    def _iterate_shard(self, url: str, counts: bool) -> Iterator[SampleMeta]:
        walk = self._walk
        assert walk is not None
        pos = walk.pos
        skip_shard = self._skip if counts else lambda key, reason: None
        try:
            f = open_shard(url)
        except ValueError as e:  # fsspec: an unknown protocol or a malformed URL
            if pos["offset"] == 0:
                skip_shard(f"shard:{url}", f"unreadable shard ({type(e).__name__})")
            return
        with f:
            gz = isinstance(f, GzipShard)
            size = _extent(f) if gz else f.seek(0, io.SEEK_END)
            if size == 0:
                skip_shard(f"shard:{url}", "empty shard")
                return
            inline = _GZIP_INLINE_BYTES if gz else _INLINE_BYTES
            start = pos["offset"]
            members: dict[str, TarMember] = {}
            cur_key: str | None = None
            damaged = {pos["damaged"]} if pos["damaged"] is not None else set()
            poison = False  # the first sample after a resynchronisation lost members too
            any_sample = start > 0
            counted = False  # damage already counted: a shard of random bytes is one skip, not also empty
            side = _SideFile(url)
            try:
                for info in itertools.chain(iter_members(f, start, size, inline=inline), [None]):
                    if isinstance(info, TarDamage):
                        # the members between the bad header and the next good one are lost: they belonged
                        # to the sample being read, to samples in between, or to the next one
                        skip_shard(f"shard:{url}@{info.offset}", "damaged tar header")
                        counted = True
                        if cur_key is not None:
                            damaged.add(cur_key)
                        poison = True
                        continue
                    if isinstance(info, TarRefused):  # a link, a device, an absolute or '..' name: named
                        raw = info.name.encode("utf-8", "surrogateescape")
                        skip_shard(
                            f"shard:{url}@{info.header}:{raw.decode('utf-8', 'backslashreplace')}",
                            info.reason,
                        )
                        counted = True
                        continue
                    key, ext = (None, None) if info is None else base_plus_ext(info.name)
                    if info is not None and (key is None or key.startswith("__")):
                        continue
                    if poison and info is not None:
                        damaged.add(key)
                        poison = False
                    if cur_key is not None and key != cur_key:
                        any_sample = True
                        if gz:
                            size = _extent(f)  # known once the walk has reached the end of the stream
                        meta = self._finish(url, cur_key, members, size, side, cur_key in damaged)
                        # resume point: the header of the next sample's first member (or the shard's end)
                        pos["offset"] = size if info is None else info.header
                        pos["damaged"] = key if key in damaged else None
                        pos["sample_in_shard"] += 1
                        pos["seq"] += 1
                        if meta is not None:
                            yield meta
                    if info is None:
                        break
                    if key != cur_key:
                        cur_key, members = key, {}
                    members[ext.lower()] = info
            finally:
                side.close()
            if gz:
                size = _extent(f)
                if f.damage is not None:
                    # key: the shard and the decompressed byte where its stream ended (f.damage: why)
                    skip_shard(f"shard:{url}@{f.size}", "damaged gzip stream (rest of shard lost)")
                    counted = True
            if any(m.offset + m.size > size for m in members.values()):
                skip_shard(f"shard:{url}@{size}", "shard cut off (the samples after the cut are lost)")
            if not any_sample and not counted:
                skip_shard(f"shard:{url}", "empty shard")

    def _finish(
        self, url: str, key: str, members: dict[str, TarMember], size: int, side: _SideFile, damaged: bool
    ) -> SampleMeta | None:
        walk = self._walk
        assert walk is not None
        if walk.split and walk.pos["seq"] % walk.mod != walk.residue:
            return None
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            shown = key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            self._skip(shown, "key is not UTF-8")
            return None
        if damaged:
            self._skip(key, "damaged tar header")
            return None
        refs = {ext: MemberRef(url, m.offset, m.size, ext) for ext, m in members.items()}
        for ref in refs.values():
            if ref.offset + ref.size > size:
                self._skip(key, "truncated member")
                return None
        side.inline = {ext: m.data for ext, m in members.items() if m.data is not None}
        try:
            return self._meta(key, refs, side, walk.epoch)
        except _SkipSample as s:
            self._skip(key, s.reason)
            return None

    def _read(self, side: _SideFile, ref: MemberRef, limit: int | None = None) -> bytes:
        n = ref.size if limit is None else min(limit, ref.size)
        data = side.inline.get(ref.ext)
        if data is not None:
            return data[:n]
        f = side.open()
        f.seek(ref.offset)
        return f.read(n)

    def _meta(self, key: str, refs: dict[str, MemberRef], f: Any, epoch: int) -> SampleMeta:
        info: dict[str, Any] = {}
        if "json" in refs:
            try:
                info = json.loads(self._read(f, refs["json"]))
            except (ValueError, UnicodeDecodeError) as e:
                raise _SkipSample("bad json") from e
            if not isinstance(info, dict):
                raise _SkipSample("bad json")
        text_tokens = 0
        if "txt" in refs and self.tokenizer is not None:
            try:
                text = self._read(f, refs["txt"]).decode("utf-8")
            except UnicodeDecodeError as e:
                raise _SkipSample("bad utf-8 text") from e
            text_tokens = count_text_tokens(self.tokenizer, text)
        m = self.modality
        if m is Modality.TEXT:
            if "txt" not in refs:
                raise _SkipSample("missing .txt")
            if text_tokens == 0:
                raise _SkipSample("empty text")
            return SampleMeta(key, self.name, m, 0, text_tokens, 0.0, (text_tokens,), refs, None, epoch)
        if m is Modality.GENERATION:  # caption then the image's codes: text-like, planned from metadata
            ext = next((e for e in IMAGE_EXTS if e in refs), None)
            if ext is None:
                raise _missing_member("image", refs)
            if "txt" not in refs:
                raise _SkipSample("missing .txt")
            self._image_size(info, refs[ext], f)  # the header checks an image sample gets
            assert self.generation is not None  # __init__ refuses a generation source without one
            g = self.generation
            n = g.tokens(text_tokens)
            return SampleMeta(key, self.name, m, 0, n, 0.0, tuple(g.grid), refs, None, epoch)
        if m is Modality.IMAGE:
            ext = next((e for e in IMAGE_EXTS if e in refs), None)
            if ext is None:
                raise _missing_member("image", refs)
            h, w = self._image_size(info, refs[ext], f)
            rh, rw = self.image_tokens.resize(h, w)
            tokens = self.image_tokens.tokens(h, w)
            flops = self.encoder_cost.flops(self.image_tokens.patches(h, w))
            return SampleMeta(key, self.name, m, tokens, text_tokens, flops, (3, rh, rw), refs, None, epoch)
        if m is Modality.VIDEO:
            ext = next((e for e in VIDEO_EXTS if e in refs), None)
            if ext is None:
                raise _missing_member("video", refs)
            v = self._video_info(info, refs[ext], f)
            vt = self.video_tokens
            n = vt.num_sampled(v.frames, v.fps)
            rh, rw = vt.frame.resize(v.height, v.width)
            t, gh, gw = vt.grid(v.frames, v.fps, v.height, v.width)
            flops = self.encoder_cost.flops(t * gh * gw, slices=t)  # attention per temporal slice
            return SampleMeta(
                key,
                self.name,
                m,
                vt.tokens(v.frames, v.fps, v.height, v.width),
                text_tokens,
                flops,
                (n, 3, rh, rw),
                refs,
                None,
                epoch,
                None,
                v.frames,
                v.fps,
            )
        ext = next((e for e in AUDIO_EXTS if e in refs), None)
        if ext is None:
            raise _missing_member("audio", refs)
        num_samples, rate = self._audio_len(info, refs[ext], f)
        if self.sample_rate is not None and rate != self.sample_rate:
            num_samples, rate = resampled_length(num_samples, rate, self.sample_rate), self.sample_rate
        tokens = self.audio_tokens.tokens(num_samples, rate)
        flops = self.encoder_cost.flops(tokens)
        return SampleMeta(
            key, self.name, m, tokens, text_tokens, flops, (num_samples,), refs, None, epoch, rate
        )

    def _image_size(self, info: dict[str, Any], ref: MemberRef, f: Any) -> tuple[int, int]:
        head = self._read(f, ref, _IMAGE_HEADER_BYTES)
        try:
            with open_image(head, self.max_image_pixels) as im:  # parses the header only
                w, h = im.size
        except MediaRefusedError as e:  # a bomb, no pixels or no bytes: refused before any decode
            raise _SkipSample(e.reason) from e
        except Exception as e:  # PIL raises many types for garbage; all mean "not an image"
            raise _SkipSample("undecodable image") from e
        if "width" in info and "height" in info and (int(info["width"]), int(info["height"])) != (w, h):
            raise _SkipSample("image size disagrees with json")
        if h < 1 or w < 1:
            raise _SkipSample("empty image")
        return h, w

    def _video_info(self, info: dict[str, Any], ref: MemberRef, f: Any) -> VideoInfo:
        """``key.json``'s description of the video, else the whole member probed (container header and
        packet count; no frame decoded)."""
        try:
            v = video_info_from_json(info)
        except (TypeError, ValueError) as e:
            raise _SkipSample("bad video json") from e
        try:
            if v is not None:
                return v.check(self.max_image_pixels)
            return probe_video(self._read(f, ref), self.max_image_pixels)
        except MediaRefusedError as e:
            raise _SkipSample(e.reason) from e
        except Exception as e:  # FFmpeg errors on garbage
            raise _SkipSample("undecodable video") from e

    def _audio_len(self, info: dict[str, Any], ref: MemberRef, f: Any) -> tuple[int, int]:
        rate = info.get("sample_rate")
        if rate is not None and "num_frames" in info:
            n, r = int(info["num_frames"]), int(rate)
        elif rate is not None and "duration_s" in info:
            n, r = round(float(info["duration_s"]) * int(rate)), int(rate)
        else:
            si = None
            if ref.ext == "flac":  # STREAMINFO in the first bytes holds the exact length: no full read
                try:
                    si = soundfile.info(io.BytesIO(self._read(f, ref, _AUDIO_HEADER_BYTES)))
                except Exception:
                    si = None
            if si is None or si.frames <= 0:  # WAV lengths clamp to the bytes given, OGG needs them all
                try:
                    si = soundfile.info(io.BytesIO(self._read(f, ref)))
                except Exception as e:  # libsndfile errors on garbage
                    raise _SkipSample("undecodable audio") from e
            n, r = int(si.frames), int(si.samplerate)
        if n < 1 or r < 1:
            raise _SkipSample("empty audio")
        return n, r


def _extent(f: Any) -> int:
    """A gzip shard's decompressed length if known yet, else a bound past any offset."""
    return f.size if f.size is not None else _UNKNOWN_END


def _by_shard(walk: _Walk) -> list[_Walk]:
    """A shard-splitting walk as one item per remaining shard (so they can be dealt out separately);
    a sample-splitting walk stays whole (its sequence numbers run across shards)."""
    if walk.split:
        return [walk] if walk.pos["shard"] < len(walk.shards) else []
    k = walk.pos["shard"]
    out = []
    for i, s in enumerate(walk.shards[k:]):
        pos = dict(walk.pos) if i == 0 else _fresh_pos()
        pos["shard"] = 0
        out.append(_Walk(walk.epoch, [s], False, 1, 0, pos))
    return out


def _old_layout(name: str, states: Sequence[dict[str, Any]], shards: int, new: list[int]) -> list[list[int]]:
    """The old readers' layouts, checked: one layout, every reader exactly once, the same shard count."""
    layouts = [list(st["layout"]) for st in states]
    if not layouts:
        raise LayoutMismatchError(f"source {name!r}: load_resplit needs the old readers' states, got none")
    world, workers = layouts[0][0], layouts[0][1]
    desc = f"old layout {world} ranks x {workers} workers, new {new[0]} ranks x {new[1]} workers"
    if any(lay[:2] != [world, workers] for lay in layouts):
        raise LayoutMismatchError(
            f"source {name!r}: states of different layouts {sorted({tuple(x[:2]) for x in layouts})}"
        )
    if sorted(lay[2] for lay in layouts) != list(range(world * workers)):
        raise LayoutMismatchError(
            f"source {name!r}: {desc}: need the state of each of the {world * workers} old readers once, "
            f"got readers {sorted(lay[2] for lay in layouts)}"
        )
    bad = sorted({int(st.get("shards", shards)) for st in states} - {shards})
    if bad:
        raise LayoutMismatchError(
            f"source {name!r}: {desc}: states over {bad} shards, the source has {shards}"
        )
    return layouts


class _SideFile:
    """A second handle on the shard, opened on first use, for members not read inline by the header walk
    (which must keep its own file position)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.inline: dict[str, bytes] = {}
        self._f: Any = None

    def open(self) -> Any:
        if self._f is None:
            self._f = open_shard(self.url)
        return self._f

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _missing_member(kind: str, refs: Mapping[str, Any]) -> _SkipSample:
    """The skip of a sample without the ``kind`` member its source reads; when it holds another medium
    (a generation or image source on video shards) the reason says which, e.g. ``"missing image member,
    has video"`` (a few fixed reasons, so the skip counts stay grouped)."""
    other = sorted({_MEDIA_KINDS[e] for e in refs if _MEDIA_KINDS.get(e, kind) != kind})
    return _SkipSample(f"missing {kind} member" + (f", has {' and '.join(other)}" if other else ""))


class _SkipSample(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
