"""Discrete-event simulation of one training step of a schedule + data flow over a cost model.

Each pipeline rank runs its program in order; an action starts when the rank is free (the previous
action's end plus ``CostModel.dispatch_s``) and every input has arrived (same rank: at the producer's end;
another rank: producer's end + latency + bytes / bandwidth). Communication overlaps compute (its own
stream, receives posted before they are needed) and links do not contend. This is what
``omni_pipeline.executor`` does: 1F1B programs in order, encoder outputs sent to stage 0 (whose receives
are posted at the step's start), LLM receives posted one action ahead, sends asynchronous. The step
time adds ``CostModel.step_overhead_s`` (work outside the pipeline) to the makespan. Memory: a forward's stored
activations count from its start to the end of its backward; encoder outputs count on stage 0's rank from
their arrival to the end of stage 0's backward of the consuming microbatch.

Scale: a step is simulated for one DP replica's pipeline (``num_ranks`` ranks); every replica runs the same
pipeline, so a 1,024-rank job with pp=8 is simulated as 8 ranks and its throughput multiplied by
``CostModel.data_parallel`` (= 128). This is how the 1,000+ GPU configurations are reasoned about on a
laptop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from omni_pipeline.actions import Action, ActionKind
from omni_pipeline.cost import CostModel
from omni_pipeline.dataflow import DataFlow
from omni_pipeline.graph import execution_order, llm_encoder_deps
from omni_pipeline.schedules import Schedule
from omni_pipeline.trace import TimelineEvent, plot_timeline, write_chrome_trace

__all__ = ["SimulationResult", "action_times", "peak_activation_bytes", "simulate", "simulate_programs"]


@dataclass
class SimulationResult:
    """Outcome of :func:`simulate`.

    Attributes:
        timelines: ``{rank: [TimelineEvent, ...]}`` in execution order (seconds).
        makespan_s: seconds from the first action's start to the last action's end.
        step_time_s: ``makespan_s + CostModel.step_overhead_s``: the predicted wall time of a whole step.
        bubble_fraction: ``{rank: idle seconds / makespan}``; idle = neither LLM nor encoder compute runs
            on the rank (so encoder work placed in a pipeline bubble fills it).
        peak_activation_bytes: ``{rank: peak bytes of stored activations}``.
        throughput_tokens_per_s: ``tokens_per_microbatch * microbatches * data_parallel / step_time_s``.
        encoder_busy_s: ``{rank: seconds of encoder work}``.
    """

    timelines: dict[int, list[TimelineEvent]]
    makespan_s: float
    bubble_fraction: dict[int, float]
    peak_activation_bytes: dict[int, float]
    throughput_tokens_per_s: float
    encoder_busy_s: dict[int, float]
    step_time_s: float = 0.0

    @property
    def mean_bubble_fraction(self) -> float:
        """Mean of :attr:`bubble_fraction` over ranks."""
        return sum(self.bubble_fraction.values()) / len(self.bubble_fraction)

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write the timelines as a Chrome trace (opens in Perfetto / chrome://tracing)."""
        return write_chrome_trace(self.timelines, path)

    def plot(self, path: str | Path, *, title: str = "") -> Path:
        """Write a PNG timeline, one row per rank, encoder work coloured apart from LLM work."""
        return plot_timeline(self.timelines, path, title=title)


def action_times(
    programs: Mapping[int, list[Action]],
    num_stages: int,
    encoder_consumer: Mapping[int, int],
    costs: CostModel,
    *,
    order: list[tuple[int, Action]] | None = None,
) -> tuple[dict[Action, int], dict[Action, float], dict[Action, float], dict[Action, float]]:
    """Start and end of every action, and the arrival time of its result on stage 0 for encoder forwards.

    Args:
        order: a precomputed ``graph.execution_order`` of ``programs`` (saves recomputing it).

    Returns:
        ``(rank_of, start_s, end_s, arrival_s)``; ``arrival_s[EF e]`` is when e's output reaches stage 0.

    Raises:
        Deadlock: the programs cannot run.
    """
    deps = llm_encoder_deps(num_stages, encoder_consumer)
    if order is None:
        order = execution_order(programs, deps)
    rank_of = {a: r for r, prog in programs.items() for a in prog}
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    free = dict.fromkeys(programs, 0.0)
    started: set[int] = set()
    for r, a in order:
        t = free[r] + (costs.dispatch_s if r in started else 0.0)
        started.add(r)
        for d in deps(a):
            arrive = end[d]
            if rank_of[d] != r:
                arrive += costs.transfer_s(costs.message_bytes(d, a))
            t = max(t, arrive)
        start[a] = t
        end[a] = free[r] = t + costs.duration(a)
    stage0_rank = 0
    arrival = {
        a: end[a] + (costs.transfer_s(costs.message_bytes(a, a)) if rank_of[a] != stage0_rank else 0.0)
        for a in end
        if a.kind == ActionKind.ENCODER_FORWARD
    }
    return rank_of, start, end, arrival


