"""Resuming from an older committed step (``Trainer(resume_step=N)``, ``omni-train run --resume
--resume-step N``) when the newest step is damaged: the newer step directories are set aside, the run goes
on from N, and its losses, metrics and checkpoints equal an uninterrupted run's (the oracle: the same
config trained once without interruption, compared bit for bit)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config

from omni_parallel.testing import WorldError, run_world
from omni_train.binder import load_config

pytestmark = pytest.mark.slow


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train(rank, world_size, cfg, runs):
    from omni_train.trainer import Trainer

    for out, resume, step in runs:
        Trainer(cfg, Path(out), resume=resume, resume_step=step).run()


def _damage(step_dir: Path) -> None:
    for f in step_dir.glob("rank-*.safetensors"):  # every rank's file: each fails its load
        raw = bytearray(f.read_bytes())
        raw[-64] ^= 0x10
        f.write_bytes(bytes(raw))


def _restarted_worker(rank, world_size, cfg, out):
    import os

    from omni_train.worker import worker_main

    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # as torchrun's elastic agent sets it on a restart
    worker_main(cfg, out, True, 4)


def test_resume_from_an_older_step_when_the_newest_is_damaged_reproduces_the_run(tmp_path):
    data = make_dataset(tmp_path / "data")
    config = write_config(tmp_path / "c.toml", data, steps=6, every=2)
    cfg = load_config(str(config))
    a, b = tmp_path / "a", tmp_path / "b"
    run_world(_train, 2, timeout_s=600, args=(cfg, [(str(a), False, None), (str(b), False, None)]))
    assert _losses(a) == _losses(b) and len(_losses(a)) == 6
    ckpt = b / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000004", "step-00000006"]
    _damage(ckpt / "step-00000006")
    # a plain resume fails on the damage, naming the file and what to do about it
    with pytest.raises(WorldError) as failed:
        run_world(_train, 2, timeout_s=600, args=(cfg, [(str(b), True, None)]))
    assert "step-00000006/rank-0000" in str(failed.value) and "checksum mismatch" in str(failed.value)
    assert "to resume from an older committed step (4): omni-train run --resume --resume-step N" in str(
        failed.value
    )

    run_world(_train, 2, timeout_s=600, args=(cfg, [(str(b), True, 4)]))
    assert _losses(b) == _losses(a)  # steps 5 and 6 trained again, bit for bit; one line per step
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "latest", "step-00000004", "step-00000006", "step-00000006.rolled-back-to-4",
    ]  # fmt: skip
    assert (ckpt / "latest").read_text() == "step-00000006"
    summary = json.loads((b / "summary.json").read_text())
    assert summary["resumed_from"] == 4

    # the same from the command line, on the run as it is now: finished (its newest step is train.steps,
    # which a plain --resume takes for done) and the newest step damaged again
    _damage(ckpt / "step-00000006")
    argv = ["run", "--config", str(config), "--out", str(b), "--resume", "--resume-step", "4"]
    p = subprocess.run([sys.executable, "-m", "omni_train.cli", *argv], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (
        "omni-train: rolled back to step 4; newer steps set aside (kept): step-00000006.rolled-back-to-4.2"
        in p.stderr
    ), p.stderr
    assert _losses(b) == _losses(a)
    assert (ckpt / "step-00000006.rolled-back-to-4.2").is_dir() and (ckpt / "step-00000006").is_dir()

    # a worker that torchrun restarted (its command line still says --resume-step 4) resumes from the
    # newest step: what it saved after the roll back is not set aside again
    names = {f.name for f in ckpt.iterdir()}
    longer = load_config(str(config), [("train.steps", "8")])
    run_world(_restarted_worker, 2, timeout_s=600, args=(longer, str(b)))
    assert {f.name for f in ckpt.iterdir()} == names - {"step-00000004"} | {"step-00000008"}  # keep_last 2
    assert _losses(b)[:6] == _losses(a) and len(_losses(b)) == 8
