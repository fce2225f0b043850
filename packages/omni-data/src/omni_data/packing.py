"""Hybrid packing: samples of every modality packed into sequences of near-uniform length.

``HybridPacker`` runs best-fit decreasing (BFD) over a streaming buffer (paper §2.1, Figure 3(c)):
each round it refills the buffer to ``buffer_size`` samples, places them largest first into the open pack
with the least free space that still fits (a new pack when none does), then emits the fullest packs and
carries the ``max_open_packs`` least-full ones over to the next round, where smaller samples fill them.
Budgets are expanded token counts (image patches after merge, audio frames after subsampling, text
tokens). A pack never exceeds ``max_seq_len``; a longer sample follows ``overlong``.

Two refinements keep the per-source mix of what is trained close to the mix that was drawn (omni-data
README, "Mixture fidelity"). Plain BFD fills packs one after another with the largest samples, so the
round's many small samples overflow into packs of their own: at buffer 1024 a round has one or two packs
of 70-170 small audio and text samples and no image, and wherever such a pack falls the trained share of
images dips by ~0.7 of its sample count. So the largest samples, holding ``spread`` of the round's tokens,
go to the tightest carried pack that fits or else are spread worst-fit over the new packs the round needs
(``ceil(tokens not fitting the carried packs / max_seq_len)``); the small rest fill the gaps best-fit, and
every pack gets its share of them. With few samples per pack the small rest may not fill the gaps the
spreading leaves, so a round keeps the spread placement only where its emitted packs waste at most
``spread_fill_cost`` (0.1%) of the round's tokens more than plain BFD's. And a round's packs are emitted in the order that keeps, after every
pack, each source's count of emitted samples closest to its count among as many earliest-drawn samples
(greedy, in squares; ties in the order the samples were drawn on average).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from omni_data.mixture import MixtureStream
from omni_data.node import StatefulNode, resplit_child
from omni_data.sample import Modality, SampleMeta
from omni_data.skips import SkipLedger

__all__ = ["HybridPacker", "ModalitySpan", "Overlong", "OverlongSampleError", "Pack", "collate_packs"]


class Overlong(StrEnum):
    """What to do with a sample longer than ``max_seq_len``: text can split; media cannot and is dropped."""

    SPLIT = "split"
    DROP = "drop"
    ERROR = "error"


class OverlongSampleError(ValueError):
    """A sample is longer than ``max_seq_len`` and ``overlong="error"``; the message names it."""


@dataclass(frozen=True, slots=True)
class ModalitySpan:
    """Where one sample's encoder embeddings go in a pack: tokens ``[start, start + length)``."""

    sample: int
    modality: Modality
    start: int
    length: int


