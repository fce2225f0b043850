"""Executor: one training step of a planned schedule + data flow on real ``torch.distributed`` P2P.

Per pipeline rank it walks the LLM actions of :meth:`Schedule.actions` in order; at each boundary the
:class:`EncoderAnchor` hands back the encoder actions the data flow places there (non-intrusive: the LLM
stage modules are plain ``nn.Module``s, never edited). Shapes come from the plan (:class:`StepPlan`: one
activation shape per LLM microbatch, one output shape per encoder microbatch), so sequence lengths may
differ per microbatch and nothing is inferred from data. Transfers (``isend`` / ``irecv``, header + payload,
see ``p2p``):

* LLM activations (F) and their gradients (B) between stages on the ``pp`` group;
* encoder outputs to stage 0 and their gradients back on ``encoder_p2p`` (default: the ``pp`` group with a
  disjoint tag range), so encoder traffic can never be matched with LLM activations. Stage 0 posts every
  encoder-output receive when the step starts and each encoder rank posts its gradient receives then too;
  LLM receives are posted one action ahead; sends are waited for at the end of the step.

Numerics: the step's objective is the sum of the per-microbatch losses ``loss_fn`` returns (scale inside
``loss_fn``, e.g. by 1 / microbatches). After the step LLM gradients are averaged over ``llm_dp``; encoder
gradients are summed over ``encoder_dp`` (every rank of every replica computes a slice of the encoder work)
and divided by the number of DP replicas (``size(encoder_dp) / pp``), unless the encoders use ZeRO-3.

Missing gradients, the same in every layout: after a step every parameter of this rank's stage modules and
encoders with ``requires_grad`` has a ``.grad`` tensor. One that received none this step (a layer no
microbatch reached, an encoder whose modality this rank never ran) gets zeros of its shape before any
reduction, with or without process groups (pp=1 included), so an optimizer such as AdamW treats it the
same way (zero gradient: moments decay, weight decay applies) whatever the layout. Parameters with
``requires_grad=False`` are left alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from omni_pipeline.actions import Action, ActionKind, flow_index
from omni_pipeline.anchor import EncoderAnchor
from omni_pipeline.dataflow import DataFlow
from omni_pipeline.p2p import PendingRecv, PlannedP2P
from omni_pipeline.schedules import Schedule
from omni_pipeline.trace import TimelineEvent

__all__ = ["PipelineExecutor", "PipelineGroups", "StepFunctions", "StepPlan", "StepResult", "stage_slices"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
EF, EB = ActionKind.ENCODER_FORWARD, ActionKind.ENCODER_BACKWARD


@dataclass
class PipelineGroups:
    """Process groups the executor talks on.

    Attributes:
        pp: pipeline group, group ranks in pipeline order (group rank r holds stages r, r+P, ...);
            ``None`` for pp=1.
        encoder_dp: every rank holding an encoder replica (all pp x dp ranks); ``None``: no reduction.
        llm_dp: this stage's data-parallel replicas; ``None``: no reduction.
        encoder_p2p: group for encoder outputs / gradients, same ranks and order as ``pp``; ``None``:
            use ``pp`` with a separate tag range.
    """

    pp: dist.ProcessGroup | None = None
    encoder_dp: dist.ProcessGroup | None = None
    llm_dp: dist.ProcessGroup | None = None
    encoder_p2p: dist.ProcessGroup | None = None


@dataclass
class StepPlan:
    """What one step runs, identical on every pipeline rank.

    Attributes:
        schedule: the LLM schedule.
        flow: the data flow (with ``encoder_inputs``: ``{k: [e, ...]}``).
        llm_shapes: ``{k: shape}`` of the stage-boundary activation of LLM microbatch ``k`` (from 1),
            e.g. ``(tokens_k, hidden)`` for packed sequences.
        encoder_shapes: ``{e: shape}`` of encoder microbatch ``e``'s output, e.g. ``(tokens_e, hidden)``.
        dtype: dtype of activations and encoder outputs on the wire.
    """

    schedule: Schedule
    flow: DataFlow
    llm_shapes: Mapping[int, tuple[int, ...]]
    encoder_shapes: Mapping[int, tuple[int, ...]]
    dtype: torch.dtype = torch.float32

    def check(self) -> None:
        """Raises ValueError when a microbatch or encoder microbatch has no planned shape."""
        missing = [k for k in range(1, self.schedule.num_microbatches + 1) if k not in self.llm_shapes]
        if missing:
            raise ValueError(f"StepPlan: llm_shapes lacks LLM microbatches {missing}")
        enc = [e for es in self.flow.encoder_inputs.values() for e in es if e not in self.encoder_shapes]
        if enc:
            raise ValueError(f"StepPlan: encoder_shapes lacks encoder microbatches {enc}")


@dataclass
class StepFunctions:
    """The user's model glue (plain callables; no base classes to inherit).

    Attributes:
        first_stage_input: ``(k, {e: Tensor[tokens_e, hidden]}) -> args`` for stage 0's module: builds
            stage 0's input of LLM microbatch ``k`` from its inputs (held by the closure: token ids,
            cu_seqlens, ...) and the outputs of the encoder microbatches it consumes (e.g. scattered into
            placeholder positions). A tuple is splatted, anything else passed as one argument. Parameters
            it uses must belong to stage 0's module (so they are reduced).
        loss: ``(k, last_stage_output) -> loss`` or ``(loss, {name: metric})`` on the last stage; the loss
            is a scalar tensor, metrics scalars (tensors or floats).
        encoder: ``(e, inputs_e) -> Tensor[tokens_e, hidden]``, runs on the rank the flow picks; the
            encoder modules it uses must be the anchor's.
        stage_kwargs: ``(stage, k) -> {name: value}`` extra keyword arguments for a stage's module
            (cu_seqlens, position_ids...); ``None``: none.
    """

    first_stage_input: Callable[[int, Mapping[int, torch.Tensor]], Any]
    loss: Callable[[int, torch.Tensor], Any]
    encoder: Callable[[int, Any], torch.Tensor]
    stage_kwargs: Callable[[int, int], Mapping[str, Any]] | None = None


@dataclass
class StepResult:
    """Outcome of :meth:`PipelineExecutor.step` on one rank.

    Attributes:
        losses: ``{k: loss}`` (float) for every LLM microbatch, on every pipeline rank (broadcast from the
            last stage).
        metrics: ``{k: {name: float}}`` extra per-microbatch metrics from ``loss``, on every pipeline rank.
        timeline: this rank's actions with start/end in seconds from the step's start.
        timelines: ``{pp rank: timeline}`` when ``gather_timelines=True``, else ``{this rank: timeline}``.
    """

    losses: dict[int, float]
    metrics: dict[int, dict[str, float]]
    timeline: list[TimelineEvent]
    timelines: dict[int, list[TimelineEvent]] = field(default_factory=dict)

    @property
    def loss(self) -> float:
        """Sum of the per-microbatch losses (the step's objective)."""
        return float(sum(self.losses.values()))


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class PipelineExecutor:
    """Runs planned steps on this pipeline rank.

    Args:
        stages: ``{stage index: module}`` for the stages this rank holds (``Schedule.rank_stages``).
        anchor: the encoders colocated on this rank (see :class:`EncoderAnchor`).
        functions: the user's callables.
        groups: process groups.
        device: where receive buffers live (default: the first stage's parameters' device, else CPU).

    Raises:
        ValueError: an empty ``stages`` mapping.
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        anchor: EncoderAnchor,
        functions: StepFunctions,
        groups: PipelineGroups | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        if not stages:
            raise ValueError("PipelineExecutor: this rank holds no stage modules")
        self.stages = dict(stages)
        self.anchor = anchor
        self.fn = functions
        self.groups = groups or PipelineGroups()
        self.pp_size = _size(self.groups.pp)
        self.pp_rank = 0 if self.groups.pp is None else dist.get_rank(self.groups.pp)
        if device is None:
            p = next((p for m in self.stages.values() for p in m.parameters()), None)
            device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(device)

    # -- tags: every transfer of a step gets its own -------------------------------------------------------
    def _llm_tag(self, plan: StepPlan, kind: ActionKind, stage: int, mb: int) -> int:
        return 2 * (stage * plan.schedule.num_microbatches + mb) + (0 if kind == F else 1)

    def _enc_tag(self, plan: StepPlan, e: int, grad: bool) -> int:
        base = (
            0
            if self.groups.encoder_p2p is not None
            else 2 * plan.schedule.num_stages * plan.schedule.num_microbatches
        )
        return base + 2 * e + int(grad)

    def parameters(self) -> list[nn.Parameter]:
        """LLM stage parameters on this rank, each once (a module shared by two stages counts once; the
        anchor holds the encoders')."""
        return list({id(p): p for m in self.stages.values() for p in m.parameters()}.values())

    def step(
        self,
        plan: StepPlan,
        encoder_inputs: Mapping[int, Any],
        *,
        gather_timelines: bool = False,
    ) -> StepResult:
        """Run forward and backward of every microbatch of ``plan`` and reduce gradients.

        Gradients accumulate into ``.grad`` (zero them before the step, step the optimizer after). On
        return every parameter of this rank's stage modules and encoders that requires grad has a
        ``.grad`` tensor: zeros where it received no gradient, in every layout (see the module docstring).

        Args:
            plan: the step plan (identical on all pipeline ranks).
            encoder_inputs: ``{e: inputs}`` for the encoder microbatches the flow places on this rank
                only (zero redundancy: other ranks never see the payload).
            gather_timelines: also collect every pipeline rank's timeline into ``StepResult.timelines``.

        Raises:
            ValueError: the plan's schedule is for another pp size, this rank misses a stage module, or
                ``encoder_inputs`` lacks an encoder microbatch the flow places here.
            P2PError: a produced or received tensor's shape differs from the plan (names rank, action,
                shapes).
        """
        sched, flow = plan.schedule, plan.flow
        if sched.num_ranks != self.pp_size:
            raise ValueError(
                f"rank {self.pp_rank}: schedule has {sched.num_ranks} ranks but the pp group has {self.pp_size}"
            )
        mine = sched.rank_stages(self.pp_rank)
        if sorted(self.stages) != mine:
            raise ValueError(
                f"rank {self.pp_rank}: schedule expects stages {mine}, executor holds {sorted(self.stages)}"
            )
        plan.check()
        self.anchor.register(self.pp_rank, flow, sched)
        placed_here = [a.microbatch for a in self.anchor.placed() if a.kind == EF]
        lacking = [e for e in placed_here if e not in encoder_inputs]
        if lacking:
            raise ValueError(
                f"rank {self.pp_rank}: the data flow runs encoder microbatches {lacking} here but encoder_inputs lacks them"
            )

        llm = PlannedP2P(self.groups.pp, self.pp_rank, self.device)
        enc_group = self.groups.encoder_p2p if self.groups.encoder_p2p is not None else self.groups.pp
        enc = PlannedP2P(enc_group, self.pp_rank, self.device)
        consumer = flow.encoder_consumer  # e -> torch mb index
        consumes: dict[int, list[int]] = {k - 1: list(es) for k, es in flow.encoder_inputs.items()}
        enc_rank = {e: flow.encoder_rank(e) for e in consumer}
        last = sched.num_stages - 1
        t0 = time.perf_counter()
        timeline: list[TimelineEvent] = []

        # Receives known at step start: encoder outputs on stage 0, encoder gradients on encoder ranks.
        enc_out_recv: dict[int, PendingRecv] = {}
        enc_grad_recv: dict[int, PendingRecv] = {}
        if self.pp_rank == 0:
            for e in sorted(consumer, key=lambda e: e):
                if enc_rank[e] != 0:
                    enc_out_recv[e] = enc.post_recv(
                        enc_rank[e],
                        self._enc_tag(plan, e, False),
                        f"receive of EF{e} output",
                        tuple(plan.encoder_shapes[e]),
                        plan.dtype,
                    )
        if self.pp_rank != 0:
            for e in placed_here:
                enc_grad_recv[e] = enc.post_recv(
                    0,
                    self._enc_tag(plan, e, True),
                    f"receive of EB{e} gradient",
                    tuple(plan.encoder_shapes[e]),
                    plan.dtype,
                )

        enc_leaf: dict[int, torch.Tensor] = {}  # stage 0: encoder outputs as autograd leaves
        local_grad: dict[int, torch.Tensor] = {}  # stage 0 rank: gradients of encoder mbs it ran itself
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        local_act: dict[tuple[int, int], torch.Tensor] = {}  # pp=1 hand-offs between stages
        local_gradin: dict[tuple[int, int], torch.Tensor] = {}
        losses: dict[int, float] = {}
        metrics: dict[int, dict[str, float]] = {}
        actions = sched.actions(self.pp_rank)
        recvs: dict[int, PendingRecv] = {}

        def post(j: int) -> None:
            if j >= len(actions) or j in recvs:
                return
            a = actions[j]
            if a.kind == F and a.stage > 0:
                src = sched.stage_to_rank(a.stage - 1)
                if src != self.pp_rank:
                    recvs[j] = llm.post_recv(
                        src,
                        self._llm_tag(plan, F, a.stage - 1, a.microbatch),
                        f"{a} input",
                        tuple(plan.llm_shapes[flow_index(a.microbatch)]),
                        plan.dtype,
                    )
            elif a.kind == B and a.stage < last:
                src = sched.stage_to_rank(a.stage + 1)
                if src != self.pp_rank:
                    recvs[j] = llm.post_recv(
                        src,
                        self._llm_tag(plan, B, a.stage + 1, a.microbatch),
                        f"{a} output gradient",
                        tuple(plan.llm_shapes[flow_index(a.microbatch)]),
                        plan.dtype,
                    )

        def record(a: Action, start: float) -> None:
            timeline.append(
                TimelineEvent(self.pp_rank, str(a), a.kind.value, start - t0, time.perf_counter() - t0)
            )

        def run_encoder(a: Action) -> None:
            e = a.microbatch
            if a.kind == EF:
                start = time.perf_counter()
                out = self.anchor.forward(e, self.fn.encoder, encoder_inputs[e])
                if self.pp_rank == 0:
                    if tuple(out.shape) != tuple(plan.encoder_shapes[e]):
                        raise ValueError(
                            f"rank 0, {a}: produced shape {tuple(out.shape)} but the plan says {tuple(plan.encoder_shapes[e])}"
                        )
                    enc_leaf[e] = out.detach().requires_grad_(out.requires_grad)
                else:
                    enc.send(
                        out,
                        0,
                        self._enc_tag(plan, e, False),
                        f"{a} output to stage 0",
                        tuple(plan.encoder_shapes[e]),
                    )
                record(a, start)
            else:
                grad = local_grad.pop(e) if self.pp_rank == 0 else enc.wait(enc_grad_recv.pop(e))
                start = time.perf_counter()
                self.anchor.backward(e, grad)
                record(a, start)

        def kwargs(stage: int, mb: int) -> Mapping[str, Any]:
            return self.fn.stage_kwargs(stage, flow_index(mb)) if self.fn.stage_kwargs else {}

        for j, a in enumerate(actions):
            for ea in self.anchor.at(a):
                run_encoder(ea)
            post(j)
            post(j + 1)
            s, mb, k = a.stage, a.microbatch, flow_index(a.microbatch)
            module = self.stages[s]
            if a.kind == F:
                if s == 0:
                    outs = {}
                    for e in consumes.get(mb, ()):
                        if e not in enc_leaf:
                            enc_leaf[e] = enc.wait(enc_out_recv.pop(e)).requires_grad_(True)
                        outs[e] = enc_leaf[e]
                    start = time.perf_counter()
                    args = self.fn.first_stage_input(k, outs)
                    x_in = None
                    y = (
                        module(*args, **kwargs(s, mb))
                        if isinstance(args, tuple)
                        else module(args, **kwargs(s, mb))
                    )
                else:
                    x = local_act.pop((s, mb)) if j not in recvs else llm.wait(recvs.pop(j))
                    start = time.perf_counter()
                    x_in = x.detach().requires_grad_(True)
                    y = module(x_in, **kwargs(s, mb))
                if s == last:
                    got = self.fn.loss(k, y)
                    loss, extra = got if isinstance(got, tuple) else (got, {})
                    losses[k] = float(loss.detach())
                    metrics[k] = {
                        n: float(v.detach() if isinstance(v, torch.Tensor) else v) for n, v in extra.items()
                    }
                    saved[(s, mb)] = (x_in, loss)
                else:
                    saved[(s, mb)] = (x_in, y)
                    dst = sched.stage_to_rank(s + 1)
                    if dst == self.pp_rank:
                        if tuple(y.shape) != tuple(plan.llm_shapes[k]):
                            raise ValueError(
                                f"rank {self.pp_rank}, {a}: produced shape {tuple(y.shape)} but the plan says {tuple(plan.llm_shapes[k])}"
                            )
                        local_act[(s + 1, mb)] = y.detach()
                    else:
                        llm.send(
                            y,
                            dst,
                            self._llm_tag(plan, F, s, mb),
                            f"{a} output to stage {s + 1}",
                            tuple(plan.llm_shapes[k]),
                        )
                record(a, start)
            else:
                x_in, y = saved.pop((s, mb))
                if s == last:
                    start = time.perf_counter()
                    torch.autograd.backward(y)
                else:
                    g = local_gradin.pop((s, mb)) if j not in recvs else llm.wait(recvs.pop(j))
                    start = time.perf_counter()
                    torch.autograd.backward(y, g)
                if s > 0:
                    g_in = x_in.grad if x_in.grad is not None else torch.zeros_like(x_in)
                    dst = sched.stage_to_rank(s - 1)
                    if dst == self.pp_rank:
                        local_gradin[(s - 1, mb)] = g_in
                    else:
                        llm.send(
                            g_in,
                            dst,
                            self._llm_tag(plan, B, s, mb),
                            f"{a} input gradient to stage {s - 1}",
                            tuple(plan.llm_shapes[k]),
                        )
                else:
                    for e in consumes.get(mb, ()):
                        leaf = enc_leaf.pop(e)
                        g_e = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                        if enc_rank[e] == 0:
                            local_grad[e] = g_e
                        else:
                            enc.send(
                                g_e,
                                enc_rank[e],
                                self._enc_tag(plan, e, True),
                                f"EB{e} gradient from {a}",
                                tuple(plan.encoder_shapes[e]),
                            )
                record(a, start)
        for ea in self.anchor.at(None):
            run_encoder(ea)
        llm.wait_sends()
        enc.wait_sends()
        self._reduce_gradients()
        losses, metrics = self._share_losses(sched, losses, metrics)
        timelines = {self.pp_rank: timeline}
        if gather_timelines and self.groups.pp is not None:
            gathered: list[Any] = [None] * self.pp_size
            dist.all_gather_object(gathered, timeline, group=self.groups.pp)
            timelines = dict(enumerate(gathered))
        return StepResult(losses=losses, metrics=metrics, timeline=timeline, timelines=timelines)

    def _fill_missing_gradients(self) -> None:
        """Zeros for every trainable parameter without ``.grad`` (stage modules and encoders), so the
        optimizer sees the same parameters in every layout, with or without groups to reduce over."""
        params = {id(p): p for p in [*self.parameters(), *self.anchor.parameters()]}
        for p in params.values():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def _reduce_gradients(self) -> None:
        """LLM: average over ``llm_dp``. Encoders: sum over ``encoder_dp``, divide by the DP replicas."""
        self._fill_missing_gradients()
        llm_dp = _size(self.groups.llm_dp)
        if llm_dp > 1:
            for p in self.parameters():
                if p.grad is None:  # requires_grad=False: nothing to average
                    continue
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.groups.llm_dp)
                p.grad.div_(llm_dp)
        if self.groups.encoder_dp is not None and self.anchor.parallel.zero_stage < 3:
            replicas = max(1, _size(self.groups.encoder_dp) // self.pp_size)
            for p in {id(p): p for p in self.anchor.parameters()}.values():
                if p.grad is None:  # requires_grad=False
                    continue
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.groups.encoder_dp)
                if replicas > 1:
                    p.grad.div_(replicas)

    def _share_losses(self, sched: Schedule, losses, metrics):
        if self.groups.pp is None or self.pp_size == 1:
            return losses, metrics
        src = dist.get_global_rank(self.groups.pp, sched.stage_to_rank(sched.num_stages - 1))
        box: list[Any] = [(losses, metrics)]
        dist.broadcast_object_list(box, src=src, group=self.groups.pp)
        return box[0]


def stage_slices(num_layers: int, num_stages: int) -> Sequence[range]:
    """Layer ranges per stage, as even as possible (first stages get the remainder).

    Raises:
        ValueError: ``num_stages < 1``, or fewer layers than stages (a stage would hold no layer).
    """
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(
            f"stage_slices: {num_layers} layers cannot fill {num_stages} stages (need 1 <= stages <= layers)"
        )
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out
