"""The larger Tux Paint set: stamp images with descriptions and their human-spoken descriptions.

Debian's `tuxpaint-stamps-default` ships, per stamp, `<name>.txt` (English description on the first
line, then `<lang>.utf8=<translation>` lines), `<name>.png` (or only an SVG), and recordings of the
description read by volunteers: `<name>_desc.ogg` (English) and `<name>_desc_<lang>.ogg`. The package
is GPL, so this set is built into a folder outside the repository and never committed.

Recordings are 44.1/48 kHz Ogg Vorbis; they are mixed to mono and resampled to 16 kHz with `soxr`
(a build-time dependency: `pip install soxr`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
from tqdm import tqdm

from omni_train.prepare.openclipart import encode_image
from omni_train.prepare.shards import encode_json, write_shards
from omni_train.prepare.sources import SOURCES, SourceName, require_path
from omni_train.prepare.speech import SAMPLE_RATE, encode_flac

__all__ = ["Stamp", "build_tuxpaint", "read_stamps"]

DEFAULT_STAMPS_ROOT = Path("/usr/share/tuxpaint/stamps")
IMAGES_PER_SHARD = 200
AUDIO_PER_SHARD = 500
_DESC_AUDIO = re.compile(r"^(?P<stem>.+)_desc(?:_(?P<lang>[a-z]{2,3}(?:_[A-Z]{2})?))?\.ogg$")


@dataclass(frozen=True)
class Stamp:
    """One stamp: its image, English description, translations and spoken descriptions.

    Attributes:
        key: `tuxpaint-<folders>-<name>`, e.g. `tuxpaint-animals-birds-adelaide-rosella`.
        image: the PNG, or None when the stamp ships only as SVG.
        caption: the English description (first line of `<name>.txt`).
        captions: {language: description} for every `<lang>.utf8=` line, "en" included.
        recordings: {language: path of `<name>_desc[_<lang>].ogg`}.
    """

    key: str
    image: Path | None
    caption: str
    captions: dict[str, str]
    recordings: dict[str, Path]


def read_stamps(root: Path = DEFAULT_STAMPS_ROOT) -> list[Stamp]:
    """Every stamp with a description, sorted by path.

    Raises:
        MissingSourceError: when `tuxpaint-stamps-default` is not installed.
    """
    root = require_path(SourceName.TUXPAINT, root)
    stamps = []
    for txt in sorted(root.rglob("*.txt")):
        lines = [
            line.strip() for line in txt.read_text("utf-8", errors="replace").splitlines() if line.strip()
        ]
        if not lines:
            continue
        captions = {"en": lines[0]}
        for line in lines[1:]:
            lang, sep, text = line.partition(".utf8=")
            if sep and text.strip():
                captions.setdefault(lang, text.strip())
        recordings = {}
        for ogg in sorted(txt.parent.glob(f"{txt.stem}_desc*.ogg")):
            match = _DESC_AUDIO.match(ogg.name)
            if match and match["stem"] == txt.stem:
                recordings[match["lang"] or "en"] = ogg
        png = txt.with_suffix(".png")
        rel = txt.relative_to(root).with_suffix("")
        key = "tuxpaint-" + re.sub(r"[^A-Za-z0-9_-]+", "_", "-".join(rel.parts))
        stamps.append(Stamp(key, png if png.is_file() else None, lines[0], captions, recordings))
    return stamps


def _require_soxr() -> Any:
    try:
        import soxr
    except ImportError as exc:
        raise ImportError(
            "--source tuxpaint resamples audio with soxr: install it with `pip install soxr`"
        ) from exc
    return soxr


def _resample_mono(path: Path) -> np.ndarray:
    soxr = _require_soxr()
    data, rate = sf.read(path, dtype="float32", always_2d=True)
    mono = data.mean(axis=1)
    if rate != SAMPLE_RATE:
        mono = soxr.resample(mono, rate, SAMPLE_RATE, quality="HQ")
    return np.clip(np.round(mono * 32767.0), -32768, 32767).astype(np.int16)


def build_tuxpaint(
    out: Path, limit: int | None = None, root: Path = DEFAULT_STAMPS_ROOT, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Build `out/shards/image-*.tar` and `out/shards/audio-*.tar` from Tux Paint stamps.

    Image samples: `key.png` (RGB, <= 256 px), `key.txt` (English description), `key.json` (with all
    translations under `captions`). Audio samples, one per recording of any stamp: `key.flac` (16 kHz
    mono), `key.txt` (the description in the recording's language), `key.json` (`"human": true`,
    `language`, and `image_key` when the stamp's image is in the image shards). A recording whose
    language has no description line is skipped and counted.

    Args:
        out: output folder, outside the repository (GPL data).
        limit: at most this many stamp images, and at most this many recordings; None for all.
        root: the package's stamps folder.
        log: where progress lines go.

    Returns:
        The manifest written to `out/manifest.json` (counts, skipped items by reason).

    Raises:
        MissingSourceError: when the package is not installed.
        ImportError: when `soxr` is missing (the message says how to install it).
    """
    _require_soxr()  # fail before building anything
    stamps = read_stamps(root)
    skipped: Counter[str] = Counter()
    spec = SOURCES[SourceName.TUXPAINT]
    with_image = []
    for stamp in stamps:
        if stamp.image is None:
            skipped["stamp without PNG (SVG only)"] += 1
        else:
            with_image.append(stamp)
    chosen = with_image if limit is None else with_image[:limit]
    counts: Counter[str] = Counter()
    languages: Counter[str] = Counter()
    image_keys: set[str] = set()  # filled while the image shards are written, before the audio ones

    def images() -> Iterator[dict[str, Any]]:
        for stamp in tqdm(chosen, desc="tuxpaint images", leave=False):
            assert stamp.image is not None
            encoded = encode_image(stamp.image)
            if isinstance(encoded, str):
                skipped[f"image: {encoded}"] += 1
                continue
            meta = {
                "modality": "image",
                "source": str(SourceName.TUXPAINT),
                "license": spec.license,
                "width": encoded.width,
                "height": encoded.height,
                "title": stamp.caption,
                "captions": stamp.captions,
            }
            counts["image"] += 1
            image_keys.add(stamp.key)
            yield {
                "__key__": stamp.key,
                "png": encoded.png,
                "txt": stamp.caption.encode(),
                "json": encode_json(meta),
            }

    def recordings() -> Iterator[dict[str, Any]]:
        # every stamp's recordings, SVG-only stamps included: the audio does not need the picture
        pairs = [(s, lang, path) for s in stamps for lang, path in sorted(s.recordings.items())]
        for stamp, lang, path in tqdm(
            pairs if limit is None else pairs[:limit], desc="tuxpaint audio", leave=False
        ):
            text = stamp.captions.get(lang)
            if text is None:
                skipped["recording without a description in its language"] += 1
                continue
            try:
                pcm = _resample_mono(path)
            except (RuntimeError, sf.LibsndfileError) as exc:
                skipped[f"unreadable recording ({type(exc).__name__})"] += 1
                continue
            meta = {
                "modality": "audio",
                "source": str(SourceName.TUXPAINT),
                "license": spec.license,
                "sample_rate": SAMPLE_RATE,
                "num_frames": int(pcm.shape[0]),
                "human": True,
                "speaker": f"tuxpaint-{lang}",
                "language": lang,
            }
            if stamp.key in image_keys:
                meta["image_key"] = stamp.key
            counts["audio"] += 1
            languages[lang] += 1
            key = f"{stamp.key}-desc-{lang}"
            yield {"__key__": key, "flac": encode_flac(pcm), "txt": text.encode(), "json": encode_json(meta)}

    shards = out / "shards"
    written = {
        "image": write_shards(shards, "image", images(), IMAGES_PER_SHARD),
        "audio": write_shards(shards, "audio", recordings(), AUDIO_PER_SHARD),
    }
    manifest = {
        "source": str(SourceName.TUXPAINT),
        "license": spec.license,
        "limit": limit,
        "counts": {"stamps": len(stamps), **counts},
        "recordings_per_language": dict(sorted(languages.items())),
        "shards": {m: [p.name for p in paths] for m, paths in written.items()},
        "skipped": dict(sorted(skipped.items())),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").write_text(
        json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    )
    log(
        f"wrote {counts['image']} images and {counts['audio']} recordings to {shards} (GPL: keep out of the repo)"
    )
    return manifest
