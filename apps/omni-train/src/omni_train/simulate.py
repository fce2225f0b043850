"""``omni-train simulate``: training steps of the config's recipe in omni-pipeline's simulator.

The recipe is the config's own: its mixture, packing and encoder split are run on the bundled data's
metadata (no payload is read) to draw one DP replica's steps of ``microbatches`` packs; each LLM
microbatch's encoder work is split into ``pp`` encoder microbatches (Karmarkar-Karp). omni-pipeline's
simulator then times a 1F1B step under each placement policy, and the table compares them against
``prepend_first_stage``. Durations come from one of:

* **a calibration** (``calibration=RUN_DIR``): the cost model fitted from the per-action records a run of
  this config wrote (``RUN_DIR/actions.jsonl``, :mod:`omni_pipeline.records`;
  :func:`omni_pipeline.calibrate.fit_cost_model`), applied to each simulated step's token counts
  (:func:`action_tokens`): the config's own models on the measured machine, P2P latency and bandwidth,
  dispatch gaps and the time outside the pipeline included. The run's first recorded step is dropped
  (warm-up). When the run directory also holds ``metrics.jsonl`` and the run's flow (``dataflow.json``,
  or each step's ``"flow"`` record when ``planned`` planned it per step), the flow the run used is
  simulated on the same steps and printed beside the measured step time.
* **modelled FLOPs** at a modelled device rate, for models of the paper's sizes (``scale="paper"``:
  LLaMA-12B backbone, ViT-1B image encoder, USM-2B audio encoder; Table 1 and §2.2) or of the config's own
  tiny sizes (``scale="config"``).

Modelled device (documented assumptions, not measurements): ``peak_flops`` 989e12 (H100 bf16 dense) at
``efficiency`` 0.4; point-to-point 10 us latency and 25 GB/s (200 Gb/s InfiniBand); an activation of
``T`` tokens at width ``d`` is ``2*T*d`` bytes in bf16; a transformer layer stores ``34*T*d`` bytes from
forward to backward (Korthikanti et al., 2022, bf16, no recomputation). Calibrated runs scale these sizes
by the run's dtype (4 bytes for float32).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from omni_data import Modality, Pack, encoder_microbatch_ids, split_encoder_microbatches
from omni_data.zero_redundancy import SampleIndex
from omni_pipeline.calibrate import fit_cost_model
from omni_pipeline.cost import ActionTokens, CostModel
from omni_pipeline.dataflow import DataFlow
from omni_pipeline.placement import PlacementPolicy, place
from omni_pipeline.records import RECORDS_FILE, RunRecords, read_records
from omni_pipeline.schedules import Schedule1F1B
from omni_pipeline.simulator import simulate
from omni_train.config import ConfigError, RunConfig, load_tokenizer
from omni_train.data_pipeline import build_step_stream
from omni_train.flops import attention_flops

__all__ = [
    "MODEL_SCALES",
    "ModelScale",
    "action_tokens",
    "calibrated_step_costs",
    "config_scale",
    "fit_run",
    "modelled_step_costs",
    "simulate_config",
]


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


def config_scale(cfg: RunConfig) -> ModelScale:
    """The config's own model sizes (matmul parameters per token, widths, layers) for the cost model."""
    llm = cfg.model.llm
    encs = {"image": cfg.model.vit, "audio": cfg.model.audio}
    return ModelScale(
        llm.n_layers
        * (2 * llm.dim**2 + 2 * llm.dim**2 * llm.n_kv_heads // llm.n_heads + 3 * llm.dim * llm.ffn_dim),
        llm.dim,
        llm.n_layers,
        {k: 12.0 * e.n_layers * e.dim**2 for k, e in encs.items() if e is not None},
        {k: e.dim for k, e in encs.items() if e is not None},
        {k: e.n_layers for k, e in encs.items() if e is not None},
    )


def _encoder_seq(cfg: RunConfig, modality: Modality, media_tokens: int) -> int:
    """Encoder sequence of a sample: ViT patches before the merge; audio frames after subsampling."""
    if modality is Modality.IMAGE:
        merge = cfg.model.vit.merge if cfg.model.vit is not None else 2
        return media_tokens * merge * merge
    return media_tokens


def action_tokens(
    cfg: RunConfig, packs: list[Pack], mbs: dict[int, list[SampleIndex]]
) -> tuple[dict[int, ActionTokens], dict[int, ActionTokens]]:
    """Token counts of one step's actions in the convention the trainer records them in (the one
    calibration fits and predicts with).

    * LLM microbatch ``k`` (pack ``k - 1``), every stage's F and B: ``{"llm": (T, sum L**2)}``, ``T``
      the pack's tokens, ``L`` each packed document's (sample's) tokens: attention runs per document
      (``omni_parallel.varlen.varlen_attention``).
    * Encoder microbatch ``e``: per tower that runs, ``(sum n, sum n**2)`` over its samples, ``n`` a
      sample's encoder sequence (``"image"``: ViT patches before the 2x2 merge, ``"audio"``: frames after
      subsampling); attention runs per image / per clip.

    Returns:
        ``({k: ActionTokens}, {e: ActionTokens})``.
    """
    llm = {
        k: ActionTokens.single("llm", p.num_tokens, sum(n * n for n in p.seqlens))
        for k, p in enumerate(packs, start=1)
    }
    enc = {}
    for e, items in mbs.items():
        seq: dict[str, list[float]] = {}
        for p, i in items:
            s = packs[p].samples[i]
            n = _encoder_seq(cfg, s.modality, s.media_tokens)
            acc = seq.setdefault(str(s.modality), [0.0, 0.0])
            acc[0] += n
            acc[1] += n * n
        enc[e] = ActionTokens({m: (n, sq) for m, (n, sq) in seq.items()})
    return llm, enc


def _sizes(cfg: RunConfig, packs: list[Pack], mbs, pp: int, dtype_bytes: float, ms: ModelScale) -> dict:
    """Byte sizes of one step (activations, stored activations, encoder outputs) and tokens/microbatch."""
    tokens = sum(p.num_tokens for p in packs) / len(packs)
    out_b, stored = {}, {}
    for e, items in mbs.items():
        o = st = 0.0
        for p, i in items:
            s = packs[p].samples[i]
            kind = str(s.modality)
            seq = _encoder_seq(cfg, s.modality, s.media_tokens)
            o += dtype_bytes * s.media_tokens * ms.llm_dim
            st += 17.0 * dtype_bytes * ms.encoder_layers[kind] * seq * ms.encoder_dim[kind]
        out_b[e], stored[e] = o, st
    return {
        "llm_activation_bytes": dtype_bytes * tokens * ms.llm_dim,
        "llm_stored_bytes": 17.0 * dtype_bytes * tokens * ms.llm_dim * ms.llm_layers / pp,
        "encoder_output_bytes": out_b,
        "encoder_stored_bytes": stored,
        "tokens_per_microbatch": tokens,
    }


def fit_run(run: Path) -> tuple[RunRecords, CostModel, int]:
    """A run's records, the cost model fitted from them (:func:`~omni_pipeline.calibrate.fit_cost_model`,
    the first recorded step dropped as warm-up when there are more) and the pipeline stages it fitted.

    Raises:
        OSError: no records file in ``run``. ValueError: malformed records (``RecordError``) or too few
            to fit.
    """
    records = read_records(run)
    fitted = fit_cost_model(records, skip_steps=1 if len(records.step_ids) > 1 else 0)
    stages = len(fitted.llm_forward_s) if isinstance(fitted.llm_forward_s, list) else 0
    return records, fitted, stages


def calibrated_step_costs(
    cfg: RunConfig, fitted: CostModel, packs: list[Pack], mbs: dict[int, list[SampleIndex]]
) -> CostModel:
    """``fitted`` (from :func:`~omni_pipeline.calibrate.fit_cost_model`) applied to one step: every
    action's seconds from its token counts (:func:`action_tokens`), byte sizes from the config's models
    in the run's dtype.

    Raises:
        KeyError: the fit has no coefficients for a module this step runs (the run never ran it).
    """
    pp = cfg.parallel.pp
    llm, enc = action_tokens(cfg, packs, mbs)
    dtype_bytes = 8.0 if str(cfg.train.dtype) == "float64" else 4.0
    return fitted.for_step(pp, llm, enc, **_sizes(cfg, packs, mbs, pp, dtype_bytes, config_scale(cfg)))


def modelled_step_costs(
    cfg: RunConfig,
    ms: ModelScale,
    packs: list[Pack],
    mbs: dict[int, list[SampleIndex]],
    pp: int,
    rate: float,
    dp: int,
    stage_weights: list[float] | None = None,
) -> CostModel:
    """One step's cost model from modelled FLOPs (no measurement): each action's seconds are its matmul
    (``2 * params * tokens``) and attention FLOPs over ``rate`` FLOP/s; P2P 10 us + bytes / 25 GB/s;
    byte sizes as the module docstring says.

    Args:
        ms: model sizes (:data:`MODEL_SCALES` or :func:`config_scale`).
        packs, mbs: the step's packs and encoder microbatches ``{e: [(pack, sample)]}``.
        pp: pipeline stages; rate: FLOP/s; dp: data-parallel replicas.
        stage_weights: per stage, its LLM cost relative to the mean stage (embedding, LM head and loss
            counted: ``omni_pipeline.stage_costs``); ``None``: every stage the mean.
    """
    llm_fwd = [
        2.0 * ms.llm_params * p.num_tokens
        + attention_flops(p.seqlens, ms.llm_dim, ms.llm_layers, causal=True)
        for p in packs
    ]
    enc_fwd_s = {}
    for e, items in mbs.items():
        flops = 0.0
        for p, i in items:
            s = packs[p].samples[i]
            kind = str(s.modality)
            seq = _encoder_seq(cfg, s.modality, s.media_tokens)
            d, n_layers = ms.encoder_dim[kind], ms.encoder_layers[kind]
            flops += 2.0 * ms.encoder_params[kind] * seq + attention_flops([seq], d, n_layers, causal=False)
        enc_fwd_s[e] = flops / rate
    stage_fwd = sum(llm_fwd) / len(llm_fwd) / pp / rate
    fwd: float | list[float] = stage_fwd
    bwd: float | list[float] = 2 * stage_fwd
    if stage_weights is not None:
        fwd = [stage_fwd * w for w in stage_weights]
        bwd = [2 * f for f in fwd]
    return CostModel(
        llm_forward_s=fwd,
        llm_backward_s=bwd,
        encoder_forward_s=enc_fwd_s,
        p2p_latency_s=10e-6,
        p2p_bandwidth_Bps=25e9,
        data_parallel=dp,
        **_sizes(cfg, packs, mbs, pp, 2.0, ms),
    )


def _measured_step_times(run_dir: Path, steps: list[int]) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(r["step"]): float(r["step_time_s"]) for r in rows if r.get("step") in steps}


