"""Skipped data over a parallel run: every rank's skip ledgers (:func:`omni_data.skip_report`) reduced over
the world at every step, as per-step deltas (for a metrics row) and run totals (for a summary).

How the ledgers reduce (:mod:`omni_data.skips`): metadata skips (a damaged tar header, a key that is not
UTF-8, a read error, a truncated member, over-long media) are counted identically by every pipeline, TP,
CP and Ulysses rank of a DP rank, so only the rank at position 0 of those groups contributes them;
payload skips (media whose body does not decode) are counted by the rank that read the payload, so every
rank contributes its own. Nothing is dropped silently (DESIGN.md §omni-data): each skip is counted per
source and reason, the first keys of each source are named, and the first time a source skips, rank 0
says it with those keys.

Cost: the world's count of skipped items per step (one all-reduce of one int64, or none when the caller
passes the count: e.g. folded into the step's own metrics all-reduce); only when that count changed, two
all-gathers of the ranks' msgpack-encoded reports (no pickle).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from omni_data.skips import skip_report
from omni_parallel import ParallelState

__all__ = ["SkipMetrics", "merge_skip_reports"]

logger = logging.getLogger("omni_data")

_SCOPES = ("metadata", "payload")


def merge_skip_reports(reports: list[dict[str, Any]], max_keys: int) -> dict[str, Any]:
    """One report from per-rank :func:`omni_data.skip_report` results: counts summed per scope, source and
    reason; each source's keys in rank order without repeats, the first ``max_keys``."""
    out: dict[str, Any] = {"metadata": {}, "payload": {}, "keys": {}, "total": 0}
    for rep in reports:
        for scope in _SCOPES:
            for source, by_reason in rep[scope].items():
                mine = out[scope].setdefault(source, {})
                for reason, n in by_reason.items():
                    mine[reason] = mine.get(reason, 0) + int(n)
                    out["total"] += int(n)
        for source, keys in rep["keys"].items():
            mine = out["keys"].setdefault(source, [])
            for key, reason in keys:
                if len(mine) < max_keys and [key, reason] not in mine:
                    mine.append([key, reason])
    return out


class SkipMetrics:
    """Per-step skip counts of one rank's stream, reduced over the world (collective: every rank calls
    :meth:`start` once, then :meth:`step` once per step).

    Args:
        stream: this rank's loader (a :class:`~omni_data.ZeroRedundancyFilter`, or any node whose
            ledgers :func:`~omni_data.skip_report` finds: its own and its upstream nodes').
        ps: the parallel state (which ranks count metadata skips).
        max_keys: keys named per source in the metrics and the summary (the notice names the first 5);
            counts are always complete.
        notice: where rank 0 says, once per source, the first time it skips (one line, e.g. ``"source
            'img' skipped 2 items so far (2 undecodable); first: k1 (undecodable)"``); default: a warning
            on the ``omni_data`` logger.
    """

    def __init__(
        self,
        stream: Any,
        ps: ParallelState,
        *,
        max_keys: int = 20,
        notice: Callable[[str], None] | None = None,
    ) -> None:
        self.stream, self.max_keys = stream, max_keys
        self.rank = ps.rank
        self.counts_metadata = all(ps.local_rank(g) == 0 for g in ("pp", "tp", "cp", "ulysses"))
        self.notice = notice if notice is not None else logger.warning
        self.report = merge_skip_reports([], max_keys)
        self._logged: set[str] = set()

    def start(self) -> None:
        """Take the counts the stream starts with (those of a restored checkpoint) as the baseline."""
        self.report = self._global() or self.report
        self._logged = set(self.report["keys"])

    def local_total(self) -> int:
        """This rank's count of skipped items (metadata skips only where this rank counts them); their sum
        over the world is what :meth:`step` takes (the trainer adds it to the step's metrics all-reduce)."""
        return int(self._local()["total"])

    def step(self, world_total: int | None = None) -> dict[str, Any]:
        """The metrics of the skips since the last call (the same on every rank): ``skipped``
        ``{"source/reason": count}`` and ``skipped_keys`` ``{source: [[key, reason], ...]}`` (keys named
        for the first time), both empty when nothing was skipped. ``world_total``: the sum of
        :meth:`local_total` over the world, already reduced by the caller (else one all-reduce here);
        the named reports are gathered only when it changed (collective: every rank calls it)."""
        now = self._global(world_total)
        if now is None:
            return {"skipped": {}, "skipped_keys": {}}
        before, self.report = self.report, now
        delta: dict[str, int] = {}
        for scope in _SCOPES:
            for source, by_reason in now[scope].items():
                for reason, n in by_reason.items():
                    d = n - before[scope].get(source, {}).get(reason, 0)
                    if d:
                        delta[f"{source}/{reason}"] = delta.get(f"{source}/{reason}", 0) + d
        new_keys = {
            source: [k for k in keys if k not in before["keys"].get(source, [])]
            for source, keys in now["keys"].items()
        }
        new_keys = {s: k for s, k in new_keys.items() if k}
        for source in sorted(set(now["keys"]) - self._logged):
            self._logged.add(source)
            if self.rank == 0:
                counts = {r: n for sc in _SCOPES for r, n in now[sc].get(source, {}).items()}
                first = ", ".join(f"{k} ({r})" for k, r in now["keys"][source][:5])
                said = ", ".join(f"{n} {r}" for r, n in counts.items())
                self.notice(
                    f"source {source!r} skipped {sum(counts.values())} items so far ({said}); first: {first}"
                )
        return {"skipped": delta, "skipped_keys": new_keys}

    def summary(self) -> dict[str, Any]:
        """Totals over the run so far: ``{"metadata": {source: {reason: n}}, "payload": {...}, "keys":
        {source: [[key, reason], ...]}, "total": n}``."""
        return self.report

    def _local(self) -> dict[str, Any]:
        rep = skip_report(self.stream, max_keys=self.max_keys)
        if not self.counts_metadata:  # another rank of this DP rank counts the same metadata skips
            rep["total"] -= sum(n for by_reason in rep["metadata"].values() for n in by_reason.values())
            rep["metadata"] = {}
        return rep

    def _global(self, world_total: int | None = None) -> dict[str, Any] | None:
        """The merged report of every rank, or None when the global count did not change."""
        if not dist.is_initialized():
            reports = [self._local()]
        else:
            if world_total is None:
                total = torch.tensor([self.local_total()], dtype=torch.int64)
                dist.all_reduce(total)
                world_total = int(total)
            if world_total == self.report["total"]:
                return None
            reports = _all_gather_msgpack(self._local())
        merged = merge_skip_reports(reports, self.max_keys)
        return None if merged == self.report else merged


def _all_gather_msgpack(obj: Any) -> list[Any]:
    """``obj`` of every rank (msgpack through two CPU all-gathers: lengths, then padded bytes)."""
    blob = msgpack.packb(obj, use_bin_type=True)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(blob)], dtype=torch.int64))
    width = max(int(s) for s in sizes)
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(outs, buf)
    return [msgpack.unpackb(o[: int(s)].numpy().tobytes(), strict_map_key=False) for o, s in zip(outs, sizes)]
