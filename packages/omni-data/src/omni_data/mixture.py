"""Mixture schedules over sources and deterministic low-discrepancy selection.

``MixtureSchedule`` gives per-source weights as a function of the training position (step or tokens):
piecewise constant phases (the paper's multi-stage recipes, §2.2 "dynamic modality mixture") or linear
interpolation between points. ``MixtureStream`` draws the next sample's source by smooth weighted
round-robin (nginx's SWRR; equivalently largest accumulated deficit): every draw each source earns its
weight in credit, the richest source is chosen and pays 1. For fixed weights each source's count after
``n`` draws stays within a constant (< number of sources) of ``n * weight``, so realised shares in any
window of 10,000 draws track the schedule to well under 0.5 percentage points, with no RNG at all.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from torchdata.nodes import BaseNode

from omni_data.node import StatefulNode, common, resplit_child
from omni_data.sample import SampleMeta
from omni_data.source import EmptySourceError

__all__ = ["MixtureSchedule", "MixtureStream", "ScheduleUnit"]


class ScheduleUnit(StrEnum):
    """What a schedule point's position counts: optimizer steps or drawn tokens (expanded)."""

    STEP = "step"
    TOKEN = "token"


class MixtureSchedule:
    """Per-source weights over training position.

    Args:
        points: ``[(position, {source: weight})]`` with strictly increasing positions, the first at 0.
            Weights are non-negative and normalised per point; every point names the same sources.
        unit: what ``position`` counts (:class:`ScheduleUnit`).
        interpolate: ``False``: phases (weights of the last point at or before the position);
            ``True``: linear between neighbouring points, constant after the last.

    Raises:
        ValueError: no points, the first not at 0, positions not increasing, differing source sets,
            a negative or non-finite weight, or a point whose weights sum to 0.
    """

    def __init__(
        self,
        points: Sequence[tuple[int, Mapping[str, float]]],
        *,
        unit: ScheduleUnit | str = ScheduleUnit.STEP,
        interpolate: bool = False,
    ) -> None:
        if not points or points[0][0] != 0:
            raise ValueError("MixtureSchedule: need at least one point, the first at position 0")
        self.sources: list[str] = list(points[0][1])
        self.unit = ScheduleUnit(unit)
        self.interpolate = interpolate
        self.positions: list[int] = []
        self.table: list[list[float]] = []
        for pos, w in points:
            if self.positions and pos <= self.positions[-1]:
                raise ValueError(
                    f"MixtureSchedule: positions must increase, got {pos} after {self.positions[-1]}"
                )
            if set(w) != set(self.sources):
                raise ValueError(
                    f"MixtureSchedule: point at {pos} names {sorted(w)}, expected {sorted(self.sources)}"
                )
            vals = [float(w[s]) for s in self.sources]
            if any(not (v >= 0.0 and v < float("inf")) for v in vals) or sum(vals) <= 0:
                raise ValueError(
                    f"MixtureSchedule: weights at {pos} must be finite, >= 0, not all 0: {dict(w)}"
                )
            self.positions.append(int(pos))
            self.table.append([v / sum(vals) for v in vals])

    @classmethod
    def constant(cls, weights: Mapping[str, float]) -> MixtureSchedule:
        """One phase forever."""
        return cls([(0, weights)])

    def weights_at(self, position: int) -> list[float]:
        """Normalised weights (in :attr:`sources` order) at ``position`` (steps or tokens)."""
        j = bisect.bisect_right(self.positions, position) - 1
        if not self.interpolate or j + 1 >= len(self.positions):
            return list(self.table[j])
        a, b = self.positions[j], self.positions[j + 1]
        t = (position - a) / (b - a)
        return [(1 - t) * x + t * y for x, y in zip(self.table[j], self.table[j + 1])]

    def weights(self, position: int) -> dict[str, float]:
        return dict(zip(self.sources, self.weights_at(position)))


