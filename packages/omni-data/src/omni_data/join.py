"""Consecutive text samples of one document joined into one long sample (long-context recipes).

Corpora often store a long document as consecutive samples ``<doc>-000``, ``<doc>-001``, ... (a play cut
into passages at scene boundaries, as the bundled Shakespeare shards are). A long-context recipe wants
the document whole, so that attention spans it: :class:`JoinDocuments` merges the consecutive parts of
one document (same ``<doc>`` key stem, indices increasing by one, same epoch) found within a look-ahead
window into one :class:`~omni_data.sample.SampleMeta` of up to ``max_tokens`` text tokens. The joined sample keeps every
part's ``txt`` member (``members["txt"]``, ``members["txt+1"]``, ...: :func:`text_members`); the payload
reader tokenizes each part and concatenates the ids, the same count the source gave each part, so a
pack's layout planned from metadata matches the ids read later. Metadata only; nothing is read here.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from torchdata.nodes import BaseNode

from omni_data.node import StatefulNode
from omni_data.sample import MemberRef, Modality, SampleMeta

__all__ = ["JoinDocuments", "document_part", "text_members"]

_PART = re.compile(r"^(?P<doc>.+)-(?P<index>\d+)$")


def document_part(key: str) -> tuple[str, int] | None:
    """``"hamlet-003" -> ("hamlet", 3)``; ``None`` for a key without a trailing ``-<digits>``."""
    m = _PART.match(key)
    return (m["doc"], int(m["index"])) if m else None


def text_members(meta: SampleMeta) -> list[MemberRef]:
    """The ``txt`` members of a sample in text order: ``txt`` then the joined parts ``txt+1``, ``txt+2``...
    (empty when it has no text member)."""
    if "txt" not in meta.members:
        return []
    out, i = [meta.members["txt"]], 1
    while f"txt+{i}" in meta.members:
        out.append(meta.members[f"txt+{i}"])
        i += 1
    return out


class JoinDocuments(StatefulNode[SampleMeta]):
    """Joins the parts of each document found within a look-ahead window (see the module docstring).

    Each call takes the oldest buffered sample; if it is a part of a document, every buffered part of that
    document (same stem and epoch) is sorted by index and the contiguous run from the smallest index is
    joined, up to ``max_tokens`` text tokens; the rest stay buffered for later calls. Shards often
    interleave documents (the bundled Shakespeare shards hold one passage of each play in turn), so the
    window must cover the distance between a document's parts; it costs metadata only.

    Args:
        source: a node of :class:`SampleMeta` (e.g. a text ``WebDatasetSource``).
        max_tokens: a joined sample stops before it would exceed this many text tokens (>= 1); a single
            part longer than that passes alone (the packer's overlong policy decides).
        window: samples buffered ahead (>= 1).

    The joined sample's key is ``<first key>+<parts>`` (``hamlet-000+9``); samples of another modality,
    split text (``text_range`` set) and keys without a ``-<digits>`` suffix pass unchanged, in order.
    Counters in :attr:`stats`: ``documents`` (output samples of more than one part), ``parts`` (their parts).

    Raises:
        ValueError: ``max_tokens`` or ``window`` < 1.
    """

    def __init__(self, source: BaseNode[SampleMeta], max_tokens: int, *, window: int = 1024) -> None:
        super().__init__()
        for name, value in (("max_tokens", max_tokens), ("window", window)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"JoinDocuments: {name} must be a positive int, got {value!r}")
        self.source, self.max_tokens, self.window = source, max_tokens, window
        self._buffer: list[SampleMeta] = []
        self._exhausted = False
        self.stats: dict[str, int] = {}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        st = initial_state or {}
        self.source.reset(st.get("source"))
        self._buffer = [SampleMeta.from_dict(d) for d in st.get("buffer", [])]
        self._exhausted = bool(st.get("exhausted", False))
        self.stats = dict(st.get("stats", {"documents": 0, "parts": 0}))

    def get_state(self) -> dict[str, Any]:
        return {
            "source": self.source.state_dict(),
            "buffer": [s.to_dict() for s in self._buffer],
            "exhausted": self._exhausted,
            "stats": dict(self.stats),
        }

    @staticmethod
    def _part(s: SampleMeta) -> tuple[str, int] | None:
        if s.modality is not Modality.TEXT or s.text_range is not None:
            return None
        return document_part(s.key)

    def next(self) -> SampleMeta:
        while not self._exhausted and len(self._buffer) < self.window:
            try:
                self._buffer.append(next(self.source))
            except StopIteration:
                self._exhausted = True
        if not self._buffer:
            raise StopIteration
        head = self._part(self._buffer[0])
        if head is None:
            return self._buffer.pop(0)
        epoch = self._buffer[0].epoch
        mine = sorted(
            (part[1], j)
            for j, s in enumerate(self._buffer)
            if s.epoch == epoch and (part := self._part(s)) is not None and part[0] == head[0]
        )
        run = [mine[0][1]]
        tokens = self._buffer[run[0]].text_tokens
        for (index, j), (prev, _) in zip(mine[1:], mine):
            if index != prev + 1 or tokens + self._buffer[j].text_tokens > self.max_tokens:
                break
            run.append(j)
            tokens += self._buffer[j].text_tokens
        parts = [self._buffer[j] for j in run]
        taken = set(run)
        self._buffer = [s for j, s in enumerate(self._buffer) if j not in taken]
        if len(parts) == 1:
            return parts[0]
        self.stats["documents"] += 1
        self.stats["parts"] += len(parts)
        first = parts[0]
        members = dict(first.members)
        for i, p in enumerate(parts[1:], start=1):
            members[f"txt+{i}"] = p.members["txt"]
        return replace(
            first, key=f"{first.key}+{len(parts)}", text_tokens=tokens, shape=(tokens,), members=members
        )
