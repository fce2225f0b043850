"""Small real WebDataset shards and a tiny BPE tokenizer, for tests, examples and benchmarks.

Shards are written with ``webdataset.ShardWriter`` through fsspec (so ``memory://`` works too); images
are real PNGs (PIL), audio real FLAC/WAV/OGG (soundfile), text real UTF-8.

:class:`FlakyFileSystem` reproduces read errors in the middle of a shard (the webdataset #142 class of
fault: a network store dropping a connection): local files whose reads fail with ``EIO`` at a chosen
byte, a chosen number of times (transient) or always, as a sidecar file says (see :func:`flaky_url`).
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import random
import struct
import tarfile
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import soundfile
from fsspec.implementations.local import LocalFileSystem
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from omni_data.loader import PackedLoader
from omni_data.mixture import MixtureSchedule, MixtureStream
from omni_data.node import StatefulNode
from omni_data.packing import HybridPacker
from omni_data.sample import Modality, SampleMeta
from omni_data.source import WebDatasetSource
from omni_data.video import encode_mp4  # re-exported: the test clips' encoder
from omni_data.write import write_shards
from omni_data.zero_redundancy import FilteredStep

__all__ = [
    "FlakyFileSystem",
    "GatedLoader",
    "SyntheticSource",
    "audio_samples",
    "damaged_image_shards",
    "declared_png",
    "encode_mp4",
    "flaky_url",
    "float_wav",
    "hostile_media_folder",
    "hostile_waves",
    "image_samples",
    "merge_replica_steps",
    "packed_loader",
    "solid_png",
    "text_samples",
    "train_tiny_bpe",
    "trained_sources",
    "video_samples",
    "webdataset_sources",
    "write_shards",
    "write_tar",
]

_WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sits",
    "runs",
    "on",
    "under",
    "red",
    "blue",
    "green",
    "small",
    "large",
    "image",
    "sound",
    "speech",
    "model",
    "token",
    "river",
    "mountain",
    "city",
    "street",
    "car",
    "tree",
    "bird",
    "sky",
    "light",
    "music",
    "voice",
    "train",
    "data",
    "loader",
    "pack",
]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def image_samples(
    n: int, *, seed: int = 0, sizes: tuple[int, int] = (16, 96), prefix: str = "img", with_json: bool = True
) -> Iterator[dict[str, Any]]:
    """``n`` samples ``{__key__, png, txt, json}`` with random-size RGB PNGs (sides in ``sizes`` pixels)."""
    rng = random.Random(seed)
    for i in range(n):
        w, h = rng.randint(*sizes), rng.randint(*sizes)
        arr = np.random.default_rng(seed * 100003 + i).integers(0, 256, (h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        sample = {
            "__key__": f"{prefix}{i:06d}",
            "png": buf.getvalue(),
            "txt": _sentence(rng, rng.randint(3, 12)),
        }
        if with_json:
            sample["json"] = json.dumps({"width": w, "height": h}).encode()
        yield sample


def video_samples(
    n: int,
    *,
    seed: int = 0,
    sizes: tuple[int, int] = (16, 48),
    frames: tuple[int, int] = (3, 12),
    fps: int = 4,
    prefix: str = "vid",
    with_json: bool = True,
) -> Iterator[dict[str, Any]]:
    """``n`` samples ``{__key__, mp4, txt[, json]}``: clips of a random number of frames (in ``frames``)
    of even random sides (in ``sizes`` pixels) at ``fps``, a smooth gradient moving a few pixels a frame
    plus noise (so frames differ and the codec has motion to predict); json ``{frames, fps, width,
    height, duration_s}``."""
    rng = random.Random(seed)
    for i in range(n):
        w, h = 2 * (rng.randint(*sizes) // 2), 2 * (rng.randint(*sizes) // 2)
        t = rng.randint(*frames)
        g = np.random.default_rng(seed * 100003 + i)
        yy, xx = np.mgrid[0:h, 0:w]
        clip = np.empty((t, h, w, 3), dtype=np.uint8)
        for k in range(t):
            base = np.stack([(xx + 3 * k) * 5, (yy + 2 * k) * 7, (xx + yy + k) * 3], axis=-1) % 256
            clip[k] = np.clip(base + g.integers(-20, 21, (h, w, 3)), 0, 255).astype(np.uint8)
        sample = {
            "__key__": f"{prefix}{i:06d}",
            "mp4": encode_mp4(clip, fps),
            "txt": _sentence(rng, rng.randint(3, 12)),
        }
        if with_json:
            meta = {"frames": t, "fps": fps, "width": w, "height": h, "duration_s": t / fps}
            sample["json"] = json.dumps(meta).encode()
        yield sample


def audio_samples(
    n: int,
    *,
    seed: int = 0,
    rate: int = 8000,
    seconds: tuple[float, float] = (0.1, 1.0),
    fmt: str = "flac",
    prefix: str = "aud",
    with_json: bool = False,
) -> Iterator[dict[str, Any]]:
    """``n`` samples ``{__key__, flac|wav, txt[, json]}`` of mono sine-plus-noise audio at ``rate`` Hz."""
    rng = random.Random(seed)
    for i in range(n):
        num = max(1, int(rng.uniform(*seconds) * rate))
        t = np.arange(num) / rate
        wave = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 1000) * t) + 0.01 * np.random.default_rng(
            i
        ).standard_normal(num)
        buf = io.BytesIO()
        soundfile.write(buf, wave.astype(np.float32), rate, format=fmt.upper(), subtype="PCM_16")
        sample = {
            "__key__": f"{prefix}{i:06d}",
            fmt: buf.getvalue(),
            "txt": _sentence(rng, rng.randint(2, 8)),
        }
        if with_json:
            sample["json"] = json.dumps({"num_frames": num, "sample_rate": rate}).encode()
        yield sample


def text_samples(
    n: int, *, seed: int = 0, words: tuple[int, int] = (5, 200), prefix: str = "txt"
) -> Iterator[dict[str, Any]]:
    """``n`` samples ``{__key__, txt}`` of random sentences with word counts in ``words``."""
    rng = random.Random(seed)
    for i in range(n):
        yield {"__key__": f"{prefix}{i:06d}", "txt": _sentence(rng, rng.randint(*words))}


def train_tiny_bpe(texts: Iterable[str] | None = None, *, vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (default: this module's word list)."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["[UNK]", "[PAD]"], show_progress=False
    )
    corpus = list(texts) if texts is not None else [" ".join(_WORDS)] * 4 + list(_WORDS)
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def write_tar(
    path: str | os.PathLike[str],
    members: Iterable[tuple[str, bytes] | tuple[str, bytes, str]],
    *,
    fmt: int = tarfile.PAX_FORMAT,
) -> None:
    """``[(name, bytes)]`` members into one tar file with ``tarfile`` (not ``webdataset``), so a member name
    may hold any bytes (surrogate-escaped, e.g. ``"k\\udcff.png"`` for a raw 0xff): for damaged shards. A
    member ``(name, tarfile.SYMTYPE | tarfile.LNKTYPE, target)`` is a link, stored as given."""
    with tarfile.open(path, "w", format=fmt, encoding="utf-8", errors="surrogateescape") as tf:
        for name, data, *link in members:
            info = tarfile.TarInfo(name)
            if link:
                info.type, info.linkname = data, link[0]
                tf.addfile(info)
                continue
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def damaged_image_shards(
    pattern: str, n: int, *, per_shard: int, bad: int, sizes: tuple[int, int] = (16, 40)
) -> list[str]:
    """``image_samples(n, sizes=sizes)`` in shards ``pattern % i`` of ``per_shard``, damaged three ways:
    sample ``bad``'s PNG is not an image, the last shard is cut in the middle of a member, and an empty
    shard follows it (the last path returned)."""
    imgs = list(image_samples(n, sizes=sizes))
    imgs[bad]["png"] = b"not an image at all"
    urls = write_shards(pattern, imgs, per_shard=per_shard)
    with open(urls[-1], "r+b") as f:  # cut the last shard in the middle of a member
        f.truncate(f.seek(0, 2) // 2 + 100)
    empty = pattern % len(urls)
    open(empty, "wb").close()
    return [*urls, empty]


def solid_png(h: int, w: int, mode: str = "RGB") -> bytes:
    """A PNG of ``h`` x ``w`` pixels of one grey (90), converted to PIL ``mode``."""
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 90, np.uint8)).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def declared_png(w: int, h: int) -> bytes:
    """A PNG of a few dozen bytes whose IHDR declares ``w`` x ``h`` RGB pixels (a decompression bomb when
    large; PNG spec 11.2.2): its IDAT holds almost nothing."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


