"""End to end: the trainer on a tiny config and real-format data, over real processes.

* placements and reordering: ``uniform_on_demand``, ``prepend_first_stage``, ``isolated``, ``planned`` and
  reordering off give the same losses, and the same as one process running the whole model (pp=1), step
  for step;
* the CLI: a 2-process run writes metrics, TensorBoard events, both PNGs, a committed checkpoint and (with
  ``--profile``) a torch.profiler trace per rank naming the trainer's phases; a run killed with SIGKILL
  mid-training and resumed with ``--resume`` reproduces the uninterrupted losses exactly; the automatic
  restart in between is reported in two lines, without a traceback; ``--resume`` of the finished run says
  so and changes nothing, and with a larger ``--max-steps`` trains on from where it ended; ``actions.jsonl``
  holds one record per rank and step after the restarts, as ``metrics.jsonl`` holds one line per step.
"""

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_fixtures import make_dataset, side_by_side, spawned_workers, write_config

from omni_parallel.testing import run_world
from omni_pipeline import PlacementPolicy as Placement
from omni_pipeline import read_records
from omni_train.binder import load_config

pytestmark = pytest.mark.slow


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train_variants(rank, world_size, cfg, variants, root):
    from omni_train.config import Packing
    from omni_train.trainer import Trainer

    out = []
    for name, par in variants:
        par = dict(par)
        data = dataclasses.replace(cfg.data, packing=Packing(par.pop("packing", cfg.data.packing)))
        c = dataclasses.replace(cfg, data=data, parallel=dataclasses.replace(cfg.parallel, **par))
        run = Path(root) / name
        trainer = Trainer(c, run, resume=False)
        trainer.run()
        out.append(_losses(run) if rank == 0 else None)
    return out


def test_placements_reordering_and_single_process_agree(tmp_path):
    data = make_dataset(tmp_path / "data")
    # float64: the pipeline must reproduce one process to rounding, not just to float32 noise (which
    # Adam amplifies on near-zero gradients within a few steps).
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=3, every=0, extra='dtype = "float64"'))
    )
    variants = [
        ("uniform", {}),
        ("prepend", {"placement": Placement.PREPEND_FIRST_STAGE}),
        ("reorder-off", {"reorder": False}),
        ("isolated", {"placement": Placement.ISOLATED}),
        ("planned", {"placement": Placement.PLANNED}),
    ]
    # these see other data (one modality per pack; DP ranks read disjoint shards): they must run and learn
    others = [("per-modality", {"packing": "per_modality"}), ("pp1-dp2", {"pp": 1, "dp": 2})]
    two, one = side_by_side(  # other run folders: the one process runs on the core the pipeline leaves idle
        lambda: run_world(
            _train_variants, 2, args=(cfg, variants + others, str(tmp_path / "pp2")), timeout_s=400
        ),
        lambda: run_world(
            _train_variants, 1, args=(cfg, [("pp1", {"pp": 1})], str(tmp_path / "pp1")), timeout_s=200
        ),
    )
    results = two[0]
    for (name, _), losses in zip(others, results[len(variants) :]):
        assert len(losses) == 3 and losses[-1] < losses[0], (name, losses)
    results = results[: len(variants)]
    single = one[0][0]
    base = results[0]
    assert len(base) == 3 and base[-1] < base[0]
    for (name, _), losses in zip(variants, results):
        assert losses == pytest.approx(base, rel=1e-10, abs=1e-10), name
    assert single == pytest.approx(base, rel=1e-10, abs=1e-10)


def _cli(*args: str, log: Path | None = None, **kw) -> subprocess.Popen:
    """The CLI in a process of its own; with ``log`` its output goes to that file instead of a pipe (for a
    run left going while the test waits on another: a full pipe would stall it)."""
    exe = [sys.executable, "-m", "omni_train.cli", *args]
    if log is None:
        return subprocess.Popen(exe, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    with open(log, "w") as f:
        return subprocess.Popen(exe, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, **kw)


def _finish(p: subprocess.Popen, log: Path, timeout_s: float = 300) -> str:
    """Wait for ``p`` (started with ``log``) and return its output; a run still going after ``timeout_s``
    fails the test with the end of its output."""
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(p.args[2:])} still running after {timeout_s} s:\n{log.read_text()[-3000:]}")
    return log.read_text()


