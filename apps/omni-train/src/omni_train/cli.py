"""``omni-train``: ``run`` (train), ``prepare-data`` (rebuild the bundled shards), ``simulate`` (model a
large cluster with the pipeline simulator), ``import-hf`` / ``export-hf`` (Hugging Face checkpoints),
``make-shards`` (your own media into shards and config lines), ``memory`` (per-rank bytes of a layout,
planned on the meta device: :mod:`omni_train.memory_plan`), ``sample`` (images drawn for captions from a
run's checkpoint: :mod:`omni_train.generate`).

Configuration errors are reported before any process starts, naming the field, with exit status 2.
``run`` takes an override for every config field (``--parallel.pp 1 --optim.lr 1e-3``, see
:func:`omni_train.binder.apply_overrides`); ``--placement``, ``--reorder``, ``--packing``, ``--max-steps``
and ``--profile`` are aliases of ``--parallel.placement``, ``--parallel.reorder``, ``--data.packing``,
``--train.steps`` and ``--train.profile_steps``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from omni_ckpt import CheckpointError
from omni_pipeline import PlacementPolicy
from omni_train.binder import (
    RESUME_MAY_CHANGE,
    config_from_dict,
    field_paths,
    load_config,
    resume_differences,
    to_toml,
)
from omni_train.config import ConfigError, DataConfig, Packing, RunConfig
from omni_train.data_files import data_root
from omni_train.hf.folder import HFFolderError
from omni_train.preflight import check_resume_layout, validate

if TYPE_CHECKING:
    from omni_train.launch import RunStopped

__all__ = ["build_parser", "main", "parse_args", "resolve_run"]


def _override_help() -> str:
    rows = [f"  --{path} ({kind})" for path, kind in field_paths()]
    return (
        "config overrides: any field of the TOML as --section.field VALUE (or =VALUE), typed and\n"
        "validated like the TOML; list items by index (--data.sources[0].urls 'shards/x-*.tar'), table\n"
        "entries by key (--data.mixture[1].weights.text 0.5), a bare bool flag is true (--train.compile):\n"
        + "\n".join(rows)
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-train", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="train a tiny multimodal LLM (default: omni-tiny, 2 processes, CPU)",
        epilog=_override_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --parallel.pp must never be read as an abbreviation of another flag
    )
    run.add_argument("--config", default="omni-tiny", help="bundled config name or TOML path")
    run.add_argument(
        "--nproc", type=int, default=None, help="worker processes (default: the config's world size)"
    )
    run.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many steps (alias of --train.steps)"
    )
    run.add_argument("--out", default=None, help="run directory (default: runs/<config>-<time>)")
    run.add_argument("--resume", action="store_true", help="continue from the last committed checkpoint")
    run.add_argument(
        "--resume-step",
        type=int,
        default=None,
        metavar="N",
        help="with --resume: continue from committed step N instead (e.g. when a newer one is damaged); "
        "newer step directories are renamed <step dir>.rolled-back-to-N and kept",
    )
    run.add_argument("--max-restarts", type=int, default=0, help="restart failed workers this many times")
    run.add_argument(
        "--placement",
        choices=[str(m) for m in PlacementPolicy],
        default=None,
        help="alias of --parallel.placement",
    )
    run.add_argument(
        "--reorder",
        choices=["on", "off"],
        default=None,
        help="grouped reordering of encoder work (alias of --parallel.reorder)",
    )
    run.add_argument(
        "--packing", choices=[str(m) for m in Packing], default=None, help="alias of --data.packing"
    )
    run.add_argument(
        "--profile",
        type=int,
        default=None,
        metavar="STEPS",
        help="record STEPS steps with torch.profiler into RUN_DIR/profile/ (alias of --train.profile_steps)",
    )
    run.add_argument("--print-config", action="store_true", help="print the resolved config (TOML) and exit")

    prep = sub.add_parser("prepare-data", help="rebuild the bundled WebDataset shards", add_help=False)
    prep.add_argument("args", nargs=argparse.REMAINDER)

    sim = sub.add_parser("simulate", help="simulate the config's pipeline on a modelled large cluster")
    sim.add_argument("--config", default=None, help="default omni-tiny (--measured: that run's config.json)")
    sim.add_argument("--gpus", type=int, default=None, help="default 1024 (a calibration: the run's pp*dp)")
    sim.add_argument("--pp", type=int, default=None, help="default 8 (a calibration: the config's)")
    sim.add_argument(
        "--microbatches", type=int, default=None, help="default 64 (a calibration: the config's)"
    )
    sim.add_argument(
        "--scale",
        default=None,
        help="model sizes to time: paper (LLaMA-12B, ViT-1B, USM-2B; default) or config",
    )
    sim.add_argument(
        "--calibration",
        default=None,
        help="run directory whose actions.jsonl fits the cost model (the config's models, measured)",
    )
    sim.add_argument(
        "--measured",
        default=None,
        help="out of sample: predict THIS run directory's recorded steps (its config.json) from the "
        "--calibration run's fit; prints predicted vs measured s/step",
    )
    sim.add_argument(
        "--skip-steps",
        type=int,
        default=None,
        help="--calibration: the first recorded steps left out of the fit (and, with --measured, the prediction) as warm-up; default 1 when more than one step is recorded",
    )
    sim.add_argument(
        "--host-cores",
        type=float,
        default=None,
        help="--calibration: the run's parallel.world_size processes share this many cores of one host (CPU runs; the step simulated again under processor sharing, each process's CPU beside its actions, from the calibration run's step records, competing too); default a core per rank",
    )
    sim.add_argument(
        "--workload",
        default=None,
        help="a workload TOML (or bundled name: paper-vlm, paper-omni) instead of the config's recipe; "
        "adds the paper's baselines (megatron_dist, optimus_static); default 512 GPUs",
    )
    sim.add_argument(
        "--encoder-ranks",
        type=int,
        default=None,
        help="--workload: megatron_dist's encoder ranks per replica",
    )
    sim.add_argument(
        "--timelines",
        action="store_true",
        help="--workload: also draw timeline-<placement>.png (matplotlib; seconds per plot at paper scale)",
    )
    sim.add_argument(
        "--offload", default=None, metavar="FAMILIES",
        help="--workload: block families whose saved activations go to host memory, comma-separated: llm, "
        "image, audio (the config's train.offload; not with --recompute, whole blocks keep nothing to offload)",
    )  # fmt: skip
    sim.add_argument(
        "--host-gbps", type=float, default=None,
        help="--workload: GB/s (1e9 bytes) per direction of a GPU's link to host memory, --offload's copies "
        "(default 25: pinned copies over PCIe Gen4 x16)",
    )  # fmt: skip
    sim.add_argument("--steps", type=int, default=1, help="steps of the recipe to simulate (mean)")
    sim.add_argument("--first-step", type=int, default=0, help="first recipe step to simulate")
    sim.add_argument("--out", default="runs/simulate")
    _layout_args(sim)
    _device_args(sim)

    tune_help = (
        "search pp (with 1, 2 or 4 virtual stages), dp, tp(+SP, async TP unless --no-async-tp), cp / ulysses, ep (MoE), llm_zero, encoder_zero, "
        "recompute (off, whole blocks, or selective: the attention or the MLP branch; --recompute), placement "
        "and, at pp > 1 under 1F1B, uneven LLM layers per stage (parallel.stage_layers; --max-splits) for a "
        "workload on N GPUs, then the reordering group across DP of the top plans (groups up to "
        "--max-reorder-group, priced over up to 16 replicas drawing their own packs); print the fastest plans "
        "that fit in memory"
    )
    tun = sub.add_parser("tune", help=tune_help, description=tune_help)
    tun.add_argument(
        "--workload", default="paper-vlm", help="a workload TOML or bundled name (paper-vlm, paper-omni)"
    )
    tun.add_argument(
        "--scale", default=None, help="paper (the default: the workload's model sizes, the paper's)"
    )
    tun.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    tun.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="packs per step (default: workload microbatches x gpus / 8)",
    )
    tun.add_argument("--top", type=int, default=5, help="plans to print")
    tun.add_argument(
        "--write-config", default=None, metavar="PATH", help="write the best plan as a trainer config (TOML)"
    )
    tun.add_argument(
        "--out", default="runs/tune", metavar="DIR",
        help="a directory, created; tune.json is written in it (default runs/tune). The config: --write-config",
    )  # fmt: skip
    tun.add_argument(
        "--max-reorder-group", type=int, default=16, metavar="N",
        help="the largest reordering group across DP searched for the top plans (1, 2, 4, ... N; 1: none; default 16)",
    )  # fmt: skip
    tun.add_argument(
        "--recompute", default="off,block,attention,mlp", metavar="FORMS",
        help="recompute forms searched, comma-separated: off, block (whole blocks), attention, mlp (that "
        "residual branch, train.recompute_modules); default all four",
    )  # fmt: skip
    tun.add_argument(
        "--no-async-tp", action="store_true",
        help="search plain Megatron SP only (default: tp > 1 plans of a dense LLM run async TP, "
        "parallel.async_tp, where preflight accepts it)",
    )  # fmt: skip
    tun.add_argument(
        "--max-splits", type=int, default=64, metavar="N",
        help="uneven layers per stage (1F1B, pp > 1): every split while a layout has at most N, else the "
        "modelled balanced ones; 0: the even split only (default 64)",
    )  # fmt: skip
    _device_args(tun)

    mem = sub.add_parser(
        "memory",
        help="per-rank bytes of a layout (parameters, gradients, optimizer state, activations), built on "
        "the meta device: no allocation",
        epilog="Layout overrides as for run: --parallel.pp 8 --parallel.tp 4 ... (parallel.dp = what --gpus leaves)",
        allow_abbrev=False,
    )
    mem.add_argument("--config", default="omni-tiny", help="bundled config name or TOML path")
    mem.add_argument("--gpus", type=int, required=True, help="world size (ranks)")
    mem.add_argument("--json", default=None, metavar="PATH", help="also write the plan as JSON here")
    mem.add_argument("--scale", default=None, help="paper: LLaMA-12B + ViT-1B + USM-2B at 16K packs")
    mem.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="GB (1e9 bytes) per GPU for the fits / OOM verdict of the step peak (default: 80 and 141)",
    )

    imp = sub.add_parser(
        "import-hf", help="write step 0 of a run from Hugging Face folders (then: run --resume --out RUN_DIR)"
    )
    imp.add_argument(
        "dirs",
        nargs="+",
        metavar="DIR",
        help="Llama/Qwen2, Qwen2-VL vision or Whisper folders, or export-hf's OUT",
    )
    imp.add_argument(
        "--config", default="omni-tiny", help="bundled config name or TOML path (must match DIR)"
    )
    imp.add_argument("--out", default=None, help="run directory (default: runs/<config>-hf-<time>)")

    exp = sub.add_parser("export-hf", help="write Hugging Face folders (llm/, vision/, audio/) from a run")
    exp.add_argument("run_dir", metavar="RUN_DIR")
    exp.add_argument("out", metavar="OUT")
    exp.add_argument("--step", type=int, default=None, help="committed step to export (default: the latest)")
    exp.add_argument(
        "--max-shard-bytes", type=int, default=5 << 30, help="split weights into indexed shards above this"
    )

    smp = sub.add_parser(
        "sample", help="draw images for captions from a run's checkpoint: RUN/samples/step-N-sample.png"
    )
    smp.add_argument("--run", required=True, metavar="DIR", help="the run directory")
    smp.add_argument("--step", type=int, default=None, help="committed step (default: the latest)")
    smp.add_argument(
        "--out",
        default=None,
        metavar="PNG",
        help="default: DIR/samples/step-N-sample.png (the run's own samples/step-N.png is left alone)",
    )
    smp.add_argument(
        "--caption", action="append", default=[], help="a caption to draw for (repeatable; default: "
        "the first --rows samples of the run's generation source, with their real images)"
    )  # fmt: skip
    smp.add_argument("--rows", type=int, default=4, help="captions taken from the source (default 4)")
    smp.add_argument("--per-caption", type=int, default=2, help="images per caption (default 2)")
    smp.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1.0)")
    smp.add_argument("--top-k", type=int, default=0, help="draw among the k likeliest codes (0: all)")
    smp.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")

    shards = sub.add_parser(
        "make-shards",
        help="turn a folder of images/videos/audio with .txt captions or transcripts into shards",
    )
    shards.add_argument("input", nargs="?", help="folder of media files with same-named .txt (and .json)")
    shards.add_argument("out", help="output folder for {image,audio,text,video}-NNNNNN.tar and manifest.json")
    shards.add_argument(
        "--manifest", help="CSV or JSONL instead of a folder: path, text (caption/transcript), key"
    )
    shards.add_argument("--per-shard", type=int, default=1000, help="samples per shard (default 1000)")
    shards.add_argument(
        "--max-image-pixels",
        type=int,
        default=DataConfig.max_image_pixels,
        help="skip images declaring more pixels (width x height) than this, undecoded: decompression "
        f"bombs (default {DataConfig.max_image_pixels})",
    )
    shards.add_argument(
        "--write-config",
        metavar="TOML",
        help="also write a run config there: the default model, these shards",
    )
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse a command line; ``run``'s ``--section.field VALUE`` overrides land in ``args.overrides`` as
    ``(field, value)`` pairs (``value`` None for a bare ``--train.compile``).

    Exits (status 2, argparse's message) on an argument that is neither a flag nor a field override.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.overrides = []
    if extra and args.command not in ("run", "memory"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    i = 0
    while i < len(extra):
        token = extra[i]
        if not token.startswith("--") or len(token) < 3:
            parser.error(f"run: unexpected argument {token!r} (overrides are --section.field VALUE)")
        key, eq, value = token[2:].partition("=")
        if eq:
            args.overrides.append((key, value))
            i += 1
        elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            args.overrides.append((key, extra[i + 1]))
            i += 2
        else:
            args.overrides.append((key, None))
            i += 1
    return args


def _aliases(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """The short flags as the field overrides they stand for (applied before the dotted ones)."""
    out: list[tuple[str, str | None]] = []
    if args.placement is not None:
        out.append(("parallel.placement", args.placement))
    if args.reorder is not None:
        out.append(("parallel.reorder", args.reorder))
    if args.packing is not None:
        out.append(("data.packing", args.packing))
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise ConfigError(f"--max-steps: must be >= 1, got {args.max_steps}")
        out.append(("train.steps", str(args.max_steps)))
    if getattr(args, "profile", None) is not None:
        if args.profile < 0:
            raise ConfigError(f"--profile: must be >= 0 steps, got {args.profile}")
        out.append(("train.profile_steps", str(args.profile)))
    return out


def committed_steps(out: Path, url: str = "") -> list[int]:
    """Committed checkpoint steps of the run directory ``out``, or of ``url`` (``checkpoint.url``, e.g.
    ``s3://...``) when given (oldest first; read without processes)."""
    from omni_ckpt import CheckpointManager

    if not url and not (out / "checkpoints").is_dir():
        return []
    return CheckpointManager(url or str(out / "checkpoints"), keep_last=None, async_save=False).steps()


def _check_resume(cfg: RunConfig, out: Path) -> None:
    """``--resume`` into ``out``: its saved ``config.json`` must agree with ``cfg`` in every field a resume
    cannot change (:data:`omni_train.binder.RESUME_MAY_CHANGE`).

    Raises:
        ConfigError: naming each differing field, an unreadable ``config.json``, or a layout change whose
            loader state cannot be carried over (:func:`omni_train.preflight.check_resume_layout`).
    """
    path = out / "config.json"
    if not path.is_file():
        print(f"omni-train: {path} is missing; the config cannot be checked against the run", file=sys.stderr)
        return
    try:
        saved = config_from_dict(json.loads(path.read_text()))
    except (ValueError, ConfigError) as exc:
        raise ConfigError(f"--resume: {path} is not a run config ({exc})") from None
    steps = committed_steps(out, cfg.checkpoint.url)
    weights_only = bool(steps) and steps[-1] == 0
    diffs = resume_differences(saved, cfg, weights_only=weights_only)
    if diffs:
        may = ", ".join(f if "." in f else f + ".*" for f in RESUME_MAY_CHANGE if f != "name")
        allowed = "anything but model.* from a weights-only step 0" if weights_only else f"only: {may}"
        raise ConfigError(
            f"--resume: the config differs from the run's {path} in fields a resume cannot change: "
            + "; ".join(diffs)
            + f" (a resume may change {allowed})"
        )
    if steps and steps[-1] > 0:  # the loader state is carried over (omni_train.checkpointing)
        check_resume_layout(saved, cfg)


def _refuse_file(out: Path, flag: str, what: str) -> None:
    """Raise :class:`ConfigError` if ``out`` or a folder above it is a file (``mkdir`` would fail there)."""
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"{flag}: {blocker} is a file, not a directory; name {what}")