def float_wav(wave: np.ndarray, rate: int = 16000) -> bytes:
    """A float32 WAV: it stores NaN and Inf as they are (PCM subtypes would clip them)."""
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype(np.float32), rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def hostile_waves(*, inf_at: int = 1234) -> dict[str, np.ndarray]:
    """name -> 0.25 s of samples at 22.05 kHz (a rate the loader resamples): the poisons (all NaN, all +Inf,
    one -Inf at sample ``inf_at`` of a sine, the sine 1e30 loud), then the sine itself (``ok``)."""
    t = np.arange(5512) / 22050
    sine = 0.3 * np.sin(2 * np.pi * 300 * t)
    one_inf = sine.copy()
    one_inf[inf_at] = -np.inf
    return {
        "nan": np.full_like(sine, np.nan),
        "inf": np.full_like(sine, np.inf),
        "one_ninf": one_inf,
        "loud": sine * 1e30,
        "ok": sine,
    }


def hostile_media_folder(
    folder: str | os.PathLike[str],
    waves: Mapping[str, np.ndarray],
    *,
    extra: Mapping[str, bytes] | None = None,
    caption: str = "caption of",
) -> None:
    """A media folder for ``write_dataset`` / ``make-shards`` (created): ``ok.png`` (20 x 24), ``bomb.png``
    (declares 50,000 x 50,000), ``empty.png`` (0 bytes), ``zero.png`` (0 x 0), a float WAV ``a_{name}.wav``
    at 22.05 kHz per wave, the ``extra`` files ``{name: bytes}``, and beside each a ``.txt`` holding
    ``"{caption} {stem}"``."""
    src = Path(folder)
    src.mkdir()
    (src / "ok.png").write_bytes(solid_png(20, 24))
    (src / "bomb.png").write_bytes(declared_png(50_000, 50_000))
    (src / "empty.png").write_bytes(b"")
    (src / "zero.png").write_bytes(declared_png(0, 0))
    for name, w in waves.items():
        (src / f"a_{name}.wav").write_bytes(float_wav(w, 22050))  # "ok.png" and "ok.wav" would be one sample
    for name, data in (extra or {}).items():
        (src / name).write_bytes(data)
    for p in list(src.iterdir()):
        p.with_suffix(".txt").write_text(f"{caption} {p.stem}")


