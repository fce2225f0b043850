"""What sharding the LLM costs on CPU: ``parallel.llm_zero`` 0/1/2/3 at pp=2 x dp=2, and tp=2 with and
without Megatron sequence parallelism (``parallel.sequence_parallel``), in one 4-process world.

Each variant trains ``--steps`` steps of ``omni-tiny`` (gloo, float32, CPU), ``--repeats`` times in
rotated order (repeat ``r`` starts at variant ``r``), so a slow drift of the machine does not always
favour the same one; the first ``--warmup`` steps of every run are not counted. Reported per variant, as
a ratio to its baseline measured in the same world: tokens/s, and where the step time goes (the
trainer's ``time_s_per_rank`` phases, summed over the counted steps, mean over ranks). Baselines:
``llm_zero = 0`` for the ZeRO rows, ``tp=2`` without SP for the SP row. There is no target on CPU: the
collectives run over gloo through loopback and the model is tiny, so the numbers say what the
mechanisms add per step, not what they save on a GPU.

Writes ``benchmarks/results/llm_sharding.json``. Run it alone on an idle machine:

    uv run python benchmarks/llm_sharding.py [--steps 8] [--warmup 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from long_context import apply_changes  # benchmarks/ is on sys.path when run as a script

from omni_parallel.testing import run_world
from omni_pipeline.step_metrics import PHASES
from omni_train.binder import load_config
from omni_train.metrics import tokens_per_s

ZERO = {"pp": 2, "dp": 2, "tp": 1}
TP = {"pp": 1, "dp": 2, "tp": 2}


def _variants() -> list[dict[str, Any]]:
    """``{name, base, changes: {section: {field: value}}}``: the runs, each with its baseline's name."""
    rows: list[dict[str, Any]] = [
        {
            "name": f"pp2 dp2 llm_zero {z}",
            "base": None if z == 0 else "pp2 dp2 llm_zero 0",
            "changes": {"parallel": {**ZERO, "llm_zero": z}},
        }
        for z in range(4)
    ]
    rows.append(
        {"name": "dp2 tp2", "base": None, "changes": {"parallel": {**TP, "sequence_parallel": False}}}
    )
    rows.append(
        {
            "name": "dp2 tp2 + SP",
            "base": "dp2 tp2",
            "changes": {"parallel": {**TP, "sequence_parallel": True}},
        }
    )
    return rows


def _world(rank: int, world_size: int, cfg, variants, root: str, repeats: int) -> dict[str, list] | None:
    """Every variant ``repeats`` times in rotated order; rank 0 returns each run's metrics rows."""
    from omni_train.preflight import validate
    from omni_train.trainer import Trainer

    runs: dict[str, list] = {v["name"]: [] for v in variants}
    for rep in range(repeats):
        for j in range(len(variants)):
            v = variants[(rep + j) % len(variants)]
            c = apply_changes(cfg, v["changes"])
            validate(c, world_size)
            out = Path(root) / f"r{rep}-{v['name'].replace(' ', '_').replace('+', 'plus')}"
            Trainer(c, out, resume=False).run()
            if rank == 0:
                runs[v["name"]].append(
                    [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                )
    return runs if rank == 0 else None


def _phases(rows: list[dict]) -> dict[str, float]:
    """Seconds per phase over ``rows``, mean over ranks."""
    return {
        p: statistics.mean(
            sum(m["time_s_per_rank"][p][r] for m in rows) for r in range(len(rows[0]["time_s_per_rank"][p]))
        )
        for p in PHASES
    }


def _summarise(variants, runs: dict[str, list], warmup: int) -> list[dict[str, Any]]:
    rows = []
    for v in variants:
        counted = [m for run in runs[v["name"]] for m in (run[warmup:] or run)]
        last = runs[v["name"]][0][-1]
        rows.append(
            {
                "variant": v["name"],
                "base": v["base"],
                "tokens_per_s": tokens_per_s(counted),
                "step_time_s": statistics.mean(m["step_time_s"] for m in counted),
                "phase_s": _phases(counted),
                "llm_state_bytes": last.get("llm_state_bytes"),
                "peak_activation_bytes_per_rank": last.get("peak_activation_bytes_per_rank"),
            }
        )
    by_name = {r["variant"]: r for r in rows}
    for r in rows:
        base = by_name.get(r["base"]) if r["base"] else None
        if base is not None:
            r["tokens_per_s_vs_base"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["phase_s_minus_base"] = {p: r["phase_s"][p] - base["phase_s"][p] for p in PHASES}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="omni-tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps per run not counted")
    ap.add_argument("--repeats", type=int, default=2, help="runs per variant, in rotated order")
    args = ap.parse_args()
    cfg = load_config(args.config)
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, steps=args.steps),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=0),
    )
    variants = _variants()
    with tempfile.TemporaryDirectory() as root:
        runs = run_world(_world, 4, args=(cfg, variants, root, args.repeats), timeout_s=7200)[0]
    rows = _summarise(variants, runs, args.warmup)
    print(
        f"LLM sharding: {cfg.name}, 4 processes (gloo, CPU), {args.steps} steps per run "
        f"({args.warmup} not counted), {args.repeats} runs per variant in rotated order"
    )
    print(
        f"{'variant':<22}{'tokens/s':>10}{'vs base':>9}  largest phase changes vs base (s over counted steps)"
    )
    for r in rows:
        ratio = f"{r['tokens_per_s_vs_base']:.3f}x" if "tokens_per_s_vs_base" in r else "-"
        delta = r.get("phase_s_minus_base", {})
        top = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:3]
        print(
            f"{r['variant']:<22}{r['tokens_per_s']:>10.0f}{ratio:>9}  "
            + ", ".join(f"{p} {d:+.2f}" for p, d in top)
        )
    out = Path(__file__).resolve().parent / "results" / "llm_sharding.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {"config": cfg.name, "world": 4, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
             "rows": rows},
            indent=2,
        )
    )  # fmt: skip
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
