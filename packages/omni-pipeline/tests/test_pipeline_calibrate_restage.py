"""Out-of-sample calibration: a joint per-block fit of pp=2 records re-staged onto pp=4 gives the known
coefficients; processor sharing of ranks over too few cores, computed by hand and equal to the simulator
with a core per rank; refusals name what is wrong; the
fit leaves out first calls and fixed costs that nearly equal sizes cannot tell apart."""

from __future__ import annotations

import dataclasses
import random

import pytest

from omni_pipeline import ActionRecord, RunRecords, StepRecord, TokenCost, cost_key, fit_cost_model
from omni_pipeline.calibrate import (
    BASE_SPREAD,
    LayerCostModel,
    fit_layer_model,
    host_step_s,
    restage_cost_model,
)
from omni_pipeline.cost import CostModel
from omni_pipeline.dataflow import DataFlow
from omni_pipeline.schedules import Schedule1F1B
from omni_pipeline.simulator import simulate

# the known per-layer model the synthetic records are drawn from (seconds, seconds/token, seconds/token^2)
KNOWN = LayerCostModel(
    block={"F": TokenCost(2e-4, 3e-6, 4e-10), "B": TokenCost(3e-4, 6e-6, 8e-10)},
    head={"F": TokenCost(5e-4, 7e-6, 0.0), "B": TokenCost(6e-4, 9e-6, 0.0)},
    embedding_share=0.05,
)
ENCODER = TokenCost(1e-3, 2e-5, 1e-8)


def _stage_seconds(kind: str, n: int, first: bool, last: bool, t: float, t2: float) -> float:
    """A stage of ``n`` blocks written out (not through ``LayerCostModel``): every block, the embedding's
    share of one on the first stage, the head on the last; attention (``t2``) only in the blocks."""
    b, h = KNOWN.block[kind], KNOWN.head[kind]
    blocks = n + (KNOWN.embedding_share if first else 0.0)
    out = blocks * (b.base_s + b.per_token_s * t) + n * b.per_token_sq_s * t2
    return out + ((h.base_s + h.per_token_s * t) if last else 0.0)


def _records(split: list[int], steps: int = 4, microbatches: int = 6) -> RunRecords:
    """Records of a run split as ``split`` whose every action costs exactly what ``KNOWN`` (and
    ``ENCODER`` for the image tower) says, with varied pack lengths and document splits."""
    rng = random.Random(0)
    actions, step_records = [], []
    last = len(split) - 1
    for step in range(steps):
        ends = [0.0] * len(split)
        for mb in range(microbatches):
            t = rng.randint(100, 256)
            docs = [t // 3, t // 3, t - 2 * (t // 3)] if rng.random() < 0.5 else [t]
            t2 = sum(d * d for d in docs)
            for kind in ("F", "B"):
                for s, n in enumerate(split):
                    sec = _stage_seconds(kind, n, s == 0, s == last, t, t2)
                    actions.append(
                        ActionRecord(step, s, kind, s, mb, {"llm": t}, {"llm": t2}, ends[s], ends[s] + sec)
                    )
                    ends[s] += sec
            p = rng.randint(10, 300)
            for kind, f in (("EF", 1.0), ("EB", 2.0)):
                sec = f * ENCODER.seconds(p, p * p)
                actions.append(
                    ActionRecord(
                        step, 0, kind, None, mb + 1, {"image": p}, {"image": p * p}, ends[0], ends[0] + sec
                    )
                )
                ends[0] += sec
        step_records += [StepRecord(step, s, max(ends) + 0.01, e) for s, e in enumerate(ends)]
    return RunRecords(actions=actions, steps=step_records)


def _close(a: TokenCost, b: TokenCost) -> None:
    for name in ("base_s", "per_token_s", "per_token_sq_s"):
        assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-9, abs=1e-15), name


def test_pp2_fit_restaged_to_pp4_is_the_known_model():
    records = _records([3, 1])
    layers = fit_layer_model(records, [range(0, 3), range(3, 4)], embedding_share=KNOWN.embedding_share)
    for kind in ("F", "B"):
        _close(layers.block[kind], KNOWN.block[kind])
        _close(layers.head[kind], KNOWN.head[kind])
    fitted = fit_cost_model(records)
    staged = restage_cost_model(
        fitted, layers, [3, 1], [1, 1, 1, 1], from_rank_params=4.0, to_rank_params=3.0
    )
    for kind in ("F", "B"):
        b, h, e = KNOWN.block[kind], KNOWN.head[kind], 1.0 + KNOWN.embedding_share
        want = [  # one block per stage, the embedding's share on stage 0, the head on stage 3
            TokenCost(e * b.base_s, e * b.per_token_s, b.per_token_sq_s),
            b,
            b,
            TokenCost(b.base_s + h.base_s, b.per_token_s + h.per_token_s, b.per_token_sq_s),
        ]
        for s in range(4):
            _close(staged.coefficients[cost_key(kind, s, "llm")], want[s])
    assert {cost_key(k, s, "llm") for k in "FB" for s in (2, 3)} <= set(staged.coefficients)
    _close(staged.coefficients["EF:image"], ENCODER)  # encoder terms carried over
    assert staged.step_overhead_s == pytest.approx(fitted.step_overhead_s * 3.0 / 4.0)
    assert len(staged.llm_forward_s) == 4