def webdataset_sources(
    urls: Mapping[str, tuple[str | Sequence[str], Modality | str]], **kwargs: Any
) -> dict[str, WebDatasetSource]:
    """``{name: (urls, modality)}`` -> ``{name: WebDatasetSource(urls, modality=modality, name=name,
    **kwargs)}``, in the same order."""
    return {name: WebDatasetSource(u, modality=m, name=name, **kwargs) for name, (u, m) in urls.items()}


def packed_loader(
    sources: Mapping[str, Any],
    schedule: MixtureSchedule | Mapping[str, float],
    max_seq_len: int,
    buffer_size: int,
    packs_per_step: int,
    *,
    max_open_packs: int | None = None,
    loader: type[PackedLoader] = PackedLoader,
) -> PackedLoader:
    """``sources`` -> :class:`MixtureStream` by ``schedule`` (a mapping of weights: one constant phase) ->
    :class:`HybridPacker` -> ``loader`` (a :class:`PackedLoader` class) of ``packs_per_step`` packs."""
    if not isinstance(schedule, MixtureSchedule):
        schedule = MixtureSchedule.constant(schedule)
    mix = MixtureStream(sources, schedule)
    packer = HybridPacker(
        mix, max_seq_len=max_seq_len, buffer_size=buffer_size, max_open_packs=max_open_packs
    )
    return loader(packer, packs_per_step, mixture=mix)


class GatedLoader(PackedLoader):
    """A :class:`PackedLoader` whose next step can be held back (``gate``): a deliberately slow preparation.
    ``entered`` is set when a ``next`` starts, ``left`` when one returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.entered, self.left = threading.Event(), threading.Event()

    def next(self) -> Any:
        self.entered.set()
        self.gate.wait(timeout=5)  # bounded: whatever waits for this fails its test instead of hanging
        try:
            return super().next()
        finally:
            self.left.set()

    def while_held(self, stream: Any, fn: Callable[[], Any]) -> tuple[Any, bool]:
        """Start ``stream``'s preparation of its next step (``stream.prepare()``; ``stream`` a background
        ``ZeroRedundancyFilter`` over this loader), hold it inside this loader's ``next``, call ``fn``, then
        release it and wait for it. Returns ``fn``'s result and whether the preparation was still held when
        ``fn`` returned (False: ``fn`` waited for it, up to the gate's 5 s)."""
        self.gate.clear()
        self.entered.clear()
        self.left.clear()
        stream.prepare()
        if not self.entered.wait(timeout=10):
            raise AssertionError("the loader's preparation of the next step did not start within 10 s")
        out = fn()
        held = not self.left.is_set()
        self.gate.set()
        stream.wait_prepared()
        return out, held


def trained_sources(stream: Any, samples: int) -> list[tuple[int, str]]:
    """``[(step, source)]`` of every sample in the packs of the steps ``stream`` (a
    ``ZeroRedundancyFilter``) emits, in training order, until at least ``samples``; closes the stream."""
    out: list[tuple[int, str]] = []
    with stream:
        while len(out) < samples:
            fs = next(stream)
            out += [(fs.step, s.source) for p in fs.packs for s in p.samples]
    return out


class _FlakyFile(io.RawIOBase):
    """A read-only view of a local file whose reads covering byte ``at`` raise ``OSError(EIO)`` while the
    sidecar's ``failures`` count is above 0 (each failure decrements it)."""

    def __init__(self, path: str, faults: str) -> None:
        super().__init__()
        self._f = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._faults = faults

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, b: Any) -> int:
        start = self._f.tell()
        with open(self._faults) as fh:
            plan = json.load(fh)
        if plan["failures"] > 0 and start <= plan["at"] < start + max(1, len(b)):
            plan["failures"] -= 1
            tmp = f"{self._faults}.{os.getpid()}.{threading.get_ident()}"
            with open(tmp, "w") as fh:
                json.dump(plan, fh)
            os.replace(tmp, self._faults)  # atomic: readers on other threads never see half a file
            raise OSError(errno.EIO, f"injected I/O error at byte {plan['at']}")
        return self._f.readinto(b)

    def close(self) -> None:
        self._f.close()
        super().close()


