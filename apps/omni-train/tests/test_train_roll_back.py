"""Resuming from an older committed step (``Trainer(resume_step=N)``, ``omni-train run --resume
--resume-step N``) when the newest step is damaged: the newer step directories are set aside, the run goes
on from N, and its losses, metrics and checkpoints equal an uninterrupted run's (the oracle: the same
config trained once without interruption, compared bit for bit)."""

import json
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config

from omni_parallel.testing import run_world
from omni_train.config import load_config

pytestmark = pytest.mark.slow


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train(rank, world_size, cfg, runs):
    from omni_train.trainer import Trainer

    for out, resume, step in runs:
        Trainer(cfg, Path(out), resume=resume, resume_step=step).run()


def test_resume_from_an_older_step_when_the_newest_is_damaged_reproduces_the_run(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = load_config(str(write_config(tmp_path / "c.toml", data, steps=6, every=2)))
    a, b = tmp_path / "a", tmp_path / "b"
    run_world(_train, 2, timeout_s=600, args=(cfg, [(str(a), False, None), (str(b), False, None)]))
    assert _losses(a) == _losses(b) and len(_losses(a)) == 6
    ckpt = b / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000004", "step-00000006"]
    for f in (ckpt / "step-00000006").glob("rank-*.safetensors"):  # every rank's file: each fails its load
        raw = bytearray(f.read_bytes())
        raw[-64] ^= 0x10
        f.write_bytes(bytes(raw))

    run_world(_train, 2, timeout_s=600, args=(cfg, [(str(b), True, 4)]))
    assert _losses(b) == _losses(a)  # steps 5 and 6 trained again, bit for bit; one line per step
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "latest", "step-00000004", "step-00000006", "step-00000006.rolled-back-to-4",
    ]  # fmt: skip
    assert (ckpt / "latest").read_text() == "step-00000006"
    summary = json.loads((b / "summary.json").read_text())
    assert summary["resumed_from"] == 4
