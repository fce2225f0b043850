"""``RoundRobinWorkers``: one rank's reader slots (workers) merged into one deterministic stream."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchdata.nodes import BaseNode

from omni_data.node import LayoutMismatchError, StatefulNode, resplit_child
from omni_data.sample import SampleMeta

__all__ = ["RoundRobinWorkers"]


class RoundRobinWorkers(StatefulNode[SampleMeta]):
    """Takes one sample from each worker's source in turn (worker 0, 1, ..., 0, ...), skipping workers that
    have run out, until all have. The order depends only on the data, so it is exactly resumable.

    The slots run one after another in the calling thread (no processes or threads): they partition the
    data (see ``WebDatasetSource(worker=, num_workers=)``), they do not parallelise the metadata pass.

    Args:
        workers: the rank's sources, one per worker slot (``WebDatasetSource(..., worker=w, num_workers=W)``).

    Raises:
        ValueError: no workers.
    """

    def __init__(self, workers: Sequence[StatefulNode[SampleMeta]]) -> None:
        super().__init__()
        if not workers:
            raise ValueError("RoundRobinWorkers: need at least one worker source")
        self.workers = list(workers)
        self.cursor = 0
        self.done = [False] * len(self.workers)

    def children(self) -> list[BaseNode[Any]]:
        return list(self.workers)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        st = initial_state or {}
        if st and len(st["workers"]) != len(self.workers):
            raise LayoutMismatchError(
                f"RoundRobinWorkers: state saved with {len(st['workers'])} workers, loaded into "
                f"{len(self.workers)}; to change the worker count pass every old rank's state to load_resplit()"
            )
        for i, w in enumerate(self.workers):
            w.reset(st["workers"][i] if st else None)
        self.cursor = int(st.get("cursor", 0))
        self.done = [bool(x) for x in st.get("done", [False] * len(self.workers))]

    def load_resplit(self, states: Sequence[dict[str, Any]], rank: int, world_size: int) -> None:
        """Take this rank's share of the work left by every rank of another layout (another DP size or
        worker count): ``states`` = every old rank's :meth:`state_dict`; each worker source gets every old
        reader's state (:meth:`WebDatasetSource.load_resplit`).

        Raises:
            LayoutMismatchError: a worker source cannot re-split, or the states do not fit; nothing is read.
        """
        flat = [w for st in states for w in st["workers"]]
        for w in self.workers:
            resplit_child(w, flat, rank, world_size)
        super().reset(None)
        self.cursor = 0
        self.done = [False] * len(self.workers)

    def get_state(self) -> dict[str, Any]:
        return {
            "workers": [w.state_dict() for w in self.workers],
            "cursor": self.cursor,
            "done": list(self.done),
        }

    def next(self) -> SampleMeta:
        n = len(self.workers)
        for _ in range(n):
            i = self.cursor
            self.cursor = (self.cursor + 1) % n
            if self.done[i]:
                continue
            try:
                return next(self.workers[i])
            except StopIteration:
                self.done[i] = True
        raise StopIteration
