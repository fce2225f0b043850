"""``omni-train simulate``: training steps of the config's recipe in omni-pipeline's simulator.

The recipe is the config's own: its mixture, packing and encoder split are run on the bundled data's
metadata (no payload is read) to draw one DP replica's steps of ``microbatches`` packs; each LLM
microbatch's encoder work is split into ``pp`` encoder microbatches (Karmarkar-Karp). omni-pipeline's
simulator then times a 1F1B step under each placement policy, and the table compares them against
``prepend_first_stage``. Durations come from one of:

* **a calibration** (``calibration=RUN_DIR``): the cost model fitted from the per-action records a run of
  this config wrote (``RUN_DIR/actions.jsonl``, :mod:`omni_pipeline.records`;
  :func:`omni_pipeline.calibrate.fit_cost_model`), applied to each simulated step's token counts
  (:func:`omni_pipeline.action_tokens`): the config's own models on the measured machine, P2P latency and bandwidth,
  dispatch gaps and the time outside the pipeline included. The run's first recorded step is dropped
  (warm-up). When the run directory also holds ``metrics.jsonl`` and the run's flow (``dataflow.json``,
  or each step's ``"flow"`` record when ``planned`` planned it per step), the flow the run used is
  simulated on the same steps and printed beside the measured step time. Out of sample
  (``measured=RUN_B``, ``omni-train simulate --calibration RUN_A --measured RUN_B``): RUN_B's recorded
  steps are predicted from RUN_A's fit, RUN_B giving only its config, flows and measured step times
  (another pipeline size or layer split re-staged: :func:`omni_pipeline.calibrate.restage_cost_model`;
  ranks sharing a host's cores: ``host_cores``, :func:`omni_pipeline.calibrate.host_step_s`).
* **modelled FLOPs** at a modelled device rate, for models of the paper's sizes (``scale="paper"``:
  LLaMA-12B backbone, ViT-1B image encoder, USM-2B audio encoder; Table 1 and §2.2) or of the config's own
  tiny sizes (``scale="config"``).

``--workload FILE|NAME`` (:func:`simulate_workload`) draws the steps from a workload file instead
(:mod:`omni_pipeline.workload`: per-source length distributions, mixture phases, pack length, batch and
model sizes; the paper's ``paper-vlm`` and ``paper-omni`` ship in ``omni_train/configs/workloads/``), packs
whole samples with omni-data's packer, and compares the paper's baselines too: Megatron-LM
(``prepend_first_stage``), Megatron-Dist / DistTrain (``megatron_dist``: encoders on ranks of their own,
:func:`omni_pipeline.simulate_disaggregated`), Optimus (``optimus_static``: static bubble filling,
:func:`omni_pipeline.optimus_static`), beside ``isolated``, ``uniform_on_demand`` and ``planned``.

Modelled device (documented assumptions, not measurements): ``peak_flops`` 989e12 (H100 bf16 dense) at
``efficiency`` 0.4; the interconnect and activation sizes of :mod:`omni_pipeline.step_costs` (which holds
the cost model: :func:`omni_pipeline.modelled_step_costs`, :func:`omni_pipeline.calibrated_step_costs`).
Calibrated runs scale the sizes by the run's dtype (4 bytes for float32).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

from omni_data import encoder_microbatch_ids, split_encoder_microbatches
from omni_pipeline import (
    MODEL_SCALES,
    RECORDS_FILE,
    DataFlow,
    PlacementPolicy,
    Schedule1F1B,
    ScheduleKind,
    SimulationResult,
    Workload,
    WorkloadError,
    calibrated_step_costs,
    encoder_ranks_for,
    fit_run,
    load_workload,
    modelled_step_costs,
    optimus_static,
    place,
    simulate,
    simulate_disaggregated,
)
from omni_pipeline.calibrate import fit_layer_model, fit_process_cpu, host_step_s, restage_cost_model
from omni_pipeline.cost import CostModel, Network
from omni_pipeline.records import RunRecords, read_records
from omni_pipeline.split import layer_costs
from omni_pipeline.step_model import (
    PLACEMENTS,
    Device,
    Layout,
    StepPrediction,
    even_stage_layers,
    llm_stage_params,
    predict_step,
)
from omni_pipeline.tune import MAX_SPLITS, RECOMPUTE_CHOICES, tune
from omni_train.binder import config_from_dict
from omni_train.config import ConfigError, RunConfig
from omni_train.data_files import load_tokenizer
from omni_train.data_pipeline import build_step_stream
from omni_train.pipeline import config_scale, image_merge, llm_shape, stage_split

__all__ = [
    "WORKLOAD_ROWS",
    "exact_state",
    "layout_check",
    "resolve_workload",
    "simulate_config",
    "simulate_workload",
    "tune_workload",
    "whole_step",
    "workload_config",
]


def _measured_step_times(run_dir: Path, steps: list[int]) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(r["step"]): float(r["step_time_s"]) for r in rows if r.get("step") in steps}


def _recorded_steps(run_dir: Path) -> list[int]:
    """The steps ``run_dir/metrics.jsonl`` records (sorted).

    Raises:
        ConfigError: no readable metrics file, or a line without an integer ``step`` (names the line).
    """
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--measured: {path}: no measured steps ({exc})") from None
    steps = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            raise ConfigError(
                f"--measured: {path}:{n}: not a metrics record with an integer 'step'"
            ) from None
    return sorted(steps)


def _check_shape(gpus: int, pp: int, microbatches: int, steps: int, first_step: int) -> None:
    """Raises: ConfigError: ``gpus`` not a positive multiple of ``pp``, fewer ``microbatches`` than ``pp``
    stages, ``steps < 1`` or ``first_step < 0`` (one line naming the option)."""
    if pp < 1 or gpus < pp or gpus % pp:
        raise ConfigError(f"--gpus: {gpus} is not a positive multiple of --pp {pp}")
    if microbatches < pp:
        raise ConfigError(f"--microbatches: {microbatches} cannot fill {pp} stages")
    if steps < 1 or first_step < 0:
        raise ConfigError(f"--steps: need steps >= 1 and first step >= 0, got {steps} from {first_step}")


def _accumulate(acc: dict[str, dict[str, float]], name: str, res: SimulationResult, steps: int) -> None:
    """Add one step's simulation ``res`` of placement ``name`` to its running means over ``steps`` steps
    in ``acc`` (step and makespan seconds, bubble fraction), its token total and its stage-0 peak."""
    r = acc.setdefault(name, dict.fromkeys(("step_time_s", "makespan_s", "tokens", "bubble", "peak0"), 0.0))
    r["step_time_s"] += res.step_time_s / steps
    r["makespan_s"] += res.makespan_s / steps
    r["tokens"] += res.throughput_tokens_per_s * res.step_time_s
    r["bubble"] += res.mean_bubble_fraction / steps
    r["peak0"] = max(r["peak0"], res.peak_activation_bytes[0])


def _mean_results(acc: dict[str, dict[str, float]], steps: int) -> dict[str, dict[str, float]]:
    """The rows of ``acc`` (:func:`_accumulate`) as reported: the throughput is total tokens over total
    (simulated) time of the steps, not a mean of per-step rates."""
    return {
        name: {
            "step_time_s": r["step_time_s"],
            "makespan_s": r["makespan_s"],
            "throughput_tokens_per_s": r["tokens"] / (r["step_time_s"] * steps),
            "mean_bubble_fraction": r["bubble"],
            "stage0_peak_activation_bytes": r["peak0"],
        }
        for name, r in acc.items()
    }


_SAME_FOR_A_FIT = (  # what a fit carries to another run only when equal: the models, the arithmetic, the
    # parallel layout within a stage (CP, TP, ...) the per-stage coefficients measured
    "model",
    "train.dtype",
    "data.tokenizer",
    "parallel.dp",
    "parallel.tp",
    "parallel.sequence_parallel",
    "parallel.async_tp",
    "parallel.cp",
    "parallel.cp_attention",
    "parallel.ulysses",
    "parallel.ep",
    "parallel.encoder_sp",
    "parallel.virtual_stages",
    "parallel.schedule",
)


def _field(cfg: RunConfig, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _differences(a, b, prefix: str) -> list[str]:
    """Dotted names of the leaf fields where dataclasses ``a`` and ``b`` differ."""
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b) and type(a) is type(b):
        return [
            d for f in dataclasses.fields(a)
            for d in _differences(getattr(a, f.name), getattr(b, f.name), f"{prefix}.{f.name}")
        ]  # fmt: skip
    return [] if a == b else [prefix]


def _rank_params(cfg: RunConfig, split: list[range], vocab: int) -> float:
    """The largest parameter count one pipeline rank holds: its LLM stage
    (:func:`omni_pipeline.step_model.llm_stage_params`) plus the encoder towers (blocks' matmuls and
    norms), held by every rank unless the placement prepends them to stage 0."""
    ms = config_scale(cfg)
    shape = llm_shape(cfg.model.llm).blocks
    towers = sum(ms.encoder_params.values())
    prepend = cfg.parallel.placement == PlacementPolicy.PREPEND_FIRST_STAGE
    last = len(split) - 1
    return max(
        llm_stage_params(shape, vocab, len(r), first=s == 0, last=s == last)[0]
        + (towers if s == 0 or not prepend else 0.0)
        for s, r in enumerate(split)
    )


def _out_of_sample_fit(
    cfg: RunConfig, fit_dir: Path, skip_steps: int | None
) -> tuple[RunRecords, CostModel, dict]:
    """The cost model fitted on run ``fit_dir`` for the run of ``cfg`` (another run): its records,
    the model and what was re-staged (:func:`simulate_config` with ``measured``).

    Same layers per stage: the run's per-stage fit as it is. Another split (pipeline size or layers per
    stage): :func:`omni_pipeline.calibrate.restage_cost_model` of the joint per-block fit
    (:func:`omni_pipeline.calibrate.fit_layer_model`, the embedding as its modelled FLOPs share of a
    block, :func:`omni_pipeline.layer_costs`), the step overhead scaled by the largest rank's parameters.

    Raises:
        ConfigError: no readable ``config.json`` or records in ``fit_dir``, or runs that differ in a field
            of :data:`_SAME_FOR_A_FIT` (named), or a fit of one stage to re-stage.
    """
    where = f"--calibration: {fit_dir}"
    try:
        fit_cfg = config_from_dict(json.loads((fit_dir / "config.json").read_text()))
    except (OSError, ValueError, ConfigError) as exc:
        raise ConfigError(f"{where}: no readable run config config.json ({exc})") from None
    differ = [d for f in _SAME_FOR_A_FIT for d in _differences(_field(fit_cfg, f), _field(cfg, f), f)]
    if differ:
        raise ConfigError(
            f"{where}: the fitted run and the predicted run differ in {', '.join(differ)}; a fit predicts runs "
            "of the same models, dtype, tokenizer and in-stage parallelism (pipeline size, layers per stage, "
            "mixture, pack length, microbatches and placement may differ)"
        )
    try:
        records, fitted, _ = fit_run(fit_dir, skip_steps=skip_steps)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: {fit_dir / RECORDS_FILE}: {exc}") from None
    vocab = load_tokenizer(cfg.data).get_vocab_size()
    llm = dataclasses.replace(cfg.model.llm, vocab_size=vocab)
    src = stage_split(fit_cfg.parallel, llm, fit_cfg.data.max_seq_len)
    dst = stage_split(cfg.parallel, llm, cfg.data.max_seq_len)
    counts = ([len(r) for r in src], [len(r) for r in dst])
    info = {
        "fit_layers_per_stage": counts[0],
        "layers_per_stage": counts[1],
        "restaged": counts[0] != counts[1],
    }
    if counts[0] == counts[1]:
        return records, fitted, info
    if len(src) < 2:
        raise ConfigError(
            f"{where}: fitted on {len(src)} LLM stage (layers {counts[0]}), whose block and LM head costs "
            f"cannot be told apart; fit on a run of >= 2 stages to predict the split {counts[1]}"
        )
    block_flops, embedding_flops, _ = layer_costs(llm_shape(llm), fit_cfg.data.max_seq_len)
    skip = 1 if skip_steps is None and len(records.step_ids) > 1 else (skip_steps or 0)
    try:
        layers = fit_layer_model(records, src, skip_steps=skip, embedding_share=embedding_flops / block_flops)
        params = (_rank_params(fit_cfg, src, vocab), _rank_params(cfg, dst, vocab))
        fitted = restage_cost_model(
            fitted, layers, src, dst, from_rank_params=params[0], to_rank_params=params[1]
        )
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    info["rank_params"] = list(params)
    return records, fitted, info


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
    measured: Path | None = None,
    skip_steps: int | None = None,
    host_cores: float | None = None,
) -> str:
    """Simulate every placement policy on ``steps`` steps of the recipe from ``first_step``.

    Args:
        gpus, pp, microbatches: the modelled cluster (``gpus // pp`` DP replicas); with ``calibration``
            they default to (and ``pp`` must equal) the config's, since the fit is of its stages.
        scale: ``"paper"`` (default) or ``"config"`` model sizes; with ``calibration`` always the config's.
        calibration: a run directory holding ``actions.jsonl`` (see the module docstring).
        steps, first_step: which steps of the recipe to simulate (their mean is reported).
        plots: write the timeline PNGs (off: only ``simulate.json``, e.g. for benchmarks).
        measured: out of sample: another run directory, of ``cfg`` (its ``config.json``), whose recorded
            steps are predicted from the fit of ``calibration`` (:func:`_out_of_sample_fit`: another
            pipeline size, layers per stage, mixture, pack length, microbatches or placement; the same
            models and in-stage parallelism). It contributes only its steps (the config's stream), its
            flows (``dataflow.json`` / flow records) and its measured step times (``metrics.jsonl``),
            never records to the fit. ``steps`` / ``first_step`` are then its recorded steps from
            ``skip_steps``.
        skip_steps: warm-up steps dropped from the fit and (with ``measured``) from the prediction
            (default: the fit drops the first recorded step).
        host_cores: the ranks share this many cores of one host (CPU runs; a machine parameter, e.g.
            ``os.cpu_count()``): every step's time is :func:`omni_pipeline.calibrate.host_step_s` of the
            config's ``parallel.world_size`` processes, with each process's CPU outside its actions
            (:func:`omni_pipeline.calibrate.fit_process_cpu` of the calibration run's step records, when
            they carry ``cpu_s``) competing for them. ``None``: a processor per rank.

    Writes ``timeline-<placement>.png`` (of the first simulated step; with ``plots``) and ``simulate.json`` under
    ``out_dir``.

    Returns:
        the comparison table (text).

    Raises:
        ConfigError: ``gpus`` not a multiple of ``pp``, fewer microbatches than stages, unknown scale,
            ``steps < 1``, a calibration whose stages are not the config's ``pp`` or that lacks records.
            Also a missing or malformed records file (names the file, line and field). With ``measured``:
            no calibration, no metrics in ``measured``, runs that cannot share a fit (named fields), or
            ``--pp`` / ``--gpus`` / ``--microbatches`` other than the measured run's.
    """
    fitted = None
    oos: dict = {}
    if measured is not None:
        measured = Path(measured)
        if calibration is None:
            raise ConfigError("--measured: needs --calibration, the run whose records fit the cost model")
        if Path(calibration).resolve() == measured.resolve():
            raise ConfigError(f"--measured: {measured} is the calibration run itself; name another run")
        if (pp, gpus, microbatches) != (None, None, None):
            raise ConfigError("--measured: the measured run gives --pp, --gpus and --microbatches; drop them")
        recorded = _recorded_steps(measured)
        warmup = skip_steps if skip_steps is not None else (1 if len(recorded) > 1 else 0)  # as the fit's
        kept = recorded[warmup:]  # by position, as the fit skips: a resumed run's steps start past 0
        if not kept:
            raise ConfigError(
                f"--measured: {measured / 'metrics.jsonl'} holds no step after the {warmup} warm-up steps "
                f"(recorded: {recorded})"
            )
        if kept != list(range(kept[0], kept[-1] + 1)):
            raise ConfigError(f"--measured: {measured / 'metrics.jsonl'}: steps {kept} are not consecutive")
        first_step, steps = kept[0], len(kept)
    if calibration is not None:
        if scale not in (None, "config"):
            raise ConfigError(f"--scale: a calibration times the config's own models, not scale {scale!r}")
        if measured is not None:
            records, fitted, oos = _out_of_sample_fit(cfg, Path(calibration), skip_steps)
            fit_stages = cfg.parallel.pp
        else:
            try:
                records, fitted, fit_stages = fit_run(Path(calibration), skip_steps=skip_steps)
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
        # each process's CPU outside its actions (the fit run's step records), competing for the host's cores
        warm = skip_steps if skip_steps is not None else (1 if len(records.step_ids) > 1 else 0)
        process_cpu = fit_process_cpu(records, skip_steps=warm) if host_cores is not None else None
    else:
        process_cpu = None
        scale = scale or "paper"
        if scale == "config":
            ms = config_scale(cfg)
        elif scale in MODEL_SCALES:
            tp = cfg.model.vit.temporal_patch if cfg.model.vit is not None else 2  # the data's patches
            ms = dataclasses.replace(MODEL_SCALES[scale], image_merge=image_merge(cfg), temporal_patch=tp)
        else:
            raise ConfigError(f"--scale: {scale!r} is not 'config' or one of {sorted(MODEL_SCALES)}")
        gpus = 1024 if gpus is None else gpus
        pp = 8 if pp is None else pp
        microbatches = 64 if microbatches is None else microbatches
    _check_shape(gpus, pp, microbatches, steps, first_step)
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
    dtype_bytes = 8.0 if str(cfg.train.dtype) == "float64" else 4.0  # a calibrated run's activations
    run_flow = None
    run_dir = measured if measured is not None else (Path(calibration) if fitted is not None else None)
    if run_dir is not None and (run_dir / "dataflow.json").is_file():
        run_flow = DataFlow.from_json((run_dir / "dataflow.json").read_text())
    flow_records = records if fitted is not None else None
    if measured is not None:  # the predicted run's own flows (per step when planned), never its actions
        try:
            flow_records = read_records(measured)
        except (OSError, ValueError):
            flow_records = None
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
                costs = calibrated_step_costs(fitted, ms, packs, mbs, pp, dtype_bytes)
            else:
                costs = modelled_step_costs(ms, packs, mbs, pp, rate, gpus // pp)
            flows = {
                str(policy): place(policy, schedule, encoder_inputs, costs, fixed_ranks=fitted is not None)
                for policy in PlacementPolicy
            }
            as_run = flow_records.flow(fs.step) if flow_records is not None else None  # planned per step
            if as_run is not None or run_flow is not None:
                flows["as run"] = as_run or run_flow
            for name, flow in flows.items():
                res = simulate(schedule, flow, costs)
                if host_cores is not None:
                    step_s = host_step_s(
                        schedule,
                        flow,
                        costs,
                        processes=cfg.parallel.world_size,
                        cores=host_cores,
                        process_cpu=process_cpu,
                    )
                    tokens = res.throughput_tokens_per_s * res.step_time_s
                    res = dataclasses.replace(
                        res, step_time_s=step_s, throughput_tokens_per_s=tokens / step_s
                    )
                if plots and n == 0 and name != "as run":
                    res.plot(
                        out_dir / f"timeline-{name}.png",
                        title=f"{cfg.name}: {name}, {gpus} GPUs, pp={pp}, step {fs.step}",
                    )
                _accumulate(acc, name, res, steps)
            llm_only_bubble += simulate(schedule, None, costs).mean_bubble_fraction / steps
    results = _mean_results(acc, steps)
    times = _measured_step_times(run_dir, simulated) if run_dir is not None else {}
    if "as run" in results and len(times) == len(simulated):
        results["as run"]["measured_step_time_s"] = sum(times.values()) / len(times)
    base = results[str(PlacementPolicy.PREPEND_FIRST_STAGE)]
    span = f"step {simulated[0]}" if steps == 1 else f"steps {simulated[0]}-{simulated[-1]} (mean)"
    lines = [
        f"{cfg.name} ({scale} model sizes) on {gpus} GPUs (pp={pp}, dp={gpus // pp}, {microbatches} microbatches of "
        f"~{mb_tokens / steps:.0f} tokens; {span}; LLM-only 1F1B bubble {llm_only_bubble:.3f})",
        f"{'placement':<22}{'step s':>12}{'tokens/s':>14}{'vs prepend':>12}{'bubble':>9}{'stage-0 act. GB':>17}",
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<22}{r['step_time_s']:>12.4g}{r['throughput_tokens_per_s']:>14.4g}"
            f"{r['throughput_tokens_per_s'] / base['throughput_tokens_per_s']:>11.2f}x"
            f"{r['mean_bubble_fraction']:>9.3f}{r['stage0_peak_activation_bytes'] / 1e9:>17.2f}"
        )
    if "measured_step_time_s" in results.get("as run", {}):
        r = results["as run"]
        source = f" (run {measured}, fitted on run {calibration})" if measured is not None else ""
        if oos.get("restaged"):
            source += (
                f"; layers per stage {oos['fit_layers_per_stage']} re-staged to {oos['layers_per_stage']}"
            )
        if host_cores is not None:
            source += f"; {cfg.parallel.world_size} processes on {host_cores:g} cores"
            if process_cpu is not None:
                source += (
                    f", each with {process_cpu.background_s:.3g} + {process_cpu.outside_s:.3g} s of CPU "
                    "beside its actions"
                )
                if process_cpu.skipped_steps:
                    source += f" ({process_cpu.skipped_steps} steps a checkpoint save overlapped left out)"
        lines.append(
            f"as run{source}: predicted {r['step_time_s']:.4g} s per step, measured "
            f"{r['measured_step_time_s']:.4g} s ({100 * (r['step_time_s'] / r['measured_step_time_s'] - 1):+.1f} %)"
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
                "measured": str(measured) if measured is not None else None,
                "host_cores": host_cores,
                # per process: CPU seconds per step beside the actions (omni_pipeline.calibrate.ProcessCpu)
                "process_cpu": dataclasses.asdict(process_cpu) if process_cpu is not None else None,
                **oos,
                "results": results,
                "llm_only_bubble": llm_only_bubble,
            },
            indent=2,
        )
    )
    return "\n".join(lines)


# the rows of a workload simulation: the paper's baselines (Megatron-LM, Megatron-Dist, Optimus) and ours,
# the placements the whole-step model runs
WORKLOAD_ROWS = PLACEMENTS
# omni-train tune: the largest reordering group across DP it searches for its best plans (omni_pipeline.tune)
TUNE_MAX_REORDER_GROUP = 16


def resolve_workload(name_or_path: str) -> Workload:
    """A workload by bundled name (``paper-vlm`` -> ``omni_train/configs/workloads/paper-vlm.toml``) or path.

    Raises:
        ConfigError: neither a bundled name nor a readable file, or a malformed file (one line naming the
            file and the key).
    """
    p = Path(name_or_path)
    if not (p.suffix == ".toml" or "/" in name_or_path):
        bundled = Path(str(resources.files("omni_train") / "configs" / "workloads" / f"{name_or_path}.toml"))
        if not bundled.is_file():
            names = sorted(f.stem for f in bundled.parent.glob("*.toml"))
            raise ConfigError(f"--workload: no bundled workload named {name_or_path!r} (have {names})")
        p = bundled
    try:
        return load_workload(p)
    except WorkloadError as exc:
        raise ConfigError(f"--workload: {exc}") from None


def simulate_workload(
    workload: Workload,
    *,
    gpus: int = 512,
    pp: int = 8,
    microbatches: int | None = None,
    out_dir: Path,
    peak_flops: float = 989e12,
    efficiency: float = 0.4,
    steps: int = 1,
    first_step: int = 0,
    encoder_ranks: int | None = None,
    plots: bool = False,
    layout: Layout | None = None,
    device: Device | None = None,
    network: Network | None = None,
    exact_memory: bool = True,
) -> str:
    """Simulate ``steps`` steps of ``workload`` from ``first_step`` under every row of :data:`WORKLOAD_ROWS`.

    Each step: the workload's packs (:meth:`omni_pipeline.Workload.step_packs`, whole samples), each LLM
    microbatch's media split into ``pp`` encoder microbatches (Karmarkar-Karp by encoder FLOPs, the
    reordering on), modelled FLOPs of the workload's model sizes at ``peak_flops * efficiency``
    (:func:`omni_pipeline.modelled_step_costs`), one 1F1B pipeline replica of ``gpus // pp``.
    ``megatron_dist`` gives its encoders ``encoder_ranks`` extra ranks per replica (default: sized once
    from the first simulated step, :func:`omni_pipeline.encoder_ranks_for`) out of the same GPUs, so its
    throughput counts ``gpus / (pp + encoder_ranks)`` replicas.

    Then the whole step of ``layout`` (default: ``pp``, ``dp = gpus // pp``, nothing else) on the first
    simulated step, every placement (:func:`whole_step`: TP / SP, CP, Ulysses, ZeRO and encoder
    collectives, the reordering all-to-all and the optimizer over ``network``; activation offload of
    ``layout.offload``'s block families, its copies over ``device.host_Bps``, ``--offload`` /
    ``--host-gbps``; per-rank memory, exact from ``omni-train memory``'s build with ``exact_memory``,
    with the OOM verdict against ``device``).

    Writes ``simulate.json`` (and with ``plots`` one ``timeline-<row>.png`` of the first step, drawn after
    the timing: matplotlib takes seconds per plot at paper scale) under ``out_dir``.

    Returns:
        the comparison table (text), with the seconds the simulation took.

    Raises:
        ConfigError: ``gpus`` not a positive multiple of ``pp``, fewer microbatches than stages, ``steps < 1``,
            ``first_step < 0``, ``encoder_ranks < 1``, a layout of another pipeline size or GPU count, a layout
            the trainer refuses (with ``exact_memory``), ``layout.offload`` naming a block family the
            workload lacks.
    """
    t0 = time.perf_counter()
    microbatches = workload.microbatches if microbatches is None else microbatches
    _check_shape(gpus, pp, microbatches, steps, first_step)
    layout = layout if layout is not None else Layout(pp=pp, dp=gpus // pp)
    if layout.pp != pp or layout.gpus != gpus:
        raise ConfigError(
            f"--gpus: {gpus} is not pp * dp * tp * cp * ulysses = {layout.pp} * {layout.dp} * {layout.tp} * "
            f"{layout.cp} * {layout.ulysses}"
        )
    if encoder_ranks is not None and encoder_ranks < 1:
        raise ConfigError(f"--encoder-ranks: must be >= 1, got {encoder_ranks}")
    absent = [f for f in layout.offload if f not in workload.shapes]
    if absent:
        raise ConfigError(
            f"--offload: workload {workload.name} has no {', '.join(absent)} blocks to offload (its block "
            f"families: {', '.join(workload.shapes)})"
        )
    if layout.ep > 1 and (workload.moe is None or workload.moe.experts % layout.ep):
        have = "no [model] moe" if workload.moe is None else f"{workload.moe.experts} experts"
        raise ConfigError(
            f"--ep: {layout.ep} needs an MoE workload whose experts it divides ({workload.name}: {have})"
        )
    dp = gpus // pp
    schedule = Schedule1F1B(pp, microbatches)
    encoder_inputs = encoder_microbatch_ids(microbatches, pp)
    out_dir.mkdir(parents=True, exist_ok=True)
    acc: dict[str, dict[str, float]] = {}
    llm_only_bubble = mb_tokens = 0.0
    for n, step in enumerate(range(first_step, first_step + steps)):
        packs = workload.step_packs(step, microbatches)
        mbs = split_encoder_microbatches(packs, microbatches, pp, balance=True)
        mb_tokens += sum(p.num_tokens for p in packs) / len(packs) / steps
        costs = modelled_step_costs(workload.model, packs, mbs, pp, peak_flops * efficiency, dp)
        if encoder_ranks is None:
            encoder_ranks = encoder_ranks_for(costs, schedule)
        flows = {
            "prepend_first_stage": place("prepend_first_stage", schedule, encoder_inputs, costs),
            "optimus_static": optimus_static(schedule, encoder_inputs, costs),
            "isolated": place("isolated", schedule, encoder_inputs, costs),
            "uniform_on_demand": place("uniform_on_demand", schedule, encoder_inputs, costs),
            "planned": place("planned", schedule, encoder_inputs, costs),
        }
        results = {name: simulate(schedule, flow, costs) for name, flow in flows.items()}
        results["megatron_dist"] = simulate_disaggregated(schedule, encoder_inputs, costs, encoder_ranks)
        if n == 0:
            first = results
        for name in WORKLOAD_ROWS:
            _accumulate(acc, name, results[name], steps)
        llm_only_bubble += simulate(schedule, None, costs).mean_bubble_fraction / steps
    results_out = _mean_results(acc, steps)
    preds, step_lines = whole_step(
        workload, layout, device=device or Device(peak_flops=peak_flops, efficiency=efficiency),
        network=network or Network(), microbatches=microbatches, step=first_step, exact_memory=exact_memory,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    for name, res in first.items() if plots else ():
        res.plot(
            out_dir / f"timeline-{name}.png",
            title=f"{workload.name}: {name}, {gpus} GPUs, pp={pp}, step {first_step}",
        )
    base = results_out["prepend_first_stage"]["throughput_tokens_per_s"]
    span = f"step {first_step}" if steps == 1 else f"steps {first_step}-{first_step + steps - 1} (mean)"
    lines = [
        f"workload {workload.name} on {gpus} GPUs (pp={pp}, dp={dp}, {microbatches} packs of ~{mb_tokens:.0f} tokens "
        f"(max {workload.max_seq_len}) per replica, global batch {microbatches * dp} packs; {span}; LLM-only 1F1B bubble {llm_only_bubble:.3f}; "
        f"megatron_dist: {encoder_ranks} encoder ranks per replica); simulated in {wall:.2f} s (the placements' "
        "pipelines and the whole step with its memory build; not the command's start-up); stage-0 act. GB: "
        "the simulated peak of stage 0's activations (1e9 bytes; the whole-step table adds the state)",
        f"{'placement':<22}{'step s':>12}{'tokens/s':>14}{'vs prepend':>12}{'bubble':>9}{'stage-0 act. GB':>17}",
    ]
    for name, r in results_out.items():
        lines.append(
            f"{name:<22}{r['step_time_s']:>12.4g}{r['throughput_tokens_per_s']:>14.4g}"
            f"{r['throughput_tokens_per_s'] / base:>11.2f}x"
            f"{r['mean_bubble_fraction']:>9.3f}{r['stage0_peak_activation_bytes'] / 1e9:>17.2f}"
        )
    lines += step_lines
    (out_dir / "simulate.json").write_text(
        json.dumps(
            {
                "whole_step": {name: _prediction_json(p) for name, p in preds.items()},
                "exact_memory": exact_memory,
                "workload": workload.name,
                "gpus": gpus,
                "pp": pp,
                "microbatches": microbatches,
                "global_batch_packs": microbatches * dp,
                "max_seq_len": workload.max_seq_len,
                "steps": list(range(first_step, first_step + steps)),
                "encoder_ranks": encoder_ranks,
                "results": results_out,
                "llm_only_bubble": llm_only_bubble,
                "wall_s": wall,
            },
            indent=2,
        )
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# The whole step of one layout (omni_pipeline.step_model) and the tuner (omni_pipeline.tune): this module
# only maps a workload and a layout to the trainer's config (for `omni-train memory`'s exact state and for
# --write-config) and formats the results.


def workload_config(
    workload: Workload,
    layout: Layout,
    microbatches: int | None = None,
    base: RunConfig | None = None,
    stage_layers: Sequence[int] | None = None,
) -> RunConfig:
    """The trainer's config of ``workload``'s models under ``layout``: ``base`` (default the bundled
    ``omni-tiny`` when the workload has an audio tower, else ``vlm-tiny``: its data and recipe) with the
    workload's LLM (with its ``[model] moe`` as ``[model.llm] moe``) / ViT / audio shapes (as :func:`omni_train.memory_plan.paper_config` maps them: whole
    MLP ratios for the encoders), its pack length, ``microbatches`` per replica (default the workload's),
    bfloat16, ``train.recompute`` of every family when ``layout.recompute`` (``train.recompute_modules`` =
    ``layout.recompute_modules``), ``train.offload`` = ``layout.offload``'s families the model has,
    ``data.decode_workers`` = the workload's ``loader_workers`` (at least 1), and ``[parallel]`` from the
    layout (``parallel.async_tp`` = ``layout.async_tp``; ZeRO-3: ``llm_reshard_after_forward`` written as
    ``always`` / ``never``, what
    :meth:`~omni_pipeline.step_model.Layout.reshards` resolves; ``virtual_stages > 1`` as
    ``schedule = "interleaved"``; the layers split evenly, or ``stage_layers`` as ``parallel.stage_layers``,
    one count per stage; ``data.reorder_group_size`` =
    ``layout.reorder_group``) (``optimus_static`` and ``megatron_dist``, not trainer placements, map to ``uniform_on_demand``).

    Raises:
        ConfigError: the workload lacks an LLM shape, or ``base`` lacks a tower the workload uses.
    """
    from omni_train.binder import load_config

    shapes = workload.shapes
    if "llm" not in shapes:
        raise ConfigError(f"--workload: {workload.name} has no LLM shape")
    cfg = base if base is not None else load_config("omni-tiny" if "audio" in shapes else "vlm-tiny")
    m = cfg.model
    llm = shapes["llm"]
    model = dataclasses.replace(
        m,
        llm=dataclasses.replace(m.llm, dim=llm.dim, n_layers=llm.n_layers, n_heads=llm.n_heads,
                                n_kv_heads=llm.n_kv_heads or llm.n_heads, ffn_dim=int(llm.mlp_dim),
                                vocab_size=None, moe=_moe_spec(workload)),
    )  # fmt: skip
    for part, field_ in (("image", "vit"), ("audio", "audio")):
        tower = getattr(m, field_)
        if part in shapes and tower is None:
            raise ConfigError(f"--config: the workload has an {part} tower, the config no [model.{field_}]")
        if part in shapes:
            s = shapes[part]
            extra = {"merge": workload.model.image_merge} if part == "image" else {}
            tower = dataclasses.replace(tower, dim=s.dim, n_layers=s.n_layers, n_heads=s.n_heads,
                                        mlp_ratio=round(s.mlp_dim / s.dim), **extra)  # fmt: skip
        model = dataclasses.replace(model, **{field_: tower})
    data = dataclasses.replace(
        cfg.data,
        max_seq_len=workload.max_seq_len,
        microbatches=workload.microbatches if microbatches is None else microbatches,
    )
    families = ["llm"] + [f for f, t in (("image", model.vit), ("audio", model.audio)) if t is not None]
    train = dataclasses.replace(
        cfg.train, dtype="bfloat16", recompute=families if layout.recompute else [],
        recompute_modules=list(layout.recompute_modules) if layout.recompute else [],
        offload=[f for f in families if f in layout.offload],
    )  # fmt: skip
    # the loader's decode workers the step model timed (the trainer runs at least one)
    data = dataclasses.replace(data, decode_workers=max(1, workload.loader_workers))
    placement = (
        "uniform_on_demand" if layout.placement in ("optimus_static", "megatron_dist") else layout.placement
    )
    par = dataclasses.replace(
        cfg.parallel, pp=layout.pp, dp=layout.dp, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
        async_tp=layout.async_tp, cp=layout.cp, cp_attention=layout.cp_attention, ulysses=layout.ulysses, llm_zero=layout.llm_zero,
        encoder_zero=layout.encoder_zero, placement=PlacementPolicy(placement), ep=layout.ep,
        virtual_stages=layout.virtual_stages, stage_layers=None if stage_layers is None else list(stage_layers),
        schedule=ScheduleKind.INTERLEAVED if layout.virtual_stages > 1 else ScheduleKind.ONE_F_ONE_B,
    )  # fmt: skip
    # the reordering group the step model timed (its all-to-all), not the trainer's node-wide default
    data = dataclasses.replace(data, reorder_group_size=layout.reorder_group)
    if layout.llm_zero == 3:  # the policy the step model timed, written explicitly (never "auto")
        par = dataclasses.replace(
            par, llm_reshard_after_forward="always" if layout.reshards(data.microbatches) else "never"
        )
    return dataclasses.replace(cfg, model=model, data=data, train=train, parallel=par)


def _moe_spec(workload: Workload):
    """The trainer's ``[model.llm] moe`` (``MoESpec``) of the workload's ``[model] moe``; ``None``: dense."""
    from omni_train.models.llm import MoESpec

    x = workload.moe
    if x is None:
        return None
    return MoESpec(
        experts=x.experts, top_k=x.top_k, shared_experts=x.shared_experts, every_n_layers=x.every_n_layers,
        expert_ffn_dim=x.expert_ffn_dim, shared_expert_ffn_dim=x.shared_expert_ffn_dim,
    )  # fmt: skip


def exact_state(
    workload: Workload,
    layout: Layout,
    microbatches: int | None = None,
    *,
    vocab: int = 32000,
    stage_layers: Sequence[int] | None = None,
) -> dict[int, dict[str, dict[str, int]]]:
    """Per pipeline rank, the state bytes ``omni-train memory`` plans for this layout
    (:func:`omni_train.memory_plan.memory_plan` of :func:`workload_config`: the model built on the meta
    device, ``planned_state_bytes``): ``{pp rank: {"llm": {kind: bytes}, "encoders": {kind: bytes},
    "in_step": {"llm" | "encoders": {"gradients", "gathered"}}}}`` (``omni_train.memory_plan.in_step_bytes``),
    each pipeline rank's largest planned rank (its stage's first: the largest FSDP2 shards).
    ``stage_layers``: layers per LLM stage (``parallel.stage_layers``; default the even split).

    Raises:
        ConfigError: the trainer refuses the layout (preflight; one line naming the field).
    """
    from omni_train.memory_plan import memory_plan

    cfg = workload_config(workload, layout, microbatches, stage_layers=stage_layers)
    plan = memory_plan(cfg, layout.gpus, vocab=vocab)
    out: dict[int, dict[str, dict[str, int]]] = {}
    for r in plan["ranks"]:
        total = sum(r["llm"].values()) + sum(r["encoders"].values())
        for p in r["same_pp_ranks"]:
            have = out.get(p)
            if have is None or total > sum(have["llm"].values()) + sum(have["encoders"].values()):
                out[p] = {"llm": dict(r["llm"]), "encoders": dict(r["encoders"]), "in_step": r["in_step"]}
    return out


def layout_check(workload: Workload) -> Callable[[Layout], str | None]:
    """``layout -> None`` when the trainer's preflight accepts :func:`workload_config` of it on
    ``layout.gpus`` ranks, else the preflight's one-line reason.

    The preflight's file checks (shards, media, tokenizers: :func:`omni_train.preflight.validate_sources`),
    which no layout changes, run once here; each layout runs the rest (``validate(..., sources=False)``),
    and a layout those accept gets the file checks' reason, if any."""
    from omni_train.preflight import validate, validate_sources

    base = workload_config(workload, Layout())
    try:
        validate_sources(workload_config(workload, Layout(), base=base))
        files = None
    except ConfigError as exc:
        files = str(exc)

    def check(layout: Layout) -> str | None:
        try:
            validate(workload_config(workload, layout, base=base), layout.gpus, sources=False)
        except ConfigError as exc:
            return str(exc)
        return files

    return check


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def format_prediction(p: StepPrediction, device: Device) -> list[str]:
    """Lines: where the time goes (seconds and share of the step) and memory per pipeline rank (GB)."""
    lines = ["where the time goes (busiest pipeline rank, s per step):"]
    lines.append("  " + ", ".join(f"{k} {v:.3g} ({100 * v / p.step_time_s:.0f}%)"
                                  for k, v in p.time_s.items() if v > 0))  # fmt: skip
    kinds = ("parameters", "gathered", "gradients", "optimizer")
    lines.append(
        f"memory per pipeline rank, GB (device {_gb(device.memory_bytes)} GB; state held between steps, "
        "in-step: ZeRO-2/3's whole gradients and ZeRO-3's gathered parameters until the sync; peak: the sum, "
        "the OOM verdict's):"
    )
    lines.append(
        f"{'':<14}"
        + "".join(
            f"{h:>10}"
            for h in [f"llm {k[:5]}" for k in kinds] + ["enc state", "in-step", "activ.", "peak", "verdict"]
        )
    )
    for r, row in p.memory.items():
        enc = sum(row[f"enc_{k}"] for k in kinds)
        in_step = sum(row[f"{a}_in_step_{k}"] for a in ("llm", "enc") for k in ("gradients", "gathered"))
        vals = [row[f"llm_{k}"] for k in kinds] + [enc, in_step, row["activations"], row["total"]]
        verdict = "OOM" if r in p.oom else "fits"
        lines.append(f"  pp rank {r:<4}" + "".join(f"{_gb(v):>10}" for v in vals) + f"{verdict:>10}")
    return lines


def whole_step(
    workload: Workload,
    layout: Layout,
    *,
    device: Device,
    network: Network,
    microbatches: int | None = None,
    step: int = 0,
    exact_memory: bool = True,
) -> tuple[dict[str, StepPrediction], list[str]]:
    """Every placement of :data:`omni_pipeline.step_model.PLACEMENTS` under ``layout`` (``megatron_dist``
    only without virtual stages; the whole step:
    collectives, optimizer, memory with the OOM verdict), the state exact from ``omni-train memory``'s
    build when ``exact_memory`` (else analytic). Returns the predictions and the report's lines.

    Raises:
        ConfigError: with ``exact_memory``, a layout the trainer refuses.
    """
    state = exact_state(workload, layout, microbatches) if exact_memory else None
    cache: dict = {}
    preds = {
        pl: predict_step(
            workload, dataclasses.replace(layout, placement=pl), device=device, network=network,
            microbatches=microbatches, step=step, state=state, cache=cache,
        )
        for pl in PLACEMENTS
        if layout.virtual_stages == 1 or pl != "megatron_dist"  # its encoder ranks run 1F1B only
    }  # fmt: skip
    L = layout
    lines = [
        f"whole step at pp={L.pp}{f' x {L.virtual_stages} virtual' if L.virtual_stages > 1 else ''}, dp={L.dp}, tp={L.tp}{' +SP' if L.sequence_parallel else ''}{' +async TP' if L.async_tp else ''}, cp={L.cp} "
        f"({L.cp_attention}), ulysses={L.ulysses}, llm_zero={L.llm_zero}, encoder_zero={L.encoder_zero}, "
        f"ep={L.ep}, recompute={('+'.join(L.recompute_modules) or 'on') if L.recompute else 'off'}, reorder group {L.reorder_group}; "
        + (
            f"offload {'+'.join(L.offload)} over a {device.host_Bps / 1e9:g} GB/s host link; "
            if L.offload
            else ""
        )
        + f"{network.gpus_per_node} GPUs/node, state {'exact (omni-train memory)' if exact_memory else 'analytic'}",
        f"{'placement':<22}{'step s':>10}{'tokens/s':>12}{'MFU':>7}{'peak GB':>10}{'verdict':>9}",
    ]
    for name, p in preds.items():
        lines.append(
            f"{name:<22}{p.step_time_s:>10.4g}{p.tokens_per_s:>12.4g}{p.mfu:>7.3f}"
            f"{_gb(p.peak_memory_bytes):>10}{'OOM' if p.oom else 'fits':>9}"
        )
    lines += format_prediction(preds[L.placement], device)
    return preds, lines


def _absolute_data(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its relative shard urls and tokenizer made absolute (against
    :func:`omni_train.data_files.data_root`), so the written config runs from any folder."""
    from omni_train.data_files import data_root

    root = data_root(cfg)

    def absolute(url: str) -> str:
        return url if "://" in url or Path(url).is_absolute() else str(root / url)

    sources = [
        dataclasses.replace(
            src, urls=absolute(src.urls) if isinstance(src.urls, str) else [absolute(u) for u in src.urls]
        )
        for src in cfg.data.sources
    ]
    tok = cfg.data.tokenizer
    if tok and not Path(tok).is_absolute() and (root / tok).is_file():
        tok = str(root / tok)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sources=sources, tokenizer=tok))


def _prediction_json(p: StepPrediction) -> dict:
    return {
        "layout": dataclasses.asdict(p.layout),
        "step_time_s": p.step_time_s,
        "tokens_per_s": p.tokens_per_s,
        "mfu": p.mfu,
        "time_s": p.time_s,
        "memory_bytes": {str(r): row for r, row in p.memory.items()},
        "oom_pp_ranks": p.oom,
    }


def tune_workload(
    workload: Workload,
    gpus: int,
    *,
    device: Device,
    network: Network,
    global_batch: int | None = None,
    top: int = 5,
    out_dir: Path,
    write_config: Path | None = None,
    max_reorder_group: int = TUNE_MAX_REORDER_GROUP,
    recompute: Sequence[str] | None = None,
    max_splits: int = MAX_SPLITS,
    async_tp: bool = True,
) -> str:
    """``omni-train tune``: :func:`omni_pipeline.tune.tune` over the layouts the trainer's preflight
    accepts (:func:`layout_check`), the best plans' state exact from ``omni-train memory``'s build
    (:func:`exact_state`). Writes ``tune.json`` under ``out_dir`` (a directory) and, with ``write_config``,
    the best plan as a trainer config (:func:`workload_config`, TOML via :func:`omni_train.binder.to_toml`).
    The best plans' reordering group across DP (up to :data:`TUNE_MAX_REORDER_GROUP` replicas) is searched
    over several replicas' packs (:mod:`omni_pipeline.replica_balance`), printed (column ``rg``, the best
    plan's curve), written to ``tune.json`` (``reorder_groups``) and to the config
    (``data.reorder_group_size``).
    Plans are ranked by :func:`omni_pipeline.tune.rank_plans` (equal predictions: lower ``llm_zero``, then
    ``encoder_zero``, then fewer virtual stages first); a row predicting the same step as an earlier one
    is marked ``(ties #k)``. Each plan's LLM layers per stage (column ``layers``: ``even`` or the uneven
    split the search found, ``stage_layers`` in ``tune.json``) go to the config as
    ``parallel.stage_layers`` when uneven.

    Args:
        max_reorder_group: the largest reordering group searched (``--max-reorder-group``; 1: none).
        recompute: the recompute forms searched (``--recompute``: names of
            :data:`omni_pipeline.tune.RECOMPUTE_CHOICES`; default all).
        max_splits: ``--max-splits`` (:func:`omni_pipeline.tune.tune`'s; 0: the even split only).
        async_tp: ``tp > 1`` plans run async TP where the preflight accepts it (column ``sp``: ``a``;
            ``parallel.async_tp`` in the config), else plain SP (``y``); ``False`` (``--no-async-tp``):
            plain SP only.

    Returns:
        the report (text).

    Raises:
        ConfigError: ``gpus`` < 1, ``top`` < 1, ``max_reorder_group`` < 1, ``max_splits`` < 0, unknown
            ``recompute`` forms, or no layout fits (one line).
    """
    from omni_train.binder import to_toml

    if gpus < 1 or top < 1:
        raise ConfigError(f"--gpus / --top: need >= 1, got {gpus}, {top}")
    if global_batch is not None and global_batch < 1:
        raise ConfigError(f"--global-batch: need >= 1 packs per step, got {global_batch}")
    if max_reorder_group < 1 or max_splits < 0:
        raise ConfigError(
            f"--max-reorder-group / --max-splits: need >= 1 and >= 0, got {max_reorder_group}, {max_splits}"
        )
    forms = tuple(RECOMPUTE_CHOICES) if recompute is None else tuple(recompute)
    if not forms or set(forms) - set(RECOMPUTE_CHOICES):
        raise ConfigError(
            f"--recompute: name some of {', '.join(RECOMPUTE_CHOICES)}, got {', '.join(forms)!r}"
        )
    try:
        res = tune(
            workload, gpus, device=device, network=network, global_batch=global_batch, top=top,
            check=layout_check(workload),
            exact_state=lambda layout, m, split: exact_state(workload, layout, m, stage_layers=split),
            max_reorder_group=max_reorder_group, max_splits=max_splits, recompute=forms, async_tp=async_tp,
        )  # fmt: skip
    except ValueError as exc:
        raise ConfigError(f"--gpus: {exc}") from None
    lines = [
        f"omni-train tune: {workload.name} on {gpus} GPUs ({network.gpus_per_node}/node), global batch "
        f"{res.global_batch} packs of {workload.max_seq_len}; device {_gb(device.memory_bytes)} GB, "
        f"{device.peak_flops / 1e12:g} TFLOP/s x {device.efficiency}; {res.considered} layouts, "
        f"{res.refused} refused by preflight, {res.oom} out of memory, {res.simulated} simulated, "
        f"{res.bounded} virtual-stage layouts bounded out; {res.splits} uneven splits ({res.split_oom} out of "
        f"memory, {res.split_bounded} bounded out, {res.split_s:.1f} s); "
        f"{res.wall_s:.1f} s",
        f"{'#':>2} {'pp':>3}{'v':>3}{'dp':>5}{'tp':>4}{'sp':>4}{'cp':>4}{'uly':>5}{'ep':>4}{'zero':>5}{'ez':>3}{'rc':>5}{'rg':>4} {'placement':<18}"
        f"{'tokens/s':>11}{'MFU':>7}{'peak GB':>9} {'layers':<12} top time",
    ]
    head = 1  # the first row of a run of equal predictions
    for i, (p, layers) in enumerate(zip(res.plans, res.stage_layers, strict=True), 1):
        L = p.layout
        even = layers == even_stage_layers(workload.shapes["llm"].n_layers, L.stages)
        split = "even" if even else "/".join(map(str, layers))
        cp = f"{L.cp}{'r' if L.cp > 1 and L.cp_attention == 'ring' else ''}"
        where = sorted(p.time_s.items(), key=lambda kv: -kv[1])[:3]
        head = head if i > 1 and p.tokens_per_s == res.plans[i - 2].tokens_per_s else i
        lines.append(
            f"{i:>2} {L.pp:>3}{L.virtual_stages:>3}{L.dp:>5}{L.tp:>4}{('a' if L.async_tp else 'y') if L.sequence_parallel else 'n':>4}{cp:>4}"
            f"{L.ulysses:>5}{L.ep:>4}{L.llm_zero:>5}{L.encoder_zero:>3}{(L.recompute_modules[0][:4] if L.recompute_modules else 'y') if L.recompute else 'n':>5}"
            f"{L.reorder_group:>4} {L.placement:<18}{p.tokens_per_s:>11.4g}"
            f"{p.mfu:>7.3f}{_gb(p.peak_memory_bytes):>9} {split:<12} "
            + ", ".join(f"{k} {100 * v / p.step_time_s:.0f}%" for k, v in where)
            + (f"  (ties #{head})" if head != i else "")
        )
    if any(p.layout.sequence_parallel for p in res.plans):
        lines.append(
            "sp: y Megatron SP, a with async TP (parallel.async_tp: each SP ring overlapped with its region's "
            f"projection matmuls, only the exposed part priced); {res.async_fallbacks} async layouts refused "
            "by preflight and searched with plain SP"
        )
    if any(a.tokens_per_s == b.tokens_per_s for a, b in zip(res.plans, res.plans[1:])):
        lines.append(
            "(ties #k): the same predicted step as row k; equal predictions list lower zero, then lower "
            "ez, then fewer virtual stages first"
        )
    best = res.plans[0]
    if res.groups:  # omni_pipeline.replica_balance: replicas' own packs, encoder samples reordered
        curve = res.groups[0]
        lines.append(
            f"rg: reordering group (data.reorder_group_size), priced for these plans over {curve[0].replicas} "
            f"of {best.layout.dp} DP replicas (own packs, encoder samples reordered per group as the trainer "
            f"does, slowest replica + all-to-all; "
            f"{res.reorder_s:.1f} s); best plan: "
            + ", ".join(
                f"{c.group}: {c.tokens_per_s:.4g} tokens/s (a2a {1e3 * c.reorder_all_to_all_s:.2g} ms)"
                for c in curve
            )
        )
    lines.append("best plan:")
    lines += format_prediction(best, device)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tune.json").write_text(
        json.dumps(
            {
                "workload": workload.name,
                "gpus": gpus,
                "global_batch": res.global_batch,
                "considered": res.considered,
                "refused": res.refused,
                "oom": res.oom,
                "simulated": res.simulated,
                "bounded": res.bounded,
                "async_fallbacks": res.async_fallbacks,
                "wall_s": res.wall_s,
                "plans": [
                    _prediction_json(p) | {"stage_layers": layers}
                    for p, layers in zip(res.plans, res.stage_layers, strict=True)
                ],
                "uneven_splits": {
                    "considered": res.splits,
                    "oom": res.split_oom,
                    "bounded": res.split_bounded,
                    "search_s": res.split_s,
                },
                "reorder_groups": [
                    [
                        {
                            "group": c.group,
                            "replicas": c.replicas,
                            "tokens_per_s": c.tokens_per_s,
                            "step_time_s": c.step_time_s,
                            "reorder_all_to_all_s": c.reorder_all_to_all_s,
                            "replica_step_spread": c.spread,
                            "oom": bool(c.prediction.oom),
                        }
                        for c in curve
                    ]
                    for curve in res.groups
                ],
                "reorder_search_s": res.reorder_s,
            },
            indent=2,
        )
    )
    if write_config is not None:
        m = res.global_batch // best.layout.dp
        layers = res.stage_layers[0]
        uneven = layers != even_stage_layers(workload.shapes["llm"].n_layers, best.layout.stages)
        cfg = _absolute_data(
            workload_config(workload, best.layout, m, stage_layers=layers if uneven else None)
        )
        write_config.parent.mkdir(parents=True, exist_ok=True)
        write_config.write_text(
            f"# omni-train tune: best plan for workload {workload.name} on {gpus} GPUs "
            f"({best.tokens_per_s:.4g} tokens/s predicted); run on {gpus} ranks\n" + to_toml(cfg)
        )
        lines.append(f"wrote {write_config}")
    return "\n".join(lines)