def peak_activation_bytes(
    programs: Mapping[int, Sequence[Action]],
    start: Mapping[Action, float],
    end: Mapping[Action, float],
    arrival: Mapping[Action, float],
    encoder_consumer: Mapping[int, int],
    costs: CostModel,
) -> dict[int, float]:
    """Peak stored-activation bytes per rank from :func:`action_times`' output.

    A forward's stored activations count from its start to the end of its backward; an encoder output
    counts on stage 0's rank from its arrival to the end of stage 0's backward of the consuming microbatch
    (``encoder_consumer``: ``{e: torch index}``). At equal times frees come before allocations.
    """
    mem_events: dict[int, list[tuple[float, float]]] = {r: [] for r in programs}
    for r, a in ((r, a) for r, prog in programs.items() for a in prog):
        if a.kind == ActionKind.FORWARD:
            b = Action.unchecked(ActionKind.BACKWARD, a.microbatch, a.stage)
            mem_events[r] += [(start[a], costs.stored_bytes(a)), (end[b], -costs.stored_bytes(a))]
        elif a.kind == ActionKind.ENCODER_FORWARD:
            b = Action.unchecked(ActionKind.ENCODER_BACKWARD, a.microbatch)
            mem_events[r] += [(start[a], costs.stored_bytes(a)), (end[b], -costs.stored_bytes(a))]
            if a.microbatch in encoder_consumer:
                out = float(costs.encoder_output_bytes.get(a.microbatch, 0.0))
                grad_done = end[Action.unchecked(ActionKind.BACKWARD, encoder_consumer[a.microbatch], 0)]
                mem_events[0] += [(arrival[a], out), (grad_done, -out)]
    peak: dict[int, float] = {}
    for r, evs in mem_events.items():
        level = top = 0.0
        for _, delta in sorted(evs, key=lambda x: (x[0], x[1])):  # frees before allocations at a tie
            level += delta
            top = max(top, level)
        peak[r] = top
    return peak


def simulate(schedule: Schedule, flow: DataFlow | None, costs: CostModel) -> SimulationResult:
    """Simulate one step of ``schedule`` with encoder work placed by ``flow`` (``None``: LLM only).

    Args:
        schedule: the LLM schedule (one DP replica's pipeline).
        flow: data flow; its ``encoder_inputs`` say which LLM microbatch consumes which encoder microbatch.
        costs: the cost model.

    Returns:
        :class:`SimulationResult`.

    Raises:
        DataFlowError: the flow names positions that do not exist.
        Deadlock: the combined programs cannot run.
    """
    programs = flow.programs(schedule) if flow is not None else schedule.programs()
    consumer = flow.encoder_consumer if flow is not None else {}
    return simulate_programs(programs, schedule.num_stages, schedule.num_microbatches, consumer, costs)


def simulate_programs(
    programs: Mapping[int, list[Action]],
    num_stages: int,
    num_microbatches: int,
    encoder_consumer: Mapping[int, int],
    costs: CostModel,
    *,
    replicas: float | None = None,
) -> SimulationResult:
    """Simulate one step of explicit per-rank programs (what :func:`simulate` does for a schedule and a
    flow; here ranks may also hold only encoder work, e.g. a disaggregated encoder stage,
    :func:`omni_pipeline.placement.simulate_disaggregated`).

    Args:
        programs: ``{rank: [Action, ...]}``; LLM stage 0 runs on rank 0.
        num_stages: LLM stages. num_microbatches: LLM microbatches per step.
        encoder_consumer: ``{e: torch index of the LLM microbatch consuming e}``.
        costs: the cost model.
        replicas: pipeline replicas the throughput counts (default ``costs.data_parallel``); may be
            fractional when another layout of the same GPUs is compared.

    Raises:
        Deadlock: the programs cannot run.
    """
    _, start, end, arrival = action_times(programs, num_stages, encoder_consumer, costs)
    consumer = encoder_consumer
    makespan = max(end.values(), default=0.0)
    timelines = {
        r: [
            TimelineEvent(r, str(a), a.kind.value, start[a], end[a])
            for a in sorted(prog, key=start.__getitem__)
        ]
        for r, prog in programs.items()
    }
    busy = {r: sum(end[a] - start[a] for a in prog) for r, prog in programs.items()}
    enc_busy = {r: sum(end[a] - start[a] for a in prog if a.kind.is_encoder) for r, prog in programs.items()}
    peak = peak_activation_bytes(programs, start, end, arrival, consumer, costs)
    step_time = makespan + costs.step_overhead_s
    tokens = (
        costs.tokens_per_microbatch
        * num_microbatches
        * (costs.data_parallel if replicas is None else replicas)
    )
    return SimulationResult(
        timelines=timelines,
        makespan_s=makespan,
        step_time_s=step_time,
        bubble_fraction={r: (1.0 - busy[r] / makespan) if makespan > 0 else 0.0 for r in programs},
        peak_activation_bytes=peak,
        throughput_tokens_per_s=tokens / step_time if step_time > 0 else 0.0,
        encoder_busy_s=enc_busy,
    )
