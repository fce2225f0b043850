"""``StatefulNode``: a ``torchdata.nodes.BaseNode`` with the ``load_state_dict`` spelling too, and the
helpers of ``load_resplit`` (resuming under another DP size or worker count)."""

from __future__ import annotations

from typing import Any, TypeVar

from torchdata.nodes import BaseNode

__all__ = ["LayoutMismatchError", "StatefulNode", "common", "resplit_child"]

T = TypeVar("T", covariant=True)


class LayoutMismatchError(ValueError):
    """A state saved with one reader layout (ranks x workers) was loaded into another, or states that
    cannot be re-split exactly were given to ``load_resplit``; raised before any sample is read."""


def resplit_child(node: Any, states: list[dict[str, Any]], rank: int, world_size: int, **kw: Any) -> None:
    """``node.load_resplit(states, rank, world_size, **kw)``, or a :class:`LayoutMismatchError` naming the
    node when it cannot re-split (e.g. a plain ``torchdata`` node)."""
    fn = getattr(node, "load_resplit", None)
    if fn is None:
        raise LayoutMismatchError(
            f"{type(node).__name__} cannot re-split its state for rank {rank} of {world_size}: "
            "resume with the old layout"
        )
    fn(states, rank, world_size, **kw)


def common(states: list[dict[str, Any]], key: str, what: str) -> int:
    """The one value of ``key`` all ``states`` share, or a :class:`LayoutMismatchError`."""
    values = sorted({int(st[key]) for st in states})
    if len(values) != 1:
        raise LayoutMismatchError(f"{what}: the old ranks' states are at different {key}s {values}")
    return values[0]


class StatefulNode(BaseNode[T]):
    """``state_dict()`` (from ``BaseNode``) and ``load_state_dict(state)`` = ``reset(state)``."""

    def children(self) -> list[BaseNode[Any]]:
        """The nodes this one pulls from (for :func:`omni_data.skips.skip_report` and friends)."""
        return []

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict`` (as returned by :meth:`state_dict`, possibly via msgpack)."""
        self.reset(state_dict)
