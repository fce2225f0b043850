"""``StatefulNode``: a ``torchdata.nodes.BaseNode`` with the ``load_state_dict`` spelling too."""

from __future__ import annotations

from typing import Any, TypeVar

from torchdata.nodes import BaseNode

__all__ = ["StatefulNode"]

T = TypeVar("T", covariant=True)


class StatefulNode(BaseNode[T]):
    """``state_dict()`` (from ``BaseNode``) and ``load_state_dict(state)`` = ``reset(state)``."""

    def children(self) -> list[BaseNode[Any]]:
        """The nodes this one pulls from (for :func:`omni_data.skips.skip_report` and friends)."""
        return []

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict`` (as returned by :meth:`state_dict`, possibly via msgpack)."""
        self.reset(state_dict)
