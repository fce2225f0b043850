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
the step starts (:meth:`LLMGradientSync.attach`), forwards and backwards of every microbatch but each
stage's last accumulate into the gathered gradients without a collective, and the gradients are summed
once per step (a plain float32 SUM: the objective's, never FSDP2's mean). The sum overlaps the last
backward: the executor calls :meth:`LLMGradientSync.arm` with a stage module just before its last
backward of the step (``PipelineExecutor(before_last_backward=...)``), and during that backward each
block unit's collective (ZeRO-2/3: the SUM reduce-scatter into its ``Shard(0)`` gradients; ZeRO-1: the
SUM all-reduce) is issued with ``async_op=True`` as soon as the unit's every gradient has been
accumulated for the last time (a post-accumulate-grad hook per gathered parameter, counting). Units
are issued in one fixed order, the stage's blocks last-first, a unit never before the one ahead of it,
so every rank of the group issues the same collectives in the same order whatever its hooks' timing (a
unit with a parameter unused in that backward holds the rest back to the sync); under TP a ``Partial``
gradient is summed over TP at issue, at the same point of the backward on every TP rank.
:meth:`LLMGradientSync.__call__` (after the step's last backward) issues what is left of that order,
waits for them all, reduces the rest once per bucket (the root units: embedding, final norm, LM head;
stages not armed; the routed experts after) and reshards. Collectives already done are waited for at
each issue, so the send buffers in flight stay a few blocks' gradients. This is torchtitan's choice under
PP (``reshard_after_forward=False`` for pipelined models: the gathered parameters live through the step)
with the gradient reduction on the last microbatch only, overlapped with its backward as PyTorch FSDP2's
post-backward reduce-scatter and Megatron-LM's ``overlap_grad_reduce`` (DDP's gradient buckets) do.
ZeRO-3 with ``reshard_after_forward=True`` (below) keeps the whole reduction at the sync (its blocks
are re-gathered in each backward), and ZeRO-0 (:func:`omni_parallel.parallelize.apply_dp`) reduces after
the last backward as before.

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
while the experts keep their EP shards (``1/ep`` of them per rank; with one holder per EP shard never
gathered, else sharded further over its holders, below),
accumulate their gradients in place and are summed over the expert-data-parallel group only
(:attr:`~omni_parallel.ParallelState.expert_dp_group`, the ranks holding the same shard) by the same
sync, after the non-expert reduction (:func:`~omni_parallel.moe.expert_parallel_sync` at stage 0).

