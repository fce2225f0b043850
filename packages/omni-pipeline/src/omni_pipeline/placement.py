"""Placement policies: each turns a schedule and ``encoder_inputs`` (``{k: [e, ...]}``) into a DataFlow.

* ``prepend_first_stage`` - Megatron-LM / torchtitan baseline: every encoder microbatch runs on rank 0
  (stage 0) right before the forward that needs it, its backward right after stage 0's backward.
* ``isolated`` - encoder work spread over all ranks, every forward before the pipeline starts and every
  backward after it ends (MegaScale-Omni, uniform insertion: no interference, high memory).
* ``uniform_on_demand`` - MegaScale-Omni's policy: the encoder work of LLM microbatch k is split over all P
  ranks (largest-first onto the least-loaded rank; with ``fixed_ranks=True`` the j-th onto rank j % P);
  each rank runs its slice at the latest point from which it still finishes before stage 0 needs it, and
  its backward at the earliest point after the gradient has returned. "When" is estimated from the LLM-only schedule timed with a cost model (unit costs F=1, B=2 by
  default); a point after which the rank would wait on stage 0's forward itself is never chosen.
* ``planned`` (beyond the paper; :mod:`omni_pipeline.planner`) - rank and slots searched by simulation
  under a per-rank activation-memory cap, starting from the best of the three above.

Imports go one way: this module (the baselines) <- :mod:`omni_pipeline.planner` (the search starting from
them) <- :mod:`omni_pipeline.policy` (:func:`~omni_pipeline.policy.place`, a policy run by name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum

from omni_pipeline.actions import Action, ActionKind
from omni_pipeline.cost import CostModel
from omni_pipeline.dataflow import DataFlow, DataFlowError
from omni_pipeline.graph import happens_before
from omni_pipeline.schedules import Schedule
from omni_pipeline.simulator import action_times

__all__ = [
    "PlacementPolicy",
    "isolated",
    "prepend_first_stage",
    "split_over_ranks",
    "uniform_on_demand",
]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


class PlacementPolicy(StrEnum):
    """Names of the placement policies (for configs and CLIs)."""

    PREPEND_FIRST_STAGE = "prepend_first_stage"
    ISOLATED = "isolated"
    UNIFORM_ON_DEMAND = "uniform_on_demand"
    PLANNED = "planned"


def _inputs(schedule: Schedule, encoder_inputs: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
    """``encoder_inputs`` as ``{k: [e, ...]}`` sorted by ``k``, checked against ``schedule``.

    Raises:
        DataFlowError: an LLM microbatch outside ``1..num_microbatches``, an encoder microbatch ``< 1``, or
            one feeding two LLM microbatches (each named).
    """
    try:
        enc = {int(k): [int(e) for e in es] for k, es in sorted(encoder_inputs.items())}
    except (TypeError, ValueError) as exc:
        raise DataFlowError(
            [f"encoder_inputs must map LLM microbatch k to a list of encoder microbatches: {exc}"]
        ) from None
    errors: list[str] = []
    consumer: dict[int, int] = {}
    for k, es in enc.items():
        if not 1 <= k <= schedule.num_microbatches:
            errors.append(
                f"encoder_inputs: LLM microbatch {k} does not exist in {schedule!r} "
                f"(numbered 1..{schedule.num_microbatches})"
            )
        for e in es:
            if e < 1:
                errors.append(f"encoder_inputs[{k}]: encoder microbatch {e} (numbered from 1)")
            elif e in consumer:
                errors.append(f"encoder microbatch {e} feeds LLM microbatches {consumer[e]} and {k}")
            consumer[e] = k
    if errors:
        raise DataFlowError(errors)
    return enc


def split_over_ranks(
    encoder_inputs: Mapping[int, Sequence[int]],
    num_ranks: int,
    encoder_costs: Mapping[int, float] | None = None,
    *,
    fixed_ranks: bool = False,
) -> dict[int, int]:
    """Assign each encoder microbatch to a rank: per LLM microbatch, largest first onto the rank with the
    least work so far (LPT greedy, Graham 1969), so the work of every microbatch spreads over all ranks.

    The greedy choice depends on ``encoder_costs`` (and on the load carried over from earlier LLM
    microbatches), so with unequal costs the rank of an encoder microbatch can change from step to step.
    With equal costs (or none) and ``encoder_inputs[k]`` listing ``P = num_ranks`` microbatches each, it
    coincides with the fixed rule below.

    Args:
        encoder_inputs: ``{k: [e, ...]}``.
        num_ranks: pipeline ranks ``P``.
        encoder_costs: ``{e: seconds}`` (missing: 1.0); ignored when ``fixed_ranks``.
        fixed_ranks: ignore costs: the ``j``-th encoder microbatch listed for LLM microbatch ``k``
            (``encoder_inputs[k][j]``, ``j`` from 0) runs on rank ``j % P``; with the conventional numbering
            ``e = (k-1)*P + j + 1`` that is rank ``j``. A pure function of ``encoder_inputs``, so a data
            loader can know each rank's encoder microbatches before any cost or payload is read.

    Returns:
        ``{e: rank}``.

    Raises:
        ValueError: ``num_ranks < 1``.
    """
    if num_ranks < 1:
        raise ValueError(f"split_over_ranks: num_ranks must be >= 1, got {num_ranks}")
    if fixed_ranks:
        return {e: j % num_ranks for _, es in sorted(encoder_inputs.items()) for j, e in enumerate(es)}
    load = [0.0] * num_ranks
    out: dict[int, int] = {}
    for _, es in sorted(encoder_inputs.items()):
        cost = {e: float((encoder_costs or {}).get(e, 1.0)) for e in es}
        taken: set[int] = set()
        for e in sorted(es, key=lambda e: (-cost[e], e)):
            free = [r for r in range(num_ranks) if r not in taken] or list(range(num_ranks))
            r = min(free, key=lambda r: (load[r], r))
            taken.add(r)
            if len(taken) == num_ranks:
                taken.clear()
            out[e] = r
            load[r] += cost[e]
    return out


def _build(schedule: Schedule, encoder_inputs, placed: list[tuple[int, int, int, int]]) -> DataFlow:
    """``placed``: ``(rank, slot, order, signed e)``; slots are indices into the rank's LLM program."""
    programs = schedule.program_view
    entries: dict[int, tuple[int, tuple[int, int]]] = {}
    for rank, slot, _, key in sorted(placed, key=lambda x: (x[0], x[1], x[2], abs(x[3]))):
        entries[key] = (rank, DataFlow.slot_ref(schedule, programs[rank], rank, slot))
    return DataFlow(entries, encoder_inputs, schedule=schedule)


