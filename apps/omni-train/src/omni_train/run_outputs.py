"""What a run writes as it steps, and its closing: one :class:`RunOutputs` per :meth:`Trainer.run`.

Rank 0 writes ``metrics.jsonl`` (with TensorBoard and the progress bar: :class:`~omni_train.metrics
.MetricsLogger`), ``actions.jsonl`` (:mod:`omni_pipeline.records`: every compute action of every step of
the first DP replica's pipeline with its token counts in :func:`omni_pipeline.action_tokens`'s convention,
the receives waited for and each step's wall time, which ``omni-train simulate --calibration`` fits a
cost model from), ``config.json``, ``dataflow.json`` (a fixed flow; a planned one is in ``actions.jsonl``
per step) and at the end ``summary.json`` (:func:`omni_train.metrics.finish_run`). Those per-step writes
run off the training thread (:class:`~omni_train.run_writes.RunWrites`), drained before each checkpoint
commits. Every rank writes its ``--profile`` trace (:class:`~omni_train.profiling.StepProfiler`).

A resumed run holds one history: ``metrics.jsonl`` and ``actions.jsonl`` are cut back to the steps before
the resumed one. Notices on stderr (rank 0): a restart under torchrun's elastic agent, a roll-back to an
older step (naming what was set aside), and a per-step plan over ``parallel.planner_memory_cap_mib``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from omni_data.zero_redundancy import FilteredStep
from omni_parallel import ParallelState
from omni_pipeline import (
    RECORDS_FILE,
    CPSharding,
    DataFlow,
    RecordWriter,
    StepInputs,
    StepPlanner,
    StepResult,
    action_tokens,
    gather_step_records,
)
from omni_train.checkpointing import TrainCheckpoint
from omni_train.config import RunConfig
from omni_train.metrics import MetricsLogger, finish_run
from omni_train.profiling import StepProfiler
from omni_train.run_writes import RunWrites

if TYPE_CHECKING:
    from omni_train.generate import SampleWriter

__all__ = ["RunOutputs", "record_writer"]


def record_writer(out: Path, rank: int, start: int) -> RecordWriter | None:
    """Rank 0: the writer of ``out/actions.jsonl``, cut back to the steps before ``start`` (a resumed run
    then holds one history, as ``metrics.jsonl``); other ranks: ``None``.

    A last line cut short (the run was killed while writing it) is of a step after the last
    checkpoint (records are written before the step's checkpoint) and goes with them.

    Raises:
        ValueError: a line before the last is not a JSON record (names the file and line).
    """
    if rank != 0:
        return None
    path = out / RECORDS_FILE
    if path.exists():
        lines, kept = path.read_text().splitlines(), []
        for n, line in enumerate(lines, start=1):
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                if n == len(lines):
                    break
                raise ValueError(f"{path}:{n}: not a record of a step; cannot resume its records") from None
            if step < start:
                kept.append(line)
        path.write_text("".join(line + "\n" for line in kept))
    return RecordWriter(path)


@dataclass
class RunOutputs:
    """What one run writes to as it steps, and its step clock (open with :meth:`open`).

    Attributes:
        clock: when the current step's wall time started (``time.perf_counter``; the end of the previous
            step's metrics reduction, so its logging and checkpoint count in the next step).
        cpu_clock: this process's CPU seconds (``time.process_time``, all its threads) at ``clock``: the
            step records' ``cpu_s`` is counted from it.
        checkpoint_s: the previous step's checkpoint save, reported in this step's time breakdown.
        saving: a checkpoint save was in flight at some time since ``cpu_clock`` (one :meth:`save` made,
            or an async save still running when the clock started; the trainer sets the latter): the
            step record's ``checkpoint_save``.
        writes: rank 0's file writes, off the step.
        said_over_cap: the planner's over-cap notice was given (it is given once).
        temporal_patch: the ViT's frames per patch (``model.vit.temporal_patch``): a video's attention
            slices in the records' token counts (:func:`omni_pipeline.action_tokens`).
    """

    out: Path
    rank: int
    logger: MetricsLogger
    records: RecordWriter | None
    profiler: StepProfiler
    clock: float
    cpu_clock: float = field(default_factory=time.process_time)
    checkpoint_s: float = 0.0
    saving: bool = False
    writes: RunWrites = field(default_factory=RunWrites)
    said_over_cap: bool = False
    temporal_patch: int = 1

    @classmethod
    def open(
        cls,
        out: Path,
        cfg: RunConfig,
        rank: int,
        start: int,
        *,
        device: torch.device,
        flow: DataFlow | None,
        restarts: int,
        set_aside: list[str] | None,
    ) -> RunOutputs:
        """The run's outputs from ``start`` on (metrics, records, profiler), the resolved config and, with
        ``flow``, the run's fixed data flow; a restart notice after ``restarts`` elastic restarts, or with
        ``set_aside`` (a roll-back to an older step) a notice naming the newer steps set aside.

        Raises:
            ValueError: as :func:`record_writer` (a damaged ``actions.jsonl``).
        """
        if restarts and rank == 0:
            of = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
            print(f"omni-train: restarted ({restarts} of {of}), resuming from step {start}", file=sys.stderr)
        if set_aside is not None and rank == 0:  # renamed directories are not silent
            aside = ", ".join(set_aside) or "none (it was the newest)"
            print(
                f"omni-train: rolled back to step {start}; newer steps set aside (kept): {aside}",
                file=sys.stderr,
            )
        logger = MetricsLogger(out, cfg.train.steps, start, enabled=rank == 0)
        records = record_writer(out, rank, start)
        if rank == 0:
            (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
            if flow is not None:
                (out / "dataflow.json").write_text(flow.to_json())
        profiler = StepProfiler(
            out, rank, cfg.train.profile_steps, first_step=start, total_steps=cfg.train.steps, device=device
        ).start()
        clock, temporal = time.perf_counter(), cfg.model.vit.temporal_patch
        return cls(out, rank, logger, records, profiler, clock=clock, temporal_patch=temporal)

    def write_records(
        self,
        ps: ParallelState,
        step: int,
        fs: FilteredStep,
        inputs: StepInputs,
        result: StepResult,
        wall: float,
        *,
        image_merge: int,
        planned: bool,
        cpu_s: tuple[float, float] | None = None,
        checkpoint_save: bool | None = None,
    ) -> None:
        """This step's per-action, receive and step records of every rank of global rank 0's pipeline (the
        first DP replica's; TP/SP/CP rank 0), gathered to rank 0 over that pipeline group (collective over
        it) and queued on rank 0's writes; with ``planned``, pipeline rank 0 adds the step's flow. Other
        ranks record nothing. ``cpu_s``: this process's CPU seconds over the step's ``wall`` and over
        the executor's step within it (the step record's ``cpu_s`` and ``pipeline_cpu_s``);
        ``checkpoint_save``: a save was in flight during that interval (the step record's)."""
        if any(ps.local_rank(a) for a in ("dp", "tp", "cp", "ulysses")):
            return
        pp_rank = ps.local_rank("pp")
        llm, enc = action_tokens(
            inputs.packs, fs.microbatches, image_merge=image_merge, temporal_patch=self.temporal_patch
        )
        flow = inputs.plan.flow if planned and pp_rank == 0 else None
        pp_group = ps.group("pp") if ps.size("pp") > 1 else None
        records = gather_step_records(
            step, result, llm, enc, wall_s=wall, pp_rank=pp_rank, pp_group=pp_group, flow=flow, cpu_s=cpu_s,
            checkpoint_save=checkpoint_save,
        )  # fmt: skip
        if self.records is not None and records is not None:
            self.writes.submit(f"{self.records.path}, step {step}", self.records.write, records)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Queue the step's ``metrics.jsonl`` row (rank 0)."""
        self.writes.submit(f"{self.logger.path}, step {step}", self.logger.log, step, metrics)

    def save(self, checkpoint: TrainCheckpoint, next_step: int, samples: SampleWriter | None = None) -> None:
        """Commit the checkpoint of ``next_step`` if it is due, after the steps before it are on disk;
        its seconds go in the next step's time breakdown (``checkpoint_s``). Then ``samples`` (rank 0's
        omni-gen grid writer) notes a due checkpoint and starts a grid's child once one is committed."""
        self.checkpoint_s = 0.0
        if checkpoint.due(next_step):
            t = time.perf_counter()
            self.writes.drain()  # the steps before the checkpoint are on disk before it commits
            checkpoint.save(next_step)
            self.checkpoint_s = time.perf_counter() - t
            self.saving = True  # in the next step's CPU interval (its clock started before this)
        if samples is not None:
            samples.after_save(next_step, checkpoint)

    def cp_metrics(self, sharding: CPSharding | None) -> dict[str, int]:
        """Hybrid DP/CP: ``hybrid_cp_raised_caps``, the packs so far planned above ``data.max_seq_len``
        tokens per rank (``CPSharding.raised_caps``; the same on every rank of a stage, which all plan every
        pack)."""
        if sharding is None or not sharding.hybrid:
            return {}
        return {"hybrid_cp_raised_caps": sharding.raised_caps}

    def planner_metrics(self, planner: StepPlanner | None, cap_mib: float | None) -> dict[str, float]:
        """Per-step ``planned`` with ``parallel.planner_memory_cap_mib`` (``cap_mib``):
        ``planner_over_cap_bytes``, the step's plan's modelled bytes over the cap (0 when it holds), said
        once on stderr when it first does not."""
        if planner is None or planner.memory_cap_bytes is None:
            return {}
        over = planner.over_cap_bytes
        if over > 0 and not self.said_over_cap:
            self.said_over_cap = True
            print(
                f"omni-train: planned: no placement keeps every rank under parallel.planner_memory_cap_mib = "
                f"{cap_mib} (modelled); the step's plan is {over / 2**20:.1f} "
                "MiB over it (planner_over_cap_bytes in metrics.jsonl)",
                file=sys.stderr,
            )
        return {"planner_over_cap_bytes": over}

    def stop(self) -> None:
        """After the last step: the profiler's trace written, every queued write on disk."""
        self.profiler.stop()
        self.writes.close()

    def close(self) -> None:
        """Close the run's files (after :meth:`stop`)."""
        self.logger.close()
        if self.records is not None:
            self.records.close()

    def close_after(self, error: BaseException) -> None:
        """After ``error`` stopped the run: the queued writes of the steps that finished reach disk, the
        writes thread stops and the run's files are closed; what fails meanwhile is added to ``error`` as
        a note (it stays the error raised)."""
        closes = [self.writes.close, self.logger.close] + (
            [self.records.close] if self.records is not None else []
        )
        for close in closes:
            try:
                close()
            except Exception as also:  # not raised: the error that stopped the run stays the one raised
                if also is not error:
                    error.add_note(f"omni-train: also, while closing the run's files: {also!r}")

    def summary(
        self,
        cfg: RunConfig,
        last: StepResult | None,
        elapsed: float,
        start: int,
        *,
        checkpoints: list[int],
        skipped: dict[str, Any],
        numerics: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Rank 0 at the end: the loss plot, the last step's timeline and ``summary.json``
        (:func:`omni_train.metrics.finish_run`; ``numerics``: the numerics guard's bad steps); returns the
        summary."""
        title = f"{cfg.name}: last step, {cfg.parallel.placement}"
        timelines = last.timelines if last is not None else None
        return finish_run(
            self.out,
            cfg.name,
            timelines,
            title,
            elapsed,
            start,
            checkpoints=checkpoints,
            skipped=skipped,
            numerics=numerics,
        )