Expert-data-parallel sharding (stages 1-3 with ``V = dp_cp / ep > 1`` holders of each EP shard;
torchtitan's FSDP of the experts over ``dp_shard_mod_ep``, Megatron-Core's distributed optimizer over the
expert-data-parallel group): each EP shard ``[E/ep, a, b]`` is further split over its ``V`` holders along
its first dim that ``V`` divides (``d``: 0 when ``V`` divides ``E/ep``), and the parameter becomes a
``[Shard(0), Shard(d)]`` DTensor over the 2-D ``("ep", "edp")`` mesh (:func:`expert_mesh`), so AdamW,
clipping (norms made whole over both dims) and checkpoints (a box inside the global ``[E, a, b]``
tensor, loadable at any ``ep`` / ZeRO stage) see global experts. The same step-scoped schedule as the
FSDP2 units, written out for these tensors (they stay out of FSDP2, whose mesh is ``dp_cp``):
:meth:`LLMGradientSync.attach` all-gathers each shard over ``edp`` into the module's
:attr:`~omni_parallel.moe.GroupedExperts.gathered` leaf (forward and backward of every microbatch compute
on it and accumulate its gradient), and the sync, after the non-expert reduction, sums those gradients
over ``edp``: ZeRO-1 all-reduces them whole (the shard's gradient a view of its slice; the whole gradient
stays allocated), ZeRO-2/3 reduce-scatter into the shard; ZeRO-1/2 keep the gathered copy between steps,
ZeRO-3 frees it. Per rank the experts then hold the stage's ZeRO bytes with ``W = V`` on top of the
``1/ep`` split (:func:`omni_parallel.memory.analytic_state_bytes`' ``expert_shards``).

Tensor parallelism (``tp > 1``, torchtitan's FSDP2 + TP): the parameters are already TP ``DTensor`` s
over ``ps.mesh["tp"]``; FSDP2 shards them over ``ps.data_mesh`` (``GroupSpec(data_mesh=True)``: the
``dp_cp`` ranks as one dimension of the same root mesh, sliced or flattened) and joins the two into its
2-D ``(dp_cp, tp)`` mesh. Each rank's shard is its TP-local tensor's ``Shard(0)`` rows over the data
group; the parameter is a DTensor with placements ``(Shard(0), <TP placement>)``, or
``(_StridedShard(0, split_factor=tp), Shard(0))`` when TP also shards dim 0 (a column-parallel weight:
chunk ``i`` of TP chunk ``j``), so AdamW steps, clipping norms and checkpoint boxes see global tensors.
The schedule above runs on the TP-local tensors: the gathered gradient of a parameter is a DTensor over
the TP mesh, a ``Partial`` one (a sequence-parallel norm's weight: each TP rank's sum over its own tokens)
summed over TP first (:meth:`_Units.take_grads`; at stage 0
:func:`~omni_parallel.tensor_parallel.reduce_partial_gradients` does it), then reduce-scattered or
all-reduced over the data group. Not composed with ``ep > 1`` (:func:`apply_llm_zero` raises).

Source: torchtitan ``parallelize_llama.apply_fsdp`` (per-block ``fully_shard``, ``reshard_after_forward``
False under PP), PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``), Megatron-LM's distributed
optimizer (ZeRO-1: full gradients, sharded optimizer).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from omni_parallel.encoder_zero import (
    _BUCKET_BYTES,
    PendingReduction,
    configure_step_schedule,
    reduce_scatter_rows,
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
    "expert_mesh",
    "reshard_after_forward",
]

LLM_ZERO_STAGES = (0, 1, 2, 3)
RESHARD_POLICIES = ("auto", "always", "never")


@dataclass(frozen=True)
class LLMGradientSync:
    """The LLM's gradient sync :func:`apply_llm_zero` returns.

    ``sync.attach()``: on every rank of the stage's data group, after
    ``optimizer.zero_grad(set_to_none=True)`` and before the step's first LLM forward (collective under
    ZeRO 1-3: the once-per-step all-gather). ``sync.arm(chunk)``: on every rank, just before the step's
    last backward through ``chunk`` (one of the stage modules given to :func:`apply_llm_zero`; the
    executor's ``before_last_backward`` hook); from then on each of the chunk's block units issues its
    gradient collective as soon as that backward has accumulated all of its gradients (module docstring:
    Schedule); a no-op at ZeRO-0, with one rank in the group, and for ZeRO-3's lazy units. ``sync()``: on
    every rank after the step's last backward (collective: waits for the armed collectives, then the
    all-reduce or reduce-scatter of the rest, then the reshard).

    Attributes:
        zero_stage: the stage in effect (0 when the group has one rank, whatever was asked).
        reshard_after_forward: whether ZeRO-3's block units are freed after each forward (module docstring).
    """

    reduce: Callable[[], None]
    attach: Callable[[], None] = lambda: None
    zero_stage: int = 0
    reshard_after_forward: bool = False
    arm: Callable[[nn.Module], None] = lambda chunk: None

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
        """Each parameter's gathered gradient as a plain tensor of its gathered (TP-local) shape, in its
        shard's dtype (float32 under a bf16 ``MixedPrecisionPolicy``; ``None``: unused on this rank this
        step), cleared from the gathered parameter; then every unit resharded. Under TP a gathered
        parameter is a DTensor over the TP mesh: a ``Partial`` gradient (a sequence-parallel norm's weight,
        each TP rank's sum over its own tokens) is first summed over TP (collective over the TP group, the
        same parameters in the same order on every TP rank), the step's TP reduction that
        :func:`omni_parallel.tensor_parallel.reduce_partial_gradients` does at stage 0."""
        grads = self.take(self.params)
        self.reshard()
        return grads

    def take(self, fps: Sequence[Any], *, clear: bool = True) -> list[torch.Tensor | None]:
        """:meth:`take_grads` for the parameters ``fps`` without the reshard; ``clear=False`` leaves each
        gathered parameter's ``.grad`` in place (the early collectives of :class:`_Overlap`, issued inside
        the last backward, clear them at the sync)."""
        grads = []
        for fp in fps:
            u = getattr(fp, "_unsharded_param", None)
            g = None if u is None else u.grad
            if g is not None:
                if clear:
                    fp.unsharded_param.grad = None
                dtype = fp.sharded_param.dtype
                g = g if g.dtype == dtype else g.to(dtype)  # before the TP sum: float32 under bf16 compute
                if isinstance(g, DTensor):
                    if tuple(g.placements) != tuple(u.placements):  # Partial(sum) over TP -> u's placements
                        g = g.redistribute(placements=u.placements)
                    g = g.to_local()
            grads.append(g)
        return grads

    def reshard(self) -> None:
        """Reshard every unit (local)."""
        for unit in reversed(self.units):
            unit.reshard()

    def reduce_scatter(self, divide_by: float = 1.0) -> None:
        """ZeRO-2/3: one SUM reduce-scatter per bucket into ``Shard(0)`` gradients."""
        self.reduce_scatter_grads(self.params, self.take_grads(), divide_by)

    def reduce_scatter_grads(
        self, fps: Sequence[Any], grads: Sequence[torch.Tensor | None], divide_by: float = 1.0,
        *, async_op: bool = False,
    ) -> PendingReduction | None:  # fmt: skip
        """ZeRO-2/3's reduction of ``fps``' gathered gradients ``grads`` (one SUM reduce-scatter per
        bucket); ``async_op``: issued, and the :class:`PendingReduction` returned waits and sets the
        ``.grad`` s."""
        pairs = list(zip(fps, grads, strict=True))
        buckets = _flat_buckets(pairs, key=lambda item: _gathered(item[0]))
        pending = [self._reduce_scatter_bucket(b, divide_by, async_op) for b in buckets]
        return _all_of(pending) if async_op else None

    def _reduce_scatter_bucket(
        self, bucket: list[tuple[Any, torch.Tensor | None]], divide_by: float, async_op: bool = False
    ) -> PendingReduction | None:
        """One SUM reduce-scatter for a bucket of ``(FSDPParam, gathered gradient)``. FSDP2 shards each
        gathered (TP-local) tensor along dim 0 as ``torch.chunk`` does (chunks of ``ceil(rows / W)`` rows,
        trailing ones short or empty), so each gradient is padded to ``W`` equal chunks and chunk ``r`` of
        every gradient goes to rank ``r``; each shard's gradient is a DTensor with its parameter's
        placements (over the 1-D data mesh, or under TP FSDP2's 2-D ``(data, tp)`` mesh)."""
        items = [(_checked_shard(fp), _gathered(fp), g, fp._param_fqn) for fp, g in bucket]
        return reduce_scatter_rows(items, self.group, divide_by, async_op=async_op)

    def all_reduce(self, divide_by: float = 1.0) -> None:
        """ZeRO-1: the whole gradients summed (one all-reduce per bucket), each shard's gradient its rows."""
        self.all_reduce_grads(self.params, self.take_grads(), divide_by)

    def all_reduce_grads(
        self, fps: Sequence[Any], grads: Sequence[torch.Tensor | None], divide_by: float = 1.0,
        *, async_op: bool = False,
    ) -> PendingReduction | None:  # fmt: skip
        """ZeRO-1's reduction of ``fps``' gathered gradients ``grads`` (one SUM all-reduce per bucket);
        ``async_op``: issued, and the :class:`PendingReduction` returned waits, copies the sums back and
        sets the ``.grad`` s."""
        grads = list(grads)
        for k, (fp, g) in enumerate(zip(fps, grads, strict=True)):
            if g is None:  # zeros where a rank used a parameter nowhere: the buckets line up on every rank
                sharded = fp.sharded_param
                grads[k] = torch.zeros(_gathered(fp), dtype=sharded.dtype, device=sharded.to_local().device)
        works = []
        for bucket in _flat_buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            works.append((bucket, flat, dist.all_reduce(flat, dist.ReduceOp.SUM, self.group, async_op)))

        def finish() -> None:
            for bucket, flat, _ in works:
                if divide_by != 1:
                    flat.div_(divide_by)
                for g, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
                    g.copy_(part.view_as(g))
            for fp, g in zip(fps, grads, strict=True):
                p = _checked_shard(fp, "all_reduce_into_shards")
                start, rows = shard_rows(g.shape[0], self.world, self.rank)
                p.grad = DTensor.from_local(
                    g.narrow(0, start, rows), p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                    run_check=False,
                )  # fmt: skip

        if async_op:
            return PendingReduction(tuple(w for _, _, w in works), finish)
        finish()
        return None


def _no_arm(chunk: nn.Module) -> None:
    """:attr:`LLMGradientSync.arm` where nothing is issued early (ZeRO-3's lazy units)."""


def _all_of(pending: Sequence[PendingReduction | None]) -> PendingReduction:
    """One :class:`PendingReduction` of several (their works; then each one's result in order)."""
    parts = [p for p in pending if p is not None]

    def then() -> None:
        for p in parts:
            p.then()

    return PendingReduction(tuple(w for p in parts for w in p.works), then)


class _Overlap:
    """The LLM sync with each block unit's collective issued during its chunk's last backward (module
    docstring: Schedule). Per step: :meth:`arm` a chunk before its last backward: a post-accumulate-grad
    hook on each trainable gathered parameter of its block units counts that backward's accumulations;
    the unit whose every parameter has been accumulated is ready, and ready units are issued (async) in
    one fixed order, the chunk's units last-first (autograd's order through a stack of blocks), a unit
    never before the one ahead of it. So every rank of the group issues the same collectives in the same
    order whatever its hooks' timing; a unit not ready by the end (a parameter unused in that backward)
    holds back the rest of the order, which :meth:`reduce` issues, in the same order, before it waits for
    them all and reduces what is left (root units, units of chunks not armed) as :class:`_Units` does."""

    def __init__(self, units: _Units, chunks: Sequence[nn.Module], zero_stage: int) -> None:
        self.units, self.zero = units, zero_stage
        roots = {id(c) for c in chunks}
        self.blocks: dict[int, list[tuple[Any, ...]]] = {}
        for chunk in chunks:
            inner = [u for u in sharded_units([chunk]) if id(u) not in roots]
            fps = [
                tuple(fp for g in u._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params)
                for u in inner
            ]
            self.blocks[id(chunk)] = [f for f in reversed(fps) if f]
        self.reset()

    def reset(self) -> None:
        """Drop this step's hooks and state (local)."""
        for h in getattr(self, "handles", ()):
            h.remove()
        self.handles: list[Any] = []
        self.armed: set[int] = set()
        self.order: list[tuple[Any, ...]] = []  # armed units, in issue order
        self.left: list[int] = []  # per armed unit: accumulations still to come in the last backward
        self.issued = 0  # order[:issued] are issued
        self.pending: collections.deque[PendingReduction] = collections.deque()  # not waited for yet

    def arm(self, chunk: nn.Module) -> None:
        """Hook ``chunk``'s block units for its last backward of the step (local; see the class).

        Raises:
            ValueError: ``chunk`` is not one of the stage modules given to :func:`apply_llm_zero`.
        """
        if id(chunk) not in self.blocks:
            raise ValueError(
                f"LLMGradientSync.arm: {type(chunk).__name__} is not one of the LLM's stage modules"
            )
        if id(chunk) in self.armed:
            return
        self.armed.add(id(chunk))
        for fps in self.blocks[id(chunk)]:
            trainable = [
                fp._unsharded_param for fp in fps if getattr(fp, "_unsharded_param", None) is not None
            ]
            trainable = [p for p in trainable if p.requires_grad]
            k = len(self.order)
            self.order.append(fps)
            self.left.append(len(trainable))
            for p in trainable:
                self.handles.append(
                    p.register_post_accumulate_grad_hook(lambda _p, k=k: self._accumulated(k))
                )
        self._issue_ready()

    def _accumulated(self, k: int) -> None:
        self.left[k] -= 1
        if self.left[k] == 0:
            self._issue_ready()

    def _issue_ready(self) -> None:
        while self.issued < len(self.order) and self.left[self.issued] <= 0:
            self._issue(self.order[self.issued])

    def _issue(self, fps: tuple[Any, ...]) -> None:
        # the send buffers of collectives already done are let go now, not at the sync, so the copies in
        # flight stay a few blocks' gradients (FSDP2 bounds them the same way)
        while self.pending and self.pending[0].done():
            self.pending.popleft().wait()
        self.issued += 1
        grads = self.units.take(fps, clear=False)
        issue = self.units.all_reduce_grads if self.zero == 1 else self.units.reduce_scatter_grads
        self.pending.append(issue(fps, grads, async_op=True))

    def reduce(self) -> None:
        """The sync (collective): the armed units not issued yet, in order; wait for all of them; the rest
        reduced as :class:`_Units` does; every unit resharded."""
        for h in self.handles:
            h.remove()
        self.handles = []
        while self.issued < len(self.order):
            self._issue(self.order[self.issued])
        while self.pending:
            self.pending.popleft().wait()
        early = {id(fp) for fps in self.order for fp in fps}
        for fps in self.order:  # their gradients were read at issue; the sums live in the shards now
            for fp in fps:
                if getattr(fp, "_unsharded_param", None) is not None:
                    fp.unsharded_param.grad = None
        rest = [fp for fp in self.units.params if id(fp) not in early]
        grads = self.units.take(rest)
        self.units.reshard()
        if rest:
            (self.units.all_reduce_grads if self.zero == 1 else self.units.reduce_scatter_grads)(rest, grads)
        self.reset()


def _gathered(fp: Any) -> tuple[int, ...]:
    """The shape an ``FSDPParam`` gathers to: the whole parameter, or under TP its TP-local tensor (what
    FSDP2 shards along dim 0 over the data mesh)."""
    return tuple(fp._orig_size)


def _checked_shard(fp: Any, who: str = "reduce_scatter_gradients") -> DTensor:
    """``fp``'s sharded parameter, checked to be FSDP2's dim-0 shard of its gathered tensor: ``Shard(0)``
    over the 1-D data mesh, or under TP ``(Shard(0) or _StridedShard(0), <TP placement>)`` over FSDP2's
    2-D ``(data, tp)`` mesh (the strided form when TP also shards dim 0: a column-parallel weight)."""
    p = fp.sharded_param
    first = p.placements[0] if isinstance(p, DTensor) else None
    if not isinstance(first, Shard | _StridedShard) or first.dim != 0 or p.device_mesh.ndim > 2:
        raise ValueError(
            f"{who}: {fp._param_fqn} is not an FSDP2 dim-0 shard over a 1-D data mesh (or a 2-D data x tp "
            f"mesh): placements {getattr(p, 'placements', None)}"
        )
    return p


def _flat_buckets(items: list[Any], key: Callable[[Any], tuple[int, ...]] | None = None) -> list[list[Any]]:
    """Consecutive items up to :data:`_BUCKET_BYTES` (the same on every rank of the group): gradients of
    one device and dtype (``key=None``), or ``(FSDPParam, gradient)`` pairs of one sharded parameter
    device and dtype, sized by ``key`` (their gathered shape)."""
    out: list[list[Any]] = []
    size, last = 0, None
    for item in items:
        if key is None:
            kind, nbytes = (item.device, item.dtype), item.numel() * item.element_size()
        else:
            p = item[0].sharded_param
            kind, nbytes = (p.device, p.dtype), math.prod(key(item)) * p.element_size()
        if not out or size + nbytes > _BUCKET_BYTES or last != kind:
            out.append([])
            size, last = 0, kind
        out[-1].append(item)
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
        ps: the parallel state (its ``dp_cp`` group and mesh, ``tp`` size; with ``tp > 1`` its
            ``data_mesh``, built with ``GroupSpec(data_mesh=True)``; with ``ep > 1`` its
            ``expert_dp_group``, built with ``GroupSpec(expert_dp=True)``).
        zero_stage: 0, 1, 2 or 3.
        blocks: transformer blocks inside ``chunks``, one FSDP2 unit each (sharded before their chunk).
        param_dtype: ``None`` (nothing cast) or the dtype the units gather and compute in (bfloat16 over
            float32 shards), with float32 gradient reductions (``MixedPrecisionPolicy``; stages 1-3).
        reshard_after_forward: ZeRO-3: free each block unit after its forward (module docstring).

    With ``ep > 1`` the routed experts in ``chunks`` stay out of FSDP2 and are summed over the
    expert-data-parallel group (module docstring), at every stage; at stages 1-3 with an
    expert-data-parallel group they are sharded over it as well (their parameters replaced by
    ``[Shard(0), Shard(d)]`` DTensors over :func:`expert_mesh`: build the optimizer after this call).

    Raises:
        ValueError: ``zero_stage`` not in 0-3; ``zero_stage > 0`` with ``tp > 1`` and no
            ``ps.data_mesh`` (``GroupSpec(data_mesh=True)``; none with ``ep > 1``); a block not inside
            any chunk; ``param_dtype`` not a floating dtype; routed
            experts with ``ep`` < ``dp_cp`` and no ``ps.expert_dp_group``; an expert tensor none of whose
            dims the expert-data-parallel size divides.
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
    mesh = _data_mesh(ps, zero_stage)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    inside = {id(m) for c in chunks for m in c.modules()}
    edp = None
    if experts and ps.expert_dp_group is not None:  # each EP shard sharded over its edp ranks too
        edp = _ExpertShards(chunks, expert_mesh(ps), zero_stage)
        experts = edp.parameters
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
    attach, arm = units.attach, _no_arm
    if not lazy:  # ZeRO-3's lazy units are re-gathered in each backward: reduced at the sync, as before
        overlap = _Overlap(units, chunks, zero_stage)
        reduce, attach, arm = overlap.reduce, _then(overlap.reset, units.attach), overlap.arm
    if edp is not None:  # the experts sharded over their expert-data-parallel ranks at the same stage
        reduce, attach = _then(reduce, edp.sync), _then(attach, edp.attach)
    elif experts:
        reduce = _then_sum_experts(reduce, experts, ps.expert_dp_group)
    return LLMGradientSync(reduce, attach, zero_stage, bool(lazy), arm)


def _data_mesh(ps: ParallelState, zero_stage: int) -> DeviceMesh:
    """The 1-D mesh FSDP2 shards the LLM over: group ``dp_cp``; under TP ``ps.data_mesh``, the ``dp_cp``
    ranks as one dimension of ``ps.mesh`` (sliced, or flattened over ``dp_rest`` x ``cp`` x ``ulysses``),
    so that FSDP2 joins it with the TP parameters' mesh (``ps.mesh["tp"]``, a slice of the same root)
    into its 2-D ``(dp_cp, tp)`` mesh (torchtitan's ``dp_shard_cp`` x ``tp``).

    Raises:
        ValueError: ``tp > 1`` and ``ps`` has no data mesh (built without ``GroupSpec(data_mesh=True)``,
            or ``ep > 1``).
    """
    if ps.size("tp") == 1:
        return ps.device_mesh("dp_cp")
    mesh = ps.data_mesh
    if mesh is None or sorted(mesh.mesh.flatten().tolist()) != sorted(ps.members["dp_cp"]):
        raise ValueError(
            f"apply_llm_zero: ZeRO stage {zero_stage} with tp = {ps.size('tp')} needs the data group as one "
            "dimension of the device mesh: ParallelState.build(..., groups=GroupSpec(data_mesh=True)), "
            f"ep = 1 (got ep = {ps.size('ep')})"
        )
    return mesh


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


def expert_mesh(ps: ParallelState) -> DeviceMesh:
    """The 2-D ``("ep", "edp")`` :class:`DeviceMesh` of this rank's expert block: ``mesh[i, j]`` the rank
    holding EP shard ``i`` as expert-data-parallel rank ``j`` (from
    :func:`omni_parallel.topology.expert_groups`' tables; no collective), over ``ps``' ``ep`` group and
    :attr:`~omni_parallel.ParallelState.expert_dp_group`.

    Raises:
        ValueError: ``ps`` has no expert-data-parallel group, or its ``ep`` / ``edp`` groups do not form
            a grid (a layout :func:`~omni_parallel.topology.expert_groups` never builds).
    """
    from omni_parallel.topology import expert_groups

    if ps.expert_dp_group is None:
        raise ValueError("expert_mesh: no expert-data-parallel group (GroupSpec(expert_dp=True), edp > 1)")
    table = expert_groups(ps.world_size, ps.config, ps.order)
    ep_of = {r: g for g in table["ep"] for r in g}
    edp = ps.members["edp"]
    grid = [[ep_of[r][i] for r in edp] for i in range(ps.size("ep"))]
    rows = {tuple(sorted(row)) for row in grid}
    if ep_of[ps.rank] != ps.members["ep"] or not rows <= {tuple(g) for g in table["edp"]}:
        raise ValueError(f"expert_mesh: the ep and edp groups of rank {ps.rank} do not form a grid: {grid}")
    return DeviceMesh.from_group(
        [ps.group("ep"), ps.expert_dp_group], ps.mesh.device_type, mesh=torch.tensor(grid),
        mesh_dim_names=("ep", "edp"),
    )  # fmt: skip


class _ExpertShards:
    """The routed experts' expert-data-parallel ZeRO (module docstring): each parameter of every
    :class:`~omni_parallel.moe.GroupedExperts` (an EP ``Shard(0)`` DTensor, local ``[E_local, a, b]``)
    becomes a ``[Shard(0), Shard(d)]`` DTensor over ``mesh`` (``("ep", "edp")``): this rank's ``1/W``
    slice of its EP block along the first dim ``d`` that ``W`` (edp ranks) divides. ``attach`` all-gathers
    the slices into the module's ``gathered`` leaves; ``sync`` sums their gradients over ``edp`` (ZeRO-1:
    all-reduce whole, the shard's gradient a view of its slice; 2-3: reduce-scatter) into the shards'
    DTensor gradients, and frees the gathered copy at ZeRO-3."""

    def __init__(self, modules: list[nn.Module], mesh: DeviceMesh, zero_stage: int) -> None:
        from omni_parallel.moe import GroupedExperts

        self.mesh, self.zero = mesh, zero_stage
        self.group, self.world, self.rank = mesh.get_group(1), mesh.size(1), mesh.get_local_rank(1)
        self.entries: list[tuple[GroupedExperts, str, int]] = []
        for m in (sub for c in modules for sub in c.modules() if isinstance(sub, GroupedExperts)):
            if m.edp_dims is not None:
                continue
            dims: dict[str, int] = {}
            for name, p in list(m.named_parameters(recurse=False)):
                local = p.to_local() if isinstance(p, DTensor) else p.data
                d = next((k for k, n in enumerate(local.shape) if n % self.world == 0 and n > 0), None)
                if d is None:
                    raise ValueError(
                        f"apply_llm_zero: GroupedExperts.{name} {tuple(local.shape)} has no dim that the "
                        f"{self.world} expert-data-parallel ranks divide"
                    )
                shard = local.detach().chunk(self.world, d)[self.rank].clone()
                dt = DTensor.from_local(shard, mesh, [Shard(0), Shard(d)], run_check=False)
                setattr(m, name, nn.Parameter(dt, requires_grad=p.requires_grad))
                if zero_stage < 3:  # ZeRO-1/2: the gathered copy stays allocated between steps
                    m.gathered[name] = local.detach().requires_grad_(p.requires_grad)
                dims[name] = d
                self.entries.append((m, name, d))
            m.edp_dims = dims

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [getattr(m, name) for m, name, _ in self.entries]

    def attach(self) -> None:
        """All-gather every expert shard over ``edp`` into its module's ``gathered`` leaf (collective)."""
        with torch.no_grad():
            for m, name, d in self.entries:
                p = getattr(m, name)
                local = p.to_local()
                parts = torch.empty((self.world, *local.shape), dtype=local.dtype, device=local.device)
                dist.all_gather(list(parts.unbind(0)), local.contiguous(), group=self.group)
                whole = torch.cat(parts.unbind(0), dim=d)
                kept = m.gathered.get(name)
                if kept is None:
                    m.gathered[name] = whole.requires_grad_(p.requires_grad)
                else:
                    kept.copy_(whole)
                    kept.grad = None

    def sync(self) -> None:
        """The experts' gradients summed over ``edp`` into their shards (collective; after the step's last
        backward, once the gathered leaves hold the step's gradients)."""
        for m, name, d in self.entries:
            p, leaf = getattr(m, name), m.gathered[name]
            g, leaf.grad = leaf.grad, None
            if g is None:  # no row reached these experts on this rank: zeros, so the collectives line up
                g = torch.zeros_like(leaf)
            if self.zero == 1:  # ZeRO-1: the whole gradient summed, the shard's gradient its slice (a view)
                dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.group)
                mine = g.chunk(self.world, d)[self.rank]
            else:
                send = torch.stack(g.chunk(self.world, d)).contiguous()
                mine = send.new_empty(send.shape[1:])
                dist.reduce_scatter_tensor(mine, send.view(-1, *send.shape[2:]), group=self.group)
            p.grad = DTensor.from_local(
                mine, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
            )
            if self.zero == 3:  # ZeRO-3: the gathered copy freed between steps
                del m.gathered[name]


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
            a dim-0 shard over the data mesh after reshard (``_checked_shard``).
    """
    if not divide_by > 0:
        raise ValueError(f"all_reduce_into_shards: divide_by must be > 0, got {divide_by}")
    _Units.of(modules, "all_reduce_into_shards").all_reduce(divide_by)
