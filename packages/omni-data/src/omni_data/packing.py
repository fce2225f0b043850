"""Hybrid packing: samples of every modality packed into sequences of near-uniform length.

``HybridPacker`` runs best-fit decreasing (BFD) over a streaming buffer (paper §2.1, Figure 3(c)):
each round it refills the buffer to ``buffer_size`` samples, places them largest first into the open pack
with the least free space that still fits (a new pack when none does), then emits the fullest packs and
carries the ``max_open_packs`` least-full ones over to the next round, where smaller samples fill them.
Budgets are expanded token counts (image patches after merge, audio frames after subsampling, text
tokens). A pack never exceeds ``max_seq_len``; a longer sample follows ``overlong``.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import torch
from torchdata.nodes import BaseNode

from omni_data.node import StatefulNode
from omni_data.sample import Modality, SampleMeta

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
    """Streaming best-fit-decreasing packer with carry-over of open packs.

    Args:
        source: upstream node of :class:`SampleMeta` (a source or a mixture).
        max_seq_len: pack capacity, tokens.
        buffer_size: samples gathered before each BFD round (the look-ahead), >= 1.
        overlong: policy for samples longer than ``max_seq_len`` (:class:`Overlong`).
        max_open_packs: least-full packs carried over to the next round (default ``max(1, buffer_size // 16)``).

    Counters in :attr:`stats`: ``samples``, ``packs``, ``tokens``, ``split`` (text samples split),
    ``dropped_overlong`` (media, or any sample with ``overlong="drop"``).

    Raises:
        ValueError: ``max_seq_len`` or ``buffer_size`` < 1, ``max_open_packs`` < 0, an unknown ``overlong``.
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
    ) -> None:
        super().__init__()
        if max_seq_len < 1 or buffer_size < 1:
            raise ValueError(
                f"HybridPacker: max_seq_len ({max_seq_len}) and buffer_size ({buffer_size}) must be >= 1"
            )
        if max_open_packs is not None and max_open_packs < 0:
            raise ValueError(f"HybridPacker: max_open_packs must be >= 0, got {max_open_packs}")
        self.source = source
        self.max_seq_len = max_seq_len
        self.buffer_size = buffer_size
        self.overlong = Overlong(overlong)
        self.max_open_packs = max_open_packs if max_open_packs is not None else max(1, buffer_size // 16)
        self._buffer: list[SampleMeta] = []
        self._open: list[Pack] = []
        self._ready: deque[Pack] = deque()
        self._exhausted = False
        self.stats: dict[str, int] = {}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._ready.clear()
        if initial_state is None:
            self.source.reset(None)
            self._buffer, self._open, self._exhausted = [], [], False
            self.stats = dict.fromkeys(("samples", "packs", "tokens", "split", "dropped_overlong"), 0)
            return
        self.source.reset(initial_state["source"])
        self._buffer = [SampleMeta.from_dict(d) for d in initial_state["buffer"]]
        self._open = [Pack.from_dict(d) for d in initial_state["open"]]
        self._ready.extend(Pack.from_dict(d) for d in initial_state["ready"])
        self._exhausted = bool(initial_state["exhausted"])
        self.stats = dict(initial_state["stats"])

    def get_state(self) -> dict[str, Any]:
        return {
            "source": self.source.state_dict(),
            "buffer": [s.to_dict() for s in self._buffer],
            "open": [p.to_dict() for p in self._open],
            "ready": [p.to_dict() for p in self._ready],
            "exhausted": self._exhausted,
            "stats": dict(self.stats),
        }

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
        if n <= self.max_seq_len:
            self._buffer.append(s)
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
            return
        self.stats["dropped_overlong"] += 1

    def _round(self) -> bool:
        while not self._exhausted and len(self._buffer) < self.buffer_size:
            try:
                s = next(self.source)
            except StopIteration:
                self._exhausted = True
                break
            self.stats["samples"] += 1
            self._admit(s)
        if not self._buffer and not self._open:
            return False
        cap = self.max_seq_len
        packs = self._open
        free = [cap - p.num_tokens for p in packs]
        # sorted (free, pack index): bisect finds the tightest pack that fits in O(log P)
        order = sorted((f, i) for i, f in enumerate(free))
        for s in sorted(self._buffer, key=lambda x: -x.num_tokens):  # stable: ties keep arrival order
            n = s.num_tokens
            j = bisect.bisect_left(order, (n, -1))
            if j < len(order):
                f, i = order.pop(j)
            else:
                packs.append(Pack([], cap))
                f, i = cap, len(packs) - 1
            packs[i].samples.append(s)
            bisect.insort(order, (f - n, i))
        self._buffer = []
        # emit the fullest, carry the least full (unless the stream is over: flush everything)
        keep = 0 if self._exhausted else self.max_open_packs
        by_fill = [i for _, i in order]  # ascending free space = fullest first
        n_emit = max(0, len(packs) - keep)
        emit = set(by_fill[:n_emit]) | {i for f, i in order if f == 0}
        self._ready.extend(packs[i] for i in sorted(emit))
        self._open = [p for i, p in enumerate(packs) if i not in emit]
        return True
