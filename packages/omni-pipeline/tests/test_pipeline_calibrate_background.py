"""Each process's CPU outside its recorded actions (``omni_pipeline.calibrate.fit_process_cpu``) and how
``host_step_s`` lets it compete for a host's cores, against hand-worked steps and a brute-force
time-stepped processor-sharing simulation; the step records' ``cpu_s`` / ``pipeline_cpu_s`` round trip."""

from __future__ import annotations

import json

import pytest

from omni_pipeline.calibrate import ProcessCpu, fit_process_cpu, host_step_s
from omni_pipeline.cost import CostModel
from omni_pipeline.graph import llm_encoder_deps
from omni_pipeline.records import (
    ActionRecord,
    RecordError,
    RecordWriter,
    RunRecords,
    StepRecord,
    read_records,
)
from omni_pipeline.schedules import Schedule1F1B


def _act(step: int, rank: int, mb: int, start: float, end: float, wait: float = 0.0) -> ActionRecord:
    return ActionRecord(step, rank, "F", rank, mb, {"llm": 10}, {"llm": 100}, start, end, wait)


def test_fit_process_cpu_by_hand():
    recs = RunRecords()
    # step 0 is warm-up (skipped): absurd numbers that would show in the means
    recs.add(_act(0, 0, 1, 0.0, 1.0))
    recs.add(StepRecord(0, 0, 50.0, 1.0, cpu_s=40.0, pipeline_cpu_s=30.0))
    # step 1, rank 0: actions 1.0 + 0.8 s, the gap 1.0 -> 1.2 of which 0.1 s waited: 0.1 s of dispatch;
    # pipeline CPU 2.0 -> background 2.0 - 1.8 - 0.1 = 0.1; step CPU 2.3 -> outside 0.3
    recs.add(_act(1, 0, 1, 0.0, 1.0))
    recs.add(_act(1, 0, 2, 1.2, 2.0, wait=0.1))
    recs.add(StepRecord(1, 0, 2.5, 2.0, cpu_s=2.3, pipeline_cpu_s=2.0))
    # step 1, rank 1: one action of 0.5 s, pipeline CPU 0.8 -> background 0.3; step CPU 0.9 -> outside 0.1
    recs.add(_act(1, 1, 1, 0.2, 0.7, wait=0.2))
    recs.add(StepRecord(1, 1, 2.5, 0.7, cpu_s=0.9, pipeline_cpu_s=0.8))
    # step 2, rank 0: no action recorded (e.g. a rank with nothing to run): all its pipeline CPU is
    # background 0.2; outside 0.4
    recs.add(StepRecord(2, 0, 1.0, 0.0, cpu_s=0.6, pipeline_cpu_s=0.2))
    # step 2, rank 1: written before CPU was recorded: not counted
    recs.add(StepRecord(2, 1, 1.0, 0.0))
    got = fit_process_cpu(recs, skip_steps=1)
    assert got.background_s == pytest.approx((0.1 + 0.3 + 0.2) / 3, abs=1e-12)
    assert got.outside_s == pytest.approx((0.3 + 0.1 + 0.4) / 3, abs=1e-12)
    # no CPU in any record: no fit (the caller keeps the model without it)
    assert fit_process_cpu(RunRecords(steps=[StepRecord(0, 0, 1.0, 0.5)])) is None
    # actions longer than the CPU (a host shared with other work): clamped at 0, not negative
    shared = RunRecords([_act(0, 0, 1, 0.0, 2.0)], steps=[StepRecord(0, 0, 2.5, 2.0, 1.5, 1.0)])
    assert fit_process_cpu(shared) == ProcessCpu(0.0, 0.5)
    with pytest.raises(ValueError, match="finite and >= 0"):
        ProcessCpu(-0.1, 0.0)


SCHEDULE = Schedule1F1B(2, 2)  # F 1 s, B 2 s per stage: 12 s of actions, 9 s as simulated with a core each
COSTS = CostModel(llm_forward_s=1.0, llm_backward_s=2.0, step_overhead_s=0.1)


def test_host_step_with_process_cpu_by_hand():
    def step(processes, cores, cpu):
        return host_step_s(SCHEDULE, None, COSTS, processes=processes, cores=cores, process_cpu=cpu)

    # no CPU beyond the time outside the pipeline, all of it CPU: the model without process_cpu
    for p, c in ((2, 2), (2, 1), (4, 2)):
        assert step(p, c, ProcessCpu(0.0, 0.1)) == pytest.approx(step(p, c, None))
    # one core for both ranks: it never idles, so the pipeline ends after all 12 s of actions and both
    # ranks' 0.5 s of background; outside: 0.05 s of waits as they are, 0.05 s of CPU twice as long
    assert step(2, 1, ProcessCpu(0.5, 0.05)) == pytest.approx(12.0 + 2 * 0.5 + 0.05 + 2 * 0.05)
    # a core each: at the start rank 0's F1 and both background jobs share 2 cores (2/3 each) until the
    # background is done at 0.75 s (F1 then 0.5 s in); F1 ends at 1.25, and the rest of the step runs as
    # the simulator's 9 s, 0.25 s late; outside: 0.1 s, of which 0.05 s CPU (not stretched: a core each)
    assert step(2, 2, ProcessCpu(0.5, 0.05)) == pytest.approx(9.25 + 0.1)
    # more CPU outside the pipeline than its wall seconds (a rank busy while another waits): all of it
    # CPU, stretched
    assert step(2, 1, ProcessCpu(0.0, 0.3)) == pytest.approx(12.0 + 0.3 * 2)


