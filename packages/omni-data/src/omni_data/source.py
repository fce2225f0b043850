"""``WebDatasetSource``: WebDataset-convention tar shards read through fsspec, metadata first.

The source walks each tar's headers (seeking, not reading, over payload members), groups members into
samples by WebDataset's key convention (``webdataset.tariterators.base_plus_ext``) and yields a
:class:`~omni_data.sample.SampleMeta` per sample. Only small members are read for metadata: ``key.json``
(``width``/``height``, ``num_frames``/``sample_rate`` or ``duration_s``), ``key.txt`` when a tokenizer
counts its tokens, the first bytes of an image (PIL parses the header lazily), and, when ``key.json``
lacks the audio length, the first 4 KiB of a FLAC (its STREAMINFO) or the whole WAV/OGG (``soundfile.info``). Payloads are read later, where they are
consumed (:class:`omni_data.payload.PayloadReader`).

Splitting (paper §5.1, decentralized loaders): there are ``R = world_size * num_workers`` readers, reader
``r = rank * num_workers + worker``. With at least ``R`` shards, reader ``r`` reads shards ``r, r+R, ...``
of the epoch's shard order; with fewer, every reader walks every shard's headers and keeps samples
``r, r+R, ...`` of the epoch's sample sequence. Either way each sample is read by exactly one reader.

Bad data is skipped, never fatal, never silent: a member cut off by a truncated shard, an image whose
header PIL cannot parse, audio ``soundfile`` cannot read, a sample missing its main member, an empty or
unreadable shard. Each is counted per reason in :attr:`WebDatasetSource.skipped`, its key kept (up to
``max_skipped_keys``), logged once. The resume position counts skipped samples, so resume stays exact.
"""

from __future__ import annotations

import io
import json
import logging
import random
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import soundfile
from PIL import Image
from webdataset.shardlists import expand_urls
from webdataset.tariterators import base_plus_ext

from omni_data.node import StatefulNode
from omni_data.sample import MemberRef, Modality, SampleMeta
from omni_data.tar_index import TarHeaderError, TarMember, iter_members
from omni_data.tokens import AudioTokens, EncoderCost, ImageTokens, TextTokenizer, count_text_tokens

__all__ = ["AUDIO_EXTS", "IMAGE_EXTS", "EmptySourceError", "LayoutMismatchError", "WebDatasetSource"]

logger = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
AUDIO_EXTS = ("flac", "wav", "ogg")
_IMAGE_HEADER_BYTES = 1 << 16  # enough for PNG IHDR and JPEG SOF behind typical EXIF blocks
_AUDIO_HEADER_BYTES = 1 << 12  # FLAC STREAMINFO (and any leading metadata blocks of test files)
_INLINE_BYTES = 1 << 13  # json/txt and small members come with the header walk, no seek back


class EmptySourceError(RuntimeError):
    """A cycling source produced no usable sample in a whole epoch on this reader."""


class LayoutMismatchError(ValueError):
    """A state saved with one reader layout (ranks x workers) was loaded into another."""


