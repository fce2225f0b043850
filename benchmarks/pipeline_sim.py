"""Encoder placement policies in the pipeline simulator: throughput, stage-0 memory, bubbles, resilience.

Workload (MegaScale-Omni §2 and §8): packs of 16K tokens (hybrid packing) of image and text samples
(image ~3.8K LLM tokens after the 2x2 merge, OpenImages; text ~6K, BytedLong; lognormal lengths),
image:text sample ratios 1:9, 5:5 and 9:1; pp 4 and 8, 4 * pp microbatches per step, 1F1B.
Costs follow the paper's proportions: ViT-1B : USM-2B : LLaMA-12B = 14.7K : 4.54K : 29.0K TFLOPs at 16K
tokens x 32 with image:audio:text 4:4:2, i.e. per encoder-input LLM token the ViT costs 14.7 / 29.0 / 0.4
= 1.27x and the audio encoder 0.39x the LLM's whole-model cost per token. Seconds = FLOPs / (989 TFLOP/s x
40 %); LLM forward = 2 x 12e9 FLOPs per token split evenly over stages, backward 2x forward. Activations:
Megatron's 34 * hidden bytes per token per layer (LLaMA-12B: hidden 5120, 40 layers; ViT-1B: hidden 1536,
40 layers, 4 patches per LLM token); P2P 20 us + bytes / 50 GB/s in bf16. Encoder work of each LLM
microbatch comes as pp encoder microbatches (the loader's split).

Printed: per ratio and pp, each policy's throughput and stage-0 peak memory relative to
prepend_first_stage, and its bubble against LLM-only 1F1B. Bubble metrics (same definitions for every row
and for the LLM-only baseline; ``SimulationResult.bubble_fraction``):

* ``idle %``: a rank's idle time (neither LLM nor encoder compute running) / the step's makespan, mean over
  ranks. LLM-only 1F1B has ``(p - 1) / (m + p - 1)`` here. ``Δ pts`` = policy minus LLM-only.
* ``idle s x``: the policy's mean idle seconds per rank / LLM-only 1F1B's. A fraction falls when the step
  simply gets longer (more work, same idle seconds); idle seconds do not, so this is the honest test of
  "no extra bubbles": <= 1 means no more idle time than the LLM-only pipeline.
* ``vs even``: makespan / that of the equal-work reference, LLM-only 1F1B with every stage's forward and
  backward stretched by an even 1/(p m) share of the step's encoder forward and backward work (Fig. 10b's
  ideal of encoder latency scaling every stage uniformly). Its idle fraction equals LLM-only's, so a
  policy can sit *below* LLM-only 1F1B in ``idle %`` only by running encoder work inside 1F1B's warm-up
  and drain bubbles; ``vs even`` < 1 says it does, > 1 that it adds waiting.

``planned`` (beyond the paper, ``omni_pipeline.planner``) searches each encoder microbatch's rank and
slots by simulation, starting from the best of the three baselines, so it is never slower than them here.

Then the shifting
triple-modality recipe (image:text 1:1, then audio rising to image:audio:text 13:74:13) replayed step by
step, with each policy's step-time spread max / min over steps. Also writes a PNG timeline of one step
per policy to packages/omni-pipeline/docs/.

Run: ``uv run python benchmarks/pipeline_sim.py``; writes ``benchmarks/results/pipeline_sim.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from pathlib import Path

from omni_pipeline import (
    CostModel,
    Schedule1F1B,
    isolated,
    planned,
    prepend_first_stage,
    simulate,
    uniform_on_demand,
)

SEQ = 16384
HIDDEN, LAYERS = 5120, 40
VIT_HIDDEN, VIT_LAYERS, PATCHES_PER_TOKEN = 1536, 40, 4
EFFECTIVE_FLOPS = 989e12 * 0.4
LLM_FLOPS_PER_TOKEN = 2 * 12e9  # forward, whole model
ENC_REL = {"image": 14.7 / 29.0 / 0.4, "audio": 4.54 / 29.0 / 0.4}  # encoder cost per input token / LLM's
MEAN_LEN = {"image": 3800, "audio": 340, "text": 6000}
BF16 = 2
POLICIES = ("prepend_first_stage", "isolated", "uniform_on_demand", "planned")
ROOT = Path(__file__).resolve().parents[1]


def draw_packs(rng: random.Random, mix: dict[str, float], num_packs: int) -> list[dict[str, int]]:
    """Hybrid packs: samples drawn by ``mix`` (sample ratios), lognormal lengths, filled up to SEQ
    tokens. Returns per pack the tokens of each modality."""
    names, weights = zip(*[(k, v) for k, v in mix.items() if v > 0])
    packs = []
    for _ in range(num_packs):
        pack = dict.fromkeys(MEAN_LEN, 0)
        room = SEQ
        while room > 0:
            kind = rng.choices(names, weights)[0]
            n = int(MEAN_LEN[kind] * rng.lognormvariate(-0.125, 0.5))
            n = max(16, min(n, room))
            pack[kind] += n
            room -= n
        packs.append(pack)
    return packs


def build(pp: int, packs: list[dict[str, int]]):
    """Schedule, encoder_inputs and cost model for one step."""
    m = len(packs)
    schedule = Schedule1F1B(pp, m)
    enc_inputs: dict[int, list[int]] = {}
    fwd_s, stored, out_bytes = {}, {}, {}
    e = 1
    for k, pack in enumerate(packs, start=1):
        enc_inputs[k] = []
        for kind in ("image", "audio"):
            if pack[kind] == 0:
                continue
            share = pack[kind] / pp  # the loader splits this pack's encoder work into pp microbatches
            for _ in range(pp):
                enc_inputs[k].append(e)
                fwd_s[e] = ENC_REL[kind] * LLM_FLOPS_PER_TOKEN * share / EFFECTIVE_FLOPS
                stored[e] = 34 * VIT_HIDDEN * VIT_LAYERS * PATCHES_PER_TOKEN * share
                out_bytes[e] = share * HIDDEN * BF16
                e += 1
    stage_fwd = LLM_FLOPS_PER_TOKEN * SEQ / pp / EFFECTIVE_FLOPS
    costs = CostModel(
        llm_forward_s=stage_fwd,
        llm_backward_s=2 * stage_fwd,
        encoder_forward_s=fwd_s,
        p2p_latency_s=20e-6,
        p2p_bandwidth_Bps=50e9,
        llm_activation_bytes=SEQ * HIDDEN * BF16,
        llm_stored_bytes=34 * HIDDEN * SEQ * LAYERS / pp,
        encoder_output_bytes=out_bytes,
        encoder_stored_bytes=stored,
        tokens_per_microbatch=SEQ,
    )
    return schedule, enc_inputs, costs


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


def flows(schedule, enc_inputs, costs):
    return {
        "prepend_first_stage": prepend_first_stage(schedule, enc_inputs),
        "isolated": isolated(schedule, enc_inputs, costs.encoder_forward_s),
        "uniform_on_demand": uniform_on_demand(schedule, enc_inputs, costs),
        "planned": planned(schedule, enc_inputs, costs),
    }


def ratio_table(rng: random.Random) -> list[dict]:
    rows = []
    print(
        f"{'img:txt':>8} {'pp':>3} {'policy':>20} {'tput/prepend':>13} {'st0 mem prepend/x':>18} "
        f"{'idle %':>7} {'LLM-only':>9} {'Δ pts':>6} {'idle s x':>9} {'vs even':>8}"
    )
    for img, txt in ((1, 9), (5, 5), (9, 1)):
        for pp in (4, 8):
            packs = draw_packs(rng, {"image": img, "text": txt}, 4 * pp)
            schedule, enc_inputs, costs = build(pp, packs)
            llm_only = simulate(schedule, None, costs)
            even = even_reference(schedule, costs)
            results = {}
            for name, flow in flows(schedule, enc_inputs, costs).items():
                flow.validate(schedule)
                results[name] = simulate(schedule, flow, costs)
            base = results["prepend_first_stage"]
            for name in POLICIES:
                r = results[name]
                row = {
                    "image_text": f"{img}:{txt}",
                    "pp": pp,
                    "policy": name,
                    "throughput_tokens_per_s": r.throughput_tokens_per_s,
                    "throughput_vs_prepend": r.throughput_tokens_per_s / base.throughput_tokens_per_s,
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
                    "image_token_share": sum(p["image"] for p in packs) / (SEQ * len(packs)),
                }
                rows.append(row)
                print(
                    f"{img}:{txt:<6} {pp:>3} {name:>20} {row['throughput_vs_prepend']:>12.2f}x "
                    f"{row['stage0_memory_prepend_over_policy']:>17.2f}x {100 * r.mean_bubble_fraction:>6.1f}% "
                    f"{100 * llm_only.mean_bubble_fraction:>8.1f}% "
                    f"{100 * (r.mean_bubble_fraction - llm_only.mean_bubble_fraction):>+6.1f} "
                    f"{row['idle_s_vs_llm_only']:>8.2f}x {row['makespan_vs_even_reference']:>7.2f}x"
                )
    print(
        "idle % = time with no LLM or encoder compute / makespan (mean over ranks), same for LLM-only 1F1B;\n"
        "idle s x = idle seconds per rank / LLM-only 1F1B's; vs even = makespan / LLM-only 1F1B with the\n"
        "encoder work spread evenly over every stage's F and B (whose idle % equals LLM-only's)"
    )
    return rows


def shifting_replay(rng: random.Random, pp: int = 8, steps: int = 24) -> dict:
    """Triple-modality recipe: image:text 1:1 for the first third, then audio rises linearly until
    image:audio:text is 13:74:13. Sample lengths are drawn afresh every step."""
    times: dict[str, list[float]] = {p: [] for p in POLICIES}
    mixes = []
    for step in range(steps):
        t = max(0.0, (step - steps / 3) / (steps - 1 - steps / 3))
        mix = {
            "image": 1 * (1 - t) + 13 / 100 * t * 2,
            "audio": 74 / 100 * t * 2,
            "text": 1 * (1 - t) + 13 / 100 * t * 2,
        }
        mixes.append(mix)
        packs = draw_packs(rng, mix, 4 * pp)
        schedule, enc_inputs, costs = build(pp, packs)
        for name, flow in flows(schedule, enc_inputs, costs).items():
            times[name].append(simulate(schedule, flow, costs).makespan_s)
    print(f"\nshifting mixture replay, pp={pp}, {steps} steps (image:audio:text 1:0:1 -> 13:74:13)")
    print(f"{'policy':>20} {'min step s':>11} {'max step s':>11} {'spread max/min':>15}")
    out = {}
    for name in POLICIES:
        lo, hi = min(times[name]), max(times[name])
        out[name] = {"step_times_s": times[name], "spread_max_over_min": hi / lo}
        print(f"{name:>20} {lo:>11.3f} {hi:>11.3f} {hi / lo:>14.2f}x")
    return {"pp": pp, "mixes": mixes, "policies": out}


def timeline_pngs(rng: random.Random) -> list[str]:
    packs = draw_packs(rng, {"image": 5, "text": 5}, 8)
    schedule, enc_inputs, costs = build(4, packs)
    paths = []
    for name, flow in flows(schedule, enc_inputs, costs).items():
        if name == "isolated":
            continue
        path = ROOT / f"packages/omni-pipeline/docs/timeline_{name}.png"
        r = simulate(schedule, flow, costs)
        r.plot(
            path,
            title=f"{name}: 1F1B, pp=4, 8 microbatches, image:text 5:5 (step {r.makespan_s:.1f} s)",
        )
        paths.append(str(path.relative_to(ROOT)))
    return paths


def main() -> None:
    rng = random.Random(2026)
    t0 = time.perf_counter()
    rows = ratio_table(rng)
    replay = shifting_replay(rng)
    # scale check: 1,024 GPUs = pp 8 x dp 128, 64 microbatches (one replica simulated, throughput x dp)
    packs = draw_packs(rng, {"image": 5, "text": 5}, 64)
    schedule, enc_inputs, costs = build(8, packs)
    costs.data_parallel = 128
    t1 = time.perf_counter()
    big = simulate(schedule, uniform_on_demand(schedule, enc_inputs, costs), costs)
    big_s = time.perf_counter() - t1
    t1 = time.perf_counter()
    big_planned = simulate(schedule, planned(schedule, enc_inputs, costs), costs)
    planned_s = time.perf_counter() - t1
    print(
        f"\n1,024 ranks (pp 8 x dp 128), 64 microbatches: uniform_on_demand planned + simulated in "
        f"{big_s:.2f} s, {big.throughput_tokens_per_s / 1e6:.2f} M tokens/s; planned (1,000 simulations) in "
        f"{planned_s:.2f} s, {big_planned.throughput_tokens_per_s / 1e6:.2f} M tokens/s"
    )
    pngs = timeline_pngs(rng)
    out = {
        "ratios": rows,
        "shifting_mixture": replay,
        "scale_1024_ranks": {
            "seconds": big_s,
            "throughput_tokens_per_s": big.throughput_tokens_per_s,
            "planned_seconds": planned_s,
            "planned_throughput_tokens_per_s": big_planned.throughput_tokens_per_s,
        },
        "timeline_pngs": pngs,
        "wall_s": time.perf_counter() - t0,
    }
    path = ROOT / "benchmarks/results/pipeline_sim.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path.relative_to(ROOT)} and {', '.join(pngs)}")
    assert math.isfinite(big.makespan_s)


if __name__ == "__main__":
    main()
