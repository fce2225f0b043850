"""The entry point of one worker process: the process group, then the trainer's run.

Started by the elastic launcher (:func:`omni_train.launch.launch`) or ``torchrun`` (the CLI then calls it
inline). It sits above both the trainer and the launcher: the launcher takes it as an argument, and the
trainer only reads the restart count from :mod:`omni_train.launch`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from omni_train.config import RunConfig
from omni_train.launch import restart_count
from omni_train.trainer import Trainer

__all__ = ["worker_main"]


def worker_main(cfg: RunConfig, out_dir: str, resume: bool, resume_step: int | None = None) -> dict[str, Any]:
    """Entry point of one worker process (started by the elastic launcher or ``torchrun``).

    A worker restarted by the elastic agent (``TORCHELASTIC_RESTART_COUNT > 0``) resumes from the last
    committed checkpoint (not from ``resume_step`` again: the first attempt already went back to it, and
    the steps it saved since must not be set aside).
    """
    torch.set_num_threads(1)
    restarted = restart_count() > 0
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            # NCCL for the CUDA tensors (activations, gradients); the trainer's and loaders' bookkeeping
            # collectives (metrics, target counts, loader state) are on CPU tensors and need gloo.
            dist.init_process_group("cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group("gloo")
    try:
        step = None if restarted else resume_step
        return Trainer(cfg, Path(out_dir), resume=resume or restarted, resume_step=step).run()
    finally:
        dist.destroy_process_group()
