"""Turn your own media into omni-data shards: ``python -m omni_data.write INPUT OUT``.

Input, either:

- a folder: every image (``png jpg jpeg webp``, or ``bmp gif tif tiff``, re-encoded as PNG), video
  (``mp4 webm mkv mov avi ogv``, stored as is) or audio file (``flac wav ogg``, or anything else libsndfile
  reads, e.g. ``mp3 aiff``, re-encoded as FLAC), with its
  caption or transcript in a ``.txt`` of the same name beside it (optional), and extra fields in a
  ``.json`` of the same name (optional, merged into the sample's json). A folder of only ``.txt`` files
  becomes text shards;
- or a manifest (``--manifest list.csv`` or ``list.jsonl``): one row per sample with ``path`` (media,
  relative to the manifest's folder; absent for text samples), ``text`` (or ``caption`` /
  ``transcript``), and optionally ``key``.

Output (the layout ``WebDatasetSource`` reads): ``OUT/{modality}-000000.tar, ...`` with ``--per-shard``
samples each; per sample ``KEY.{png|jpg|jpeg|webp}``, ``KEY.{mp4|webm|mkv|mov|avi|ogv}`` or
``KEY.{flac|wav|ogg}`` (the file's own bytes when already in one of those formats), ``KEY.txt`` (UTF-8)
and ``KEY.json``: images ``{"width", "height"}``, videos ``{"frames", "fps", "width", "height",
"duration_s"}`` (frames counted by decoding the whole video with PyAV, so a damaged one is found here;
the loader plans from these fields without reading the video), audio ``{"num_frames", "sample_rate", "channels"}`` (of the file as stored: the loader
resamples to the encoder's rate and averages channels), plus ``"path"`` (where it came from) and any
fields of the sidecar json. Keys are the relative path without extension, with ``/`` as ``__`` and
characters outside ``[A-Za-z0-9_-]`` as ``_`` (WebDataset keys cannot hold dots), made unique.
``OUT/manifest.json`` lists the shards, counts per modality and every file skipped, by reason (a file
that does not decode, text that is not UTF-8, a caption without media, a file of another type, and
hostile media refused before the expensive decode, :mod:`omni_data.media_checks`: an empty file, an
image of no pixels or declaring more than ``max_image_pixels`` (a decompression bomb), a video of no
frames or whose frames exceed that bound, audio with no frames or a NaN, Inf or absurdly large sample). Files under ``OUT`` are not read when ``OUT`` lies
inside the input folder.

Source: WebDataset's shard format (``webdataset.ShardWriter``), through fsspec (``OUT`` may be any
fsspec URL).
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import soundfile
import webdataset as wds

from omni_data.media_checks import DEFAULT_MAX_IMAGE_PIXELS, MediaRefusedError, open_image, waveform_problem
from omni_data.sample import Modality
from omni_data.source import AUDIO_EXTS, IMAGE_EXTS
from omni_data.video import VIDEO_EXTS, decoded_info

__all__ = ["WriteReport", "main", "write_dataset", "write_dataset_args", "write_shards"]

_IMAGE_CONVERT = ("bmp", "gif", "tif", "tiff")
_AUDIO_CONVERT = ("mp3", "aiff", "aif", "au", "caf", "opus")
_TEXT_FIELDS = ("text", "caption", "transcript")


@dataclass
class WriteReport:
    """What :func:`write_dataset` wrote: shard URLs and sample counts per modality, skipped files by reason,
    and the media files written without a caption or transcript (no ``.txt`` of the same name, or no
    text in the manifest row): they train the encoder and projector on no target text."""

    shards: dict[str, list[str]] = field(default_factory=dict)
    samples: Counter[str] = field(default_factory=Counter)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    uncaptioned: list[str] = field(default_factory=list)

    def skip(self, what: str, reason: str) -> None:
        self.skipped.setdefault(reason, []).append(what)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shards": self.shards,
            "samples": dict(self.samples),
            "skipped": self.skipped,
            "uncaptioned": self.uncaptioned,
        }

    def summary(self) -> list[str]:
        """The skipped and uncaptioned files as lines for a command's output (count, reason, first 5)."""
        out = []
        for reason, what in sorted(self.skipped.items()):
            out.append(f"skipped {len(what)} ({reason}): {_first(what)}")
        if self.uncaptioned:
            out.append(
                f"written without a caption or transcript {len(self.uncaptioned)} (no .txt of the same "
                f"name): {_first(self.uncaptioned)}"
            )
        return out


