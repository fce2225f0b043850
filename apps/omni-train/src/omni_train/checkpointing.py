"""Checkpoints of a training run through omni-ckpt's :class:`~omni_ckpt.CheckpointManager` (async saves):
the model, the optimizer (by parameter name, so any layout reloads it), the loader state (msgpack) and
the step. A committed step ``N`` holds the state after ``N`` optimizer steps; restoring it makes the run
continue at step ``N`` exactly (the loader resumes mid-stream).

The optimizer's parameter groups are saved without their member lists: which parameters a rank holds
depends on the layout (pipeline schedule, virtual stages, pp), and a per-rank list would make every rank
load the saved layout's names. Membership is the optimizer's own (``build_optimizer`` decides it from
each parameter's shape); the saved groups give the hyperparameters, the saved state the moments by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import torch
from torch import nn

from omni_ckpt import CheckpointManager, load_optimizer_state_dict, optimizer_state_dict
from omni_data import ZeroRedundancyFilter, snapshot_async
from omni_train.config import CheckpointConfig

__all__ = ["TrainCheckpoint"]


class TrainCheckpoint:
    """Save and restore one rank's share of a run (collective: every rank calls the same methods).

    Args:
        directory: ``<run>/checkpoints``.
        cfg: ``[checkpoint]`` (every, keep_last, async_save).
        total_steps: the run's steps (the last one is always saved).
        model: every module of this rank (state dict by name).
        optimizer: its optimizer.
        stream: the loader, whose state is saved with the step.
    """

    def __init__(
        self,
        directory: Path,
        cfg: CheckpointConfig,
        total_steps: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        stream: ZeroRedundancyFilter,
    ) -> None:
        self.cfg, self.total_steps = cfg, total_steps
        self.model, self.optimizer, self.stream = model, optimizer, stream
        self.manager = CheckpointManager(str(directory), keep_last=cfg.keep_last, async_save=cfg.async_save)

    def due(self, next_step: int) -> bool:
        """Whether the state after ``next_step`` optimizer steps is saved: every ``every`` and at the end."""
        return next_step == self.total_steps or (self.cfg.every > 0 and next_step % self.cfg.every == 0)

    def save(self, next_step: int) -> None:
        state = self._state(snapshot_async(self.stream).result())
        state["step"] = next_step
        handle = self.manager.save(next_step, state)
        if handle is not None:
            handle.staged.result()  # weights may change once staged; the write continues in the background

    def restore(self) -> int:
        """Load the last committed step (model, optimizer, loader) and return it; 0 and a fresh loader
        when there is none.

        Step 0 holds initial weights only (``omni-train import-hf`` writes it; the trainer's own saves
        start at step 1): its model is loaded, the optimizer and the loader start fresh.

        Raises:
            RuntimeError: the checkpoint's recorded step differs from its directory's.
        """
        latest = self.manager.latest()
        if latest is None or latest == 0:
            if latest == 0:
                self.manager.load(0, {"model": self.model.state_dict()})
            self.stream.reset()
            return 0
        state = self._state(b"")
        members = [g["params"] for g in optimizer_state_dict(self.model, self.optimizer)["param_groups"]]
        self.manager.load(latest, state)
        groups = state["optim"]["param_groups"]
        if len(groups) != len(members):
            raise RuntimeError(
                f"checkpoint step-{latest:08d}: {len(groups)} optimizer parameter groups, this run has "
                f"{len(members)}"
            )
        state["optim"]["param_groups"] = [dict(g, params=m) for g, m in zip(groups, members)]
        load_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        self.stream.reset(msgpack.unpackb(state["loader"], strict_map_key=False))
        if int(state["step"]) != latest:
            raise RuntimeError(f"checkpoint step-{latest:08d} holds step {state['step']}")
        return latest

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return self.manager.steps()

    def close(self) -> None:
        """Finish pending writes (raises what a background write raised)."""
        self.manager.close()

    def _state(self, loader: bytes) -> dict[str, Any]:
        optim = optimizer_state_dict(self.model, self.optimizer)
        optim["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]]
        return {
            "model": self.model.state_dict(),
            "optim": optim,
            "loader": loader,
            "step": 0,
        }
