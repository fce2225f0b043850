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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.distributed as dist

from omni_parallel.context_parallel import context_parallel_attention, cp_layout
from omni_parallel.ring_attention import ring_attention
from omni_parallel.varlen import _tokens, varlen_attention

__all__ = [
    "CPAttention",
    "CPSequence",
    "HybridCPPlan",
    "HybridCPSlot",
    "LocalSegment",
    "LocalSequence",
    "cp_sequence_attention",
    "hybrid_cp_blocks",
    "hybrid_cp_load",
    "local_sequence",
    "plan_hybrid_cp",
]


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


# -- a rank's local sequence under a plan, and attention over it ------------------------------------------


class CPAttention(StrEnum):
    """How a CP group computes attention: ``allgather`` (K/V all-gathered,
    :func:`~omni_parallel.context_parallel.context_parallel_attention`) or ``ring`` (K/V passed around
    the ring, :func:`~omni_parallel.ring_attention.ring_attention`)."""

    ALLGATHER = "allgather"
    RING = "ring"


@dataclass(frozen=True)
class LocalSegment:
    """Rows ``[start, start + rows)`` of a rank's local sequence: documents of global (unpadded)
    boundaries ``cu_seqlens``, whole on this rank (``cp == 1``: plain varlen attention) or head-tail
    sharded over the aligned block of dp_cp ranks ``[first, first + cp)`` (``cp > 1``)."""

    start: int
    rows: int
    cu_seqlens: tuple[int, ...]
    first: int
    cp: int


@dataclass(frozen=True)
class LocalSequence:
    """What one dp_cp rank holds of one pack (one microbatch) under hybrid DP/CP slots.

    Attributes:
        source: ``[tokens_local]`` index into the pack of each local token, -1 for CP padding.
        position: ``[tokens_local]`` position of each local token inside its document (RoPE).
        segments: the local rows in order: first the samples whole on this rank (one segment, if any),
            then one segment per CP block holding this rank, ordered by ``(cp, first)``, which every rank
            shares, so the collectives of overlapping blocks run in one global order (no deadlock).
    """

    source: tuple[int, ...]
    position: tuple[int, ...]
    segments: tuple[LocalSegment, ...]

    @property
    def tokens(self) -> int:
        return len(self.source)


def local_sequence(lengths: Sequence[int], slots: Sequence[HybridCPSlot], rank: int) -> LocalSequence:
    """dp_cp rank ``rank``'s share of a pack whose sample ``s.sample`` (of length ``lengths[s.sample]``)
    runs on ranks ``[s.first, s.first + s.cp)``: whole samples keep pack order, a CP block's samples are
    laid out head-tail over the block (:func:`~omni_parallel.context_parallel.cp_layout`). Pure.

    Args:
        lengths: ``[samples]`` tokens per sample of the pack, in pack order.
        slots: one :class:`HybridCPSlot` per sample (``microbatch`` is not read).
        rank: the dp_cp rank.

    Raises:
        ValueError: a sample without exactly one slot, or a slot's block not aligned to its CP size.
    """
    by_sample = {s.sample: s for s in slots}
    if sorted(by_sample) != list(range(len(lengths))) or len(slots) != len(lengths):
        raise ValueError(f"local_sequence: {len(slots)} slots for {len(lengths)} samples (one each)")
    for s in slots:
        if s.cp < 1 or s.first % s.cp or s.first < 0:
            raise ValueError(
                f"local_sequence: sample {s.sample}: block at {s.first} not aligned to cp {s.cp}"
            )
    offset = [0]
    for n in lengths:
        offset.append(offset[-1] + _tokens("lengths", n))
    source: list[int] = []
    position: list[int] = []
    segments: list[LocalSegment] = []
    whole = [i for i in range(len(lengths)) if by_sample[i].cp == 1 and by_sample[i].first == rank]
    if whole:
        cu = [0]
        for i in whole:
            source.extend(range(offset[i], offset[i + 1]))
            position.extend(range(lengths[i]))
            cu.append(cu[-1] + lengths[i])
        segments.append(LocalSegment(0, len(source), tuple(cu), rank, 1))
    blocks = sorted({(s.cp, s.first) for s in slots if s.cp > 1 and s.first <= rank < s.first + s.cp})
    for cp, first in blocks:
        docs = [i for i in range(len(lengths)) if (by_sample[i].cp, by_sample[i].first) == (cp, first)]
        cu = [0]
        for i in docs:
            cu.append(cu[-1] + lengths[i])
        layout = cp_layout(cu, cp)
        doc_of = [d for d, i in enumerate(docs) for _ in range(lengths[i])]
        start = len(source)
        for j in layout.source[rank - first]:
            source.append(-1 if j < 0 else offset[docs[doc_of[j]]] + j - cu[doc_of[j]])
        position.extend(layout.position[rank - first])
        segments.append(LocalSegment(start, len(source) - start, tuple(cu), first, cp))
    return LocalSequence(tuple(source), tuple(position), tuple(segments))


