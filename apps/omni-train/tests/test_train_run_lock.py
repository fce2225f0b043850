"""The run-directory lock (``omni_train.run_lock``): a second ``omni-train run`` into a ``--out`` that a
running run holds is refused before any worker starts, with one line naming the holder's pid and host
and the lock file, and the first run's ``metrics.jsonl`` holds its steps once each, in order (issue 29:
both started and the first's steps read ``[0, 0, 1, 1, 2, ...]``); a lock left by a run that is gone
is replaced with a notice; the lock is given back at the end of a run and on an exception; workers of
one ``torchrun`` job share it, another job is refused."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from train_fixtures import make_dataset, write_config

from omni_train.cli import main
from omni_train.config import ConfigError
from omni_train.run_lock import LOCK_NAME, LockHolder, acquire_run_lock, refuse_if_locked, torchrun_job


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write_lock(out, **fields) -> None:
    out.mkdir(parents=True, exist_ok=True)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": None, "job": None, "since": "t0"}
    (out / LOCK_NAME).write_text(json.dumps({**holder, **fields}))


@pytest.mark.slow
def test_a_second_run_into_a_running_runs_out_is_refused_before_any_worker(tmp_path, capsys):
    data = make_dataset(tmp_path / "data", n_image=4, n_audio=2, n_text=4)
    config = write_config(tmp_path / "c.toml", data, steps=10, every=4)
    out = tmp_path / "run"
    gone = _dead_pid()
    _write_lock(out, pid=gone, since="yesterday")  # a SIGKILLed run's lock: stale, replaced
    argv = ["run", "--config", str(config), "--out", str(out)]
    first = subprocess.Popen(
        [sys.executable, "-m", "omni_train.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().strip()):  # the first run is training
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "the first run never trained"
            time.sleep(0.05)
        started = time.monotonic()
        code = main(argv)  # the second run, in this process
        refused_in = time.monotonic() - started
        running = first.poll() is None
    finally:
        log, _ = first.communicate(timeout=600)
    err = capsys.readouterr().err
    assert code == 2, err
    assert running, "the first run ended before the second was refused; train it longer"
    assert first.returncode == 0, log
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(
        f"omni-train: configuration error: --out: {out} is in use by another omni-train run (pid {first.pid} on "
        f"{socket.gethostname()}, since "
    ), err
    assert f"lock {out / LOCK_NAME}" in lines[0], err
    assert refused_in < 30, refused_in  # no worker was started (a start takes longer than training here)
    # the first run alone wrote its history: every step once, in order
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(10)), steps
    assert (
        f"omni-train: replaced a stale lock {out / LOCK_NAME} of a run that is gone (pid {gone} on" in log
    ), log
    assert not (out / LOCK_NAME).exists()  # given back at the end
    assert not [p.name for p in out.iterdir() if p.name.startswith(f".{LOCK_NAME}")]


def test_a_running_holder_is_named_and_refused(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "run"
        _write_lock(out, pid=sleeper.pid, since="2026-01-01T00:00:00Z")
        with pytest.raises(ConfigError) as refused:
            acquire_run_lock(out)
        want = (
            f"--out: {out} is in use by another omni-train run (pid {sleeper.pid} on {socket.gethostname()}, "
            f"since 2026-01-01T00:00:00Z); lock {out / LOCK_NAME}; wait for it to end or choose another --out "
            "(delete the lock only if that run is gone)"
        )
        assert str(refused.value) == want
        with pytest.raises(ConfigError) as peeked:
            refuse_if_locked(out)
        assert str(peeked.value) == want
    finally:
        sleeper.kill()
        sleeper.wait()
    # its holder gone, the same lock is stale: replaced, with a notice
    notices: list[str] = []
    with acquire_run_lock(out, notice=notices.append) as lock:
        assert lock.owner and json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert len(notices) == 1 and f"(pid {sleeper.pid} on {socket.gethostname()}" in notices[0]
    assert not (out / LOCK_NAME).exists()


def test_a_reused_pid_and_another_host(tmp_path):
    out = tmp_path / "run"
    # this very process's pid with another start time: the holder died and its pid was given to us
    _write_lock(out, started=1)
    notices: list[str] = []
    lock = acquire_run_lock(out, notice=notices.append)
    assert lock.owner and len(notices) == 1
    lock.release()
    # another host: cannot be checked from here, so never taken for stale
    _write_lock(out, host="elsewhere-node-7", pid=_dead_pid())
    with pytest.raises(
        ConfigError, match=r"on elsewhere-node-7, since t0\) \(another host: cannot tell from here"
    ):
        acquire_run_lock(out)
    (out / LOCK_NAME).write_text("{not json")
    with pytest.raises(
        ConfigError, match=rf"holds a lock file {out / LOCK_NAME} that is not an omni-train lock"
    ):
        acquire_run_lock(out)


def test_the_lock_is_given_back_on_an_exception_and_not_taken_twice(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError), acquire_run_lock(out):
        assert LockHolder(**json.loads((out / LOCK_NAME).read_text())).running() is True
        with pytest.raises(ConfigError, match=rf"pid {os.getpid()} on "):
            acquire_run_lock(out)  # this process again, without a job: refused like any other run
        raise RuntimeError("a worker failed")
    assert not (out / LOCK_NAME).exists()


def test_workers_of_one_torchrun_job_share_the_lock(tmp_path):
    out = tmp_path / "run"
    first = acquire_run_lock(out, job="job-a")
    joined = acquire_run_lock(out, job="job-a")  # another rank (or a restarted worker) of the same job
    assert first.owner and not joined.owner
    refuse_if_locked(out, job="job-a")
    with pytest.raises(ConfigError, match=r"torchrun job job-a, since"):
        acquire_run_lock(out, job="job-b")
    joined.release()  # a joiner leaves the file to the rank that created it
    assert (out / LOCK_NAME).exists()
    first.release()
    assert not (out / LOCK_NAME).exists()
    # the creating rank died and the job's workers were restarted: one of them takes the lock over, quietly
    _write_lock(out, pid=_dead_pid(), job="job-a")
    notices: list[str] = []
    again = acquire_run_lock(out, job="job-a", notice=notices.append)
    assert again.owner and notices == []
    again.release()


def test_the_job_identity_every_rank_of_a_job_shares(monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert torchrun_job() is None  # not a distributed worker: the process alone holds the lock
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert torchrun_job() == "job@10.0.0.1:29500"  # a launcher that sets only the master (srun, mpirun)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id: every job would share it
    assert torchrun_job() == "none@10.0.0.1:29500"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "omni-1234")
    assert torchrun_job() == "omni-1234"