def _first(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (" ..." if len(names) > n else "")


def write_shards(pattern: str, samples: Iterable[dict[str, Any]], *, per_shard: int) -> list[str]:
    """Write ``samples`` (WebDataset dicts: ``__key__`` and ``ext -> bytes|str``) to tar shards named
    ``pattern % i`` (any fsspec URL) with ``webdataset.ShardWriter``.

    Returns:
        The shard URLs written, in order.
    """
    urls: list[str] = []
    files: list[Any] = []

    def opener(url: str) -> Any:
        urls.append(url)
        files.append(fsspec.open(url, "wb").open())
        return files[-1]

    writer = wds.ShardWriter(pattern, maxcount=per_shard, verbose=0, opener=opener)
    try:
        for s in samples:
            writer.write(s)
    finally:
        writer.close()
        for f in files:  # ShardWriter leaves files from an opener open; memory:// commits on close
            f.close()
    return urls


@dataclass(frozen=True, slots=True)
class _Item:
    key: str
    path: Path | None  # media (None: a text sample)
    text: str | None
    extra: dict[str, Any]
    origin: str


def _modality_of(path: Path) -> Modality | None:
    ext = path.suffix.lower().lstrip(".")
    if ext in IMAGE_EXTS or ext in _IMAGE_CONVERT:
        return Modality.IMAGE
    if ext in VIDEO_EXTS:
        return Modality.VIDEO
    if ext in AUDIO_EXTS or ext in _AUDIO_CONVERT:
        return Modality.AUDIO
    return None


def _key(stem: str, taken: set[str]) -> str:
    key = "__".join(re.sub(r"[^A-Za-z0-9_-]", "_", part) for part in stem.split("/")) or "sample"
    out, n = key, 1
    while out in taken:
        n += 1
        out = f"{key}_{n}"
    taken.add(out)
    return out


def _read_text(path: Path, report: WriteReport, name: str) -> str | None:
    try:
        return path.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        report.skip(name, "text is not UTF-8")
        return None


def _from_folder(root: Path, report: WriteReport, skip_dir: Path | None = None) -> Iterator[_Item]:
    """Samples of the folder ``root``; files under ``skip_dir`` (the output, when inside it) are not read."""
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and not p.name.startswith(".")
        and (skip_dir is None or not p.resolve().is_relative_to(skip_dir))
    )
    by_stem: dict[Path, list[Path]] = {}
    for p in files:
        if _modality_of(p) is None and p.suffix.lower() not in (".txt", ".json"):
            report.skip(str(p.relative_to(root)), "not an image, video, audio, .txt or .json file")
            continue
        by_stem.setdefault(p.with_suffix(""), []).append(p)
    taken: set[str] = set()
    media_stems = {s for s, ps in by_stem.items() if any(_modality_of(p) for p in ps)}
    text_only = not media_stems
    for stem, paths in sorted(by_stem.items()):
        media = [p for p in paths if _modality_of(p)]
        txt = next((p for p in paths if p.suffix.lower() == ".txt"), None)
        side = next((p for p in paths if p.suffix.lower() == ".json"), None)
        rel = str(stem.relative_to(root))
        if len(media) > 1:
            report.skip(rel, "several media files with one name")
            continue
        if not media and not text_only:
            if txt is not None:
                report.skip(str(txt.relative_to(root)), "text without a media file of the same name")
            continue
        text = _read_text(txt, report, str(txt.relative_to(root))) if txt is not None else None
        if txt is not None and text is None:
            continue
        extra: dict[str, Any] = {}
        if side is not None:
            try:
                extra = json.loads(side.read_bytes())
            except (ValueError, UnicodeDecodeError):
                report.skip(str(side.relative_to(root)), "bad json")
                continue
            if not isinstance(extra, dict):
                report.skip(str(side.relative_to(root)), "bad json")
                continue
        path = media[0] if media else None
        origin = str((path or txt or stem).relative_to(root))
        yield _Item(_key(rel, taken), path, text, extra, origin)


