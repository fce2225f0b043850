"""Tensor parallelism for LLaMA-style blocks through ``torch.distributed.tensor.parallel``.

Megatron's layout, expressed as DTensor plans (as torchtitan does): the Q/K/V projections and the
SwiGLU gate/up projections are column-parallel (each TP rank owns a slice of the heads / of the
intermediate size), the attention output and MLP down projections are row-parallel (partial sums,
all-reduced). The attention module must reshape with ``-1`` heads (``view(tokens, -1, head_dim)``) so
it runs on the local heads unchanged. No hand-written parallel layers.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

__all__ = ["apply_tensor_parallel", "check_tp_heads", "llama_tp_plan"]


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
) -> dict[str, ParallelStyle]:
    """``parallelize_module`` plan for one transformer block, keyed by module path inside the block.

    Defaults are torchtitan/Meta LLaMA names; pass Hugging Face names (``attention="self_attn"``,
    ``mlp="mlp"``, ``q_proj="q_proj"``, ..., ``o_proj="o_proj"``, ``gate_proj="gate_proj"``,
    ``up_proj="up_proj"``, ``down_proj="down_proj"``) for HF-style modules.

    Returns:
        ``{"attention.wq": ColwiseParallel(), ..., "attention.wo": RowwiseParallel(), ...}``: inputs and
        block outputs stay replicated over the TP group; one all-reduce after attention and one after
        the MLP in forward, and likewise in backward.
    """
    col = (
        f"{attention}.{q_proj}",
        f"{attention}.{k_proj}",
        f"{attention}.{v_proj}",
        f"{mlp}.{gate_proj}",
        f"{mlp}.{up_proj}",
    )
    row = (f"{attention}.{o_proj}", f"{mlp}.{down_proj}")
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in col}
    plan.update({name: RowwiseParallel() for name in row})
    return plan


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
