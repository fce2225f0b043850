"""``parallel.placement = "planned"``: each step's data flow searched from that step's metadata.

The paper's policies fix the data flow by rule. ``planned`` (omni-pipeline's :func:`plan_placement`)
searches each encoder microbatch's rank and forward / backward slots by simulating the step; what it
needs is the step's costs. They are known before any payload is read: the packs' metadata give every
encoder microbatch's image patches and audio frames, so the flow is planned per step, the moment the
loader has the step's metadata (inside the zero-redundancy filter, ``ZeroRedundancyFilter(consumes=
StepPlanner.consumes)``), and this rank reads and decodes only the payloads its flow runs. Every rank
of a pipeline plans the same flow: the planner is a pure function of the metadata and the cost model.

Costs: modelled FLOPs of the config's models (:func:`omni_train.simulate.modelled_step_costs`, the
stages weighted by their layers, embedding, LM head and loss), or, with ``parallel.planner_calibration
= RUN_DIR``, the cost model fitted from that run's ``actions.jsonl`` (the machine's measured speeds,
:func:`omni_pipeline.calibrate.fit_cost_model`). A per-rank activation-memory cap
(``parallel.planner_memory_cap_mib``) bounds the plan's modelled peak of stored activations.

Where the ranks must not change from step to step (reordering across DP replicas, whose groups pair
the same encoder microbatch on each replica; CP, whose ranks split each encoder microbatch), the flow is
planned once at startup with the fixed rank rule and equal costs (:func:`static_flow`).
"""

from __future__ import annotations

import threading
from pathlib import Path

from omni_data import Pack
from omni_data.zero_redundancy import SampleIndex
from omni_pipeline import CostModel, DataFlow, PlanResult, Schedule, plan_placement, stage_costs
from omni_pipeline.placement import place
from omni_train.config import ConfigError, Placement, RunConfig
from omni_train.models.llm import LLMConfig
from omni_train.pipeline import layer_costs
from omni_train.simulate import calibrated_step_costs, config_scale, fit_run, modelled_step_costs

__all__ = ["StepPlanner", "fitted_cost_model", "stage_weights", "static_flow"]

# modelled device rate: only ratios of durations steer the search (P2P terms aside), so any rate of the
# right order does; 1 TFLOP/s keeps the 10 us P2P latency small next to the compute, as on a GPU
_RATE = 1e12


def stage_weights(cfg: RunConfig, llm: LLMConfig, split: list[range]) -> list[float]:
    """Each stage's modelled LLM cost relative to the mean stage (its layers, plus the embedding on the
    first and the LM head + loss on the last: :func:`omni_train.pipeline.layer_costs`)."""
    block, first, last = layer_costs(llm, cfg.data.max_seq_len)
    costs = stage_costs(split, [block] * llm.n_layers, first_stage_extra=first, last_stage_extra=last)
    return [c * len(costs) / sum(costs) for c in costs]


def static_flow(
    cfg: RunConfig, schedule: Schedule, encoder_inputs: dict[int, list[int]], weights: list[float]
) -> DataFlow:
    """The run's one data flow, planned at startup (every policy but per-step ``planned``): equal costs
    per encoder microbatch (``parallel.encoder_forward_share``), the fixed rank rule (slice ``j`` of each
    LLM microbatch on pipeline rank ``j``, which the loader's split balances); ``planned`` also sees how
    the stages differ (``weights``) and searches the slots."""
    par = cfg.parallel
    share = {e: par.encoder_forward_share for es in encoder_inputs.values() for e in es}
    costs = CostModel(encoder_forward_s=share)
    if par.placement == Placement.PLANNED:
        costs = CostModel(
            encoder_forward_s=share, llm_forward_s=list(weights), llm_backward_s=[2 * w for w in weights]
        )
    return place(par.placement, schedule, encoder_inputs, costs, fixed_ranks=True)


class StepPlanner:
    """Plans each step's data flow from its metadata (see the module docstring).

    Args:
        cfg: the run config (``parallel.planner_evaluations``, ``planner_memory_cap_mib``,
            ``planner_calibration``).
        schedule: the LLM schedule; encoder_inputs: ``{k: [e, ...]}`` (``encoder_microbatch_ids``).
        weights: :func:`stage_weights`.
        pp_rank: this rank's pipeline rank (what :meth:`consumes` answers for).

    Raises:
        ConfigError: ``planner_calibration`` has no readable ``actions.jsonl`` or was recorded with
            another pipeline size.
    """

    def __init__(
        self,
        cfg: RunConfig,
        schedule: Schedule,
        encoder_inputs: dict[int, list[int]],
        weights: list[float],
        pp_rank: int,
    ) -> None:
        par = cfg.parallel
        self.cfg, self.schedule, self.encoder_inputs = cfg, schedule, encoder_inputs
        self.weights, self.pp_rank = weights, pp_rank
        self.max_evaluations = par.planner_evaluations
        cap = par.planner_memory_cap_mib
        self.memory_cap_bytes = None if cap is None else cap * 2**20
        self.fitted = fitted_cost_model(cfg) if par.planner_calibration else None
        self.scale = config_scale(cfg)
        # flows planned ahead (by the loader, maybe on its preparation thread) until the step runs
        self._flows: dict[int, PlanResult] = {}
        self.over_cap_bytes = 0.0
        self._lock = threading.Lock()

    def plan(self, packs: list[Pack], mbs: dict[int, list[SampleIndex]]) -> DataFlow:
        """The data flow of a step with these packs and encoder microbatches (pure function of them)."""
        return self._search(packs, mbs).flow

    def _search(self, packs: list[Pack], mbs: dict[int, list[SampleIndex]]) -> PlanResult:
        if self.fitted is not None:
            costs = calibrated_step_costs(self.cfg, self.fitted, packs, mbs)
        else:
            pp = self.cfg.parallel.pp
            costs = modelled_step_costs(self.cfg, self.scale, packs, mbs, pp, _RATE, 1, self.weights)
        return plan_placement(
            self.schedule,
            self.encoder_inputs,
            costs,
            memory_cap_bytes=self.memory_cap_bytes,
            max_evaluations=self.max_evaluations,
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


def fitted_cost_model(cfg: RunConfig) -> CostModel:
    """The cost model fitted from ``parallel.planner_calibration``'s ``actions.jsonl``
    (:func:`omni_pipeline.calibrate.fit_cost_model`, its first step dropped as warm-up when it has more).

    Raises:
        ConfigError: naming ``parallel.planner_calibration``: no readable records there, or they were
            recorded with another pipeline size than ``parallel.pp``.
    """
    run = Path(cfg.parallel.planner_calibration or "")
    try:
        _, fitted, stages = fit_run(run)
    except (OSError, ValueError) as exc:  # RecordError is a ValueError
        raise ConfigError(f"parallel.planner_calibration: {run}: {exc}") from None
    if stages != cfg.parallel.pp:
        raise ConfigError(
            f"parallel.planner_calibration: {run} recorded {stages} pipeline stages, the config has "
            f"parallel.pp = {cfg.parallel.pp}; calibrate with a run of this layout"
        )
    return fitted