def _from_manifest(manifest: Path, report: WriteReport) -> Iterator[_Item]:
    root = manifest.parent
    raw = manifest.read_bytes().decode("utf-8-sig")  # spreadsheets save "CSV UTF-8" with a BOM
    if manifest.suffix.lower() == ".csv":
        rows: Iterable[dict[str, Any]] = csv.DictReader(io.StringIO(raw))
    elif manifest.suffix.lower() in (".jsonl", ".ndjson"):
        rows = []
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{manifest}: line {n} is not JSON: {e}") from e
                if not isinstance(row, dict):
                    raise ValueError(f"{manifest}: line {n} is not a JSON object")
                rows.append(row)
    else:
        raise ValueError(f"{manifest}: a manifest is a .csv or .jsonl file")
    taken: set[str] = set()
    for n, row in enumerate(rows, 1):
        text = next((str(row[f]) for f in _TEXT_FIELDS if row.get(f) not in (None, "")), None)
        path = root / str(row["path"]) if row.get("path") else None
        if path is None and text is None:
            report.skip(f"{manifest.name}:{n}", "row with neither path nor text")
            continue
        if path is not None and not path.is_file():
            report.skip(str(row["path"]), "file not found")
            continue
        if path is not None and _modality_of(path) is None:
            report.skip(str(row["path"]), "not an image, video or audio file")
            continue
        name = str(row.get("key") or Path(str(row.get("path") or f"row{n:06d}")).with_suffix(""))
        extra = {k: v for k, v in row.items() if k not in ("path", "key", *_TEXT_FIELDS)}
        yield _Item(_key(name, taken), path, text, extra, str(row.get("path") or f"{manifest.name}:{n}"))


