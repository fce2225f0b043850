"""What a real 2-process pp=2 run measures about itself, checked against brute force from its own files:

* ``summary.json`` ``tokens_per_s`` is the run's tokens over the summed step times of ``metrics.jsonl``;
* ``actions.jsonl`` holds every F/B of both stages per step with the pack's tokens (their sum is the
  step's ``tokens``), the encoder actions with their towers' tokens, the activation receives of rank 1
  and one step record per rank; a cost model fits it and ``omni-train simulate --calibration`` predicts
  the run's own flow from it;
* ``time_s_per_rank``: every phase >= 0, the LLM and encoder phases equal the recorded actions' seconds,
  and the phases of a rank sum to its recorded step wall time (the slowest rank's is ``step_time_s``);
  each step record carries the process's CPU seconds over the step and over the executor's step within
  it (``0 < pipeline_cpu_s <= cpu_s <= cores x step_s``).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config

from omni_parallel.testing import run_world
from omni_pipeline import fit_cost_model, read_records
from omni_pipeline.calibrate import fit_process_cpu
from omni_pipeline.step_metrics import PHASES
from omni_train.binder import load_config
from omni_train.cli import main

pytestmark = pytest.mark.slow

STEPS = 3


def _train(rank, world_size, cfg, out):
    from omni_train.trainer import Trainer

    Trainer(cfg, Path(out), resume=False).run()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    data = make_dataset(root / "data", n_image=12, n_audio=6, n_text=12)
    cfg_path = write_config(root / "c.toml", data, steps=STEPS, every=2)
    run_world(_train, 2, args=(load_config(str(cfg_path)), str(root / "run")), timeout_s=300)
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return root / "run", cfg_path, rows


def test_summary_throughput_is_total_tokens_over_total_step_time(run):
    out, _, rows = run
    summary = json.loads((out / "summary.json").read_text())
    total_tokens, total_s = 0.0, 0.0
    for r in rows:
        total_tokens += r["tokens"]
        total_s += r["step_time_s"]
    assert len(rows) == STEPS
    assert summary["tokens_per_s"] == pytest.approx(total_tokens / total_s, rel=1e-12)


def test_actions_jsonl_records_every_action_and_calibrates_simulate(run, tmp_path, capsys):
    out, cfg_path, rows = run
    rec = read_records(out)
    microbatches = load_config(str(cfg_path)).data.microbatches
    assert rec.step_ids == list(range(STEPS))
    for step, row in enumerate(rows):
        acts = [a for a in rec.actions if a.step == step]
        for kind in ("F", "B"):
            for stage in (0, 1):
                got = sorted(a.microbatch for a in acts if a.kind == kind and a.stage == stage)
                assert got == list(range(microbatches)), (step, kind, stage)
                assert {a.rank for a in acts if a.kind == kind and a.stage == stage} == {stage}
        assert sum(a.tokens["llm"] for a in acts if a.kind == "F" and a.stage == 0) == row["tokens"]
        enc = [a for a in acts if a.kind == "EF"]
        assert enc and all(set(a.tokens) <= {"image", "audio"} for a in enc)
        assert sum(sum(a.tokens.values()) for a in enc) > 0
        recv = [p for p in rec.p2p if p.step == step and p.what == "activation"]
        assert sorted(p.microbatch for p in recv) == list(range(microbatches))
        assert all(p.src == 0 and p.dst == 1 and p.bytes > 0 for p in recv)
        assert sorted(s.rank for s in rec.steps if s.step == step) == [0, 1]

    fitted = fit_cost_model(rec, skip_steps=1)
    assert {"F0:llm", "B0:llm", "F1:llm", "B1:llm"} <= set(fitted.coefficients)
    sim = tmp_path / "sim"
    argv = ["simulate", "--config", str(cfg_path), "--calibration", str(out), "--steps", "2"]
    assert main([*argv, "--first-step", "1", "--out", str(sim)]) == 0
    assert "as run: predicted" in capsys.readouterr().out
    as_run = json.loads((sim / "simulate.json").read_text())["results"]["as run"]
    assert as_run["step_time_s"] > 0 and as_run["measured_step_time_s"] == pytest.approx(
        (rows[1]["step_time_s"] + rows[2]["step_time_s"]) / 2
    )


def test_time_breakdown_sums_to_each_ranks_step_time(run):
    out, _, rows = run
    rec = read_records(out)
    seconds: dict[tuple[int, int, str], float] = defaultdict(float)
    for a in rec.actions:
        seconds[(a.step, a.rank, "encoder" if a.stage is None else "llm")] += a.seconds
    wall = {(s.step, s.rank): s.step_s for s in rec.steps}
    for s in rec.steps:  # the process's CPU over the step, and over the executor's step within it
        assert 0 < s.pipeline_cpu_s <= s.cpu_s <= s.step_s * (os.cpu_count() or 1) + 1e-3, s
    for step, row in enumerate(rows):
        phases = row["time_s_per_rank"]
        assert sorted(phases) == sorted(PHASES)
        for rank in (0, 1):
            assert all(phases[p][rank] >= -1e-9 for p in PHASES), (step, rank, phases)
            assert sum(phases[p][rank] for p in PHASES) == pytest.approx(wall[(step, rank)], rel=1e-9)
            for p in ("llm", "encoder"):
                assert phases[p][rank] == pytest.approx(seconds[(step, rank, p)], rel=1e-9, abs=1e-12)
        assert row["step_time_s"] == pytest.approx(max(wall[(step, r)] for r in (0, 1)), rel=1e-12)
        assert phases["p2p_wait"][1] > 0  # rank 1 waits for stage 0's first activation
    # the checkpoint saved after step 1 (every = 2) counts in step 2
    assert rows[2]["time_s_per_rank"]["checkpoint"][0] > 0
    assert rows[1]["time_s_per_rank"]["checkpoint"] == [0.0, 0.0]


def test_step_records_mark_the_steps_a_checkpoint_save_overlapped(run):
    """The save after step 1 (``checkpoint.every = 2``, asynchronous: the default) starts inside step 2's
    CPU interval, so step 2's records are marked on both ranks; no save ran before steps 0 and 1 (the one
    after step 2, the last, falls in no step). ``fit_process_cpu`` leaves step 2 out."""
    out, _, _ = run
    rec = read_records(out)
    marks = {(s.step, s.rank): s.checkpoint_save for s in rec.steps}
    assert marks == {(step, rank): step == 2 for step in range(STEPS) for rank in (0, 1)}
    assert fit_process_cpu(rec, skip_steps=1).skipped_steps == 1