def resolve_run(args: argparse.Namespace) -> tuple[RunConfig, int, Path]:
    """Apply the command-line overrides to the config and validate it.

    Returns:
        ``(config, nproc, out_dir)``.

    Raises:
        ConfigError: an invalid config or override (names the field), ``--out`` naming a file,
            ``--resume`` with nothing to resume or with a config the run cannot continue under (the
            differing fields named), a run directory that already holds checkpoints without ``--resume``,
            or ``--resume-step`` without ``--resume`` or naming a step that is not committed.
    """
    if args.resume_step is not None and not args.resume:
        raise ConfigError("--resume-step: needs --resume")
    cfg = load_config(args.config, _aliases(args) + list(getattr(args, "overrides", [])))
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts: must be >= 0, got {args.max_restarts}")
    if args.nproc is not None:
        nproc = args.nproc
        if nproc < 1:
            raise ConfigError(f"--nproc: must be >= 1, got {nproc}")
    elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        nproc = int(os.environ["WORLD_SIZE"])  # under torchrun the world is already decided
    else:
        nproc = cfg.parallel.world_size  # a size below 1 is named by validate (parallel.pp, ...)
    validate(cfg, nproc)
    if args.out is not None:
        out = Path(args.out)
    elif args.resume:
        runs = sorted(Path("runs").glob(f"{cfg.name}-*"))
        if not runs:
            raise ConfigError(f"--resume: no run directory runs/{cfg.name}-* to resume; pass --out")
        out = runs[-1]
    elif "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:
        # under torchrun every rank resolves this on its own: the name must not depend on the clock
        out = Path("runs") / f"{cfg.name}-{os.environ['TORCHELASTIC_RUN_ID']}"
    else:
        out = Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    _refuse_file(out, "--out", "a run directory")
    if not getattr(args, "print_config", False):
        # a running run's lock speaks before its checkpoints do below (omni_train.run_lock)
        from omni_train.launch import under_torchrun
        from omni_train.run_lock import refuse_if_locked, torchrun_job

        refuse_if_locked(out, torchrun_job() if under_torchrun() else None)
    if args.resume and not cfg.checkpoint.url and not (out / "checkpoints").is_dir():
        raise ConfigError(f"--resume: {out} holds no checkpoints directory")
    # A worker that torchrun restarted resumes (see worker.worker_main); anything else must not train
    # into a run directory whose checkpoints it would collide with at its first save.
    from omni_train.launch import restart_count

    restarted = restart_count() > 0
    old = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    if cfg.checkpoint.url:  # an object store holds the steps: the committed ones are what counts
        old = [f"step-{s:08d}" for s in committed_steps(out, cfg.checkpoint.url)]
    if old and not (args.resume or restarted):
        raise ConfigError(
            f"--out: {out} already holds checkpoints ({old[-1]}); pass --resume to continue that run, "
            "or another --out"
        )
    # a restarted worker resumes from the newest step, not from --resume-step (worker.worker_main): its
    # first attempt already went back to it, and pruning may have deleted it since
    if args.resume_step is not None and not restarted:
        steps = committed_steps(out, cfg.checkpoint.url)
        if args.resume_step not in steps:
            raise ConfigError(
                f"--resume-step: {args.resume_step} is not a committed step of {out / 'checkpoints'} "
                f"(committed: {', '.join(map(str, steps)) or 'none'})"
            )
    if args.resume:
        _check_resume(cfg, out)
    return cfg, nproc, out


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _run(args: argparse.Namespace) -> int:
    from omni_train.launch import restart_count, under_torchrun
    from omni_train.run_lock import acquire_run_lock, torchrun_job

    cfg, nproc, out = resolve_run(args)
    if args.print_config:
        print(
            f"# omni-train run --print-config: {cfg.source}, overrides applied, valid for {nproc} processes"
        )
        print(
            f"# relative data.sources urls resolve against {data_root(cfg)} (make them absolute in a copy saved elsewhere)"
        )
        print(to_toml(cfg), end="")
        return 0
    if args.resume:
        # --resume-step was checked against the committed steps already (resolve_run)
        given = args.resume_step is not None and restart_count() == 0
        steps = [args.resume_step] if given else committed_steps(out, cfg.checkpoint.url)
        if steps and steps[-1] >= cfg.train.steps:
            if _rank0():
                print(
                    f"omni-train: {out} already finished: step {steps[-1]} of train.steps = "
                    f"{cfg.train.steps}; nothing to train (pass --max-steps N with N > {steps[-1]} to "
                    "train further)",
                    file=sys.stderr,
                )
            return 0
        if steps:
            from omni_ckpt import CheckpointManager, read_manifest
            from omni_train.checkpointing import with_older_steps

            # the step to resume proves itself (dtypes, shapes, boxes, file sizes) before any worker
            # starts: a refused checkpoint is then one line and exit 2, not a worker's traceback
            mgr = CheckpointManager(
                cfg.checkpoint.url or str(out / "checkpoints"), keep_last=None, async_save=False
            )
            try:
                read_manifest(mgr.step_url(steps[-1]))
            except CheckpointError as exc:
                if len(steps) < 2:
                    raise
                # the same way out as the workers' own restore (TrainCheckpoint.restore) offers
                raise with_older_steps(exc, steps[:-1]) from exc
    # the run directory's lock, taken before any worker starts (omni_train.run_lock: who holds it under
    # torchrun) and given back however the run ends
    with acquire_run_lock(out, job=torchrun_job() if under_torchrun() else None):
        return _train(args, cfg, nproc, out)


