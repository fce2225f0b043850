"""Hybrid DP/CP (ByteScale's idea, § adaptive resharding): only long samples are CP-sharded.

Inside the LLM's ``dp_cp`` group, a sample that fits ``max_tokens_per_rank`` runs whole on one rank
(plain DP); a longer one runs with context parallelism over an aligned block of the smallest CP size
that fits. Samples are placed heaviest first onto the (microbatch, block) whose most-loaded rank is
lightest, under the per-rank token cap.

Pipeline parallelism: the plan is a pure function of the lengths, so every stage computes the same
plan, and every rank gets exactly ``num_microbatches`` microbatches (Megatron's hybrid CP varies the
microbatch count per rank, which is why it refuses PP > 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omni_parallel.varlen import _tokens

__all__ = ["HybridCPPlan", "HybridCPSlot", "hybrid_cp_load", "plan_hybrid_cp"]


def hybrid_cp_load(length: int, cp: int = 1, attention_len: int = 16384) -> float:
    """Modelled per-rank work of one causal sample: ``(L + L**2 / attention_len) / cp``.

    The linear term is the MLP/projection work per token, the quadratic one causal attention;
    ``attention_len`` is the length (tokens) at which both are equal (about ``6 * hidden`` for a dense
    transformer). Units: token-equivalents. Raises ``ValueError`` if ``cp`` or ``attention_len`` < 1.
    """
    if cp < 1 or attention_len <= 0:
        raise ValueError(f"hybrid_cp_load: cp ({cp}) and attention_len ({attention_len}) must be >= 1")
    return (length + length * length / attention_len) / cp


@dataclass(frozen=True)
class HybridCPSlot:
    """Sample ``sample`` runs in microbatch ``microbatch`` on ``dp_cp`` ranks ``[first, first + cp)``
    (indices inside the dp_cp group) with CP size ``cp`` (1 = plain DP)."""

    sample: int
    microbatch: int
    first: int
    cp: int


@dataclass(frozen=True)
class HybridCPPlan:
    """Placement of every sample of one step.

    Attributes:
        dp_cp_size, max_tokens_per_rank, num_microbatches: the inputs.
        slots: ``[samples]`` :class:`HybridCPSlot`, in sample order.
        loads: ``[num_microbatches][dp_cp_size]`` modelled load (see :func:`hybrid_cp_load`).
        tokens: ``[num_microbatches][dp_cp_size]`` tokens per rank, CP padding included.
    """

    dp_cp_size: int
    max_tokens_per_rank: int
    num_microbatches: int
    slots: tuple[HybridCPSlot, ...]
    loads: tuple[tuple[float, ...], ...]
    tokens: tuple[tuple[int, ...], ...]

    def rank_samples(self, rank: int, microbatch: int = 0) -> list[tuple[int, int, int]]:
        """``(sample, cp, cp_rank)`` that dp_cp rank ``rank`` runs in ``microbatch``, in sample order."""
        return [
            (s.sample, s.cp, rank - s.first)
            for s in self.slots
            if s.microbatch == microbatch and s.first <= rank < s.first + s.cp
        ]

    @property
    def imbalance(self) -> float:
        """max / mean modelled load over all (microbatch, rank) slots; 1.0 is perfect."""
        flat = [x for row in self.loads for x in row]
        mean = sum(flat) / len(flat)
        return max(flat) / mean if mean > 0 else 1.0


def _cp_tokens(length: int, cp: int) -> int:
    # Per-rank tokens under head-tail CP: the sample is padded to a multiple of 2 cp.
    return length if cp == 1 else -(-length // (2 * cp)) * 2


def plan_hybrid_cp(
    lengths: Sequence[int],
    dp_cp_size: int,
    max_tokens_per_rank: int,
    *,
    num_microbatches: int = 1,
    attention_len: int = 16384,
    slack: float = 0.03,
) -> HybridCPPlan:
    """Place samples on the dp_cp group: short ones whole, long ones CP-sharded. Pure, deterministic.

    Args:
        lengths: ``[samples]`` tokens per sample.
        dp_cp_size: ranks in the dp_cp group.
        max_tokens_per_rank: token cap per rank and microbatch (activation memory).
        num_microbatches: microbatches per rank (the same on every rank, as PP needs).
        attention_len: cost model parameter of :func:`hybrid_cp_load`.
        slack: a sample gets more than its smallest fitting CP size only if that would push a rank
            above ``(1 + slack)`` times the mean load: CP costs communication, so samples are not split
            just to shave the last percent.

    Returns:
        :class:`HybridCPPlan`. CP sizes are divisors of ``dp_cp_size``; blocks are aligned to them.

    Raises:
        ValueError: bad sizes (not positive ints), ``attention_len`` < 1 or ``slack`` < 0, a negative or
            non-integer length, a sample too long even over all ranks, or samples that do not fit the
            token caps (the message names the sample).
    """
    for name, value in (
        ("dp_cp_size", dp_cp_size),
        ("max_tokens_per_rank", max_tokens_per_rank),
        ("num_microbatches", num_microbatches),
    ):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if dp_cp_size < 1 or max_tokens_per_rank < 1 or num_microbatches < 1:
        raise ValueError(
            f"dp_cp_size ({dp_cp_size}), max_tokens_per_rank ({max_tokens_per_rank}) and "
            f"num_microbatches ({num_microbatches}) must be >= 1"
        )
    if attention_len <= 0 or not slack >= 0:
        raise ValueError(f"attention_len ({attention_len}) must be > 0 and slack ({slack}) >= 0")
    lengths = [_tokens(f"lengths[{i}]", length) for i, length in enumerate(lengths)]
    divisors = [c for c in range(1, dp_cp_size + 1) if dp_cp_size % c == 0]
    cps = []
    for i, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"lengths[{i}] = {length} is negative")
        fit = [c for c in divisors if _cp_tokens(length, c) <= max_tokens_per_rank]
        if not fit:
            raise ValueError(
                f"sample {i} ({length} tokens) does not fit {max_tokens_per_rank} tokens per rank even "
                f"with CP over all {dp_cp_size} ranks"
            )
        cps.append(fit[0])
    loads = [[0.0] * dp_cp_size for _ in range(num_microbatches)]
    tokens = [[0] * dp_cp_size for _ in range(num_microbatches)]
    slots: dict[int, HybridCPSlot] = {}
    order = sorted(range(len(lengths)), key=lambda i: (-hybrid_cp_load(lengths[i], 1, attention_len), i))
    # Mean load per (microbatch, rank): total work does not depend on the CP size (work / cp on cp ranks).
    mean = sum(hybrid_cp_load(n, 1, attention_len) for n in lengths) / (num_microbatches * dp_cp_size)
    limit = mean * (1 + slack)
    for i in order:
        # Smallest CP size that fits, unless it would push a rank above (1 + slack) * mean load; if
        # every size does, the one with the lowest resulting peak.
        best: tuple[float, int, int, int] | None = None
        for cp in (c for c in divisors if c >= cps[i]):
            share, work = _cp_tokens(lengths[i], cp), hybrid_cp_load(lengths[i], cp, attention_len)
            for m in range(num_microbatches):
                for first in range(0, dp_cp_size, cp):
                    block = range(first, first + cp)
                    if any(tokens[m][r] + share > max_tokens_per_rank for r in block):
                        continue
                    key = (max(loads[m][r] for r in block) + work, cp, m, first)
                    if best is None or key < best:
                        best = key
            if best is not None and best[0] <= limit:
                break
        if best is None:
            raise ValueError(
                f"sample {i} ({lengths[i]} tokens) does not fit: every block of every microbatch is over "
                f"{max_tokens_per_rank} tokens per rank; raise num_microbatches"
            )
        _, cp, m, first = best
        share, work = _cp_tokens(lengths[i], cp), hybrid_cp_load(lengths[i], cp, attention_len)
        for r in range(first, first + cp):
            loads[m][r] += work
            tokens[m][r] += share
        slots[i] = HybridCPSlot(i, m, first, cp)
    return HybridCPPlan(
        dp_cp_size=dp_cp_size,
        max_tokens_per_rank=max_tokens_per_rank,
        num_microbatches=num_microbatches,
        slots=tuple(slots[i] for i in range(len(lengths))),
        loads=tuple(tuple(row) for row in loads),
        tokens=tuple(tuple(row) for row in tokens),
    )
