"""The paper's Figures 13, 15, 17, 18 and 20 as trends at 64-512 GPUs, by pure simulation
(:func:`omni_pipeline.step_model.predict_step`: the 1F1B pipeline action by action, every collective of the
step over a two-tier network, the optimizer and per-rank memory; no GPU is used).

Assumptions (every one ours unless cited; the workloads' own are in their files,
``apps/omni-train/src/omni_train/configs/workloads/paper-vlm.toml`` and ``paper-omni.toml``):

* Models: ViT-1B + LLaMA-12B (+ USM-2B for the triple-modality sweep), shapes of
  ``omni_pipeline.MODEL_SHAPES`` (the paper publishes names, not shapes); 16K packs (§6), 32 packs per
  pipeline replica per step (§2.2's "batch size of 32"), whole samples packed by omni-data's HybridPacker.
* Device: H100 SXM, 80 GB, 989 TFLOP/s bf16 dense at 40 % of peak (issue 31's calibration point), HBM
  3.35 TB/s; network: 8 GPUs per node on NVLink (450 GB/s, 5 us), 50 GB/s per GPU between nodes (the
  paper's Cluster-A "8*400 Infiniband", §6), 20 us.
* Hand-picked layout per GPU count (the paper tunes each baseline; we give every row the same layout):
  pp 8, tp 2 with Megatron SP, dp = GPUs / 16, LLM ZeRO-1, encoder ZeRO-2, block recompute on ("all memory
  optimizations are enabled", §6 Figure 15). Per step: one step of the workload (step 0), its mean over
  ``STEPS`` steps where noted.
* Rows: Megatron-LM = ``prepend_first_stage``; Megatron-Dist / DistTrain = ``megatron_dist`` (encoders on
  ranks of their own, sized from the 5:5 step and kept, the paper's "statically allocated encoder
  resources"; its throughput counts those GPUs); Optimus = ``optimus_static`` (static bubble filling);
  ours = ``isolated``, ``uniform_on_demand``, ``planned``.
* Alpa-style AutoParallel (:func:`alpa`; Zheng et al., "Alpa", OSDI 2022), at 512 GPUs for every image:text ratio of Figure 13
  and at 256 GPUs for the triple-modality 1:1:8 and 4:4:2: a planner that does not know the modalities
  apart. Assumptions: the encoders stay in the first stage's graph (``prepend_first_stage``); its
  inter-operator pass profiles that pipeline (even split, one simulation) and splits the layers so that
  no stage is busier than needed with stage 0's encoder seconds counted
  (:func:`omni_pipeline.step_model.encoder_aware_stage_layers`: fewer LLM layers on stage 0); its
  intra-operator pass is modelled as a search over tp (+ plain Megatron SP, no async TP: Alpa overlaps no
  collective with a matmul) x dp, LLM ZeRO 0-3 and encoder ZeRO 0/2/3
  (Alpa's sharding of optimizer state), and rematerialisation (none, whole blocks, or one residual branch:
  the trainer's forms), under 1F1B (no virtual stages, no CP / Ulysses: Alpa has neither), keeping the
  fastest layout the trainer's preflight accepts that fits in 80 GB, at the hand-picked layout's global
  batch (32 packs x GPUs / 16). Alpa itself plans one graph with an ILP and a DP over stage slicings
  (not our enumeration), and does not run our trainer; what is kept is what matters here: a balanced
  but modality-unaware split and a searched layout.
* Tuned plans of ours at 512 GPUs (every ratio of Figure 13) and at 256 GPUs (image:audio:text 1:1:8, 4:4:2): :func:`omni_pipeline.tune.tune` with the trainer's
  preflight as its check (``omni_train.simulate.layout_check``), virtual stages, encoder ZeRO and
  selective recompute (``train.recompute_modules``) searched, ``max_sp = 4``, at the same global batch;
  uneven ``stage_layers`` searched for 1F1B layouts under ``uniform_on_demand`` only
  (``split_placements``: ``tune`` would also try ``prepend_first_stage``, Megatron's placement, not ours);
  and ours (the best of our placements) on Alpa's layout and uneven split (``ours_on_alpa_split``). Each with :func:`breakdown` (where the step goes, shares of it).
* Compute bound: the step's model FLOPs (3 x forward, no recompute) at ``peak x efficiency`` on every GPU
  with no bubble, no collective and no recompute; ``bound`` = that time / the predicted step time
  (= MFU / efficiency).
* Figure 18's ablation at 256 GPUs, image:text 7:3: "w/o multiplexing" = prepend; "w/o WL-balance" =
  encoder microbatches in sample order (no Karmarkar-Karp) and no cross-replica reordering; "w/o
  long-short SP" = one rank of each tp group runs each encoder microbatch whole (the penalty's upper bound);
  "w/o tuning" = the hand-picked layout against :func:`omni_pipeline.tune.tune`'s best at 64 GPUs (tuning
  at 256 takes minutes).
* Figure 20 (reordering group size): ``REPLICAS`` DP replicas each draw their own packs (steps 0, 1, ...
  of the workload stand for different replicas' data); DP is synchronous, so the step takes the slowest
  replica's time. A group of ``g`` replicas reorders its encoder samples as the trainer does: for each
  encoder microbatch (slice ``j`` of LLM microbatch ``k``, the same on every replica) the group's samples
  of it go where the trainer's partition sends them (``omni_data.reorder_destinations``: Karmarkar-Karp
  by encoder FLOPs, each part to the replica holding most of it; samples never split), every pack's LLM
  tokens stay home, and the group pays the reordering all-to-all of
  :func:`omni_pipeline.step_model.step_collectives` over ``g`` replicas:
  :func:`omni_pipeline.replica_balance.price_group`, which ``omni-train tune`` searches with.

Run: ``uv run python benchmarks/paper_scale.py [--json PATH]`` (6-7 minutes alone on 2 cores); writes
``benchmarks/results/paper_scale.json`` (or ``PATH``) and prints the tables. ``--show [PATH]`` prints the
tables of results already written (default: the committed ones), computing nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from omni_pipeline.cost import Network
from omni_pipeline.replica_balance import price_group
from omni_pipeline.step_model import (
    Device,
    Layout,
    StepPrediction,
    encoder_aware_stage_layers,
    predict_step,
    rank_memory,
)
from omni_pipeline.tune import candidate_layouts, tune
from omni_pipeline.workload import Workload, load_workload
from omni_train.simulate import layout_check

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "apps/omni-train/src/omni_train/configs/workloads"
OUT = ROOT / "benchmarks/results/paper_scale.json"
GPUS = (64, 128, 256, 512)
RATIOS = ((1, 9), (3, 7), (5, 5), (7, 3), (9, 1))  # image:text samples (Figure 13)
TRIPLE = ((1, 1, 8), (2, 2, 6), (3, 3, 4), (4, 4, 2), (13, 74, 13))  # image:audio:text (Figure 17)
ROWS = ("prepend_first_stage", "megatron_dist", "optimus_static", "isolated", "uniform_on_demand", "planned")
OURS = ("isolated", "uniform_on_demand", "planned")
REPLICAS = 16
DEVICE = Device()
NETWORK = Network()


def layout(gpus: int, placement: str = "uniform_on_demand", **kw) -> Layout:
    """The hand-picked layout (module docstring)."""
    base = dict(pp=8, dp=gpus // 16, tp=2, sequence_parallel=True, llm_zero=1, encoder_zero=2, recompute=True)
    return Layout(**(base | kw), placement=placement)


def vlm(image: float, text: float) -> Workload:
    w = load_workload(WORKLOADS / "paper-vlm.toml")
    return w.with_weights({"openimages": image / 2, "refcocog": image / 2, "bytedlong": text})


def omni(image: float, audio: float, text: float) -> Workload:
    w = load_workload(WORKLOADS / "paper-omni.toml")
    return w.with_weights({"openimages": image, "librispeech": audio, "bytedlong": text})


def row(p: StepPrediction) -> dict:
    """One result row: throughput, MFU, fraction of the compute bound, step time, memory, OOM."""
    last = max(p.memory)
    return {
        "tokens_per_s": p.tokens_per_s,
        "mfu": p.mfu,
        "bound": p.mfu / DEVICE.efficiency,
        "step_time_s": p.step_time_s,
        "stage0_gb": p.memory[0]["total"] / 1e9,
        "last_stage_gb": p.memory[last]["total"] / 1e9,
        "peak_gb": p.peak_memory_bytes / 1e9,
        "stage0_activations_gb": p.memory[0]["activations"] / 1e9,
        "oom": bool(p.oom),
        "encoder_ranks": p.encoder_ranks,
    }


def sweep(make, mixes, gpus: int, rows=ROWS, encoder_ranks: int | None = None) -> dict:
    out = {}
    for mix in mixes:
        w = make(*mix)
        cache: dict = {}
        out[":".join(map(str, mix))] = {
            name: row(predict_step(w, layout(gpus, name), device=DEVICE, network=NETWORK, cache=cache,
                                   encoder_ranks=encoder_ranks if name == "megatron_dist" else None))
            for name in rows
        }  # fmt: skip
    return out


def alpa_stage_layers(w: Workload, lay: Layout, m: int) -> list[int]:
    """Alpa's inter-operator pass for ``lay`` (module docstring): profile the prepend pipeline with the
    even split (one simulation), then split the layers by :func:`encoder_aware_stage_layers` of stage 0's
    encoder seconds (forward, backward and recompute of every microbatch's encoders, TP-split as the step
    model runs them) and the LLM's seconds per layer (busy seconds of every LLM action of the replica over
    the layers: compute, recompute and the collectives inside them)."""
    even = predict_step(w, dataclasses.replace(lay, llm_zero=0, encoder_zero=0), device=DEVICE, network=NETWORK,
                        microbatches=m)  # fmt: skip
    tl = even.simulation.timelines
    enc = sum(ev.end_s - ev.start_s for ev in tl[0] if ev.is_encoder)
    llm = sum(ev.end_s - ev.start_s for r in range(lay.pp) for ev in tl[r] if not ev.is_encoder)
    n = w.shapes["llm"].n_layers
    return encoder_aware_stage_layers(n, lay.pp, enc, llm / n)


def alpa(w: Workload, gpus: int, global_batch: int, check) -> tuple[StepPrediction, dict]:
    """The Alpa-style AutoParallel baseline (module docstring): the encoders prepended to stage 0, the
    layers split by :func:`alpa_stage_layers`, the best of pp x tp x dp x LLM ZeRO x encoder ZeRO x
    recompute (whole blocks or one branch) under 1F1B that the trainer's preflight accepts and that fits
    in memory, at ``global_batch`` packs per step. Returns the best prediction and its row (with its
    layout, stage split and search counts)."""
    t0 = time.perf_counter()
    splits: dict = {}
    caches: dict = {}
    best: StepPrediction | None = None
    tried = fits = 0
    verdicts: dict = {}
    # plain Megatron SP: Alpa's intra-operator pass has no collective-matmul overlap
    for lay, m in candidate_layouts(w, gpus, global_batch, max_sp=1, max_virtual=1, async_tp=False,
                                    placements=("prepend_first_stage",)):  # fmt: skip
        if lay.offload:
            continue  # Alpa rematerialises; it does not offload activations to host memory
        shape = dataclasses.replace(lay, recompute=False, recompute_modules=())
        if shape not in verdicts:
            verdicts[shape] = check(shape)
        if verdicts[shape] is not None:
            continue
        tried += 1
        key = dataclasses.replace(lay, llm_zero=0, encoder_zero=0)
        if key not in splits:
            splits[key] = alpa_stage_layers(w, lay, m)
        layers = splits[key]
        wm = dataclasses.replace(w, microbatches=m)
        if max(r["total"] for r in rank_memory(wm, lay, stage_layers=layers).values()) > DEVICE.memory_bytes:
            continue  # a lower bound of the simulated peak
        p = predict_step(w, lay, device=DEVICE, network=NETWORK, microbatches=m, stage_layers=layers,
                         cache=caches.setdefault(tuple(layers), {}))  # fmt: skip
        if p.oom:
            continue
        fits += 1
        if best is None or p.tokens_per_s > best.tokens_per_s:
            best = p
    if best is None:
        raise ValueError(f"alpa: no layout of {gpus} GPUs fits ({tried} accepted by preflight)")
    out = row(best)
    key = dataclasses.replace(best.layout, llm_zero=0, encoder_zero=0)
    out |= {"layout": dataclasses.asdict(best.layout), "stage_layers": splits[key], "layouts_accepted": tried,
            "layouts_fit": fits, "search_s": time.perf_counter() - t0}  # fmt: skip
    out["breakdown"] = breakdown(w, best, global_batch // best.layout.dp, stage_layers=splits[key])
    return best, out


def breakdown(w: Workload, p: StepPrediction, m: int, stage_layers=None) -> dict:
    """Where the step of ``p`` goes, as shares of its step time (busiest pipeline rank): ``model_compute``
    (the compute bound's seconds: model FLOPs over every GPU at ``peak x efficiency``, = ``bound``),
    ``rank_excess`` (the busiest rank's model compute above the mean: encoder work or layers unevenly
    spread), ``recompute`` (its compute less the same layout's without recompute), ``tp`` / ``cp`` /
    ``ulysses`` / ``ep`` (inside its actions), ``pipeline_idle`` (bubble and P2P waits), the once-per-step
    ``llm_sync`` / ``encoder_sync`` (ZeRO or DP gradient collectives, after the last backward),
    ``reorder`` and ``optimizer``, ``offload`` (activation copies to and from host memory) and
    ``data_loading`` (the payload decode the step waits for). They sum to 1."""
    t = p.time_s
    base = predict_step(w, dataclasses.replace(p.layout, recompute=False, recompute_modules=()), device=DEVICE,
                        network=NETWORK, microbatches=m, stage_layers=stage_layers)  # fmt: skip
    compute = t["llm_compute"] + t["encoder_compute"]
    plain = base.time_s["llm_compute"] + base.time_s["encoder_compute"]
    bound = p.mfu / DEVICE.efficiency
    step = p.step_time_s
    out = {
        "model_compute": bound,
        "rank_excess": plain / step - bound,
        "recompute": (compute - plain) / step,
        **{k: t[k] / step for k in ("tp", "cp", "ulysses", "ep", "pipeline_idle")},
        "llm_sync": sum(v for k, v in t.items() if k.startswith(("llm_all", "llm_reduce", "expert_"))) / step,
        "encoder_sync": sum(v for k, v in t.items() if k.startswith(("encoder_all", "encoder_reduce")))
        / step,
        "reorder": t.get("reorder_all_to_all", 0.0) / step,
        "optimizer": t["optimizer"] / step,
        "offload": t.get("offload", 0.0) / step,
        "data_loading": t.get("data_loading", 0.0) / step,
    }
    if abs(sum(out.values()) - 1) > 1e-9:
        raise AssertionError(f"breakdown: shares sum to {sum(out.values())}, not 1: {out}")
    return out


def best_plans(make, mix, gpus: int) -> dict:
    """At one mix: the tuned plan of ours (:func:`omni_pipeline.tune.tune` with the trainer's preflight as
    its check; virtual stages, encoder ZeRO and selective recompute searched) and the Alpa-style
    baseline (:func:`alpa`), both at the hand-picked layout's global batch (32 packs x GPUs / 16), each
    with its :func:`breakdown`."""
    w = make(*mix)
    gb = w.microbatches * gpus // 16
    check = layout_check(w)
    t0 = time.perf_counter()
    res = tune(w, gpus, device=DEVICE, network=NETWORK, global_batch=gb, top=1, max_sp=4, check=check,
               split_placements=("uniform_on_demand",))  # fmt: skip
    wall = time.perf_counter() - t0
    best = res.plans[0]
    tuned = row(best) | {"layout": dataclasses.asdict(best.layout), "tune_s": wall,
                         "layouts_considered": res.considered, "stage_layers": res.stage_layers[0],
                         "breakdown": breakdown(w, best, gb // best.layout.dp, stage_layers=res.stage_layers[0])}  # fmt: skip
    a, alp = alpa(w, gpus, gb, check)
    # ours on Alpa's layout and uneven split
    split = alp["stage_layers"]
    m = gb // a.layout.dp
    ours = [predict_step(w, dataclasses.replace(a.layout, placement=pl), device=DEVICE, network=NETWORK,
                         microbatches=m, stage_layers=split) for pl in OURS]  # fmt: skip
    fit = [q for q in ours if not q.oom] or ours
    q = max(fit, key=lambda q: q.tokens_per_s)
    on_alpa = row(q) | {"layout": dataclasses.asdict(q.layout), "stage_layers": split,
                        "breakdown": breakdown(w, q, m, stage_layers=split)}  # fmt: skip
    return {"tuned": tuned, "alpa": alp, "ours_on_alpa_split": on_alpa}


def reorder_groups(w: Workload, gpus: int) -> dict:
    """Figure 20 (module docstring): step time of REPLICAS synchronous replicas per group size, priced by
    :func:`omni_pipeline.replica_balance.price_group` (the pricing ``omni-train tune`` searches with)."""
    out = {}
    cache: dict = {}  # the replicas' packs, drawn once for every group size
    for g in (1, 2, 4, 8, 16):
        r = price_group(w, layout(gpus), g, device=DEVICE, network=NETWORK, replicas=REPLICAS, cache=cache)
        out[str(g)] = {
            "step_time_s": r.step_time_s,
            "tokens_per_s": r.tokens_per_s,
            "bound": r.mfu / DEVICE.efficiency,
            "reorder_all_to_all_ms": 1e3 * r.reorder_all_to_all_s,
            "replica_step_spread": r.spread,
        }
    return out


def ablation(gpus: int) -> dict:
    w = vlm(7, 3)
    common = dict(device=DEVICE, network=NETWORK)
    full = predict_step(w, layout(gpus, "planned"), **common)
    out = {
        "full (planned)": row(full),
        "w/o multiplexing (prepend)": row(predict_step(w, layout(gpus, "prepend_first_stage"), **common)),
        "w/o WL-balance": row(predict_step(w, layout(gpus, "planned"), balance=False, **common)),
        "w/o long-short SP": row(predict_step(w, layout(gpus, "planned"), encoder_sp=False, **common)),
    }
    for r in out.values():
        r["vs_full"] = r["tokens_per_s"] / out["full (planned)"]["tokens_per_s"]
    return out


def tuning(gpus: int = 64) -> dict:
    w = vlm(7, 3)
    t0 = time.perf_counter()
    res = tune(
        w,
        gpus,
        device=DEVICE,
        network=NETWORK,
        global_batch=w.microbatches * gpus // 16,
        top=1,
        max_sp=4,
        check=layout_check(w),  # only layouts the trainer's preflight accepts
        split_placements=("uniform_on_demand",),
    )
    wall = time.perf_counter() - t0
    best = res.plans[0]
    hand = predict_step(w, layout(gpus, best.layout.placement), device=DEVICE, network=NETWORK)
    return {
        "gpus": gpus,
        "tuned_layout": dataclasses.asdict(best.layout),
        "tuned_stage_layers": res.stage_layers[0],
        "tuned": row(best),
        "hand_picked": row(hand),
        "tuned_over_hand": best.tokens_per_s / hand.tokens_per_s,
        "tune_wall_s": wall,
        "layouts_considered": res.considered,
    }


def _commit() -> str:
    """The short hash of ``HEAD`` (``unknown`` outside git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# what print_tables reads; a results file without one of them is refused by --show
TABLE_KEYS = ("fig13_throughput", "fig13_best_512", "fig15_memory", "fig17_triple", "fig18_ablation",
              "fig17_alpa", "fig17_tuned", "fig18_tuning", "fig20_reorder_group", "timing", "wall_s")  # fmt: skip
MAX_RESULTS_BYTES = 16 << 20  # the committed file is about 0.2 MB


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="The paper's Figures 13, 15, 17, 18 and 20 at 64-512 GPUs by pure simulation (the "
        "assumptions: this file's docstring).",
        epilog=f"With no flag: computes every row (6-7 minutes alone on 2 cores), OVERWRITES "
        f"{OUT.relative_to(ROOT)} and prints the tables.",
    )
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--json", type=Path, default=OUT, metavar="PATH",
                       help=f"write the results here instead (default: overwrite {OUT.relative_to(ROOT)})")  # fmt: skip
    where.add_argument("--show", nargs="?", const=OUT, type=Path, metavar="PATH",
                       help="print the tables of results already written (default: the committed ones); "
                       "computes and writes nothing")  # fmt: skip
    args = ap.parse_args(argv)
    if args.show is not None:
        res = _read_results(args.show, ap)
        try:
            print_tables(res)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            ap.error(f"--show: {args.show}: malformed results ({type(exc).__name__}: {exc})")
        return
    # checked before minutes of simulation, not after
    if args.json.is_dir():
        ap.error(f"--json: {args.json} is a directory, not a file")
    if not args.json.parent.is_dir():
        ap.error(f"--json: {args.json.parent} is not a directory")
    if not os.access(args.json.parent, os.W_OK) or (args.json.exists() and not os.access(args.json, os.W_OK)):
        ap.error(f"--json: {args.json} is not writable")
    t0 = time.perf_counter()
    # Megatron-Dist's encoder ranks: sized once from the 5:5 step at pp 8 (kept for every ratio)
    probe = predict_step(vlm(5, 5), layout(64, "megatron_dist"), device=DEVICE, network=NETWORK)
    er = probe.encoder_ranks
    timing = {}
    t = time.perf_counter()
    predict_step(vlm(5, 5), layout(512, "planned"), device=DEVICE, network=NETWORK)
    timing["one_512_gpu_planned_config_s"] = time.perf_counter() - t
    fig13 = {str(g): sweep(vlm, RATIOS, g, encoder_ranks=er) for g in GPUS}
    fig17 = sweep(omni, TRIPLE, 256, rows=("prepend_first_stage", "megatron_dist", "uniform_on_demand", "planned"),
                  encoder_ranks=er)  # fmt: skip
    fig18 = ablation(256)
    fig20 = reorder_groups(vlm(7, 3), 256)
    tuned = tuning(64)
    best13 = {":".join(map(str, mix)): best_plans(vlm, mix, 512) for mix in RATIOS}  # Figure 13's ratios
    alpa17, tuned17 = {}, {}
    for mix in ((1, 1, 8), (4, 4, 2)):
        w = omni(*mix)
        gb = w.microbatches * 256 // 16
        alpa17[":".join(map(str, mix))] = alpa(w, 256, gb, layout_check(w))[1]
        t = time.perf_counter()
        res = tune(w, 256, device=DEVICE, network=NETWORK, global_batch=gb, top=1, max_sp=4, check=layout_check(w),
                   split_placements=("uniform_on_demand",))  # fmt: skip
        b = res.plans[0]
        tuned17[":".join(map(str, mix))] = row(b) | {
            "layout": dataclasses.asdict(b.layout), "stage_layers": res.stage_layers[0],
            "tune_s": time.perf_counter() - t,
            "breakdown": breakdown(w, b, gb // b.layout.dp, stage_layers=res.stage_layers[0]),
        }  # fmt: skip
    res = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": _commit(),
        "device": dataclasses.asdict(DEVICE),
        "network": dataclasses.asdict(NETWORK),
        "layout": dataclasses.asdict(layout(256)),
        "megatron_dist_encoder_ranks": er,
        "fig13_throughput": fig13,
        "fig15_memory": {
            k: {n: {m: v[m] for m in ("stage0_gb", "last_stage_gb", "oom")} for n, v in r.items()}
            for k, r in fig13["256"].items()
        },
        "fig13_best_512": best13,
        "fig17_triple": fig17,
        "fig17_alpa": alpa17,
        "fig17_tuned": tuned17,
        "fig18_ablation": fig18,
        "fig18_tuning": tuned,
        "fig20_reorder_group": fig20,
        "timing": timing,
        "wall_s": time.perf_counter() - t0,
    }
    args.json.write_text(json.dumps(res, indent=2))
    print_tables(res)


def _read_results(path: Path, ap: argparse.ArgumentParser) -> dict:
    """The results ``main`` wrote to ``path``; ``ap.error`` (exit 2, one line naming the file) when it is
    missing, larger than ``MAX_RESULTS_BYTES`` (refused before it is read), not JSON, not an object, or
    lacks a table's key (written by an older version of this script)."""
    try:
        size = path.stat().st_size
        if size > MAX_RESULTS_BYTES:
            ap.error(
                f"--show: {path}: {size} bytes, more than the {MAX_RESULTS_BYTES} a results file may hold"
            )
        res = json.loads(path.read_text())
    except OSError as exc:
        ap.error(f"--show: {path}: {exc.strerror or exc}")
    except ValueError as exc:
        ap.error(f"--show: {path}: not JSON ({exc})")
    if not isinstance(res, dict):
        ap.error(f"--show: {path}: not paper_scale results (a JSON {type(res).__name__}, not an object)")
    missing = [k for k in TABLE_KEYS if k not in res]
    if len(missing) == len(TABLE_KEYS):
        ap.error(f"--show: {path}: not paper_scale results (none of its keys, e.g. fig13_throughput)")
    if missing:
        ap.error(f"--show: {path}: written by an older paper_scale.py, no {', '.join(missing)}")
    return res


def print_tables(res: dict) -> None:
    for g, by_ratio in res["fig13_throughput"].items():
        print(f"Figure 13, {g} GPUs: tokens/s (M) [fraction of compute bound]")
        for ratio, rows in by_ratio.items():
            print(f"  {ratio:>5} " + "  ".join(f"{n[:10]:>10} {r['tokens_per_s'] / 1e6:6.2f} [{r['bound']:.2f}]"
                                             f"{'*' if r['oom'] else ''}" for n, r in rows.items()))  # fmt: skip
    print(
        "Figure 13, 512 GPUs: tuned plan of ours and the Alpa-style baseline (searched), fraction of the bound"
    )
    for ratio, b in res["fig13_best_512"].items():
        for name, r in b.items():
            lay = r["layout"]
            print(f"  {ratio:>5} {name:<6} {r['tokens_per_s'] / 1e6:6.2f} [{r['bound']:.2f}] pp {lay['pp']} x v "
                  f"{lay['virtual_stages']} tp {lay['tp']} cp {lay['cp']} u {lay['ulysses']} z {lay['llm_zero']}/"
                  f"{lay['encoder_zero']} rc {lay['recompute']}{lay['recompute_modules']} {lay['placement']} "
                  f"peak {r['peak_gb']:.1f} GB")  # fmt: skip
            print("        " + ", ".join(f"{k} {v:.3f}" for k, v in r["breakdown"].items() if abs(v) > 5e-4))
    print("Figure 15 (256 GPUs): stage-0 / last-stage GB")
    for ratio, rows in res["fig15_memory"].items():
        print(f"  {ratio:>5} " + "  ".join(f"{n[:10]:>10} {r['stage0_gb']:5.1f}/{r['last_stage_gb']:5.1f}"
                                         for n, r in rows.items()))  # fmt: skip
    print("Figure 17 (256 GPUs, image:audio:text): tokens/s (M)")
    for mix, rows in res["fig17_triple"].items():
        print(f"  {mix:>9} " + "  ".join(f"{n[:10]:>10} {r['tokens_per_s'] / 1e6:6.2f} [{r['bound']:.2f}]"
                                         for n, r in rows.items()))  # fmt: skip
    print("Figure 18 ablation (256 GPUs, 7:3):")
    for name, r in res["fig18_ablation"].items():
        print(
            f"  {name:<28} {r['tokens_per_s'] / 1e6:6.2f} M tokens/s  x{r['vs_full']:.3f}  [{r['bound']:.2f}]"
        )
    for mix, r in res["fig17_alpa"].items():
        lay = r["layout"]
        print(f"  {mix:>9} alpa {r['tokens_per_s'] / 1e6:6.2f} [{r['bound']:.2f}] pp {lay['pp']} tp {lay['tp']} "
              f"z {lay['llm_zero']}/{lay['encoder_zero']} rc {lay['recompute']}{lay['recompute_modules']} "
              f"split {r['stage_layers']}")  # fmt: skip
    for mix, r in res["fig17_tuned"].items():
        lay = r["layout"]
        print(f"  {mix:>9} tuned {r['tokens_per_s'] / 1e6:6.2f} [{r['bound']:.2f}] pp {lay['pp']} x v "
              f"{lay['virtual_stages']} tp {lay['tp']} u {lay['ulysses']} z {lay['llm_zero']}/{lay['encoder_zero']} "
              f"rc {lay['recompute']}{lay['recompute_modules']} {lay['placement']} split {r['stage_layers']}")  # fmt: skip
    t = res["fig18_tuning"]
    print(f"  tuned vs hand-picked at {t['gpus']} GPUs: x{t['tuned_over_hand']:.3f} ({t['tune_wall_s']:.1f} s, "
          f"{t['tuned_layout']})")  # fmt: skip
    print("Figure 20 (256 GPUs, 7:3): group size -> tokens/s (M), all-to-all ms, replica spread")
    for g, r in res["fig20_reorder_group"].items():
        print(
            f"  {g:>3} {r['tokens_per_s'] / 1e6:6.2f}  {r['reorder_all_to_all_ms']:7.2f} ms  {r['replica_step_spread']:.3f}"
        )
    print(
        f"wall {res['wall_s']:.1f} s; one 512-GPU planned config {res['timing']['one_512_gpu_planned_config_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
