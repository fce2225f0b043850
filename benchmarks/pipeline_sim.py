"""Encoder placement policies and the paper's baselines in the pipeline simulator: throughput, stage-0
memory, bubbles, resilience, the triple-modality FLOPs split and the time to simulate 512 GPUs.

Workloads are the shipped data files (``apps/omni-train/src/omni_train/configs/workloads/``, every
assumption stated and cited there; :mod:`omni_pipeline.workload`): ``paper-vlm`` (ViT-1B + LLaMA-12B,
16K packs of OpenImages ~3.8K / RefCOCOg ~1.4K image samples and BytedLong ~6K text, paper §2.2 and §6)
swept over image:text sample ratios 1:9, 5:5 and 9:1 (Figure 13; the image share split 1:1 between the two
image sources), and ``paper-omni`` (+ USM-2B, LibriSpeech ~0.34K) through its phases (image:text 1:1, then
audio rising to image:audio:text 13:74:13, §2.1). Whole samples are packed by omni-data's HybridPacker, each
LLM microbatch's media split into pp encoder microbatches (Karmarkar-Karp by encoder FLOPs). Costs:
``omni_pipeline.modelled_step_costs`` (the one FLOP model, ``omni_parallel.flops``; one set of model shapes
``omni_pipeline.MODEL_SHAPES`` and P2P constants ``omni_pipeline.P2P_LATENCY_S`` / ``P2P_BANDWIDTH_BPS``,
shared with ``omni-train simulate``) at 989 TFLOP/s x 40 %; 1F1B, 4 * pp microbatches per step.

Rows: the paper's baselines, Megatron-LM (``prepend_first_stage``), Megatron-Dist / DistTrain
(``megatron_dist``: encoders on ranks of their own, sized once per pp from the 5:5 step in proportion to
their compute and kept for every ratio, the paper's "statically allocated encoder resources"; its
throughput counts those GPUs) and Optimus (``optimus_static``: encoder work placed statically into the
LLM-only 1F1B bubbles, planned for the step's mean encoder microbatch); ours: ``isolated``,
``uniform_on_demand`` and ``planned`` (beyond the paper: a search by simulation starting from the best of
the others). Not modelled here (issue 31 leaves them for later): DP/TP/CP collectives, the optimizer,
memory beyond stored activations, the Alpa-style AutoParallel baseline.

Printed per ratio and pp: each row's throughput and stage-0 peak memory relative to prepend_first_stage,
its bubble against LLM-only 1F1B. Bubble metrics (same definitions for every row and for the LLM-only
baseline; ``SimulationResult.bubble_fraction``):

* ``idle %``: a rank's idle time (neither LLM nor encoder compute running) / the step's makespan, mean over
  ranks (megatron_dist: its encoder ranks included). LLM-only 1F1B has ``(p - 1) / (m + p - 1)``.
* ``idle s x``: the row's mean idle seconds per rank / LLM-only 1F1B's.
* ``vs even``: makespan / that of LLM-only 1F1B with every stage's forward and backward stretched by an
  even 1/(p m) share of the step's encoder work (Fig. 10b's ideal).

Also the triple-modality FLOPs split at image:audio:text 4:4:2 (samples) against the paper's §2.2 numbers,
the seconds to plan and simulate one 512-GPU configuration (pp 8 x dp 64, 32 packs) per row, and PNG
timelines of one step per policy in packages/omni-pipeline/docs/.

Run: ``uv run python benchmarks/pipeline_sim.py``; writes ``benchmarks/results/pipeline_sim.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from omni_data import encoder_microbatch_ids, split_encoder_microbatches
from omni_parallel.flops import attention_flops, model_flops
from omni_pipeline import (
    CostModel,
    Schedule1F1B,
    Workload,
    encoder_forward_flops,
    encoder_ranks_for,
    isolated,
    load_workload,
    modelled_step_costs,
    optimus_static,
    planned,
    prepend_first_stage,
    simulate,
    simulate_disaggregated,
    uniform_on_demand,
)
from omni_train.simulate import WORKLOAD_ROWS

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "apps/omni-train/src/omni_train/configs/workloads"
RATE = 989e12 * 0.4
POLICIES = WORKLOAD_ROWS  # the rows of `omni-train simulate --workload`: the paper's baselines and ours
# the paper's triple-modality FLOPs at 16K packs x 32, image:audio:text 4:4:2 (§2.2), TFLOPs
PAPER_TFLOPS = {"image": 14.7e3, "audio": 4.54e3, "llm": 29.0e3}


def vlm_weights(img: float, txt: float) -> dict[str, float]:
    """paper-vlm's sources at image:text ``img:txt`` (images split 1:1 between OpenImages and RefCOCOg)."""
    return {"openimages": img / 2, "refcocog": img / 2, "bytedlong": txt}