class MixtureStream(StatefulNode[SampleMeta]):
    """Interleaves sources by a :class:`MixtureSchedule` with smooth weighted round-robin.

    The position the schedule reads (:meth:`position`) is, for ``unit="step"``, the step at which the
    next drawn sample is expected to be *trained*: :attr:`step` (advanced by the consumer with
    :meth:`set_step`) plus :attr:`lookahead` steps, which :class:`~omni_data.loader.PackedLoader` sets to
    the packer's backlog (samples drawn but not yet emitted). Without it, a packer with a look-ahead
    buffer trains samples drawn under a phase several steps after that phase ended. For
    ``unit="token"`` it is the *global* number of expanded tokens drawn: the DP-wide total at the last
    synchronisation (:meth:`sync_tokens`, done by ``PackedLoader`` with a ``dp_group`` inside the
    all-reduce it already runs every step) plus ``dp_size`` times this rank's tokens since, so every
    DP rank switches phase at about the same global token count. All of it is state.

    A source that runs out ends the stream (``StopIteration``): weights are never zeroed behind the
    schedule's back. Make sources cycle (``epochs=None``) for endless mixing; :class:`PackedLoader`
    with a ``dp_group`` stops every DP rank at the same step when any reader runs out.

    Args:
        sources: ``{name: node}``, names matching the schedule's.
        schedule: the weights over time.

    Raises:
        ValueError: source names differ from the schedule's.
        EmptySourceError: (from ``next``) a source ran out before yielding a single sample.
    """

    def __init__(self, sources: Mapping[str, BaseNode[SampleMeta]], schedule: MixtureSchedule) -> None:
        super().__init__()
        if set(sources) != set(schedule.sources):
            raise ValueError(
                f"MixtureStream: sources {sorted(sources)} != schedule's {sorted(schedule.sources)}"
            )
        self.schedule = schedule
        self.names = list(schedule.sources)
        self.sources = [sources[n] for n in self.names]
        self.lookahead: Callable[[], int] | None = None
        self.step = 0
        self.tokens = 0
        self.synced = [0, 0, 1]  # [global tokens, this rank's tokens then, DP size]
        self.credit = [0.0] * len(self.names)
        self.counts = [0] * len(self.names)

    def children(self) -> list[BaseNode[Any]]:
        return list(self.sources)

    def set_step(self, step: int) -> None:
        """Set the training step the schedule reads (for ``unit="step"``)."""
        self.step = int(step)

    def sync_tokens(self, global_tokens: int, local_tokens: int, dp_size: int) -> None:
        """Record that the DP ranks had drawn ``global_tokens`` in total when this rank had drawn
        ``local_tokens`` (for ``unit="token"``); ``dp_size`` ranks draw alike from then on."""
        self.synced = [int(global_tokens), int(local_tokens), int(dp_size)]

    def position(self) -> int:
        """Where the schedule is read for the next draw: a step (expected training step of the sample) or
        an estimate of the global token count."""
        if self.schedule.unit is ScheduleUnit.STEP:
            return self.step + (self.lookahead() if self.lookahead is not None else 0)
        g, at, dp = self.synced
        return g + dp * (self.tokens - at)

    def phase(self) -> int:
        """Index of the schedule phase the next draw is in (always 0 for an interpolated schedule, which
        has no boundaries to keep)."""
        if self.schedule.interpolate:
            return 0
        return bisect.bisect_right(self.schedule.positions, self.position()) - 1

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        st = initial_state or {}
        for name, src in zip(self.names, self.sources):
            src.reset(st["sources"][name] if st else None)
        self.step = int(st.get("step", 0))
        self.tokens = int(st.get("tokens", 0))
        self.synced = [int(x) for x in st.get("synced", [0, 0, 1])]
        self.credit = [float(x) for x in st.get("credit", [0.0] * len(self.names))]
        self.counts = [int(x) for x in st.get("counts", [0] * len(self.names))]

    def load_resplit(self, states: Sequence[dict[str, Any]], rank: int, world_size: int) -> None:
        """Resume under another DP size: each source re-splits the work of every old rank's reader of it;
        the schedule goes on at the old ranks' common step and their total drawn tokens.

        Raises:
            LayoutMismatchError: the old ranks are at different steps, or a source cannot re-split.
        """
        states = list(states)
        step = common(
            states, "step", f"MixtureStream: {len(states)} old DP ranks -> rank {rank} of {world_size}"
        )
        for name, src in zip(self.names, self.sources):
            resplit_child(src, [st["sources"][name] for st in states], rank, world_size)
        super().reset(None)
        self.step, self.tokens = step, 0
        self.synced = [sum(int(st["tokens"]) for st in states), 0, world_size]
        self.credit = [0.0] * len(self.names)
        self.counts = [sum(int(st["counts"][i]) for st in states) for i in range(len(self.names))]

    def get_state(self) -> dict[str, Any]:
        return {
            "sources": {n: s.state_dict() for n, s in zip(self.names, self.sources)},
            "step": self.step,
            "tokens": self.tokens,
            "synced": list(self.synced),
            "credit": list(self.credit),
            "counts": list(self.counts),
        }

    def next(self) -> SampleMeta:
        w = self.schedule.weights_at(self.position())
        credit = self.credit
        for i, x in enumerate(w):
            credit[i] += x
        i = max(range(len(w)), key=lambda j: (w[j] > 0, credit[j]))  # first max wins ties: deterministic
        credit[i] -= sum(w)
        try:
            s = next(self.sources[i])
        except StopIteration:
            if self.counts[i] == 0:
                raise EmptySourceError(f"MixtureStream: source {self.names[i]!r} yielded no sample") from None
            raise
        self.counts[i] += 1
        self.tokens += s.num_tokens
        return s
