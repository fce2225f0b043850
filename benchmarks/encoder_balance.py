"""Encoder workload balancing in the trainer on a long-tailed image-size mix (``omni-longtail``), one run.

Runs the real trainer (2 processes, gloo on CPU) for a few steps per variant, three layouts of the same
2 processes, and reports per variant the *measured* encoder seconds per rank (time inside encoder
forwards and backwards, their collectives included) as max/mean over ranks (1.00: balanced), the modelled
encoder-FLOPs max/mean, and tokens/s, each as a ratio against its layout's baseline in the same run:

* ``dp=2, pp=1``: no balancing (``parallel.reorder = false``: each replica encodes its own samples);
  per-pipeline split only (the Karmarkar-Karp split inside each pipeline, ``data.reorder_group_size = 1``;
  with pp=1 it has nothing to split); grouped reordering across DP (both replicas one reordering group,
  §5.1); the same with encoder ZeRO-3 (its per-rank encoder parameter + optimizer bytes against ZeRO-0's);
* ``pp=2, dp=1``: no balancing (media of each LLM microbatch cut in arrival order); per-pipeline split;
* ``ulysses=2`` (the LLM's sequence group, which the encoders share): short samples spread over the group
  by cost but long images whole (``encoder_sp = 1``, the baseline), plus long-short SP (``encoder_sp = 2``:
  images above ``long_threshold`` tokens split over both ranks, Ulysses inside the ViT).

Variants run in rotated order per repeat so that drift on a shared machine favours none; the first
``--warmup`` steps of each run are not counted. Writes ``benchmarks/results/encoder_balance.json``.

    uv run python benchmarks/encoder_balance.py [--steps 12] [--warmup 3] [--repeats 2] [--config omni-longtail]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.metrics import tokens_per_s

# (layout, variant, [parallel] fields, [data] fields); the first variant of each layout is its baseline
VARIANTS = [
    ("dp=2, pp=1", "no balancing", {"pp": 1, "dp": 2, "reorder": False}, {}),
    ("dp=2, pp=1", "per-pipeline split only", {"pp": 1, "dp": 2}, {"reorder_group_size": 1}),
    ("dp=2, pp=1", "grouped reordering across DP", {"pp": 1, "dp": 2}, {"reorder_group_size": 2}),
    (
        "dp=2, pp=1",
        "grouped reordering across DP, encoder ZeRO-3",
        {"pp": 1, "dp": 2, "encoder_zero": 3},
        {"reorder_group_size": 2},
    ),
    ("pp=2, dp=1", "no balancing", {"pp": 2, "dp": 1, "reorder": False}, {}),
    ("pp=2, dp=1", "per-pipeline split only", {"pp": 2, "dp": 1}, {}),
    ("ulysses=2", "SP group, long images whole", {"pp": 1, "ulysses": 2, "encoder_sp": 1}, {}),
    ("ulysses=2", "plus long-short SP", {"pp": 1, "ulysses": 2, "encoder_sp": 2}, {}),
]


def _run_variants(rank: int, world_size: int, cfg, root: str, repeats: int) -> list | None:
    from omni_train.trainer import Trainer

    out: list[list[list[dict]]] = [[] for _ in VARIANTS]
    for rep in range(repeats):
        for j in range(len(VARIANTS)):
            i = (rep + j) % len(VARIANTS)
            _, _, par, data = VARIANTS[i]
            c = dataclasses.replace(
                cfg,
                parallel=dataclasses.replace(cfg.parallel, **par),
                data=dataclasses.replace(cfg.data, **data),
            )
            run = Path(root) / f"r{rep}v{i}"
            Trainer(c, run, resume=False).run()
            if rank == 0:
                out[i].append([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()])
    return out if rank == 0 else None


def _mean(xs: list[float | None]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="omni-longtail")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="runs per variant, in rotated order")
    args = ap.parse_args()
    cfg = load_config(args.config)
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, steps=args.steps),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=0),
    )
    with tempfile.TemporaryDirectory() as root:
        metrics = run_world(_run_variants, 2, args=(cfg, root, args.repeats), timeout_s=3600)[0]
    rows, base = [], {}
    for (layout, name, par, data), runs in zip(VARIANTS, metrics):
        counted = [m for run in runs for m in run[args.warmup :]]
        last = runs[0][-1]["encoder_state_bytes"]
        held = last["parameters"] + last["gathered"] + last["optimizer"]
        row = {
            "layout": layout,
            "variant": name,
            "parallel": par,
            "data": data,
            "encoder_time_max_over_mean": _mean([m["encoder_time_imbalance"] for m in counted]),
            "encoder_s_per_rank": [
                statistics.mean(m["encoder_s_per_rank"][r] for m in counted) for r in range(2)
            ],
            "encoder_flops_max_over_mean": _mean(
                [m["encoder_flops_imbalance_after_dp_reorder"] for m in counted]
            ),
            "tokens_per_s": tokens_per_s(counted),
            "reorder_mib_per_step": statistics.mean(m["reorder_bytes"] for m in counted) / 2**20,
            "encoder_param_optimizer_bytes_per_rank": held,
            "losses": [m["loss"] for m in runs[0]],
        }
        base.setdefault(layout, row)
        row["tokens_per_s_vs_baseline"] = row["tokens_per_s"] / base[layout]["tokens_per_s"]
        rows.append(row)
    print(
        f"encoder balance: {cfg.name}, 2 processes, {args.repeats} runs x {args.steps} steps per variant "
        f"({args.warmup} warm-up steps not counted); baseline = the first variant of each layout"
    )
    print(
        f"{'layout':<12}{'variant':<46}{'enc time max/mean':>18}{'enc FLOPs max/mean':>20}"
        f"{'tokens/s':>10}{'vs base':>9}{'moved MiB':>11}{'enc state KiB':>15}"
    )
    for r in rows:
        print(
            f"{r['layout']:<12}{r['variant']:<46}{r['encoder_time_max_over_mean']:>18.2f}"
            f"{r['encoder_flops_max_over_mean']:>20.2f}{r['tokens_per_s']:>10.0f}"
            f"{r['tokens_per_s_vs_baseline']:>8.2f}x{r['reorder_mib_per_step']:>11.2f}"
            f"{r['encoder_param_optimizer_bytes_per_rank'] / 1024:>15.0f}"
        )
    for layout in base:
        same = [r for r in rows if r["layout"] == layout]
        worst = max(abs(a - b) / abs(b) for r in same for a, b in zip(r["losses"], same[0]["losses"]))
        print(f"{layout}: largest relative loss difference between its variants: {worst:.2e}")
    out = Path(__file__).resolve().parent / "results" / "encoder_balance.json"
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
