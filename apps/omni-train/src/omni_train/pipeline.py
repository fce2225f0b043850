"""The LLM pipeline of a run: its schedule (``parallel.schedule``, ``parallel.virtual_stages``) and the
stages one pipeline rank holds.

With ``V = virtual_stages`` the layers are split over ``pp * V`` stages by the one splitter
(``omni_pipeline.split.stage_slices``) and pipeline rank ``r`` holds stages ``r, r + pp, ...,
r + (V - 1) pp`` (``Schedule.rank_stages``, Megatron-LM's and torch's round-robin). Each stage is an
:class:`~omni_train.models.LLMStage`; the executor runs them as separate modules. The trainer sees them
as one :class:`RankStages` whose parameter names are those of a single ``LLMStage`` over the same layers
(``tok_embeddings.weight``, ``layers.<global index>.*``, ``norm.weight``, ``output.weight``), so a
checkpoint (model and optimizer, saved by name) loads under every schedule, ``pp`` and ``V``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist
from torch import nn

from omni_pipeline import Schedule, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from omni_train.config import ParallelConfigSection, PipelineSchedule
from omni_train.models.llm import LLMConfig, LLMStage

__all__ = ["RankStages", "build_rank_stages", "build_schedule"]


def build_schedule(par: ParallelConfigSection, microbatches: int) -> Schedule:
    """The LLM schedule over ``par.pp`` ranks and ``microbatches`` LLM microbatches.

    Raises:
        omni_pipeline.ScheduleError: sizes the schedule cannot run (``validate`` in
            ``omni_train.config`` names the field first).
    """
    kind, v = PipelineSchedule(par.schedule), par.virtual_stages
    if kind is PipelineSchedule.GPIPE:
        return ScheduleGPipe(par.pp, microbatches, v)
    if kind is PipelineSchedule.INTERLEAVED:
        return ScheduleInterleaved1F1B(par.pp, microbatches, v)
    return Schedule1F1B(par.pp, microbatches, v)


class RankStages(nn.Module):
    """The LLM stages of one pipeline rank, named as one model.

    The stages' submodules are registered here, not the stages themselves: the embedding (stage 0),
    every layer under ``layers.<global index>``, the final norm and LM head (last stage). The stage
    modules, for the executor, are :attr:`chunks` ``{stage: LLMStage}``; they share these submodules.

    Args:
        chunks: ``{global stage index: LLMStage}`` of this rank.

    Raises:
        ValueError: no stages, or two stages holding the same layer or the same non-layer submodule.
    """

    def __init__(self, chunks: Mapping[int, LLMStage]) -> None:
        super().__init__()
        if not chunks:
            raise ValueError("RankStages: a pipeline rank holds at least one LLM stage")
        self.layers = nn.ModuleDict()
        for s in sorted(chunks):
            for name, child in chunks[s].named_children():
                if name == "layers":
                    for i, block in child.items():
                        if i in self.layers:
                            raise ValueError(f"RankStages: layer {i} is held by two stages (stage {s})")
                        self.layers[i] = block
                elif hasattr(self, name):
                    raise ValueError(f"RankStages: {name} is held by two stages (stage {s})")
                else:
                    self.add_module(name, child)
        self.chunks: dict[int, LLMStage] = dict(sorted(chunks.items()))  # plain dict: not registered twice


def build_rank_stages(
    cfg: LLMConfig,
    schedule: Schedule,
    pp_rank: int,
    *,
    seed: int,
    sp_group: dist.ProcessGroup | None = None,
) -> RankStages:
    """The stages ``schedule`` places on pipeline rank ``pp_rank``, each over its share of the layers of
    ``schedule.num_stages`` stages (initialised per layer from ``seed``: any split holds the same weights)."""
    return RankStages(
        {
            s: LLMStage(cfg, s, schedule.num_stages, seed=seed, sp_group=sp_group)
            for s in schedule.rank_stages(pp_rank)
        }
    )
