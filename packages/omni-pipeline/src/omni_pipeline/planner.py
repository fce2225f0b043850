"""``planned``: encoder placement by simulation, under a per-rank activation-memory cap (beyond the paper).

The paper's ``uniform_on_demand`` fixes *which* rank runs an encoder microbatch (an even split) and
*when* (as late as possible) by rule. Here both are searched: each encoder microbatch gets a rank and a
forward and backward slot in that rank's program that minimise the simulated step time
(:func:`~omni_pipeline.simulator.action_times` over the cost model), subject to every rank's peak stored
activations staying under ``memory_cap_bytes``. Encoder forwards move into a rank's warm-up and
drain idle time, onto ranks with slack, or earlier when stage 0 would wait.

Search (deterministic: same inputs, same flow, on every rank):

1. Start from the best of the baselines (``prepend_first_stage``, ``isolated``, ``uniform_on_demand``;
   cost-balanced and fixed rank splits), so the result is never worse than the best baseline in
   simulation (at the cap: never more over it).
2. Local search: for each encoder microbatch in turn (by consuming LLM microbatch, then id), try moving
   its forward to another (rank, slot) and its backward to another slot; take the best move if it lowers
   the objective ``(memory over the caps, makespan)``; repeat passes until none improves (a trial whose
   simulation passes the makespan it would have to beat stops there: same moves, less time). Then the same
   from the next-best baseline, and so on, while ``max_evaluations`` simulations last; the best end
   point wins. Slots are :func:`~omni_pipeline.placement.feasible_slots`
   (``DataFlow.validate``'s rules); a move that would deadlock is rejected.

Zero redundancy: the rank of every encoder microbatch is a pure function of ``(schedule,
encoder_inputs, costs, memory_cap_bytes)``, i.e. of step metadata and the cost model, so a loader can be
told which payloads to read before it reads any. With ``fixed_ranks=True`` ranks follow the fixed rule
``encoder_inputs[k][j] -> rank j % P`` and only the slots are searched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from omni_pipeline.actions import Action, ActionKind
from omni_pipeline.cost import CostModel
from omni_pipeline.dataflow import DataFlow
from omni_pipeline.placement import (
    Placed,
    _build,
    _inputs,
    _isolated_placed,
    _prepend_placed,
    _uniform_placed,
    feasible_slots,
    split_over_ranks,
)
from omni_pipeline.schedules import Schedule
from omni_pipeline.simulator import simulate

__all__ = ["PlanResult", "plan_placement", "planned"]

EF, EB = ActionKind.ENCODER_FORWARD, ActionKind.ENCODER_BACKWARD
# one encoder microbatch's place: (rank, forward slot, backward slot)
Where = tuple[int, int, int]


@dataclass
class PlanResult:
    """What :func:`plan_placement` found.

    Attributes:
        flow: the data flow.
        makespan_s: its simulated makespan.
        peak_activation_bytes: ``{rank: simulated peak bytes}``.
        over_cap_bytes: sum over ranks of bytes above the cap (0 when the cap holds).
        start: name of the baseline the search started from.
        evaluations: simulations spent.
    """

    flow: DataFlow
    makespan_s: float
    peak_activation_bytes: dict[int, float]
    over_cap_bytes: float
    start: str
    evaluations: int


def _caps(cap: float | Mapping[int, float] | None, num_ranks: int) -> list[float]:
    if cap is None:
        return [math.inf] * num_ranks
    if isinstance(cap, int | float):
        caps = [float(cap)] * num_ranks
    else:
        missing = [r for r in range(num_ranks) if r not in cap]
        if missing:
            raise ValueError(f"planned: memory_cap_bytes has no cap for ranks {missing}")
        caps = [float(cap[r]) for r in range(num_ranks)]
    bad = [c for c in caps if not c > 0]
    if bad:
        raise ValueError(f"planned: memory caps must be > 0 bytes, got {caps}")
    return caps


class _Evaluator:
    """Simulates placements ``{e: (rank, f_slot, b_slot)}`` fast: the simulator's rules
    (:func:`~omni_pipeline.simulator.action_times`, :func:`~omni_pipeline.simulator.peak_activation_bytes`)
    on integer node ids with the LLM part precomputed, no DataFlow or Action objects per trial.
    ``plan_placement`` checks its answer against :func:`~omni_pipeline.simulator.simulate`'s."""

    def __init__(self, schedule: Schedule, enc: Mapping[int, Sequence[int]], costs: CostModel, caps) -> None:
        self.caps = caps
        self.track_memory = any(math.isfinite(c) for c in caps)
        self.dispatch = costs.dispatch_s
        self.count = 0
        llm = schedule.program_view
        self.num_ranks = len(llm)
        ids: dict[Action, int] = {}
        rank_of: list[int] = []
        for r, prog in llm.items():
            for a in prog:
                ids[a] = len(rank_of)
                rank_of.append(r)
        self.llm_ids = {r: [ids[a] for a in prog] for r, prog in llm.items()}
        n_llm = len(rank_of)
        self.es = sorted(e for es in enc.values() for e in es)
        self.ef = {e: n_llm + 2 * i for i, e in enumerate(self.es)}
        self.eb = {e: n_llm + 2 * i + 1 for i, e in enumerate(self.es)}
        n = n_llm + 2 * len(self.es)
        self.dur = [0.0] * n
        self.stored = [0.0] * n
        self.deps: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        last = schedule.num_stages - 1
        act = costs.transfer_s(costs.llm_activation_bytes)
        for a, i in ids.items():
            self.dur[i] = costs.duration(a)
            if a.kind == ActionKind.FORWARD:
                self.stored[i] = costs.stored_bytes(a)
                if a.stage > 0:
                    d = ids[Action.unchecked(ActionKind.FORWARD, a.microbatch, a.stage - 1)]
                    self.deps[i].append((d, act if rank_of[d] != rank_of[i] else 0.0))
            else:
                self.deps[i].append((ids[Action.unchecked(ActionKind.FORWARD, a.microbatch, a.stage)], 0.0))
                if a.stage < last:
                    d = ids[Action.unchecked(ActionKind.BACKWARD, a.microbatch, a.stage + 1)]
                    self.deps[i].append((d, act if rank_of[d] != rank_of[i] else 0.0))
        self.f0 = {k: ids[Action.unchecked(ActionKind.FORWARD, k - 1, 0)] for k in enc}
        self.b0 = {k: ids[Action.unchecked(ActionKind.BACKWARD, k - 1, 0)] for k in enc}
        self.consumer = {e: k for k, es in enc.items() for e in es}
        self.out_bytes = {e: float(costs.encoder_output_bytes.get(e, 0.0)) for e in self.es}
        self.out_tx = {e: costs.transfer_s(self.out_bytes[e]) for e in self.es}
        for e in self.es:
            self.dur[self.ef[e]] = costs.duration(Action.unchecked(EF, e))
            self.dur[self.eb[e]] = costs.duration(Action.unchecked(EB, e))
            self.stored[self.ef[e]] = costs.stored_bytes(Action.unchecked(EF, e))
        # node whose end frees a forward's stored bytes: its backward
        self.release = [-1] * n
        for a, i in ids.items():
            if a.kind == ActionKind.FORWARD:
                self.release[i] = ids[Action.unchecked(ActionKind.BACKWARD, a.microbatch, a.stage)]
        for e in self.es:
            self.release[self.ef[e]] = self.eb[e]
        self.n = n
        self.llm_busy = [sum(self.dur[i] for i in self.llm_ids[r]) for r in range(self.num_ranks)]
        self.encoder_busy = {e: self.dur[self.ef[e]] + self.dur[self.eb[e]] for e in self.es}

    def __call__(self, where: Mapping[int, Where], bound: float = math.inf) -> tuple[float, float] | None:
        """``(bytes over the caps, makespan)``, or ``None`` if the programs deadlock or an action ends
        after ``bound`` seconds (such a placement cannot beat one of makespan ``bound`` with nothing over
        the caps: the search passes that, and the simulation stops there instead of running to the end)."""
        self.count += 1
        # (slot, 0 = backward / 1 = forward, id) per rank: at one slot backwards first, then forwards,
        # each by id (placement._build's order)
        inserts: list[list[tuple[int, int, int]]] = [[] for _ in range(self.num_ranks)]
        deps = list(self.deps)
        ef, eb, f0s, b0s, consumer, out_tx = self.ef, self.eb, self.f0, self.b0, self.consumer, self.out_tx
        for e, (r, f, b) in where.items():
            inserts[r] += ((f, 1, e), (b, 0, e))
            k = consumer[e]
            x = out_tx[e] if r != 0 else 0.0
            f0 = f0s[k]
            deps[f0] = [*deps[f0], (ef[e], x)]
            deps[eb[e]] = [(ef[e], 0.0), (b0s[k], x)]
        progs = []
        for r, ins in enumerate(inserts):
            ids = self.llm_ids[r]
            merged: list[int] = []
            last = 0
            for slot, forward, e in sorted(ins):
                merged += ids[last:slot]
                last = slot
                merged.append(ef[e] if forward else eb[e])
            merged += ids[last:]
            progs.append(merged)
        start = [0.0] * self.n
        end = [-1.0] * self.n
        pos = [0] * self.num_ranks
        free = [0.0] * self.num_ranks
        waiting: dict[int, list[int]] = {}
        ready = list(range(self.num_ranks))
        dispatch, dur = self.dispatch, self.dur
        while ready:
            r = ready.pop()
            prog, i, fr = progs[r], pos[r], free[r]
            n_r = len(prog)
            while i < n_r:
                a = prog[i]
                t = fr + dispatch if i else fr
                for d, x in deps[a]:
                    ed = end[d]
                    if ed < 0:  # its input is not made yet: this rank waits for the rank that makes it
                        waiting.setdefault(d, []).append(r)
                        break
                    if ed + x > t:
                        t = ed + x
                else:
                    start[a] = t
                    end[a] = fr = t + dur[a]
                    if fr > bound:
                        return None
                    i += 1
                    woken = waiting.pop(a, None)
                    if woken:
                        ready.extend(woken)
                    continue
                break
            pos[r], free[r] = i, fr
        if any(pos[r] < len(progs[r]) for r in range(self.num_ranks)):
            return None
        makespan = max(end, default=0.0)
        if not self.track_memory:
            return 0.0, makespan
        over = 0.0
        for r in range(self.num_ranks):
            events = []
            for a in progs[r]:
                if self.stored[a]:
                    events += [(start[a], self.stored[a]), (end[self.release[a]], -self.stored[a])]
            if r == 0:
                for e, (re, _, _) in where.items():
                    arrive = end[self.ef[e]] + (self.out_tx[e] if re != 0 else 0.0)
                    events += [
                        (arrive, self.out_bytes[e]),
                        (end[self.b0[self.consumer[e]]], -self.out_bytes[e]),
                    ]
            level = top = 0.0
            for _, delta in sorted(events):  # frees before allocations at a tie
                level += delta
                top = max(top, level)
            over += max(0.0, top - self.caps[r])
        return over, makespan


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """``a`` beats ``b``: less memory over the caps, or as little and a shorter makespan (beyond rounding)."""
    if a[0] < b[0] - 1e-9 * max(1.0, b[0]):
        return True
    return a[0] <= b[0] + 1e-9 * max(1.0, b[0]) and a[1] < b[1] - 1e-12 * max(1.0, abs(b[1]))


