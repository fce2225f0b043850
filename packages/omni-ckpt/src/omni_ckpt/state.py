"""Flattening nested state dicts into dotted names (``"model.layers.0.w"``) and back."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, MutableMapping
from typing import Any

from omni_ckpt.sharding import is_tensor_leaf

__all__ = ["flatten_state", "gc_paused", "unflatten_state"]


def flatten_state(
    state: MutableMapping[Any, Any],
) -> Iterator[tuple[str, MutableMapping[Any, Any], Any, Any]]:
    """Yield ``(name, container, key, leaf)`` for every leaf of nested dicts, depth first.

    Keys are joined with ``"."`` (``int`` keys are written in decimal). Tensors, DTensors, FlatShards and
    BoxShards are tensor leaves; anything else that is not a dict (ints, strings, bytes, lists...) is an
    object leaf stored with msgpack.

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: two paths give the same name (``{"a.b": x}`` next to ``{"a": {"b": y}}``), or a key is
            neither ``str`` nor ``int``.
    """
    if not isinstance(state, MutableMapping):
        raise TypeError(
            f"state must be a dict (nested dicts of tensors and values), got {type(state).__name__}"
        )
    seen: set[str] = set()
    stack: list[tuple[str, MutableMapping[Any, Any]]] = [("", state)]
    while stack:
        prefix, d = stack.pop()
        for key in reversed(list(d.keys())):
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise ValueError(f"state key {key!r} under {prefix or '<root>'!r} must be str or int")
            name = f"{prefix}{key}"
            value = d[key]
            if isinstance(value, MutableMapping) and not is_tensor_leaf(value):
                stack.append((name + ".", value))
                continue
            if name in seen:
                raise ValueError(f"state name {name!r} is reached by two different key paths")
            seen.add(name)
            yield name, d, key, value


def unflatten_state(flat: dict[str, Any]) -> dict[str, Any]:
    """Nest ``{"a.b": v}`` back into ``{"a": {"b": v}}`` (keys stay strings)."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        node = out
        *parents, last = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: planning 20,000 small tensors allocates ~10^5 short-lived
    containers, and collections triggered by them cost several times the work itself."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