def _wait(p: subprocess.Popen, cond, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        if p.poll() is not None:
            pytest.fail(f"the run ended (exit {p.returncode}) before {what}")
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def background():
    """The CLI runs a test leaves going while it waits on another (each in a session of its own), killed
    with their workers if the test ends before them."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:  # the group, also when the launcher is gone: its workers may not be
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_cli_run_outputs_restart_and_sigkill_resume_are_exact(tmp_path, background):
    data = make_dataset(tmp_path / "data")
    cfg = write_config(tmp_path / "c.toml", data, steps=16, every=2)
    a, b = tmp_path / "a", tmp_path / "b"

    # The uninterrupted run (a) and the interrupted one (b) share nothing but the config: they run side by
    # side (a CLI run's launcher imports torch on one core, then two pipeline ranks leave a core half idle).
    pa = _cli("run", "--config", str(cfg), "--out", str(a), "--profile", "2", log=tmp_path / "a.log")
    background.append(pa)

    # 1) one worker dies: the elastic agent restarts both, they resume from the last committed step;
    # 2) later the launcher and all workers are SIGKILLed; 3) `--resume` finishes the run.
    p = _cli("run", "--config", str(cfg), "--out", str(b), "--max-restarts", "1", start_new_session=True)
    background.append(p)
    latest = b / "checkpoints" / "latest"
    _wait(p, lambda: latest.exists() and (b / "metrics.jsonl").exists() and len(_losses(b)) >= 3, "step 3")
    first = spawned_workers(p.pid)
    os.kill(first[0], signal.SIGKILL)
    _wait(
        p,
        lambda: set(spawned_workers(p.pid)).isdisjoint(first) and len(spawned_workers(p.pid)) == 2,
        "the restart",
    )
    restarted_at = int(latest.read_text().removeprefix("step-"))
    _wait(
        p,
        lambda: len(_losses(b)) >= restarted_at + 2 and latest.read_text() != f"step-{restarted_at:08d}",
        "progress after the restart",
    )
    os.killpg(p.pid, signal.SIGKILL)
    restart_out, _ = p.communicate(timeout=60)
    assert re.search(
        r"worker local rank 0 \(pid \d+\) died: SIGKILL; restarting the workers \(restart 1 of 1\)",
        restart_out,
    ), restart_out
    resumed = re.search(r"omni-train: restarted \(1 of 1\), resuming from step (\d+)", restart_out)
    assert resumed and 0 < int(resumed.group(1)) <= restarted_at, restart_out
    assert "Traceback" not in restart_out, restart_out
    done = len(_losses(b))
    assert done < 16, f"the run finished ({done} steps) before it could be killed"

    out = _finish(pa, tmp_path / "a.log")
    assert pa.returncode == 0, out
    uninterrupted = _losses(a)
    assert len(uninterrupted) == 16
    for rank in (0, 1):
        names = {
            e.get("name", "")
            for e in json.loads((a / "profile" / f"rank-{rank}.json").read_text())["traceEvents"]
        }
        assert {"omni_train.load_step", "omni_train.clip_grad_norm", "omni_train.reduce_gradients"} <= names
        assert {"ProfilerStep#1", "ProfilerStep#2"} <= names and "ProfilerStep#0" not in names  # 0: warm-up
        assert "aten::mm" in names and any(n.startswith("Optimizer.step#AdamW") for n in names)
    assert list((a / "tensorboard").glob("events.out.tfevents.*"))
    assert (a / "loss.png").stat().st_size > 0 and (a / "timeline.png").stat().st_size > 0
    assert (a / "checkpoints" / "latest").read_text() == "step-00000016"
    assert (a / "checkpoints" / "step-00000016" / "manifest.msgpack").is_file()

    # b's resume and the two runs on the finished a below run side by side too (other output folders)
    p = _cli("run", "--config", str(cfg), "--out", str(b), "--resume", log=tmp_path / "b.log")
    background.append(p)

    # The finished run: --resume says so and leaves it alone; a larger --max-steps trains on.
    summary = (a / "summary.json").read_text()
    q = _cli("run", "--config", str(cfg), "--out", str(a), "--resume", start_new_session=True)
    background.append(q)
    out, _ = q.communicate(timeout=300)
    assert q.returncode == 0 and "already finished: step 16 of train.steps = 16" in out, out
    assert (a / "summary.json").read_text() == summary
    q = _cli(
        "run", "--config", str(cfg), "--out", str(a), "--resume", "--max-steps", "18", log=tmp_path / "q.log"
    )
    background.append(q)

    out = _finish(p, tmp_path / "b.log")
    assert p.returncode == 0, out
    assert _losses(b) == uninterrupted  # step for step, bit for bit
    # actions.jsonl is cut back on every resume as metrics.jsonl is: one history, one record per rank/step
    steps = sorted((r.step, r.rank) for r in read_records(b).steps)
    assert steps == [(i, r) for i in range(16) for r in (0, 1)]

    out = _finish(q, tmp_path / "q.log")
    assert q.returncode == 0, out
    assert _losses(a)[:16] == _losses(b) and len(_losses(a)) == 18
    extended = json.loads((a / "summary.json").read_text())
    assert (extended["steps"], extended["resumed_from"], extended["checkpoints"][-1]) == (18, 16, 18)
