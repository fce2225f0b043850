"""Encoder ZeRO-2/3 over FSDP2 on a step-scoped schedule that every rank follows (§ decoupled parallelism).

Encoder data parallelism spans every rank, so the encoders' FSDP2 mesh is the whole world, while the
encoder work of a step is spread unevenly over the pipeline schedule: a rank may run fewer encoder
forwards than another, or none, and runs them at other points of the schedule. FSDP2's own hooks issue an
all-gather before each unit's forward (and backward) and a reduce-scatter after its backward, collectives
over the world at schedule points that differ per rank: a rank that encodes waits in the all-gather for a
rank that never enters it (the multimodal "text-only rank" hang, DeepSpeed #7170 class). FSDP2's
reduce-scatter also *averages* over its mesh, while this repo's objective is a plain sum of what the ranks
compute (:mod:`omni_pipeline.loss`, :func:`omni_parallel.apply_encoder_zero`): on 2 ranks every encoder
gradient came out exactly 0.5x.

The schedule here moves every encoder collective of a step to two points that every rank reaches in the
same order whatever its encoder work:

1. :func:`gather_parameters` before the step's first encoder forward: every sharded unit (each
   ``fully_shard``-ed module, in module order) all-gathers its parameters once (``FSDPModule.unshard``);
   FSDP2's per-forward/backward resharding and its gradient reduction are switched off
   (``set_reshard_after_forward(False)``, ``set_reshard_after_backward(False)``,
   ``set_requires_gradient_sync(False)``), so forwards and backwards issue no collective at all and
   gradients accumulate on the gathered parameters;
2. :func:`reduce_scatter_gradients` after the step's last encoder backward (per tower: after that
   tower's last backward on this rank, below): the gathered gradients (zeros for parameters a rank never
   used) are summed with ``reduce_scatter_tensor(op=SUM)`` in buckets, divided by an explicit
   ``divide_by`` (never FSDP2's mean), every unit is resharded (``FSDPModule.reshard``), and each sharded
   parameter gets its gradient as a ``DTensor`` with the parameter's own placements, so the optimizer
   state stays sharded too (AdamW's moments are DTensors like the parameters).

Stages, as in ZeRO (Rajbhandari et al., 2020): both shard gradients and optimizer states; stage 3 also
shards parameters at rest (the gathered copy exists only inside a step), stage 2 keeps the gathered copy's
storage between steps (``set_keep_unsharded_storage(True)``; FSDP2's ``reshard_after_forward=False``) and
refreshes it with the same one all-gather per step after the update. Inside a step both hold the gathered
parameters from the first encoder forward to the last backward: resharding between an encoder forward and
its backward would need a per-action all-gather at schedule points that differ per rank, which is exactly
what hangs. Communication per step: one all-gather of the parameters and one reduce-scatter of the
gradients, as FSDP2's ZeRO-2.

Overlap (:class:`TowerSync`, :func:`omni_parallel.apply_encoder_zero`'s sync at ZeRO 0 and 2/3 alike):
the reduction is split per tower, and each tower's collectives are issued with ``async_op=True`` as
soon as that tower's last backward of the step on this rank has run (the trainer learns it from the
executor's ``encoder_backwards_left`` hook and the towers each encoder microbatch runs here; a rank with
no work for a tower has it done when the step starts), so they run under the backward actions that
follow (the LLM's, the other towers'); the sync after the step's last backward issues what is left and
waits for it all. Tower ``t``'s last backward falls at different points on different ranks, so the issue
*order* is fixed instead: the step's towers in name order (at ZeRO 0 those that ran on some rank, then
the parameters shared by towers), a tower never issued before the ones ahead of it (a tower done early
waits for them; that is the only cost), each tower's buckets in parameter order. Every rank therefore
issues the same collectives, of the same sizes, in the same order. They run on a process group of their
own (``apply_encoder_zero`` creates it), which no other collective uses, so their interleaving with the
collectives of other groups (the LLM's ZeRO collectives on its data group, pipeline P2P, the numerics
guard's all-reduce on the world) may differ per rank: each group progresses on its own (gloo: its own
connections and threads; NCCL: its own communicator and stream, as FSDP2's reduce-scatter beside
pipeline P2P in torchtitan and Megatron-LM's overlapped gradient reduction rely on). No rank waits for an
encoder collective before the sync, where it first issues all that is left: the pipeline reaches the sync
on every rank as without the overlap, and then every rank has issued the whole order, so every wait
returns. A backward that reached a tower after its collectives were issued would be lost (ZeRO 2/3: the
gradient was copied into the send buffer) or race them (ZeRO 0: an all-reduce in place): it raises
instead (a post-accumulate-grad hook per parameter, :class:`TowerSync`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

__all__ = [
    "PendingReduction",
    "TowerSync",
    "configure_step_schedule",
    "gather_parameters",
    "is_sharded",
    "reduce_scatter_gradients",
    "reduce_scatter_rows",
    "shard_rows",
    "sharded_units",
]

_BUCKET_BYTES = 25 * 2**20


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``(first row, row count)`` of rank ``rank``'s FSDP2 ``Shard(0)`` chunk of a dim 0 of ``rows``
    over ``world`` ranks: ``torch.chunk``'s split, chunks of ``ceil(rows / world)`` rows, the trailing
    ones short or empty (count 0)."""
    chunk = -(-rows // world)
    start = min(rows, rank * chunk)
    return start, max(0, min(chunk, rows - rank * chunk))


def sharded_units(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Every FSDP2 unit (a module ``fully_shard`` was applied to) inside ``modules``, in module order, each
    once: the order every rank gathers and reshards them in."""
    from torch.distributed.fsdp import FSDPModule

    seen: dict[int, nn.Module] = {}
    for root in modules:
        for m in root.modules():
            if isinstance(m, FSDPModule) and id(m) not in seen:
                seen[id(m)] = m
    return list(seen.values())


def is_sharded(modules: Iterable[nn.Module]) -> bool:
    """Whether any module inside ``modules`` is an FSDP2 unit."""
    return bool(sharded_units(modules))


def configure_step_schedule(modules: Iterable[nn.Module], *, keep_gathered: bool) -> None:
    """Put every FSDP2 unit inside ``modules`` on the step-scoped schedule (no collective in forward or
    backward; see the module docstring). ``keep_gathered``: ZeRO-2, the gathered storage stays allocated
    between steps; ``False``: ZeRO-3, it is freed at reshard. Local: no communication."""
    for unit in sharded_units(modules):
        unit.set_reshard_after_forward(False, recurse=False)
        unit.set_reshard_after_backward(False, recurse=False)
        unit.set_requires_gradient_sync(False, recurse=False)
        unit.set_keep_unsharded_storage(keep_gathered, recurse=False)


def gather_parameters(modules: Iterable[nn.Module]) -> None:
    """All-gather every FSDP2 unit's parameters once (collective over each unit's mesh: call it on every
    rank, before the step's first encoder forward, whether or not the rank encodes anything this step).
    Afterwards the modules hold their whole parameters and run forward and backward without collectives.
    No-op for modules without FSDP2 units."""
    units = sharded_units(modules)
    for unit in units:
        # Idempotent; also covers units sharded without configure_step_schedule (their own hooks would
        # otherwise reshard after forward and reduce after backward, at per-rank schedule points).
        unit.set_reshard_after_forward(False, recurse=False)
        unit.set_reshard_after_backward(False, recurse=False)
        unit.set_requires_gradient_sync(False, recurse=False)
    for unit in units:
        unit.unshard()


def _named(modules: Iterable[nn.Module]) -> Iterator[tuple[int, str, nn.Parameter]]:
    seen: set[tuple[int, str]] = set()
    for i, root in enumerate(modules):
        for name, p in root.named_parameters():
            key = (i, name)
            if key not in seen and p.requires_grad:
                seen.add(key)
                yield i, name, p


def checked_units(
    modules: Iterable[nn.Module], divide_by: float, who: str
) -> tuple[list[nn.Module], list[nn.Module]]:
    """``(modules, their FSDP2 units)`` for a gradient sync named ``who``.

    Raises:
        ValueError: ``divide_by <= 0``, or the modules hold no FSDP2 unit.
    """
    if not divide_by > 0:
        raise ValueError(f"{who}: divide_by must be > 0, got {divide_by}")
    modules = list(modules)
    units = sharded_units(modules)
    if not units:
        raise ValueError(f"{who}: the modules hold no FSDP2 unit (fully_shard them first)")
    return modules, units


def reduce_scatter_gradients(
    modules: Iterable[nn.Module],
    *,
    divide_by: float = 1.0,
    bucket_bytes: int = _BUCKET_BYTES,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> PendingReduction | None:
    """Sum the step's gradients over each unit's mesh into sharded ``DTensor`` gradients, divide by
    ``divide_by``, and reshard every unit (collective: every rank calls it after the step's last encoder
    backward through ``modules``, in the same order as :func:`gather_parameters`).

    Parameters of ``modules`` that are not FSDP2-sharded (a module left out of ``fully_shard``) are
    all-reduced (sum) over the first sharded parameter's mesh group instead, so every parameter ends with
    the summed gradient in its own layout.

    Args:
        modules: the modules given to :func:`gather_parameters`, gathered (or some of them: one tower).
        divide_by: divisor after the sum (e.g. the TP size, whose ranks run the same encoder work); 1: sum.
        bucket_bytes: upper bound of one reduce-scatter buffer (a larger gradient gets a bucket of its own).
        group: the process group the collectives run on: the units' mesh ranks in the mesh's order (a
            communicator of their own, e.g. :class:`TowerSync`'s); ``None``: the mesh's own group.
        async_op: issue the collectives and return the :class:`PendingReduction` that waits for them and
            sets the ``.grad`` s (the gradients are copied into the send buffers and the units resharded
            before it returns); ``False``: done on return, ``None`` returned.

    Raises:
        ValueError: ``divide_by <= 0``, or the modules hold no FSDP2 unit.
    """
    modules, units = checked_units(modules, divide_by, "reduce_scatter_gradients")
    # Gathered gradients (None: unused on this rank this step, i.e. zeros) keyed by parameter name: the
    # gathered and the sharded parameters are registered under the same names.
    grads: dict[tuple[int, str], torch.Tensor | None] = {}
    for i, name, p in _named(modules):
        grads[(i, name)] = p.grad
        p.grad = None
    for unit in reversed(units):
        unit.reshard()
    sharded: list[tuple[nn.Parameter, torch.Tensor | None]] = []
    plain: list[tuple[nn.Parameter, torch.Tensor | None]] = []
    for i, name, p in _named(modules):
        (sharded if isinstance(p, DTensor) else plain).append((p, grads[(i, name)]))
    if not sharded:
        raise ValueError("reduce_scatter_gradients: no parameter is sharded after reshard")
    if group is None:
        group = sharded[0][0].device_mesh.get_group()
    pending = [_reduce_scatter_bucket(b, group, divide_by, async_op) for b in _buckets(sharded, bucket_bytes)]
    works, sums = [], []
    for p, g in plain:
        full = g.detach().clone() if g is not None else torch.zeros_like(p)
        works.append(dist.all_reduce(full, group=group, async_op=async_op))
        sums.append((p, full))

    def finish() -> None:
        for part in pending:
            if part is not None:
                part.then()
        for p, full in sums:
            p.grad = full.div_(divide_by) if divide_by != 1 else full

    if not async_op:
        finish()
        return None
    return PendingReduction(
        tuple(w for part in pending if part is not None for w in part.works) + tuple(works), finish
    )


def _buckets(
    items: list[tuple[nn.Parameter, torch.Tensor | None]], bucket_bytes: int
) -> list[list[tuple[nn.Parameter, torch.Tensor | None]]]:
    # Parameter order, the same on every rank, so the buffers line up element for element.
    out: list[list[tuple[nn.Parameter, torch.Tensor | None]]] = []
    size = 0
    for item in items:
        p = item[0]
        key = (p.device, p.dtype)
        nbytes = p.numel() * p.element_size()
        if out and (size + nbytes > bucket_bytes or (out[-1][0][0].device, out[-1][0][0].dtype) != key):
            out.append([])
            size = 0
        if not out:
            out.append([])
        out[-1].append(item)
        size += nbytes
    return out


def _reduce_scatter_bucket(
    bucket: list[tuple[nn.Parameter, torch.Tensor | None]],
    group: dist.ProcessGroup,
    divide_by: float,
    async_op: bool = False,
) -> PendingReduction | None:
    """One SUM reduce-scatter for a bucket of dim-0-sharded parameters (:func:`reduce_scatter_rows`)."""
    for p, _ in bucket:
        if len(p.placements) != 1 or p.placements[0] != Shard(0):
            raise ValueError(f"reduce_scatter_gradients: placements {p.placements} are not FSDP2's Shard(0)")
    items = [(p, p.shape, g, "the parameter") for p, g in bucket]
    return reduce_scatter_rows(items, group, divide_by, async_op=async_op)


def reduce_scatter_rows(
    items: list[tuple[DTensor, torch.Size, torch.Tensor | None, str]],
    group: dist.ProcessGroup,
    divide_by: float,
    *,
    async_op: bool = False,
) -> PendingReduction | None:
    """One SUM reduce-scatter of whole gradients into FSDP2 dim-0 shards, for the encoders' and the LLM's
    ZeRO-2/3 syncs.

    Each item is ``(sharded parameter, gathered shape [rows, ...], gathered gradient or None, name)``: the
    gathered shape is what FSDP2 shards along dim 0 (the TP-local tensor under TP). FSDP2 shards dim 0 as
    ``torch.chunk`` does (chunks of ``ceil(rows / W)`` rows, trailing ones short or empty), so each gradient
    is padded to ``W`` equal chunks and chunk ``r`` of every gradient goes to rank ``r`` of ``group``; a
    missing gradient counts as zeros. Each parameter's ``.grad`` becomes a DTensor of its rows with its
    own mesh and placements, divided by ``divide_by``.

    ``async_op=True`` (the LLM's per-block reduce-scatter issued during the last backward,
    :mod:`omni_parallel.llm_zero`): the gradients are copied into the send buffer and the collective
    issued, and the :class:`PendingReduction` returned waits for it and sets the ``.grad`` s (call its
    ``wait`` on every rank, before the gradients are read). Otherwise it returns ``None`` with the
    ``.grad`` s set.

    Raises:
        ValueError: a rank's rows differ from its parameter's local shard (naming the rank and ``name``).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    blocks, widths = [], []
    for p, shape, g, _ in items:
        chunk = -(-shape[0] // world)
        full = torch.zeros((chunk * world, *shape[1:]), dtype=p.dtype, device=p.to_local().device)
        if g is not None:
            full[: shape[0]] = g
        blocks.append(full.view(world, -1))
        widths.append(full[0:chunk].numel())
    send = torch.cat(blocks, dim=1).contiguous()
    out = send.new_empty(send.shape[1])
    work = dist.reduce_scatter_tensor(
        out, send.view(-1), op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )
    items = [(p, shape, None, name) for p, shape, _, name in items]  # the gradients: copied, not held

    def finish(send: torch.Tensor = send) -> None:  # holds the send buffer until the collective is done
        _set_shards(items, out, widths, world, rank, divide_by)

    if async_op:
        return PendingReduction((work,), finish)
    finish()
    return None


@dataclass(frozen=True)
class PendingReduction:
    """A gradient collective issued with ``async_op=True``: ``works`` (``torch.distributed`` work handles)
    and ``then``, what puts the result in place once they are done (the shards' ``.grad`` s).

    ``done()``: whether every work has completed (no wait). ``wait()``: wait for them, then ``then()``;
    call it once, on every rank of the group, before the gradients are read."""

    works: tuple[Any, ...]
    then: Callable[[], None]

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.then()


def _set_shards(
    items: list[tuple[DTensor, torch.Size, torch.Tensor | None, str]],
    out: torch.Tensor,
    widths: list[int],
    world: int,
    rank: int,
    divide_by: float,
) -> None:
    """:func:`reduce_scatter_rows`' second half: each parameter's rows of the reduced ``out``."""
    if divide_by != 1:
        out.div_(divide_by)
    for (p, shape, _, name), part in zip(items, out.split(widths), strict=True):
        chunk = -(-shape[0] // world)
        local = part.view(chunk, *shape[1:])[: shard_rows(shape[0], world, rank)[1]].clone()
        if tuple(local.shape) != tuple(p.to_local().shape):
            raise ValueError(
                f"reduce_scatter_gradients: rank {rank} shard {tuple(local.shape)} differs from "
                f"{name}'s local shard {tuple(p.to_local().shape)}"
            )
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
        )


class TowerSync:
    """The encoders' gradient sync with each tower's collectives issued (``async_op=True``) as soon as the
    tower's last backward of the step on this rank has run (module docstring: Overlap).

    ``towers``: ``{name: issue}``, ``issue()`` issuing the tower's collectives async on ``group`` and
    returning their :class:`PendingReduction` (``None``: nothing to sum); ``params(name)``: the tower's
    parameters that a backward accumulates into *now* (read just before the issue: under ZeRO 2/3 the
    gathered ones); ``skip_idle``: a tower that ran on no rank in the step is not reduced (ZeRO 0: its
    gradients are zeros everywhere); ``tail``: ``{name: issue}`` reduced after every tower, once all of
    them are done on this rank (ZeRO 0: parameters shared by towers or in none).

    Per step, on every rank: :meth:`ready` (any number of times, from the step's start to its sync) with
    the towers whose last backward of the step on this rank has run; :meth:`__call__` at the sync. The
    issue order is fixed for the step and the same on every rank: the towers reduced in the step (every
    tower; with ``skip_idle`` those in ``ran``) in name order, then ``tail``; a tower is never issued
    before the ones ahead of it, so each rank issues the same collectives in the same order on ``group``
    whatever its encoder work and its timing (a tower ready early waits for the ones ahead of it). The
    sync issues what is left, in the same order, then waits for them all in that order.

    A gradient accumulated into a tower's parameters after its collectives were issued would be lost (or,
    all-reduced in place, race the collective): a post-accumulate-grad hook on each of them raises
    ``RuntimeError`` naming the tower until the sync.
    """

    def __init__(
        self,
        towers: dict[str, Callable[[], PendingReduction | None]],
        params: Callable[[str], Iterable[torch.Tensor]],
        *,
        skip_idle: bool,
        tail: dict[str, Callable[[], PendingReduction | None]] | None = None,
    ) -> None:
        self.towers, self.params, self.skip_idle = dict(towers), params, skip_idle
        self.tail = dict(tail or {})
        self.reset()

    def reset(self) -> None:
        """Forget the step (local): its order, what was issued, the guard hooks."""
        for h in getattr(self, "handles", ()):
            h.remove()
        self.handles: list[Any] = []
        self.ran: frozenset[str] | None = None
        self.order: list[str] | None = None  # this step's issue order, fixed by its first ready / sync
        self.done: set[str] = set()  # towers whose last backward on this rank has run
        self.issued = 0  # order[:issued] are issued
        self.pending: list[PendingReduction | None] = []

    def _order(self, ran: Collection[str] | None) -> list[str]:
        ran = None if ran is None else frozenset(ran)
        if self.order is None:
            self.ran = ran
            names = sorted(n for n in self.towers if not self.skip_idle or ran is None or n in ran)
            self.order = [*names, *self.tail]
        elif ran != self.ran:
            raise ValueError(
                f"TowerSync: the towers that ran in the step changed within it: {self.ran} then {ran}"
            )
        return self.order

    def ready(self, done: Collection[str], ran: Collection[str] | None = None) -> None:
        """The towers ``done`` have had their last backward of the step on this rank (no backward of the
        step will reach them here again); ``ran``: the towers that ran on any rank in the step (``None``:
        all), the same on every rank and at the sync. Issues, in the step's order, every tower ready from
        the first not issued on (local: the collectives are async).

        Raises:
            ValueError: ``done`` names no tower; ``ran`` differs from the step's earlier calls.
        """
        unknown = sorted(set(done) - set(self.towers))
        if unknown:
            raise ValueError(f"TowerSync.ready: {unknown} are not towers ({sorted(self.towers)})")
        order = self._order(ran)
        self.done |= set(done)
        every = self.done >= set(self.towers)
        while self.issued < len(order) and (order[self.issued] in self.done or every):
            self._issue(order[self.issued])

    def _issue(self, name: str, *, guard: bool = True) -> None:
        # the send buffers of collectives already done are let go now (their results set), not at the sync
        while self.pending and (self.pending[0] is None or self.pending[0].done()):
            part = self.pending.pop(0)
            if part is not None:
                part.wait()
        self.issued += 1
        if guard and name in self.towers:
            for p in self.params(name):
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(_late(name)))
        issue = self.towers[name] if name in self.towers else self.tail[name]
        self.pending.append(issue())

    def __call__(self, ran: Collection[str] | None = None) -> None:
        """The sync (collective over the group, every rank, after the step's last backward): issue the rest
        of the step's order, wait for every collective in order, forget the step."""
        order = self._order(ran)
        while self.issued < len(order):  # no backward is left: no guard
            self._issue(order[self.issued], guard=False)
        for part in self.pending:
            if part is not None:
                part.wait()
        self.reset()


def _late(name: str) -> Callable[[torch.Tensor], None]:
    def hook(_p: torch.Tensor) -> None:
        raise RuntimeError(
            f"encoder tower {name!r}: a backward accumulated a gradient into it after its reduction was "
            "issued on this rank (TowerSync.ready was told its last backward of the step had run)"
        )

    return hook
