"""``PackedLoader``: packs grouped into training steps, with a DP-wide stop and async state snapshots."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from torchdata.nodes import BaseNode

from omni_data.mixture import MixtureStream
from omni_data.node import LayoutMismatchError, StatefulNode, common, resplit_child
from omni_data.packing import HybridPacker, Pack

__all__ = ["LoaderSnapshot", "PackedLoader", "StepBatch", "snapshot_async"]


@dataclass(slots=True)
class StepBatch:
    """One optimizer step's packs for this DP rank: metadata only (phase one of the two-phase flow)."""

    step: int
    packs: list[Pack]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "packs": [p.to_dict() for p in self.packs]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepBatch:
        return cls(int(d["step"]), [Pack.from_dict(p) for p in d["packs"]])


class PackedLoader(StatefulNode[StepBatch]):
    """Groups ``packs_per_step`` packs into a :class:`StepBatch` and advances the mixture's step.

    Mixture fidelity at the trainer's input: a packer with a look-ahead buffer emits a sample several
    steps after the mixture drew it. When ``packer`` is a :class:`HybridPacker` over ``mixture``, the
    loader sets the mixture's :attr:`~MixtureStream.lookahead` to the packer's backlog in steps,
    ``floor((packs taken this step + HybridPacker.pending_packs()) / packs_per_step)``, so a step-unit
    schedule is read at the step the sample will be trained at. (The backlog counts tokens in units of
    full packs, so with packs filled to ``f < 1`` it runs up to ``1/f - 1`` of a step early.)

    Args:
        packer: the pack stream.
        packs_per_step: packs per step on this DP rank (global batch / DP size), >= 1.
        mixture: the :class:`MixtureStream` under ``packer`` whose step to advance (optional).
        dp_group: if given, every step all-reduces, in one call of two int64, a "have a full step" count
            and this rank's drawn mixture tokens over the DP ranks: when any reader runs out all ranks
            stop at the same step (no rank waits in a collective alone; the incomplete steps are counted
            in ``stats["dropped_packs"]``), and a token-unit schedule reads the global token count
            (:meth:`MixtureStream.sync_tokens`).
    """

    def __init__(
        self,
        packer: HybridPacker,
        packs_per_step: int,
        *,
        mixture: MixtureStream | None = None,
        dp_group: Any = None,
    ) -> None:
        super().__init__()
        if packs_per_step < 1:
            raise ValueError(f"PackedLoader: packs_per_step must be >= 1, got {packs_per_step}")
        self.packer = packer
        self.packs_per_step = packs_per_step
        self.mixture = mixture
        self.dp_group = dp_group
        self.step = 0
        self.stats = {"steps": 0, "dropped_packs": 0}
        self._taken = 0  # packs of the step being assembled
        if mixture is not None and isinstance(packer, HybridPacker) and packer.source is mixture:
            mixture.lookahead = self._lookahead

    def children(self) -> list[BaseNode[Any]]:
        return [self.packer]

    def _lookahead(self) -> int:
        return int((self._taken + self.packer.pending_packs()) // self.packs_per_step)

    def _dp_size(self) -> int:
        return 1 if self.dp_group is None else dist.get_world_size(self.dp_group)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.packer.reset(None if initial_state is None else initial_state["packer"])
        if initial_state is None and self.mixture is not None:
            self.mixture.sync_tokens(0, 0, self._dp_size())
        self._taken = 0
        self.step = 0 if initial_state is None else int(initial_state["step"])
        self.stats = (
            {"steps": 0, "dropped_packs": 0} if initial_state is None else dict(initial_state["stats"])
        )

    def get_state(self) -> dict[str, Any]:
        return {"packer": self.packer.state_dict(), "step": self.step, "stats": dict(self.stats)}

    def load_resplit(
        self, states: Sequence[dict[str, Any]], rank: int, world_size: int, *, orphans: Sequence[Any] = ()
    ) -> None:
        """Resume rank ``rank`` of ``world_size`` DP ranks from the states of *every* old DP rank (any old
        DP size): at their common step, with the samples they had drawn but not trained redistributed
        (``orphans`` from above, then the packer's buffers) and the sources re-split
        (:meth:`WebDatasetSource.load_resplit`). Every sample is then trained exactly once per epoch.

        Raises:
            LayoutMismatchError: the old ranks are at different steps, or a node below cannot re-split
                (e.g. a packer that is not a :class:`HybridPacker` while samples are in flight); nothing
                is read.
        """
        states = list(states)
        step = common(
            states, "step", f"PackedLoader: {len(states)} old DP ranks -> rank {rank} of {world_size}"
        )
        if orphans and not isinstance(self.packer, HybridPacker):
            raise LayoutMismatchError(
                f"PackedLoader: {len(orphans)} samples in flight cannot be handed to a "
                f"{type(self.packer).__name__} for rank {rank} of {world_size}"
            )
        kw = {"orphans": orphans} if isinstance(self.packer, HybridPacker) else {}
        resplit_child(self.packer, [st["packer"] for st in states], rank, world_size, **kw)
        super().reset(None)
        self.step, self._taken = step, 0
        self.stats = {"steps": 0, "dropped_packs": 0}
        if rank == 0:
            for st in states:
                self.stats = {k: v + int(st["stats"].get(k, 0)) for k, v in self.stats.items()}

    def next(self) -> StepBatch:
        if self.mixture is not None:
            self.mixture.set_step(self.step)
        packs: list[Pack] = []
        self._taken = 0
        for _ in range(self.packs_per_step):
            try:
                packs.append(next(self.packer))
            except StopIteration:
                break
            self._taken += 1
        self._taken = 0
        full = len(packs) == self.packs_per_step
        if self.dp_group is not None:
            tokens = self.mixture.tokens if self.mixture is not None else 0
            sums = torch.tensor([1 if full else 0, tokens], dtype=torch.int64)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.dp_group)
            dp = self._dp_size()
            full = int(sums[0]) == dp
            if self.mixture is not None:
                self.mixture.sync_tokens(int(sums[1]), tokens, dp)
        if not full:
            self.stats["dropped_packs"] += len(packs)
            raise StopIteration
        batch = StepBatch(self.step, packs)
        self.step += 1
        self.stats["steps"] += 1
        return batch


