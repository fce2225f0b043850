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

Mixed precision (``param_dtype``, e.g. bfloat16 for ``train.dtype = "bfloat16"``): every unit gets
``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``. The all-gather moves ``param_dtype``
copies of the float32 shards (half the bytes), forward and backward run on them, FSDP2 accumulates each
gradient across the step's microbatches in float32 (``grad_dtype``), and the step's one reduce-scatter /
all-reduce runs in float32 into float32 shard gradients; AdamW steps the float32 shards (torchtitan's
``mixed_precision_param = bfloat16``, ``mixed_precision_reduce = float32``). The gathered copies kept by
ZeRO-1/2 between steps are ``param_dtype``. Without it (float32 / float64 runs, and stage 0) nothing is
cast.

Reshard policy (``reshard_after_forward``, ZeRO-3 only; :func:`reshard_after_forward` maps the app's
``auto`` / ``always`` / ``never``): ``False`` (torchtitan's choice under PP with more than one
microbatch per stage) keeps every unit gathered from :meth:`LLMGradientSync.attach` to the sync, no
collective inside the step. ``True`` gathers each block unit in its own pre-forward hook and frees it
after its forward (FSDP2's ``reshard_after_forward``), re-gathering it for backward: the whole gathered
stage is never held at once, at one more all-gather per block and microbatch; the roots (embedding,
final norm, LM head) stay gathered through the step. Every rank of the group runs the same microbatches
through the same stage, so these per-microbatch all-gathers line up. ZeRO-1/2 keep the gathered storage
between steps anyway, so there the policy has nothing to free and is not applied.

The units, their ``FSDPParam`` s (each parameter's sharded and gathered tensors) and the mesh are read
once, in :func:`apply_llm_zero`; the per-step attach and sync walk those lists (no module traversal).

Expert parallelism (``ep > 1``, :mod:`omni_parallel.moe`): the routed experts' parameters
(:func:`~omni_parallel.moe.expert_parameters`, already ``Shard(0)`` DTensors over the EP group,
:func:`~omni_parallel.moe.shard_experts`) are left out of every FSDP2 unit (``fully_shard(...,
ignored_params=...)``): FSDP2 shards, gathers and reduces the other parameters over ``dp_cp`` as above,
while the experts keep their EP shards (``1/ep`` of them per rank, whole over the step: never gathered),
accumulate their gradients in place and are summed over the expert-data-parallel group only
(:attr:`~omni_parallel.ParallelState.expert_dp_group`, the ranks holding the same shard) by the same
sync, after the non-expert reduction (:func:`~omni_parallel.moe.expert_parallel_sync` at stage 0). The
experts' AdamW state is therefore ``1/ep`` at every stage, not sharded further over the expert-data-parallel
ranks (torchtitan's ``dp_shard_mod_ep`` FSDP of the experts is not built).

Not composed: tensor parallelism (the parameters are already TP ``DTensor``s; FSDP2 over TP needs a 2-D
mesh ``(dp_cp, tp)`` sliced from one root mesh, which ``ParallelState``'s ``dp_cp`` group is not);
:func:`apply_llm_zero` raises for it.

Source: torchtitan ``parallelize_llama.apply_fsdp`` (per-block ``fully_shard``, ``reshard_after_forward``
False under PP), PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``), Megatron-LM's distributed
optimizer (ZeRO-1: full gradients, sharded optimizer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from omni_parallel.encoder_zero import (
    _BUCKET_BYTES,
    _buckets,
    _reduce_scatter_bucket,
    configure_step_schedule,
    shard_rows,
    sharded_units,
)
from omni_parallel.moe import expert_parallel_sync, expert_parameters
from omni_parallel.state import ParallelState

__all__ = [
    "LLM_ZERO_STAGES",
    "RESHARD_POLICIES",
    "LLMGradientSync",
    "all_reduce_into_shards",
    "apply_llm_zero",
    "reshard_after_forward",
]

LLM_ZERO_STAGES = (0, 1, 2, 3)
RESHARD_POLICIES = ("auto", "always", "never")


@dataclass(frozen=True)
class LLMGradientSync:
    """The LLM's gradient sync :func:`apply_llm_zero` returns.

    ``sync.attach()``: on every rank of the stage's data group, after
    ``optimizer.zero_grad(set_to_none=True)`` and before the step's first LLM forward (collective under
    ZeRO 1-3: the once-per-step all-gather). ``sync()``: on every rank after the step's last backward
    (collective: the all-reduce or reduce-scatter, then the reshard).

    Attributes:
        zero_stage: the stage in effect (0 when the group has one rank, whatever was asked).
        reshard_after_forward: whether ZeRO-3's block units are freed after each forward (module docstring).
    """

    reduce: Callable[[], None]
    attach: Callable[[], None] = lambda: None
    zero_stage: int = 0
    reshard_after_forward: bool = False

    def __call__(self) -> None:
        self.reduce()


def reshard_after_forward(policy: str, *, pp: int, microbatches: int) -> bool:
    """The reshard policy of ZeRO-3's block units for a schedule: ``"always"`` True, ``"never"`` False,
    ``"auto"`` False under pipeline parallelism with more than one microbatch per stage (``pp > 1`` and
    ``microbatches > 1``: torchtitan's default, which spares an all-gather per block and microbatch),
    True otherwise.

    Raises:
        ValueError: ``policy`` not in :data:`RESHARD_POLICIES`.
    """
    if policy not in RESHARD_POLICIES:
        raise ValueError(f"reshard_after_forward: policy {policy!r} is not one of {RESHARD_POLICIES}")
    if policy == "auto":
        return not (pp > 1 and microbatches > 1)
    return policy == "always"


@dataclass(frozen=True)
class _Units:
    """The FSDP2 units inside some modules, read once: the units (module order), their ``FSDPParam`` s
    (the same order on every rank), the mesh group, and the units gathered at attach."""

    units: tuple[nn.Module, ...]
    params: tuple[Any, ...]
    group: dist.ProcessGroup
    world: int
    rank: int
    gathered_at_attach: tuple[nn.Module, ...]

    @classmethod
    def of(cls, modules: Iterable[nn.Module], who: str, lazy: Iterable[nn.Module] = ()) -> _Units:
        units = sharded_units(modules)
        params = tuple(
            fp for u in units for g in u._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params
        )
        if not params:
            raise ValueError(
                f"{who}: the modules hold no FSDP2 unit with parameters (fully_shard them first)"
            )
        mesh = params[0].mesh_info.mesh
        if mesh.ndim != 1 or any(fp.mesh_info.mesh is not mesh for fp in params):
            raise ValueError(f"{who}: the FSDP2 units are not sharded over one 1-D mesh")
        skip = {id(m) for m in lazy}
        return cls(
            tuple(units), params, mesh.get_group(), mesh.size(), mesh.get_local_rank(),
            tuple(u for u in units if id(u) not in skip),
        )  # fmt: skip

    def attach(self) -> None:
        """All-gather the units gathered at attach (collective over the mesh, every rank)."""
        for unit in self.gathered_at_attach:
            unit.unshard()

    def take_grads(self) -> list[torch.Tensor | None]:
        """Each parameter's gathered gradient (in its shard's dtype: float32 under a bf16
        ``MixedPrecisionPolicy``; ``None``: unused on this rank this step), cleared from the gathered
        parameter; then every unit resharded."""
        grads = []
        for fp in self.params:
            g = getattr(fp, "_unsharded_param", None)
            g = None if g is None else g.grad
            if g is not None:
                fp.unsharded_param.grad = None
                dtype = fp.sharded_param.dtype
                g = g if g.dtype == dtype else g.to(dtype)
            grads.append(g)
        for unit in reversed(self.units):
            unit.reshard()
        return grads

    def reduce_scatter(self, divide_by: float = 1.0) -> None:
        """ZeRO-2/3: one SUM reduce-scatter per bucket into ``Shard(0)`` gradients."""
        pairs = list(zip((fp.sharded_param for fp in self.params), self.take_grads(), strict=True))
        for bucket in _buckets(pairs, _BUCKET_BYTES):
            _reduce_scatter_bucket(bucket, self.group, divide_by)

    def all_reduce(self, divide_by: float = 1.0) -> None:
        """ZeRO-1: the whole gradients summed (one all-reduce per bucket), each shard's gradient its rows."""
        grads = self.take_grads()
        for k, (fp, g) in enumerate(zip(self.params, grads, strict=True)):
            if g is None:  # zeros where a rank used a parameter nowhere: the buckets line up on every rank
                sharded = fp.sharded_param
                grads[k] = torch.zeros(sharded.shape, dtype=sharded.dtype, device=sharded.to_local().device)
        for bucket in _flat_buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            if divide_by != 1:
                flat.div_(divide_by)
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
                g.copy_(part.view_as(g))
        for fp, g in zip(self.params, grads, strict=True):
            p = fp.sharded_param
            if not isinstance(p, DTensor) or tuple(p.placements) != (Shard(0),):
                raise ValueError(
                    f"all_reduce_into_shards: {fp._param_fqn} is not an FSDP2 Shard(0) parameter"
                )
            start, rows = shard_rows(p.shape[0], self.world, self.rank)
            p.grad = DTensor.from_local(
                g.narrow(0, start, rows), p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                run_check=False,
            )  # fmt: skip


def _flat_buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one device and dtype up to :data:`_BUCKET_BYTES` (the same on every rank)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if (
            not out
            or size + nbytes > _BUCKET_BYTES
            or (out[-1][0].device, out[-1][0].dtype) != (g.device, g.dtype)
        ):
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out


def apply_llm_zero(
    chunks: Sequence[nn.Module],
    ps: ParallelState,
    zero_stage: int = 0,
    *,
    blocks: Iterable[nn.Module] = (),
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = False,
) -> LLMGradientSync:
    """Shard this rank's LLM stages over ``ps`` group ``dp_cp`` at ZeRO ``zero_stage`` (see the module
    docstring) and return their gradient sync. Collective for stages 1-3 with more than one rank in the
    group (every rank of it calls it, with the same modules).

    Args:
        chunks: the stage modules the pipeline executor runs (each an FSDP2 root); their parameters are
            the LLM's parameters on this rank. Stage 0 reduces exactly these parameters.
        ps: the parallel state (its ``dp_cp`` group and mesh, ``tp`` size; with ``ep > 1`` its
            ``expert_dp_group``, built with ``GroupSpec(expert_dp=True)``).
        zero_stage: 0, 1, 2 or 3.
        blocks: transformer blocks inside ``chunks``, one FSDP2 unit each (sharded before their chunk).
        param_dtype: ``None`` (nothing cast) or the dtype the units gather and compute in (bfloat16 over
            float32 shards), with float32 gradient reductions (``MixedPrecisionPolicy``; stages 1-3).
        reshard_after_forward: ZeRO-3: free each block unit after its forward (module docstring).

    With ``ep > 1`` the routed experts in ``chunks`` stay out of FSDP2 and are summed over the
    expert-data-parallel group (module docstring), at every stage.

    Raises:
        ValueError: ``zero_stage`` not in 0-3; ``zero_stage > 0`` with ``tp > 1`` (not composed, see the
            module docstring); a block not inside any chunk; ``param_dtype`` not a floating dtype; routed
            experts with ``ep`` < ``dp_cp`` and no ``ps.expert_dp_group``.
    """
    from omni_parallel.parallelize import apply_dp

    if isinstance(zero_stage, bool) or zero_stage not in LLM_ZERO_STAGES:
        raise ValueError(f"apply_llm_zero: ZeRO stage {zero_stage!r} is not one of {LLM_ZERO_STAGES}")
    if param_dtype is not None and not param_dtype.is_floating_point:
        raise ValueError(f"apply_llm_zero: param_dtype {param_dtype} is not a floating dtype")
    chunks = list(chunks)
    experts = expert_parameters(chunks) if ps is not None and ps.size("ep") > 1 else []
    if experts and ps.expert_dp_group is None and ps.size("dp_cp") > ps.size("ep"):
        raise ValueError(
            f"apply_llm_zero: ep = {ps.size('ep')} inside dp_cp = {ps.size('dp_cp')} needs the "
            "expert-data-parallel group (ParallelState.build(..., groups=GroupSpec(expert_dp=True)))"
        )
    if zero_stage == 0 or ps.size("dp_cp") == 1:
        if experts:  # the experts over the expert-data-parallel ranks, the rest over dp_cp
            dense = ps.group("dp_cp") if ps.size("dp_cp") > 1 else None
            return LLMGradientSync(expert_parallel_sync(chunks, dense, ps.expert_dp_group))
        return LLMGradientSync(apply_dp(chunks, ps))
    if ps.size("tp") > 1:
        raise ValueError(
            f"apply_llm_zero: ZeRO stage {zero_stage} with tp = {ps.size('tp')} is not supported "
            "(the parameters are TP DTensors; FSDP2 over them needs a 2-D mesh)"
        )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    inside = {id(m) for c in chunks for m in c.modules()}
    mesh = ps.device_mesh("dp_cp")
    ignored = set(experts) or None  # EP-sharded experts: not FSDP2's (module docstring)
    blocks = list(blocks)
    for i, block in enumerate(blocks):
        if id(block) not in inside:
            raise ValueError(f"apply_llm_zero: blocks[{i}] ({type(block).__name__}) is in no chunk")
        fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=mp, ignored_params=ignored)
    for chunk in chunks:
        fully_shard(chunk, mesh=mesh, reshard_after_forward=False, mp_policy=mp, ignored_params=ignored)
    configure_step_schedule(chunks, keep_gathered=zero_stage < 3)
    lazy = blocks if zero_stage == 3 and reshard_after_forward else []
    for block in lazy:  # gathered by its own pre-forward hook, freed after its forward
        block.set_reshard_after_forward(True, recurse=False)
    units = _Units.of(chunks, "apply_llm_zero", lazy=lazy)
    reduce = units.all_reduce if zero_stage == 1 else units.reduce_scatter
    if experts:
        reduce = _then_sum_experts(reduce, experts, ps.expert_dp_group)
    return LLMGradientSync(reduce, units.attach, zero_stage, bool(lazy))


def _then_sum_experts(
    reduce: Callable[[], None], experts: list[nn.Parameter], group: dist.ProcessGroup | None
) -> Callable[[], None]:
    """``reduce`` (the FSDP2 units' sync), then the experts' gradients summed over ``group`` (the
    expert-data-parallel ranks; ``None``: one holder of each shard, nothing to sum)."""
    from omni_parallel.data_parallel import all_reduce_gradients

    def sync() -> None:
        reduce()
        all_reduce_gradients(experts, group)

    return sync


def all_reduce_into_shards(modules: Iterable[nn.Module], *, divide_by: float = 1.0) -> None:
    """ZeRO-1's sync of gathered FSDP2 units: sum the whole gradients over the units' mesh (one
    all-reduce per bucket, in the shards' dtype), divide by ``divide_by``, reshard every unit, and give
    each sharded parameter its ``Shard(0)`` rows of the summed gradient as a ``DTensor`` gradient (a view
    of the whole gradient, which stays allocated until ``zero_grad``). Collective: every rank of the
    mesh, after the step's last backward, with the modules given to
    :func:`~omni_parallel.encoder_zero.gather_parameters`. (:func:`apply_llm_zero`'s sync runs the same
    on units it read once.)

    Raises:
        ValueError: ``divide_by <= 0``; the modules hold no FSDP2 unit, or a parameter that is not
            ``Shard(0)`` over a 1-D mesh after reshard.
    """
    if not divide_by > 0:
        raise ValueError(f"all_reduce_into_shards: divide_by must be > 0, got {divide_by}")
    _Units.of(modules, "all_reduce_into_shards").all_reduce(divide_by)