def _brute_force(schedule, costs, *, share: float, background: float, dt: float) -> float:
    """The pipeline's end under processor sharing, time-stepped by ``dt``: each step every runnable job
    (a rank whose next action's inputs have arrived; a background job with work left) progresses by
    ``dt * min(1, share / jobs)``. Written out independently of ``host_step_s``'s event loop."""
    programs = schedule.programs()
    deps = llm_encoder_deps(schedule.num_stages, {})
    rank_of = {a: r for r, prog in programs.items() for a in prog}
    pos = dict.fromkeys(programs, 0)
    left = {r: costs.duration(prog[0]) for r, prog in programs.items()}
    bg = dict.fromkeys(programs, background)
    end: dict = {}
    t = 0.0
    while any(pos[r] < len(p) for r, p in programs.items()) or any(v > 0 for v in bg.values()):
        runnable = []
        for r, prog in programs.items():
            if pos[r] >= len(prog):
                continue
            a = prog[pos[r]]
            arrived = [
                end[d] + (costs.transfer_s(costs.message_bytes(d, a)) if rank_of[d] != r else 0.0)
                for d in deps(a)
                if d in end
            ]
            if len(arrived) == len(deps(a)) and all(x <= t + 1e-12 for x in arrived):
                runnable.append(r)
        jobs = len(runnable) + sum(v > 0 for v in bg.values())
        rate = min(1.0, share / jobs) if jobs else 0.0
        t += dt
        for r in bg:
            if bg[r] > 0:
                bg[r] -= dt * rate
        for r in runnable:
            left[r] -= dt * rate
            if left[r] <= 1e-12:
                end[programs[r][pos[r]]] = t
                pos[r] += 1
                if pos[r] < len(programs[r]):
                    left[r] = costs.duration(programs[r][pos[r]])
    return t


@pytest.mark.parametrize(("processes", "cores", "background"), [(2, 2, 0.7), (4, 2, 1.3), (2, 1, 0.4)])
def test_host_step_with_background_matches_brute_force(processes, cores, background):
    # activations cross ranks after 0.3 s: waits the background fills, as the actions' work does not
    costs = CostModel(llm_forward_s=[1.0, 0.6], llm_backward_s=[1.5, 1.2], p2p_latency_s=0.3)
    cpu = ProcessCpu(background, 0.0)
    got = host_step_s(SCHEDULE, None, costs, processes=processes, cores=cores, process_cpu=cpu)
    share = cores * 2 / processes
    want = _brute_force(SCHEDULE, costs, share=share, background=background, dt=1e-3)
    assert got == pytest.approx(want, abs=5e-3)
    # and the background costs time only where cores are short
    assert got >= host_step_s(SCHEDULE, None, costs, processes=processes, cores=cores) - 1e-9


def test_step_record_cpu_round_trip(tmp_path):
    with RecordWriter(tmp_path / "actions.jsonl") as w:
        w.write([StepRecord(3, 1, 0.5, 0.4, cpu_s=0.45, pipeline_cpu_s=0.4), StepRecord(3, 0, 0.5, 0.4)])
    got = read_records(tmp_path)
    assert got.steps == [StepRecord(3, 1, 0.5, 0.4, 0.45, 0.4), StepRecord(3, 0, 0.5, 0.4, None, None)]
    bad = {"type": "step", "step": 0, "rank": 0, "step_s": 1.0, "actions_end_s": 0.5, "pipeline_cpu_s": -1}
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(RecordError, match=r"bad\.jsonl:1: step_s, actions_end_s, cpu_s and pipeline_cpu_s"):
        read_records(tmp_path / "bad.jsonl")
    # the executor's CPU over more than the whole step's: refused, naming the field, the rank and the step
    over = {"type": "step", "step": 7, "rank": 2, "step_s": 1.0, "actions_end_s": 0.5}
    (tmp_path / "over.jsonl").write_text(json.dumps({**over, "cpu_s": 0.3, "pipeline_cpu_s": 0.4}) + "\n")
    with pytest.raises(
        RecordError, match=r"over\.jsonl:1: field 'pipeline_cpu_s' of rank 2 step 7 .*cpu_s 0\.3"
    ):
        read_records(tmp_path / "over.jsonl")
    # equal (all the step's CPU in the executor) is kept
    (tmp_path / "eq.jsonl").write_text(json.dumps({**over, "cpu_s": 0.4, "pipeline_cpu_s": 0.4}) + "\n")
    assert read_records(tmp_path / "eq.jsonl").steps == [StepRecord(7, 2, 1.0, 0.5, 0.4, 0.4)]
