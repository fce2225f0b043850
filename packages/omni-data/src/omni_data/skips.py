"""Skipped data, counted and named: :class:`SkipLedger` per pipeline node, :func:`skip_report` for metrics.

Nothing is dropped silently (DESIGN.md §omni-data): every sample, member or shard a node skips is
counted per source and reason, its key kept (the first ``max_keys``), and logged once per source and
reason with the key that started it. Ledgers are part of their node's state, so counts survive resume.

Two scopes, because they are reduced differently across ranks:

- ``"metadata"`` (sources, the packer): every pipeline and TP rank of a DP rank holds the same metadata
  stream, so these counts are identical on those ranks; sum them over DP ranks only.
- ``"payload"`` (:class:`~omni_data.zero_redundancy.ZeroRedundancyFilter`): counted on the rank that read
  the payload (TP rank 0 of each pipeline rank); sum them over every reading rank.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Literal

__all__ = ["SkipLedger", "iter_ledgers", "skip_report"]

logger = logging.getLogger("omni_data")

Scope = Literal["metadata", "payload"]


class SkipLedger:
    """Counts of skipped items by source and reason, with their keys.

    Args:
        owner: who skips (for the log line): a source name, ``"packer"``, ``"filter"``.
        scope: ``"metadata"`` or ``"payload"`` (see the module docstring).
        max_keys: keys kept by name over all sources (the counts are always complete).

    Attributes:
        counts: ``{source: {reason: count}}``.
        keys: ``[(source, key, reason)]`` in skip order, the first ``max_keys``.
    """

    def __init__(self, owner: str, *, scope: Scope = "metadata", max_keys: int = 1000) -> None:
        self.owner = owner
        self.scope: Scope = scope
        self.max_keys = max_keys
        self.counts: dict[str, dict[str, int]] = {}
        self.keys: list[tuple[str, str, str]] = []
        self._logged: set[tuple[str, str]] = set()

    def add(self, source: str, key: str, reason: str) -> None:
        """Count one skipped ``key`` of ``source`` for ``reason``; the first of each (source, reason) is logged."""
        by_reason = self.counts.setdefault(source, {})
        by_reason[reason] = by_reason.get(reason, 0) + 1
        if len(self.keys) < self.max_keys:
            self.keys.append((source, key, reason))
        if (source, reason) not in self._logged:
            self._logged.add((source, reason))
            of = "" if repr(source) in self.owner else f" of source {source!r}"
            logger.warning(
                "%s: skipping %s%s (%s); further ones are counted (skip_report)", self.owner, key, of, reason
            )

    @property
    def total(self) -> int:
        return sum(n for by_reason in self.counts.values() for n in by_reason.values())

    def of(self, source: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
        """``({reason: count}, [(key, reason)])`` of one source."""
        return dict(self.counts.get(source, {})), [(k, r) for s, k, r in self.keys if s == source]

    def merge(self, state: dict[str, Any]) -> None:
        """Add another ledger's :meth:`state_dict` to this one (keys up to ``max_keys``; no logging)."""
        for source, by_reason in state["counts"].items():
            mine = self.counts.setdefault(source, {})
            for reason, n in by_reason.items():
                mine[reason] = mine.get(reason, 0) + int(n)
        room = self.max_keys - len(self.keys)
        self.keys += [(s, k, r) for s, k, r in state["keys"][: max(0, room)]]

    def state_dict(self) -> dict[str, Any]:
        return {
            "counts": {s: dict(r) for s, r in self.counts.items()},
            "keys": [list(x) for x in self.keys],
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore (``None``: empty). Reasons already counted are not logged again."""
        self.counts, self.keys = {}, []
        if state is not None:
            self.merge(state)
        self._logged = {(s, r) for s, by_reason in self.counts.items() for r in by_reason}


def iter_ledgers(node: Any) -> Iterator[SkipLedger]:
    """Every :class:`SkipLedger` in a pipeline of omni-data nodes (a node's ``ledger`` and its
    ``children()``, depth first)."""
    ledger = getattr(node, "ledger", None)
    if isinstance(ledger, SkipLedger):
        yield ledger
    children = getattr(node, "children", None)
    for child in children() if callable(children) else ():
        yield from iter_ledgers(child)


def skip_report(node: Any, *, max_keys: int = 5) -> dict[str, Any]:
    """What a pipeline skipped, for a run's metrics and summary.

    Returns:
        ``{"metadata": {source: {reason: count}}, "payload": {source: {reason: count}},
        "keys": {source: [[key, reason], ...]}, "total": int}``: counts summed over the pipeline's
        ledgers by scope (see the module docstring for how to reduce them over ranks) and the first
        ``max_keys`` keys of each source.
    """
    out: dict[str, Any] = {"metadata": {}, "payload": {}, "keys": {}, "total": 0}
    for ledger in iter_ledgers(node):
        scope = out[ledger.scope]
        for source, by_reason in ledger.counts.items():
            mine = scope.setdefault(source, {})
            for reason, n in by_reason.items():
                mine[reason] = mine.get(reason, 0) + n
                out["total"] += n
        for source, key, reason in ledger.keys:
            keys = out["keys"].setdefault(source, [])
            if len(keys) < max_keys:
                keys.append([key, reason])
    return out