def build(w: Workload, step: int, pp: int, m: int, dp: int = 1):
    """Schedule, encoder_inputs, cost model and packs of one step of ``w``."""
    packs = w.step_packs(step, m)
    mbs = split_encoder_microbatches(packs, m, pp)
    costs = modelled_step_costs(w.model, packs, mbs, pp, RATE, dp)
    return Schedule1F1B(pp, m), encoder_microbatch_ids(m, pp), costs, packs


def idle_s(result) -> float:
    """Mean idle seconds per rank (makespan x bubble fraction)."""
    return result.makespan_s * result.mean_bubble_fraction


def even_reference(schedule, costs: CostModel):
    """LLM-only 1F1B with every stage's F and B stretched by an even share of the encoder work."""
    m, p = schedule.num_microbatches, schedule.num_ranks
    enc_f = sum(costs.encoder_forward_s.values())
    enc_b = 2 * enc_f if costs.encoder_backward_s is None else sum(costs.encoder_backward_s.values())
    even = dataclasses.replace(
        costs,
        llm_forward_s=costs.llm_forward_s + enc_f / (p * m),
        llm_backward_s=costs.llm_backward_s + enc_b / (p * m),
    )
    return simulate(schedule, None, even)


def run_all(schedule, enc_inputs, costs, encoder_ranks: int, *, validate: bool = True) -> dict:
    """Every row's SimulationResult (flows validated against the schedule)."""
    flows = {
        "prepend_first_stage": prepend_first_stage(schedule, enc_inputs),
        "optimus_static": optimus_static(schedule, enc_inputs, costs),
        "isolated": isolated(schedule, enc_inputs, costs.encoder_forward_s),
        "uniform_on_demand": uniform_on_demand(schedule, enc_inputs, costs),
        "planned": planned(schedule, enc_inputs, costs),
    }
    out = {}
    for name, flow in flows.items():
        if validate:
            flow.validate(schedule)
        out[name] = simulate(schedule, flow, costs)
    out["megatron_dist"] = simulate_disaggregated(schedule, enc_inputs, costs, encoder_ranks)
    return {name: out[name] for name in POLICIES}


def ratio_table(vlm: Workload) -> list[dict]:
    rows = []
    print(
        f"{'img:txt':>8} {'pp':>3} {'policy':>20} {'tput/prepend':>13} {'st0 mem prepend/x':>18} "
        f"{'idle %':>7} {'LLM-only':>9} {'Δ pts':>6} {'idle s x':>9} {'vs even':>8}"
    )
    for pp in (4, 8):
        # Megatron-Dist's encoder ranks: sized once, at 5:5, and kept (static allocation)
        _, _, mid_costs, _ = build(vlm.with_weights(vlm_weights(5, 5)), 0, pp, 4 * pp)
        enc_ranks = encoder_ranks_for(mid_costs, Schedule1F1B(pp, 4 * pp))
        for img, txt in ((1, 9), (5, 5), (9, 1)):
            w = vlm.with_weights(vlm_weights(img, txt))
            schedule, enc_inputs, costs, packs = build(w, 0, pp, 4 * pp)
            llm_only = simulate(schedule, None, costs)
            even = even_reference(schedule, costs)
            results = run_all(schedule, enc_inputs, costs, enc_ranks)
            base = results["prepend_first_stage"]
            for name in POLICIES:
                r = results[name]
                row = {
                    "image_text": f"{img}:{txt}",
                    "pp": pp,
                    "policy": name,
                    "encoder_ranks": enc_ranks if name == "megatron_dist" else 0,
                    "throughput_tokens_per_s": r.throughput_tokens_per_s,
                    "throughput_vs_prepend": r.throughput_tokens_per_s / base.throughput_tokens_per_s,
                    "step_time_s": r.step_time_s,
                    "stage0_peak_bytes": r.peak_activation_bytes[0],
                    "stage0_memory_prepend_over_policy": base.peak_activation_bytes[0]
                    / r.peak_activation_bytes[0],
                    "bubble_fraction": r.mean_bubble_fraction,
                    "llm_only_bubble_fraction": llm_only.mean_bubble_fraction,
                    "bubble_definition": "idle (no LLM or encoder compute) / makespan, mean over ranks",
                    "idle_s_per_rank": idle_s(r),
                    "idle_s_vs_llm_only": idle_s(r) / idle_s(llm_only),
                    "even_reference_bubble_fraction": even.mean_bubble_fraction,
                    "makespan_vs_even_reference": r.makespan_s / even.makespan_s,
                    "image_token_share": sum(s.num_tokens for p in packs for s in p.samples if s.media_tokens)
                    / sum(p.num_tokens for p in packs),
                }
                rows.append(row)
                print(
                    f"{img}:{txt:<6} {pp:>3} {name:>20} {row['throughput_vs_prepend']:>12.2f}x "
                    f"{row['stage0_memory_prepend_over_policy']:>17.2f}x {100 * r.mean_bubble_fraction:>6.1f}% "
                    f"{100 * llm_only.mean_bubble_fraction:>8.1f}% "
                    f"{100 * (r.mean_bubble_fraction - llm_only.mean_bubble_fraction):>+6.1f} "
                    f"{row['idle_s_vs_llm_only']:>8.2f}x {row['makespan_vs_even_reference']:>7.2f}x"
                )
    return rows


