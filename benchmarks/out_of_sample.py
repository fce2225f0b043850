"""Out-of-sample checks of the calibrated cost model: fit on one trainer run, predict ANOTHER run's steps.

Three pairs (issue 31, item 5), each a fit run and a predicted run of the real trainer on this machine
(gloo on CPU), the predicted run differing in one thing:

* ``mixture``: ``omni-heavy`` at pp=2 (2 processes), every step at image:text 1:9 (fit) and 9:1
  (predicted), as ``benchmarks/train_ab.py --share`` sets them;
* ``pipeline``: ``omni-heavy`` with 4 LLM layers (its 3 cannot fill 4 stages; both runs get the
  override), image:text 5:5, pp=2 on 2 processes (fit) and pp=4 on 4 processes (predicted);
* ``pack length``: ``omni-long`` (cp=2 ring attention, pp=1, 2 processes) with 4K-token packs (fit) and
  its own 16K-token packs (predicted).

No leakage: the fit reads only the fit run's ``actions.jsonl`` (:func:`omni_pipeline.calibrate.fit_run`);
the predicted run gives only its config (hence its packs: the data stream is deterministic), its flows
(``dataflow.json`` or per-step flow records) and its measured step times (``metrics.jsonl``) for the
comparison (:func:`omni_train.simulate.simulate_config` with ``measured=``). A pipeline of another layout
is re-staged (:func:`omni_pipeline.calibrate.restage_cost_model`); the host is modelled by its core count
(``--cores``, default ``os.cpu_count()``: the ranks share that many cores, and the step is simulated
again under processor sharing, :func:`omni_pipeline.calibrate.host_step_s`), a machine parameter, never
fitted; each process's CPU beside its recorded actions (fitted from the fit run's step records' ``cpu_s``
and ``pipeline_cpu_s``, :func:`omni_pipeline.calibrate.fit_process_cpu`) competes for those cores.

The machine's run-to-run noise (a run of the same config measured 10-15 % apart from the next on
the 2-core machine) is as large as the target, so every pair is repeated (``--repeats``, fresh runs
each, the two runs' order alternating): the table gives the error of the repeats' mean predicted step
time against their mean measured one, and each repeat's own error. The first ``--warmup`` steps of each
run are neither fitted nor predicted. Runs at ``nice -n 10``
(``os.nice``). Writes ``benchmarks/results/out_of_sample.json`` and prints a table (pair, fit run,
predicted run, measured s/step, predicted s/step, error %).

    uv run python benchmarks/out_of_sample.py [--repeats 3] [--steps 32] [--warmup 3] [--pairs mixture,pipeline,pack]
        [--cores N] [--keep DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from paper_scale import _commit  # the same git lookup (benchmarks/ is on the path of a script run)

from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.config import MixturePhase, RunConfig
from omni_train.simulate import simulate_config

PAIRS = ("mixture", "pipeline", "pack")


def _train(rank: int, world_size: int, cfg: RunConfig, out: str) -> None:
    from omni_train.trainer import Trainer

    Trainer(cfg, Path(out), resume=False).run()


def _share(image: float, text: float) -> list[MixturePhase]:
    return [MixturePhase({"image": image, "audio": 0.0, "text": text})]


def _base(name: str, steps: int) -> RunConfig:
    cfg = load_config(name)
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, steps=steps),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=0),
    )


def _heavy(steps: int, share: tuple[float, float], pp: int, layers: int | None = None) -> RunConfig:
    cfg = _base("omni-heavy", steps)
    model = cfg.model
    if layers is not None:
        model = dataclasses.replace(model, llm=dataclasses.replace(model.llm, n_layers=layers))
    return dataclasses.replace(
        cfg,
        model=model,
        data=dataclasses.replace(cfg.data, mixture=_share(*share)),
        parallel=dataclasses.replace(cfg.parallel, pp=pp),
    )


def _long(steps: int, seq: int) -> RunConfig:
    cfg = _base("omni-long", steps)
    first = cfg.data.mixture[0]  # one mixture for every step: the pair differs in pack length only
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, max_seq_len=seq, mixture=[MixturePhase(dict(first.weights))]),
    )


def pairs(steps: int) -> dict[str, tuple[tuple[str, RunConfig], tuple[str, RunConfig]]]:
    """``{pair: ((fit name, fit config), (predicted name, predicted config))}``."""
    return {
        "mixture": (
            ("omni-heavy pp=2 1:9", _heavy(steps, (1, 9), 2)),
            ("omni-heavy pp=2 9:1", _heavy(steps, (9, 1), 2)),
        ),
        "pipeline": (
            ("omni-heavy(4 layers) pp=2", _heavy(steps, (5, 5), 2, layers=4)),
            ("omni-heavy(4 layers) pp=4", _heavy(steps, (5, 5), 4, layers=4)),
        ),
        "pack": (
            ("omni-long 4K packs", _long(steps, 4096)),
            ("omni-long 16K packs", _long(steps, 16384)),
        ),
    }


def _run(cfg: RunConfig, out: Path) -> float:
    t0 = time.perf_counter()
    run_world(_train, cfg.parallel.world_size, args=(cfg, str(out)), timeout_s=1800)
    return time.perf_counter() - t0


def _one(pair: str, rep: int, root: Path, args: argparse.Namespace) -> dict:
    """One repeat of one pair: train its two runs (the predicted one first in odd repeats, so drift
    favours neither), fit on one, predict the other."""
    (fit_name, fit_cfg), (pred_name, pred_cfg) = pairs(args.steps)[pair]
    fit_dir, pred_dir = root / pair / f"repeat-{rep}" / "fit", root / pair / f"repeat-{rep}" / "predicted"
    train_s = 0.0
    runs = [(fit_cfg, fit_dir), (pred_cfg, pred_dir)]
    for cfg, d in runs[::-1] if rep % 2 else runs:
        if not (args.reuse and (d / "metrics.jsonl").is_file()):
            train_s += _run(cfg, d)
    simulate_config(
        pred_cfg,
        out_dir=pred_dir / "oos",
        calibration=fit_dir,
        measured=pred_dir,
        skip_steps=args.warmup,
        host_cores=args.cores,
        plots=False,
    )
    res = json.loads((pred_dir / "oos" / "simulate.json").read_text())
    r = res["results"]["as run"]
    return {
        "pair": pair,
        "repeat": rep,
        "fit_run": fit_name,
        "predicted_run": pred_name,
        "steps": res["steps"],
        "measured_step_time_s": r["measured_step_time_s"],
        "predicted_step_time_s": r["step_time_s"],
        "error": r["step_time_s"] / r["measured_step_time_s"] - 1,
        "host_cores": args.cores,
        "layers_per_stage": [res.get("fit_layers_per_stage"), res.get("layers_per_stage")],
        "restaged": res.get("restaged"),
        # the fit run's per-process CPU beside its actions (None: its records carry no CPU seconds)
        "process_cpu": res.get("process_cpu"),
        "train_s": train_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=32, help="trainer steps per run")
    ap.add_argument(
        "--warmup", type=int, default=3, help="first steps of each run neither fitted nor predicted"
    )
    ap.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated subset of {', '.join(PAIRS)}")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the ranks share (host)")
    ap.add_argument("--keep", default=None, help="keep the run directories under DIR (default: a temp dir)")
    ap.add_argument("--reuse", action="store_true", help="with --keep: reuse runs already there")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of every pair (fresh runs each)")
    ap.add_argument("--json", default=None, help="output (default benchmarks/results/out_of_sample.json)")
    args = ap.parse_args()
    chosen = [p.strip() for p in args.pairs.split(",") if p.strip()]
    if not chosen or any(p not in PAIRS for p in chosen):
        ap.error(f"--pairs: choose from {', '.join(PAIRS)}, got {args.pairs!r}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if not 0 <= args.warmup < args.steps - 1:
        ap.error(f"--warmup {args.warmup} must leave >= 2 counted steps of --steps {args.steps}")
    os.nice(10)
    tmp = None if args.keep else tempfile.TemporaryDirectory()
    root = Path(args.keep or tmp.name)
    rows = []
    t_start = time.perf_counter()
    for rep in range(args.repeats):
        for pair in chosen:
            rows.append(_one(pair, rep, root, args))
            r = rows[-1]
            print(
                f"{pair} repeat {rep}: {100 * r['error']:+.1f} % ({r['train_s']:.0f} s of training)",
                flush=True,
            )
    summary = []
    for pair in chosen:
        rs = [r for r in rows if r["pair"] == pair]
        measured = sum(r["measured_step_time_s"] for r in rs) / len(rs)
        predicted = sum(r["predicted_step_time_s"] for r in rs) / len(rs)
        errors = [r["error"] for r in rs]
        summary.append(
            {
                "pair": pair,
                "fit_run": rs[0]["fit_run"],
                "predicted_run": rs[0]["predicted_run"],
                "repeats": len(rs),
                "measured_step_time_s": measured,
                "predicted_step_time_s": predicted,
                "error": predicted / measured - 1,
                "repeat_errors": errors,
                "measured_spread": max(r["measured_step_time_s"] for r in rs)
                / min(r["measured_step_time_s"] for r in rs),
            }
        )
    print(
        f"\n{'pair':<10}{'fit run':<28}{'predicted run':<28}{'measured s/step':>16}{'predicted s/step':>17}"
        f"{'error %':>9}  per repeat %"
    )
    for s in summary:
        print(
            f"{s['pair']:<10}{s['fit_run']:<28}{s['predicted_run']:<28}{s['measured_step_time_s']:>16.3f}"
            f"{s['predicted_step_time_s']:>17.3f}{100 * s['error']:>+9.1f}  "
            + " ".join(f"{100 * e:+.1f}" for e in s["repeat_errors"])
        )
    total = time.perf_counter() - t_start
    print(
        f"total {total:.0f} s; {args.repeats} repeats; {args.steps} steps per run, {args.warmup} warm-up steps "
        f"dropped; cores {args.cores}"
    )
    out = Path(args.json) if args.json else Path(__file__).resolve().parent / "results" / "out_of_sample.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "steps": args.steps,
                "warmup": args.warmup,
                "host_cores": args.cores,
                "date": datetime.now(UTC).strftime("%Y-%m-%d"),
                "commit": _commit(),
                "repeats": args.repeats,
                # --reuse: the runs were trained earlier (their train_s 0 here), only predicted again now
                "runs_reused": bool(args.reuse),
                "total_s": total,
                "summary": summary,
                "rows": rows,
            },
            indent=2,
        )
    )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