@dataclass(slots=True)
class Pack:
    """One LLM sequence holding several samples (in placement order).

    Token layout of sample ``i``: ``samples[i].media_tokens`` embedding slots, then its text tokens.
    """

    samples: list[SampleMeta] = field(default_factory=list)
    max_seq_len: int = 0

    @property
    def num_tokens(self) -> int:
        """Used tokens (<= ``max_seq_len``)."""
        return sum(s.num_tokens for s in self.samples)

    @property
    def keys(self) -> list[str]:
        """``source/key[@start]`` of every sample, in pack order."""
        return [s.uid for s in self.samples]

    @property
    def seqlens(self) -> list[int]:
        return [s.num_tokens for s in self.samples]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``[num_samples + 1]`` int32 sample boundaries in tokens (flash-attn varlen convention)."""
        out = torch.zeros(len(self.samples) + 1, dtype=torch.int32)
        out[1:] = torch.cumsum(torch.tensor(self.seqlens, dtype=torch.int32), 0)
        return out

    @property
    def position_ids(self) -> torch.Tensor:
        """``[num_tokens]`` int64 positions, restarting at 0 at every sample."""
        if not self.samples:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.arange(n, dtype=torch.int64) for n in self.seqlens])

    @property
    def spans(self) -> list[ModalitySpan]:
        """Media embedding spans (images and audio), in pack order."""
        out, start = [], 0
        for i, s in enumerate(self.samples):
            if s.media_tokens:
                out.append(ModalitySpan(i, s.modality, start, s.media_tokens))
            start += s.num_tokens
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"max_seq_len": self.max_seq_len, "samples": [s.to_dict() for s in self.samples]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Pack:
        return cls([SampleMeta.from_dict(x) for x in d["samples"]], int(d["max_seq_len"]))


def collate_packs(packs: list[Pack], *, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Flatten a batch of packs into one varlen sequence.

    Args:
        packs: ``B`` packs.
        pad_to: if given, every pack occupies exactly ``pad_to`` tokens; its padding is one extra segment.

    Returns:
        ``cu_seqlens``: ``[S + 1]`` int32 boundaries over the ``T`` flattened tokens (``S`` segments);
        ``position_ids``: ``[T]`` int64; ``pack_offsets``: ``[B + 1]`` int64 start token of each pack.

    Raises:
        ValueError: a pack is longer than ``pad_to``.
    """
    lens: list[int] = []
    offsets = [0]
    for p in packs:
        lens.extend(p.seqlens)
        n = p.num_tokens
        if pad_to is not None:
            if n > pad_to:
                raise ValueError(f"pack of {n} tokens exceeds pad_to={pad_to}")
            if n < pad_to:
                lens.append(pad_to - n)
                n = pad_to
        offsets.append(offsets[-1] + n)
    t = torch.tensor(lens, dtype=torch.int64)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(t, 0)
    pos = torch.arange(int(t.sum()), dtype=torch.int64) - torch.repeat_interleave(cu[:-1].long(), t)
    return {"cu_seqlens": cu, "position_ids": pos, "pack_offsets": torch.tensor(offsets, dtype=torch.int64)}


