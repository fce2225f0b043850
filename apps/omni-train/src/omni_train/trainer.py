"""The trainer: every package wired into one training loop, run by each worker process.

Per rank (DESIGN.md §omni-train; MegaScale-Omni §3-§5; ARCHITECTURE.md draws the flow), :class:`Trainer`
builds its parts through :mod:`omni_train.wiring` (the run config mapped to the packages' specs: every
process group in one ``ParallelState``, the parallelised model and AdamW, the schedule, CP delivery, the
data flow and the loader, the step builder, the executor, the checkpoint and the step metrics) and runs
the loop below; what the run writes (metrics, ``actions.jsonl``, notices, profiler traces, the summary)
is :mod:`omni_train.run_outputs`'s.

Each step: learning rate, gradients zeroed (ZeRO-0 encoder gradients re-attached to their flat buffers;
LLM ZeRO 1-3 parameters all-gathered) -> the loader's step -> :class:`~omni_pipeline.StepInputs` (a value;
the executor's callables close over it) -> executor step (each encoder tower's gradient collectives issued
once its last backward of the step on this rank has run, ``EncoderGradientSync.ready``; each LLM block's
during its stage's last backward, ``LLMGradientSync.arm``) -> gradient clipping across pipeline ranks and
encoder replicas -> the numerics guard's verdict (``omni_parallel.numerics``: AdamW steps, or the step is
skipped, rolled back or stops the run) -> metrics (one collective) -> records -> checkpoint. A step's wall
clock runs from the end of the previous step's metrics reduction, so the previous checkpoint save counts
in it (``time_s_per_rank`` in ``metrics.jsonl`` says where it went). The loader's skips are reduced over
the ranks each step (``omni_data.SkipMetrics``).

Determinism: one intra-op thread per process, parameters initialised from seeded private generators, no
dropout, data order from seeded shard shuffles and the deterministic mixture; a resumed run therefore
reproduces the uninterrupted run's losses step for step on CPU.

Hangs and preemption (issue 29): a heartbeat watchdog (:func:`omni_train.wiring.watchdog`,
``omni_parallel.watchdog``) runs beside the loop and names a rank that stops beating; after each step the
ranks agree on a stop signal (``omni_parallel.preemption``, its counts carried in the numerics guard's
all-reduce: no collective of its own) and, on one, commit checkpoint N synchronously and stop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from omni_data.zero_redundancy import FilteredStep
from omni_parallel.grad_clip import clip_grad_norm_
from omni_parallel.preemption import StopSignal
from omni_pipeline import StepInputs, StepResult, build_schedule
from omni_train import wiring
from omni_train.config import RunConfig
from omni_train.data_files import load_tokenizer
from omni_train.data_pipeline import llm_vocab_size, load_image_tokenizer, step_config
from omni_train.generate import SampleWriter
from omni_train.launch import StopReport, restart_count
from omni_train.models.llm import moe_step_metrics
from omni_train.numerics_guard import act_on, numerics_guard
from omni_train.optim import lr_at
from omni_train.pipeline import image_merge
from omni_train.run_outputs import RunOutputs

__all__ = ["Trainer"]


class Trainer:
    """One worker's training run (the default process group must be initialised).

    Args:
        cfg: the validated run config.
        out_dir: the run directory (shared by all ranks).
        resume: continue from the last committed checkpoint under ``out_dir/checkpoints`` (if any).
        resume_step: with ``resume``, continue from this committed step instead; newer ones are set aside
            (:meth:`omni_train.checkpointing.TrainCheckpoint.restore`).
        stop: the process's stop signals (installed by the caller): after each step the ranks agree on
            them and, on one, commit a checkpoint and stop (:attr:`stopped`); ``None``: not asked.
    """

    def __init__(
        self,
        cfg: RunConfig,
        out_dir: Path,
        *,
        resume: bool,
        resume_step: int | None = None,
        stop: StopSignal | None = None,
    ) -> None:
        self.cfg, self.out, self.resume, self.resume_step = cfg, out_dir, resume, resume_step
        self.stop, self.stopped = stop, None  # stopped: a StopReport once the ranks stopped on a signal
        self.out.mkdir(parents=True, exist_ok=True)
        self.ps = wiring.parallel_state(cfg)  # every group of the run, here, in one order
        self.rank, self.world = self.ps.rank, self.ps.world_size
        self.pp_rank, self.pp = self.ps.local_rank("pp"), self.ps.size("pp")
        self.dp, self.tp, self.sp = self.ps.size("dp"), self.ps.size("tp"), self.ps.size("ulysses")
        self.device = wiring.training_device()
        # the step's consumers train data.microbatches per data replica of this DP rank (data.replicas);
        # the loader (step_stream below) and the run's records take the run's own config
        cfg = step_config(cfg, self.dp)
        torch.manual_seed(cfg.train.seed)
        self.tokenizer = load_tokenizer(cfg.data)
        par = cfg.parallel
        self.schedule = build_schedule(par.schedule, par.pp, cfg.data.microbatches, par.virtual_stages)
        vq = load_image_tokenizer(cfg)  # [model.image_tokenizer], loaded once: the LLM's vocab + boi, eoi, K
        vocab = llm_vocab_size(cfg, self.tokenizer.get_vocab_size(), vq)
        parts = wiring.build_model(cfg, self.ps, self.schedule, vocab, self.device)
        self.llm_cfg, self.split = parts.llm_cfg, parts.split
        self.stage, self.encoders = parts.stage, parts.encoders
        self.model, self.optimizer, self.memory = parts.model, parts.optimizer, parts.memory
        self.sync_llm, self.sync_encoders = parts.sync_llm, parts.sync_encoders  # the executor's hook's
        self._step_media: frozenset[str] | None = None  # the running step's StepInputs.media (None: all)
        self._step_towers: dict[int, frozenset[str]] = {}  # per encoder microbatch here: towers it runs
        self.sharding = wiring.cp_sharding(cfg, self.ps, self.llm_cfg)
        flow = wiring.data_flow(cfg, self.ps, self.schedule, self.llm_cfg, self.split, self.sharding)
        self.flow, self.planner = flow.flow, flow.planner
        self.stream = wiring.step_stream(self.cfg, self.tokenizer, self.ps, flow.consumes, self.sharding, vq)
        self.builder = wiring.step_builder(
            cfg, self.ps, self.tokenizer, parts, self.schedule, self.flow, self.sharding, self.device
        )
        self.groups, self.executor = wiring.executor(
            cfg, self.ps, parts, self.sharding, self.device, reduce_gradients=self._reduce_gradients
        )
        # LLM ZeRO 1-3: each block's gradient collective issued during its stage's last backward
        self.executor.before_last_backward = self.sync_llm.arm
        # each encoder tower's gradient collectives issued once its last backward here has run
        self.executor.encoder_backwards_left = self._encoder_backwards_left
        self.watchdog = wiring.watchdog(cfg, self.ps, self.executor)  # started with the loop
        self.checkpoint = wiring.checkpoint(cfg, self.out, self.ps, parts, self.stream)
        self.metrics = wiring.step_metrics(cfg, self.ps, parts, self.device)
        self.skips = wiring.skip_metrics(self.ps, self.stream)
        self.guard = numerics_guard(cfg.train, self.ps, dict(self.encoders.towers.items()), self.device)
        # rank 0 with [model.image_tokenizer]: a child draws samples/step-N.png per committed checkpoint
        self.samples = SampleWriter.for_rank(cfg, self.out, self.rank)

    # -- the loop -----------------------------------------------------------------------------------------
    def run(
        self, *, after_backward: Callable[[int, StepInputs, StepResult], None] | None = None
    ) -> dict[str, Any]:
        """Train to ``train.steps`` (from the checkpoint with ``resume``); returns rank 0's run summary.

        ``after_backward(step, inputs, result)``, if given, runs on every rank once the step's gradients
        are reduced, before clipping and the optimizer step (tests read the gradients there).
        The loader's decode threads are stopped at the end and on error.
        """
        try:
            return self._run(after_backward)
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            self.stream.close()
            if self.samples is not None:
                self.samples.close()  # a grid's child still drawing after an error is stopped

    def _run(self, after_backward: Callable[[int, StepInputs, StepResult], None] | None) -> dict[str, Any]:
        total = self.cfg.train.steps
        start = self.checkpoint.restore(self.resume_step) if self.resume else self._fresh_start()
        self.skips.start()
        run = RunOutputs.open(
            self.out,
            self.cfg,
            self.rank,
            start,
            device=self.device,
            flow=self.flow if self.planner is None else None,  # a planned flow is per step, in the records
            restarts=restart_count(),
            set_aside=self.checkpoint.set_aside if self.resume_step is not None else None,
        )
        t_run, last = time.perf_counter(), None
        if self.watchdog is not None:
            self.watchdog.start()
        try:
            for step in range(start, total):
                if self.watchdog is not None:
                    self.watchdog.progress(step)
                result = self._train_step(step, run, after_backward)
                last = result if step == total - 1 else last
                if self._stop_requested(step + 1, run):
                    break
            if self.watchdog is not None:
                self.watchdog.stop()  # rank 0's summary below is no hang
            run.stop()
            self.checkpoint.close()
        except BaseException as exc:
            run.close_after(exc)
            raise
        run.close()
        elapsed, summary = time.perf_counter() - t_run, {}
        if self.rank == 0:
            done, skipped, numerics = self.checkpoint.steps(), self.skips.summary(), self.guard.summary()
            summary = run.summary(
                self.cfg, last, elapsed, start, checkpoints=done, skipped=skipped, numerics=numerics
            )
        dist.barrier()
        if self.samples is not None:  # after the barrier: the other ranks never wait for the last grid
            summary = self.samples.finish(self.checkpoint, summary)
        return summary

    def _train_step(
        self, step: int, run: RunOutputs, after_backward: Callable[[int, StepInputs, StepResult], None] | None
    ) -> StepResult:
        """One optimizer step: inputs, the pipeline step, clipping and AdamW, metrics, records, checkpoint."""
        # before the loader's thread starts on step + 1 below: zeroing and re-attaching the gradients is
        # short Python work that would otherwise wait on that thread for the GIL
        lr = self._start_step(step)
        t = time.perf_counter()
        fs = self._loader_step(step)
        flow = self.planner.flow(fs.step, fs.packs, fs.microbatches) if self.planner else None
        inputs = self.builder.build(fs, flow)
        self._step_media = inputs.media  # read by _reduce_gradients, the executor's hook
        self._step_towers = {e: self._towers_of(work) for e, work in inputs.encoder_work.items()}
        self.stream.prepare()  # step + 1 from here on, on the loader's thread (wiring.step_stream)
        data_s = time.perf_counter() - t
        self.memory.start_step()
        fns = self.builder.functions(inputs)
        pipeline_cpu = time.process_time()  # the step record's pipeline_cpu_s: CPU over the executor's step
        with self.memory.track():
            result = self.executor.step(
                inputs.plan,
                inputs.encoder_work,
                functions=dataclasses.replace(fns, loss=self.guard.wrap_loss(fns.loss)),  # loss watched
                gather_timelines=step == self.cfg.train.steps - 1,
                step=step,
            )
        pipeline_cpu = time.process_time() - pipeline_cpu
        if after_backward is not None:
            after_backward(step, inputs, result)
        t = time.perf_counter()
        grad_norm = self._clip()
        verdict = self.guard.verdict(step, grad_norm)  # the same on every rank
        numerics = act_on(verdict, self.guard, self.optimizer, self.checkpoint, self.rank)
        optimizer_s = time.perf_counter() - t
        self.stream.wait_prepared()  # skips found preparing step + 1 count in this step, as without it
        wall = time.perf_counter() - run.clock
        cpu = time.process_time() - run.cpu_clock  # this process's CPU seconds over the same interval
        phases = {"data": data_s, "optimizer": optimizer_s, "checkpoint": run.checkpoint_s}
        # one collective for the step's numbers, memory peaks, skip and image-code counts (step_metrics)
        codes, skips, peaks = self.stream.image_code_encodes, self.skips.local_total(), self.memory.peaks()
        row = self.metrics.reduce(
            inputs, result, wall, phases, peaks=peaks, skip_total=skips, image_code_encodes=codes
        )
        # [model.llm] moe: aux / z losses and expert load (one all-reduce over the world; {} without MoE)
        moe = moe_step_metrics(self.stage, self.llm_cfg, dist.group.WORLD)
        # the next step's clock starts here: logging and checkpoint count in it
        run.clock, run.cpu_clock = time.perf_counter(), time.process_time()
        # a save in flight during this step's CPU interval marks its records; an async save still running
        # now runs into the next step's too (run.save below marks that one when it saves)
        saving, run.saving = run.saving, self.checkpoint.saving()
        planned, merge = self.planner is not None, image_merge(self.cfg)
        cpus = (cpu, pipeline_cpu)
        run.write_records(
            self.ps, step, fs, inputs, result, wall, image_merge=merge, planned=planned, cpu_s=cpus,
            checkpoint_save=saving,
        )  # fmt: skip
        skipped = self.skips.step(row["skip_total"])
        if self.rank == 0:
            metrics = self.metrics.row(inputs, row, lr, grad_norm)
            over_cap = run.planner_metrics(self.planner, self.cfg.parallel.planner_memory_cap_mib)
            extra = {**row["memory"], **skipped, **run.cp_metrics(self.sharding), **over_cap, **numerics}
            run.log(step, {**metrics, **extra, **moe})
        stop = self.guard.stop_error(verdict)
        if stop is not None:  # after the step's metrics, before its checkpoint
            self.checkpoint.close()  # the save in flight commits: a resume starts from it
            raise stop
        run.save(self.checkpoint, step + 1, self.samples)  # and the omni-gen grids' child, once committed
        run.profiler.step()
        return result

    def _stop_requested(self, done: int, run: RunOutputs) -> bool:
        """After ``done`` steps: whether any rank received a stop signal by the step's gradient reduction
        (the counts its all-reduce carried; the same answer on every rank); if so, checkpoint ``done`` is
        committed before it returns."""
        agreed = self.stop.adopt(self.guard.carried) if self.stop is not None else None
        if agreed is None:
            return False
        if not self.checkpoint.due(done):  # a due one was saved with the step
            run.writes.drain()  # the steps before the checkpoint are on disk before it commits
            self.checkpoint.save(done)
        self.checkpoint.close()  # committed (synchronously) before rank 0 reports it
        self.stopped = StopReport(agreed.name, done)
        return True

    def _fresh_start(self) -> int:
        self.stream.reset()
        return 0

    @record_function("omni_train.load_step")
    def _loader_step(self, step: int) -> FilteredStep:
        fs = next(self.stream)
        if fs.step != step:
            raise RuntimeError(f"rank {self.rank}: the loader is at step {fs.step}, the trainer at {step}")
        return fs

    def _start_step(self, step: int) -> float:
        """Set this step's learning rate and zero the gradients (the executor accumulates into them)."""
        lr = lr_at(step, self.cfg.train.steps, self.cfg.optim)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.sync_encoders.attach()  # ZeRO 0: encoder gradients accumulate into flat buffers (no copies)
        self.sync_llm.attach()  # LLM ZeRO 1-3: the step's one all-gather, before its first LLM forward
        return lr

    @record_function("omni_train.clip_grad_norm")
    def _clip(self) -> float:
        return clip_grad_norm_(
            list(self.stage.parameters()),
            list(self.encoders.parameters()),
            self.cfg.optim.grad_clip,
            self.ps.group("pp") if self.pp > 1 else None,
        )

    def _towers_of(self, work: Any) -> frozenset[str]:
        """The towers this rank runs for one encoder microbatch (its ``EncoderWork``): each of its whole
        payloads' (a routed modality's target: a video's is ``image``) and, with long-short SP, the long
        samples' (``ModalityRouter.forward`` calls exactly these)."""
        router = self.encoders
        towers = {router.tower_of(p.meta.modality) for p in work.short}
        if work.long:
            towers.add(router.tower_of(work.long[0].meta.modality))
        return frozenset(towers)

    def _encoder_backwards_left(self, later: tuple[int, ...]) -> None:
        """The executor's hook (``PipelineExecutor.encoder_backwards_left``): the towers that none of this
        rank's encoder backwards still to come in the step run are done here, and their gradient
        collectives are issued (``EncoderGradientSync.ready``; in one order on every rank, whatever the
        rank's encoder work, so a rank with none issues them all when the step starts). A microbatch
        without its work here counts as running every tower."""
        names = list(self.encoders.towers)
        busy: set[str] = set()
        for e in later:
            busy |= self._step_towers.get(e, frozenset(names))
        self.sync_encoders.ready([n for n in names if n not in busy], self._step_media)

    @record_function("omni_train.reduce_gradients")
    def _reduce_gradients(self) -> float:
        """The LLM's and the encoders' gradient sync; returns the seconds spent first waiting for every
        rank to arrive (a small all-reduce over the world, which every rank's sync waits for anyway: the
        slowest rank's last backward; it carries the numerics guard's flags), so that
        ``time_s_per_rank`` tells the pipeline's drain imbalance (``reduce_wait``) from the collectives'
        own cost (``grad_reduce``)."""
        # every encoder backward is through: what is left of the towers' collectives is issued now, on
        # their own group, so it runs while this rank waits below and the LLM's gradients are reduced
        self.sync_encoders.ready(list(self.encoders.towers), self._step_media)
        # wait_for_ranks' all-reduce, carrying the step's numerics flags and the stop-signal counts
        wait = self.guard.reduce(self.stop.counts() if self.stop is not None else ())
        self.sync_llm()
        self.sync_encoders(self._step_media)  # towers that ran nowhere this step have zeros to sum
        return wait
