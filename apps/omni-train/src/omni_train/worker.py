"""The entry point of one worker process: stop signals, the process group, then the trainer's run.

Started by the elastic launcher (:func:`omni_train.launch.launch`) or ``torchrun`` (the CLI then calls it
inline). It sits above both the trainer and the launcher: the launcher takes it as an argument, and the
trainer only reads the restart count and the report folder from :mod:`omni_train.launch`.
"""

from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from omni_parallel.numerics import NonFiniteError
from omni_parallel.preemption import PreemptionSpec, StopSignal
from omni_train.config import RunConfig
from omni_train.launch import NUMERICS_EXIT_CODE, StopReport, report_dir, restart_count
from omni_train.trainer import Trainer

__all__ = ["worker_main"]


def worker_main(cfg: RunConfig, out_dir: str, resume: bool, resume_step: int | None = None) -> dict[str, Any]:
    """Entry point of one worker process (started by the elastic launcher or ``torchrun``).

    A worker restarted by the elastic agent (``TORCHELASTIC_RESTART_COUNT > 0``) resumes from the last
    committed checkpoint (not from ``resume_step`` again: the first attempt already went back to it, and
    the steps it saved since must not be set aside).

    ``SIGTERM`` / ``SIGINT`` are recorded from the start (:class:`omni_parallel.preemption.StopSignal`):
    the ranks stop together after a step with a checkpoint (:meth:`omni_train.trainer.Trainer.run`), and
    rank 0 reports it: to the launcher's report folder (:class:`omni_train.launch.StopReport`), or on
    stderr under ``torchrun``. Every collective waits at most ``train.collective_timeout_s``.
    """
    torch.set_num_threads(1)
    # before the process group: a signal during start-up must not kill the process half-initialised
    stop = (
        StopSignal(PreemptionSpec()).install()
        if threading.current_thread() is threading.main_thread()
        else None
    )
    restarted = restart_count() > 0
    timeout = timedelta(seconds=cfg.train.collective_timeout_s)
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            # NCCL for the CUDA tensors (activations, gradients); the trainer's and loaders' bookkeeping
            # collectives (metrics, target counts, loader state) are on CPU tensors and need gloo.
            dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    try:
        step = None if restarted else resume_step
        trainer = Trainer(cfg, Path(out_dir), resume=resume or restarted, resume_step=step, stop=stop)
        try:
            summary = trainer.run()
        except NonFiniteError as exc:  # every rank reaches the same verdict: one line, no traceback
            _report_numerics(str(exc))
            raise SystemExit(NUMERICS_EXIT_CODE) from None
        if trainer.stopped is not None and dist.get_rank() == 0:
            _report_stop(trainer.stopped, Path(out_dir))
        return summary
    finally:
        dist.destroy_process_group()
        if stop is not None:
            stop.uninstall()


def _report_numerics(line: str) -> None:
    """Every rank writes the guard's line (the verdict is the same on all): whichever exits first, the
    launcher finds it; written whole and renamed, so a reader never sees half of it."""
    folder = report_dir()
    if folder is None:
        if dist.get_rank() == 0:
            print(f"omni-train: {line}", file=sys.stderr)
        return
    tmp = folder / f"numerics.{dist.get_rank()}.tmp"
    tmp.write_text(line + "\n")
    tmp.replace(folder / "numerics")


def _report_stop(report: StopReport, out: Path) -> None:
    folder = report_dir()
    if folder is not None:
        report.write(folder)  # the launcher says it, with the command to resume
        return
    print(
        f"omni-train: stopped by {report.signal} at step {report.step}; checkpoint {report.step} committed; "
        f"resume with the same command and --resume --out {out}",
        file=sys.stderr,
    )