def _addressable(program: Sequence[Action], rank: int, slot: int) -> bool:
    return slot == len(program) or program[slot].stage == rank


def prepend_first_stage(schedule: Schedule, encoder_inputs: Mapping[int, Sequence[int]]) -> DataFlow:
    """All encoder microbatches on rank 0, right before stage 0's forward that consumes them, their
    backward right after stage 0's backward of that microbatch (Megatron-LM / torchtitan baseline).

    Raises:
        DataFlowError: ``encoder_inputs`` names an LLM microbatch the schedule lacks, an encoder
            microbatch < 1, or one encoder microbatch twice (same for every policy).
    """
    enc = _inputs(schedule, encoder_inputs)
    return _build(schedule, enc, _prepend_placed(schedule, enc))


Placed = list[tuple[int, int, int, int]]


def _prepend_placed(schedule: Schedule, enc: Mapping[int, Sequence[int]]) -> Placed:
    prog = schedule.program_view[0]
    index = {a: i for i, a in enumerate(prog)}
    placed = []
    for k, es in enc.items():
        fs = index[Action(F, k - 1, 0)]
        bs = index[Action(B, k - 1, 0)] + 1
        while not _addressable(prog, 0, bs):
            bs += 1
        for e in es:
            placed += [(0, fs, 1, e), (0, bs, 0, -e)]
    return placed


def isolated(
    schedule: Schedule,
    encoder_inputs: Mapping[int, Sequence[int]],
    encoder_costs: Mapping[int, float] | None = None,
    *,
    fixed_ranks: bool = False,
) -> DataFlow:
    """Encoder work split over all ranks (:func:`split_over_ranks`, ``fixed_ranks`` as there); every
    forward before the rank's first LLM action, every backward after its last one."""
    enc = _inputs(schedule, encoder_inputs)
    return _build(schedule, enc, _isolated_placed(schedule, enc, encoder_costs, fixed_ranks))


def _isolated_placed(
    schedule: Schedule, enc: Mapping[int, Sequence[int]], encoder_costs, fixed_ranks: bool
) -> Placed:
    ranks = split_over_ranks(enc, schedule.num_ranks, encoder_costs, fixed_ranks=fixed_ranks)
    programs = schedule.program_view
    placed = []
    for es in enc.values():
        for e in es:
            r = ranks[e]
            placed += [(r, 0, 1, e), (r, len(programs[r]), 0, -e)]
    return placed