def hybrid_cp_blocks(dp_cp_size: int) -> dict[int, list[list[int]]]:
    """Every aligned block of every CP size a plan over ``dp_cp_size`` ranks may use: ``{cp: [[first, ...,
    first + cp - 1], ...]}`` for each divisor ``cp > 1`` (dp_cp indices), the sub-groups to create once
    at startup. Raises ``ValueError`` if ``dp_cp_size`` < 1."""
    if not isinstance(dp_cp_size, int) or dp_cp_size < 1:
        raise ValueError(f"hybrid_cp_blocks: dp_cp_size must be a positive int, got {dp_cp_size!r}")
    return {
        c: [list(range(f, f + c)) for f in range(0, dp_cp_size, c)]
        for c in range(2, dp_cp_size + 1)
        if dp_cp_size % c == 0
    }


@dataclass(frozen=True)
class CPSequence:
    """A rank's local sequence bound to process groups: what an attention layer needs under CP or hybrid
    DP/CP (passed where a plain varlen layer takes ``cu_seqlens``).

    Attributes:
        segments: :class:`LocalSegment` s covering the local rows in order.
        groups: ``{(cp, first): ProcessGroup}`` for every CP block among the segments.
        method: :class:`CPAttention` of the CP blocks.
    """

    segments: tuple[LocalSegment, ...]
    groups: Mapping[tuple[int, int], dist.ProcessGroup]
    method: CPAttention = CPAttention.ALLGATHER

    @property
    def tokens(self) -> int:
        return self.segments[-1].start + self.segments[-1].rows if self.segments else 0


@torch.compiler.disable
def cp_sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq: CPSequence,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over a rank's local sequence: plain varlen attention on its whole samples, CP attention
    (all-gather or ring, ``seq.method``) over each CP block's group.

    Args:
        q: ``[tokens_local, heads_q, head_dim]``; k, v: ``[tokens_local, heads_kv, head_dim]``.
        seq: the layout and groups; every rank of a block calls with the block's same segment.

    Returns:
        ``[tokens_local, heads_q, head_dim]`` (CP padding rows zero).

    Raises:
        ValueError: ``q`` rows differ from ``seq``'s, or a CP block has no group.

    Runs outside ``torch.compile`` graphs (``torch.compiler.disable``, as
    :func:`omni_parallel.varlen_attention`): the layout's Python ints (each CP share's documents) would
    specialise a compiled block on every pack.
    """
    if q.shape[0] != seq.tokens:
        raise ValueError(f"q has {q.shape[0]} local tokens, the CP sequence {seq.tokens}")
    outs = []
    for s in seq.segments:
        sl = slice(s.start, s.start + s.rows)
        if s.cp == 1:
            outs.append(varlen_attention(q[sl], k[sl], v[sl], s.cu_seqlens, causal=causal, scale=scale))
            continue
        group = seq.groups.get((s.cp, s.first))
        if group is None:
            raise ValueError(f"CP block of {s.cp} ranks at {s.first} has no process group")
        attend = ring_attention if CPAttention(seq.method) is CPAttention.RING else context_parallel_attention
        outs.append(attend(q[sl], k[sl], v[sl], group, cu_seqlens=s.cu_seqlens, causal=causal, scale=scale))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)
