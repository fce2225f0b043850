"""The app's model parallelised: its config mapped to the steps of :mod:`omni_parallel.parallelize`.

:func:`parallelize` calls them in torchtitan's order over this app's model: TP of every LLM block
(``parallel.tp``), activation checkpointing of the block families in ``train.recompute`` (of the residual
branches in ``train.recompute_modules``), ``torch.compile`` per block (``train.compile``), offload of the
families in ``train.offload``, autocast over float32 master parameters (``train.dtype = "bfloat16"``), and
the gradient syncs of the LLM and of the encoders (``parallel.encoder_zero``) that define the objective's
reduction (a plain sum; :mod:`omni_parallel.parallelize` states it). :func:`family_blocks` names the
blocks of a family of this app's model.

The executor's process groups come from ``omni_pipeline.PipelineGroups.from_state``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from omni_parallel import ParallelState
from omni_parallel.activation_memory import ActivationMemory
from omni_parallel.parallelize import (
    EncoderGradientSync,
    apply_ac,
    apply_compile,
    apply_dp,
    apply_encoder_zero,
    apply_mixed_precision,
    apply_offload,
    apply_tp,
    training_dtypes,
)
from omni_parallel.tensor_parallel import llama_tp_plan
from omni_train.config import RECOMPUTE, TrainSection
from omni_train.encoders import Encoders
from omni_train.pipeline import RankStages

__all__ = ["BRANCHES", "ParallelModel", "family_blocks", "parallelize"]

# train.recompute_modules -> the residual-branch method of Block / EncoderBlock it checkpoints
BRANCHES = {"attention": "attention_branch", "mlp": "mlp_branch"}


def family_blocks(stage: nn.Module, encoders: Encoders, families: Iterable[str]) -> list[nn.Module]:
    """The transformer blocks of the named families: ``llm`` (``stage.layers``: an ``LLMStage``'s or a
    ``RankStages``'s), ``image``, ``audio`` (each tower's encoder keeps its blocks in ``.blocks``); a
    family whose tower is not built has none."""
    out: list[nn.Module] = []
    for family in families:
        if family == "llm":
            out.extend(stage.layers.values())
        elif family in encoders.towers:
            out.extend(encoders.towers[family].encoder.blocks)
    return out


@dataclass(frozen=True)
class ParallelModel:
    """What :func:`parallelize` returns: the rank's activation accounting and its two gradient syncs
    (the executor's hooks, run on every rank after the step's last backward)."""

    memory: ActivationMemory
    sync_llm: Callable[[], None]
    sync_encoders: EncoderGradientSync


def parallelize(
    stage: RankStages,
    encoders: Encoders,
    ps: ParallelState,
    train: TrainSection,
    *,
    encoder_zero: int,
    num_stages: int,
    device: torch.device,
) -> ParallelModel:
    """Parallelise this rank's LLM stages and encoders in place, in :mod:`omni_parallel.parallelize`'s
    order (collective under TP and encoder ZeRO 2/3: every rank calls it).

    Args:
        stage: this pipeline rank's stages (their parameters already in the master dtype on ``device``).
        encoders: the encoders (likewise).
        ps: the parallel state.
        train: ``recompute``, ``recompute_modules``, ``compile``, ``offload`` and ``dtype`` are read.
        encoder_zero: ``parallel.encoder_zero`` (0, 2 or 3).
        num_stages: stages of the whole pipeline (the schedule's).
        device: the compute device.
    """
    apply_tp(stage.layers.values(), ps, llama_tp_plan(attention="attn", mlp="mlp"))
    memory = ActivationMemory([stage, encoders], device)  # after TP: the sharded parameters' storages
    apply_ac(family_blocks(stage, encoders, train.recompute), [BRANCHES[m] for m in train.recompute_modules])
    if train.compile:
        apply_compile(family_blocks(stage, encoders, RECOMPUTE))
    apply_offload(family_blocks(stage, encoders, train.offload), memory)
    apply_mixed_precision(stage.chunks, num_stages, training_dtypes(train.dtype)[1], modules=[encoders])
    blocks = {name: list(tower.encoder.blocks) for name, tower in encoders.towers.items()}
    return ParallelModel(
        memory,
        apply_dp([stage], ps),
        apply_encoder_zero(encoders, encoders.towers, ps, encoder_zero, blocks=blocks),
    )
