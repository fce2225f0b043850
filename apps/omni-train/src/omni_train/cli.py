"""``omni-train``: ``run`` (train), ``prepare-data`` (rebuild the bundled shards), ``simulate`` (model a
large cluster with the pipeline simulator), ``import-hf`` / ``export-hf`` (Hugging Face checkpoints).

Configuration errors are reported before any process starts, naming the field, with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from omni_train.config import ConfigError, Packing, Placement, RunConfig, load_config, validate
from omni_train.hf.folder import HFFolderError

__all__ = ["build_parser", "main", "resolve_run"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-train", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train a tiny multimodal LLM (default: omni-tiny, 2 processes, CPU)")
    run.add_argument("--config", default="omni-tiny", help="bundled config name or TOML path")
    run.add_argument(
        "--nproc", type=int, default=None, help="worker processes (default: the config's world size)"
    )
    run.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many steps (overrides train.steps)"
    )
    run.add_argument("--out", default=None, help="run directory (default: runs/<config>-<time>)")
    run.add_argument("--resume", action="store_true", help="continue from the last committed checkpoint")
    run.add_argument("--max-restarts", type=int, default=0, help="restart failed workers this many times")
    run.add_argument("--placement", choices=[str(m) for m in Placement], default=None)
    run.add_argument(
        "--reorder", choices=["on", "off"], default=None, help="grouped reordering of encoder work"
    )
    run.add_argument("--packing", choices=[str(m) for m in Packing], default=None)

    prep = sub.add_parser("prepare-data", help="rebuild the bundled WebDataset shards", add_help=False)
    prep.add_argument("args", nargs=argparse.REMAINDER)

    sim = sub.add_parser("simulate", help="simulate the config's pipeline on a modelled large cluster")
    sim.add_argument("--config", default="omni-tiny")
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
    sim.add_argument("--steps", type=int, default=1, help="steps of the recipe to simulate (mean)")
    sim.add_argument("--first-step", type=int, default=0, help="first recipe step to simulate")
    sim.add_argument("--out", default="runs/simulate")

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
    return p


def resolve_run(args: argparse.Namespace) -> tuple[RunConfig, int, Path]:
    """Apply the command-line overrides to the config and validate it.

    Returns:
        ``(config, nproc, out_dir)``.

    Raises:
        ConfigError: an invalid config or override (names the field), ``--resume`` with nothing to resume,
            or a run directory that already holds checkpoints without ``--resume``.
    """
    cfg = load_config(args.config)
    par = cfg.parallel
    if args.placement is not None:
        par = dataclasses.replace(par, placement=Placement(args.placement))
    if args.reorder is not None:
        par = dataclasses.replace(par, reorder=args.reorder == "on")
    cfg = dataclasses.replace(cfg, parallel=par)
    if args.packing is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, packing=Packing(args.packing)))
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise ConfigError(f"--max-steps: must be >= 1, got {args.max_steps}")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=args.max_steps))
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts: must be >= 0, got {args.max_restarts}")
    if args.nproc is not None:
        nproc = args.nproc
    elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        nproc = int(os.environ["WORLD_SIZE"])  # under torchrun the world is already decided
    else:
        nproc = cfg.parallel.world_size
    if nproc < 1:
        raise ConfigError(f"--nproc: must be >= 1, got {nproc}")
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
    if args.resume and not (out / "checkpoints").is_dir():
        raise ConfigError(f"--resume: {out} holds no checkpoints directory")
    # A worker that torchrun restarted resumes (see trainer.worker_main); anything else must not train
    # into a run directory whose checkpoints it would collide with at its first save.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    old = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    if old and not (args.resume or restarted):
        raise ConfigError(
            f"--out: {out} already holds checkpoints ({old[-1]}); pass --resume to continue that run, "
            "or another --out"
        )
    return cfg, nproc, out


def _run(args: argparse.Namespace) -> int:
    from omni_train.launch import ChildFailedError, launch, under_torchrun

    cfg, nproc, out = resolve_run(args)
    out.mkdir(parents=True, exist_ok=True)
    if under_torchrun():
        from omni_train.trainer import worker_main

        worker_main(cfg, str(out), args.resume)
        return 0
    print(f"omni-train: {cfg.name} on {nproc} processes -> {out}", file=sys.stderr)
    try:
        launch(cfg, out, nproc=nproc, resume=args.resume, max_restarts=args.max_restarts)
    except ChildFailedError as exc:
        print(f"omni-train: training failed:\n{exc.format_msg()}", file=sys.stderr)
        return 1
    print(f"omni-train: done; outputs in {out}", file=sys.stderr)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from omni_train.simulate import simulate_config

    cfg = load_config(args.config)
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
    )
    print(table)
    return 0


def _import_hf(args: argparse.Namespace) -> int:
    from omni_train.hf.convert import import_hf

    cfg = load_config(args.config)
    validate(cfg, cfg.parallel.world_size)
    out = Path(args.out) if args.out else Path("runs") / f"{cfg.name}-hf-{time.strftime('%Y%m%d-%H%M%S')}"
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

    report = export_hf(args.run_dir, args.out, step=args.step, max_shard_bytes=args.max_shard_bytes)
    for family, folder in report.folders.items():
        print(f"omni-train: step {report.step} {family} -> {folder}", file=sys.stderr)
    for family, reasons in report.skipped.items():
        print(f"omni-train: {family} not exported: {'; '.join(reasons)}", file=sys.stderr)
    if report.not_exported:
        print(f"omni-train: {len(report.not_exported)} tensors have no Hugging Face counterpart and were not "
              f"exported ({', '.join(report.not_exported[:3])}, ...)", file=sys.stderr)  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``omni-train`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "prepare-data":
        from omni_train.prepare import main as prepare_main

        return int(prepare_main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "simulate":
            return _simulate(args)
        if args.command == "import-hf":
            return _import_hf(args)
        if args.command == "export-hf":
            return _export_hf(args)
    except ConfigError as exc:
        print(f"omni-train: configuration error: {exc}", file=sys.stderr)
        return 2
    except HFFolderError as exc:
        print(f"omni-train: Hugging Face folder error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
