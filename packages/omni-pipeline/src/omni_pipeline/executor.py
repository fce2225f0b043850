"""Executor: one training step of a planned schedule + data flow on real ``torch.distributed`` P2P.

Per pipeline rank a small interpreter (``_StepRun``, one object per step holding the in-flight state)
walks the LLM actions of :meth:`Schedule.actions` in order; at each boundary the :class:`EncoderAnchor`
hands back the encoder actions the data flow places there (non-intrusive: the LLM stage modules are plain
``nn.Module``s, never edited). Each action kind has one method: LLM forward, LLM backward, encoder
forward, encoder backward, plus the posting of receives. Shapes come from the plan (:class:`StepPlan`: one
activation shape per LLM microbatch, one output shape per encoder microbatch), so sequence lengths may
differ per microbatch and nothing is inferred from data. Transfers (``isend`` / ``irecv``, header + payload,
see ``p2p``; which group and tag each one uses is decided in one place, ``_Wires``):

* LLM activations (F) and their gradients (B) between stages on the ``pp`` group;
* encoder outputs to stage 0 and their gradients back on ``encoder_p2p``, a group of its own, so encoder
  traffic can never be matched with LLM activations even on a backend that ignores tags (NCCL). Without
  ``encoder_p2p`` they share ``pp`` on a disjoint tag range, which only a tag-honouring backend (gloo)
  keeps apart. Stage 0 posts every encoder-output receive when the step starts and each encoder rank
  posts its gradient receives then too; LLM receives are posted one action ahead, before the encoder
  actions at that boundary run; sends are waited for at the end of the step. On each group, the messages
  between two ranks are sent and received in the same order, which is all a tag-blind backend needs.

Timing (one clock, ``time.perf_counter``, from the step's start): each action's compute is the
timeline's event; the time it blocked on receives before its compute started is ``StepResult.waits``
and one :class:`~omni_pipeline.records.P2PRecord` per receive, so a trainer can write per-action records
(:mod:`omni_pipeline.records`) without timing anything twice.

Microbatch numbering (see :mod:`omni_pipeline.actions`): inside the interpreter every LLM microbatch is
torch's 0-based index ``mb``; the public API (:class:`StepPlan`, :class:`StepFunctions`,
:class:`StepResult`) numbers them as the :class:`DataFlow` does, ``k = mb + 1``, and the conversion happens
only where the interpreter meets that API.

Numerics: one objective (:mod:`omni_pipeline.loss`): the step's loss is the plain sum of what ``loss_fn``
returns, over the microbatches and over every rank (normalise inside ``loss_fn``, e.g. by the step's
target tokens on every DP replica, as :func:`omni_pipeline.loss.microbatch_loss` does). Gradient reduction
therefore sums: the default hook (:meth:`PipelineExecutor.reduce_over_groups`) sums LLM gradients over
``llm_dp`` and encoder gradients over ``encoder_dp`` (every rank of every replica computes a slice of the
encoder work), one flattened all-reduce per bucket (:func:`omni_parallel.data_parallel.all_reduce_gradients`).
``reduce_gradients`` runs once after the last backward; a caller with other groups to reduce over (TP
peers that duplicate encoder work, hybrid DP/CP) passes its own hook, which sums the same way.

Encoder ZeRO-2/3 (``EncoderParallelConfig.zero_stage``, FSDP2-sharded encoders): every rank gathers the
encoder parameters when the step starts (:meth:`EncoderAnchor.gather`), so no encoder forward or backward
issues a collective, and the gradient reduction sums them into sharded gradients and reshards
(:meth:`EncoderAnchor.reduce_gradients`; a plain sum, never FSDP2's mean over its mesh). Every rank reaches both points whatever encoder work the flow gives it (none
included): see :mod:`omni_parallel.encoder_zero`. A custom ``reduce_gradients`` hook must call
``anchor.reduce_gradients``; the executor checks that the encoders were resharded.

Missing gradients, the same in every layout: after a step every parameter of this rank's stage modules and
encoders with ``requires_grad`` has a ``.grad`` tensor. One that received none this step (a layer no
microbatch reached, an encoder whose modality this rank never ran) gets zeros of its shape before
``reduce_gradients`` runs, with or without process groups (pp=1 included), so an optimizer such as AdamW
treats it the same way (zero gradient: moments decay, weight decay applies) whatever the layout.
Parameters with ``requires_grad=False`` are left alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from omni_parallel.data_parallel import all_reduce_gradients
from omni_parallel.state import ParallelState
from omni_pipeline.actions import Action, ActionKind, flow_index, torch_index
from omni_pipeline.anchor import EncoderAnchor
from omni_pipeline.dataflow import DataFlow
from omni_pipeline.p2p import PendingRecv, PlannedP2P
from omni_pipeline.records import P2PRecord
from omni_pipeline.schedules import Schedule
from omni_pipeline.trace import TimelineEvent

__all__ = ["PipelineExecutor", "PipelineGroups", "StepFunctions", "StepPlan", "StepResult"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
EF, EB = ActionKind.ENCODER_FORWARD, ActionKind.ENCODER_BACKWARD


@dataclass
class PipelineGroups:
    """Process groups the executor talks on.

    Attributes:
        pp: pipeline group, group ranks in pipeline order (group rank r holds stages r, r+P, ...);
            ``None`` for pp=1.
        encoder_dp: every rank holding an encoder replica (all pp x dp ranks), for the default gradient
            reduction; ``None``: no encoder reduction.
        llm_dp: this stage's data-parallel replicas, for the default gradient reduction; ``None``: none.
        encoder_p2p: group for encoder outputs / gradients, same ranks and order as ``pp`` (give one
            whenever the backend may ignore tags, e.g. NCCL); ``None``: share ``pp`` on a separate tag
            range.
    """

    pp: dist.ProcessGroup | None = None
    encoder_dp: dist.ProcessGroup | None = None
    llm_dp: dist.ProcessGroup | None = None
    encoder_p2p: dist.ProcessGroup | None = None

    @classmethod
    def from_state(cls, ps: ParallelState) -> PipelineGroups:
        """The transfer groups of a :class:`~omni_parallel.ParallelState` built with
        ``GroupSpec(encoder_p2p=True)``: its ``pp`` group and, for encoder outputs and their gradients,
        ``ps.encoder_p2p_group`` over the same ranks in the same order, so encoder and LLM transfers between
        two ranks never share a communicator (NCCL ignores P2P tags; DESIGN.md §omni-pipeline). No
        reduction groups: pass the gradient syncs (``omni_parallel.apply_dp``,
        ``omni_parallel.apply_encoder_zero``) as the executor's ``reduce_gradients`` hook. Creates no group.

        Raises:
            ValueError: ``pp`` > 1 and ``ps`` was built without the encoders' point-to-point group.
        """
        if ps.size("pp") == 1:
            return cls()
        if ps.encoder_p2p_group is None:
            raise ValueError(
                f"pp {ps.size('pp')}: build the ParallelState with GroupSpec(encoder_p2p=True) so encoder "
                "transfers get a communicator of their own"
            )
        return cls(pp=ps.group("pp"), encoder_p2p=ps.encoder_p2p_group)


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
        waits: ``{action: seconds}`` this rank blocked on receives before each action's compute started
            (its input, output gradient or encoder outputs; actions that never blocked are absent).
        p2p: every receive this rank waited for, as :class:`~omni_pipeline.records.P2PRecord` (``step``
            as passed to :meth:`PipelineExecutor.step`; ``transfer_s`` unknown: ``None``).
        pipeline_s: seconds from the step's start to the end of its last action and sends.
        reduce_s: seconds in ``reduce_gradients`` (the missing-gradient fill included).
        reduce_wait_s: the part of ``reduce_s`` the hook reports as waiting for the other ranks to arrive
            (its return value; 0 when it returns ``None``, as the default hook does).
    """

    losses: dict[int, float]
    metrics: dict[int, dict[str, float]]
    timeline: list[TimelineEvent]
    timelines: dict[int, list[TimelineEvent]] = field(default_factory=dict)
    waits: dict[str, float] = field(default_factory=dict)
    p2p: list[P2PRecord] = field(default_factory=list)
    pipeline_s: float = 0.0
    reduce_s: float = 0.0
    reduce_wait_s: float = 0.0

    @property
    def loss(self) -> float:
        """Sum of the per-microbatch losses (the step's objective)."""
        return float(sum(self.losses.values()))


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _Wires:
    """The group and tag of every transfer of a step (the one place the scheme is written).

    * ``activation(s, mb)``: stage ``s``'s forward output of ``mb`` to stage ``s + 1``, on ``pp``,
      tag ``2 * (s * M + mb)``;
    * ``input_grad(s, mb)``: stage ``s``'s input gradient of ``mb`` back to stage ``s - 1``, on ``pp``,
      tag ``2 * (s * M + mb) + 1``;
    * ``encoder_output(e)`` / ``encoder_grad(e)``: on ``encoder_p2p``, tags ``2e`` / ``2e + 1``; when the
      encoders share ``pp``, shifted past the LLM's ``2 * stages * M`` tags.

    Each returns ``(PlannedP2P, tag)``; :class:`PlannedP2P` turns a tag into a header and a payload tag.
    """

    def __init__(self, groups: PipelineGroups, rank: int, device: torch.device, schedule: Schedule) -> None:
        self.llm = PlannedP2P(groups.pp, rank, device)
        shared = groups.encoder_p2p is None
        self.enc = self.llm if shared else PlannedP2P(groups.encoder_p2p, rank, device)
        self._mbs = schedule.num_microbatches
        self._enc_base = 2 * schedule.num_stages * schedule.num_microbatches if shared else 0

    def activation(self, stage: int, mb: int) -> tuple[PlannedP2P, int]:
        return self.llm, 2 * (stage * self._mbs + mb)

    def input_grad(self, stage: int, mb: int) -> tuple[PlannedP2P, int]:
        return self.llm, 2 * (stage * self._mbs + mb) + 1

    def encoder_output(self, e: int) -> tuple[PlannedP2P, int]:
        return self.enc, self._enc_base + 2 * e

    def encoder_grad(self, e: int) -> tuple[PlannedP2P, int]:
        return self.enc, self._enc_base + 2 * e + 1

    def wait(self, pending: PendingRecv) -> torch.Tensor:
        return self.llm.wait(pending)  # a posted receive carries its own works: any PlannedP2P waits on it

    def wait_sends(self) -> None:
        self.llm.wait_sends()
        if self.enc is not self.llm:
            self.enc.wait_sends()


