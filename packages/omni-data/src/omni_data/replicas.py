"""``ReplicaMerge``: data replicas independent of the DP size.

A run with ``R`` data replicas reads its data as ``R`` independent loaders (replica ``r`` reads share ``r``
of ``R`` of every source's shards and packs ``M`` packs per step), whatever the number of DP ranks ``D``
that train them (``D`` divides ``R``). DP rank ``d`` runs replicas ``d * R / D .. (d + 1) * R / D - 1`` and
one step of it is their ``M`` packs each, concatenated in replica order: ``(R / D) * M`` packs. The global
step (every replica's packs, in replica order) is then the same at every DP size, so a run saved at one
DP size resumes at another exactly (production trainers' data shards decoupled from DP; the one-process
reference of a DP run merges its replicas the same way).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from omni_data.loader import PackedLoader, StepBatch
from omni_data.node import LayoutMismatchError, StatefulNode, common
from omni_data.skips import SkipLedger

__all__ = ["ReplicaMerge", "hand_over_replicas", "replica_ids"]


def replica_ids(replicas: int, dp_rank: int, dp_size: int) -> list[int]:
    """The data replicas DP rank ``dp_rank`` of ``dp_size`` runs: ``replicas / dp_size`` consecutive ids.

    Raises:
        ValueError: ``dp_size`` does not divide ``replicas``, or ``dp_rank`` is not in ``0..dp_size-1``.
    """
    if dp_size < 1 or replicas < 1 or replicas % dp_size:
        raise ValueError(f"replica_ids: {replicas} data replicas do not split over {dp_size} DP ranks")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"replica_ids: DP rank {dp_rank} not in 0..{dp_size - 1}")
    per = replicas // dp_size
    return list(range(dp_rank * per, (dp_rank + 1) * per))


def hand_over_replicas(
    states: Sequence[dict[str, Any]], ids: Sequence[int], *, ledgers: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """The :class:`~omni_data.ZeroRedundancyFilter` state of a DP rank that runs data replicas ``ids``
    over a :class:`ReplicaMerge`, from the filter states of every old DP rank (any DP size dividing the
    replica count; at one pipeline / TP position: their metadata is the same at every position). Each
    replica's loader state is taken whole from the old rank that ran it, and the pre-filtered steps
    (``pending``) are cut back into the replicas' packs (an old rank's step holds its replicas' equal
    shares in replica order) and joined in the order of ``ids``: the state resumes the same global steps.
    ``ledgers``: the payload skip counts this rank takes over (merged into one; default none).

    Raises:
        LayoutMismatchError: a replica of ``ids`` is in no state, the old ranks are at different steps
            or hold different pre-filtered steps; nothing is read.
    """
    held: dict[int, tuple[dict[str, Any], int, int]] = {}  # replica -> (old state, slot, replicas there)
    for st in states:
        if "replicas" not in st["loader"]:
            raise LayoutMismatchError(
                "hand_over_replicas: a state saved without data replicas (a DP rank's own loader): resume "
                "with the run's data.replicas"
            )
        keys = sorted(int(k) for k in st["loader"]["replicas"])
        for j, r in enumerate(keys):
            held[r] = (st, j, len(keys))
    missing = [r for r in ids if r not in held]
    if missing:
        raise LayoutMismatchError(f"hand_over_replicas: no old DP rank ran data replicas {missing}")
    step = common([st["loader"] for st in states], "step", f"hand_over_replicas: replicas {list(ids)}")
    depth = {len(st["pending"]) for st in states}
    if len(depth) != 1:
        raise LayoutMismatchError(
            f"hand_over_replicas: the old ranks hold {sorted(depth)} pre-filtered steps"
        )
    pending = []
    for k in range(depth.pop()):
        at = common([st["pending"][k] for st in states], "step", f"hand_over_replicas: pre-filtered step {k}")
        packs: list[Any] = []
        for r in ids:
            st, j, per = held[r]
            theirs = st["pending"][k]["packs"]
            m = len(theirs) // per
            packs.extend(theirs[j * m : (j + 1) * m])
        pending.append({"step": at, "packs": packs})
    ledger = SkipLedger("ZeroRedundancyFilter", scope="payload")
    for led in ledgers:
        ledger.merge(led)
    return {
        "loader": {"step": step, "replicas": {str(r): held[r][0]["loader"]["replicas"][str(r)] for r in ids}},
        "pending": pending,
        "ledger": ledger.state_dict(),
    }


class ReplicaMerge(StatefulNode[StepBatch]):
    """This DP rank's data replicas' loaders as one step stream (see the module docstring).

    Args:
        loaders: replica id -> its :class:`PackedLoader` (built as replica ``id`` of ``replicas``, without
            a DP group: this node runs the DP collective for all of them).
        replicas: the run's number of data replicas ``R`` (over all DP ranks).
        dp_group: the DP group (``None``: one DP rank). Every step all-reduces, in one call of two int64,
            the count of replicas with a full step and the replicas' drawn mixture tokens: when any replica
            runs out every rank stops at the same step, and a token-unit schedule reads the global token
            count over the ``R`` replicas (:meth:`MixtureStream.sync_tokens`).

    State: ``{"step": next step, "replicas": {str(replica id): PackedLoader state}}``.

    Raises:
        ValueError: no loaders, or an id outside ``0..replicas-1``.
    """

    def __init__(self, loaders: Mapping[int, PackedLoader], replicas: int, *, dp_group: Any = None) -> None:
        super().__init__()
        if not loaders:
            raise ValueError("ReplicaMerge: no replica loaders")
        bad = [r for r in loaders if not 0 <= r < replicas]
        if bad:
            raise ValueError(f"ReplicaMerge: replica ids {bad} not in 0..{replicas - 1}")
        self.loaders = dict(sorted(loaders.items()))
        self.replicas = replicas
        self.dp_group = dp_group
        self.step = 0

    def children(self) -> list[Any]:
        return list(self.loaders.values())

    def _sync(self, global_tokens: int) -> None:
        for loader in self.loaders.values():
            if loader.mixture is not None:
                loader.mixture.sync_tokens(global_tokens, loader.mixture.tokens, self.replicas)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        """Fresh, or from a state holding (at least) this rank's replicas (keys ``str(id)``).

        Raises:
            LayoutMismatchError: a replica of this rank is missing from the state, or the replicas'
                states are at different steps.
        """
        super().reset(initial_state)
        if initial_state is None:
            for loader in self.loaders.values():
                loader.reset(None)
            self._sync(0)
            self.step = 0
            return
        held = initial_state["replicas"]
        missing = [r for r in self.loaders if str(r) not in held]
        if missing:
            raise LayoutMismatchError(f"ReplicaMerge: the state has no data replicas {missing}")
        steps = {int(held[str(r)]["step"]) for r in self.loaders}
        if len(steps) != 1:
            raise LayoutMismatchError(f"ReplicaMerge: the replicas' states are at different steps {steps}")
        for r, loader in self.loaders.items():
            loader.reset(held[str(r)])
        self.step = steps.pop()

    def get_state(self) -> dict[str, Any]:
        return {"step": self.step, "replicas": {str(r): lo.state_dict() for r, lo in self.loaders.items()}}

    def load_resplit(self, states: Any, rank: int, world_size: int, **kw: Any) -> None:
        """Not needed and refused: replicas are handed over whole (:meth:`reset` with their states).

        Raises:
            LayoutMismatchError: always.
        """
        raise LayoutMismatchError(
            f"ReplicaMerge: data replicas are not re-split (rank {rank} of {world_size}): resume with the "
            "same number of data replicas, whose states are handed over whole"
        )

    def next(self) -> StepBatch:
        packs, full = [], 0
        for loader in self.loaders.values():
            try:
                packs.extend(next(loader).packs)
                full += 1
            except StopIteration:
                pass
        tokens = sum(lo.mixture.tokens for lo in self.loaders.values() if lo.mixture is not None)
        if self.dp_group is not None:
            sums = torch.tensor([full, tokens], dtype=torch.int64)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.dp_group)
            full, tokens = int(sums[0]), int(sums[1])
            expected = self.replicas
        else:
            expected = len(self.loaders)
        self._sync(tokens)
        if full != expected:
            raise StopIteration
        batch = StepBatch(self.step, packs)
        self.step += 1
        return batch