def _train(args: argparse.Namespace, cfg: RunConfig, nproc: int, out: Path) -> int:
    """Train into the locked run directory ``out``: inline under torchrun, else on launched workers."""
    from omni_train.launch import ChildFailedError, RunStopped, launch, under_torchrun
    from omni_train.worker import worker_main

    if under_torchrun():
        if _rank0():
            print(f"omni-train: {cfg.name} on {nproc} processes (torchrun) -> {out}", file=sys.stderr)
        worker_main(cfg, str(out), args.resume, args.resume_step)
        if _rank0():
            print(f"omni-train: done; outputs in {out}", file=sys.stderr)
        return 0
    print(f"omni-train: {cfg.name} on {nproc} processes -> {out}", file=sys.stderr)
    try:
        launch(
            worker_main,
            cfg,
            str(out),
            args.resume,
            args.resume_step,
            nproc=nproc,
            max_restarts=args.max_restarts,
            grace_s=cfg.train.preempt_grace_s,
            resume_hint=f"resume from the last committed checkpoint with: {_resume_command(args, out)}",
        )
    except RunStopped as exc:
        # after a hang the workers were killed mid-step: rank 0's progress bar has no newline yet
        print(f"{chr(10) if exc.hang else ''}omni-train: {_stopped_line(exc, args, out)}", file=sys.stderr)
        return exc.exit_code
    except ChildFailedError as exc:
        print(f"omni-train: training failed:\n{exc.format_msg()}", file=sys.stderr)
        return 1
    print(f"omni-train: done; outputs in {out}", file=sys.stderr)
    return 0


