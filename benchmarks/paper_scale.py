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
  ours = ``isolated``, ``uniform_on_demand``, ``planned``. The Alpa-style AutoParallel baseline is not
  modelled.
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
  replica's time. A group of ``g`` replicas pools its ``g x 32`` packs and deals them back greedily by
  modelled FLOPs (largest first to the least-loaded replica: whole packs move, samples never split), and
  pays the reordering all-to-all of :func:`omni_pipeline.step_model.step_collectives` over ``g`` replicas.

Run: ``uv run python benchmarks/paper_scale.py`` (about a minute or two on 2 cores); writes
``benchmarks/results/paper_scale.json``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from omni_parallel.flops import attention_flops, model_flops
from omni_pipeline import encoder_forward_flops
from omni_pipeline.cost import Network
from omni_pipeline.step_model import Device, Layout, StepPrediction, predict_step
from omni_pipeline.tune import tune
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


def pack_flops(w: Workload, p) -> float:
    llm = model_flops(
        w.model.llm_params,
        p.num_tokens,
        attention_flops(p.seqlens, w.model.llm_dim, w.model.llm_layers, causal=True),
        training=False,
    )
    return llm + sum(encoder_forward_flops(w.model, s.modality, s.media_tokens) for s in p.samples)  # fmt: skip


def reorder_groups(w: Workload, gpus: int) -> dict:
    """Figure 20 (module docstring): step time of REPLICAS synchronous replicas per group size."""
    replicas = [w.step_packs(r, w.microbatches) for r in range(REPLICAS)]
    out = {}
    for g in (1, 2, 4, 8, 16):
        dealt: list[list] = []
        for start in range(0, REPLICAS, g):
            pool = sorted(
                (p for rep in replicas[start : start + g] for p in rep), key=lambda p: -pack_flops(w, p)
            )
            bins: list[list] = [[] for _ in range(g)]
            load = [0.0] * g
            for p in pool:  # largest first to the least-loaded replica that still has room
                j = min((i for i in range(g) if len(bins[i]) < w.microbatches), key=lambda i: load[i])
                bins[j].append(p)
                load[j] += pack_flops(w, p)
            dealt += bins
        lay = layout(gpus, reorder_group=g)
        preds = [predict_step(w, lay, device=DEVICE, network=NETWORK, packs=packs) for packs in dealt]
        slow = max(preds, key=lambda p: p.step_time_s)
        tokens = sum(sum(p.num_tokens for p in packs) for packs in dealt) / REPLICAS
        step = slow.step_time_s
        out[str(g)] = {
            "step_time_s": step,
            "tokens_per_s": tokens * lay.dp / step,
            "bound": slow.mfu / DEVICE.efficiency,
            "reorder_all_to_all_ms": 1e3 * slow.time_s.get("reorder_all_to_all", 0.0),
            "replica_step_spread": max(p.step_time_s for p in preds) / min(p.step_time_s for p in preds),
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
    )
    wall = time.perf_counter() - t0
    best = res.plans[0]
    hand = predict_step(w, layout(gpus, best.layout.placement), device=DEVICE, network=NETWORK)
    return {
        "gpus": gpus,
        "tuned_layout": dataclasses.asdict(best.layout),
        "tuned": row(best),
        "hand_picked": row(hand),
        "tuned_over_hand": best.tokens_per_s / hand.tokens_per_s,
        "tune_wall_s": wall,
        "layouts_considered": res.considered,
    }


def main() -> None:
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
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    res = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": commit,
        "device": dataclasses.asdict(DEVICE),
        "network": dataclasses.asdict(NETWORK),
        "layout": dataclasses.asdict(layout(256)),
        "megatron_dist_encoder_ranks": er,
        "fig13_throughput": fig13,
        "fig15_memory": {
            k: {n: {m: v[m] for m in ("stage0_gb", "last_stage_gb", "oom")} for n, v in r.items()}
            for k, r in fig13["256"].items()
        },
        "fig17_triple": fig17,
        "fig18_ablation": fig18,
        "fig18_tuning": tuned,
        "fig20_reorder_group": fig20,
        "timing": timing,
        "wall_s": time.perf_counter() - t0,
    }
    OUT.write_text(json.dumps(res, indent=2))
    print_tables(res)


def print_tables(res: dict) -> None:
    for g, by_ratio in res["fig13_throughput"].items():
        print(f"Figure 13, {g} GPUs: tokens/s (M) [fraction of compute bound]")
        for ratio, rows in by_ratio.items():
            print(f"  {ratio:>5} " + "  ".join(f"{n[:10]:>10} {r['tokens_per_s'] / 1e6:6.2f} [{r['bound']:.2f}]"
                                             f"{'*' if r['oom'] else ''}" for n, r in rows.items()))  # fmt: skip
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
