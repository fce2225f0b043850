"""A/B of the trainer's switches on the bundled data: placement x reordering, in one run.

Runs the real trainer (``omni-tiny`` recipe, 2 processes, pp=2, gloo on CPU) for a few steps per variant
in one 2-rank world and prints, per variant, tokens/s and the per-rank idle seconds per step (wall time
minus time inside pipeline actions), as ratios against the baseline measured in the same run:
``prepend_first_stage`` with reordering off (encoders on stage 0, as Megatron-LM / torchtitan do).
The first ``--warmup`` steps of each variant are not counted. By default the recipe's last (encoder-heavy)
mixture phase is used from step 0 (``--mixture all`` keeps every phase), so that encoder work is present
in the measured steps. Also checks that every variant saw the same
losses (same data, same math). Writes ``benchmarks/results/train_ab.json``.

    uv run python benchmarks/train_ab.py [--steps 16] [--warmup 4] [--repeats 3] [--config omni-tiny]
        [--mixture last|all]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from omni_parallel.testing import run_world
from omni_train.config import MixturePhase, Placement, load_config
from omni_train.metrics import tokens_per_s

VARIANTS = [
    ("prepend_first_stage, reorder off", Placement.PREPEND_FIRST_STAGE, False),
    ("prepend_first_stage, reorder on", Placement.PREPEND_FIRST_STAGE, True),
    ("isolated, reorder on", Placement.ISOLATED, True),
    ("uniform_on_demand, reorder off", Placement.UNIFORM_ON_DEMAND, False),
    ("uniform_on_demand, reorder on", Placement.UNIFORM_ON_DEMAND, True),
]


def _run_variants(rank: int, world_size: int, cfg, root: str, repeats: int) -> list | None:
    from omni_train.trainer import Trainer

    # out[variant][repeat] = that run's metrics rows. Each repeat starts at a different variant, so slow
    # drift of a shared machine (other load, caches, clocks) does not always favour the same variant.
    out: list[list[list[dict]]] = [[] for _ in VARIANTS]
    for rep in range(repeats):
        for j in range(len(VARIANTS)):
            i = (rep + j) % len(VARIANTS)
            _, placement, reorder = VARIANTS[i]
            par = dataclasses.replace(cfg.parallel, placement=placement, reorder=reorder)
            run = Path(root) / f"r{rep}v{i}"
            Trainer(dataclasses.replace(cfg, parallel=par), run, resume=False).run()
            if rank == 0:
                out[i].append([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()])
    return out if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="omni-tiny")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--mixture", choices=["last", "all"], default="last")
    ap.add_argument("--repeats", type=int, default=3, help="runs per variant, in rotated order")
    args = ap.parse_args()
    cfg = load_config(args.config)
    mixture = (
        cfg.data.mixture if args.mixture == "all" else [MixturePhase(dict(cfg.data.mixture[-1].weights))]
    )
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, mixture=mixture),
        train=dataclasses.replace(cfg.train, steps=args.steps),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=0),
    )
    with tempfile.TemporaryDirectory() as root:
        metrics = run_world(
            _run_variants, cfg.parallel.world_size, args=(cfg, root, args.repeats), timeout_s=3600
        )[0]
    rows = []
    for (name, _, reorder), runs in zip(VARIANTS, metrics):
        ms = runs[0]
        counted = [m for run in runs for m in run[args.warmup :]]
        per_run = [tokens_per_s(run[args.warmup :]) for run in runs]
        imbalance_key = "encoder_imbalance_after_reorder" if reorder else "encoder_imbalance_before_reorder"
        rows.append(
            {
                "variant": name,
                "tokens_per_s": tokens_per_s(counted),
                "tokens_per_s_per_run": per_run,
                "step_time_s": statistics.mean(m["step_time_s"] for m in counted),
                "idle_s_per_rank": [
                    statistics.mean(m["idle_s_per_rank"][r] for m in counted)
                    for r in range(len(counted[0]["idle_s_per_rank"]))
                ],
                # steps without encoder work (text only) have no imbalance (null)
                "encoder_imbalance": statistics.mean(
                    [x for m in counted if (x := m[imbalance_key]) is not None] or [float("nan")]
                ),
                "losses": [m["loss"] for m in ms],
            }
        )
    base = rows[0]
    print(
        f"trainer A/B: {cfg.name} (mixture: {args.mixture}), {cfg.parallel.world_size} processes, {args.repeats} runs x "
        f"{args.steps} steps per variant in rotated order "
        f"({args.warmup} warm-up steps not counted); baseline = {base['variant']}"
    )
    print(
        f"{'variant':<36}{'tokens/s':>10}{'vs base':>9}{'runs min-max':>14}{'step s':>9}{'enc imbal':>10}"
        "  idle s/step per rank"
    )
    for r in rows:
        idle = "  ".join(f"r{i} {x:.3f}" for i, x in enumerate(r["idle_s_per_rank"]))
        print(
            f"{r['variant']:<36}{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / base['tokens_per_s']:>8.2f}x"
            f"{min(r['tokens_per_s_per_run']):>8.0f}-{max(r['tokens_per_s_per_run']):<5.0f}"
            f"{r['step_time_s']:>9.3f}{r['encoder_imbalance']:>10.2f}  {idle}"
        )
    worst = max(abs(a - b) / abs(b) for r in rows for a, b in zip(r["losses"], base["losses"]))
    print(f"largest relative loss difference between variants over all steps: {worst:.2e}")
    out = Path(__file__).resolve().parent / "results" / "train_ab.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "config": cfg.name,
                "steps": args.steps,
                "warmup": args.warmup,
                "repeats": args.repeats,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