def _resume_command(args: argparse.Namespace, out: Path) -> str:
    """This run's command line (config, process count, overrides) with ``--out`` and ``--resume``."""
    words = ["omni-train", "run", "--config", args.config, "--out", str(out)]
    if args.nproc is not None:
        words += ["--nproc", str(args.nproc)]
    for key, value in _aliases(args) + list(getattr(args, "overrides", [])):
        words += [f"--{key}"] + ([] if value is None else [value])
    return shlex.join([*words, "--resume"])


def _stopped_line(exc: RunStopped, args: argparse.Namespace, out: Path) -> str:
    """The one line that says why the workers stopped and, after a signal, how to resume."""
    if exc.hang is not None:
        return exc.hang
    resume = _resume_command(args, out)
    if exc.report is not None:
        n = exc.report.step
        return f"stopped by {exc.signal} at step {n}; checkpoint {n} committed; resume with: {resume}"
    steps = committed_steps(out)
    last = f"step {steps[-1]}" if steps else "none yet"
    return (
        f"stopped by {exc.signal}; the workers committed no checkpoint within train.preempt_grace_s = "
        f"{exc.grace_s:g} s (the last committed: {last}); resume with: {resume}"
    )


def _layout_args(p: argparse.ArgumentParser) -> None:
    """``simulate --workload``'s layout of the whole step (omni_pipeline.step_model.Layout)."""
    p.add_argument("--tp", type=int, default=1, help="--workload: tensor-parallel size")
    p.add_argument("--sequence-parallel", action="store_true", help="--workload: Megatron SP (tp > 1)")
    p.add_argument(
        "--async-tp", action="store_true",
        help="--workload: async TP (with --sequence-parallel): each SP ring overlapped with the projection "
        "matmuls, only its exposed part priced (parallel.async_tp)",
    )  # fmt: skip
    p.add_argument("--cp", type=int, default=1, help="--workload: context-parallel size")
    p.add_argument("--cp-attention", default="allgather", choices=("allgather", "ring"))
    p.add_argument("--ulysses", type=int, default=1, help="--workload: Ulysses size")
    p.add_argument("--ep", type=int, default=1, help="--workload: expert-parallel size (an MoE workload)")
    p.add_argument("--llm-zero", type=int, default=0, help="--workload: LLM ZeRO stage 0-3")
    p.add_argument("--encoder-zero", type=int, default=0, help="--workload: encoder ZeRO stage 0, 2, 3")
    p.add_argument("--recompute", action="store_true", help="--workload: recompute every block")
    p.add_argument(
        "--placement", default="uniform_on_demand", help="--workload: the placement whose time is broken down"
    )
    p.add_argument(
        "--reorder-group", type=int, default=1, help="--workload: DP replicas of the reordering all-to-all"
    )
    p.add_argument(
        "--analytic-memory",
        action="store_true",
        help="--workload: analytic state, not omni-train memory's build",
    )


