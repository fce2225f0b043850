"""Tensor parallelism for LLaMA-style blocks through ``torch.distributed.tensor.parallel``.

Megatron's layout, expressed as DTensor plans (as torchtitan does): the Q/K/V projections and the
SwiGLU gate/up projections are column-parallel (each TP rank owns a slice of the heads / of the
intermediate size), the attention output and MLP down projections are row-parallel (partial sums,
all-reduced). The attention module must reshape with ``-1`` heads (``view(tokens, -1, head_dim)``) so
it runs on the local heads unchanged. No hand-written parallel layers.

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022, §4.2.2; torchtitan's ``parallelize_llama``): with ``llama_tp_plan(sequence_dim=d)`` the
residual stream between the attention and MLP regions is sharded along the token dimension ``d`` over
the TP group (``Shard(d)``, each rank ``T / tp`` tokens): the norms run on the shard
(``SequenceParallel``: their weights become ``Replicate`` DTensors), the attention and MLP inputs are
all-gathered (``PrepareModuleInput`` ``Shard(d) -> Replicate``; in backward a reduce-scatter), the output
and down projections reduce-scatter (``RowwiseParallel(output_layouts=Shard(d))``) instead of
all-reducing. Block inputs and outputs are then plain tensors holding this rank's token shard.
:func:`sequence_parallel_plan` shards the model's ends (the embedding output in, the final norm and the
LM head out), and the norms' weight gradients, partial sums over the TP group after backward (each rank
saw its own tokens), are summed once per step by :func:`reduce_partial_gradients`.
``llama_tp_plan(sequence_dim=0, async_tp=True)`` keeps these placements but overlaps each region's
all-gather and reduce-scatter with its projections (:mod:`omni_parallel.async_tp`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from omni_parallel.async_tp import AsyncTPRegion
from omni_parallel.data_parallel import all_reduce_gradients

__all__ = [
    "apply_tensor_parallel",
    "check_tp_heads",
    "llama_tp_plan",
    "reduce_partial_gradients",
    "sequence_parallel_plan",
]


def llama_tp_plan(
    *,
    attention: str = "attention",
    mlp: str = "feed_forward",
    q_proj: str = "wq",
    k_proj: str = "wk",
    v_proj: str = "wv",
    o_proj: str = "wo",
    gate_proj: str = "w1",
    up_proj: str = "w3",
    down_proj: str = "w2",
    attention_norm: str = "attention_norm",
    mlp_norm: str = "ffn_norm",
    attention_args: int = 1,
    sequence_dim: int | None = None,
    async_tp: bool = False,
) -> dict[str, ParallelStyle]:
    """``parallelize_module`` plan for one transformer block, keyed by module path inside the block.

    Defaults are torchtitan/Meta LLaMA names; pass Hugging Face names (``attention="self_attn"``,
    ``mlp="mlp"``, ``q_proj="q_proj"``, ..., ``o_proj="o_proj"``, ``gate_proj="gate_proj"``,
    ``up_proj="up_proj"``, ``down_proj="down_proj"``, ``attention_norm="input_layernorm"``,
    ``mlp_norm="post_attention_layernorm"``) for HF-style modules.

    Args:
        attention_norm, mlp_norm: the pre-attention and pre-MLP norms (read only with ``sequence_dim``).
        attention_args: positional arguments of the attention module's forward (with ``sequence_dim``):
            the first is the hidden states, the others (e.g. RoPE angles, sequence boundaries) pass
            through unchanged.
        sequence_dim: ``None``: no sequence parallelism. Else the token dimension of the hidden states
            (0 for packed ``[T, dim]``, 1 for ``[batch, T, dim]``): Megatron sequence parallelism (module
            docstring), block inputs and outputs ``Shard(sequence_dim)`` local shards of ``T / tp`` tokens.
            Q/K/V stay plain local tensors of the rank's heads over all ``T`` tokens, so any attention
            kernel (varlen, context-parallel, Ulysses) runs on them unchanged.
        async_tp: with ``sequence_dim = 0`` (packed ``[T, dim]``): async TP
            (:mod:`omni_parallel.async_tp`): the same parameter placements and norms, but the attention
            and MLP modules each an :class:`~omni_parallel.async_tp.AsyncTPRegion` (Q/K/V, resp. gate/up,
            as one ring all-gather-matmul; the output, resp. down, projection as one ring
            matmul-reduce-scatter, each transfer overlapped with a chunk's matmuls) instead of
            ``PrepareModuleInput`` + ``ColwiseParallel`` / ``RowwiseParallel``. The attention module must
            use its hidden-states input only to call Q/K/V (and read its shape), the MLP only for gate/up.

    Returns:
        ``{"attention.wq": ColwiseParallel(), ..., "attention.wo": RowwiseParallel(), ...}``: without
        ``sequence_dim`` inputs and block outputs stay replicated over the TP group; one all-reduce after
        attention and one after the MLP in forward, and likewise in backward. With it, also the norms
        (``SequenceParallel``) and the attention / MLP modules (``PrepareModuleInput``): one all-gather
        before and one reduce-scatter after each region, in forward and in backward. With ``async_tp``:
        ``{attention_norm, mlp_norm: SequenceParallel, attention, mlp: AsyncTPRegion}`` (no collective:
        ``tp - 1`` ring transfers per region and direction, each overlapped with a matmul).

    Raises:
        ValueError: ``attention_args < 1``, a negative ``sequence_dim``, or ``async_tp`` without
            ``sequence_dim = 0``.
    """
    if async_tp and sequence_dim != 0:
        raise ValueError(
            f"llama_tp_plan: async_tp needs sequence_dim = 0 (packed [T, dim] tokens), got {sequence_dim}"
        )
    col = (
        f"{attention}.{q_proj}",
        f"{attention}.{k_proj}",
        f"{attention}.{v_proj}",
        f"{mlp}.{gate_proj}",
        f"{mlp}.{up_proj}",
    )
    row = (f"{attention}.{o_proj}", f"{mlp}.{down_proj}")
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in col}
    if sequence_dim is None:
        plan.update({name: RowwiseParallel() for name in row})
        return plan
    if attention_args < 1 or sequence_dim < 0:
        raise ValueError(
            f"llama_tp_plan: attention_args must be >= 1 and sequence_dim >= 0, got {attention_args}, "
            f"{sequence_dim}"
        )
    seq, rest = Shard(sequence_dim), (None,) * (attention_args - 1)
    if async_tp:
        return {
            attention_norm: SequenceParallel(sequence_dim=0),
            mlp_norm: SequenceParallel(sequence_dim=0),
            attention: AsyncTPRegion((q_proj, k_proj, v_proj), o_proj),
            mlp: AsyncTPRegion((gate_proj, up_proj), down_proj),
        }
    plan.update({name: RowwiseParallel(output_layouts=seq) for name in row})
    plan[attention_norm] = SequenceParallel(sequence_dim=sequence_dim)
    plan[mlp_norm] = SequenceParallel(sequence_dim=sequence_dim)
    # use_local_output=False: Q/K/V (and gate/up) see a Replicate DTensor, so the gradients of their
    # input add up as Partial and leave the region as one reduce-scatter (torchtitan's choice)
    plan[attention] = PrepareModuleInput(
        input_layouts=(seq, *rest), desired_input_layouts=(Replicate(), *rest), use_local_output=False
    )
    plan[mlp] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    return plan


def sequence_parallel_plan(
    *,
    embeddings: str | None = None,
    norm: str | None = None,
    output: str | None = None,
    sequence_dim: int = 0,
) -> dict[str, ParallelStyle]:
    """Plan for the ends of a sequence-parallel model (with blocks under
    ``llama_tp_plan(sequence_dim=...)``), keyed by module path in the model; ``None`` leaves a key out
    (a pipeline stage holds the embedding, the head, both or neither).

    Args:
        embeddings: the module whose output is the embedded sequence, the same on every TP rank (token
            embeddings with any media rows already scattered in): its output becomes this rank's
            ``Shard(sequence_dim)`` (a local slice; in backward an all-gather, so the embedding's and the
            media's gradients are whole and equal on every TP rank).
        norm: the final norm: runs on the rank's shard (``SequenceParallel``).
        output: the LM head: its input is all-gathered (``Shard -> Replicate``; in backward each rank
            keeps its shard of the gradient), so it sees every token and returns whole logits on every
            TP rank, as without sequence parallelism.

    Returns:
        ``{path: ParallelStyle}`` for :func:`apply_tensor_parallel` on the model (or a pipeline stage).
    """
    seq = Shard(sequence_dim)
    plan: dict[str, ParallelStyle] = {}
    if embeddings is not None:
        plan[embeddings] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq)
    if norm is not None:
        plan[norm] = SequenceParallel(sequence_dim=sequence_dim)
    if output is not None:
        plan[output] = PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan


def reduce_partial_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum the ``Partial`` DTensor gradients of ``params`` over their meshes, in place, once per step
    (after the step's last backward, before clipping): under sequence parallelism a norm's weight is a
    ``Replicate`` DTensor applied to ``Shard`` tokens, so backward leaves each TP rank the partial sum
    over its own tokens (Megatron's all-reduce of layer-norm gradients over the TP group). One bucketed
    all-reduce per mesh (:func:`omni_parallel.data_parallel.all_reduce_gradients`); afterwards each such
    gradient carries its parameter's placements. Other gradients are left alone.

    Raises:
        ValueError: a partial gradient over a mesh of more than one dimension, or not a partial sum.

    Collective over the mesh of every such gradient: every rank of it calls this with the same
    parameters in the same order (TP peers hold the same modules and run the same microbatches).
    """
    by_mesh: dict[DeviceMesh, list[torch.nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(x, Partial) for x in g.placements):
            if g.device_mesh.ndim != 1 or g.placements[0] != Partial("sum"):
                raise ValueError(
                    f"reduce_partial_gradients: gradient placements {g.placements} over a "
                    f"{g.device_mesh.ndim}-D mesh; only Partial(sum) over a 1-D mesh is summed here"
                )
            by_mesh.setdefault(g.device_mesh, []).append(p)
    for mesh, group in by_mesh.items():
        all_reduce_gradients(group, mesh.get_group())
        for p in group:
            placements = p.placements if isinstance(p, DTensor) else (Replicate(),)
            p.grad = DTensor.from_local(p.grad.to_local(), mesh, placements, run_check=False)


def check_tp_heads(heads_q: int, heads_kv: int, tp: int) -> None:
    """Raise ``ValueError`` unless ``tp`` divides both head counts (column-parallel Q/K/V shard whole
    heads; with GQA every TP rank must keep whole KV groups)."""
    if heads_q % tp or heads_kv % tp:
        raise ValueError(
            f"tensor parallel size {tp} must divide heads_q ({heads_q}) and heads_kv ({heads_kv})"
        )


def apply_tensor_parallel(
    block: torch.nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]
) -> torch.nn.Module:
    """Apply ``plan`` to ``block`` over the 1-D ``tp_mesh`` (e.g. ``ParallelState.device_mesh("tp")``).

    Raises:
        ValueError: a plan key names no submodule of ``block`` (the message lists the missing ones).
    """
    names = {name for name, _ in block.named_modules()}
    missing = sorted(k for k in plan if k not in names)
    if missing:
        raise ValueError(f"tensor-parallel plan names modules not in {type(block).__name__}: {missing}")
    return parallelize_module(block, tp_mesh, plan)
