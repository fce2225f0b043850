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
  simulated on the same steps and printed beside the measured step time.
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
from importlib import resources
from pathlib import Path

from omni_data import encoder_microbatch_ids, split_encoder_microbatches
from omni_pipeline import (
    MODEL_SCALES,
    RECORDS_FILE,
    DataFlow,
    PlacementPolicy,
    Schedule1F1B,
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
from omni_train.config import ConfigError, RunConfig
from omni_train.data_files import load_tokenizer
from omni_train.data_pipeline import build_step_stream
from omni_train.pipeline import config_scale, image_merge

__all__ = ["WORKLOAD_ROWS", "resolve_workload", "simulate_config", "simulate_workload"]


def _measured_step_times(run_dir: Path, steps: list[int]) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(r["step"]): float(r["step_time_s"]) for r in rows if r.get("step") in steps}


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
            ms = dataclasses.replace(MODEL_SCALES[scale], image_merge=image_merge(cfg))  # the data's patches
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
                costs = calibrated_step_costs(fitted, ms, packs, mbs, pp, dtype_bytes)
            else:
                costs = modelled_step_costs(ms, packs, mbs, pp, rate, gpus // pp)
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
                _accumulate(acc, name, res, steps)
            llm_only_bubble += simulate(schedule, None, costs).mean_bubble_fraction / steps
    results = _mean_results(acc, steps)
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


# the rows of a workload simulation: the paper's baselines (Megatron-LM, Megatron-Dist, Optimus) and ours
WORKLOAD_ROWS = (
    "prepend_first_stage",
    "megatron_dist",
    "optimus_static",
    "isolated",
    "uniform_on_demand",
    "planned",
)


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
) -> str:
    """Simulate ``steps`` steps of ``workload`` from ``first_step`` under every row of :data:`WORKLOAD_ROWS`.

    Each step: the workload's packs (:meth:`omni_pipeline.Workload.step_packs`, whole samples), each LLM
    microbatch's media split into ``pp`` encoder microbatches (Karmarkar-Karp by encoder FLOPs, the
    reordering on), modelled FLOPs of the workload's model sizes at ``peak_flops * efficiency``
    (:func:`omni_pipeline.modelled_step_costs`), one 1F1B pipeline replica of ``gpus // pp``.
    ``megatron_dist`` gives its encoders ``encoder_ranks`` extra ranks per replica (default: sized once
    from the first simulated step, :func:`omni_pipeline.encoder_ranks_for`) out of the same GPUs, so its
    throughput counts ``gpus / (pp + encoder_ranks)`` replicas.

    Writes ``simulate.json`` (and with ``plots`` one ``timeline-<row>.png`` of the first step, drawn after
    the timing: matplotlib takes seconds per plot at paper scale) under ``out_dir``.

    Returns:
        the comparison table (text), with the seconds the simulation took.

    Raises:
        ConfigError: ``gpus`` not a positive multiple of ``pp``, fewer microbatches than stages, ``steps < 1``,
            ``first_step < 0``, ``encoder_ranks < 1``.
    """
    t0 = time.perf_counter()
    microbatches = workload.microbatches if microbatches is None else microbatches
    _check_shape(gpus, pp, microbatches, steps, first_step)
    if encoder_ranks is not None and encoder_ranks < 1:
        raise ConfigError(f"--encoder-ranks: must be >= 1, got {encoder_ranks}")
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
        f"megatron_dist: {encoder_ranks} encoder ranks per replica); simulated in {wall:.2f} s",
        f"{'placement':<22}{'step s':>12}{'tokens/s':>14}{'vs prepend':>12}{'bubble':>9}{'stage-0 peak MB':>17}",
    ]
    for name, r in results_out.items():
        lines.append(
            f"{name:<22}{r['step_time_s']:>12.4g}{r['throughput_tokens_per_s']:>14.4g}"
            f"{r['throughput_tokens_per_s'] / base:>11.2f}x"
            f"{r['mean_bubble_fraction']:>9.3f}{r['stage0_peak_activation_bytes'] / 2**20:>17.2f}"
        )
    (out_dir / "simulate.json").write_text(
        json.dumps(
            {
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
