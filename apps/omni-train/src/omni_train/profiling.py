"""``--profile STEPS`` (``train.profile_steps``): a ``torch.profiler`` trace of a few training steps.

Each rank records CPU activity (and CUDA kernels when its device is a GPU) for ``STEPS`` steps and writes
one Chrome trace, ``<run>/profile/rank-<r>.json`` (open it in Perfetto or ``chrome://tracing``). The
first step this process runs is a warm-up the trace leaves out (allocator, caches, ``torch.compile``) when
the run has steps to spare. Steps are marked ``ProfilerStep#N``; the trainer's phases are named
``omni_train.*`` (:data:`PHASES`), next to torch's own ``aten::`` ops, autograd nodes and
``Optimizer.step``. Source: the PyTorch profiler recipe (``torch.profiler.schedule``,
``export_chrome_trace``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

__all__ = ["PHASES", "StepProfiler", "trace_path"]

# The trainer's named regions in a trace (torch.profiler.record_function labels).
PHASES = ("omni_train.load_step", "omni_train.reduce_gradients", "omni_train.clip_grad_norm")


def trace_path(out_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its trace: ``<out_dir>/profile/rank-<rank>.json``."""
    return Path(out_dir) / "profile" / f"rank-{rank}.json"


class StepProfiler:
    """Profile ``steps`` training steps of one rank; a no-op when ``steps`` is 0.

    Call :meth:`start` before the loop, :meth:`step` after every step and :meth:`stop` after the loop
    (which writes the trace if the run ended inside the recorded window).

    Args:
        out_dir: the run directory.
        rank: this process's global rank (names the file).
        steps: steps to record (>= 0).
        first_step, total_steps: the loop's range on this process (a resumed run starts later).
        device: the rank's device; CUDA activity is recorded on a CUDA device.

    Raises:
        ValueError: ``steps < 0``.
    """

    def __init__(
        self,
        out_dir: str | Path,
        rank: int,
        steps: int,
        *,
        first_step: int,
        total_steps: int,
        device: torch.device,
    ) -> None:
        if steps < 0:
            raise ValueError(f"profile steps must be >= 0, got {steps}")
        self.path = trace_path(out_dir, rank)
        remaining = max(0, total_steps - first_step)
        warmup = 1 if remaining > steps else 0
        active = min(steps, remaining - warmup)
        self._prof: profile | None = None
        if active < 1:
            return
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._write,
        )

    def _write(self, prof: profile) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))

    def start(self) -> StepProfiler:
        if self._prof is not None:
            with warnings.catch_warnings():
                # torch warns that a schedule without warm-up may skew results: a run too short to spare
                # a warm-up step is still traced, as asked.
                warnings.filterwarnings("ignore", message=".*warmup.*")
                self._prof.start()
        return self

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def stop(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