def _device_args(p: argparse.ArgumentParser) -> None:
    """The modelled device and two-tier network (omni_pipeline.step_model.Device, omni_pipeline.Network)."""
    p.add_argument(
        "--device-memory-gb", type=float, default=80.0, help="GB (1e9 bytes) per GPU (default 80: H100)"
    )
    p.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense TFLOP/s per GPU (default 989: H100 bf16)"
    )
    p.add_argument(
        "--efficiency", type=float, default=0.4, help="share of peak the kernels sustain (default 0.4)"
    )
    p.add_argument("--hbm-tbps", type=float, default=3.35, help="HBM TB/s (the optimizer step; default 3.35)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-gbps", type=float, default=450.0, help="GB/s per GPU inside a node (NVLink)")
    p.add_argument("--intra-latency-us", type=float, default=5.0)
    p.add_argument("--inter-gbps", type=float, default=50.0, help="GB/s per GPU between nodes (NIC)")
    p.add_argument("--inter-latency-us", type=float, default=20.0)


def _device_network(args: argparse.Namespace):
    from omni_pipeline.cost import Network
    from omni_pipeline.step_model import Device

    try:
        device = Device(
            args.device_memory_gb * 1e9, args.peak_tflops * 1e12, args.efficiency, args.hbm_tbps * 1e12
        )
        network = Network(args.gpus_per_node, args.intra_gbps * 1e9, args.intra_latency_us * 1e-6,
                          args.inter_gbps * 1e9, args.inter_latency_us * 1e-6)  # fmt: skip
    except ValueError as exc:
        raise ConfigError(f"--device-memory-gb / --peak-tflops / --*-gbps: {exc}") from None
    return device, network