class HybridPacker(StatefulNode[Pack]):
    """Streaming best-fit-decreasing packer with carry-over of open packs and a pack-age bound.

    Each round refills the buffer to ``buffer_size`` samples, places them largest first into the open pack
    with the least free space that still fits, emits the fullest packs and carries at most
    ``max_open_packs`` of the least full ones to the next round. A pack is carried at most
    ``max_pack_age`` rounds: so a sample is emitted at the latest ``max_pack_age`` rounds after the round
    that placed it, i.e. before ``(max_pack_age + 1) * buffer_size`` further samples are drawn (one buffer
    to be placed, ``max_pack_age`` of carry). Without the bound a least-full pack can stay open for
    tens of rounds and the loader trains on samples drawn under a mixture phase long gone (fill cost of
    the bound: ``benchmarks/packing.py``).

    Placement and emission order keep the trained per-source mix close to the drawn one (module
    docstring): the largest samples, holding ``spread`` of a round's tokens, are spread over the round's
    new packs where that wastes at most ``spread_fill_cost`` of the round's tokens more in the emitted
    packs than plain BFD (``spread=0`` is plain BFD), and packs are emitted in the order that best tracks, per source,
    the draw order (state: the sources of the samples drawn but not yet emitted, and each source's
    emitted-minus-drawn count).

    Under a :class:`~omni_data.mixture.MixtureStream` the packer also closes a round early when the
    mixture's phase changes (:meth:`MixtureStream.phase`), and flushes every open pack: samples drawn
    under one phase are all emitted before any of the next, so a 1 -> 0 weight switch stops the old
    source at the switch (up to the mixture's look-ahead estimate, see :class:`PackedLoader`).

    Args:
        source: upstream node of :class:`SampleMeta` (a source or a mixture).
        max_seq_len: pack capacity, tokens.
        buffer_size: samples gathered before each BFD round (the look-ahead), >= 1.
        overlong: policy for samples longer than ``max_seq_len`` (:class:`Overlong`).
        max_open_packs: least-full packs carried over to the next round (default ``max(1, buffer_size // 16)``).
        max_pack_age: rounds a pack may be carried over before it is emitted however full (>= 0;
            0 = no carry-over).
        max_skipped_keys: keys of dropped over-long samples kept by name (counts are always complete).
        spread: share of each round's tokens, largest samples first, placed worst-fit over the round's
            new packs (after the tightest carried pack that fits) rather than best-fit, in ``[0, 1]``.
        spread_fill_cost: a round keeps the spread placement where the packs it emits waste at most this
            share of the round's tokens more than plain BFD's (>= 0), so spreading costs at most that
            much fill (``benchmarks/packing.py``).

    Counters in :attr:`stats`: ``samples``, ``packs``, ``tokens``, ``split`` (text samples split),
    ``dropped_overlong`` (media, or any sample with ``overlong="drop"``), ``phase_flushes``, ``spread_rounds``
    (rounds placed with ``spread``); dropped
    samples are also in :attr:`ledger` (:class:`~omni_data.skips.SkipLedger`: per source, with keys).

    Raises:
        ValueError: ``max_seq_len`` or ``buffer_size`` < 1, ``max_open_packs`` or ``max_pack_age`` < 0,
            ``spread`` outside ``[0, 1]``, ``spread_fill_cost`` < 0, an unknown ``overlong``.
        OverlongSampleError: (from ``next``) with ``overlong="error"``, naming the sample.
    """

    def __init__(
        self,
        source: BaseNode[SampleMeta],
        max_seq_len: int,
        buffer_size: int = 1024,
        *,
        overlong: Overlong | str = Overlong.SPLIT,
        max_open_packs: int | None = None,
        max_pack_age: int = 1,
        max_skipped_keys: int = 1000,
        spread: float = 0.95,
        spread_fill_cost: float = 0.001,
    ) -> None:
        super().__init__()
        if max_seq_len < 1 or buffer_size < 1:
            raise ValueError(
                f"HybridPacker: max_seq_len ({max_seq_len}) and buffer_size ({buffer_size}) must be >= 1"
            )
        if max_open_packs is not None and max_open_packs < 0:
            raise ValueError(f"HybridPacker: max_open_packs must be >= 0, got {max_open_packs}")
        if max_pack_age < 0:
            raise ValueError(f"HybridPacker: max_pack_age must be >= 0 rounds, got {max_pack_age}")
        if not 0.0 <= spread <= 1.0:
            raise ValueError(f"HybridPacker: spread must be in [0, 1], got {spread}")
        if not spread_fill_cost >= 0.0:
            raise ValueError(f"HybridPacker: spread_fill_cost must be >= 0, got {spread_fill_cost}")
        self.source = source
        self.max_seq_len = max_seq_len
        self.buffer_size = buffer_size
        self.overlong = Overlong(overlong)
        self.max_open_packs = max_open_packs if max_open_packs is not None else max(1, buffer_size // 16)
        self.max_pack_age = max_pack_age
        self.spread = spread
        self.spread_fill_cost = spread_fill_cost
        self.ledger = SkipLedger("packer", max_keys=max_skipped_keys)
        self._buffer: list[SampleMeta] = []
        self._open: list[Pack] = []
        self._age: list[int] = []
        self._arrival: list[int] = []  # draw index of each buffered sample
        self._drawn: list[list[int]] = []  # [sum of draw indices, samples] of each open pack
        self._pending: deque[str] = deque()  # sources of the samples drawn but not yet emitted, in draw order
        self._offset: dict[str, int] = {}  # per source: samples emitted - samples among as many first drawn
        self._ready: deque[Pack] = deque()
        self._exhausted = False
        self._phase: int | None = None
        self._buffer_tokens = 0
        self._open_free = 0  # free tokens in the open packs
        self.stats: dict[str, int] = {}

    def children(self) -> list[BaseNode[Any]]:
        return [self.source]

    def _mixture(self) -> MixtureStream | None:
        return self.source if isinstance(self.source, MixtureStream) else None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._ready.clear()
        if initial_state is None:
            self.source.reset(None)
            self._buffer, self._open, self._age, self._exhausted, self._phase = [], [], [], False, None
            self._arrival, self._drawn = [], []
            self._pending, self._offset = deque(), {}
            self.stats = dict.fromkeys(_STATS, 0)
            self.ledger.load_state_dict(None)
        else:
            self.source.reset(initial_state["source"])
            self._buffer = [SampleMeta.from_dict(d) for d in initial_state["buffer"]]
            self._open = [Pack.from_dict(d) for d in initial_state["open"]]
            self._age = [int(a) for a in initial_state["open_age"]]
            self._arrival = [int(a) for a in initial_state["arrival"]]
            self._drawn = [[int(a), int(b)] for a, b in initial_state["drawn"]]
            names = list(initial_state.get("pending_sources", []))
            self._pending = deque(names[int(j)] for j in initial_state.get("pending", []))
            self._offset = {str(k): int(v) for k, v in initial_state.get("offset", {}).items()}
            self._ready.extend(Pack.from_dict(d) for d in initial_state["ready"])
            self._exhausted = bool(initial_state["exhausted"])
            self._phase = initial_state.get("phase")
            self.stats = {**dict.fromkeys(_STATS, 0), **initial_state["stats"]}
            self.ledger.load_state_dict(initial_state.get("skipped"))
        self._buffer_tokens = sum(s.num_tokens for s in self._buffer)
        self._open_free = sum(self.max_seq_len - p.num_tokens for p in self._open)

    def get_state(self) -> dict[str, Any]:
        return {
            "source": self.source.state_dict(),
            "buffer": [s.to_dict() for s in self._buffer],
            "open": [p.to_dict() for p in self._open],
            "open_age": list(self._age),
            "arrival": list(self._arrival),
            "drawn": [list(x) for x in self._drawn],
            **_pending_state(self._pending),
            "offset": dict(self._offset),
            "ready": [p.to_dict() for p in self._ready],
            "exhausted": self._exhausted,
            "phase": self._phase,
            "stats": dict(self.stats),
            "skipped": self.ledger.state_dict(),
        }

    def load_resplit(
        self,
        states: Sequence[dict[str, Any]],
        rank: int,
        world_size: int,
        *,
        orphans: Sequence[SampleMeta] = (),
    ) -> None:
        """Resume under another DP size: the samples every old rank had drawn but not emitted (``orphans``
        handed down from above, then each old rank's ready packs, open packs and buffer, in rank order)
        are dealt round-robin over the new ranks into their buffers, and the source re-splits.

        Raises:
            LayoutMismatchError: the source cannot re-split (see its ``load_resplit``).
        """
        states = list(states)
        pool = list(orphans)
        for st in states:
            for key in ("ready", "open"):
                pool += [SampleMeta.from_dict(d) for p in st[key] for d in p["samples"]]
            pool += [SampleMeta.from_dict(d) for d in st["buffer"]]
        resplit_child(self.source, [st["source"] for st in states], rank, world_size)
        super().reset(None)
        self._ready.clear()
        self._buffer = pool[rank::world_size]
        self._arrival = [0] * len(self._buffer)
        self._open, self._age, self._drawn, self._exhausted, self._phase = [], [], [], False, None
        # the dealt samples count as drawn now, in dealt order
        self._pending, self._offset = deque(s.source for s in self._buffer), {}
        self.stats = dict.fromkeys(_STATS, 0)
        self.ledger.load_state_dict(None)
        if rank == 0:
            for st in states:
                self.stats = {k: v + int(st["stats"].get(k, 0)) for k, v in self.stats.items()}
                self.ledger.merge(st["skipped"])
        self._buffer_tokens = sum(s.num_tokens for s in self._buffer)
        self._open_free = 0

    def pending_packs(self) -> float:
        """Packs that drawn samples not yet emitted will fill, so about where the next drawn sample lands:
        the ready and open packs, plus the buffered tokens that do not fit the open packs' free space in
        units of full packs (a lower bound on the packs they need)."""
        spill = max(0, self._buffer_tokens - self._open_free)
        return len(self._ready) + len(self._open) + spill / self.max_seq_len

    def next(self) -> Pack:
        while not self._ready:
            if not self._round():
                raise StopIteration
        pack = self._ready.popleft()
        self.stats["packs"] += 1
        self.stats["tokens"] += pack.num_tokens
        return pack

    def _admit(self, s: SampleMeta) -> None:
        n = s.num_tokens
        seq = self.stats["samples"]
        if n <= self.max_seq_len:
            self._buffer.append(s)
            self._arrival.append(seq)
            self._pending.append(s.source)
            self._buffer_tokens += n
            return
        if self.overlong is Overlong.ERROR:
            raise OverlongSampleError(
                f"sample {s.uid} ({s.modality}) has {n} tokens > max_seq_len={self.max_seq_len}"
            )
        if self.overlong is Overlong.SPLIT and s.modality is Modality.TEXT:
            base = s.text_range[0] if s.text_range is not None else 0
            self.stats["split"] += 1
            for a in range(0, s.text_tokens, self.max_seq_len):
                b = min(a + self.max_seq_len, s.text_tokens)
                self._buffer.append(
                    replace(s, text_tokens=b - a, shape=(b - a,), text_range=(base + a, base + b))
                )
                self._arrival.append(seq)
                self._pending.append(s.source)
            self._buffer_tokens += n
            return
        self.stats["dropped_overlong"] += 1
        self.ledger.add(s.source, s.uid, f"over-long {s.modality} ({n} > {self.max_seq_len} tokens)")

    def _round(self) -> bool:
        mix = self._mixture()
        flush = False
        while not self._exhausted and len(self._buffer) < self.buffer_size:
            if mix is not None:
                phase = mix.phase()
                if self._phase is not None and phase != self._phase and (self._buffer or self._open):
                    flush = True  # the next draw is under another phase: emit everything drawn so far
                    self.stats["phase_flushes"] += 1
                    break
                self._phase = phase
            try:
                s = next(self.source)
            except StopIteration:
                self._exhausted = True
                break
            self._admit(s)
            self.stats["samples"] += 1
        if not self._buffer and not self._open:
            return False
        keep = 0 if self._exhausted or flush else self.max_open_packs
        packs, age, drawn, order = self._place(0.0)
        emit = self._emit_set(order, age, keep)
        if self.spread > 0:
            # spreading can leave gaps the small rest does not fill (few samples per pack): keep it
            # only where the packs it emits waste at most spread_fill_cost of the round's tokens more
            # than plain BFD's
            alt = self._place(self.spread)
            alt_emit = self._emit_set(alt[3], alt[1], keep)
            budget = self.spread_fill_cost * self._buffer_tokens
            if _waste(alt[3], alt_emit) <= _waste(order, emit) + budget:
                (packs, age, drawn, order), emit = alt, alt_emit
                self.stats["spread_rounds"] += 1
        self._buffer, self._arrival, self._buffer_tokens = [], [], 0
        # emitted in the order that tracks the draw order per source (ties: the order their samples
        # were drawn on average; BFD creates packs largest sample first, so creation order would emit a
        # round's image-heavy packs before its audio and text)
        by_drawn = sorted(emit, key=lambda i: (drawn[i][0] / drawn[i][1], i))
        self._ready.extend(packs[i] for i in self._draw_order(packs, by_drawn))
        self._open = [p for i, p in enumerate(packs) if i not in emit]
        self._age = [a + 1 for i, a in enumerate(age) if i not in emit]
        self._drawn = [d for i, d in enumerate(drawn) if i not in emit]
        self._open_free = sum(self.max_seq_len - p.num_tokens for p in self._open)
        return True

    def _place(self, spread: float) -> tuple[list[Pack], list[int], list[list[int]], list[tuple[int, int]]]:
        """The buffer placed largest first into copies of the open packs and new ones; the largest
        samples holding ``spread`` of its tokens go to the tightest carried pack that fits, else the
        emptiest pack (a new one while fewer than the round needs are open), so every pack keeps room for
        small ones; the rest best-fit. Returns packs, their ages, ``[sum of draw indices, samples]``, and
        sorted ``(free tokens, pack index)``."""
        cap = self.max_seq_len
        packs = [Pack(list(p.samples), cap) for p in self._open]
        age, drawn = list(self._age), [list(d) for d in self._drawn]
        # sorted (free, pack index) of every pack and of the carried ones: bisect finds the tightest
        # pack that fits in O(log P)
        order = sorted((cap - p.num_tokens, i) for i, p in enumerate(packs))
        carried, n_carried = list(order), len(packs)
        new_packs = math.ceil(max(0, self._buffer_tokens - self._open_free) / cap)  # the round needs
        spread_tokens, placed = spread * self._buffer_tokens, 0
        by_size = sorted(range(len(self._buffer)), key=lambda k: -self._buffer[k].num_tokens)  # stable
        for k in by_size:
            s, n = self._buffer[k], self._buffer[k].num_tokens
            placed += n
            wide = spread > 0 and placed <= spread_tokens
            j = bisect.bisect_left(order, (n, -1))  # best fit
            if wide:
                c = bisect.bisect_left(carried, (n, -1))
                if c < len(carried):
                    j = bisect.bisect_left(order, carried.pop(c))
                elif new_packs > 0:
                    j = len(order)
                elif order and order[-1][0] >= n:
                    j = len(order) - 1
            if j < len(order):
                f, i = order.pop(j)
            else:
                packs.append(Pack([], cap))
                age.append(0)
                drawn.append([0, 0])
                new_packs -= 1
                f, i = cap, len(packs) - 1
            packs[i].samples.append(s)
            drawn[i][0] += self._arrival[k]
            drawn[i][1] += 1
            bisect.insort(order, (f - n, i))
            if wide and i < n_carried:
                bisect.insort(carried, (f - n, i))
        return packs, age, drawn, order

    def _emit_set(self, order: list[tuple[int, int]], age: list[int], keep: int) -> set[int]:
        """Packs to emit: all but the ``keep`` least full, every full one, and every one carried
        ``max_pack_age`` rounds."""
        by_fill = [i for _, i in order]  # ascending free space = fullest first
        emit = set(by_fill[: max(0, len(order) - keep)]) | {i for f, i in order if f == 0}
        return emit | {i for i, a in enumerate(age) if a >= self.max_pack_age}

    def _draw_order(self, packs: list[Pack], idx: list[int]) -> list[int]:
        """``idx`` (packs to emit, in tie-break order) reordered greedily: each next pack is the one
        after which every source's emitted count is closest (sum of squares) to its count among as many
        earliest-drawn samples not yet emitted (:attr:`_pending`), counting the lead or lag
        (:attr:`_offset`) carried from earlier rounds. O(len(idx)^2 * sources)."""
        counts = [Counter(s.source for s in packs[i].samples) for i in idx]
        emitted = sum(sum(c.values()) for c in counts)
        drawn = list(itertools.islice(self._pending, emitted))
        names = sorted({n for c in counts for n in c} | set(self._offset) | set(drawn))
        col = {n: j for j, n in enumerate(names)}
        vecs = np.array([[c.get(n, 0) for n in names] for c in counts], dtype=np.int64).reshape(
            len(idx), len(names)
        )
        sizes = vecs.sum(1)
        # prefix[m, j]: samples of source j among the first m pending draws
        prefix = np.zeros((len(drawn) + 1, len(names)), dtype=np.int64)
        if drawn:
            np.add.at(prefix, (np.arange(1, len(drawn) + 1), [col[n] for n in drawn]), 1)
            prefix = np.cumsum(prefix, 0)
        dev = np.array([self._offset.get(n, 0) for n in names], dtype=np.int64)  # emitted - drawn so far
        left, out, m = np.arange(len(idx)), [], 0
        while len(left):
            pick = 0
            if len(names) > 1:  # one source: every order scores alike
                t = prefix[np.minimum(m + sizes[left], len(drawn))]
                pick = int(np.argmin(((dev + vecs[left] - t) ** 2).sum(1)))  # first minimum wins ties
            a = int(left[pick])
            left = np.delete(left, pick)
            out.append(idx[a])
            dev += vecs[a]
            m += int(sizes[a])
        t = prefix[min(m, len(drawn))]
        self._offset = {n: int(d - y) for n, d, y in zip(names, dev, t) if d != y}
        for _ in range(min(emitted, len(self._pending))):
            self._pending.popleft()
        return out


def _pending_state(pending: deque[str]) -> dict[str, list[Any]]:
    """``pending`` as a table of source names and indices into it (compact in msgpack)."""
    names = sorted(set(pending))
    col = {n: j for j, n in enumerate(names)}
    return {"pending_sources": names, "pending": [col[n] for n in pending]}


def _waste(order: list[tuple[int, int]], emit: set[int]) -> int:
    """Free tokens in the packs ``emit`` (of ``order``'s ``(free, pack index)``)."""
    return sum(f for f, i in order if i in emit)


_STATS = ("samples", "packs", "tokens", "split", "dropped_overlong", "phase_flushes", "spread_rounds")