def test_processor_sharing_of_a_pipeline_on_too_few_cores():
    """1F1B, pp=2, 2 microbatches, F = 1 s, B = 2 s, computed by hand.

    A core per rank: the simulator's 9 s. One core for both ranks: r0 F1 alone [0, 1]; r0 F2 and r1 F1
    share it [1, 3]; r1 B1 alone [3, 5]; r1 F2 and r0 B1 share [5, 7] (r0 B1 has 1 s left); r0 B1 and
    r1 B2 share [7, 9]; r1 B2's last second alone [9, 10]; r0 B2 alone [10, 12]: 12 s (all 12 s of work
    on one core, as it must be), plus the overhead both ranks run at once, stretched 2x."""
    schedule = Schedule1F1B(2, 2)
    costs = CostModel(llm_forward_s=1.0, llm_backward_s=2.0, step_overhead_s=0.1)
    assert simulate(schedule, None, costs).step_time_s == pytest.approx(9.1)
    assert host_step_s(schedule, None, costs, processes=2, cores=2) == pytest.approx(9.1)
    assert host_step_s(schedule, None, costs, processes=2, cores=1) == pytest.approx(12.2)
    # two DP replicas on 2 cores: each replica's pipeline gets one core's worth
    assert host_step_s(schedule, None, costs, processes=4, cores=2) == pytest.approx(12.2)
    # the dispatch gap is CPU work after every action but a rank's last (3 per rank): on one core the 12 s
    # of actions and 3 s of gaps, the core never idle (a rank waiting while the other computes)
    gaps = dataclasses.replace(costs, dispatch_s=0.5)
    assert host_step_s(schedule, None, gaps, processes=2, cores=1) == pytest.approx(15.2)
    # with a core per rank the gap overlaps the wait for inputs, as in the simulator: its own step, also
    # with an encoder output crossing ranks (transfer time) and dispatch gaps
    flow = DataFlow({1: (1, (0, 1)), -1: (1, (-1, 0))}, {1: [1]})
    one = Schedule1F1B(2, 1)
    enc = CostModel(
        llm_forward_s=1.0, llm_backward_s=2.0, encoder_forward_s={1: 3.0}, p2p_latency_s=0.5, dispatch_s=0.25
    )
    for sched, fl, c in ((schedule, None, gaps), (one, flow, enc)):
        want = simulate(sched, fl, c).step_time_s
        assert host_step_s(sched, fl, c, processes=2, cores=2) == pytest.approx(want)
        assert host_step_s(sched, fl, c, processes=4, cores=4) == pytest.approx(want)
    with pytest.raises(ValueError, match="cores > 0"):
        host_step_s(schedule, None, costs, processes=2, cores=0)
    with pytest.raises(ValueError, match="pipeline's 2 ranks"):
        host_step_s(schedule, None, costs, processes=1, cores=1)


def test_refusals_name_what_is_wrong():
    records = _records([3, 1], steps=2)
    with pytest.raises(ValueError, match=r"records of LLM stages \[1\], the split has 1 stages"):
        fit_layer_model(records, [4])
    with pytest.raises(ValueError, match="no LLM records of stages \\[2\\]"):
        fit_layer_model(records, [2, 1, 1])
    one = fit_layer_model(RunRecords(actions=[a for a in records.actions if a.stage in (0, None)]), [3])
    with pytest.raises(ValueError, match=r"fitted on 1 LLM stage.*cannot be told apart"):
        restage_cost_model(fit_cost_model(records), one, [3], [2, 1])


def test_first_calls_left_out_and_narrow_sizes_fit_no_fixed_cost():
    records = _records([3, 1])
    # each rank's first image action pays a one-time 20 ms: left out, the fit is the tower's model again
    firsts = {}
    for a in records.actions:
        if a.stage is None:
            firsts.setdefault((a.rank, a.kind), a)
    slow = {id(a) for a in firsts.values()}
    actions = [dataclasses.replace(a, end_s=a.end_s + 0.02) if id(a) in slow else a for a in records.actions]
    fitted = fit_cost_model(RunRecords(actions=actions, steps=records.steps))
    _close(fitted.coefficients["EF:image"], ENCODER)
    kept = fit_cost_model(RunRecords(actions=actions, steps=records.steps), drop_first_calls=False)
    got, want = kept.coefficients["EF:image"].seconds(100, 1e4), ENCODER.seconds(100, 1e4)
    assert abs(got - want) > 1e-4  # kept, the one-time costs skew the fit
    # LLM packs filled to within BASE_SPREAD of one length: the per-token terms carry the whole cost
    narrow = [a for a in records.actions if a.stage is not None and a.tokens["llm"] >= 200]
    assert max(a.tokens["llm"] for a in narrow) < BASE_SPREAD * min(a.tokens["llm"] for a in narrow)
    assert fit_cost_model(RunRecords(actions=narrow)).coefficients["F0:llm"].base_s == 0.0
    assert fitted.coefficients["F0:llm"].base_s > 0.0  # 100-256 tokens: wide enough