def _encode(
    item: _Item, modality: Modality, report: WriteReport, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> dict[str, Any] | None:
    sample: dict[str, Any] = {"__key__": item.key}
    info: dict[str, Any] = {"path": item.origin, **item.extra}
    if item.text is not None:
        sample["txt"] = item.text
    if modality is Modality.TEXT:
        if not item.text:
            report.skip(item.origin, "empty text")
            return None
        return sample
    assert item.path is not None
    data = item.path.read_bytes()
    ext = item.path.suffix.lower().lstrip(".")
    try:
        if not data:
            raise MediaRefusedError("empty file", "0 bytes")
        if modality is Modality.IMAGE:
            with open_image(data, max_image_pixels) as im:  # the declared size is checked before load
                im.load()  # decodes the whole file: a damaged body is found here, not in training
                info.update(width=im.width, height=im.height)
                if ext not in IMAGE_EXTS:
                    buf = io.BytesIO()
                    (
                        im if im.mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16") else im.convert("RGB")
                    ).save(buf, format="PNG")
                    data, ext = buf.getvalue(), "png"
        elif modality is Modality.VIDEO:
            v = decoded_info(data, max_image_pixels)
            info.update(
                frames=v.frames,
                fps=v.fps,
                width=v.width,
                height=v.height,
                duration_s=round(v.frames / v.fps, 6),
            )
        else:
            wave, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
            bad = waveform_problem(wave)  # no frames, or a NaN/Inf/absurd sample that would poison the run
            if bad is not None:
                raise bad
            info.update(num_frames=int(wave.shape[0]), sample_rate=int(rate), channels=int(wave.shape[1]))
            if ext not in AUDIO_EXTS:
                buf = io.BytesIO()
                soundfile.write(buf, wave, rate, format="FLAC", subtype="PCM_24")
                data, ext = buf.getvalue(), "flac"
    except MediaRefusedError as e:
        report.skip(item.origin, e.reason)
        return None
    except Exception as e:  # PIL, libsndfile and FFmpeg raise many types for files they cannot decode
        report.skip(item.origin, f"undecodable {modality} ({type(e).__name__})")
        return None
    sample[ext] = data
    sample["json"] = json.dumps(info, ensure_ascii=False)
    if not item.text:
        report.uncaptioned.append(item.origin)
    return sample


def write_dataset(
    source: str | os.PathLike[str],
    out: str,
    *,
    manifest: str | os.PathLike[str] | None = None,
    per_shard: int = 1000,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> WriteReport:
    """Write shards of every modality found in ``source`` (a folder) or ``manifest`` to ``out``.

    ``max_image_pixels``: the most ``width * height`` an image may declare; larger ones are skipped
    (``"image over the pixel limit"``) from their header, never decoded. The loader applies its own
    limit (``WebDatasetSource(max_image_pixels=)``) to whatever shards it reads.

    Returns:
        The :class:`WriteReport` (also written to ``out/manifest.json``).

    Raises:
        ValueError: ``per_shard`` or ``max_image_pixels`` < 1, no input, a malformed manifest, or nothing
            usable found.
    """
    if per_shard < 1:
        raise ValueError(f"write_dataset: per_shard must be >= 1, got {per_shard}")
    if max_image_pixels < 1:
        raise ValueError(f"write_dataset: max_image_pixels must be >= 1, got {max_image_pixels}")
    report = WriteReport()
    if manifest is not None:
        items = list(_from_manifest(Path(manifest), report))
    else:
        root = Path(source)
        if not root.is_dir():
            raise ValueError(f"write_dataset: {root} is not a folder (give a folder, or --manifest FILE)")
        local = "://" not in out or out.startswith("file://")
        skip_dir = Path(out.removeprefix("file://")).resolve() if local else None
        items = list(_from_folder(root, report, skip_dir))
    groups: dict[Modality, list[_Item]] = {}
    for it in items:
        modality = (_modality_of(it.path) if it.path is not None else None) or Modality.TEXT
        groups.setdefault(modality, []).append(it)
    out = out.rstrip("/")
    fsspec.core.url_to_fs(out)[0].makedirs(out, exist_ok=True)
    for modality, group in sorted(groups.items()):
        encoded = (_encode(it, modality, report, max_image_pixels) for it in group)
        samples = (s for s in encoded if s is not None)
        first = next(samples, None)
        if first is None:  # every file of it was skipped (named in the report): no empty shard, no source
            continue
        counted = _counting(itertools.chain([first], samples), report.samples, str(modality))
        report.shards[str(modality)] = write_shards(
            f"{out}/{modality}-%06d.tar", counted, per_shard=per_shard
        )
    if not report.samples:
        raise ValueError(
            f"write_dataset: no usable sample in {manifest or source}; skipped: {report.skipped}"
        )
    with fsspec.open(f"{out}/manifest.json", "w") as f:
        json.dump(report.to_dict(), f, indent=2)
    return report


def _counting(
    samples: Iterable[dict[str, Any]], counter: Counter[str], name: str
) -> Iterator[dict[str, Any]]:
    for s in samples:
        counter[name] += 1
        yield s


def write_dataset_args(args: argparse.Namespace) -> WriteReport:
    """:func:`write_dataset` from parsed command-line arguments (``python -m omni_data.write``, ``omni-train
    make-shards``): ``input`` (``.`` when only ``manifest`` is given), ``out``, ``manifest``, ``per_shard``
    and ``max_image_pixels``."""
    return write_dataset(
        args.input or ".",
        args.out,
        manifest=args.manifest,
        per_shard=args.per_shard,
        max_image_pixels=args.max_image_pixels,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m omni_data.write`` command; returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="python -m omni_data.write",
        description="Turn a folder of images/audio with .txt captions or transcripts (or a CSV/JSONL "
        "manifest) into omni-data WebDataset shards with metadata.",
    )
    ap.add_argument("input", nargs="?", help="folder of media files and same-named .txt/.json sidecars")
    ap.add_argument("out", help="output folder (or fsspec URL) for {modality}-NNNNNN.tar and manifest.json")
    ap.add_argument("--manifest", help="CSV or JSONL with columns path, text (or caption/transcript), key")
    ap.add_argument("--per-shard", type=int, default=1000, help="samples per shard (default 1000)")
    ap.add_argument(
        "--max-image-pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help=f"skip images declaring more pixels than this, undecoded (default {DEFAULT_MAX_IMAGE_PIXELS})",
    )
    args = ap.parse_args(argv)
    if args.input is None and args.manifest is None:
        ap.error("give an input folder or --manifest FILE")
    try:
        report = write_dataset_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for modality, urls in report.shards.items():
        first, last = urls[0].rsplit("/", 1)[-1], urls[-1].rsplit("/", 1)[-1]
        span = first if first == last else f"{modality}-{{{first[-10:-4]}..{last[-10:-4]}}}.tar"
        print(f"{modality}: {report.samples[modality]} samples in {len(urls)} shards: {args.out}/{span}")
    for line in report.summary():
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