def simulate_config(
    cfg: RunConfig,
    *,
    gpus: int | None = None,
    pp: int | None = None,
    microbatches: int | None = None,
    out_dir: Path,
    scale: str | None = None,
    peak_flops: float = 989e12,
    efficiency: float = 0.4,
    calibration: Path | None = None,
    steps: int = 1,
    first_step: int = 0,
    plots: bool = True,
) -> str:
    """Simulate every placement policy on ``steps`` steps of the recipe from ``first_step``.

    Args:
        gpus, pp, microbatches: the modelled cluster (``gpus // pp`` DP replicas); with ``calibration``
            they default to (and ``pp`` must equal) the config's, since the fit is of its stages.
        scale: ``"paper"`` (default) or ``"config"`` model sizes; with ``calibration`` always the config's.
        calibration: a run directory holding ``actions.jsonl`` (see the module docstring).
        steps, first_step: which steps of the recipe to simulate (their mean is reported).
        plots: write the timeline PNGs (off: only ``simulate.json``, e.g. for benchmarks).

    Writes ``timeline-<placement>.png`` (of the first simulated step; with ``plots``) and ``simulate.json`` under
    ``out_dir``.

    Returns:
        the comparison table (text).

    Raises:
        ConfigError: ``gpus`` not a multiple of ``pp``, fewer microbatches than stages, unknown scale,
            ``steps < 1``, a calibration whose stages are not the config's ``pp`` or that lacks records.
            Also a missing or malformed records file (names the file, line and field).
    """
    fitted = None
    if calibration is not None:
        if scale not in (None, "config"):
            raise ConfigError(f"--scale: a calibration times the config's own models, not scale {scale!r}")
        try:
            records, fitted, fit_stages = fit_run(Path(calibration))
        except (OSError, ValueError) as exc:  # RecordError is a ValueError
            raise ConfigError(f"--calibration: {Path(calibration) / RECORDS_FILE}: {exc}") from None
        pp = cfg.parallel.pp if pp is None else pp
        if fit_stages != pp or pp != cfg.parallel.pp:
            raise ConfigError(
                f"--calibration: the run recorded {fit_stages} stages, the config has parallel.pp = "
                f"{cfg.parallel.pp} (asked --pp {pp}); calibrate with a run of this config"
            )
        microbatches = cfg.data.microbatches if microbatches is None else microbatches
        gpus = pp * cfg.parallel.dp if gpus is None else gpus
        ms = config_scale(cfg)
        scale = "config (calibrated)"
    else:
        scale = scale or "paper"
        if scale == "config":
            ms = config_scale(cfg)
        elif scale in MODEL_SCALES:
            ms = MODEL_SCALES[scale]
        else:
            raise ConfigError(f"--scale: {scale!r} is not 'config' or one of {sorted(MODEL_SCALES)}")
        gpus = 1024 if gpus is None else gpus
        pp = 8 if pp is None else pp
        microbatches = 64 if microbatches is None else microbatches
    if pp < 1 or gpus < pp or gpus % pp:
        raise ConfigError(f"--gpus: {gpus} is not a positive multiple of --pp {pp}")
    if microbatches < pp:
        raise ConfigError(f"--microbatches: {microbatches} cannot fill {pp} stages")
    if steps < 1 or first_step < 0:
        raise ConfigError(f"--steps: need steps >= 1 and first step >= 0, got {steps} from {first_step}")
    data = dataclasses.replace(cfg.data, microbatches=microbatches)
    # a calibrated step is the run's own: its reordering; modelled steps balance (reorder on)
    par = dataclasses.replace(cfg.parallel, pp=pp, dp=1, reorder=cfg.parallel.reorder if fitted else True)
    cfg = dataclasses.replace(cfg, data=data, parallel=par)
    stream = build_step_stream(
        cfg, load_tokenizer(cfg.data), dp_rank=0, dp_size=1, dp_group=None, consumes=set(), read_text=False
    )
    schedule = Schedule1F1B(pp, microbatches)
    encoder_inputs = encoder_microbatch_ids(microbatches, pp)
    rate = peak_flops * efficiency
    run_flow = None
    if fitted is not None and (Path(calibration) / "dataflow.json").is_file():
        run_flow = DataFlow.from_json((Path(calibration) / "dataflow.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    acc: dict[str, dict[str, float]] = {}
    llm_only_bubble = mb_tokens = 0.0
    simulated: list[int] = []
    with stream:
        stream.reset()
        for _ in range(first_step):
            next(stream)
        for n in range(steps):
            fs = next(stream)
            simulated.append(fs.step)
            packs = fs.packs
            mbs = split_encoder_microbatches(packs, microbatches, pp, balance=par.reorder)
            mb_tokens += sum(p.num_tokens for p in packs) / len(packs)
            if fitted is not None:
                costs = calibrated_step_costs(cfg, fitted, packs, mbs)
            else:
                costs = modelled_step_costs(cfg, ms, packs, mbs, pp, rate, gpus // pp)
            flows = {
                str(policy): place(policy, schedule, encoder_inputs, costs, fixed_ranks=fitted is not None)
                for policy in PlacementPolicy
            }
            as_run = records.flow(fs.step) if fitted is not None else None  # a flow planned per step
            if as_run is not None or run_flow is not None:
                flows["as run"] = as_run or run_flow
            for name, flow in flows.items():
                res = simulate(schedule, flow, costs)
                if plots and n == 0 and name != "as run":
                    res.plot(
                        out_dir / f"timeline-{name}.png",
                        title=f"{cfg.name}: {name}, {gpus} GPUs, pp={pp}, step {fs.step}",
                    )
                r = acc.setdefault(
                    name, dict.fromkeys(("step_time_s", "makespan_s", "tokens", "bubble", "peak0"), 0.0)
                )
                r["step_time_s"] += res.step_time_s / steps
                r["makespan_s"] += res.makespan_s / steps
                r["tokens"] += res.throughput_tokens_per_s * res.step_time_s
                r["bubble"] += res.mean_bubble_fraction / steps
                r["peak0"] = max(r["peak0"], res.peak_activation_bytes[0])
            llm_only_bubble += simulate(schedule, None, costs).mean_bubble_fraction / steps
    results = {
        name: {
            "step_time_s": r["step_time_s"],
            "makespan_s": r["makespan_s"],
            # total tokens over total (simulated) time of the steps, not a mean of per-step rates
            "throughput_tokens_per_s": r["tokens"] / (r["step_time_s"] * steps),
            "mean_bubble_fraction": r["bubble"],
            "stage0_peak_activation_bytes": r["peak0"],
        }
        for name, r in acc.items()
    }
    measured = _measured_step_times(Path(calibration), simulated) if fitted is not None else {}
    if "as run" in results and len(measured) == len(simulated):
        results["as run"]["measured_step_time_s"] = sum(measured.values()) / len(measured)
    base = results[str(PlacementPolicy.PREPEND_FIRST_STAGE)]
    span = f"step {simulated[0]}" if steps == 1 else f"steps {simulated[0]}-{simulated[-1]} (mean)"
    lines = [
        f"{cfg.name} ({scale} model sizes) on {gpus} GPUs (pp={pp}, dp={gpus // pp}, {microbatches} microbatches of "
        f"~{mb_tokens / steps:.0f} tokens; {span}; LLM-only 1F1B bubble {llm_only_bubble:.3f})",
        f"{'placement':<22}{'step s':>12}{'tokens/s':>14}{'vs prepend':>12}{'bubble':>9}{'stage-0 peak MB':>17}",
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<22}{r['step_time_s']:>12.4g}{r['throughput_tokens_per_s']:>14.4g}"
            f"{r['throughput_tokens_per_s'] / base['throughput_tokens_per_s']:>11.2f}x"
            f"{r['mean_bubble_fraction']:>9.3f}{r['stage0_peak_activation_bytes'] / 2**20:>17.2f}"
        )
    if "measured_step_time_s" in results.get("as run", {}):
        r = results["as run"]
        lines.append(
            f"as run: predicted {r['step_time_s']:.4g} s per step, measured {r['measured_step_time_s']:.4g} s "
            f"({100 * (r['step_time_s'] / r['measured_step_time_s'] - 1):+.1f} %)"
        )
    (out_dir / "simulate.json").write_text(
        json.dumps(
            {
                "gpus": gpus,
                "pp": pp,
                "microbatches": microbatches,
                "scale": scale,
                "steps": simulated,
                "calibration": str(calibration) if calibration is not None else None,
                "results": results,
                "llm_only_bubble": llm_only_bubble,
            },
            indent=2,
        )
    )
    return "\n".join(lines)
