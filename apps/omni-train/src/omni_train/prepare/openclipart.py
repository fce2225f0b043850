"""Clip-art images with captions from Debian's `openclipart-svg` (metadata) and `openclipart-png` (pixels).

Each SVG carries Dublin Core metadata in a `cc:Work` block: a title, sometimes a description, and
keywords (`dc:subject`). The caption is built from those fields, optionally followed by the WordNet
gloss of the title's head noun. Titles shared by many files are collection names ("Lemon SVG theme"),
not descriptions, so such files are left out. Selection order is the SHA-1 of the file name: stable,
independent of the install path, and spread over every category.
"""

from __future__ import annotations

import hashlib
import io
import re
import warnings
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from omni_train.prepare.sources import SourceName, require_path
from omni_train.prepare.wordnet import WordNetGlosses

__all__ = ["ClipArt", "EncodedImage", "encode_image", "scan_clipart"]

DEFAULT_ROOT = Path("/usr/share/openclipart")
MAX_SIDE_PX = 256
MIN_SIDE_PX = 32
# A few PNG renderings are ~170 megapixels (~700 MB decoded); they are skipped, not decoded.
MAX_SOURCE_PIXELS = 4096 * 4096
# A title used by more than this many files is a collection name, not a description.
_MAX_TITLE_REPEATS = 2
_GENERIC_TITLE = re.compile(r"theme|collection|icon|clip ?art|\bsvg\b|untitled|various", re.IGNORECASE)
_GENERIC_KEYWORDS = frozenset(
    {
        "hash",
        "icon",
        "icons",
        "theme",
        "clip art",
        "clipart",
        "svg",
        "image",
        "png",
        "unsorted",
        "media",
        "other",
    }
)
# At most this many images per category folder, so that country flags do not crowd out the rest.
MAX_PER_CATEGORY = 60
_MAX_KEYWORDS = 8
_SPOKEN_KEYWORDS = 2

_NS = {
    "rdf": "http://www.w3.org/1999/02/22-rdf-syntax-ns#",
    "dc": "http://purl.org/dc/elements/1.1/",
    "cc": "http://web.resource.org/cc/",
}
_BOILERPLATE = re.compile(r"http|HASH\(|converted|www\.", re.IGNORECASE)
_RDF_BLOCK = re.compile(rb"<rdf:RDF\b.*?</rdf:RDF>", re.DOTALL)
_WRAP = "<w " + " ".join(f'xmlns:{k}="{v}"' for k, v in _NS.items()) + ">{}</w>"


@dataclass(frozen=True)
class ClipArt:
    """One selected clip-art image and its caption.

    Attributes:
        key: WebDataset key, `openclipart-<category>-<file stem>`.
        png: the raster file from `openclipart-png`.
        category: top-level folder, e.g. "animals".
        title: `dc:title` of the SVG's `cc:Work`.
        caption: title, description, keywords and (when found) WordNet gloss, as sentences.
        spoken: a short caption to read aloud: title and up to two keywords.
        gloss_used: whether the caption contains a WordNet gloss (its license then applies too).
    """

    key: str
    png: Path
    category: str
    title: str
    caption: str
    spoken: str
    gloss_used: bool


@dataclass
class ScanReport:
    """How many SVG files were seen and why the ones not selected were left out."""

    files: int = 0
    unique: int = 0
    skipped: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class _Meta:
    rel: Path
    title: str
    description: str
    keywords: tuple[str, ...]


def _text(el: ET.Element | None) -> str:
    return " ".join((el.text or "").split()) if el is not None else ""


def _read_meta(path: Path, rel: Path) -> _Meta | None:
    raw = path.read_bytes()
    match = _RDF_BLOCK.search(raw)
    work = None
    if match is not None:
        try:
            work = ET.fromstring(_WRAP.format(match.group(0).decode("utf-8"))).find(".//cc:Work", _NS)
        except (ET.ParseError, UnicodeDecodeError):
            work = None
    if work is None:  # namespaces declared elsewhere or unusual layout: parse the whole document
        try:
            work = ET.fromstring(raw).find(".//cc:Work", _NS)
        except ET.ParseError:
            return None
    if work is None:
        return None
    keywords = tuple(_text(li) for li in work.findall("dc:subject//rdf:li", _NS))
    title = _text(work.find("dc:title", _NS)).replace("_", " ")
    return _Meta(rel, title, _text(work.find("dc:description", _NS)), keywords)


def _sentence(text: str) -> str:
    text = text.strip()
    text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."


def _good_title(title: str, repeats: int) -> bool:
    words = re.findall(r"[A-Za-z]{3,}", title)
    return (
        bool(words)
        and 3 <= len(title) <= 60
        and repeats <= _MAX_TITLE_REPEATS
        and not _GENERIC_TITLE.search(title)
    )


def _keywords(meta: _Meta) -> list[str]:
    out: list[str] = []
    for kw in meta.keywords:
        kw = kw.lower().replace("_", " ").strip()
        if kw and kw not in _GENERIC_KEYWORDS and kw not in out and re.fullmatch(r"[a-z][a-z \-']*", kw):
            out.append(kw)
    return out[:_MAX_KEYWORDS]


def _head_noun_gloss(
    title: str, keywords: list[str], glosses: WordNetGlosses | None
) -> tuple[str, str] | None:
    # Only when the head noun is the whole title or also a keyword: a surer guess at the sense.
    if glosses is None:
        return None
    words = re.findall(r"[A-Za-z]+", title)
    if not words:
        return None
    noun = words[-1].lower()
    for candidate in (noun, noun[:-1] if noun.endswith("s") else None):
        if candidate and len(candidate) >= 3 and (len(words) == 1 or candidate in keywords):
            gloss = glosses.gloss(candidate)
            if gloss:
                return candidate, gloss
    return None


