"""A stopped worker no longer hangs the run: ``SIGSTOP`` on worker rank 1 of a 2-process ``omni-train run``
mid-training (the issue's reproduction; before the watchdog the run was still alive 301 s later, silent)
ends the run within ``train.hang_timeout_s`` + 30 s with one line naming the rank, its host and pid (the
process the test stopped), the step and its last pipeline action, and no traceback."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_fixtures import make_dataset, spawned_workers, write_config

pytestmark = pytest.mark.slow

HANG_S = 5


def _rows(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len([ln for ln in path.read_text().splitlines() if ln.strip()]) if path.exists() else 0


def test_a_stopped_worker_is_named_and_the_run_ends_in_bounded_time(tmp_path):
    data = make_dataset(tmp_path / "data")
    config = write_config(tmp_path / "c.toml", data, steps=200, every=0)
    out = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, "-m", "omni_train.cli", "run", "--config", str(config), "--out", str(out),
         "--train.hang_timeout_s", str(HANG_S)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    stopped = None
    try:
        deadline = time.monotonic() + 300
        while _rows(out) < 3:
            assert p.poll() is None, p.communicate()[0]
            assert time.monotonic() < deadline, "the run logged no third step"
            time.sleep(0.02)
        workers = spawned_workers(p.pid)
        assert len(workers) == 2, workers
        stopped = workers[1]
        os.kill(stopped, signal.SIGSTOP)
        t_stop = time.monotonic()
        said, _ = p.communicate(timeout=HANG_S + 60)
        elapsed = time.monotonic() - t_stop
    finally:
        if p.poll() is None:
            p.kill()
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
    assert elapsed < HANG_S + 30, (elapsed, said)
    assert p.returncode == 1, said
    assert "Traceback" not in said, said
    last = said.strip().splitlines()[-1]
    m = re.fullmatch(
        rf"omni-train: rank 1 \(host {re.escape(socket.gethostname())}, pid {stopped}\) hung at step (\d+), "
        rf"last pipeline action (\S+): no heartbeat for [\d.]+ s \(hang timeout {HANG_S} s, seen by rank 0\); "
        r"no restarts left",
        last,
    )
    assert m, said
    step = int(m.group(1))
    logged = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    # the step it stopped in, as of its last beat (one per step): rank 0 may have logged one more or less
    assert logged[-1] - 1 <= step <= logged[-1] + 1, (step, logged)
    assert re.fullmatch(r"\d*(F|B|EF|EB)\d+", m.group(2)), m.group(2)  # e.g. 1F0, 1B1, EF3