def _offload_args(args: argparse.Namespace, device):
    """``simulate --workload``'s ``--offload`` (``Layout.offload``, as the config's ``train.offload``) and
    ``--host-gbps`` (``Device.host_Bps``): the device with its host link, and the families.

    Raises:
        ConfigError: an unknown or repeated family, offload with ``--recompute`` (whole blocks), or a
            host link not > 0 GB/s (one line naming the flag).
    """
    from omni_train.config import OFFLOAD

    if args.host_gbps is not None:
        if not (math.isfinite(args.host_gbps) and args.host_gbps > 0):
            raise ConfigError(f"--host-gbps: must be a finite number of GB/s > 0, got {args.host_gbps:g}")
        device = dataclasses.replace(device, host_Bps=args.host_gbps * 1e9)
    if args.offload is None:
        return device, ()
    names = [f.strip() for f in args.offload.split(",") if f.strip()]
    bad = [f for f in names if f not in OFFLOAD]
    if not names or bad or len(set(names)) != len(names):
        why = f"unknown {', '.join(map(repr, bad))}" if bad else "none or a repeated one"
        raise ConfigError(
            f"--offload: name distinct block families of {', '.join(OFFLOAD)}, comma-separated; got "
            f"{args.offload!r} ({why})"
        )
    if args.recompute:
        raise ConfigError(
            "--offload: with --recompute every block recomputes whole and keeps nothing to offload "
            "(the trainer's train.offload / train.recompute rule); drop one"
        )
    return device, tuple(names)


