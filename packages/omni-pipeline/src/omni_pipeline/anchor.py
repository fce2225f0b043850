"""EncoderAnchor: attaches encoder work to points of an LLM stage's schedule (MegaScale-Omni, unified
encoder representation, Fig. 9c).

The anchor is built from the encoders colocated on this pipeline rank, their parallel layout and their
data limits; ``register(stage, flow)`` binds it to the pipeline rank holding LLM stage ``stage`` and to a data
flow (the flow's own schedule, as placement policies record it, or an explicit third argument). The LLM step
loop calls ``anchor.at(next_llm_action)`` at each action boundary and gets back exactly the encoder actions
the data flow places there; :meth:`forward` / :meth:`backward` run one encoder microbatch. The LLM stage
code is not edited: the anchor only needs the boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omni_pipeline.actions import Action, ActionKind
from omni_pipeline.dataflow import DataFlow
from omni_pipeline.schedules import Schedule

__all__ = ["EncoderAnchor", "EncoderDataConfig", "EncoderParallelConfig"]


@dataclass(frozen=True)
class EncoderParallelConfig:
    """Encoder layout on the pipeline ranks.

    Attributes:
        zero_stage: 0-2: every rank holds full encoder parameters and the executor all-reduces their
            gradients over the encoder DP group; 3: the encoders are FSDP2-sharded (``fully_shard``) and
            reduce their own gradients, so the executor leaves them alone.

    Activation offload is not the anchor's: the model's blocks choose it themselves (omni-train's
    ``train.offload`` wraps encoder and LLM blocks alike in saved-tensor hooks), so one mechanism serves
    both.
    """

    zero_stage: int = 0

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"EncoderParallelConfig.zero_stage must be 0..3, got {self.zero_stage}")


@dataclass(frozen=True)
class EncoderDataConfig:
    """Encoder data limits: ``max_seq_len`` (encoder tokens per encoder microbatch, checked on every
    forward)."""

    max_seq_len: int = 16384

    def __post_init__(self) -> None:
        if self.max_seq_len < 1:
            raise ValueError(f"EncoderDataConfig: max_seq_len must be >= 1, got {self}")


class EncoderAnchor:
    """Encoders anchored to one LLM pipeline rank.

    Args:
        encoders: ``{name: module}`` colocated on this rank (every rank holds them: encoder DP spans all).
        parallel: encoder parallel layout.
        data: encoder data limits.
    """

    def __init__(
        self,
        encoders: Mapping[str, nn.Module],
        parallel: EncoderParallelConfig | None = None,
        data: EncoderDataConfig | None = None,
    ) -> None:
        self.encoders = dict(encoders)
        self.parallel = parallel or EncoderParallelConfig()
        self.data = data or EncoderDataConfig()
        self.stage: int | None = None
        self._points: dict[Action | None, list[Action]] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def register(self, stage: int, flow: DataFlow, schedule: Schedule | None = None) -> None:
        """Bind to the pipeline rank holding LLM stage ``stage`` and the encoder actions ``flow`` places there.

        Args:
            stage: an LLM stage index (``0 <= stage < schedule.num_stages``); the anchor binds to its rank
                ``schedule.stage_to_rank(stage)`` (data flows place encoder work per rank). A pipeline rank
                is the same number as its first stage, so passing the rank works too.
            flow: the data flow.
            schedule: the LLM schedule the flow was planned for; default ``flow.schedule`` (set by the
                placement policies; a flow from :meth:`DataFlow.from_json` needs it given).

        Raises:
            ValueError: no schedule given and ``flow`` does not know its own, or ``stage`` out of range.
            DataFlowError: ``flow`` names positions that do not exist in ``schedule``.
        """
        schedule = schedule if schedule is not None else flow.schedule
        if schedule is None:
            raise ValueError(
                "EncoderAnchor.register: this data flow does not know its schedule (built by hand or "
                "from_json); call register(stage, flow, schedule)"
            )
        if not 0 <= stage < schedule.num_stages:
            raise ValueError(
                f"EncoderAnchor.register: stage {stage} out of range [0, {schedule.num_stages}) of {schedule!r}"
            )
        rank = schedule.stage_to_rank(stage)
        program = flow.programs(schedule)[rank]
        points: dict[Action | None, list[Action]] = {}
        pending: list[Action] = []
        for a in program:
            if a.kind.is_encoder:
                pending.append(a)
            else:
                if pending:
                    points[a] = pending
                pending = []
        if pending:
            points[None] = pending
        self.stage = rank
        self._points = points
        self._outputs.clear()

    def at(self, before: Action | None) -> list[Action]:
        """Encoder actions to run right before LLM action ``before`` (``None``: after the last one)."""
        if self.stage is None:
            raise RuntimeError("EncoderAnchor.at: call register(stage, flow) first")
        return list(self._points.get(before, ()))

    def placed(self) -> list[Action]:
        """Every encoder action registered on this rank, in run order."""
        return [a for acts in self._points.values() for a in acts]

    def parameters(self) -> Iterator[nn.Parameter]:
        for m in self.encoders.values():
            yield from m.parameters()

    def forward(self, e: int, encoder_fn: Callable[[int, Any], torch.Tensor], inputs: Any) -> torch.Tensor:
        """Run encoder microbatch ``e``: ``encoder_fn(e, inputs) -> Tensor[tokens_e, hidden]``; keep its
        output for :meth:`backward`.

        Raises:
            ValueError: the output has more than ``data.max_seq_len`` tokens (dim 0).
        """
        out = encoder_fn(e, inputs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"rank {self.stage}, EF{e}: encoder_fn must return a Tensor, got {type(out).__name__}"
            )
        if out.dim() >= 1 and out.shape[0] > self.data.max_seq_len:
            raise ValueError(
                f"rank {self.stage}, EF{e}: {out.shape[0]} encoder tokens exceed max_seq_len {self.data.max_seq_len}"
            )
        self._outputs[e] = out
        return out

    def backward(self, e: int, grad: torch.Tensor) -> None:
        """Backpropagate ``grad`` (d loss / d output of encoder microbatch ``e``) and free its activations.

        Raises:
            KeyError: ``e``'s forward has not run on this rank.
        """
        if e not in self._outputs:
            raise KeyError(
                f"rank {self.stage}, {ActionKind.ENCODER_BACKWARD}{e}: its forward did not run here"
            )
        out = self._outputs.pop(e)
        if out.requires_grad:
            torch.autograd.backward(out, grad)