def prepend_drop(rows: list[dict]) -> dict:
    """Throughput at 1:9 over 9:1 per row and pp (the paper: Megatron-LM drops up to 6.05x, §6)."""
    out = {}
    for pp in (4, 8):
        for name in POLICIES:
            t = {
                r["image_text"]: r["throughput_tokens_per_s"]
                for r in rows
                if r["pp"] == pp and r["policy"] == name
            }
            out[f"pp{pp}/{name}"] = t["1:9"] / t["9:1"]
    return out


def shifting_replay(omni: Workload, pp: int = 8) -> dict:
    """paper-omni through its phases: one step every 50 from 0 to 700 (1:1 image:text, the audio ramp, then
    13:74:13). Megatron-Dist's encoder ranks sized at step 0 and kept."""
    steps = list(range(0, 701, 50))
    times: dict[str, list[float]] = {p: [] for p in POLICIES}
    enc_ranks = None
    for step in steps:
        schedule, enc_inputs, costs, _ = build(omni, step, pp, 4 * pp)
        if enc_ranks is None:
            enc_ranks = encoder_ranks_for(costs, schedule)
        for name, r in run_all(schedule, enc_inputs, costs, enc_ranks, validate=False).items():
            # per GPU: megatron_dist's step runs on pp + E ranks
            per_gpu = r.throughput_tokens_per_s / costs.data_parallel / pp
            times[name].append(per_gpu)
    print(f"\npaper-omni phases, pp={pp}, steps {steps[0]}..{steps[-1]} every 50 (tokens/s per GPU)")
    print(f"{'policy':>20} {'min':>9} {'max':>9} {'max/min':>8}")
    out = {}
    for name in POLICIES:
        lo, hi = min(times[name]), max(times[name])
        out[name] = {"tokens_per_s_per_gpu": times[name], "spread_max_over_min": hi / lo}
        print(f"{name:>20} {lo:>9.0f} {hi:>9.0f} {hi / lo:>7.2f}x")
    return {
        "pp": pp,
        "steps": steps,
        "phases": [dict(omni.phase(s).weights) for s in steps],
        "policies": out,
        "megatron_dist_encoder_ranks": enc_ranks,
    }


def flops_split(omni: Workload, steps: int = 20) -> dict:
    """Training FLOPs per module of 32 16K packs at image:audio:text 4:4:2 (samples), ours against §2.2."""
    w = omni.with_weights({"openimages": 4, "librispeech": 4, "bytedlong": 2})
    ms = w.model
    fwd = {"image": 0.0, "audio": 0.0, "llm": 0.0}
    tokens = {"image": 0, "audio": 0, "text": 0}
    for step in range(steps):
        for p in w.step_packs(step, 32):
            attn = attention_flops(p.seqlens, ms.llm_dim, ms.llm_layers, causal=True)
            fwd["llm"] += model_flops(ms.llm_params, p.num_tokens, attn, training=False)
            for s in p.samples:
                tokens[str(s.modality)] += s.num_tokens
                if s.media_tokens:
                    fwd[str(s.modality)] += encoder_forward_flops(ms, s.modality, s.media_tokens)
    tflops = {k: 3 * v / steps / 1e12 for k, v in fwd.items()}  # training = 3x forward, per 32 packs
    total = sum(tokens.values())
    out = {
        "ours_tflops_per_32_packs": tflops,
        "paper_tflops_per_32_packs": PAPER_TFLOPS,
        "ours_vit_over_llm": tflops["image"] / tflops["llm"],
        "ours_audio_over_llm": tflops["audio"] / tflops["llm"],
        "paper_vit_over_llm": PAPER_TFLOPS["image"] / PAPER_TFLOPS["llm"],
        "paper_audio_over_llm": PAPER_TFLOPS["audio"] / PAPER_TFLOPS["llm"],
        "token_shares": {k: v / total for k, v in tokens.items()},
        # the paper's USM FLOPs per LLM audio token over ours
        "audio_per_token_paper_over_ours": PAPER_TFLOPS["audio"]
        / tflops["audio"]
        * (tflops["llm"] / PAPER_TFLOPS["llm"]),
    }
    print(
        f"\ntriple-modality FLOPs at 4:4:2, 32 x 16K packs (training TFLOPs): ours ViT {tflops['image']:.0f}, "
        f"USM {tflops['audio']:.0f}, LLM {tflops['llm']:.0f}; paper 14.7K, 4.54K, 29.0K. ViT/LLM ours "
        f"{out['ours_vit_over_llm']:.3f} vs {out['paper_vit_over_llm']:.3f}; audio/LLM ours "
        f"{out['ours_audio_over_llm']:.4f} vs {out['paper_audio_over_llm']:.3f}"
    )
    return out


