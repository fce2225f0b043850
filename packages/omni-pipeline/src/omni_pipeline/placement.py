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
* ``optimus_static`` - the paper's Optimus baseline (§6): encoders colocated on every pipeline rank and
  scheduled statically into the bubbles of the LLM's 1F1B timeline, planned once for a static workload.
  Not a :class:`PlacementPolicy` (the trainer does not run it); the simulator and benchmarks compare it.
  The paper's Megatron-Dist / DistTrain baseline (encoders on ranks of their own) is not a data flow over
  the pipeline's ranks: :func:`simulate_disaggregated` simulates it (:func:`disaggregated_programs`).

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
from omni_pipeline.simulator import SimulationResult, action_times, simulate_programs

__all__ = [
    "PlacementPolicy",
    "disaggregated_programs",
    "encoder_ranks_for",
    "isolated",
    "optimus_static",
    "prepend_first_stage",
    "simulate_disaggregated",
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

    Reproduces the paper's Megatron-LM baseline (§6: "treating encoders as the embedding layers of the
    first LLM pipeline stage"): stage 0 carries every encoder's compute and stored activations. Simplifies:
    Megatron's stage split does not move LLM layers off stage 0 to make room (the paper's Megatron-LM
    neither); the encoders' own TP/DP inside stage 0 is not modelled (one rank's compute).

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


def _llm_only_times(
    schedule: Schedule, costs: CostModel, *, per_action: bool
) -> tuple[dict[Action, float], dict[Action, float]]:
    """Start and end times of every LLM action of ``schedule`` with no encoder work: the LLM timeline timed
    by ``costs``' LLM and P2P terms, and by its per-action LLM seconds (``llm_action_s``) when
    ``per_action``."""
    llm_only = CostModel(
        llm_forward_s=costs.llm_forward_s,
        llm_backward_s=costs.llm_backward_s,
        p2p_latency_s=costs.p2p_latency_s,
        p2p_bandwidth_Bps=costs.p2p_bandwidth_Bps,
        llm_activation_bytes=costs.llm_activation_bytes,
        llm_action_s=costs.llm_action_s if per_action else {},
    )
    _, start, end, _ = action_times(
        schedule.program_view, schedule.num_stages, {}, llm_only, order=schedule.analysis[0]
    )
    return start, end


def _uniform_placed(
    schedule: Schedule, enc: Mapping[int, Sequence[int]], costs: CostModel, fixed_ranks: bool
) -> Placed:
    ranks = split_over_ranks(
        enc, schedule.num_ranks, costs.encoder_forward_s or None, fixed_ranks=fixed_ranks
    )
    programs = schedule.program_view
    start, end = _llm_only_times(schedule, costs, per_action=False)
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


