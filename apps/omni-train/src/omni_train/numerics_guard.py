"""The run's numerics guard (``train.on_nonfinite``, ``train.max_nonfinite_steps``, ``train.spike_zscore``,
``train.spike_window``): the config mapped to :class:`omni_parallel.numerics.NumericsSpec`, the guard
watching each encoder tower's output and every microbatch loss, and what the trainer does with a bad
step's verdict (MegaScale-Omni §7-8: encoder outputs checked, loss spikes bypassed by going back to a
checkpoint and skipping the data).

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

import dataclasses
import sys
from typing import Any

import torch
from torch import nn

from omni_parallel import ParallelState
from omni_parallel.numerics import NonFiniteError, NumericsGuard, NumericsSpec, OnNonFinite, StepVerdict
from omni_pipeline import StepFunctions
from omni_train.checkpointing import TrainCheckpoint
from omni_train.config import ConfigError, TrainSection

__all__ = ["act_on", "numerics_guard", "numerics_spec", "source_name", "stop_error", "watch_loss"]


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
    """This rank's guard, watching each of ``towers`` (``{modality: module}``, every rank's, in one order).

    The step's loss counts once per replica: on the last pipeline stage (where ``loss`` runs), TP rank 0
    (TP ranks hold copies; SP and CP ranks hold partial sums), as ``omni_train.step_metrics`` counts it.
    """
    last = ps.local_rank("pp") == ps.size("pp") - 1
    guard = NumericsGuard(
        numerics_spec(train),
        [source_name(m) for m in towers],
        device=device,
        counts_loss=last and ps.local_rank("tp") == 0,
    )
    guard.watch({source_name(m): tower for m, tower in towers.items()})
    return guard


def watch_loss(functions: StepFunctions, guard: NumericsGuard) -> StepFunctions:
    """``functions`` whose ``loss`` hands each microbatch loss to ``guard`` as well."""
    loss = functions.loss

    def watched(k: int, y: torch.Tensor) -> Any:
        got = loss(k, y)
        guard.observe_loss(got[0] if isinstance(got, tuple) else got)
        return got

    return dataclasses.replace(functions, loss=watched)


def act_on(
    verdict: StepVerdict,
    guard: NumericsGuard,
    optimizer: torch.optim.Optimizer,
    checkpoint: TrainCheckpoint,
    rank: int,
) -> dict[str, Any]:
    """Step the optimizer on a good step; on a bad one do what the verdict says (collective on a
    roll-back: every rank has the same verdict) and say it on stderr (rank 0). Returns the step's entries
    for ``metrics.jsonl``. A stopping verdict changes nothing here: the caller logs the step, then raises
    :func:`stop_error`."""
    if verdict.ok:
        optimizer.step()
        return {"bad_steps": len(guard.events)}
    said = "step skipped"
    if verdict.action == OnNonFinite.ROLLBACK:
        to, aside = checkpoint.roll_back_state(verdict.step)
        guard.note(verdict.step, rolled_back_to=to)
        if to is None:
            said = "no committed checkpoint before it to roll back to; step skipped"
        else:
            said = f"rolled back to step {to}'s parameters and optimizer state (set aside: {', '.join(aside) or 'none'})"
    elif verdict.action == OnNonFinite.STOP:
        said = "stopping"
    if rank == 0:
        print(
            f"omni-train: step {verdict.step}: {verdict.what()}; {said} ({verdict.in_a_row} in a row)",
            file=sys.stderr,
        )
    entry = dict(verdict.record())
    entry.update(guard.events[-1] if guard.events and guard.events[-1]["step"] == verdict.step else {})
    return {"bad_steps": len(guard.events), "numerics": entry}


def stop_error(verdict: StepVerdict, guard: NumericsGuard) -> NonFiniteError | None:
    """The error that ends the run after ``verdict``, or None when it goes on."""
    return NonFiniteError(guard.stop_message(verdict)) if verdict.action == OnNonFinite.STOP else None
