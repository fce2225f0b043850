"""Pipeline actions in PyTorch's pipelining notation, plus encoder actions.

An LLM action is written exactly as ``torch.distributed.pipelining.schedules._Action`` prints it:
``"<stage><kind><microbatch>"``, e.g. ``"0F1"`` (stage 0 forward of microbatch index 1), ``"1B0"`` (stage 1
full backward of microbatch index 0), ``"2SEND_F3"``. Encoder actions are ``"EF<e>"`` / ``"EB<e>"``: forward /
backward of encoder microbatch ``e`` (no stage: they run on whichever pipeline rank holds them).

Microbatch numbering (the one place it is defined):
    * ``Action.microbatch`` of an LLM action is torch's 0-based index ``i`` (so ``to_torch`` is the identity
      and torch's checkers read our schedules unchanged);
    * the data flow (``DataFlow``, DESIGN.md §Glossary) numbers LLM microbatches from 1: ``k = i + 1``, because
      0 there means the schedule's start/end and the sign means forward (+) / backward (-);
    * encoder microbatches are numbered from 1 everywhere (``e >= 1``), for the same reason.
    :func:`flow_index` and :func:`torch_index` convert between the two LLM numberings.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import NamedTuple

__all__ = ["Action", "ActionKind", "ScheduleError", "flow_index", "torch_index"]


class ScheduleError(ValueError):
    """A schedule, or a schedule with communication, breaks a rule; the message names the action."""


class ActionKind(StrEnum):
    """Kinds of pipeline actions; LLM kinds keep torch's ``_ComputationType`` spelling."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ENCODER_FORWARD = "EF"
    ENCODER_BACKWARD = "EB"

    @property
    def is_encoder(self) -> bool:
        return self in _ENCODER_KINDS

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE_KINDS


_ENCODER_KINDS = frozenset({ActionKind.ENCODER_FORWARD, ActionKind.ENCODER_BACKWARD})
_COMPUTE_KINDS = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, *_ENCODER_KINDS})


# torch's _ComputationType member name -> our kind (its values changed from ints to strings after 2.9)
_KIND_OF_TORCH_NAME = {
    "FORWARD": ActionKind.FORWARD,
    "FULL_BACKWARD": ActionKind.BACKWARD,
    "SEND_F": ActionKind.SEND_F,
    "RECV_F": ActionKind.RECV_F,
    "SEND_B": ActionKind.SEND_B,
    "RECV_B": ActionKind.RECV_B,
}
_LLM_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)$")
_ENC_RE = re.compile(r"^(EF|EB)(\d+)$")


class _ActionFields(NamedTuple):
    kind: ActionKind
    microbatch: int
    stage: int | None = None


class Action(_ActionFields):
    """One pipeline action (an immutable tuple: cheap to hash, as schedules hash many of them).

    Attributes:
        kind: what runs.
        microbatch: LLM actions: torch's 0-based microbatch index; encoder actions: encoder microbatch
            id ``e >= 1``.
        stage: LLM stage index (virtual stage under interleaving); ``None`` for encoder actions.

    Raises:
        ScheduleError: an encoder action with a stage or ``e < 1``; an LLM action without a stage or with
            a negative index.
    """

    __slots__ = ()

    def __new__(cls, kind: ActionKind, microbatch: int, stage: int | None = None) -> Action:
        if kind.__class__ is not ActionKind:
            kind = ActionKind(kind)
        if kind in _ENCODER_KINDS:
            if stage is not None:
                raise ScheduleError(f"encoder action {kind}{microbatch} must not carry a stage")
            if microbatch < 1:
                raise ScheduleError(f"encoder microbatch ids start at 1, got {kind}{microbatch}")
        else:
            if stage is None or stage < 0:
                raise ScheduleError(f"LLM action {kind} needs a stage >= 0, got {stage}")
            if microbatch < 0:
                raise ScheduleError(f"LLM microbatch index must be >= 0, got {microbatch}")
        return tuple.__new__(cls, (kind, microbatch, stage))

    @classmethod
    def unchecked(cls, kind: ActionKind, microbatch: int, stage: int | None = None) -> Action:
        """Build without checks (hot loops over already-validated schedules)."""
        return tuple.__new__(cls, (kind, microbatch, stage))

    def __repr__(self) -> str:
        return f"Action({self})"

    def __str__(self) -> str:
        if self.stage is None:
            return f"{self.kind}{self.microbatch}"
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"0F1"``, ``"1B0"``, ``"2SEND_F3"``, ``"EF4"``, ``"EB4"``.

        Raises:
            ScheduleError: the text is not an action.
        """
        s = text.strip()
        if m := _ENC_RE.match(s):
            return cls(ActionKind(m.group(1)), int(m.group(2)))
        if m := _LLM_RE.match(s):
            return cls(ActionKind(m.group(2)), int(m.group(3)), int(m.group(1)))
        raise ScheduleError(f"not an action: {text!r} (expected e.g. '0F1', '1B0', '0SEND_F2', 'EF3')")

    def to_torch(self):
        """The ``torch.distributed.pipelining.schedules._Action`` for an LLM action.

        Raises:
            ScheduleError: encoder actions have no torch counterpart.
        """
        from torch.distributed.pipelining.schedules import _Action, _ComputationType

        if self.kind.is_encoder:
            raise ScheduleError(f"{self} is an encoder action; torch's pipelining has no such kind")
        # from_str, not _ComputationType(value): the enum's values are ints in torch 2.9, strings in 2.15
        return _Action(self.stage, _ComputationType.from_str(self.kind.value), self.microbatch)

    @classmethod
    def from_torch(cls, action) -> Action:
        """Inverse of :meth:`to_torch` for F/B/SEND/RECV actions.

        Raises:
            ScheduleError: a torch action kind we do not model (I, W, UNSHARD, ...).
        """
        try:
            kind = _KIND_OF_TORCH_NAME[action.computation_type.name]  # names agree across torch releases
        except KeyError:
            raise ScheduleError(f"torch action {action} has a kind omni_pipeline does not model") from None
        return cls(kind, action.microbatch_index, action.stage_index)


def flow_index(torch_microbatch: int) -> int:
    """Data-flow LLM microbatch number (from 1) of torch's 0-based index."""
    return torch_microbatch + 1


def torch_index(flow_microbatch: int) -> int:
    """torch's 0-based microbatch index of a data-flow LLM microbatch number (from 1).

    Raises:
        ValueError: ``flow_microbatch < 1``.
    """
    if flow_microbatch < 1:
        raise ValueError(f"data-flow LLM microbatches are numbered from 1, got {flow_microbatch}")
    return flow_microbatch - 1