def _bound(score: tuple[float, float], cand: tuple[tuple[float, float], Where] | None) -> float:
    """Makespan past which a trial move cannot matter: it would beat neither the current placement nor the
    best move found so far. Only with nothing over the caps (else a longer makespan with less memory over
    them may still win). The margin keeps the bound clear of :func:`_better`'s rounding, so the search
    takes the same moves as if every trial ran to its end."""
    ref = cand[0] if cand is not None and _better(cand[0], score) else score
    if ref[0] > 0.0:
        return math.inf
    return ref[1] * (1.0 + 1e-9) + 1e-12


def _as_where(placed: Placed) -> dict[int, Where]:
    fwd = {key: (r, slot) for r, slot, _, key in placed if key > 0}
    bwd = {-key: slot for _, slot, _, key in placed if key < 0}
    return {e: (r, f, bwd[e]) for e, (r, f) in fwd.items()}


def _trim(slots: list[int], window: int, *, latest: bool) -> list[int]:
    """At most ``window`` slots nearest the deadline (latest forwards / earliest backwards), plus the far
    end (start / end of the program: the isolated extreme)."""
    if len(slots) <= window + 1:
        return slots
    return [slots[0], *slots[-window:]] if latest else [*slots[:window], slots[-1]]


def _local_search(evaluate, where, score, order, slots, fixed, window, max_evaluations, rank_candidates):
    """Best-improvement moves of one encoder microbatch at a time (see the module docstring) until a
    pass improves nothing or the budget is spent. ``fixed``: ``{e: rank}`` to keep, or ``None``; else an
    encoder microbatch may move to the ``rank_candidates`` ranks with the least work (the most slack)."""
    num_ranks = evaluate.num_ranks
    improved = True
    while improved and evaluate.count < max_evaluations:
        improved = False
        for k, e in order:
            if evaluate.count >= max_evaluations:
                break
            r0, f0, b0 = where[e]
            if fixed is not None:
                ranks = [fixed[e]]
            else:
                busy = list(evaluate.llm_busy)
                for x, (r, _, _) in where.items():
                    busy[r] += evaluate.encoder_busy[x]
                slack = sorted((r for r in range(num_ranks) if r != r0), key=lambda r: (busy[r], r))
                ranks = [r0, *slack[:rank_candidates]]
            moves: list[Where] = []
            for r in ranks:
                f_slots, b_slots = slots[(r, k)]
                bs = [b0] if r == r0 else [b_slots[0], b_slots[-1]]
                for f in _trim(f_slots, window, latest=True):
                    moves += [(r, f, b) for b in bs if (r, f, b) != (r0, f0, b0)]
            moves += [(r0, f0, b) for b in _trim(slots[(r0, k)][1], window, latest=False) if b != b0]
            cand: tuple[tuple[float, float], Where] | None = None
            for move in dict.fromkeys(moves):  # unique, in order
                if evaluate.count >= max_evaluations:
                    break
                trial = dict(where)
                trial[e] = move
                got = evaluate(trial, _bound(score, cand))
                if got is not None and (cand is None or _better(got, cand[0])):
                    cand = (got, move)
            if cand is not None and _better(cand[0], score):
                score = cand[0]
                where = dict(where)
                where[e] = cand[1]
                improved = True
    return score, where


