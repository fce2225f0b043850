"""Step records marked by a checkpoint save in flight (``StepRecord.checkpoint_save``) and
``fit_process_cpu`` leaving such steps out: the field round-trips through a records file, records written
before it load as unknown (``None``, counted as unmarked), a mistyped value is refused naming the field, and
the fit over hand-made records equals the hand mean of the unmarked steps. The trainer's marking is checked
on a real run in ``apps/omni-train/tests/test_train_records.py``."""

from __future__ import annotations

import json

import pytest

from omni_pipeline.calibrate import fit_process_cpu
from omni_pipeline.records import RecordError, RecordWriter, RunRecords, StepRecord, read_records


def test_step_records_round_trip_with_and_without_the_checkpoint_mark(tmp_path):
    path = tmp_path / "actions.jsonl"
    written = [
        StepRecord(0, 0, 1.0, 0.5, 0.9, 0.4),  # unknown: None
        StepRecord(1, 0, 1.5, 0.5, 1.4, 0.4, checkpoint_save=True),
        StepRecord(2, 0, 1.0, 0.5, 0.9, 0.4, checkpoint_save=False),
    ]
    with RecordWriter(path) as w:
        w.write(written)
    # a record from before the field existed: no key at all
    old = {"type": "step", "step": 3, "rank": 0, "step_s": 1.0, "actions_end_s": 0.5, "cpu_s": 0.9}
    with path.open("a") as f:
        f.write(json.dumps(old) + "\n")
    got = read_records(path).steps
    assert got[:3] == written
    assert [r.checkpoint_save for r in got] == [None, True, False, None]
    assert got[3] == StepRecord(3, 0, 1.0, 0.5, 0.9, None)
    path.write_text(json.dumps({**old, "checkpoint_save": 1}) + "\n")  # an int is not a boolean
    with pytest.raises(
        RecordError, match=r"actions.jsonl:1: field 'checkpoint_save' must be true, false or null"
    ):
        read_records(path)


def test_fit_process_cpu_skips_the_steps_a_save_overlapped():
    recs = RunRecords()
    # per (step, rank): (cpu_s, pipeline_cpu_s, checkpoint_save); no actions, so background is the
    # pipeline CPU and outside is cpu_s - pipeline_cpu_s
    rows = {
        (0, 0): (90.0, 80.0, None),  # warm-up, skipped by skip_steps
        (1, 0): (0.5, 0.2, False),
        (1, 1): (0.7, 0.3, None),  # unknown: counted as unmarked
        (2, 0): (9.0, 5.0, True),  # a save in flight: a big CPU the fit must not see
        (2, 1): (0.6, 0.2, False),  # the same step on the other rank: left out too (the save is collective)
        (3, 0): (0.9, 0.4, False),
        (3, 1): (7.0, 3.0, True),
        (4, 0): (0.4, 0.1, False),
    }
    for (step, rank), (cpu, pipe, mark) in rows.items():
        recs.add(StepRecord(step, rank, 1.0, 0.0, cpu, pipe, checkpoint_save=mark))
    got = fit_process_cpu(recs, skip_steps=1)
    kept = [(0.5, 0.2), (0.7, 0.3), (0.4, 0.1)]  # steps 1 and 4
    assert got.background_s == pytest.approx(sum(p for _, p in kept) / 3, abs=1e-12)
    assert got.outside_s == pytest.approx(sum(c - p for c, p in kept) / 3, abs=1e-12)
    assert got.skipped_steps == 2
    # every step past the warm-up saving: nothing to fit
    only = RunRecords(
        steps=[StepRecord(0, 0, 1.0, 0.0, 0.3, 0.1), StepRecord(1, 0, 1.0, 0.0, 5.0, 1.0, True)]
    )
    assert fit_process_cpu(only, skip_steps=1) is None
    assert fit_process_cpu(only).skipped_steps == 1
    with pytest.raises(ValueError, match="skipped_steps"):
        type(got)(0.0, 0.0, skipped_steps=-1)
