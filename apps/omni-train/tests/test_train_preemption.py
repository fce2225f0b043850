"""Preemption: ``SIGTERM`` to the launcher (what a cluster scheduler sends before it kills a job) stops a
2-process run cleanly: every rank finishes its step, checkpoint N is committed, the run ends with one
line naming the signal, the step and the command to resume; that command resolves to this run with
``--resume``, and the resume reproduces an uninterrupted run bit for bit (the oracle: the same config
trained once without interruption, losses of every step and the final checkpoint's tensors compared
exactly, as ``test_train_roll_back.py`` does). Before issue 29 the launcher died with the elastic agent's
``SignalException`` traceback and committed nothing."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import make_dataset, write_config

from omni_parallel.testing import run_world
from omni_train.cli import parse_args, resolve_run

pytestmark = pytest.mark.slow

STEPS = 8


def _losses(out: Path) -> list[float]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


def _train(rank, world_size, cfg, runs):
    from omni_train.trainer import Trainer

    for out, resume in runs:
        Trainer(cfg, Path(out), resume=resume).run()


def _parameters(out: Path, step: int) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted((out / "checkpoints" / f"step-{step:08d}").glob("rank-*.safetensors")):
        tensors.update({f"{f.name}:{k}": v for k, v in load_file(f).items()})
    return tensors


def test_sigterm_to_the_launcher_commits_the_step_and_the_resume_is_exact(tmp_path):
    data = make_dataset(tmp_path / "data")
    # every = 5: the step the signal lands in is (almost surely) not a scheduled checkpoint
    config = write_config(tmp_path / "c.toml", data, steps=STEPS, every=5)
    ref, out = tmp_path / "ref", tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, "-m", "omni_train.cli", "run", "--config", str(config), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while len(_losses(out)) < 2:  # two steps logged: the signal lands in a later one
        assert p.poll() is None, p.communicate()[0]
        assert time.monotonic() < deadline, "the run logged no second step"
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    said, _ = p.communicate(timeout=120)

    assert p.returncode == 128 + signal.SIGTERM, said
    assert "Traceback" not in said and "SignalException" not in said, said
    last = said.strip().splitlines()[-1]
    m = re.fullmatch(
        r"omni-train: stopped by SIGTERM at step (\d+); checkpoint \1 committed; resume with: (.+)", last
    )
    assert m, said
    n = int(m.group(1))
    assert 2 <= n < STEPS, said  # stopped mid-run, after the steps already logged
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text() == f"step-{n:08d}"
    assert (ckpt / f"step-{n:08d}" / "manifest.msgpack").is_file()
    assert len(_losses(out)) == n  # the step in flight finished and was logged, no later one started

    # the printed command resolves to this run, resumed (what `omni-train run` checks before any worker)
    words = shlex.split(m.group(2))
    assert words[:2] == ["omni-train", "run"], words
    args = parse_args(words[1:])
    cfg, nproc, resolved_out = resolve_run(args)
    assert (args.resume, resolved_out, nproc, cfg.train.steps) == (True, out, 2, STEPS)
    # the resume (the trainer the command starts) and the uninterrupted oracle, in one world
    run_world(_train, 2, timeout_s=600, args=(cfg, [(str(out), True), (str(ref), False)]))
    assert _losses(out) == _losses(ref) and len(_losses(ref)) == STEPS  # every step, bit for bit
    mine, theirs = _parameters(out, STEPS), _parameters(ref, STEPS)
    assert mine.keys() == theirs.keys() and mine
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k
