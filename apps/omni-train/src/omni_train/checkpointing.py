"""Checkpoints of a training run through omni-ckpt's :class:`~omni_ckpt.CheckpointManager` (async saves):
the model, the optimizer (by parameter name, so any layout reloads it), the loader state, the parallel
layout and the step. A committed step ``N`` holds the state after ``N`` optimizer steps; restoring it makes
the run continue at step ``N`` exactly (the loader resumes mid-stream).

Loader states are per rank (each rank's msgpack ``state_dict``) and are saved as one ``uint8`` tensor
``loader [dp, positions, width]`` whose row ``(d, p)`` is the state of DP rank ``d`` at position ``p``
(pipeline x TP x CP x Ulysses rank): 8 bytes of little-endian length, the msgpack bytes, zeros. As a
tensor it is checksummed and can be read by any rank of any later layout (omni-ckpt loads any box). The
model and optimizer load through omni-ckpt's box intersection whatever the two layouts (TP and FSDP2
DTensor shards, other stage splits; ZeRO stages and SP change freely). The loader:

* same layout: this rank's own row, exactly where it stopped;
* same DP size, another pipeline, TP, CP or Ulysses size: replayed from its start over the committed
  steps (the packs of a DP replica do not depend on these sizes), so the run continues as the
  uninterrupted one;
* another DP size (the pipeline, TP, CP and Ulysses sizes the same or not): the rows of every old DP
  rank, read at one old position (the packs' metadata is the same at every position of a DP rank),
  re-split exactly over the new DP ranks (omni-data's ``load_resplit``: every sample trained exactly
  once per epoch; the payload skip counts of old position ``p`` go to new position ``p mod positions``).
  This does not reproduce the uninterrupted run and cannot: a DP replica's loader reads its own share of
  the shards and packs ``data.microbatches`` packs of it per step, so a step's global batch (``dp x
  microbatches`` packs) is another one at another DP size; from the resumed step on, the run is the
  one-process run on the re-split data from the saved state (``tests/test_train_dp_resplit.py``);
* another DP size with ``data.replicas`` (omni-data's ``ReplicaMerge``: data replicas independent of the
  DP size, the same number saved and resumed): the loader states are keyed by replica, so each new DP
  rank takes its replicas' states whole from the old ranks that ran them and their pre-filtered steps
  cut back into the replicas' packs (omni-data's ``hand_over_replicas``); the global step is the same
  at every DP size dividing ``data.replicas``, so the run continues exactly as the uninterrupted one
  (``tests/test_train_llm_zero.py``).

States that cannot be re-split (a node without ``load_resplit``, e.g. a text source's ``join_tokens``,
which ``omni_train.preflight.check_resume_layout`` refuses before any worker starts) are refused with
:class:`~omni_data.LayoutMismatchError` naming both layouts before a sample is read.

The optimizer state is omni-ckpt's portable one (:func:`omni_ckpt.portable_optimizer_state_dict`): its
parameter groups are saved without their member lists, since which parameters a rank holds depends on the
layout (pipeline schedule, virtual stages, pp). Membership is the optimizer's own (``build_optimizer``
decides it from each parameter's shape); the saved groups give the hyperparameters, the saved state the
moments by name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni_ckpt import (
    AsyncSaveHandle,
    BoxShard,
    CheckpointError,
    CheckpointManager,
    byte_rows,
    decode_row,
    load,
    load_portable_optimizer_state_dict,
    portable_optimizer_state_dict,
    read_manifest,
)
from omni_ckpt.layout import dtype_from_name
from omni_data import LayoutMismatchError, ReplicaMerge, ZeroRedundancyFilter, hand_over_replicas
from omni_parallel import ParallelState
from omni_train.binder import config_from_dict
from omni_train.config import CheckpointConfig, ConfigError, RunConfig

__all__ = [
    "LAYOUT_AXES",
    "TrainCheckpoint",
    "committed_step_url",
    "read_model_tensors",
    "run_config",
    "with_older_steps",
]

LAYOUT_AXES = ("dp", "pp", "tp", "cp", "ulysses")
"""The parallel sizes a checkpoint records (``layout.<axis>``); any of them may change on resume."""

_POSITION_AXES = ("pp", "tp", "cp", "ulysses")  # ranks of one DP rank, slowest first


def run_config(run_dir: str | Path, command: str) -> RunConfig:
    """The run config saved in ``run_dir/config.json`` (written by the trainer at start).

    Raises:
        ConfigError: no ``config.json`` there, or it is not a run config (``command`` and the file named).
    """
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{command}: {run_dir} has no config.json (not a run directory)")
    try:
        return config_from_dict(json.loads(path.read_text()))
    except (ValueError, ConfigError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{command}: {path} is not a run config ({exc})") from None


def checkpoints_root(cfg: RunConfig, run_dir: str | Path) -> str | Path:
    """Where the run in ``run_dir`` keeps its checkpoints: ``cfg.checkpoint.url`` when set, else
    ``run_dir/checkpoints`` (the trainer's choice; read back by ``export-hf`` and ``sample``)."""
    return cfg.checkpoint.url or Path(run_dir) / "checkpoints"


def committed_step_url(checkpoints: str | Path, step: int | None, command: str) -> tuple[int, str]:
    """``(step, url)`` of committed ``step`` (default: the latest) under ``checkpoints`` (a run's
    ``checkpoints/``), read outside any process group (the CLI's ``export-hf`` and ``sample``).

    Raises:
        ConfigError: no committed step (``command`` named), or ``step`` is not one (the committed ones named).
    """
    mgr = CheckpointManager(str(checkpoints), keep_last=None, async_save=False)
    steps = mgr.steps()
    if not steps:
        raise ConfigError(f"{command}: {checkpoints} holds no committed checkpoint")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ConfigError(f"--step: {step} is not a committed step of {checkpoints} (have {steps})")
    return step, mgr.step_url(step)


def read_model_tensors(url: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model's whole tensors under ``prefix`` (e.g. ``"llm."``; stripped, with the ``model.`` of the
    checkpoint) of the committed step at ``url``, whatever layout saved them: omni-ckpt's manifest, then a
    box read in this process alone (no collective, so one rank of a run may call it).

    Raises:
        omni_ckpt.CheckpointError: the step is not committed or fails omni-ckpt's checks (raised by
            ``read_manifest`` before any tensor is allocated from the manifest).
    """
    head = "model." + prefix
    saved = read_manifest(url)["tensors"]
    tensors = {
        n.removeprefix("model."): torch.empty(tuple(shape), dtype=dtype_from_name(dt))
        for n, (dt, shape, _) in saved.items()
        if n.startswith(head)
    }
    load({"model": tensors}, url, process_group=None)
    return {k.removeprefix(prefix): v for k, v in tensors.items()}


def _describe(layout: dict[str, int]) -> str:
    return " ".join(f"{a}={layout[a]}" for a in LAYOUT_AXES)


def with_older_steps(exc: CheckpointError, older: list[int]) -> CheckpointError:
    """``exc`` (the newest step is damaged) with what the user can do about it on the same line: resume
    from one of the ``older`` committed steps."""
    return CheckpointError(
        f"{exc}; to resume from an older committed step ({', '.join(map(str, older))}): "
        "omni-train run --resume --resume-step N"
    )


class TrainCheckpoint:
    """Save and restore one rank's share of a run (collective: every rank calls the same methods).

    Args:
        directory: ``<run>/checkpoints``, or the fsspec URL of ``checkpoint.url`` (``s3://...``).
        cfg: ``[checkpoint]`` (every, keep_last, async_save).
        total_steps: the run's steps (the last one is always saved).
        model: every module of this rank (state dict by name).
        optimizer: its optimizer.
        stream: the loader, whose state is saved with the step.
        ps: the run's parallel state (its layout and this rank's place in it); ``None``: one process.
        fixed: other facts of the run's layout a resume must share, by config field (e.g.
            ``{"data.reorder_group_size": 2}``: which replicas trade samples decides which rank encodes
            what, so another group size would not reproduce the run); saved with every step, checked
            by :meth:`restore` when the layout is unchanged (a resume under another DP size re-splits the
            data and does not reproduce the run anyway; one under other pipeline / TP sizes may resolve
            an automatic group size differently and replays the loader at its own).
    """

    def __init__(
        self,
        directory: Path | str,
        cfg: CheckpointConfig,
        total_steps: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        stream: ZeroRedundancyFilter,
        *,
        ps: ParallelState | None = None,
        fixed: Mapping[str, int] | None = None,
    ) -> None:
        self.cfg, self.total_steps = cfg, total_steps
        self.model, self.optimizer, self.stream = model, optimizer, stream
        self.fixed = dict(fixed or {})
        # the loader prepares the state of each step this saves while it prepares that step (on its own
        # thread), so save() takes bytes made ahead instead of walking its buffers (paper §7.4)
        stream.snapshots = self.due
        self.manager = CheckpointManager(
            str(directory),
            keep_last=cfg.keep_last,
            async_save=cfg.async_save,
            process_group=ps.checkpoint_group if ps is not None else None,  # ParallelState made it
            require_finite=True,  # a NaN or Inf never reaches a committed step (nor prunes a good one)
        )
        self.set_aside: list[str] = []  # what restore(step) renamed, for the run's notice
        self._handle: AsyncSaveHandle | None = None  # the last async save (saving() asks it)
        self.layout = {a: ps.size(a) if ps else 1 for a in LAYOUT_AXES}
        self.dp_rank = ps.local_rank("dp") if ps else 0
        self.position = 0
        for a in _POSITION_AXES:
            self.position = self.position * self.layout[a] + (ps.local_rank(a) if ps else 0)
        self.positions = 1
        for a in _POSITION_AXES:
            self.positions *= self.layout[a]

    def due(self, next_step: int) -> bool:
        """Whether the state after ``next_step`` optimizer steps is saved: every ``every`` and at the end."""
        return next_step == self.total_steps or (self.cfg.every > 0 and next_step % self.cfg.every == 0)

    def save(self, next_step: int) -> None:
        blob = self.stream.snapshot().blob  # msgpack bytes, made ahead on the loader's thread
        rows = byte_rows(blob, (self.dp_rank, self.position), (self.layout["dp"], self.positions))
        state = self._state(rows)
        state["layout"] = {**self.layout, **self.fixed, "loader_width": rows.global_shape[-1]}
        state["step"] = next_step
        # Returns once the state is staged to host memory (omni-ckpt's default), so the optimizer may step
        # at once; the write and the commit continue in the background.
        self._handle = self.manager.save(next_step, state)

    def saving(self) -> bool:
        """Whether the last async save's background staging, writing or commit is still running (a
        synchronous save is over once :meth:`save` returns). The trainer marks the step records whose CPU
        interval such a save overlaps (:attr:`omni_pipeline.records.StepRecord.checkpoint_save`)."""
        return self._handle is not None and not self._handle.done.done()

    def restore(self, step: int | None = None) -> int:
        """Load the last committed step (model, optimizer, loader) and return it; 0 and a fresh loader
        when there is none. With ``step``, that committed step instead: the newer step directories are
        set aside first (``omni_ckpt.CheckpointManager.roll_back``: renamed, kept on disk), so the run
        goes on from ``step`` and its later saves and pruning never meet them; their new names are in
        :attr:`set_aside`.

        Step 0 holds initial weights only (``omni-train import-hf`` writes it; the trainer's own saves
        start at step 1): its model is loaded, the optimizer and the loader start fresh. A step saved under
        another DP size (the pipeline, TP, CP and Ulysses sizes the same or others) resumes with the
        loader states of every old DP rank re-split over the new ones (with ``data.replicas``: the
        replicas' states handed over whole, see the module docstring); one saved at the same DP size
        under another pipeline, TP, CP or Ulysses size resumes with the loader replayed over the
        committed steps (see the module docstring).

        Raises:
            LayoutMismatchError: the step was saved under another DP size and the old loader states
                cannot be re-split exactly (both layouts named; raised before the loader reads anything).
            RuntimeError: the checkpoint's recorded step differs from its directory's, or it was saved
                with another ``fixed`` value under the same layout (names the field and both values).
            ValueError: the saved optimizer state does not fit this run's optimizer (another number of
                parameter groups, a moment of another shape: :func:`omni_ckpt.load_portable_optimizer_state_dict`).
            omni_ckpt.CheckpointError: ``step`` is not a committed step (the committed ones named), or
                the step fails its checks (a damaged file, named; the older committed steps are named
                with the ``--resume-step`` that resumes from one of them).
        """
        if step is not None:  # every rank joins (a rank that saw ``step`` as the newest must not skip it)
            self.set_aside = self.manager.roll_back(step)
        latest = self.manager.latest()
        try:
            return self._restore(latest)
        except CheckpointError as exc:
            older = [s for s in self.manager.steps() if latest is not None and s < latest]
            if not older:
                raise
            raise with_older_steps(exc, older) from exc

    def _restore(self, latest: int | None) -> int:
        if latest is None or latest == 0:
            if latest == 0:
                self.manager.load(0, {"model": self.model.state_dict()})
            self.stream.reset()
            return 0
        saved = {"layout": {a: 0 for a in (*LAYOUT_AXES, *self.fixed, "loader_width")}}
        self.manager.load(latest, saved)
        old = {a: int(saved["layout"][a]) for a in LAYOUT_AXES}
        where = (
            f"checkpoint step-{latest:08d} saved with {_describe(old)}, resumed with {_describe(self.layout)}"
        )
        changed = [a for a in LAYOUT_AXES if old[a] != self.layout[a]]
        if changed and "dp" not in changed:
            return self._relayout(latest)
        for key, value in self.fixed.items() if not changed else ():
            if int(saved["layout"][key]) != value:
                raise RuntimeError(
                    f"{key}: checkpoint step-{latest:08d} was saved with {saved['layout'][key]}, this run has "
                    f"{value}; resume with the value the run was saved with"
                )
        # The rows this rank reads: at the same DP size its own (same position); under another DP size
        # those of every old DP rank at old position ``meta`` (the packs' metadata is the same at every
        # position of a DP rank: any one will do, so the same one when the positions are unchanged) and,
        # for the payload skip counts, at the old positions this position takes over (old p -> new
        # p mod positions: every old position's counts land on exactly one new position).
        old_positions = 1
        for a in _POSITION_AXES:
            old_positions *= old[a]
        meta = self.position % old_positions
        skips = [p for p in range(old_positions) if p % self.positions == self.position]
        lo, hi = min([meta, *skips]), max([meta, *skips]) + 1
        width = int(saved["layout"]["loader_width"])
        first, count = (0, old["dp"]) if changed else (self.dp_rank, 1)
        rows = torch.zeros(count, hi - lo if changed else 1, width, dtype=torch.uint8)
        at = (first, lo if changed else self.position, 0)
        state = self._state(BoxShard(rows, (old["dp"], old_positions, width), at))
        self.manager.load(latest, state)
        load_portable_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        if int(state["step"]) != latest:
            raise RuntimeError(f"checkpoint step-{latest:08d} holds step {state['step']}")
        if not changed:
            self.stream.reset(decode_row(rows[0, 0], f"{where}: loader row of DP rank {first}"))
            return latest

        def row(d: int, p: int) -> dict[str, Any]:
            return decode_row(rows[d, p - lo], f"{where}: loader row of DP rank {d} at position {p}")

        states = [row(d, meta) for d in range(count)]
        by_position = [row(d, p) if p != meta else states[d] for p in skips for d in range(count)]
        if isinstance(self.stream.loader, ReplicaMerge):  # data replicas: handed over whole, not re-split
            ledgers = [st["ledger"] for st in by_position] if self.dp_rank == 0 else []
            try:
                state = hand_over_replicas(states, list(self.stream.loader.loaders), ledgers=ledgers)
            except LayoutMismatchError as e:
                raise LayoutMismatchError(f"{where}: the data replicas cannot be handed over: {e}") from e
            self.stream.reset(state)
            return latest
        try:
            self.stream.load_resplit(states, self.dp_rank, self.layout["dp"], skips=by_position)
        except LayoutMismatchError as e:
            raise LayoutMismatchError(f"{where}: the loader cannot re-split exactly: {e}") from e
        return latest

    def roll_back_state(self, step: int) -> tuple[int | None, list[str]]:
        """A numerics roll-back at ``step`` (``train.on_nonfinite = "rollback"``; collective): the model
        and optimizer state of the newest committed step ``N`` with ``0 < N < step`` (step ``step``'s own
        checkpoint holds the parameters that went bad), the newer step directories set aside
        (:meth:`omni_ckpt.CheckpointManager.roll_back`, kept on disk). The loader is left where it is:
        the run goes on with the next step's data, skipping what came since ``N``.

        Returns:
            ``(N, the set-aside names)``, or ``(None, [])`` when no such step is committed (nothing done).

        Raises:
            omni_ckpt.CheckpointError: as :meth:`restore` (a damaged step, a failed rename).
        """
        self.manager.wait()  # the in-flight save commits (or fails) first, on every rank alike
        older = [s for s in self.manager.steps() if 0 < s < step]
        if not older:
            return None, []
        back = older[-1]
        aside = self.manager.roll_back(back)
        self.set_aside += aside
        self._load_model_and_optimizer(back)
        return back, aside

    def _relayout(self, step: int) -> int:
        """Resume ``step`` saved at the same DP size under another pipeline, TP, CP or Ulysses layout: the
        model and AdamW state through omni-ckpt's box intersection (any shards: TP and FSDP2 DTensors,
        other stage splits), and the loader replayed from its start over ``step`` steps (the packs of a DP
        replica do not depend on these sizes, but a position's saved loader state does: which payloads it
        reads). Replaying reads the steps' data again: seconds per hundred steps on the bundled data."""
        self._load_model_and_optimizer(step)
        self.stream.reset()
        for _ in range(step):
            next(self.stream)
        return step

    def _load_model_and_optimizer(self, step: int) -> None:
        """The model and the optimizer state of committed ``step``, whatever layout saved them."""
        state = self._state(None)
        del state["loader"], state["step"]
        self.manager.load(step, state)
        load_portable_optimizer_state_dict(self.model, self.optimizer, state["optim"])

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return self.manager.steps()

    def close(self) -> None:
        """Finish pending writes (raises what a background write raised)."""
        self.manager.close()

    def _state(self, loader: Any) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": portable_optimizer_state_dict(self.model, self.optimizer),
            "loader": loader,
            "step": 0,
        }
