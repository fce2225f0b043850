"""Long-short sequence parallelism for encoders (§ decoupled parallelism, long-short SP).

Samples longer than a threshold are split along the sequence over one encoder SP group (``sp``
contiguous ranks; Ulysses all-to-all inside attention); short samples go whole to single ranks. Long
samples are spread over SP groups with Karmarkar-Karp; short samples then fill ranks greedily, heaviest
first onto the least-loaded rank, so per-rank modelled cost ends up balanced.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from omni_parallel.balance import karmarkar_karp
from omni_parallel.varlen import _tokens

__all__ = ["LongShortPlan", "Piece", "plan_long_short"]


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, end)`` of sample ``sample`` processed on one rank."""

    sample: int
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class LongShortPlan:
    """Where every token of every sample is encoded.

    Attributes:
        sp_size: encoder SP group size; groups are ranks ``[g * sp, (g + 1) * sp)``.
        long_samples: sample indices split over SP groups, ascending.
        long_group: ``{sample: SP group index}`` for long samples.
        long_cu_seqlens: ``[groups]`` ``cu_seqlens`` of each group's packed long sequence (its long
            samples in sample order, then one padding document up to a multiple of ``sp``): the
            ``cu_seqlens`` to pass to ``ulysses_attention``.
        pieces: ``[num_ranks]`` lists of :class:`Piece`: first the rank's contiguous chunk of its group's
            packed long sequence (``chunk = long_cu_seqlens[g][-1] // sp`` tokens with padding; the
            padding is not a piece), then whole short samples.
        loads: ``[num_ranks]`` modelled cost per rank (cost units of the input).
    """

    sp_size: int
    long_samples: tuple[int, ...]
    long_group: dict[int, int]
    long_cu_seqlens: tuple[tuple[int, ...], ...]
    pieces: tuple[tuple[Piece, ...], ...]
    loads: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """max / mean rank load (1.0 = perfect)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean > 0 else 1.0


def plan_long_short(
    lengths: Sequence[int],
    sp_size: int,
    long_threshold: int,
    num_ranks: int,
    *,
    costs: Sequence[float] | None = None,
    splittable: Sequence[bool] | None = None,
) -> LongShortPlan:
    """Plan long-short SP for one step's encoder samples. Pure and deterministic.

    Args:
        lengths: ``[samples]`` tokens per sample (after patch merge / subsampling).
        sp_size: encoder SP group size; must divide ``num_ranks``.
        long_threshold: samples with more tokens than this are split over an SP group.
        num_ranks: encoder ranks (every rank: encoder DP spans pipeline ranks).
        costs: ``[samples]`` modelled cost (e.g. FLOPs), finite and >= 0; default: ``lengths``. A long
            sample's cost is shared by the ranks of its SP group in proportion to their tokens of it.
        splittable: ``[samples]`` whether a sample may be split at all (e.g. only images: an audio
            encoder's convolution stem would need halo exchange); default: every sample. A sample that
            may not be split is short whatever its length.

    Returns:
        :class:`LongShortPlan`. Every token of every sample is in exactly one piece. A rank's load counts
        a long sample's cost in proportion to its tokens there.

    Raises:
        ValueError: ``sp_size`` does not divide ``num_ranks``, ``long_threshold`` is negative, a length
            is negative or not an integer, or ``costs`` has the wrong length or a negative, NaN or
            infinite entry, or ``splittable`` has the wrong length (each message names the sample).
    """
    for name, value in (("sp_size", sp_size), ("num_ranks", num_ranks), ("long_threshold", long_threshold)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if num_ranks < 1 or sp_size < 1 or num_ranks % sp_size:
        raise ValueError(f"sp_size {sp_size} must divide num_ranks {num_ranks} (both >= 1)")
    if long_threshold < 0:
        raise ValueError(f"long_threshold = {long_threshold} is negative")
    lengths = [_tokens(f"lengths[{i}]", length) for i, length in enumerate(lengths)]
    n = len(lengths)
    for i, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"lengths[{i}] = {length} is negative")
    cost = [float(c) for c in (costs if costs is not None else lengths)]
    if len(cost) != n:
        raise ValueError(f"costs has {len(cost)} entries for {n} samples")
    for i, c in enumerate(cost):
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"costs[{i}] = {c!r} (sample {i}): costs must be finite and >= 0")
    split = [True] * n if splittable is None else [bool(x) for x in splittable]
    if len(split) != n:
        raise ValueError(f"splittable has {len(split)} entries for {n} samples")
    groups = num_ranks // sp_size
    is_long = [sp_size > 1 and split[i] and lengths[i] > long_threshold for i in range(n)]
    long_ids = [i for i in range(n) if is_long[i]]
    loads = [0.0] * num_ranks
    pieces: list[list[Piece]] = [[] for _ in range(num_ranks)]
    long_group: dict[int, int] = {}
    parts = karmarkar_karp([cost[i] for i in long_ids], groups)
    for g, part in enumerate(parts):
        for j in part:
            long_group[long_ids[j]] = g
    long_cu: list[tuple[int, ...]] = []
    for g in range(groups):
        # The group's long samples, in sample order, form one packed sequence cut into sp contiguous,
        # equal chunks (the last padded): the uniform sharding Ulysses expects.
        members = sorted(i for i in long_ids if long_group[i] == g)
        cu = [0]
        for i in members:
            cu.append(cu[-1] + lengths[i])
        chunk = -(-cu[-1] // sp_size)
        if chunk * sp_size > cu[-1]:
            cu.append(chunk * sp_size)  # padding, a document of its own
        long_cu.append(tuple(cu))
        for i, a, b in zip(members, cu[:-1], cu[1:]):
            for j in range(a // chunk, -(-b // chunk)) if b > a else ():
                lo, hi = max(a, j * chunk), min(b, (j + 1) * chunk)
                pieces[g * sp_size + j].append(Piece(i, lo - a, hi - a))
                loads[g * sp_size + j] += cost[i] * (hi - lo) / lengths[i]
    heap = [(loads[r], r) for r in range(num_ranks)]
    heapq.heapify(heap)
    for i in sorted((i for i in range(n) if not is_long[i]), key=lambda i: (-cost[i], i)):
        load, r = heapq.heappop(heap)
        pieces[r].append(Piece(i, 0, lengths[i]))
        loads[r] = load + cost[i]
        heapq.heappush(heap, (loads[r], r))
    return LongShortPlan(
        sp_size=sp_size,
        long_samples=tuple(long_ids),
        long_group=long_group,
        long_cu_seqlens=tuple(long_cu),
        pieces=tuple(tuple(p) for p in pieces),
        loads=tuple(loads),
    )
