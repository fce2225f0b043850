"""``omni-train simulate``: one training step of the config's recipe on a modelled large cluster.

The recipe is the config's own: its mixture, packing and encoder split are run on the bundled data's
metadata (no payload is read) to draw one DP replica's step of ``microbatches`` packs; each LLM
microbatch's encoder work is split into ``pp`` encoder microbatches (Karmarkar-Karp). Durations come from
FLOPs at a modelled device rate, for models of the paper's sizes (``scale="paper"``:
LLaMA-12B backbone, ViT-1B image encoder, USM-2B audio encoder; Table 1 and §2.2) or of the config's own tiny
sizes (``scale="config"``); activation sizes from the usual bf16 estimates. omni-pipeline's simulator then times a 1F1B step under each placement
policy, and the table compares them against ``prepend_first_stage``.

Modelled device (documented assumptions, not measurements): ``peak_flops`` 989e12 (H100 bf16 dense) at
``efficiency`` 0.4; point-to-point 10 us latency and 25 GB/s (200 Gb/s InfiniBand); an activation of
``T`` tokens at width ``d`` is ``2*T*d`` bytes; a transformer layer stores ``34*T*d`` bytes from forward to
backward (Korthikanti et al., 2022, bf16, no recomputation).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tokenizers import Tokenizer

from omni_data import Modality, encoder_microbatch_ids, split_encoder_microbatches
from omni_pipeline.cost import CostModel
from omni_pipeline.placement import PlacementPolicy, place
from omni_pipeline.schedules import Schedule1F1B
from omni_pipeline.simulator import simulate
from omni_train.config import ConfigError, RunConfig, bundled_data_dir
from omni_train.data_pipeline import build_step_stream
from omni_train.flops import attention_flops

__all__ = ["MODEL_SCALES", "ModelScale", "simulate_config"]


@dataclasses.dataclass(frozen=True)
class ModelScale:
    """Sizes the cost model times: matmul parameters and width/layers (for attention and activations)
    of the LLM and of each encoder."""

    llm_params: float
    llm_dim: int
    llm_layers: int
    encoder_params: dict[str, float]
    encoder_dim: dict[str, int]
    encoder_layers: dict[str, int]


MODEL_SCALES = {
    # MegaScale-Omni's triple-modality setup: ViT-1B, USM-2B, LLaMA-12B (§2.2).
    "paper": ModelScale(
        12e9,
        5120,
        40,
        {"image": 1e9, "audio": 2e9},
        {"image": 1408, "audio": 1536},
        {"image": 40, "audio": 32},
    ),
}


def _tokenizer(cfg: RunConfig) -> Tokenizer:
    p = Path(cfg.data.tokenizer)
    return Tokenizer.from_file(str(p if p.is_absolute() else bundled_data_dir() / p))


def simulate_config(
    cfg: RunConfig,
    *,
    gpus: int,
    pp: int,
    microbatches: int,
    out_dir: Path,
    scale: str = "paper",
    peak_flops: float = 989e12,
    efficiency: float = 0.4,
) -> str:
    """Simulate the three placements on ``gpus`` ranks (``pp`` stages, ``gpus // pp`` DP replicas).

    Writes ``timeline-<placement>.png`` and ``simulate.json`` under ``out_dir``.

    Returns:
        the comparison table (text).

    Raises:
        ConfigError: ``gpus`` not a multiple of ``pp``, fewer microbatches than stages, unknown scale.
    """
    llm = cfg.model.llm
    if scale == "config":
        encs = {"image": cfg.model.vit, "audio": cfg.model.audio}
        ms = ModelScale(
            llm.n_layers
            * (2 * llm.dim**2 + 2 * llm.dim**2 * llm.n_kv_heads // llm.n_heads + 3 * llm.dim * llm.ffn_dim),
            llm.dim,
            llm.n_layers,
            {k: 12.0 * e.n_layers * e.dim**2 for k, e in encs.items() if e is not None},
            {k: e.dim for k, e in encs.items() if e is not None},
            {k: e.n_layers for k, e in encs.items() if e is not None},
        )
    elif scale in MODEL_SCALES:
        ms = MODEL_SCALES[scale]
    else:
        raise ConfigError(f"--scale: {scale!r} is not 'config' or one of {sorted(MODEL_SCALES)}")
    if pp < 1 or gpus < pp or gpus % pp:
        raise ConfigError(f"--gpus: {gpus} is not a positive multiple of --pp {pp}")
    if microbatches < pp:
        raise ConfigError(f"--microbatches: {microbatches} cannot fill {pp} stages")
    data = dataclasses.replace(cfg.data, microbatches=microbatches)
    par = dataclasses.replace(cfg.parallel, pp=pp, dp=1, reorder=True)
    cfg = dataclasses.replace(cfg, data=data, parallel=par)
    stream = build_step_stream(
        cfg, _tokenizer(cfg), dp_rank=0, dp_size=1, dp_group=None, consumes=set(), read_text=False
    )
    stream.reset()
    packs = next(stream).packs
    rate = peak_flops * efficiency
    llm_fwd = [
        2.0 * ms.llm_params * p.num_tokens
        + attention_flops(p.seqlens, ms.llm_dim, ms.llm_layers, causal=True)
        for p in packs
    ]
    tokens = sum(p.num_tokens for p in packs) / len(packs)
    mbs = split_encoder_microbatches(packs, microbatches, pp)
    enc_fwd_s, enc_out, enc_stored = {}, {}, {}
    for e, items in mbs.items():
        flops = out_b = stored = 0.0
        for p, i in items:
            s = packs[p].samples[i]
            kind = str(s.modality)
            # encoder sequence: ViT patches before the 2x2 merge; audio frames after subsampling
            seq = s.media_tokens * (4 if s.modality is Modality.IMAGE else 1)
            d, n_layers = ms.encoder_dim[kind], ms.encoder_layers[kind]
            flops += 2.0 * ms.encoder_params[kind] * seq + attention_flops([seq], d, n_layers, causal=False)
            out_b += 2.0 * s.media_tokens * ms.llm_dim
            stored += 34.0 * n_layers * seq * d
        enc_fwd_s[e], enc_out[e], enc_stored[e] = flops / rate, out_b, stored
    mean_fwd = sum(llm_fwd) / len(llm_fwd)
    costs = CostModel(
        llm_forward_s=mean_fwd / pp / rate,
        llm_backward_s=2 * mean_fwd / pp / rate,
        encoder_forward_s=enc_fwd_s,
        p2p_latency_s=10e-6,
        p2p_bandwidth_Bps=25e9,
        llm_activation_bytes=2.0 * tokens * ms.llm_dim,
        llm_stored_bytes=34.0 * tokens * ms.llm_dim * ms.llm_layers / pp,
        encoder_output_bytes=enc_out,
        encoder_stored_bytes=enc_stored,
        tokens_per_microbatch=tokens,
        data_parallel=gpus // pp,
    )
    schedule = Schedule1F1B(pp, microbatches)
    encoder_inputs = encoder_microbatch_ids(microbatches, pp)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for policy in PlacementPolicy:
        flow = place(policy, schedule, encoder_inputs, costs)
        res = simulate(schedule, flow, costs)
        res.plot(out_dir / f"timeline-{policy}.png", title=f"{cfg.name}: {policy}, {gpus} GPUs, pp={pp}")
        results[str(policy)] = {
            "makespan_s": res.makespan_s,
            "throughput_tokens_per_s": res.throughput_tokens_per_s,
            "mean_bubble_fraction": res.mean_bubble_fraction,
            "stage0_peak_activation_bytes": res.peak_activation_bytes[0],
        }
    llm_only = simulate(schedule, None, costs)
    base = results[str(PlacementPolicy.PREPEND_FIRST_STAGE)]
    lines = [
        f"{cfg.name} ({scale} model sizes) on {gpus} GPUs (pp={pp}, dp={gpus // pp}, {microbatches} microbatches of "
        f"~{tokens:.0f} tokens; LLM-only 1F1B bubble {llm_only.mean_bubble_fraction:.3f})",
        f"{'placement':<22}{'step s':>12}{'tokens/s':>14}{'vs prepend':>12}{'bubble':>9}{'stage-0 peak MB':>17}",
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<22}{r['makespan_s']:>12.4g}{r['throughput_tokens_per_s']:>14.4g}"
            f"{r['throughput_tokens_per_s'] / base['throughput_tokens_per_s']:>11.2f}x"
            f"{r['mean_bubble_fraction']:>9.3f}{r['stage0_peak_activation_bytes'] / 2**20:>17.2f}"
        )
    (out_dir / "simulate.json").write_text(
        json.dumps(
            {
                "gpus": gpus,
                "pp": pp,
                "microbatches": microbatches,
                "results": results,
                "llm_only_bubble": llm_only.mean_bubble_fraction,
            },
            indent=2,
        )
    )
    return "\n".join(lines)