@dataclass(frozen=True, slots=True)
class LoaderSnapshot:
    """A loader state as an immutable value: what a checkpoint stores for the loader.

    Made ahead of the save by :meth:`omni_data.ZeroRedundancyFilter.snapshot` (the paper's asynchronous
    loader-state snapshot with ahead-of-time preparation, §7.4), so that taking it at save time is a
    reference handoff rather than a walk of the pipeline's buffers.

    Attributes:
        step: the step the state resumes at (the next step the loader hands out).
        blob: ``msgpack.packb(state_dict(), use_bin_type=True)``: byte for byte what the synchronous path
            (:func:`snapshot_async`) gives for the same state.
    """

    step: int
    blob: bytes

    def state(self) -> dict[str, Any]:
        """The state dict back (for ``load_state_dict``).

        Raises:
            msgpack.exceptions.ExtraData, ValueError: ``blob`` is not one msgpack value.
        """
        return msgpack.unpackb(self.blob, strict_map_key=False)


def snapshot_async(node: BaseNode[Any], executor: ThreadPoolExecutor | None = None) -> Future[bytes]:
    """Take ``node.state_dict()`` now (a deep copy of small dicts: microseconds to milliseconds) and
    msgpack-encode it on a background thread, so the training thread does not wait for serialisation
    (paper §7.4: asynchronous loader state snapshots).

    Returns:
        A future of the msgpack bytes; ``msgpack.unpackb(b, strict_map_key=False)`` gives the state back.
    """
    state = copy.deepcopy(node.state_dict())
    ex = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-data-snapshot")
    fut = ex.submit(msgpack.packb, state, use_bin_type=True)
    if executor is None:
        ex.shutdown(wait=False)  # the submitted job still runs; the thread exits after it
    return fut