class WebDatasetSource(StatefulNode[SampleMeta]):
    """Metadata stream over WebDataset tar shards, split over ranks and workers, exactly resumable.

    Args:
        urls: fsspec URLs or local paths of tar shards; brace patterns (``shard-{000..009}.tar``) expand.
        modality: what each sample is; image samples need an image member, audio an audio member,
            text a ``txt`` member.
        name: source name in metadata and counters (default: first URL).
        tokenizer: counts ``txt`` tokens (required for text; captions/transcripts count 0 without it).
        image_tokens, audio_tokens: token accounting (:mod:`omni_data.tokens`).
        encoder_cost: FLOPs model of this modality's encoder (image: over ViT patches; audio: over
            subsampled frames).
        rank, world_size: this rank's DP position (readers split data over DP ranks only; TP/PP peers of
            a DP rank hold the same metadata stream).
        worker, num_workers: this reader's worker slot within the rank. A slot is a partition of the data,
            not a process: :class:`~omni_data.workers.RoundRobinWorkers` runs a rank's slots in the
            calling thread (the metadata pass is cheap; payload decoding runs on the
            :class:`~omni_data.zero_redundancy.ZeroRedundancyFilter`'s background thread). Slots let a
            run change how it parallelises reading without changing which reader owns which sample.
        shuffle_shards: shuffle the shard order each epoch with a private RNG seeded by ``(seed, epoch)``.
        seed: shuffle seed.
        epochs: epochs to run; ``None`` cycles forever (the epoch counter is in the state).
        max_skipped_keys: how many skipped keys to keep by name (the counts are always complete).
        allow_resplit: accept a state saved under another reader layout (DP size or workers): the source
            then starts the epoch after the saved one under the new split, and the samples of the saved
            epoch it did not reach are counted in ``skipped["resplit: rest of epoch"]`` as one entry.
            The re-split is exact only if every new reader loads a state of the same epoch (e.g. give
            them all the state of the old reader that is furthest on): readers that start at different
            epochs read different epochs' splits.

    Raises:
        ValueError: no URLs, an unknown modality, a text source without a tokenizer, or a bad split.
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
        rank: int = 0,
        world_size: int = 1,
        worker: int = 0,
        num_workers: int = 1,
        shuffle_shards: bool = False,
        seed: int = 0,
        epochs: int | None = 1,
        max_skipped_keys: int = 1000,
        allow_resplit: bool = False,
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
        if not (0 <= rank < world_size and 0 <= worker < num_workers):
            raise ValueError(f"bad split: rank {rank} of {world_size}, worker {worker} of {num_workers}")
        self.tokenizer = tokenizer
        self.image_tokens = image_tokens or ImageTokens()
        self.audio_tokens = audio_tokens or AudioTokens()
        self.encoder_cost = encoder_cost or EncoderCost()
        self.rank, self.world_size, self.worker, self.num_workers = rank, world_size, worker, num_workers
        self.shuffle_shards, self.seed, self.epochs = shuffle_shards, seed, epochs
        self.max_skipped_keys = max_skipped_keys
        self.allow_resplit = allow_resplit
        self.skipped: dict[str, int] = {}
        self.skipped_keys: list[tuple[str, str]] = []
        self._logged: set[str] = set()
        self._it: Iterator[SampleMeta] | None = None
        self._pos: dict[str, int] = {}

    # --- split -----------------------------------------------------------------------------------
    @property
    def num_readers(self) -> int:
        return self.world_size * self.num_workers

    @property
    def reader(self) -> int:
        return self.rank * self.num_workers + self.worker

    def epoch_shards(self, epoch: int) -> list[str]:
        """Shard order of ``epoch`` (every reader computes the same one)."""
        order = list(self.urls)
        if self.shuffle_shards:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def _my_shards(self, epoch: int) -> tuple[list[str], bool]:
        order = self.epoch_shards(epoch)
        if len(order) >= self.num_readers:
            return order[self.reader :: self.num_readers], False
        return order, True  # fewer shards than readers: split samples

    # --- state (torchdata.nodes conventions) -----------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        pos = {"epoch": 0, "shard": 0, "offset": 0, "seq": 0, "sample_in_shard": 0}
        if initial_state is not None:
            layout = initial_state["layout"]
            self.skipped = dict(initial_state["skipped"])
            self.skipped_keys = [(k, r) for k, r in initial_state["skipped_keys"]]
            if layout == [self.world_size, self.num_workers, self.reader]:
                pos = {k: int(initial_state[k]) for k in pos}
            elif self.allow_resplit:
                pos["epoch"] = int(initial_state["epoch"]) + (
                    1 if int(initial_state["offset"]) or int(initial_state["shard"]) else 0
                )
                if pos["epoch"] != int(initial_state["epoch"]):
                    self._skip(f"resplit@epoch{initial_state['epoch']}", "resplit: rest of epoch")
            else:
                raise LayoutMismatchError(
                    f"source {self.name!r}: state saved by reader {layout[2]} of {layout[0]} ranks x {layout[1]} "
                    f"workers, loaded into reader {self.reader} of {self.world_size} x {self.num_workers}; "
                    "construct the source with allow_resplit=True to re-split at the next epoch"
                )
        self._pos = pos
        self._it = self._iterate()

    def get_state(self) -> dict[str, Any]:
        return {
            **self._pos,
            "layout": [self.world_size, self.num_workers, self.reader],
            "skipped": dict(self.skipped),
            "skipped_keys": [list(x) for x in self.skipped_keys],
        }

    def next(self) -> SampleMeta:
        assert self._it is not None
        return next(self._it)

    # --- iteration -------------------------------------------------------------------------------
    def _skip(self, key: str, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.skipped_keys) < self.max_skipped_keys:
            self.skipped_keys.append((key, reason))
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning(
                "source %r: skipping %s (%s); further skips counted in .skipped", self.name, key, reason
            )

    def _iterate(self) -> Iterator[SampleMeta]:
        pos = self._pos
        while self.epochs is None or pos["epoch"] < self.epochs:
            shards, split_samples = self._my_shards(pos["epoch"])
            whole_epoch = pos["shard"] == 0 and pos["offset"] == 0
            kept = 0
            while pos["shard"] < len(shards):
                # with split samples every reader walks every shard: one of them counts shard-level damage
                counts = not split_samples or pos["shard"] % self.num_readers == self.reader
                for meta in self._iterate_shard(shards[pos["shard"]], split_samples, counts):
                    kept += 1
                    yield meta
                pos.update(shard=pos["shard"] + 1, offset=0, sample_in_shard=0)
            if self.epochs is None and whole_epoch and kept == 0:
                raise EmptySourceError(
                    f"source {self.name!r}: reader {self.reader} of {self.num_readers} found no usable sample in "
                    f"a whole epoch ({len(shards)} shards); skipped: {self.skipped}"
                )
            pos.update(epoch=pos["epoch"] + 1, shard=0, offset=0, seq=0, sample_in_shard=0)

    def _iterate_shard(self, url: str, split_samples: bool, counts: bool = True) -> Iterator[SampleMeta]:
        pos = self._pos
        skip_shard = self._skip if counts else lambda key, reason: None
        try:
            f = fsspec.open(url, "rb").open()
        except (OSError, ValueError) as e:
            if pos["offset"] == 0:
                skip_shard(f"shard:{url}", f"unreadable shard ({type(e).__name__})")
            return
        with f:
            size = f.seek(0, io.SEEK_END)
            if size == 0:
                skip_shard(f"shard:{url}", "empty shard")
                return
            start = pos["offset"]
            members: dict[str, TarMember] = {}
            cur_key: str | None = None
            any_sample = start > 0
            walk = iter_members(f, start, size, inline=_INLINE_BYTES)
            side = _SideFile(url)
            try:
                while True:
                    try:
                        info = next(walk, None)
                    except TarHeaderError as e:
                        info = None
                        # a header right after a member cut by truncation is the same damage: that member
                        # is counted (as "truncated member") when its sample finishes
                        if not any(m.offset + m.size > size for m in members.values()):
                            skip_shard(f"shard:{url}@{e.offset}", "corrupt tar header")
                    key, ext = (None, None) if info is None else base_plus_ext(info.name)
                    if info is not None and (key is None or key.startswith("__")):
                        continue
                    if cur_key is not None and key != cur_key:
                        any_sample = True
                        meta = self._finish(url, cur_key, members, size, side, split_samples)
                        # resume point: the header of the next sample's first member (or the shard's end)
                        pos["offset"] = size if info is None else info.header
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
            if not any_sample:
                skip_shard(f"shard:{url}", "empty shard")

    def _finish(
        self, url: str, key: str, members: dict[str, TarMember], size: int, side: _SideFile, split: bool
    ) -> SampleMeta | None:
        seq = self._pos["seq"]
        if split and seq % self.num_readers != self.reader:
            return None
        refs = {ext: MemberRef(url, m.offset, m.size, ext) for ext, m in members.items()}
        for ref in refs.values():
            if ref.offset + ref.size > size:
                self._skip(key, "truncated member")
                return None
        side.inline = {ext: m.data for ext, m in members.items() if m.data is not None}
        try:
            return self._meta(key, refs, side)
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

    def _meta(self, key: str, refs: dict[str, MemberRef], f: Any) -> SampleMeta:
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
            return SampleMeta(
                key, self.name, m, 0, text_tokens, 0.0, (text_tokens,), refs, None, self._pos["epoch"]
            )
        if m is Modality.IMAGE:
            ext = next((e for e in IMAGE_EXTS if e in refs), None)
            if ext is None:
                raise _SkipSample("missing image member")
            h, w = self._image_size(info, refs[ext], f)
            rh, rw = self.image_tokens.resize(h, w)
            tokens = self.image_tokens.tokens(h, w)
            flops = self.encoder_cost.flops(self.image_tokens.patches(h, w))
            return SampleMeta(
                key, self.name, m, tokens, text_tokens, flops, (3, rh, rw), refs, None, self._pos["epoch"]
            )
        ext = next((e for e in AUDIO_EXTS if e in refs), None)
        if ext is None:
            raise _SkipSample("missing audio member")
        num_samples, rate = self._audio_len(info, refs[ext], f)
        tokens = self.audio_tokens.tokens(num_samples, rate)
        flops = self.encoder_cost.flops(tokens)
        return SampleMeta(
            key,
            self.name,
            m,
            tokens,
            text_tokens,
            flops,
            (num_samples,),
            refs,
            None,
            self._pos["epoch"],
            rate,
        )

    def _image_size(self, info: dict[str, Any], ref: MemberRef, f: Any) -> tuple[int, int]:
        head = self._read(f, ref, _IMAGE_HEADER_BYTES)
        try:
            with Image.open(io.BytesIO(head)) as im:  # parses the header only
                w, h = im.size
        except Exception as e:  # PIL raises many types for garbage; all mean "not an image"
            raise _SkipSample("undecodable image") from e
        if "width" in info and "height" in info and (int(info["width"]), int(info["height"])) != (w, h):
            raise _SkipSample("image size disagrees with json")
        if h < 1 or w < 1:
            raise _SkipSample("empty image")
        return h, w

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


class _SideFile:
    """A second handle on the shard, opened on first use, for members not read inline by the header walk
    (which must keep its own file position)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.inline: dict[str, bytes] = {}
        self._f: Any = None

    def open(self) -> Any:
        if self._f is None:
            self._f = fsspec.open(self.url, "rb").open()
        return self._f

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


class _SkipSample(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