def _caption(meta: _Meta, glosses: WordNetGlosses | None) -> tuple[str, str, bool]:
    parts = [_sentence(meta.title)]
    desc = meta.description
    if 10 <= len(desc) <= 300 and desc.lower() != meta.title.lower() and not _BOILERPLATE.search(desc):
        parts.append(_sentence(desc))
    keywords = _keywords(meta)
    if keywords:
        parts.append("Keywords: " + ", ".join(keywords) + ".")
    spoken = " ".join(
        [parts[0]] + (["Keywords: " + ", ".join(keywords[:_SPOKEN_KEYWORDS]) + "."] if keywords else [])
    )
    noun_gloss = _head_noun_gloss(meta.title, keywords, glosses)
    if noun_gloss is not None:
        parts.append(f"{noun_gloss[0].capitalize()}: {noun_gloss[1]}.")
    return " ".join(parts), spoken, noun_gloss is not None


def _order(name: str) -> str:
    return hashlib.sha1(name.encode("utf-8")).hexdigest()


def scan_clipart(
    root: Path = DEFAULT_ROOT, glosses: WordNetGlosses | None = None, report: ScanReport | None = None
) -> Iterator[ClipArt]:
    """Yield every captionable clip-art image in selection order (SHA-1 of the file name).

    Files appearing in several category folders are taken once (the shallowest path). Left out, and
    counted in `report.skipped` by reason: no metadata, a missing or generic title, a missing PNG, a
    category that already gave 60 images.
    Pixels are not checked here (see `encode_image`).

    Args:
        root: the `openclipart` folder holding `svg/` and `png/`.
        glosses: WordNet glosses to append to captions, or None for none.
        report: filled with counts of files seen and skipped.

    Raises:
        MissingSourceError: when `root/svg` or `root/png` is not installed.
    """
    report = report if report is not None else ScanReport()
    svg_root = require_path(SourceName.OPENCLIPART, root / "svg")
    png_root = require_path(SourceName.OPENCLIPART, root / "png")
    chosen: dict[str, Path] = {}
    for path in sorted(svg_root.rglob("*.svg")):
        report.files += 1
        rel = path.relative_to(svg_root)
        prev = chosen.get(path.name)
        if prev is None or (len(rel.parts), str(rel)) < (len(prev.parts), str(prev)):
            chosen[path.name] = rel
    report.unique = len(chosen)
    metas: list[_Meta] = []
    for name in sorted(chosen, key=_order):
        meta = _read_meta(svg_root / chosen[name], chosen[name])
        if meta is None:
            report.skipped["no cc:Work metadata"] += 1
        else:
            metas.append(meta)
    repeats = Counter(m.title.lower() for m in metas)
    keys: set[str] = set()
    per_category: Counter[str] = Counter()
    for meta in metas:
        if not _good_title(meta.title, repeats[meta.title.lower()]):
            report.skipped["missing or generic title"] += 1
            continue
        png = png_root / meta.rel.with_suffix(".png")
        if not png.is_file():
            report.skipped["no PNG rendering"] += 1
            continue
        category = meta.rel.parts[0] if len(meta.rel.parts) > 1 else "misc"
        if per_category[category] >= MAX_PER_CATEGORY:
            report.skipped[f"over {MAX_PER_CATEGORY} per category"] += 1
            continue
        key = "openclipart-" + re.sub(r"[^A-Za-z0-9_-]+", "_", f"{category}-{meta.rel.stem}")
        if key in keys:
            report.skipped["duplicate key"] += 1
            continue
        keys.add(key)
        per_category[category] += 1
        caption, spoken, gloss_used = _caption(meta, glosses)
        yield ClipArt(key, png, category, meta.title, caption, spoken, gloss_used)


@dataclass(frozen=True)
class EncodedImage:
    """A downscaled image ready to store.

    Attributes:
        png: PNG bytes, RGB, long side <= 256 px.
        width: pixels.
        height: pixels.
    """

    png: bytes
    width: int
    height: int


def encode_image(path: Path, max_side: int = MAX_SIDE_PX) -> EncodedImage | str:
    """Downscale a PNG to <= `max_side` px on its long side (never upscaled), as RGB.

    Transparent clip art is composited onto white first: most loaders drop alpha by plain conversion,
    which would turn transparent backgrounds black.

    Returns:
        The encoded image, or a string saying why the image is unusable ("unreadable PNG: ...",
        "larger than 16 megapixels", "smaller than 32 px", "blank (one colour)"); the caller counts
        it as skipped.
    """
    with warnings.catch_warnings():
        # PIL warns when opening > 89 megapixels; such images are skipped just below and counted
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(path) as im:
                if im.width * im.height > MAX_SOURCE_PIXELS:
                    return "larger than 16 megapixels"
                im.load()
                if "A" in im.getbands() or "transparency" in im.info:
                    rgba = im.convert("RGBA")
                    rgb = Image.alpha_composite(
                        Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba
                    ).convert("RGB")
                else:
                    rgb = im.convert("RGB")
        except Image.DecompressionBombError:  # PIL refuses > 179 megapixels at open
            return "larger than 16 megapixels"
        except (OSError, ValueError) as exc:
            return f"unreadable PNG: {type(exc).__name__}"
    if max(rgb.size) < MIN_SIDE_PX:
        return "smaller than 32 px"
    if all(lo == hi for lo, hi in rgb.getextrema()):
        return "blank (one colour)"
    rgb.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    rgb.save(buf, format="PNG", optimize=True)
    return EncodedImage(buf.getvalue(), rgb.width, rgb.height)
