"""``StateDictAdapter``: our parameter names <-> a Hugging Face architecture's, one per model family.

torchtitan's interface (``torchtitan/protocols/state_dict_adapter.py``): ``to_hf`` and ``from_hf`` map a
whole state dict of one module (names relative to that module, full unsharded tensors) to the other
side's names, reshaping where layouts differ; ``hf_config`` writes the ``config.json`` describing our
config. Sharded layouts (pipeline stages, TP shards) never reach an adapter: import writes one full
omni-ckpt checkpoint that every layout loads by box intersection, and export reads a checkpoint of any
layout back whole (:mod:`omni_train.hf.convert`).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from omni_train.hf.folder import HFFolderError

__all__ = ["StateDictAdapter", "hf_field", "rename", "take"]

_LAYER = re.compile(r"\.(\d+)\.")


class StateDictAdapter(ABC):
    """Converts one model family between our module's names and a Hugging Face architecture's.

    Class attributes:
        model_type: ``config.json``'s ``model_type`` written on export (and accepted on import, with
            ``accepted_model_types``).
        prefixes: where the family's tensors may sit in a Hugging Face checkpoint (``""`` for the bare
            model, ``"model.visual."`` inside a full Qwen2-VL checkpoint, ...): import takes the first
            prefix under which ``anchor`` exists and leaves every other tensor alone (and counts it).
        anchor: a tensor name (after the prefix) every checkpoint of the family holds.
    """

    model_type: ClassVar[str]
    accepted_model_types: ClassVar[tuple[str, ...]]
    prefixes: ClassVar[tuple[str, ...]]
    anchor: ClassVar[str]

    @abstractmethod
    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our module's state dict -> the Hugging Face model's (no prefix)."""

    @abstractmethod
    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The Hugging Face model's state dict (prefix stripped) -> our module's (every name of
        :meth:`our_names`); tensors it does not need are left alone.

        Raises:
            HFFolderError: a tensor our module needs is missing (named).
        """

    @abstractmethod
    def our_names(self) -> list[str]:
        """Every state-dict name of our module for this adapter's config."""

    @abstractmethod
    def hf_config(self) -> dict[str, Any]:
        """``config.json`` of the Hugging Face model equal to our module."""


def rename(name: str, table: Mapping[str, str]) -> str | None:
    """``name`` through ``table``: an exact entry first, else the entry with its first ``.N.`` index
    replaced by ``{}`` (torchtitan's convention), the index carried over; None if neither exists."""
    if name in table:
        return table[name]
    m = _LAYER.search(name)
    if m is None:
        return None
    target = table.get(name[: m.start()] + ".{}." + name[m.end() :])
    return None if target is None else target.format(m.group(1))


_MISSING = object()


def hf_field(config: Mapping[str, Any], key: str, kind: type, where: str, default: Any = _MISSING) -> Any:
    """``config[key]`` checked to be ``kind`` (an int is accepted for a float).

    Raises:
        HFFolderError: missing without a default, or of the wrong type (``where`` and ``key`` named).
    """
    value = config.get(key, default)
    if value is _MISSING:
        raise HFFolderError(f"{where}: config.json has no {key!r}")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise HFFolderError(f"{where}: config.json {key!r} must be {kind.__name__}, got {value!r}")
    return value


def take(hf: Mapping[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    """``hf[name]``. Raises: HFFolderError naming the missing tensor."""
    if name not in hf:
        raise HFFolderError(f"{where}: the checkpoint has no tensor {name!r}")
    return hf[name]
