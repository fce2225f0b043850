"""Per-step planning: each step's data flow searched from that step's metadata (``planned`` placement).

The paper's policies fix the data flow by rule. ``planned`` (:func:`omni_pipeline.planner.plan_placement`)
searches each encoder microbatch's rank and forward / backward slots by simulating the step; what it
needs is the step's costs. They are known before any payload is read: the packs' metadata give every
encoder microbatch's image patches and audio frames (:mod:`omni_pipeline.step_costs`), so the flow is
planned per step, the moment the loader has the step's metadata (inside omni-data's zero-redundancy
filter, ``ZeroRedundancyFilter(consumes=StepPlanner.consumes)``), and each rank reads and decodes only
the payloads its flow runs. Every rank of a pipeline plans the same flow: the planner is a pure function
of the metadata and the cost model (:class:`PlannerSpec`).

Costs: modelled FLOPs of the models (:func:`~omni_pipeline.step_costs.modelled_step_costs`, the stages
weighted by their layers, embedding, LM head and loss: :func:`stage_weights`), or a cost model fitted
from a run's ``actions.jsonl`` (the machine's measured speeds,
:func:`omni_pipeline.calibrate.fitted_cost_model`). A per-rank activation-memory cap bounds the plan's
modelled peak of stored activations.

Where the ranks must not change from step to step (reordering across DP replicas, whose groups pair the
same encoder microbatch on each replica; CP, whose ranks split each encoder microbatch), the flow is
planned once at startup with the fixed rank rule and equal costs (:func:`static_flow`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from omni_data import Pack
from omni_data.zero_redundancy import SampleIndex
from omni_pipeline.cost import CostModel
from omni_pipeline.dataflow import DataFlow
from omni_pipeline.placement import PlacementPolicy
from omni_pipeline.planner import PlanResult, plan_placement
from omni_pipeline.policy import place
from omni_pipeline.schedules import Schedule
from omni_pipeline.split import LLMShape, layer_costs
from omni_pipeline.stage_balance import stage_costs
from omni_pipeline.step_costs import ModelScale, calibrated_step_costs, modelled_step_costs

__all__ = ["PlannerSpec", "StepPlanner", "stage_weights", "static_flow"]


@dataclass(frozen=True)
class PlannerSpec:
    """What :class:`StepPlanner` plans with besides each step's metadata.

    Args:
        scale: the models' sizes (:func:`omni_pipeline.step_costs.model_scale`): modelled FLOPs, and the
            byte sizes of a calibrated plan.
        max_evaluations: simulations the search may spend per step (``plan_placement``'s); >= 1.
        memory_cap_bytes: peak stored activations per rank the plan may reach, in the cost model's
            modelled bytes; ``None``: no cap.
        fitted: a cost model fitted from a run's records
            (:func:`omni_pipeline.calibrate.fitted_cost_model`); ``None``: modelled FLOPs.
        dtype_bytes: bytes per element of the calibrated run (its activation sizes).
        rate_flops: the modelled device's FLOP/s. Only ratios of durations steer the search (P2P terms
            aside), so any rate of the right order does; 1 TFLOP/s keeps the 10 us P2P latency small
            next to the compute, as on a GPU.

    Raises:
        ValueError: ``scale`` not a :class:`ModelScale`, ``max_evaluations < 1``, a cap <= 0, or a rate or
            ``dtype_bytes`` <= 0.
    """

    scale: ModelScale
    max_evaluations: int = 100
    memory_cap_bytes: float | None = None
    fitted: CostModel | None = None
    dtype_bytes: float = 4.0
    rate_flops: float = 1e12

    def __post_init__(self) -> None:
        if not isinstance(self.scale, ModelScale):
            raise ValueError(
                f"PlannerSpec.scale must be an omni_pipeline.ModelScale (model_scale(...)), got {self.scale!r}"
            )
        if self.max_evaluations < 1:
            raise ValueError(f"PlannerSpec: max_evaluations must be >= 1, got {self.max_evaluations}")
        if self.memory_cap_bytes is not None and not self.memory_cap_bytes > 0:
            raise ValueError(
                f"PlannerSpec: memory_cap_bytes must be > 0 or None, got {self.memory_cap_bytes}"
            )
        if not (self.rate_flops > 0 and self.dtype_bytes > 0):
            raise ValueError(
                f"PlannerSpec: rate_flops ({self.rate_flops}) and dtype_bytes ({self.dtype_bytes}) must be > 0"
            )


def stage_weights(shape: LLMShape, split: Sequence[range], max_seq_len: int) -> list[float]:
    """Each stage's modelled LLM cost relative to the mean stage: its layers, plus the embedding on the
    first and the LM head + loss on the last (:func:`omni_pipeline.split.layer_costs`).

    Raises:
        ValueError: as :func:`~omni_pipeline.split.layer_costs` (no ``vocab_size``).
    """
    block, first, last = layer_costs(shape, max_seq_len)
    costs = stage_costs(split, [block] * shape.n_layers, first_stage_extra=first, last_stage_extra=last)
    return [c * len(costs) / sum(costs) for c in costs]


def static_flow(
    placement: PlacementPolicy | str,
    schedule: Schedule,
    encoder_inputs: Mapping[int, Sequence[int]],
    weights: Sequence[float],
    *,
    encoder_forward_share: float,
) -> DataFlow:
    """A run's one data flow, planned at startup (every policy but per-step ``planned``): equal costs
    per encoder microbatch (``encoder_forward_share`` of one LLM stage's microbatch forward), the fixed
    rank rule (slice ``j`` of each LLM microbatch on pipeline rank ``j``, which a loader's split
    balances); ``planned`` also sees how the stages differ (``weights``, :func:`stage_weights`) and
    searches the slots.

    Raises:
        ValueError: an unknown placement. DataFlowError: bad ``encoder_inputs``.
    """
    share = {e: encoder_forward_share for es in encoder_inputs.values() for e in es}
    costs = CostModel(encoder_forward_s=share)
    if PlacementPolicy(placement) == PlacementPolicy.PLANNED:
        costs = CostModel(
            encoder_forward_s=share, llm_forward_s=list(weights), llm_backward_s=[2 * w for w in weights]
        )
    return place(placement, schedule, encoder_inputs, costs, fixed_ranks=True)


class StepPlanner:
    """Plans each step's data flow from its metadata (see the module docstring).

    Args:
        spec: the cost model and search budget.
        schedule: the LLM schedule (``schedule.num_ranks`` pipeline ranks).
        encoder_inputs: ``{k: [e, ...]}`` (``omni_data.encoder_microbatch_ids``).
        weights: :func:`stage_weights` (modelled costs).
        pp_rank: this rank's pipeline rank (what :meth:`consumes` answers for).
    """

    def __init__(
        self,
        spec: PlannerSpec,
        schedule: Schedule,
        encoder_inputs: Mapping[int, Sequence[int]],
        weights: Sequence[float],
        pp_rank: int,
    ) -> None:
        self.spec, self.schedule, self.encoder_inputs = spec, schedule, encoder_inputs
        self.weights, self.pp_rank = list(weights), pp_rank
        # flows planned ahead (by the loader, maybe on its preparation thread) until the step runs
        self._flows: dict[int, PlanResult] = {}
        self.over_cap_bytes = 0.0
        self._lock = threading.Lock()

    @property
    def memory_cap_bytes(self) -> float | None:
        """The spec's per-rank cap on modelled stored activations, bytes (``None``: no cap)."""
        return self.spec.memory_cap_bytes

    def plan(self, packs: list[Pack], mbs: dict[int, list[SampleIndex]]) -> DataFlow:
        """The data flow of a step with these packs and encoder microbatches (pure function of them)."""
        return self._search(packs, mbs).flow

    def _search(self, packs: list[Pack], mbs: dict[int, list[SampleIndex]]) -> PlanResult:
        spec, pp = self.spec, self.schedule.num_ranks
        if spec.fitted is not None:
            costs = calibrated_step_costs(spec.fitted, spec.scale, packs, mbs, pp, spec.dtype_bytes)
        else:
            costs = modelled_step_costs(spec.scale, packs, mbs, pp, spec.rate_flops, 1, self.weights)
        return plan_placement(
            self.schedule,
            self.encoder_inputs,
            costs,
            memory_cap_bytes=spec.memory_cap_bytes,
            max_evaluations=spec.max_evaluations,
        )

    def consumes(self, step: int, packs: list[Pack], mbs: dict[int, list[SampleIndex]]) -> frozenset[int]:
        """``ZeroRedundancyFilter``'s per-step ``consumes``: plans the step and keeps its flow for
        :meth:`flow`; returns the encoder microbatches this rank runs."""
        result = self._search(packs, mbs)
        with self._lock:
            self._flows[step] = result
        return frozenset(result.flow.encoders_on(self.pp_rank))

    def flow(self, step: int, packs: list[Pack], mbs: dict[int, list[SampleIndex]]) -> DataFlow:
        """The flow :meth:`consumes` planned for ``step`` (planned again if it was not: the same flow);
        :attr:`over_cap_bytes` is then that plan's modelled bytes over the memory cap (summed over ranks;
        0 without a cap or when the cap holds: a cap no placement meets gets the plan least over it)."""
        with self._lock:
            result = self._flows.pop(step, None)
            for old in [s for s in self._flows if s < step]:  # steps the loader prepared but never ran
                del self._flows[old]
        result = result if result is not None else self._search(packs, mbs)
        self.over_cap_bytes = result.over_cap_bytes
        return result.flow