class _StepRun:
    """One step on one pipeline rank: its in-flight state and one method per action kind.

    Microbatches are torch's 0-based ``mb`` throughout; ``flow_index(mb)`` appears only at calls into the
    user's :class:`StepFunctions` and in the results, which number them as the data flow does.
    """

    def __init__(
        self,
        ex: PipelineExecutor,
        plan: StepPlan,
        encoder_inputs: Mapping[int, Any],
        fn: StepFunctions,
        step: int = 0,
    ) -> None:
        sched, flow = plan.schedule, plan.flow
        self.ex, self.fn, self.sched, self.inputs = ex, fn, sched, encoder_inputs
        self.rank, self.last, self.dtype = ex.pp_rank, sched.num_stages - 1, plan.dtype
        self.wires = _Wires(ex.groups, ex.pp_rank, ex.device, sched)
        self.actions = sched.actions(self.rank)
        # each stage's last backward of the step: its gradients are final once that backward is through
        self.last_backward = {a.stage: j for j, a in enumerate(self.actions) if a.kind == B}
        self.llm_shape = {torch_index(k): tuple(s) for k, s in plan.llm_shapes.items()}
        self.enc_shape = {e: tuple(s) for e, s in plan.encoder_shapes.items()}
        self.consumes = {torch_index(k): list(es) for k, es in flow.encoder_inputs.items()}
        self.enc_rank = {e: flow.encoder_rank(e) for e in flow.encoder_consumer}
        self.placed = [a.microbatch for a in ex.anchor.placed() if a.kind == EF]
        # this rank's encoder backwards still to run, in run order (PipelineExecutor.encoder_backwards_left)
        self.backwards_left = tuple(a.microbatch for a in ex.anchor.placed() if a.kind == EB)
        self.llm_recv: dict[Action, PendingRecv] = {}  # an action's input (F) or output gradient (B)
        self.enc_recv: dict[int, PendingRecv] = {}  # stage 0: encoder outputs; others: their gradients
        self.enc_out: dict[int, torch.Tensor] = {}  # stage 0: encoder outputs as autograd leaves
        self.enc_grad: dict[int, torch.Tensor] = {}  # stage 0: gradients of encoder mbs it ran itself
        self.saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.local: dict[tuple[ActionKind, int, int], torch.Tensor] = {}  # same-rank hand-offs
        self.losses: dict[int, float] = {}
        self.metrics: dict[int, dict[str, float]] = {}
        self.timeline: list[TimelineEvent] = []
        self.step, self.waits, self.p2p = step, {}, []  # blocked seconds per action, receives waited for
        self.t0 = time.perf_counter()

    def run(self) -> None:
        run_llm = {F: self.llm_forward, B: self.llm_backward}
        self.post_step_receives()
        if self.ex.encoder_backwards_left is not None:
            self.ex.encoder_backwards_left(self.backwards_left)
        for j, a in enumerate(self.actions):
            # posted before the boundary's encoder actions run, so a neighbour's message can land while
            # they compute (rank 1's first input arrives during its warm-up encoder forwards)
            self.post_llm_receive(j)
            self.post_llm_receive(j + 1)
            self.run_encoders(a)
            self.ex.current_action = a
            if self.ex.before_last_backward is not None and self.last_backward.get(a.stage) == j:
                self.ex.before_last_backward(self.ex.stages[a.stage])
            run_llm[a.kind](a)
        self.run_encoders(None)
        self.wires.wait_sends()
        self.end_s = time.perf_counter() - self.t0

    def wait(self, pending: PendingRecv, a: Action, what: str, microbatch: int) -> torch.Tensor:
        """Wait for a posted receive that action ``a`` needs, timing how long the rank blocked."""
        start = time.perf_counter()
        t = self.wires.wait(pending)
        blocked = time.perf_counter() - start
        self.waits[str(a)] = self.waits.get(str(a), 0.0) + blocked
        nbytes = t.numel() * t.element_size()
        self.p2p.append(P2PRecord(self.step, pending.src, self.rank, what, microbatch, nbytes, blocked))
        return t

    def run_encoders(self, before: Action | None) -> None:
        for a in self.ex.anchor.at(before):
            self.ex.current_action = a
            (self.encoder_forward if a.kind == EF else self.encoder_backward)(a)

    # -- receives --------------------------------------------------------------------------------------
    def post_step_receives(self) -> None:
        """Receives known when the step starts: on stage 0 every encoder output computed elsewhere; on
        the other ranks the gradient of every encoder microbatch they run."""
        if self.rank == 0:
            for e in sorted(self.enc_rank):
                if self.enc_rank[e] != 0:
                    p2p, tag = self.wires.encoder_output(e)
                    what = f"receive of EF{e} output"
                    self.enc_recv[e] = p2p.post_recv(
                        self.enc_rank[e], tag, what, self.enc_shape[e], self.dtype
                    )
        else:
            for e in self.placed:
                p2p, tag = self.wires.encoder_grad(e)
                what = f"receive of EB{e} gradient"
                self.enc_recv[e] = p2p.post_recv(0, tag, what, self.enc_shape[e], self.dtype)

    def post_llm_receive(self, j: int) -> None:
        """Post the receive action ``j`` needs from another rank (its input or its output gradient)."""
        if j >= len(self.actions) or self.actions[j] in self.llm_recv:
            return
        a = self.actions[j]
        s, mb = a.stage, a.microbatch
        if a.kind == F and s > 0:
            src, (p2p, tag), what = s - 1, self.wires.activation(s - 1, mb), f"{a} input"
        elif a.kind == B and s < self.last:
            src, (p2p, tag), what = s + 1, self.wires.input_grad(s + 1, mb), f"{a} output gradient"
        else:
            return
        src_rank = self.sched.stage_to_rank(src)
        if src_rank != self.rank:
            self.llm_recv[a] = p2p.post_recv(src_rank, tag, what, self.llm_shape[mb], self.dtype)

    def incoming(self, a: Action) -> torch.Tensor:
        """The tensor action ``a`` consumes from its neighbour stage: received, or handed over locally."""
        if a in self.llm_recv:
            return self.wait(
                self.llm_recv.pop(a), a, "activation" if a.kind == F else "gradient", a.microbatch
            )
        return self.local.pop((a.kind, a.stage, a.microbatch))

    def hand_on(
        self, a: Action, t: torch.Tensor, to_stage: int, route: tuple[PlannedP2P, int], what: str
    ) -> None:
        """Pass ``t`` (an activation or an input gradient of ``a``'s microbatch) to stage ``to_stage``."""
        mb, shape = a.microbatch, self.llm_shape[a.microbatch]
        dst = self.sched.stage_to_rank(to_stage)
        if dst != self.rank:
            p2p, tag = route
            p2p.send(t, dst, tag, what, shape)
            return
        if tuple(t.shape) != shape:
            raise ValueError(
                f"rank {self.rank}, {a}: produced shape {tuple(t.shape)} but the plan says {shape}"
            )
        self.local[(a.kind, to_stage, mb)] = t.detach()

    # -- LLM actions -----------------------------------------------------------------------------------
    def llm_forward(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        module = self.ex.stages[s]
        if s == 0:
            outs = {e: self.encoder_output(e, a) for e in self.consumes.get(mb, ())}
            start = time.perf_counter()
            args, x_in = self.fn.first_stage_input(flow_index(mb), outs), None
            args = args if isinstance(args, tuple) else (args,)
        else:
            x = self.incoming(a)
            start = time.perf_counter()
            x_in = x.detach().requires_grad_(True)
            args = (x_in,)
        y = module(*args, **self.stage_kwargs(s, mb))
        if s == self.last:
            self.saved[(s, mb)] = (x_in, self.loss(mb, y))
        else:
            self.saved[(s, mb)] = (x_in, y)
            self.hand_on(a, y, s + 1, self.wires.activation(s, mb), f"{a} output to stage {s + 1}")
        self.record(a, start)

    def llm_backward(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        x_in, y = self.saved.pop((s, mb))
        if s == self.last:
            start = time.perf_counter()
            torch.autograd.backward(y)
        else:
            g = self.incoming(a)
            start = time.perf_counter()
            torch.autograd.backward(y, g)
        if s > 0:
            g_in = x_in.grad if x_in.grad is not None else torch.zeros_like(x_in)
            self.hand_on(a, g_in, s - 1, self.wires.input_grad(s, mb), f"{a} input gradient to stage {s - 1}")
        else:
            for e in self.consumes.get(mb, ()):
                self.return_encoder_grad(a, e)
        self.record(a, start)

    def stage_kwargs(self, stage: int, mb: int) -> Mapping[str, Any]:
        return self.fn.stage_kwargs(stage, flow_index(mb)) if self.fn.stage_kwargs else {}

    def loss(self, mb: int, y: torch.Tensor) -> torch.Tensor:
        k = flow_index(mb)
        got = self.fn.loss(k, y)
        loss, extra = got if isinstance(got, tuple) else (got, {})
        self.losses[k] = float(loss.detach())
        self.metrics[k] = {
            n: float(v.detach() if isinstance(v, torch.Tensor) else v) for n, v in extra.items()
        }
        return loss

    # -- encoder actions -------------------------------------------------------------------------------
    def encoder_forward(self, a: Action) -> None:
        e = a.microbatch
        start = time.perf_counter()
        out = self.ex.anchor.forward(e, self.fn.encoder, self.inputs[e])
        if self.rank == 0:
            if tuple(out.shape) != self.enc_shape[e]:
                raise ValueError(
                    f"rank 0, {a}: produced shape {tuple(out.shape)} but the plan says {self.enc_shape[e]}"
                )
            self.enc_out[e] = out.detach().requires_grad_(out.requires_grad)
        else:
            p2p, tag = self.wires.encoder_output(e)
            p2p.send(out, 0, tag, f"{a} output to stage 0", self.enc_shape[e])
        self.record(a, start)

    def encoder_backward(self, a: Action) -> None:
        e = a.microbatch
        grad = (
            self.enc_grad.pop(e)
            if self.rank == 0
            else self.wait(self.enc_recv.pop(e), a, "encoder_gradient", e)
        )
        start = time.perf_counter()
        self.ex.anchor.backward(e, grad)
        self.record(a, start)
        self.backwards_left = tuple(x for x in self.backwards_left if x != e)
        if self.ex.encoder_backwards_left is not None:
            self.ex.encoder_backwards_left(self.backwards_left)

    def encoder_output(self, e: int, a: Action) -> torch.Tensor:
        """Stage 0: encoder microbatch ``e``'s output as an autograd leaf (received on first use, by ``a``)."""
        if e not in self.enc_out:
            self.enc_out[e] = self.wait(self.enc_recv.pop(e), a, "encoder_output", e).requires_grad_(True)
        return self.enc_out[e]

    def return_encoder_grad(self, a: Action, e: int) -> None:
        """Stage 0, after backward ``a``: send encoder microbatch ``e``'s output gradient to its rank."""
        leaf = self.enc_out.pop(e)
        g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        if self.enc_rank[e] == 0:
            self.enc_grad[e] = g
        else:
            p2p, tag = self.wires.encoder_grad(e)
            p2p.send(g, self.enc_rank[e], tag, f"EB{e} gradient from {a}", self.enc_shape[e])

    def record(self, a: Action, start: float) -> None:
        end = time.perf_counter() - self.t0
        self.timeline.append(TimelineEvent(self.rank, str(a), a.kind.value, start - self.t0, end))


class PipelineExecutor:
    """Runs planned steps on this pipeline rank.

    Args:
        stages: ``{stage index: module}`` for the stages this rank holds (``Schedule.rank_stages``).
        anchor: the encoders colocated on this rank (see :class:`EncoderAnchor`).
        functions: the user's callables; ``None``: every :meth:`step` passes its own.
        groups: process groups.
        device: where receive buffers live (default: the first stage's parameters' device, else CPU).
        reduce_gradients: called once per step after the last backward, when every trainable parameter
            has a ``.grad``; default :meth:`reduce_over_groups`. It may return the seconds it spent waiting
            for the other ranks to arrive (``StepResult.reduce_wait_s``: pipeline drain imbalance, not
            the reduction's own cost).
        before_last_backward: called with a stage module just before this rank's last backward through
            it in the step (the step's gradients of that stage are final once it is through), in program
            order, the same on every rank holding that stage: e.g.
            :meth:`omni_parallel.llm_zero.LLMGradientSync.arm`, which issues each block's gradient
            collective during that backward. ``None``: nothing.
        encoder_backwards_left: called with the encoder microbatches whose backward is still to run on
            this rank in the step (a tuple, in run order): when the step starts, before its first action
            (every one placed here; empty: none), and after each encoder backward (empty after the last).
            A microbatch missing from it reaches no encoder parameter on this rank again in the step:
            e.g. the trainer tells :meth:`omni_parallel.EncoderGradientSync.ready` the towers none of the
            rest use, whose gradient collectives are then issued. ``None``: nothing.

    Attributes:
        current_action: the :class:`~omni_pipeline.actions.Action` (LLM or encoder) this rank is running,
            blocked in, or ran last (``None`` before its first step); read by a watchdog thread to name
            where a hung rank stopped.

    Raises:
        ValueError: an empty ``stages`` mapping.
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        anchor: EncoderAnchor,
        functions: StepFunctions | None,
        groups: PipelineGroups | None = None,
        *,
        device: torch.device | str | None = None,
        reduce_gradients: Callable[[], float | None] | None = None,
        before_last_backward: Callable[[nn.Module], None] | None = None,
        encoder_backwards_left: Callable[[tuple[int, ...]], None] | None = None,
    ) -> None:
        if not stages:
            raise ValueError("PipelineExecutor: this rank holds no stage modules")
        self.stages = dict(stages)
        self.anchor = anchor
        self.fn = functions
        self.groups = groups or PipelineGroups()
        self.reduce_gradients = reduce_gradients or self.reduce_over_groups
        self.before_last_backward = before_last_backward
        self.encoder_backwards_left = encoder_backwards_left
        self.pp_size = _size(self.groups.pp)
        self.pp_rank = 0 if self.groups.pp is None else dist.get_rank(self.groups.pp)
        if device is None:
            p = next((p for m in self.stages.values() for p in m.parameters()), None)
            device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(device)
        # the action this rank runs or ran last: a plain attribute that a hang watchdog's thread reads
        # without a lock (omni_parallel.watchdog)
        self.current_action: Action | None = None

    def parameters(self) -> list[nn.Parameter]:
        """LLM stage parameters on this rank, each once (a module shared by two stages counts once; the
        anchor holds the encoders')."""
        return list({id(p): p for m in self.stages.values() for p in m.parameters()}.values())

    def step(
        self,
        plan: StepPlan,
        encoder_inputs: Mapping[int, Any],
        *,
        functions: StepFunctions | None = None,
        gather_timelines: bool = False,
        step: int = 0,
    ) -> StepResult:
        """Run forward and backward of every microbatch of ``plan``, then ``reduce_gradients``.

        Gradients accumulate into ``.grad`` (zero them before the step, step the optimizer after). On
        return every parameter of this rank's stage modules and encoders that requires grad has a
        ``.grad`` tensor: zeros where it received no gradient, in every layout (see the module docstring).

        Args:
            plan: the step plan (identical on all pipeline ranks).
            encoder_inputs: ``{e: inputs}`` for the encoder microbatches the flow places on this rank
                only (zero redundancy: other ranks never see the payload).
            functions: this step's callables (e.g. closures over this step's batch); default: the
                executor's own.
            gather_timelines: also collect every pipeline rank's timeline into ``StepResult.timelines``.
            step: the training step, for ``StepResult.p2p``'s records.

        Raises:
            ValueError: the plan's schedule is for another pp size, this rank misses a stage module,
                ``encoder_inputs`` lacks an encoder microbatch the flow places here, or no callables were
                given (neither here nor to the executor).
            P2PError: a produced or received tensor's shape differs from the plan (names rank, action,
                shapes).
        """
        fn = functions or self.fn
        if fn is None:
            raise ValueError(
                f"rank {self.pp_rank}: no StepFunctions: pass functions= to step() or the executor"
            )
        self._prepare(plan, encoder_inputs)
        self.anchor.gather()
        run = _StepRun(self, plan, encoder_inputs, fn, step)
        run.run()
        start = time.perf_counter()
        self._fill_missing_gradients()
        reduce_wait_s = float(self.reduce_gradients() or 0.0)
        reduce_s = time.perf_counter() - start
        self._check_resharded()
        losses, metrics = self._share_losses(plan.schedule, run.losses, run.metrics)
        timelines = {self.pp_rank: run.timeline}
        if gather_timelines and self.groups.pp is not None:
            gathered: list[Any] = [None] * self.pp_size
            dist.all_gather_object(gathered, run.timeline, group=self.groups.pp)
            timelines = dict(enumerate(gathered))
        return StepResult(
            losses=losses,
            metrics=metrics,
            timeline=run.timeline,
            timelines=timelines,
            waits=run.waits,
            p2p=run.p2p,
            pipeline_s=run.end_s,
            reduce_s=reduce_s,
            reduce_wait_s=reduce_wait_s,
        )

    def _prepare(self, plan: StepPlan, encoder_inputs: Mapping[int, Any]) -> None:
        sched = plan.schedule
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
        self.anchor.check_layout()
        self.anchor.register(self.pp_rank, plan.flow, sched)
        placed_here = [a.microbatch for a in self.anchor.placed() if a.kind == EF]
        lacking = [e for e in placed_here if e not in encoder_inputs]
        if lacking:
            raise ValueError(
                f"rank {self.pp_rank}: the data flow runs encoder microbatches {lacking} here but encoder_inputs lacks them"
            )

    def _fill_missing_gradients(self) -> None:
        """Zeros for every trainable parameter without ``.grad`` (stage modules and encoders), so the
        optimizer sees the same parameters in every layout, with or without groups to reduce over."""
        params = {id(p): p for p in [*self.parameters(), *self.anchor.parameters()]}
        for p in params.values():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def reduce_over_groups(self) -> None:
        """The default gradient reduction, the objective's plain sum (:mod:`omni_pipeline.loss`): LLM
        gradients summed over ``groups.llm_dp``; encoder gradients summed over ``groups.encoder_dp``
        (ZeRO-2/3: over the encoders' FSDP2 mesh, which is ``encoder_dp`` or, without one, the world, into
        sharded gradients). One flattened all-reduce (or, sharded, one reduce-scatter) per bucket
        (:func:`omni_parallel.data_parallel.all_reduce_gradients`,
        :func:`omni_parallel.encoder_zero.reduce_scatter_gradients`)."""
        all_reduce_gradients(self.parameters(), self.groups.llm_dp)
        if self.anchor.sharded:
            self.anchor.reduce_gradients()
        else:
            all_reduce_gradients(self.anchor.parameters(), self.groups.encoder_dp)

    def _check_resharded(self) -> None:
        # Gathered, an FSDP2 unit holds plain tensors; resharded, its parameters are DTensors again.
        if self.anchor.sharded and not any(isinstance(p, DTensor) for p in self.anchor.parameters()):
            raise RuntimeError(
                f"rank {self.pp_rank}: the encoders are still gathered after reduce_gradients; a custom hook "
                "must call anchor.reduce_gradients() (ZeRO-2/3)"
            )

    def _share_losses(self, sched: Schedule, losses, metrics):
        if self.groups.pp is None or self.pp_size == 1:
            return losses, metrics
        src = dist.get_global_rank(self.groups.pp, sched.stage_to_rank(sched.num_stages - 1))
        box: list[Any] = [(losses, metrics)]
        dist.broadcast_object_list(box, src=src, group=self.groups.pp)
        return box[0]
