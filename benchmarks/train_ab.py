"""A/B of the trainer's encoder placement on the bundled data: every placement x reordering, in one run.

Runs the real trainer (``omni-heavy`` by default: 2 processes, pp=2, gloo on CPU) for a few steps per
variant in one 2-rank world: every placement policy (the paper's ``prepend_first_stage``, ``isolated``,
``uniform_on_demand`` and our ``planned``) with reordering on and off. Each repeat starts at a different
variant (rotated order), so slow drift of a machine does not always favour the same one. The first
``--warmup`` steps of every run are not counted.

Per variant (one JSON row each): ``tokens_per_s`` (the counted steps' tokens over their summed wall time;
``tokens_per_s_per_run`` per repeat), ``step_time_s`` (mean), ``simulated_step_time_s``: the simulator's
prediction for the same steps and the flow the run used, from a cost model fitted on that run's own
``actions.jsonl`` (``omni-train simulate --calibration``; mean over the repeats), ``idle_s_per_rank``
(wall minus time inside pipeline actions, mean per step), ``time_s_per_rank`` (mean seconds per step in
each phase of ``metrics.jsonl``'s breakdown), ``outside_pipeline_fraction_per_rank`` (share of the step
outside pipeline actions and waits: data, gradient collectives, optimizer, checkpoint, other; the issue's
<= 10% target), ``peak_activation_bytes_per_rank`` (measured saved
activations, maximum over the counted steps) beside ``simulated_stage0_peak_activation_bytes``. Ratios are
against ``prepend_first_stage`` with reordering off (encoders on stage 0, as Megatron-LM / torchtitan do),
measured in the same run. Also checks that every variant saw the same losses (same data, same math).

Mixture: by default one image:text share for every step (``--share``, default 9:1, the recipe's
image-heavy phase; no audio), so the measured steps have the encoder load asked for; ``--mixture all``
keeps the config's phases. ``--sweep`` runs the image shares 1:9, 5:5 and 9:1 (every placement, reordering
on) and prints throughput per share per policy and each policy's drop from 1:9 to 9:1, and beside them the
compute bound (``compute_bound_tokens_per_s``): the throughput of a perfect placement of the same measured
compute, which falls with the image share too, because the added encoder work is work.

Run time on 2 otherwise idle cores (``omni-heavy``): the default (8 variants x 2 repeats x 10 steps) and
``--sweep`` (3 shares x 4 placements x 2 repeats x 10 steps) each take about 4-7 minutes (steps and
repeats were cut to stay under 8); ``--quick`` (2 steps, 1 repeat, 4 microbatches) is a smoke run of
well under a minute of training. Do not record numbers measured beside other load.

    uv run python benchmarks/train_ab.py [--config omni-heavy] [--json PATH] [--steps 10] [--warmup 3]
        [--repeats 2] [--share 9:1 | --mixture all] [--sweep] [--quick]
        [--placements prepend_first_stage,isolated,planned] [--reorder both|on|off]

``--placements`` / ``--reorder`` run a subset (fewer variants: more repeats in the same time, for a
ratio that the machine's noise settles less easily); the ratios are then against prepend with
reordering off if it ran, else prepend with reordering on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from omni_parallel.testing import run_world
from omni_pipeline import PlacementPolicy
from omni_pipeline.step_metrics import PHASES
from omni_train.binder import load_config
from omni_train.config import MixturePhase, RunConfig
from omni_train.metrics import read_metrics, tokens_per_s
from omni_train.simulate import simulate_config

BASELINE = (PlacementPolicy.PREPEND_FIRST_STAGE, False)
SWEEP_SHARES = ("1:9", "5:5", "9:1")


def _share_mixture(share: str) -> list[MixturePhase]:
    image, text = (float(x) for x in share.split(":"))
    return [MixturePhase({"image": image, "audio": 0.0, "text": text})]


def _variants(
    sweep: bool, placements: list[PlacementPolicy], reorder: str
) -> list[tuple[PlacementPolicy, bool]]:
    """The variants to run: ``placements`` x reordering (``reorder``: ``"both"``, ``"on"`` or ``"off"``;
    the sweep runs reordering on)."""
    if sweep or reorder == "on":
        return [(p, True) for p in placements]
    return [(p, r) for p in placements for r in ((False,) if reorder == "off" else (False, True))]


def _placements(text: str) -> list[PlacementPolicy]:
    """``--placements``: a comma-separated list of placement names (``all``: every placement).

    Raises:
        ValueError: an unknown name (names it and the known ones).
    """
    if text == "all":
        return list(PlacementPolicy)
    known = {str(p): p for p in PlacementPolicy}
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--placements: unknown {unknown or text!r}; choose from {', '.join(known)} or all")
    return [known[n] for n in dict.fromkeys(names)]


def _name(placement: PlacementPolicy, reorder: bool) -> str:
    return f"{placement}, reorder {'on' if reorder else 'off'}"


def _run_variants(rank: int, world_size: int, cfgs: list[RunConfig], root: str, repeats: int) -> None:
    """Train every config ``repeats`` times in rotated order; run ``i`` of repeat ``rep`` in
    ``root/r<rep>v<i>``."""
    from omni_train.trainer import Trainer

    for rep in range(repeats):
        for j in range(len(cfgs)):
            i = (rep + j) % len(cfgs)
            Trainer(cfgs[i], Path(root) / f"r{rep}v{i}", resume=False).run()


def _mean_lists(lists: list[list[float]]) -> list[float]:
    return [statistics.mean(xs) for xs in zip(*lists)]


def _outside(rows: list[dict]) -> list[float]:
    """Per rank, the share of the counted steps' wall time outside pipeline actions and waits (data,
    gradient collectives, optimizer, checkpoint, other: every phase but encoder, llm, p2p_wait and
    reduce_wait)."""
    inside = ("encoder", "llm", "p2p_wait", "reduce_wait")
    ranks = len(rows[0]["time_s_per_rank"]["data"])
    out = []
    for r in range(ranks):
        total = sum(m["time_s_per_rank"][p][r] for m in rows for p in PHASES)
        outside = sum(m["time_s_per_rank"][p][r] for m in rows for p in PHASES if p not in inside)
        out.append(outside / total)
    return out


def _sweep_target(rows: list[dict], bound: dict[str, float]) -> dict[str, float]:
    """What the sweep's target (``planned`` drops from the first share to the last at most half as much as
    ``prepend_first_stage``) asks of ``planned`` at the last share, against the compute bound there."""
    first, last = SWEEP_SHARES[0], SWEEP_SHARES[-1]

    def rate(placement: PlacementPolicy, share: str) -> float:
        return next(
            r["tokens_per_s"] for r in rows if r["placement"] == str(placement) and r["share"] == share
        )

    prepend_drop = 1 - rate(PlacementPolicy.PREPEND_FIRST_STAGE, last) / rate(
        PlacementPolicy.PREPEND_FIRST_STAGE, first
    )
    planned_first = rate(PlacementPolicy.PLANNED, first)
    needed = planned_first * (1 - prepend_drop / 2)
    return {
        "prepend_drop": prepend_drop,
        "planned_first_tokens_per_s": planned_first,
        "planned_needed_tokens_per_s": needed,
        "needed_vs_compute_bound": needed / bound[last],
        "planned_vs_compute_bound": rate(PlacementPolicy.PLANNED, last) / bound[last],
    }


def _compute_bound(rows: list[dict]) -> dict[str, float]:
    """Per share, the tokens/s of a perfect placement: a step's measured compute (encoder and LLM action
    seconds, summed over ranks) spread evenly over the ranks with no wait and nothing outside the pipeline;
    the placement with the least compute per step stands for the share. How far throughput must fall as
    the image share grows whatever the placement: the added encoder work itself."""
    out = {}
    for share in SWEEP_SHARES:
        best = None
        for r in (r for r in rows if r["share"] == share):
            t = r["time_s_per_rank"]
            ranks = len(t["encoder"])
            step = sum(t["encoder"][i] + t["llm"][i] for i in range(ranks)) / ranks
            tokens = r["tokens_per_s"] * r["step_time_s"]
            best = max(best or 0.0, tokens / step)
        out[share] = best
    return out


def _row(cfg: RunConfig, runs: list[Path], warmup: int, steps: int) -> dict:
    """One variant's row from its repeats' run directories (metrics and a calibrated simulation each)."""
    metrics = [read_metrics(run / "metrics.jsonl") for run in runs]
    counted = [m for ms in metrics for m in ms[warmup:]]
    simulated, sim_peak0 = [], []
    for run in runs:
        simulate_config(
            cfg,
            out_dir=run / "sim",
            calibration=run,
            steps=steps - warmup,
            first_step=warmup,
            plots=False,
        )
        as_run = json.loads((run / "sim" / "simulate.json").read_text())["results"]["as run"]
        simulated.append(as_run["step_time_s"])
        sim_peak0.append(as_run["stage0_peak_activation_bytes"])
    peaks = [m["peak_activation_bytes_per_rank"] for m in counted]
    return {
        "variant": _name(cfg.parallel.placement, cfg.parallel.reorder),
        "placement": str(cfg.parallel.placement),
        "reorder": cfg.parallel.reorder,
        "tokens_per_s": tokens_per_s(counted),
        "tokens_per_s_per_run": [tokens_per_s(ms[warmup:]) for ms in metrics],
        "step_time_s": statistics.mean(m["step_time_s"] for m in counted),
        "simulated_step_time_s": statistics.mean(simulated),
        "simulated_step_time_s_per_run": simulated,
        "idle_s_per_rank": _mean_lists([m["idle_s_per_rank"] for m in counted]),
        "time_s_per_rank": {p: _mean_lists([m["time_s_per_rank"][p] for m in counted]) for p in PHASES},
        "outside_pipeline_fraction_per_rank": _outside(counted),
        "peak_activation_bytes_per_rank": [max(col) for col in zip(*peaks)],
        "simulated_stage0_peak_activation_bytes": max(sim_peak0),
        "losses": [m["loss"] for m in metrics[0]],
    }


def _measure(cfg: RunConfig, args, root: Path) -> list[dict]:
    """Every variant of ``cfg`` (``args.repeats`` rotated repeats in one 2-process world) -> rows."""
    variants = _variants(args.sweep, args.placements, args.reorder)
    cfgs = [
        dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, placement=p, reorder=r))
        for p, r in variants
    ]
    run_world(_run_variants, cfg.parallel.world_size, args=(cfgs, str(root), args.repeats), timeout_s=3600)
    return [
        _row(c, [root / f"r{rep}v{i}" for rep in range(args.repeats)], args.warmup, args.steps)
        for i, c in enumerate(cfgs)
    ]


def _print_table(rows: list[dict]) -> None:
    # prepend without reordering; else prepend with it (--reorder on); else the first row
    base = next((r for r in rows if (r["placement"], r["reorder"]) == BASELINE), None)
    base = base or next((r for r in rows if r["placement"] == str(BASELINE[0])), rows[0])
    print(
        f"{'variant':<34}{'tokens/s':>10}{'vs base':>9}{'runs min-max':>14}{'step s':>9}{'sim s':>8}"
        f"{'sim/meas':>9}  idle s/step per rank  outside %  peak act MiB per rank"
    )
    for r in rows:
        idle = " ".join(f"{x:.3f}" for x in r["idle_s_per_rank"])
        outside = " ".join(f"{100 * x:.0f}" for x in r["outside_pipeline_fraction_per_rank"])
        peak = " ".join(f"{x / 2**20:.1f}" for x in r["peak_activation_bytes_per_rank"])
        runs = r["tokens_per_s_per_run"]
        print(
            f"{r['variant']:<34}{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / base['tokens_per_s']:>8.2f}x"
            f"{min(runs):>8.0f}-{max(runs):<5.0f}{r['step_time_s']:>9.3f}{r['simulated_step_time_s']:>8.3f}"
            f"{r['simulated_step_time_s'] / r['step_time_s']:>9.2f}  {idle:<21}  {outside:<9}  {peak}"
        )
    worst = max(abs(a - b) / abs(b) for r in rows for a, b in zip(r["losses"], base["losses"]))
    print(f"largest relative loss difference between variants over all steps: {worst:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="omni-heavy")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="runs per variant, in rotated order")
    ap.add_argument("--share", default="9:1", help="image:text share of every step (no audio)")
    ap.add_argument("--mixture", choices=["share", "all"], default="share")
    ap.add_argument("--sweep", action="store_true", help=f"image shares {', '.join(SWEEP_SHARES)}")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 steps, 1 repeat, 4 microbatches")
    ap.add_argument("--placements", default="all", help="comma-separated placements to run (default all)")
    ap.add_argument("--reorder", choices=["both", "on", "off"], default="both", help="reordering variants")
    ap.add_argument("--json", default=None, help="output path (default benchmarks/results/train_ab.json)")
    args = ap.parse_args()
    try:
        args.placements = _placements(args.placements)
    except ValueError as exc:
        ap.error(str(exc))
    cfg = load_config(args.config)
    data = cfg.data
    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 1, 1
        data = dataclasses.replace(data, microbatches=min(4, data.microbatches))
    cfg = dataclasses.replace(
        cfg,
        data=data,
        train=dataclasses.replace(cfg.train, steps=args.steps),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=0),
    )
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} leaves no counted step of --steps {args.steps}")
    shares = SWEEP_SHARES if args.sweep else (args.share if args.mixture == "share" else None,)
    result = {
        "config": cfg.name,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "sweep": args.sweep,
        "rows": [],
    }
    for share in shares:
        mixture = _share_mixture(share) if share is not None else cfg.data.mixture
        c = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, mixture=mixture))
        with tempfile.TemporaryDirectory() as root:
            rows = _measure(c, args, Path(root))
        print(
            f"\ntrainer A/B: {cfg.name}, image:text {share or '(config phases)'}, "
            f"{cfg.parallel.world_size} processes, {args.repeats} runs x {args.steps} steps per variant in "
            f"rotated order ({args.warmup} warm-up steps not counted)"
        )
        _print_table(rows)
        result["rows"] += [{"share": share, **r} for r in rows]
    if args.sweep:
        print("\nthroughput (tokens/s) per image:text share, reordering on")
        print(f"{'placement':<22}" + "".join(f"{s:>10}" for s in SWEEP_SHARES) + f"{'drop 1:9 -> 9:1':>18}")
        for p in args.placements:
            got = {r["share"]: r["tokens_per_s"] for r in result["rows"] if r["placement"] == str(p)}
            drop = 1 - got[SWEEP_SHARES[-1]] / got[SWEEP_SHARES[0]]
            print(f"{p!s:<22}" + "".join(f"{got[s]:>10.0f}" for s in SWEEP_SHARES) + f"{100 * drop:>17.1f}%")
        bound = _compute_bound(result["rows"])
        result["compute_bound_tokens_per_s"] = bound
        drop = 1 - bound[SWEEP_SHARES[-1]] / bound[SWEEP_SHARES[0]]
        print(
            f"{'compute bound':<22}"
            + "".join(f"{bound[s]:>10.0f}" for s in SWEEP_SHARES)
            + f"{100 * drop:>17.1f}%"
        )
        if (
            PlacementPolicy.PREPEND_FIRST_STAGE in args.placements
            and PlacementPolicy.PLANNED in args.placements
        ):
            result["sweep_target"] = target = _sweep_target(result["rows"], bound)
            print(
                f"target: planned drops at most half of prepend's {100 * target['prepend_drop']:.1f}%, so from its "
                f"{target['planned_first_tokens_per_s']:.0f} tokens/s at {SWEEP_SHARES[0]} it needs "
                f"{target['planned_needed_tokens_per_s']:.0f} at {SWEEP_SHARES[-1]}: "
                f"{100 * target['needed_vs_compute_bound']:.0f}% of the compute bound "
                f"(measured: {100 * target['planned_vs_compute_bound']:.0f}%)"
            )
    out = Path(args.json) if args.json else Path(__file__).resolve().parent / "results" / "train_ab.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