def _tune(args: argparse.Namespace) -> int:
    from omni_train.simulate import resolve_workload, tune_workload

    if args.scale not in (None, "paper"):
        raise ConfigError(f"--scale: tune times the workload's model sizes (paper), got {args.scale!r}")
    device, network = _device_network(args)
    print(
        tune_workload(
            resolve_workload(args.workload), args.gpus, device=device, network=network,
            global_batch=args.global_batch, top=args.top, out_dir=Path(args.out),
            write_config=Path(args.write_config) if args.write_config else None,
            max_reorder_group=args.max_reorder_group, max_splits=args.max_splits,
            recompute=[f.strip() for f in args.recompute.split(",") if f.strip()],
            async_tp=not args.no_async_tp,
        )
    )  # fmt: skip
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from omni_train.simulate import resolve_workload, simulate_config, simulate_workload

    if args.workload is not None:
        if args.scale is not None or args.calibration is not None or args.measured is not None:
            raise ConfigError(
                "--workload: the workload gives the model sizes; drop --scale, --calibration and --measured"
            )
        from omni_pipeline.step_model import Layout

        device, network = _device_network(args)
        device, offload = _offload_args(args, device)
        pp = 8 if args.pp is None else args.pp
        gpus = 512 if args.gpus is None else args.gpus
        mp = max(1, pp * args.tp * args.cp * args.ulysses)
        try:
            layout = Layout(
                pp=pp, dp=max(1, gpus // mp), tp=args.tp, sequence_parallel=args.sequence_parallel,
                async_tp=args.async_tp, cp=args.cp,
                cp_attention=args.cp_attention, ulysses=args.ulysses, llm_zero=args.llm_zero,
                encoder_zero=args.encoder_zero, recompute=args.recompute, placement=args.placement,
                reorder_group=args.reorder_group, ep=args.ep, offload=offload,
            )  # fmt: skip
        except ValueError as exc:
            raise ConfigError(
                f"--tp / --sequence-parallel / --async-tp / --cp / --ulysses / --ep / --llm-zero / --placement: {exc}"
            ) from None
        table = simulate_workload(
            resolve_workload(args.workload),
            gpus=512 if args.gpus is None else args.gpus,
            pp=8 if args.pp is None else args.pp,
            microbatches=args.microbatches,
            out_dir=Path(args.out),
            steps=args.steps,
            first_step=args.first_step,
            encoder_ranks=args.encoder_ranks,
            plots=args.timelines,
            layout=layout,
            device=device,
            network=network,
            exact_memory=not args.analytic_memory,
        )
        print(table)
        return 0
    if args.offload is not None or args.host_gbps is not None:
        raise ConfigError(
            "--offload / --host-gbps: they set the whole-step model of --workload; the config's recipe "
            "times its pipeline only (no offload copies): add --workload"
        )
    layout_only = argparse.ArgumentParser(add_help=False)
    _layout_args(layout_only)
    given = [
        "--" + k.replace("_", "-")
        for k, v in vars(layout_only.parse_args([])).items()
        if getattr(args, k) != v
    ]
    if given:
        raise ConfigError(
            f"{' / '.join(given)}: layout flags of the whole-step model of --workload; the config's recipe "
            "takes its layout from [parallel] (--parallel.tp ...): add --workload"
        )
    measured = Path(args.measured) if args.measured else None
    if measured is not None:
        if args.config is not None:
            raise ConfigError("--measured: the config is the measured run's config.json; drop --config")
        from omni_train.binder import config_from_dict

        try:
            cfg = config_from_dict(json.loads((measured / "config.json").read_text()))
        except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise ConfigError(
                f"--measured: {measured / 'config.json'}: no readable run config ({exc})"
            ) from None
    else:
        cfg = load_config(args.config or "omni-tiny")
    table = simulate_config(
        cfg,
        gpus=args.gpus,
        pp=args.pp,
        microbatches=args.microbatches,
        out_dir=Path(args.out),
        scale=args.scale,
        calibration=Path(args.calibration) if args.calibration else None,
        steps=args.steps,
        first_step=args.first_step,
        measured=measured,
        skip_steps=args.skip_steps,
        host_cores=args.host_cores,
    )
    print(table)
    return 0


def _memory(args: argparse.Namespace) -> int:
    from omni_train.memory_plan import format_plan, memory_plan

    out = Path(args.json) if args.json else None
    if out is not None:  # checked before the plan is built: a bad path fails in one line, at once
        if out.is_dir():
            raise ConfigError(f"--json: {out} is a directory; name a file for the plan")
        if not out.parent.is_dir():
            raise ConfigError(f"--json: {out.parent} is not a directory; create it or name a file in one")
    if args.device_memory_gb is not None and not args.device_memory_gb > 0:
        raise ConfigError(f"--device-memory-gb: must be > 0, got {args.device_memory_gb}")
    plan = memory_plan(load_config(args.config, args.overrides), args.gpus, scale=args.scale)
    print(format_plan(plan, args.device_memory_gb))
    if args.scale == "paper" and not any(k.startswith("parallel.") for k, _ in args.overrides):
        print(
            "omni-train memory: no --parallel.* flags: the config's layout was used (pp "
            f"{plan['layout']['pp']}); the README's paper layout is --parallel.pp 8 --parallel.tp 4 "
            "--parallel.cp 2",
            file=sys.stderr,
        )
    if out is not None:
        try:
            out.write_text(json.dumps(plan, indent=2))
        except OSError as exc:
            raise ConfigError(f"--json: cannot write {out}: {exc.strerror or exc}") from None
    return 0


def _import_hf(args: argparse.Namespace) -> int:
    from omni_train.hf.convert import import_hf

    cfg = load_config(args.config)
    validate(cfg, cfg.parallel.world_size)
    out = Path(args.out) if args.out else Path("runs") / f"{cfg.name}-hf-{time.strftime('%Y%m%d-%H%M%S')}"
    _refuse_file(out, "--out", "a run directory")
    report = import_hf(args.dirs, cfg, out)
    for family, folder in report.folders.items():
        ignored = report.ignored.get(family, [])
        note = f" ({len(ignored)} of its tensors unused: {', '.join(ignored[:3])}{', ...' if len(ignored) > 3 else ''})"
        print(f"omni-train: {family} <- {folder}{note if ignored else ''}", file=sys.stderr)
    if report.untied:
        print(
            "omni-train: the LLM folder ties lm_head to the embedding; the LM head starts as a copy",
            file=sys.stderr,
        )
    if report.kept_init:
        print(f"omni-train: seeded initialisation kept for {len(report.kept_init)} modules "
              f"({', '.join(report.kept_init[:4])}{', ...' if len(report.kept_init) > 4 else ''})", file=sys.stderr)  # fmt: skip
    print(f"omni-train: wrote {report.checkpoint}; train with: omni-train run --config {args.config} "
          f"--out {out} --resume", file=sys.stderr)  # fmt: skip
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from omni_train.hf.convert import export_hf

    _refuse_file(Path(args.out), "export-hf OUT", "a folder for the Hugging Face folders")
    report = export_hf(args.run_dir, args.out, step=args.step, max_shard_bytes=args.max_shard_bytes)
    for family, folder in report.folders.items():
        print(f"omni-train: step {report.step} {family} -> {folder}", file=sys.stderr)
    for family, reasons in report.skipped.items():
        print(f"omni-train: {family} not exported: {'; '.join(reasons)}", file=sys.stderr)
    if report.not_exported:
        print(f"omni-train: {len(report.not_exported)} tensors have no Hugging Face counterpart and were not "
              f"exported ({', '.join(report.not_exported[:3])}, ...)", file=sys.stderr)  # fmt: skip
    return 0


def _sample(args: argparse.Namespace) -> int:
    import torch

    from omni_train.generate import SampleSettings, sample_run
    from omni_train.models.image_tokenizer import ImageTokenizerFileError

    if args.rows < 1:
        raise ConfigError(f"--rows: must be >= 1, got {args.rows}")
    try:
        settings = SampleSettings(args.temperature, args.top_k, args.seed, args.per_caption)
    except ValueError as exc:
        raise ConfigError(f"sample: {exc}") from None
    if args.out is not None:
        _refuse_file(Path(args.out).parent, "sample --out", "a PNG file in a folder")
    # one intra-op thread, as a training rank: the same draws as the run's own samples/step-N.png, and
    # these small matmuls ran 25x slower on 2 threads of a loaded 2-core machine (53 s vs 2 s a grid)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = sample_run(
            args.run, step=args.step, out=args.out, captions=args.caption, rows=args.rows, settings=settings
        )
    except ImageTokenizerFileError as exc:
        raise ConfigError(f"[model.image_tokenizer]: {exc}") from None
    finally:
        torch.set_num_threads(threads)  # as it was (main() may be called in a longer-lived process)
    print(f"omni-train: wrote {path}", file=sys.stderr)
    return 0


