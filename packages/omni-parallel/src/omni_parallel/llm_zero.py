"""LLM ZeRO 0-3 over FSDP2 for every pipeline stage, on the step-scoped schedule of
:mod:`omni_parallel.encoder_zero`.

The LLM stages of one pipeline rank are sharded over the stage's data group, ``ParallelState`` group
``dp_cp`` (its DP replicas times its Ulysses / CP ranks: every rank of it holds the same layers and
their gradients are summed over it, :mod:`omni_parallel.parallelize`). Each stage module the executor
runs (a ``chunk``) is an FSDP2 root; each transformer block inside it is a unit of its own (torchtitan's
``apply_fsdp`` per model part under PP); the root unit holds what is left (embedding, final norm, LM
head).

Schedule (one of each thing with the encoders: :func:`~omni_parallel.encoder_zero.gather_parameters`,
:func:`~omni_parallel.encoder_zero.reduce_scatter_gradients`): FSDP2's own hooks would all-gather
before every unit's forward and backward and reduce-scatter after every backward, i.e. once per
microbatch, and average over the mesh. Here every rank of the group all-gathers each unit once when
the step starts (:meth:`LLMGradientSync.attach`), forwards and backwards of every microbatch issue no
collective and accumulate into the gathered gradients, and :meth:`LLMGradientSync.__call__` (after the
step's last backward) sums them once per bucket (a plain sum: the objective's, never FSDP2's mean) and
reshards. This is torchtitan's choice under PP (``reshard_after_forward=False`` for pipelined models:
the gathered parameters live through the step) with the gradient sync on the last microbatch only.

Stages (Rajbhandari et al., "ZeRO", SC'20, §5; per rank of a group of ``W`` ranks, ``P`` parameters):

* 0: replicated (:func:`omni_parallel.parallelize.apply_dp`: bucketed all-reduce); ``P`` parameters,
  ``P`` gradients, ``2P`` AdamW moments.
* 1: optimizer state sharded. Each unit keeps its gathered storage between steps; the gradients are
  all-reduced whole (one all-reduce per bucket, the full summed gradient stays allocated: ZeRO-1's
  communication and its gradient memory), and each parameter's gradient is its ``Shard(0)`` rows of that
  buffer as a ``DTensor`` (a view, no copy), so AdamW steps and keeps moments for ``1/W`` of each
  parameter. ``P`` gathered + ``P/W`` shard parameters, ``P`` gradients, ``2P/W`` moments.
* 2: + gradients sharded: one reduce-scatter per bucket into ``Shard(0)`` gradients; the gathered
  storage is kept between steps. ``P`` + ``P/W`` parameters, ``P/W`` gradients, ``2P/W`` moments.
* 3: + parameters sharded: the gathered storage is freed at reshard, so between steps a rank holds
  ``P/W`` parameters, ``P/W`` gradients and ``2P/W`` moments (inside a step the gathered ``P`` too).

Stages 1-3 step the shards; the next step's all-gather brings the update into the gathered copy (ZeRO-1
and 2 gather into the kept storage: ``set_keep_unsharded_storage``). With one rank in the group there is
nothing to shard: every stage is stage 0.

Mixed precision. ``MixedPrecisionPolicy`` is not used: the repo trains bf16 by autocast over float32
masters (:func:`omni_parallel.parallelize.apply_mixed_precision`), so the gathered parameters, their
gradients and the explicit reduce-scatter / all-reduce are float32 (the issue's "float32 reductions");
a bf16 ``param_dtype`` would gather bf16 copies that this schedule keeps for the whole step and, for
ZeRO-1/2, between steps, and FSDP2 casts gradients to ``reduce_dtype`` only inside its own reduction,
which the step-scoped schedule replaces.

Not composed: tensor parallelism (the parameters are already TP ``DTensor``s; FSDP2 over TP needs a 2-D
mesh ``(dp_cp, tp)`` sliced from one root mesh, which ``ParallelState``'s ``dp_cp`` group is not) and
expert parallelism; :func:`apply_llm_zero` raises for both.

Source: torchtitan ``parallelize_llama.apply_fsdp`` (per-block ``fully_shard``, ``reshard_after_forward``
False under PP), PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``), Megatron-LM's distributed
optimizer (ZeRO-1: full gradients, sharded optimizer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from omni_parallel.data_parallel import all_reduce_gradients
from omni_parallel.encoder_zero import (
    _named,
    checked_units,
    configure_step_schedule,
    gather_parameters,
    reduce_scatter_gradients,
    shard_rows,
)
from omni_parallel.state import ParallelState

__all__ = ["LLM_ZERO_STAGES", "LLMGradientSync", "all_reduce_into_shards", "apply_llm_zero"]

LLM_ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class LLMGradientSync:
    """The LLM's gradient sync :func:`apply_llm_zero` returns.

    ``sync.attach()``: on every rank of the stage's data group, after
    ``optimizer.zero_grad(set_to_none=True)`` and before the step's first LLM forward (collective under
    ZeRO 1-3: the once-per-step all-gather). ``sync()``: on every rank after the step's last backward
    (collective: the all-reduce or reduce-scatter, then the reshard).

    Attributes:
        zero_stage: the stage in effect (0 when the group has one rank, whatever was asked).
    """

    reduce: Callable[[], None]
    attach: Callable[[], None] = lambda: None
    zero_stage: int = 0

    def __call__(self) -> None:
        self.reduce()


def apply_llm_zero(
    chunks: Sequence[nn.Module],
    ps: ParallelState,
    zero_stage: int = 0,
    *,
    blocks: Iterable[nn.Module] = (),
) -> LLMGradientSync:
    """Shard this rank's LLM stages over ``ps`` group ``dp_cp`` at ZeRO ``zero_stage`` (see the module
    docstring) and return their gradient sync. Collective for stages 1-3 with more than one rank in the
    group (every rank of it calls it, with the same modules).

    Args:
        chunks: the stage modules the pipeline executor runs (each an FSDP2 root); their parameters are
            the LLM's parameters on this rank. Stage 0 reduces exactly these parameters.
        ps: the parallel state (its ``dp_cp`` group and mesh, ``tp`` and ``ep`` sizes).
        zero_stage: 0, 1, 2 or 3.
        blocks: transformer blocks inside ``chunks``, one FSDP2 unit each (sharded before their chunk).

    Raises:
        ValueError: ``zero_stage`` not in 0-3; ``zero_stage > 0`` with ``tp > 1`` or ``ep > 1`` (not
            composed, see the module docstring); a block not inside any chunk.
    """
    from omni_parallel.parallelize import apply_dp

    if isinstance(zero_stage, bool) or zero_stage not in LLM_ZERO_STAGES:
        raise ValueError(f"apply_llm_zero: ZeRO stage {zero_stage!r} is not one of {LLM_ZERO_STAGES}")
    chunks = list(chunks)
    if zero_stage == 0 or ps.size("dp_cp") == 1:
        return LLMGradientSync(apply_dp(chunks, ps))
    for axis in ("tp", "ep"):
        if ps.size(axis) > 1:
            raise ValueError(
                f"apply_llm_zero: ZeRO stage {zero_stage} with {axis} = {ps.size(axis)} is not supported "
                f"(the parameters are {axis.upper()} DTensors; FSDP2 over them needs a 2-D mesh)"
            )
    from torch.distributed.fsdp import fully_shard

    inside = {id(m) for c in chunks for m in c.modules()}
    mesh = ps.device_mesh("dp_cp")
    for i, block in enumerate(blocks):
        if id(block) not in inside:
            raise ValueError(f"apply_llm_zero: blocks[{i}] ({type(block).__name__}) is in no chunk")
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    for chunk in chunks:
        fully_shard(chunk, mesh=mesh, reshard_after_forward=False)
    configure_step_schedule(chunks, keep_gathered=zero_stage < 3)
    if zero_stage == 1:
        reduce = lambda: all_reduce_into_shards(chunks)  # noqa: E731
    else:
        reduce = lambda: reduce_scatter_gradients(chunks)  # noqa: E731
    return LLMGradientSync(reduce, lambda: gather_parameters(chunks), zero_stage)


def all_reduce_into_shards(modules: Iterable[nn.Module], *, divide_by: float = 1.0) -> None:
    """ZeRO-1's sync of gathered FSDP2 units: sum the whole gradients over the units' mesh (one
    all-reduce per bucket, :func:`omni_parallel.data_parallel.all_reduce_gradients`), divide by
    ``divide_by``, reshard every unit, and give each sharded parameter its ``Shard(0)`` rows of the summed
    gradient as a ``DTensor`` gradient (a view of the whole gradient, which stays allocated until
    ``zero_grad``). Collective: every rank of the mesh, after the step's last backward, with the modules
    given to :func:`~omni_parallel.encoder_zero.gather_parameters`.

    Raises:
        ValueError: ``divide_by <= 0``; the modules hold no FSDP2 unit, or a parameter that is not
            ``Shard(0)`` over a 1-D mesh after reshard.
    """
    modules, units = checked_units(modules, divide_by, "all_reduce_into_shards")
    gathered = [p for _, _, p in _named(modules)]
    for p in gathered:  # zeros where a rank used a parameter nowhere: the buckets line up on every rank
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    mesh = _unit_mesh(units)
    all_reduce_gradients(gathered, mesh.get_group(), divide_by=divide_by)
    grads = {(i, name): p.grad for i, name, p in _named(modules)}
    for p in gathered:
        p.grad = None
    for unit in reversed(units):
        unit.reshard()
    world, rank = mesh.size(), mesh.get_local_rank()
    for i, name, p in _named(modules):
        g = grads[(i, name)]
        if not isinstance(p, DTensor) or tuple(p.placements) != (Shard(0),):
            raise ValueError(f"all_reduce_into_shards: {name} is not an FSDP2 Shard(0) parameter")
        start, rows = shard_rows(p.shape[0], world, rank)
        p.grad = DTensor.from_local(
            g.narrow(0, start, rows),
            p.device_mesh,
            p.placements,
            shape=p.shape,
            stride=p.stride(),
            run_check=False,
        )


def _unit_mesh(units: list[nn.Module]):
    """The mesh the units are sharded over (the first unit holding parameters: every unit of
    :func:`apply_llm_zero` has the same)."""
    for unit in units:
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            return group.mesh_info.mesh
    raise ValueError("all_reduce_into_shards: the FSDP2 units hold no parameter")
