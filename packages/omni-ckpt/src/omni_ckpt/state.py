"""Flattening nested state dicts into dotted names (``"model.layers.0.w"``) and back; placeholders."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, MutableMapping
from typing import Any

from omni_ckpt.sharding import is_tensor_leaf

__all__ = ["Placeholder", "PlaceholderRef", "flatten_state", "gc_paused", "unflatten_state"]


class Placeholder(dict):  # type: ignore[type-arg]
    """A subtree that is only a load target, not state yet (an optimizer's moments for a parameter that
    has none).

    :func:`~omni_ckpt.save` skips it. :func:`~omni_ckpt.load` fills it when the checkpoint holds all of its
    entries (it then becomes a plain ``dict`` in its parent) and removes it from its parent when the
    checkpoint holds none of them; holding only some raises, naming the missing ones.
    """


PlaceholderRef = tuple[str, MutableMapping[Any, Any], Any, list[str]]
"""``(name, parent container, key in it, names of its leaves)`` of one placeholder met by flatten_state."""


def flatten_state(
    state: MutableMapping[Any, Any], placeholders: list[PlaceholderRef] | None = None
) -> Iterator[tuple[str, MutableMapping[Any, Any], Any, Any]]:
    """Yield ``(name, container, key, leaf)`` for every leaf of nested dicts, depth first.

    Keys are joined with ``"."`` (``int`` keys are written in decimal). Tensors, DTensors, FlatShards and
    BoxShards are tensor leaves; anything else that is not a dict (ints, strings, bytes, lists...) is an
    object leaf stored with msgpack. :class:`Placeholder` subtrees are skipped when ``placeholders`` is
    None (saving); otherwise their leaves are yielded too and each one is appended to ``placeholders``.

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
    stack: list[tuple[str, MutableMapping[Any, Any], list[str] | None]] = [("", state, None)]
    while stack:
        prefix, d, owner = stack.pop()
        for key in reversed(list(d.keys())):
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise ValueError(f"state key {key!r} under {prefix or '<root>'!r} must be str or int")
            name = f"{prefix}{key}"
            value = d[key]
            if isinstance(value, MutableMapping) and not is_tensor_leaf(value):
                inner = owner
                if isinstance(value, Placeholder):
                    if placeholders is None:
                        continue
                    inner = []
                    placeholders.append((name, d, key, inner))
                stack.append((name + ".", value, inner))
                continue
            if name in seen:
                raise ValueError(f"state name {name!r} is reached by two different key paths")
            seen.add(name)
            if owner is not None:
                owner.append(name)
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
    """Pause the cyclic garbage collector around a save's planning or a load, in the calling thread only.

    Planning or loading 20,000 small tensors allocates ~10^5 containers that survive to the end of the
    call, which triggers full collections of the whole heap costing several times the work itself (0.3 s
    of 0.7 s here). The caller is blocked in our call meanwhile, so nothing of its own runs with the
    collector off; background save threads never call this (they would switch the collector off under
    the training loop). Concurrent callers cannot leave it off: only the one that found it on turns it on.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