def optimus_static(
    schedule: Schedule,
    encoder_inputs: Mapping[int, Sequence[int]],
    costs: CostModel | None = None,
    *,
    static_encoder_s: float | None = None,
) -> DataFlow:
    """Optimus-style static bubble filling (Feng et al., 2024, "Optimus: accelerating large-scale
    multi-modal LLM training by bubble exploitation"; the paper's baseline (4), §6).

    Encoder microbatches are colocated on the pipeline ranks with the fixed split (``encoder_inputs[k][j]``
    on rank ``j % P``, :func:`split_over_ranks` with ``fixed_ranks``) and placed into the idle gaps
    ("bubbles") of the LLM-only 1F1B timeline, planned **once for a static workload**: every encoder
    forward is assumed to take ``static_encoder_s`` seconds (default: the mean of ``costs``'
    ``encoder_forward_s``; a plan made for the average step), its backward twice that. Per rank, by
    consuming LLM microbatch: a forward goes to the earliest feasible slot (:func:`feasible_slots`) whose
    remaining gap holds it, else to the latest feasible slot (it then delays the pipeline); a backward to
    the earliest feasible slot after its gradient whose remaining gap holds it, else the rank's end.

    Reproduces: encoder work scheduled into the pipeline's bubbles on the LLM's own ranks, with a static
    plan that does not follow the step's sample lengths (the paper: Optimus' "fixed encoder-LLM 3D
    parallelization", planned "for static workloads"). Simplifies: only the pipeline tier of Optimus'
    multi-tier bubble scheduling (no DP / TP bubbles); encoder work is placed in whole encoder microbatches,
    not decomposed into kernels sized to each bubble; the plan's gaps are those of the LLM-only timeline
    (placing one encoder action does not re-time the others).

    Args:
        schedule: the LLM schedule. encoder_inputs: ``{k: [e, ...]}``.
        costs: the cost model whose LLM times give the bubbles (unit F=1, B=2 when ``None``) and whose mean
            encoder forward is the static estimate.
        static_encoder_s: the planned seconds of every encoder forward (overrides the mean).

    Raises:
        DataFlowError: as every policy (bad ``encoder_inputs``).
    """
    enc = _inputs(schedule, encoder_inputs)
    costs = costs or CostModel()
    if static_encoder_s is None:
        fwd = [float(costs.encoder_forward_s.get(e, 0.0)) for es in enc.values() for e in es]
        static_encoder_s = sum(fwd) / len(fwd) if fwd else 0.0
    ranks = split_over_ranks(enc, schedule.num_ranks, fixed_ranks=True)
    programs = schedule.program_view
    start, end = _llm_only_times(schedule, costs, per_action=True)
    makespan = max(end.values(), default=0.0)
    # gap[r][s]: idle seconds before slot s of rank r's program (slot len: from its last action to the end)
    gap = {
        r: [start[prog[0]] if prog else makespan]
        + [start[prog[i]] - end[prog[i - 1]] for i in range(1, len(prog))]
        + ([makespan - end[prog[-1]]] if prog else [])
        for r, prog in programs.items()
    }
    placed: Placed = []
    for k, es in enc.items():
        for e in es:
            r = ranks[e]
            f_cands, b_cands = feasible_slots(schedule, r, k)
            fs = next((s for s in f_cands if gap[r][s] >= static_encoder_s), f_cands[-1])
            gap[r][fs] = max(0.0, gap[r][fs] - static_encoder_s)
            bs = next((s for s in b_cands if gap[r][s] >= 2 * static_encoder_s), b_cands[-1])
            gap[r][bs] = max(0.0, gap[r][bs] - 2 * static_encoder_s)
            placed += [(r, fs, 1, e), (r, bs, 0, -e)]
    return _build(schedule, enc, placed)


def encoder_ranks_for(costs: CostModel, schedule: Schedule) -> int:
    """Encoder ranks a disaggregated layout gives its encoders, statically, in proportion to their share of
    the step's compute: ``max(1, round(P * encoder seconds / LLM seconds))`` over one step of ``costs``
    (DistTrain sizes its encoder and LLM units by their compute; a static allocation is made once, from
    one representative step, and kept as the mixture moves: the paper's "statically allocated encoder
    resources", §6)."""
    p = schedule.num_ranks
    llm = sum(costs.duration(a) for prog in schedule.program_view.values() for a in prog)
    enc = sum(
        costs.duration(Action(kind, e))
        for e in costs.encoder_forward_s
        for kind in (ActionKind.ENCODER_FORWARD, ActionKind.ENCODER_BACKWARD)
    )
    return max(1, round(p * enc / llm)) if llm > 0 else 1