def scale_512(vlm: Workload) -> dict:
    """512 GPUs (pp 8 x dp 64), 32 packs of 16K at 5:5: seconds to place + simulate each row."""
    w = vlm.with_weights(vlm_weights(5, 5))
    t0 = time.perf_counter()
    schedule, enc_inputs, costs, _ = build(w, 0, 8, 32, dp=64)
    build_s = time.perf_counter() - t0
    enc_ranks = encoder_ranks_for(costs, schedule)
    out = {"build_s": build_s, "rows": {}}
    for name in POLICIES:
        t1 = time.perf_counter()
        r = run_all_one(name, schedule, enc_inputs, costs, enc_ranks)
        out["rows"][name] = {
            "seconds": time.perf_counter() - t1,
            "throughput_tokens_per_s": r.throughput_tokens_per_s,
        }
    out["total_s"] = time.perf_counter() - t0
    print(
        f"\n512 GPUs (pp 8 x dp 64), 32 packs of 16K, 5:5: packs + costs {build_s:.2f} s; per row (place + simulate):"
    )
    for name, v in out["rows"].items():
        print(f"{name:>20} {v['seconds']:>7.2f} s {v['throughput_tokens_per_s'] / 1e6:>8.3f} M tokens/s")
    print(f"{'all rows':>20} {out['total_s']:>7.2f} s")
    return out


def run_all_one(name, schedule, enc_inputs, costs, enc_ranks):
    if name == "megatron_dist":
        return simulate_disaggregated(schedule, enc_inputs, costs, enc_ranks)
    flow = {
        "prepend_first_stage": lambda: prepend_first_stage(schedule, enc_inputs),
        "optimus_static": lambda: optimus_static(schedule, enc_inputs, costs),
        "isolated": lambda: isolated(schedule, enc_inputs, costs.encoder_forward_s),
        "uniform_on_demand": lambda: uniform_on_demand(schedule, enc_inputs, costs),
        "planned": lambda: planned(schedule, enc_inputs, costs),
    }[name]()
    return simulate(schedule, flow, costs)


def timeline_pngs(vlm: Workload) -> list[str]:
    schedule, enc_inputs, costs, _ = build(vlm.with_weights(vlm_weights(5, 5)), 0, 4, 8)
    paths = []
    for name in ("prepend_first_stage", "uniform_on_demand"):
        r = run_all_one(name, schedule, enc_inputs, costs, 1)
        path = ROOT / f"packages/omni-pipeline/docs/timeline_{name}.png"
        r.plot(path, title=f"{name}: 1F1B, pp=4, 8 packs of 16K, paper-vlm 5:5 (step {r.makespan_s:.1f} s)")
        paths.append(str(path.relative_to(ROOT)))
    return paths


def main() -> None:
    t0 = time.perf_counter()
    vlm = load_workload(WORKLOADS / "paper-vlm.toml")
    omni = load_workload(WORKLOADS / "paper-omni.toml")
    rows = ratio_table(vlm)
    drop = prepend_drop(rows)
    print("\nthroughput 1:9 / 9:1: " + ", ".join(f"{k} {v:.2f}x" for k, v in drop.items()))
    replay = shifting_replay(omni)
    split = flops_split(omni)
    scale = scale_512(vlm)
    pngs = timeline_pngs(vlm)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    out = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": commit.stdout.strip(),
        "workloads": ["paper-vlm", "paper-omni"],
        "ratios": rows,
        "throughput_1to9_over_9to1": drop,
        "shifting_mixture": replay,
        "flops_split_4_4_2": split,
        "scale_512_gpus": scale,
        "timeline_pngs": pngs,
        "wall_s": time.perf_counter() - t0,
    }
    path = ROOT / "benchmarks/results/pipeline_sim.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path.relative_to(ROOT)} and {', '.join(pngs)}")
    assert all(math.isfinite(r["throughput_tokens_per_s"]) for r in rows)


if __name__ == "__main__":
    main()