def plan_placement(
    schedule: Schedule,
    encoder_inputs: Mapping[int, Sequence[int]],
    costs: CostModel | None = None,
    *,
    memory_cap_bytes: float | Mapping[int, float] | None = None,
    fixed_ranks: bool = False,
    max_evaluations: int = 1000,
    window: int = 4,
    rank_candidates: int = 2,
) -> PlanResult:
    """Encoder placement that minimises the simulated step time under a per-rank memory cap (see the
    module docstring), with the search's outcome.

    Args:
        schedule: the LLM schedule.
        encoder_inputs: ``{k: [e, ...]}`` (LLM microbatch ``k`` from 1, encoder microbatches from 1).
        costs: the cost model (durations, P2P, stored bytes); default unit LLM costs, free encoders.
        memory_cap_bytes: peak stored-activation bytes allowed per rank (one number for every rank or
            ``{rank: bytes}``); ``None``: no cap. If no placement found meets it, the one least over it.
        fixed_ranks: keep the fixed rank rule (``encoder_inputs[k][j]`` on rank ``j % P``); search slots only.
        max_evaluations: simulations the search may spend (bounds the time at large scale); the up to 5
            starting baselines are always simulated.
        window: forward / backward slots tried per rank nearest the deadline (plus the program's far end).
        rank_candidates: other ranks an encoder microbatch may move to in one step: those with the least
            compute placed on them (the most slack), besides its current rank.

    Returns:
        :class:`PlanResult` (``.flow`` passes ``validate``; makespan and peaks from ``simulate``).

    Raises:
        DataFlowError: ``encoder_inputs`` the schedule cannot hold (as every policy).
        ValueError: a cap <= 0 or missing for a rank, ``max_evaluations < 1`` or ``window < 1``.
    """
    if max_evaluations < 1 or window < 1 or rank_candidates < 1:
        raise ValueError(
            f"planned: max_evaluations ({max_evaluations}), window ({window}) and rank_candidates "
            f"({rank_candidates}) must be >= 1"
        )
    enc = _inputs(schedule, encoder_inputs)
    costs = costs or CostModel()
    caps = _caps(memory_cap_bytes, schedule.num_ranks)
    evaluate = _Evaluator(schedule, enc, costs, caps)
    costed = costs.encoder_forward_s or None
    starts: list[tuple[str, Placed]] = []
    if not fixed_ranks:
        starts += [
            ("prepend_first_stage", _prepend_placed(schedule, enc)),
            ("isolated", _isolated_placed(schedule, enc, costed, False)),
            ("uniform_on_demand", _uniform_placed(schedule, enc, costs, False)),
        ]
    starts += [
        ("isolated fixed_ranks", _isolated_placed(schedule, enc, costed, True)),
        ("uniform_on_demand fixed_ranks", _uniform_placed(schedule, enc, costs, True)),
    ]
    evaluated = []
    for i, (name, placed) in enumerate(starts):
        where = _as_where(placed)
        got = evaluate(where)
        if got is not None:
            evaluated.append((got, i, name, where))
    # best start first (stable on ties); later starts get whatever budget the earlier searches left
    evaluated.sort(key=lambda x: (x[0], x[1]))
    fixed = split_over_ranks(enc, schedule.num_ranks, fixed_ranks=True)
    slots = {(r, k): feasible_slots(schedule, r, k) for k in enc for r in range(schedule.num_ranks)}
    order = [(k, e) for k, es in enc.items() for e in sorted(es)]
    best, _, start_name, best_where = evaluated[0]
    seen: set[tuple] = set()
    for got, _, name, where in evaluated:
        key = tuple(sorted(where.items()))
        if key in seen or evaluate.count >= max_evaluations:
            continue
        seen.add(key)
        got, where = _local_search(
            evaluate,
            where,
            got,
            order,
            slots,
            fixed if fixed_ranks else None,
            window,
            max_evaluations,
            rank_candidates,
        )
        if _better(got, best):
            best, start_name, best_where = got, name, where
    placed = [p for e, (r, f, b) in best_where.items() for p in ((r, f, 1, e), (r, b, 0, -e))]
    flow = _build(schedule, enc, placed)
    sim = simulate(schedule, flow, costs)
    return PlanResult(
        flow,
        sim.makespan_s,
        sim.peak_activation_bytes,
        sum(max(0.0, sim.peak_activation_bytes[r] - c) for r, c in enumerate(caps)),
        start_name,
        evaluate.count,
    )


def planned(
    schedule: Schedule,
    encoder_inputs: Mapping[int, Sequence[int]],
    costs: CostModel | None = None,
    **options,
) -> DataFlow:
    """The data flow :func:`plan_placement` finds (same arguments: ``memory_cap_bytes``, ``fixed_ranks``,
    ``max_evaluations``, ``window``, ``rank_candidates``); passes ``validate``.

    Raises:
        DataFlowError, ValueError: as :func:`plan_placement`.
    """
    return plan_placement(schedule, encoder_inputs, costs, **options).flow