def disaggregated_programs(
    schedule: Schedule,
    encoder_inputs: Mapping[int, Sequence[int]],
    encoder_ranks: int,
    encoder_costs: Mapping[int, float] | None = None,
) -> tuple[dict[int, list[Action]], dict[int, int]]:
    """Programs of a disaggregated layout: the LLM's ranks ``0 .. P-1`` run the schedule alone; encoder ranks
    ``P .. P+E-1`` run every encoder microbatch, as the first stage of a ``P + 1``-stage 1F1B pipeline.

    Each LLM microbatch's encoder microbatches are spread over the ``E`` encoder ranks (:func:`split_over_ranks`,
    cost-balanced by ``encoder_costs``); every encoder rank runs 1F1B as stage 0 of ``P + 1`` stages:
    ``min(P, m)`` warm-up microbatches' forwards, then per step the next microbatch's forwards and the oldest
    one's backwards, then the remaining backwards (its encoder microbatches of each LLM microbatch
    together).

    Returns:
        ``(programs, encoder_consumer)``: ``{rank: [Action, ...]}`` and ``{e: torch index of its consumer}``.

    Raises:
        ValueError: ``encoder_ranks < 1``. DataFlowError: bad ``encoder_inputs``.
    """
    if encoder_ranks < 1:
        raise ValueError(f"disaggregated_programs: encoder_ranks must be >= 1, got {encoder_ranks}")
    enc = _inputs(schedule, encoder_inputs)
    p, m = schedule.num_ranks, schedule.num_microbatches
    ranks = split_over_ranks(enc, encoder_ranks, encoder_costs)
    programs = {r: list(prog) for r, prog in schedule.programs().items()}
    mine: dict[int, dict[int, list[int]]] = {p + q: {} for q in range(encoder_ranks)}
    for k, es in enc.items():
        for e in es:
            mine[p + ranks[e]].setdefault(k, []).append(e)
    EF, EB = ActionKind.ENCODER_FORWARD, ActionKind.ENCODER_BACKWARD
    warm = min(p, m)
    for r, by_k in mine.items():
        # stage 0 of P + 1 stages in 1F1B: warm-up forwards, then forward of the next and backward of the
        # oldest, then the remaining backwards
        order = [(EF, k) for k in range(1, warm + 1)]
        for i in range(m - warm):
            order += [(EF, warm + 1 + i), (EB, 1 + i)]
        order += [(EB, k) for k in range(m - warm + 1, m + 1)]
        programs[r] = [Action(kind, e) for kind, k in order for e in by_k.get(k, ())]
    consumer = {e: k - 1 for k, es in enc.items() for e in es}
    return programs, consumer


def simulate_disaggregated(
    schedule: Schedule,
    encoder_inputs: Mapping[int, Sequence[int]],
    costs: CostModel,
    encoder_ranks: int,
) -> SimulationResult:
    """The paper's Megatron-Dist / DistTrain baseline (§6 baseline (2): "encoders as the first pipeline stage
    and the LLM backbone as other stages with distinct resources and parallelism strategies"; DistTrain,
    Zhang et al., 2024): encoders on ``encoder_ranks`` ranks of their own (:func:`disaggregated_programs`),
    their outputs sent to stage 0 over P2P (``costs.encoder_output_bytes``), their gradients back.

    Throughput counts every GPU: the same GPUs that hold ``costs.data_parallel`` replicas of the
    ``P``-rank colocated pipeline hold ``data_parallel * P / (P + E)`` replicas of this ``P + E``-rank one
    (fractional: a per-GPU comparison). ``bubble_fraction`` and ``peak_activation_bytes`` cover the encoder
    ranks too (keys ``P .. P+E-1``).

    Simplifies: the encoder stage's own parallelism is data parallelism over its ``E`` ranks (each encoder
    microbatch whole on one rank, balanced per LLM microbatch; no TP/SP inside the encoder); its size is
    given (see :func:`encoder_ranks_for` for the static, compute-proportional choice); the encoder ranks
    do not share P2P links with the pipeline's own transfers (links never contend in this simulator).

    Raises:
        ValueError, DataFlowError: as :func:`disaggregated_programs`. Deadlock: never for valid inputs.
    """
    programs, consumer = disaggregated_programs(
        schedule, encoder_inputs, encoder_ranks, costs.encoder_forward_s or None
    )
    p = schedule.num_ranks
    replicas = costs.data_parallel * p / (p + encoder_ranks)
    return simulate_programs(
        programs, schedule.num_stages, schedule.num_microbatches, consumer, costs, replicas=replicas
    )