def uniform_on_demand(
    schedule: Schedule,
    encoder_inputs: Mapping[int, Sequence[int]],
    costs: CostModel | None = None,
    *,
    fixed_ranks: bool = False,
) -> DataFlow:
    """MegaScale-Omni's uniform on-demand insertion (MegaScale-Omni §4.2; see the module docstring).

    Which rank runs which encoder microbatch (``flow.encoder_rank(e)``, ``flow.encoders_on(rank)``):

    * default (``fixed_ranks=False``): the cost-balanced split of :func:`split_over_ranks` over
      ``costs.encoder_forward_s``. It **depends on the costs**: unequal per-step costs can move an encoder
      microbatch to another rank. With equal costs (or ``costs`` without ``encoder_forward_s``) and ``P``
      encoder microbatches listed per LLM microbatch it equals the fixed rule.
    * ``fixed_ranks=True``: guaranteed, whatever ``costs`` say: ``encoder_inputs[k][j]`` runs on pipeline
      rank ``j % P`` (``P = schedule.num_ranks``, ``j`` from 0), i.e. with the conventional numbering
      ``e = (k-1)*P + j + 1`` encoder microbatch ``e`` runs on rank ``j = (e-1) % P``. A pure function of
      ``encoder_inputs`` and ``P``: a data loader's zero-redundancy filter can be given each rank's
      encoder microbatches before payloads (or costs) are read. Costs still choose *where in the rank's
      program* each encoder action goes.

    Args:
        schedule: the LLM schedule.
        encoder_inputs: ``{k: [e, ...]}`` (LLM microbatch ``k`` from 1, encoder microbatches from 1).
        costs: cost model for the timing estimate and (unless ``fixed_ranks``) the split
            (``encoder_forward_s``, seconds); default unit LLM costs (F=1 s, B=2 s) and equal encoder
            microbatches.
        fixed_ranks: use the fixed rank rule above instead of the cost-balanced split.

    Raises:
        DataFlowError: ``encoder_inputs`` names an LLM microbatch the schedule lacks, an encoder
            microbatch < 1, or one encoder microbatch twice.
    """
    enc = _inputs(schedule, encoder_inputs)
    return _build(schedule, enc, _uniform_placed(schedule, enc, costs or CostModel(), fixed_ranks))


def feasible_slots(schedule: Schedule, rank: int, k: int) -> tuple[list[int], list[int]]:
    """Where on ``rank`` the encoder work of LLM microbatch ``k`` (from 1) may go (``DataFlow.validate``'s
    rules), as slots (indices into the rank's LLM program; ``len`` = the end).

    Returns:
        ``(forward slots, backward slots)``: forwards at slots whose previous action does not wait on
        stage 0's forward of ``k``; backwards at slots from which no later action is needed by stage 0's
        backward of ``k``; both only at addressable points (under virtual stages, before the rank's
        first-stage actions or at the end).
    """
    prog = schedule.program_view[rank]
    _, where, clock = schedule.analysis
    f0, b0 = Action(F, k - 1, 0), Action(B, k - 1, 0)
    n = len(prog)
    s_max = next((i for i in range(n) if happens_before(where, clock, f0, prog[i])), n)
    s_min = next((i + 1 for i in range(n - 1, -1, -1) if happens_before(where, clock, prog[i], b0)), 0)
    return (
        [s for s in range(s_max + 1) if _addressable(prog, rank, s)],
        [s for s in range(s_min, n + 1) if _addressable(prog, rank, s)],
    )


def _uniform_placed(
    schedule: Schedule, enc: Mapping[int, Sequence[int]], costs: CostModel, fixed_ranks: bool
) -> Placed:
    ranks = split_over_ranks(
        enc, schedule.num_ranks, costs.encoder_forward_s or None, fixed_ranks=fixed_ranks
    )
    programs = schedule.program_view
    order = schedule.analysis[0]
    llm_only = CostModel(
        llm_forward_s=costs.llm_forward_s,
        llm_backward_s=costs.llm_backward_s,
        p2p_latency_s=costs.p2p_latency_s,
        p2p_bandwidth_Bps=costs.p2p_bandwidth_Bps,
        llm_activation_bytes=costs.llm_activation_bytes,
    )
    _, start, end, _ = action_times(programs, schedule.num_stages, {}, llm_only, order=order)
    t_slot = {r: [0.0] + [end[a] for a in prog] for r, prog in programs.items()}  # when rank r reaches slot s
    placed = []
    for k, es in enc.items():
        f0, b0 = Action(F, k - 1, 0), Action(B, k - 1, 0)
        window: dict[int, tuple[list[int], list[int]]] = {}
        for e in es:
            r = ranks[e]
            if r not in window:
                window[r] = feasible_slots(schedule, r, k)
            f_cands, b_cands = window[r]
            comm = 0.0 if r == 0 else costs.transfer_s(costs.encoder_output_bytes.get(e, 0.0))
            need = start[f0] - comm - costs.duration(Action(ActionKind.ENCODER_FORWARD, e))
            fs = next((s for s in reversed(f_cands) if t_slot[r][s] <= need + 1e-12), None)
            if fs is None:  # cannot finish in time anywhere: rank 0 runs it just before, others at once
                fs = f_cands[-1] if r == 0 else f_cands[0]
            back_at = end[b0] + comm
            bs = next((s for s in b_cands if t_slot[r][s] >= back_at - 1e-12), b_cands[-1])
            placed += [(r, fs, 1, e), (r, bs, 0, -e)]
    return placed
