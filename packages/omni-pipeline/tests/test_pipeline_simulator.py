"""Simulator against closed forms (1F1B / GPipe makespan, bubble, memory), hand-computed steps, scale."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from omni_pipeline import (
    CostModel,
    DataFlow,
    Schedule1F1B,
    ScheduleGPipe,
    prepend_first_stage,
    simulate,
    uniform_on_demand,
)


@pytest.mark.parametrize("cls", [Schedule1F1B, ScheduleGPipe])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 5), (4, 8), (4, 2), (8, 16)])
def test_llm_only_matches_closed_forms(cls, p, m):
    """F = 1, B = 2, free comms: makespan (m + p - 1) * 3, bubble (p - 1) / (m + p - 1) on every rank;
    1F1B keeps min(p - r, m) microbatches alive on rank r, GPipe all m (Narayanan et al. 2021)."""
    s = cls(p, m)
    r = simulate(
        s,
        None,
        CostModel(llm_forward_s=1.0, llm_backward_s=2.0, llm_stored_bytes=10.0, tokens_per_microbatch=100),
    )
    assert r.makespan_s == pytest.approx((m + p - 1) * 3)
    for rank in range(p):
        assert r.bubble_fraction[rank] == pytest.approx((p - 1) / (m + p - 1))
        live = min(p - rank, m) if cls is Schedule1F1B else m
        assert r.peak_activation_bytes[rank] == pytest.approx(10.0 * live)
    assert r.throughput_tokens_per_s == pytest.approx(100 * m / r.makespan_s)


def test_p2p_latency_and_bandwidth_on_the_critical_path():
    s = Schedule1F1B(2, 1)  # 0F0 -> 1F0 -> 1B0 -> 0B0: two messages
    costs = CostModel(
        llm_forward_s=1.0,
        llm_backward_s=2.0,
        p2p_latency_s=0.25,
        p2p_bandwidth_Bps=100.0,
        llm_activation_bytes=50.0,
    )
    assert simulate(s, None, costs).makespan_s == pytest.approx(1 + 0.75 + 1 + 2 + 0.75 + 2)


def test_encoder_work_prepended_on_one_rank_by_hand():
    s = Schedule1F1B(1, 2)
    enc = {1: [1], 2: [2, 3]}
    costs = CostModel(
        llm_forward_s=1.0,
        llm_backward_s=2.0,
        encoder_forward_s={1: 0.5, 2: 0.25, 3: 0.25},
        encoder_stored_bytes={1: 7.0, 2: 3.0, 3: 4.0},
        llm_stored_bytes=1.0,
        encoder_output_bytes={1: 2.0, 2: 1.0, 3: 1.0},
    )
    flow = prepend_first_stage(s, enc)
    r = simulate(s, flow, costs)
    # EF1 .5, 0F0 1, 0B0 2, EB1 1, EF2 .25, EF3 .25, 0F1 1, 0B1 2, EB2 .5, EB3 .5
    assert r.makespan_s == pytest.approx(9.0)
    assert [ev.action for ev in r.timelines[0]] == [
        "EF1",
        "0F0",
        "0B0",
        "EB1",
        "EF2",
        "EF3",
        "0F1",
        "0B1",
        "EB2",
        "EB3",
    ]
    assert r.encoder_busy_s[0] == pytest.approx(3.0)
    # peak: during 0F1: EF2 + EF3 stored (7) + outputs (2) + 0F1 (1) = 10; during 0F0: 7 + 2 + 1 = 10
    assert r.peak_activation_bytes[0] == pytest.approx(10.0)


def test_encoder_output_crosses_ranks_with_transfer_time():
    s = Schedule1F1B(2, 1)
    flow = DataFlow({1: (1, (0, 1)), -1: (1, (-1, 0))}, {1: [1]})
    flow.validate(s)
    costs = CostModel(llm_forward_s=1.0, llm_backward_s=2.0, encoder_forward_s={1: 3.0}, p2p_latency_s=0.5)
    r = simulate(s, flow, costs)
    # EF1 on rank 1 [0, 3], arrives at 3.5; 0F0 [3.5, 4.5]; 1F0 [5, 6]; 1B0 [6, 8]; 0B0 [8.5, 10.5]
    # EB1 needs the gradient (10.5 + .5) and runs after 1B0: [11, 17]
    events = {ev.action: (ev.start_s, ev.end_s) for ev in r.timelines[1]}
    assert events["EB1"] == pytest.approx((11.0, 17.0))
    assert r.makespan_s == pytest.approx(17.0)


def test_1024_ranks_pp8_64_microbatches_under_10_s(tmp_path):
    s = Schedule1F1B(8, 64)
    enc = {k: list(range(8 * (k - 1) + 1, 8 * k + 1)) for k in range(1, 65)}
    costs = CostModel(
        encoder_forward_s={e: 0.1 + 0.01 * (e % 7) for e in range(1, 513)},
        tokens_per_microbatch=16384,
        data_parallel=128,
        llm_stored_bytes=1e9,
        encoder_stored_bytes={e: 1e8 for e in range(1, 513)},
    )
    t0 = time.process_time()  # CPU seconds: independent of other jobs on shared CI cores
    flow = uniform_on_demand(s, enc, costs)
    r = simulate(s, flow, costs)
    elapsed = time.process_time() - t0
    assert elapsed < 10
    assert r.throughput_tokens_per_s == pytest.approx(16384 * 64 * 128 / r.makespan_s)
    base = simulate(s, prepend_first_stage(s, enc), costs)
    assert r.makespan_s < base.makespan_s and r.peak_activation_bytes[0] < base.peak_activation_bytes[0]


def test_cost_model_rejects_bad_values_naming_them():
    for kwargs, msg in (
        ({"llm_forward_s": -1.0}, "llm_forward_s must be >= 0"),
        ({"encoder_forward_s": {3: -0.5}}, r"encoder_forward_s must be >= 0, got \{3: -0.5\}"),
        ({"p2p_bandwidth_Bps": 0.0}, "p2p_bandwidth_Bps must be > 0"),
        ({"data_parallel": 0}, "data_parallel must be an int >= 1"),
    ):
        with pytest.raises(ValueError, match=msg):
            CostModel(**kwargs)
    with pytest.raises(ValueError, match="llm_forward_s has 2 per-stage values but stage 2 needs one"):
        simulate(ScheduleGPipe(3, 2), None, CostModel(llm_forward_s=[1.0, 2.0]))


def test_chrome_trace_and_png(tmp_path):
    s = Schedule1F1B(2, 2)
    flow = uniform_on_demand(s, {1: [1, 2], 2: [3, 4]})
    r = simulate(s, flow, CostModel(encoder_forward_s={e: 0.5 for e in range(1, 5)}))
    trace = json.loads(r.to_chrome_trace(tmp_path / "t.json").read_text())
    spans = [ev for ev in trace["traceEvents"] if ev["ph"] == "X"]
    assert len(spans) == 2 * 2 * 2 + 2 * 4
    assert {ev["cat"] for ev in spans} == {"llm", "encoder"} and {ev["tid"] for ev in spans} == {0, 1}
    png = r.plot(tmp_path / "t.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_readme_example_runs():
    readme = Path(__file__).resolve().parents[1] / "README.md"
    code = re.search(r"```python\n(.*?)```", readme.read_text(), re.S).group(1)
    exec(compile(code, str(readme), "exec"), {})