class FlakyFileSystem(LocalFileSystem):
    """``flaky://`` URLs: local files; one with a ``<path>.faults`` sidecar (``{"at": byte, "failures": n}``)
    fails reads that cover byte ``at`` with ``OSError(EIO)`` ``n`` times, then reads normally."""

    protocol = "flaky"

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        faults = f"{path}.faults"
        if mode == "rb" and os.path.exists(faults):
            return io.BufferedReader(_FlakyFile(path, faults), buffer_size=512)
        return super()._open(path, mode, block_size=block_size, **kwargs)


def flaky_url(path: str, *, at: int, failures: int) -> str:
    """Make reads of ``path`` through its returned ``flaky://`` URL fail at byte ``at``, ``failures`` times
    (registers :class:`FlakyFileSystem` with fsspec)."""
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    with open(f"{path}.faults", "w") as fh:
        json.dump({"at": int(at), "failures": int(failures)}, fh)
    return f"flaky://{os.path.abspath(path)}"


class SyntheticSource(StatefulNode[SampleMeta]):
    """Endless metadata of one source, no shards: sample ``i`` (keys ``{name}1, {name}2, ...``) has a
    token count log-uniform in ``tokens = (lo, hi)`` drawn from a private RNG seeded by ``(seed, i)``
    (exactly ``lo`` when ``lo == hi``); media samples get that many media tokens and 8 text tokens, text
    samples that many text tokens. Resumable by its counter."""

    def __init__(
        self, name: str, modality: Modality | str = "text", tokens: tuple[int, int] = (10, 10), seed: int = 0
    ) -> None:
        super().__init__()
        self.name, self.modality, self.tokens, self.seed, self.i = name, Modality(modality), tokens, seed, 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.i = 0 if initial_state is None else int(initial_state["i"])

    def get_state(self) -> dict[str, Any]:
        return {"i": self.i}

    def next(self) -> SampleMeta:
        lo, hi = self.tokens
        n = (
            lo
            if lo == hi
            else int(math.exp(random.Random(f"{self.seed}/{self.i}").uniform(math.log(lo), math.log(hi))))
        )
        self.i += 1
        text = self.modality is Modality.TEXT
        media, txt = (0, n) if text else (n, 8)
        return SampleMeta(
            f"{self.name}{self.i}", self.name, self.modality, media, txt, 0.0 if text else 1.0, (n,)
        )


def merge_replica_steps(parts: Sequence[FilteredStep], microbatches: int) -> FilteredStep:
    """The same step of several DP replicas' loaders as one step, for a one-process oracle whose step is
    the whole global batch: replica ``d``'s packs follow replica ``d - 1``'s, and its encoder microbatch
    ``e`` (of ``microbatches`` per replica step) becomes ``d * microbatches + e``, with its payloads.

    Raises:
        ValueError: no parts, or a replica with an encoder microbatch outside ``1..microbatches``.
    """
    if not parts:
        raise ValueError("merge_replica_steps: no replica steps to merge")
    packs, mbs, payloads, text, text_errors = [], {}, {}, [], {}
    for d, fs in enumerate(parts):
        base = len(packs)
        packs.extend(fs.packs)
        text.extend(fs.text_ids)
        text_errors.update({(p + base, i): why for (p, i), why in fs.text_errors.items()})
        for e, items in fs.microbatches.items():
            if not 1 <= e <= microbatches:
                raise ValueError(
                    f"merge_replica_steps: replica {d} has encoder microbatch {e}, not in 1..{microbatches}"
                )
            mbs[d * microbatches + e] = [(p + base, i) for p, i in items]
            payloads[d * microbatches + e] = fs.payloads[e]
    return FilteredStep(parts[0].step, packs, mbs, payloads, text, frozenset(payloads), text_errors)
