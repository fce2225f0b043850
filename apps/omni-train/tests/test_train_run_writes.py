"""RunWrites: rank 0's run files written in order on a thread of their own, errors back to the trainer;
and in a real (one-process) run: a checkpoint commits only once the earlier steps' rows are on disk, a
failed write stops the run (named) before the next checkpoint, and a run stopped by an error leaves the
rows of its finished steps on disk and no writes thread behind."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config

from omni_parallel.testing import run_world
from omni_pipeline import RECORDS_FILE
from omni_train.binder import load_config
from omni_train.run_writes import RunWrites


def test_writes_run_in_order_off_the_caller_and_drain_waits_for_them():
    gate, seen, threads = threading.Event(), [], set()

    def write(i: int) -> None:
        gate.wait(timeout=30)
        threads.add(threading.get_ident())
        seen.append(i)

    w = RunWrites()
    for i in range(20):
        w.submit(f"write {i}", write, i)  # returns at once: the first write still waits on the gate
    assert seen == []
    gate.set()
    w.drain()
    assert seen == list(range(20))
    assert threads and threading.get_ident() not in threads
    w.close()


def test_a_failed_write_is_raised_named_with_its_cause_and_nothing_after_it_runs():
    gate, seen = threading.Event(), []

    def fail() -> None:
        gate.wait(timeout=30)  # fails only once the next write is queued behind it
        raise OSError(28, "No space left on device")

    w = RunWrites()
    w.submit("run/metrics.jsonl, step 3", fail)
    w.submit("run/metrics.jsonl, step 4", seen.append, 1)
    gate.set()
    with pytest.raises(
        RuntimeError, match=r"writing run/metrics.jsonl, step 3 failed.*No space left"
    ) as info:
        w.drain()
    assert isinstance(info.value.__cause__, OSError)
    assert seen == []
    with pytest.raises(RuntimeError, match=r"step 3 failed") as again:  # every later call says why
        w.submit("run/metrics.jsonl, step 5", seen.append, 2)
    assert again.value is info.value
    with pytest.raises(RuntimeError, match=r"step 3 failed"):
        w.close()
    assert seen == []


def test_a_write_error_surfaces_at_the_next_submit_once_it_happened():
    w = RunWrites()
    w.submit("x", lambda: 1 / 0)
    w._pending[-1][1].exception(timeout=30)  # let it fail
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        w.submit("y", print, "never")
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        w.close()  # the thread is stopped all the same
    assert w._pool._shutdown


def _steps_in(path: Path) -> list[int]:
    lines = path.read_text().splitlines() if path.exists() else []
    return sorted({json.loads(line)["step"] for line in lines})


def _lagging_then_failing_runs(rank, world_size, cfg, root):
    """Two runs of 4 steps (checkpoint after steps 1 and 3) with the writes thread made to lag (sleeps
    around the real writes): one stopped by an error at step 3, one whose records write of step 1 fails."""
    import time

    from omni_pipeline import RecordWriter
    from omni_train.checkpointing import TrainCheckpoint
    from omni_train.metrics import MetricsLogger
    from omni_train.trainer import Trainer

    log, write, save = MetricsLogger.log, RecordWriter.write, TrainCheckpoint.save
    log_lag, write_lag = {1: 0.5, 2: 1.5}, {1: 0.5}  # seconds, by step
    at_save: dict[int, tuple[list[int], list[int]]] = {}

    def lagging_log(self, step, metrics):
        time.sleep(log_lag.get(step, 0.0))
        log(self, step, metrics)

    def lagging_write(self, records):
        records = list(records)
        time.sleep(write_lag.get(records[0].step, 0.0))
        write(self, records)

    def seeing_save(self, next_step):
        at_save[next_step] = (_steps_in(crashed / "metrics.jsonl"), _steps_in(crashed / RECORDS_FILE))
        save(self, next_step)

    def crash(step, inputs, result):
        if step == 3:
            raise RuntimeError("injected at step 3")

    crashed, failed = Path(root) / "crashed", Path(root) / "failed"
    MetricsLogger.log, RecordWriter.write, TrainCheckpoint.save = lagging_log, lagging_write, seeing_save
    try:
        Trainer(cfg, crashed, resume=False).run(after_backward=crash)
    except RuntimeError as e:
        assert "injected at step 3" in str(e), e
        # while the error (its traceback) still holds the run
        writers = [t.name for t in threading.enumerate() if t.name.startswith("omni-train-writes")]
        on_disk = (_steps_in(crashed / "metrics.jsonl"), _steps_in(crashed / RECORDS_FILE))
    else:
        raise AssertionError("the injected error did not stop the run")

    def failing_write(self, records):
        records = list(records)
        if records[0].step == 1:
            raise OSError(28, "No space left on device")
        write(self, records)

    MetricsLogger.log, RecordWriter.write, TrainCheckpoint.save = log, failing_write, save
    trainer = Trainer(cfg, failed, resume=False)
    try:
        trainer.run()
    except RuntimeError as e:
        message = str(e)
    else:
        raise AssertionError("the failed write did not stop the run")
    return at_save, writers, on_disk, message, trainer.checkpoint.steps(), _steps_in(failed / "metrics.jsonl")


@pytest.mark.slow
def test_run_files_are_on_disk_before_a_checkpoint_and_after_an_error(tmp_path):
    data = make_dataset(tmp_path / "data", n_image=8, n_audio=4, n_text=8)
    cfg = load_config(str(write_config(tmp_path / "c.toml", data, steps=4, every=2, pp=1)))
    (at_save, writers, on_disk, message, committed, failed_rows) = run_world(
        _lagging_then_failing_runs, 1, args=(cfg, str(tmp_path)), timeout_s=300
    )[0]
    # the checkpoint of step 2 starts once steps 0 and 1 are in both files
    assert at_save == {2: ([0, 1], [0, 1])}
    # the error at step 3 left step 2's rows (still being written when it came) on disk, no thread behind
    assert writers == []
    assert on_disk == ([0, 1, 2], [0, 1, 2])
    # a failed write: raised naming the file and step, the run stopped before the checkpoint of step 2
    failed = tmp_path / "failed"
    want = f"writing {failed / RECORDS_FILE}, step 1 failed: OSError(28, 'No space left on device')"
    assert want in message
    assert committed == []
    assert failed_rows == [0]  # step 1's row is queued behind the failed write: not written
