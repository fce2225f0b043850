"""The numerics guard end to end (issue 29: ``--optim.lr 1e6 --optim.warmup_steps 0 --checkpoint.every 2
--checkpoint.keep_last 2`` trained NaN from step 1 to 9 unnoticed, exit 0, committed NaN checkpoints and
pruned the good ones), on the tiny config over 2 processes (pp = 2).

* ``skip_step`` (the default): the first bad step (1: its gradient norm is NaN) is named in its own
  ``metrics.jsonl`` row; the skipped steps leave every parameter and AdamW state tensor bit for bit as
  they were before them (the reference: the state captured before the step's update, against the state
  before the next one); three bad steps in a row stop the run with one line naming the step and what.
* ``rollback``: a run trained at a sane learning rate to step 4, resumed at 1e6: each blow-up is rolled
  back to the newest committed step before it, whose parameters the next step then trains from (bit for
  bit the checkpoint's, read back whole), and the run ends normally.
* no committed checkpoint of either run (set-aside ones included) holds a NaN or Inf (every tensor read
  back whole).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from train_fixtures import make_dataset, write_config

from omni_ckpt import read_full
from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.config import ConfigError
from omni_train.numerics_guard import numerics_spec

BLOW_UP = [("optim.lr", "1e6"), ("optim.warmup_steps", "0")]


def _state(trainer) -> list[torch.Tensor]:
    """Every parameter and AdamW state tensor of this rank, copied."""
    out = [t.detach().clone() for t in trainer.model.state_dict().values()]
    for state in trainer.optimizer.state.values():
        out += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _runs(rank, world_size, blow_up, out_a, sane, rolled, out_b):
    from omni_parallel.numerics import NonFiniteError
    from omni_train.trainer import Trainer

    res = {}
    # (a) skip_step: the state before each step's update, as the step's after_backward sees it
    trainer = Trainer(blow_up, Path(out_a), resume=False)
    before = {}
    try:
        trainer.run(after_backward=lambda step, inputs, result: before.__setitem__(step, _state(trainer)))
        res["error"] = None
    except NonFiniteError as exc:
        res["error"] = str(exc)
    res["unchanged"] = {
        s: len(before[s]) == len(before[s + 1]) and all(map(torch.equal, before[s], before[s + 1]))
        for s in sorted(before)
        if s + 1 in before
    }
    # (b) rollback: a sane run to step 4, resumed at lr 1e6
    Trainer(sane, Path(out_b), resume=False).run()
    ckpt4, _ = read_full(str(Path(out_b) / "checkpoints" / "step-00000004"))
    trainer = Trainer(rolled, Path(out_b), resume=True)
    params = {}

    def keep(step, inputs, result):
        params[step] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    trainer.run(after_backward=keep)
    res["from_ckpt4_at_6"] = all(torch.equal(v, ckpt4[f"model.{k}"]) for k, v in params[6].items())
    res["changed_at_5"] = not all(torch.equal(v, ckpt4[f"model.{k}"]) for k, v in params[5].items())
    return res


def _rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _nonfinite_in_checkpoints(root: Path) -> dict[str, int]:
    """``{step dir/tensor: NaN or Inf elements}`` over every committed step directory under ``root``."""
    bad = {}
    for step in sorted(p for p in root.iterdir() if (p / "manifest.msgpack").exists()):
        tensors, _ = read_full(str(step))
        for name, t in tensors.items():
            if t.is_floating_point() and not torch.isfinite(t).all():
                bad[f"{step.name}/{name}"] = int((~torch.isfinite(t)).sum())
    return bad


@pytest.mark.slow
def test_lr_blow_up_is_named_skipped_rolled_back_and_never_checkpointed(tmp_path):
    data = make_dataset(tmp_path / "data")
    config = write_config(tmp_path / "c.toml", data, steps=6, every=2)
    blow_up = load_config(str(config), BLOW_UP)
    sane = load_config(str(config), [("train.steps", "4")])
    rolled = load_config(str(config), [*BLOW_UP, ("train.steps", "8"), ("train.on_nonfinite", "rollback")])
    a, b = tmp_path / "a", tmp_path / "b"
    results = run_world(_runs, 2, timeout_s=600, args=(blow_up, str(a), sane, rolled, str(b)))

    # (a) named within one step, skipped bit for bit, stopped after 3 in a row with one line
    rows = _rows(a)
    assert "numerics" not in rows[0] and rows[0]["bad_steps"] == 0 and math.isfinite(rows[0]["grad_norm"])
    first = rows[1]["numerics"]
    assert first["step"] == 1 and first["action"] == "skip_step" and "grad_norm" in first["nonfinite"]
    assert [rows[s]["numerics"]["action"] for s in (2, 3)] == ["skip_step", "stop"]
    assert sorted(rows) == [0, 1, 2, 3] and rows[3]["bad_steps"] == 3
    for r in results:
        assert r["error"] is not None, "the blown-up run was not stopped"
        assert r["error"].startswith("step 3: non-finite ") and "\n" not in r["error"], r["error"]
        assert r["error"].endswith("stopping (3 bad steps in a row, max_nonfinite_steps = 3)"), r["error"]
        assert r["unchanged"] == {0: False, 1: True, 2: True}, r["unchanged"]  # step 0 trained
    assert sorted(p.name for p in (a / "checkpoints").glob("step-*")) == ["step-00000002"]

    # (b) each blow-up rolled back to the newest committed step before it; the run ends normally
    rows = _rows(b)
    assert sorted(rows) == list(range(8))
    bad = {s: r["numerics"] for s, r in rows.items() if "numerics" in r}
    assert sorted(bad) == [5, 7], bad
    assert [(bad[s]["action"], bad[s]["rolled_back_to"]) for s in (5, 7)] == [
        ("rollback", 4),
        ("rollback", 6),
    ]
    for r in results:
        assert r["changed_at_5"] and r["from_ckpt4_at_6"]  # step 6 trains from step 4's parameters
    summary = json.loads((b / "summary.json").read_text())
    assert summary["numerics"]["bad_steps"] == 2 and summary["numerics"]["counts"]["rollback"] == 2
    assert [e["rolled_back_to"] for e in summary["numerics"]["events"]] == [4, 6]

    # no committed step of either run holds a non-finite value
    assert _nonfinite_in_checkpoints(a / "checkpoints") == {}
    assert _nonfinite_in_checkpoints(b / "checkpoints") == {}
    assert sorted(p.name for p in (b / "checkpoints").glob("step-*")) == ["step-00000006", "step-00000008"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (("train.on_nonfinite", "ignore"), "train.on_nonfinite"),
        (("train.max_nonfinite_steps", "0"), "train.max_nonfinite_steps: must be >= 1, got 0"),
        (("train.spike_zscore", "-1"), "train.spike_zscore: must be >= 0, got -1.0"),
        (("train.spike_zscore", "nan"), "train.spike_zscore: must be .*finite.*, got nan"),
        (("train.spike_window", "1"), "train.spike_window: must be >= 2, got 1"),
    ],
)
def test_numerics_fields_are_range_checked_by_name(tmp_path, override, message):
    config = write_config(
        tmp_path / "c.toml", {"tokenizer": "t.json", "image": "i", "audio": "a", "text": "t"}
    )
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(str(config), [override])


def test_numerics_spec_from_the_config(tmp_path):
    config = write_config(
        tmp_path / "c.toml", {"tokenizer": "t.json", "image": "i", "audio": "a", "text": "t"}
    )
    spec = numerics_spec(load_config(str(config)).train)
    assert (spec.on_nonfinite, spec.max_nonfinite_steps, spec.spike_zscore, spec.spike_window) == (
        "skip_step", 3, None, 50,
    )  # fmt: skip
    cfg = load_config(str(config), [("train.on_nonfinite", "rollback"), ("train.spike_zscore", "6")])
    spec = numerics_spec(cfg.train)
    assert (spec.on_nonfinite, spec.spike_zscore, spec.detects_spikes) == ("rollback", 6.0, True)


@pytest.mark.slow
def test_cli_stop_is_one_line_without_traceback(tmp_path):
    """``train.on_nonfinite = "stop"`` under ``omni-train run``: the workers report the guard's line to the
    launcher, which says it once (no elastic-agent failure block, no worker traceback), exit status 1."""
    import subprocess
    import sys

    data = make_dataset(tmp_path / "data")
    config = write_config(tmp_path / "c.toml", data, steps=4, every=0)
    said = subprocess.run(
        [sys.executable, "-m", "omni_train.cli", "run", "--config", str(config), "--out", str(tmp_path / "run"),
         "--optim.lr", "1e6", "--optim.warmup_steps", "0", "--train.on_nonfinite", "stop"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = said.stdout + said.stderr
    assert said.returncode == 1, out
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    lines = [ln for ln in said.stderr.splitlines() if ln.startswith("omni-train: step ")]
    assert len(lines) == 1 and lines[0].startswith("omni-train: step 1: non-finite "), out
    assert lines[0].endswith("no restarts left"), out
