"""Calibration: records round-trip through JSONL, the fit recovers known coefficients, and a fitted model
times a step as computed by hand."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from omni_pipeline import (
    Action,
    ActionKind,
    ActionRecord,
    ActionTokens,
    CostModel,
    DataFlow,
    FlowRecord,
    P2PRecord,
    RecordError,
    RecordWriter,
    RunRecords,
    Schedule1F1B,
    StepRecord,
    TokenCost,
    action_records,
    cost_key,
    fit_cost_model,
    read_records,
    simulate,
    uniform_on_demand,
)
from omni_pipeline.calibrate import nonnegative_lstsq

TRUE = {
    "F0:llm": TokenCost(1e-3, 2e-5, 3e-9),
    "B0:llm": TokenCost(2e-3, 4e-5, 6e-9),
    "F1:llm": TokenCost(0.5e-3, 3e-5, 3e-9),
    "B1:llm": TokenCost(1e-3, 6e-5, 6e-9),
    "EF:image": TokenCost(4e-4, 1e-5, 2e-8),
    "EF:audio": TokenCost(2e-4, 5e-6, 1e-8),
    "EB:image": TokenCost(8e-4, 2e-5, 4e-8),
    "EB:audio": TokenCost(4e-4, 1e-5, 2e-8),
}
LATENCY, BANDWIDTH, DISPATCH, OVERHEAD = 5e-5, 2e9, 1e-4, 0.02


def synthetic_records(steps: int = 6, seed: int = 0) -> RunRecords:
    """Records of ``steps`` steps with durations exactly from TRUE (no noise): per rank, actions back to
    back with DISPATCH gaps, some preceded by a wait; messages of varying size; steps OVERHEAD longer than
    the last action's end."""
    rng = random.Random(seed)
    out = RunRecords()
    for step in range(steps):
        ends = {}
        for rank in (0, 1):
            t = 0.0
            for i in range(4):
                for kind in ("F", "B"):
                    n = rng.randint(100, 512)
                    toks = {"llm": n}
                    sq = {"llm": n * n}
                    secs = TRUE[f"{kind}{rank}:llm"].seconds(n, n * n)
                    wait = rng.choice([0.0, 0.003])
                    t += DISPATCH + wait
                    out.add(ActionRecord(step, rank, kind, rank, i, toks, sq, t, t + secs, wait))
                    t += secs
                for kind in ("EF", "EB"):
                    mods = rng.choice([["image"], ["audio"], ["image", "audio"]])
                    toks = {m: rng.randint(16, 400) for m in mods}
                    sq = {m: rng.randint(1, 3) * toks[m] ** 2 // 2 for m in mods}
                    secs = sum(TRUE[f"{kind}:{m}"].seconds(toks[m], sq[m]) for m in mods)
                    t += DISPATCH
                    out.add(ActionRecord(step, rank, kind, None, 2 * i + rank + 1, toks, sq, t, t + secs))
                    t += secs
            ends[rank] = t
        for rank in (0, 1):
            slack = max(ends.values()) - ends[rank]
            out.add(StepRecord(step, rank, ends[rank] + slack + OVERHEAD, ends[rank]))
        for i in range(4):
            nbytes = rng.randint(1, 64) * 4096
            out.add(P2PRecord(step, 0, 1, "activation", i, nbytes, 1e-3, LATENCY + nbytes / BANDWIDTH))
            out.add(P2PRecord(step, 1, 0, "gradient", i, nbytes, 0.0, None))  # not observed: skipped
    return out


def test_records_round_trip_through_jsonl(tmp_path):
    recs = synthetic_records(steps=2)
    with RecordWriter(tmp_path / "run" / "actions.jsonl") as w:
        w.write(recs.actions + recs.p2p + recs.steps)
    back = read_records(tmp_path / "run")  # a directory means its actions.jsonl
    assert back == recs
    assert back.actions[0].action == Action(ActionKind.FORWARD, 0, 0)
    assert back.step_ids == [0, 1]


@pytest.mark.parametrize(
    "line, msg",
    [
        ("not json", "not JSON"),
        ('{"type": "nope"}', "field 'type' must be one of"),
        ('{"type": "step", "step": 0, "rank": 0, "step_s": 1.0}', "field 'actions_end_s' must be a finite"),
        (
            '{"type": "step", "step": 0, "rank": 0, "step_s": 1, "actions_end_s": 1, "x": 1}',
            "unknown field 'x'",
        ),
        (
            '{"type": "action", "step": 0, "rank": 0, "kind": "EF", "stage": 0, "microbatch": 1, '
            '"tokens": {}, "tokens_sq": {}, "start_s": 0, "end_s": 1}',
            "EF records must not have a stage",
        ),
        (
            '{"type": "action", "step": 0, "rank": 0, "kind": "F", "stage": 0, "microbatch": 0, '
            '"tokens": {"llm": -1}, "tokens_sq": {}, "start_s": 0, "end_s": 1}',
            r"tokens\['llm'\] must be an integer >= 0",
        ),
        (
            '{"type": "p2p", "step": 0, "src": 0, "dst": 1, "what": "bytes", "microbatch": 0, '
            '"bytes": 1, "wait_s": 0}',
            "field 'what' must be one of",
        ),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, line, msg):
    p = tmp_path / "actions.jsonl"
    good = json.dumps({"type": "step", "step": 0, "rank": 0, "step_s": 1.0, "actions_end_s": 0.5})
    p.write_text(good + "\n" + line + "\n")
    with pytest.raises(RecordError, match=msg) as info:
        read_records(p)
    assert f"{p}:2" in str(info.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_records(tmp_path / "missing")


def test_fit_recovers_known_coefficients():
    fitted = fit_cost_model(synthetic_records())
    assert sorted(fitted.coefficients) == sorted(TRUE)
    for key, true in TRUE.items():
        got = fitted.coefficients[key]
        assert (got.base_s, got.per_token_s, got.per_token_sq_s) == pytest.approx(
            (true.base_s, true.per_token_s, true.per_token_sq_s), rel=1e-6, abs=1e-12
        ), key
    assert fitted.p2p_latency_s == pytest.approx(LATENCY, rel=1e-6)
    assert fitted.p2p_bandwidth_Bps == pytest.approx(BANDWIDTH, rel=1e-6)
    assert fitted.dispatch_s == pytest.approx(DISPATCH, rel=1e-9)
    assert fitted.step_overhead_s == pytest.approx(OVERHEAD, rel=1e-9)
    toks = ActionTokens({"image": (100, 30000), "audio": (50, 2500)})
    want = TRUE["EF:image"].seconds(100, 30000) + TRUE["EF:audio"].seconds(50, 2500)
    assert fitted.predict("EF", None, toks) == pytest.approx(want, rel=1e-6)


def test_fit_skips_warmup_steps_and_refuses_nothing():
    recs = synthetic_records(steps=3)
    slow = RunRecords([r.__class__(**{**r.__dict__, "end_s": r.end_s * 5}) for r in recs.actions], [], [])
    slow.actions = [r for r in slow.actions if r.step == 0] + [r for r in recs.actions if r.step > 0]
    fitted = fit_cost_model(slow, skip_steps=1)
    assert fitted.coefficients["F0:llm"].per_token_s == pytest.approx(TRUE["F0:llm"].per_token_s, rel=1e-6)
    with pytest.raises(ValueError, match="no action records to fit"):
        fit_cost_model(recs, skip_steps=3)


def test_nonnegative_lstsq_drops_negative_columns():
    # plain least squares gives (2.238, 0, -0.333) here; the best with x >= 0 has x2 = 0 and x0 the fit
    # of y on column 0 alone: (1*2 + 2*4.5 + 3*6) / (1 + 4 + 9) = 29/14
    rows = [[1.0, 0.0, 1.0], [2.0, 0.0, 0.0], [3.0, 0.0, 2.0]]
    assert nonnegative_lstsq(rows, [2.0, 4.5, 6.0]) == pytest.approx([29 / 14, 0.0, 0.0])


def test_simulate_with_a_fitted_model_reproduces_a_hand_computed_makespan():
    """1F1B, 2 ranks, 2 microbatches of 200 and 100 tokens; one image encoder microbatch per LLM
    microbatch on rank 1 (e1 -> k1, e2 -> k2, 64 patches each). Coefficients from the fit of TRUE.

    By hand (ms): F0(200) = 1 + 4 + 0.12 = 5.12, F0(100) = 3.03, F1(200) = 6.62, F1(100) = 3.53,
    B0(200) = 10.24, B0(100) = 6.06, B1(200) = 13.24, B1(100) = 7.06, EF(64) = 0.4 + 0.64 + 0.08192 =
    1.12192 (tokens_sq = 64**2), EB(64) = 2.24384; messages: 50 us + 4096 B / 2 GB/s = 52.048 us; dispatch 0.1 ms.
    rank 1: EF1 [0, 1.12192], EF2 [1.22192, 2.34384]   (EF1, EF2 before 1F0: the flow below)
    rank 0: 0F0 needs EF1 at 1.12192 + .052048 = 1.173968 -> [1.173968, 6.293968]
            0F1 needs EF2 at 2.34384 + .052048 = 2.395888, rank free at 6.393968 -> [6.393968, 9.423968]
    rank 1: 1F0 needs 0F0 + msg = 6.346016 -> [6.346016, 12.966016]; 1B0 [13.066016, 26.306016]
            1F1 (0F1 + msg = 9.476016, free 26.406016) [26.406016, 29.936016]; 1B1 [30.036016, 37.096016]
    rank 0: 0B0 needs 1B0 + msg = 26.358064 -> [26.358064, 36.598064];
            0B1 needs 1B1 + msg = 37.148064 -> [37.148064, 43.208064]
    rank 1: EB1 needs 0B0 + msg = 36.650112, free 37.196016 -> [37.196016, 39.439856];
            EB2 needs 0B1 + msg = 43.260112 -> [43.260112, 45.503952]: makespan 45.503952 ms, plus the
            step overhead 20 ms = 65.503952 ms.
    """
    fitted = fit_cost_model(synthetic_records())
    schedule = Schedule1F1B(2, 2)
    flow = DataFlow({1: (1, (0, 1)), 2: (1, (0, 1)), -1: (1, (-2, 0)), -2: (1, (-2, 0))}, {1: [1], 2: [2]})
    flow.validate(schedule)
    step = fitted.for_step(
        2,
        {1: ActionTokens.single("llm", 200), 2: ActionTokens.single("llm", 100)},
        {1: ActionTokens.single("image", 64), 2: ActionTokens.single("image", 64)},
        llm_activation_bytes=4096.0,
        encoder_output_bytes={1: 4096.0, 2: 4096.0},
    )
    assert step.duration(Action(ActionKind.FORWARD, 0, 0)) == pytest.approx(5.12e-3, rel=1e-6)
    res = simulate(schedule, flow, step)
    assert res.makespan_s == pytest.approx(45.503952e-3, rel=1e-6)
    assert res.step_time_s == pytest.approx(65.503952e-3, rel=1e-6)
    ends = {ev.action: ev.end_s for ev in res.timelines[1]}
    assert ends["1B0"] == pytest.approx(26.306016e-3, rel=1e-6)


def test_cost_model_predict_names_missing_coefficients():
    c = CostModel(coefficients={cost_key("F", 0, "llm"): TokenCost(0.0, 1.0)})
    assert c.predict("F", 0, ActionTokens.single("llm", 3)) == 3.0
    assert c.predict("F", 0, ActionTokens({"llm": (0, 0)})) == 0.0  # no tokens: no time
    with pytest.raises(KeyError, match="no coefficients for 'B0:llm'"):
        c.predict("B", 0, ActionTokens.single("llm", 3))
    with pytest.raises(ValueError, match=r"TokenCost\.per_token_s must be finite and >= 0"):
        TokenCost(0.0, -1.0)


def test_records_of_simulated_timelines_fit_back_to_the_model_that_made_them():
    """A CostModel with TRUE's coefficients times several steps (uniform_on_demand flow, random token
    counts); the simulated timelines become records (``action_records``, waits = the gaps, since this
    model has no dispatch time), the fit recovers TRUE and no dispatch, and the fitted model predicts a
    new step's makespan exactly."""
    rng = random.Random(3)
    s = Schedule1F1B(2, 4)
    enc = {k: [2 * k - 1, 2 * k] for k in range(1, 5)}
    true = CostModel(coefficients=TRUE, llm_forward_s=[0.01, 0.01], llm_backward_s=[0.02, 0.02])

    def step_tokens():
        llm = {k: ActionTokens.single("llm", rng.randint(50, 500)) for k in enc}
        mods = {}
        for e in (e for es in enc.values() for e in es):
            kinds = rng.choice([["image"], ["audio"], ["image", "audio"]])
            mods[e] = ActionTokens(
                {m: (n, n * n * rng.randint(1, 2)) for m in kinds for n in [rng.randint(8, 300)]}
            )
        return llm, mods

    recs = RunRecords()
    for step in range(5):
        llm, mods = step_tokens()
        costs = true.for_step(2, llm, mods)
        res = simulate(s, uniform_on_demand(s, enc, costs), costs)
        for timeline in res.timelines.values():
            # no dispatch in this model: every gap between two actions is a wait on an input
            waits = {b.action: b.start_s - a.end_s for a, b in itertools.pairwise(timeline)}
            for r in action_records(step, timeline, llm, mods, waits):
                recs.add(r)
    fitted = fit_cost_model(recs)
    assert fitted.dispatch_s == pytest.approx(0.0, abs=1e-12)
    for key, t in TRUE.items():
        got = fitted.coefficients[key]
        assert (got.base_s, got.per_token_s, got.per_token_sq_s) == pytest.approx(
            (t.base_s, t.per_token_s, t.per_token_sq_s), rel=1e-6, abs=1e-12
        ), key
    llm, mods = step_tokens()
    want = true.for_step(2, llm, mods)
    got = fitted.for_step(2, llm, mods)
    flow = uniform_on_demand(s, enc, want)
    assert simulate(s, flow, got).makespan_s == pytest.approx(simulate(s, flow, want).makespan_s, rel=1e-9)


def test_flow_of_a_step_is_the_last_recorded_and_sees_records_added_later():
    """A resumed run records a step's flow again (the later one is what ran); the lookup index is
    rebuilt after records are added."""
    a = DataFlow({1: (1, (0, 1)), -1: (1, (-2, 0))}, {1: [1]})
    b = DataFlow({1: (0, (0, 1)), -1: (0, (-2, 0))}, {1: [1]})
    records = RunRecords()
    for step in range(50):
        records.add(FlowRecord(step, a.to_json()))
    records.add(FlowRecord(7, b.to_json()))  # step 7 again, after a resume
    assert records.flow(7).to_json() == b.to_json()
    assert records.flow(8).to_json() == a.to_json()
    assert records.flow(50) is None
    records.add(FlowRecord(50, b.to_json()))
    assert records.flow(50).to_json() == b.to_json()
    assert [records.flow(s).to_json() == a.to_json() for s in range(50)].count(False) == 1
    # flows replaced by a list of the same length (e.g. the records of one step only): not the old index
    records.flows = [FlowRecord(s, b.to_json()) for s in range(len(records.flows))]
    assert records.flow(8).to_json() == b.to_json()
    with pytest.raises(TypeError):
        RunRecords(_flow_index=(0, {}))  # the index is not a field a caller sets
