"""The run's numerics guard (``train.on_nonfinite``, ``train.max_nonfinite_steps``, ``train.spike_zscore``,
``train.spike_window``): the config mapped to :class:`omni_parallel.numerics.NumericsSpec`, and the
package's guard (:meth:`~omni_parallel.numerics.NumericsGuard.for_layout`: each encoder tower's output and
every microbatch loss) with its verdicts acted on by :func:`omni_parallel.numerics.apply_verdict`, rolling
back through the run's checkpoint (MegaScale-Omni §7-8: encoder outputs checked, loss spikes bypassed by
going back to a checkpoint and skipping the data).

The checks ride the step's existing world all-reduce before the gradient sync (the trainer's
``reduce_gradients`` hook calls :meth:`~omni_parallel.numerics.NumericsGuard.reduce` where it waited for
the ranks) and the gradient-clipping norm; no collective is added. A bad step:

* ``skip_step``: the optimizer does not step (parameters and AdamW state bit for bit unchanged); the
  loader has moved on, so the next step trains on the next data;
* ``rollback``: no update either, and the parameters and optimizer state go back to the newest committed
  checkpoint before the step (:meth:`omni_train.checkpointing.TrainCheckpoint.roll_back_state`; the newer
  step directories are set aside, kept); the loader and the step count go on, so the steps since that
  checkpoint are skipped with their data. Without such a checkpoint the step is only skipped (noted);
* ``stop``, or ``max_nonfinite_steps`` bad steps in a row: the step's metrics are written and the run
  ends with :class:`~omni_parallel.numerics.NonFiniteError`, one line naming the step and what was bad.

Each bad step is said on stderr (rank 0), written in ``metrics.jsonl`` (``numerics``: step, action,
``nonfinite`` names with rank counts, ``spike_z``; every row has ``bad_steps``, the run's count so far) and
counted in ``summary.json`` (``numerics``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from omni_parallel import ParallelState
from omni_parallel.numerics import NumericsGuard, NumericsSpec, OnNonFinite, StepVerdict, apply_verdict
from omni_train.checkpointing import TrainCheckpoint
from omni_train.config import ConfigError, TrainSection

__all__ = ["act_on", "numerics_guard", "numerics_spec", "source_name"]


def numerics_spec(train: TrainSection) -> NumericsSpec:
    """``[train]``'s numerics fields as the guard's spec.

    Raises:
        ConfigError: a field out of range (``train.<field>: ...``).
    """
    try:
        return NumericsSpec(
            on_nonfinite=OnNonFinite(train.on_nonfinite),
            max_nonfinite_steps=train.max_nonfinite_steps,
            spike_zscore=train.spike_zscore or None,
            spike_window=train.spike_window,
        )
    except ValueError as exc:
        raise ConfigError(f"train.{exc}") from None


def source_name(modality: str) -> str:
    """The guard's name for an encoder tower's output (``"image_encoder"``)."""
    return f"{modality}_encoder"


def numerics_guard(
    train: TrainSection, ps: ParallelState, towers: dict[str, nn.Module], device: torch.device
) -> NumericsGuard:
    """This rank's guard, watching each of ``towers`` (``{modality: module}``, every rank's, in one order)."""
    watched = {source_name(m): tower for m, tower in towers.items()}
    return NumericsGuard.for_layout(numerics_spec(train), ps, watched, device=device)


def act_on(
    verdict: StepVerdict,
    guard: NumericsGuard,
    optimizer: torch.optim.Optimizer,
    checkpoint: TrainCheckpoint,
    rank: int,
) -> dict[str, Any]:
    """:func:`omni_parallel.numerics.apply_verdict`, rolling back through ``checkpoint``
    (:meth:`~omni_train.checkpointing.TrainCheckpoint.roll_back_state`), a bad step said on stderr by
    rank 0; returns the step's entries for ``metrics.jsonl``."""

    def say(line: str) -> None:
        print(f"omni-train: {line}", file=sys.stderr)

    return apply_verdict(
        verdict, guard, optimizer, roll_back=checkpoint.roll_back_state, say=say if rank == 0 else None
    )
