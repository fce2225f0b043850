"""Out-of-sample calibration: a joint per-block fit of pp=2 records re-staged onto pp=4 gives the known
coefficients; the host bound of ranks sharing cores, computed by hand; refusals name what is wrong; the
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
from omni_pipeline.simulator import SimulationResult
from omni_pipeline.trace import TimelineEvent

# the known per-layer model the synthetic records are drawn from (seconds, seconds/token, seconds/token^2)
KNOWN = LayerCostModel(
    block={"F": TokenCost(2e-4, 3e-6, 4e-10), "B": TokenCost(3e-4, 6e-6, 8e-10)},
    head={"F": TokenCost(5e-4, 7e-6, 0.0), "B": TokenCost(6e-4, 9e-6, 0.0)},
    embedding_share=0.05,
)
ENCODER = TokenCost(1e-3, 2e-5, 1e-8)


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
                    c = KNOWN.stage_cost(kind, n, first=s == 0, last=s == last)
                    sec = c.seconds(t, t2)
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
        for s in range(4):
            _close(
                staged.coefficients[cost_key(kind, s, "llm")],
                KNOWN.stage_cost(kind, 1, first=s == 0, last=s == 3),
            )
    assert not any(k.startswith(("F2", "B2")) for k in fitted.coefficients)  # pp=4's stages are new
    _close(staged.coefficients["EF:image"], ENCODER)  # encoder terms carried over
    assert staged.step_overhead_s == pytest.approx(fitted.step_overhead_s * 3.0 / 4.0)
    assert len(staged.llm_forward_s) == 4


def test_host_bound_of_four_ranks_on_two_cores():
    ev = lambda r, a, k, t0, t1: TimelineEvent(r, a, k, t0, t1)  # noqa: E731
    timelines = {  # 4 ranks, makespan 1.0 s, busy 0.5 + 0.75 + 0.75 + 1.0 = 3.0 s in 6 actions
        0: [ev(0, "0F1", "F", 0.0, 0.5)],
        1: [ev(1, "1F1", "F", 0.25, 0.5), ev(1, "1B1", "B", 0.5, 1.0)],
        2: [ev(2, "2F1", "F", 0.0, 0.75)],
        3: [ev(3, "3F1", "F", 0.0, 0.5), ev(3, "3B1", "B", 0.5, 1.0)],
    }
    res = SimulationResult(timelines, 1.0, {}, {}, 0.0, {}, step_time_s=1.1)
    costs = CostModel(dispatch_s=0.01, step_overhead_s=0.1)
    # max(1.0 + 0.1, (3.0 + 6 * 0.01) / 2)
    assert host_step_s(res, costs, processes=4, cores=2) == pytest.approx(1.53)
    # on 4 cores the busy bound (0.765 s) does not bind: the simulator's own step
    assert host_step_s(res, costs, processes=4, cores=4) == pytest.approx(1.1)
    # a core per rank (ranks 0 and 1 alone): the simulator's own step
    two = SimulationResult({r: timelines[r] for r in (0, 1)}, 1.0, {}, {}, 0.0, {}, step_time_s=1.1)
    assert host_step_s(two, costs, processes=2, cores=2) == pytest.approx(1.1)
    with pytest.raises(ValueError, match="cores > 0"):
        host_step_s(res, costs, processes=4, cores=0)


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
