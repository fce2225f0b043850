"""The app's model parallelised: its config mapped to the steps of :mod:`omni_parallel.parallelize`.

:func:`parallelize` calls them in torchtitan's order over this app's model: TP of every LLM block
(``parallel.tp``; with ``parallel.sequence_parallel`` Megatron SP, the stages' embedding output, final norm
and LM head included; with ``parallel.async_tp`` its communication overlapped with the projections),
activation checkpointing of the block families in ``train.recompute`` (of the residual branches in
``train.recompute_modules``), ``torch.compile`` per block (``train.compile``), offload of the
families in ``train.offload``, autocast over float32 master parameters (``train.dtype = "bfloat16"``), and
the gradient syncs of the LLM (``parallel.llm_zero``; with ``parallel.ep`` the MoE experts sharded over the EP
group, ``omni_parallel.expert_parallel``) and of the encoders (``parallel.encoder_zero``)
that define the objective's reduction (a plain sum; :mod:`omni_parallel.parallelize` states it). :func:`family_blocks` names the
blocks of a family of this app's model.

The executor's process groups come from ``omni_pipeline.PipelineGroups.from_state``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from omni_parallel import ParallelState
from omni_parallel.activation_memory import ActivationMemory
from omni_parallel.llm_zero import LLMGradientSync, apply_llm_zero
from omni_parallel.moe import shard_experts
from omni_parallel.parallelize import (
    EncoderGradientSync,
    apply_ac,
    apply_compile,
    apply_encoder_zero,
    apply_mixed_precision,
    apply_offload,
    apply_tp,
    training_dtypes,
)
from omni_parallel.tensor_parallel import llama_tp_plan, sequence_parallel_plan
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
    (the executor's hooks, run on every rank after the step's last backward; each ``attach``-ed at the
    step's start)."""

    memory: ActivationMemory
    sync_llm: LLMGradientSync
    sync_encoders: EncoderGradientSync


def parallelize(
    stage: RankStages,
    encoders: Encoders,
    ps: ParallelState,
    train: TrainSection,
    *,
    encoder_zero: int,
    llm_zero: int = 0,
    llm_reshard_after_forward: bool = False,
    sequence_parallel: bool = False,
    async_tp: bool = False,
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
        sequence_parallel: ``parallel.sequence_parallel``: Megatron SP over the TP group (norms and
            residual stream sharded along the tokens; ``omni_parallel.tensor_parallel``).
        async_tp: ``parallel.async_tp`` (with ``sequence_parallel``): each block's attention and MLP run as
            :class:`omni_parallel.async_tp.AsyncTPRegion` s (the SP all-gather and reduce-scatter decomposed
            into point-to-point rings overlapped with the Q/K/V, gate/up, output and down matmuls); the
            parameter placements are the plain SP plan's.
        llm_zero: ``parallel.llm_zero`` (0-3): the LLM stages sharded over each stage's data group
            (``omni_parallel.llm_zero.apply_llm_zero``; every block an FSDP2 unit, every stage module a root;
            under ``train.dtype = "bfloat16"`` with bf16 gathers and float32 reductions).
        llm_reshard_after_forward: ZeRO-3 frees each block after its forward
            (``omni_parallel.llm_zero.reshard_after_forward`` of ``parallel.llm_reshard_after_forward``).
        num_stages: stages of the whole pipeline (the schedule's).
        device: the compute device.

    Raises:
        ValueError: ``async_tp`` without ``sequence_parallel``.
    """
    if async_tp and not sequence_parallel:
        raise ValueError(
            "parallelize: async_tp needs sequence_parallel (parallel.async_tp, parallel.sequence_parallel)"
        )
    seq = 0 if sequence_parallel else None  # packed [T, dim]: tokens on dim 0
    plan = llama_tp_plan(
        attention="attn", mlp="mlp", attention_norm="attn_norm", mlp_norm="mlp_norm", attention_args=3,
        sequence_dim=seq, async_tp=async_tp,
    )  # fmt: skip
    ends = sequence_parallel_plan(
        embeddings="embedded" if hasattr(stage, "embedded") else None,
        norm="norm" if hasattr(stage, "norm") else None,
        output="output" if hasattr(stage, "output") else None,
    )
    apply_tp(stage.layers.values(), ps, plan, model=stage, model_plan=ends if sequence_parallel else None)
    ep = ps.size("ep") > 1
    if ep:  # parallel.ep: the MoE experts' local shards become Shard(0) DTensors over the EP group
        shard_experts(stage.chunks.values(), ps.device_mesh("ep"))
    memory = ActivationMemory([stage, encoders], device)  # after TP: the sharded parameters' storages
    apply_ac(family_blocks(stage, encoders, train.recompute), [BRANCHES[m] for m in train.recompute_modules])
    if train.compile:
        apply_compile(family_blocks(stage, encoders, RECOMPUTE))
    apply_offload(family_blocks(stage, encoders, train.offload), memory)
    apply_mixed_precision(stage.chunks, num_stages, training_dtypes(train.dtype)[1], modules=[encoders])
    blocks = {name: list(tower.encoder.blocks) for name, tower in encoders.towers.items()}
    # with parallel.ep the experts stay out of FSDP2, summed over the expert-data-parallel ranks only (and
    # at llm_zero 1-3 sharded over them: omni_parallel.llm_zero)
    compute = training_dtypes(train.dtype)[1]  # bf16 over float32 masters: FSDP2 mixed precision
    sync_llm = apply_llm_zero(
        list(stage.chunks.values()), ps, llm_zero, blocks=stage.layers.values(),
        param_dtype=compute if compute == torch.bfloat16 else None,
        reshard_after_forward=llm_reshard_after_forward,
    )  # fmt: skip
    return ParallelModel(
        memory, sync_llm, apply_encoder_zero(encoders, encoders.towers, ps, encoder_zero, blocks=blocks)
    )