def _make_shards(args: argparse.Namespace) -> int:
    from omni_data.write import write_dataset_args
    from omni_train.make_shards import data_toml, write_run_config

    if args.input is None and args.manifest is None:
        raise ConfigError("make-shards: give an input folder or --manifest FILE")
    try:
        report = write_dataset_args(args)
    except ValueError as exc:
        raise ConfigError(f"make-shards: {exc}") from None
    for modality, urls in report.shards.items():
        print(
            f"omni-train: {modality}: {report.samples[modality]} samples in {len(urls)} shards",
            file=sys.stderr,
        )
    for line in report.summary():
        print(f"omni-train: {line}", file=sys.stderr)
    config = Path(args.write_config) if args.write_config else None
    lines = data_toml(report, args.out, config_dir=config.parent if config else None)
    if config is not None:
        write_run_config(config, lines)
        written = load_config(str(config))
        validate(written, written.parallel.world_size)
        print(f"omni-train: wrote {config}; train with: omni-train run --config {config}", file=sys.stderr)
    else:
        print(
            "omni-train: paste into your config (relative urls resolve against its folder):", file=sys.stderr
        )
    print(lines)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``omni-train`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "prepare-data":
        from omni_train.prepare import main as prepare_main

        return int(prepare_main(argv[1:]) or 0)
    args = parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "simulate":
            return _simulate(args)
        if args.command == "memory":
            return _memory(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "import-hf":
            return _import_hf(args)
        if args.command == "export-hf":
            return _export_hf(args)
        if args.command == "make-shards":
            return _make_shards(args)
        if args.command == "sample":
            return _sample(args)
    except ConfigError as exc:
        print(f"omni-train: configuration error: {exc}", file=sys.stderr)
        return 2
    except HFFolderError as exc:
        print(f"omni-train: Hugging Face folder error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print("omni-train: error: " + " ".join(str(exc).split("\n")), file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
