"""bf16 against float32 on a recipe: the loss after ``--steps`` steps of each, same data, same seed.

Runs the real trainer (``omni-tiny`` by default: 2 processes, pp=2, gloo on CPU; CUDA when the launcher
finds GPUs) twice in one world, ``train.dtype = "float32"`` then ``"bfloat16"`` (float32 master weights,
autocast forward/backward: ``omni_parallel.parallelize.apply_mixed_precision``), with the recipe's config
otherwise unchanged except ``train.steps`` (the learning-rate schedule spans the run). Both runs see the
same packs in the same order, so their losses compare step for step. Reports, per dtype, the last step's
loss, the mean loss of the last ``--window`` steps, tokens/s and the per-rank peak of saved activations;
and the relative differences of bf16 against float32. ``within_2pct`` holds when both the last-step and
the windowed differences are at most 2% (issue 12's bar). Writes ``benchmarks/results/bf16_loss.json``.

    uv run python benchmarks/bf16_loss.py [--steps 100] [--window 10] [--config omni-tiny] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.preflight import validate

DTYPES = ("float32", "bfloat16")
RESULTS = Path(__file__).resolve().parent / "results" / "bf16_loss.json"


def _run(rank: int, world_size: int, cfg, root: str) -> dict | None:
    from omni_train.metrics import read_metrics
    from omni_train.trainer import Trainer

    out = {}
    for dtype in DTYPES:
        c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype=dtype))
        run = Path(root) / dtype
        summary = Trainer(c, run, resume=False).run()
        out[dtype] = (read_metrics(run / "metrics.jsonl"), summary)
    return out if rank == 0 else None


def _report(rows: list[dict], summary: dict, window: int) -> dict:
    tail = rows[-window:]
    return {
        "final_loss": rows[-1]["loss"],
        f"mean_loss_last_{window}": sum(r["loss"] for r in tail) / len(tail),
        "tokens_per_s": summary["tokens_per_s"],
        "wall_s": summary["wall_s_this_process"],
        "peak_activation_bytes_per_rank": summary.get("peak_activation_bytes_per_rank"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="omni-tiny")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--window", type=int, default=10, help="steps of the windowed mean at the end")
    ap.add_argument("--out", default=str(RESULTS), help="JSON output path")
    args = ap.parse_args()
    cfg = load_config(args.config)
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, steps=args.steps),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=0),
    )
    validate(cfg, cfg.parallel.world_size)
    window = max(1, min(args.window, args.steps))
    with tempfile.TemporaryDirectory() as root:
        runs = run_world(_run, cfg.parallel.world_size, args=(cfg, root), timeout_s=7200)[0]
    result = {"config": args.config, "steps": args.steps, "window": window}
    for dtype in DTYPES:
        result[dtype] = _report(*runs[dtype], window)
    key = f"mean_loss_last_{window}"
    f32, b16 = result["float32"], result["bfloat16"]
    result["final_loss_rel_diff"] = abs(b16["final_loss"] - f32["final_loss"]) / f32["final_loss"]
    result[f"{key}_rel_diff"] = abs(b16[key] - f32[key]) / f32[key]
    result["within_2pct"] = result["final_loss_rel_diff"] <= 0.02 and result[f"{key}_rel_diff"] <= 0.02
    result["bf16_tokens_per_s_ratio"] = b16["tokens_per_s"] / f32["tokens_per_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
