"""The trainer: every package wired into one training loop, run by each worker process.

Per rank (DESIGN.md §omni-train; MegaScale-Omni §3-§5; ARCHITECTURE.md draws the flow):

* ``ParallelState`` (omni-parallel) creates every process group, in one place and order (the loader's,
  reordering, encoder P2P and hybrid DP/CP ones too: :meth:`Trainer._group_spec`).
* The model: this pipeline rank's LLM stages (one :class:`~omni_train.models.LLMStage` per virtual stage,
  together a :class:`~omni_train.pipeline.RankStages`) and the encoders (encoder data parallelism spans
  every rank: whole on every rank, or FSDP2-sharded with ``parallel.encoder_zero`` 2 or 3), parallelised
  by :mod:`omni_train.parallelize` (TP, activation checkpointing, compile, and the gradient sync that
  defines the objective's reduction).
* Encoder work (:mod:`omni_pipeline.encoder_parallel`): grouped reordering across DP replicas
  (``data.reorder_group_size``), long-short SP over the stage's LLM sequence group (``parallel.encoder_sp``,
  ``parallel.long_threshold``) and resharding of the outputs into the LLM's sequence layout.
  TP and Ulysses peers of a stage read the same packs (the loader reads on their rank 0 and broadcasts);
  stage ``s`` TP/SP rank ``t`` talks to stage ``s + 1`` TP/SP rank ``t``.
* The data pipeline (:mod:`omni_train.data_pipeline`): every rank of a pipeline builds the same packs from
  metadata; this rank decodes only the payloads of the encoder microbatches the data flow places on it.
* omni-pipeline: the schedule ``parallel.schedule`` names (1F1B, GPipe or interleaved 1F1B with
  ``parallel.virtual_stages`` stages per rank: :mod:`omni_train.pipeline`), a data flow from the
  placement policy (``uniform_on_demand`` by default), an :class:`EncoderAnchor` holding the encoders, and
  the :class:`PipelineExecutor` running each step over real point-to-point transfers (encoder transfers
  on a group of their own).
* Activation memory (:mod:`omni_parallel.activation_memory`): recompute and offload per block family, and
  the peak of saved activations per rank and step in the metrics; ``train.dtype = "bfloat16"``: autocast
  over float32 master parameters (:func:`omni_parallel.parallelize.apply_mixed_precision`).
* Each step: learning rate, gradients zeroed (ZeRO-0 encoder gradients re-attached to their flat
  buffers) -> the loader's step -> :class:`~omni_pipeline.StepInputs` (a value; the executor's
  callables close over it) -> executor step -> gradient clipping -> AdamW (:mod:`omni_train.optim`) ->
  metrics (:mod:`omni_train.step_metrics`) -> checkpoint (:mod:`omni_train.checkpointing`). A step's
  wall clock runs from the end of the previous step's metrics reduction, so the previous checkpoint save
  counts in it; where it went, per rank and phase, is ``time_s_per_rank`` in ``metrics.jsonl``.
* Per-action records: every compute action of every step (from the executor's timeline, with its token
  counts in :func:`omni_pipeline.action_tokens`'s convention), the receives waited for and each
  step's wall time go to ``<run>/actions.jsonl`` (:mod:`omni_pipeline.records`; the first DP replica's
  pipeline, gathered on rank 0), which ``omni-train simulate --calibration`` fits a cost model from.
* Bad data: a sample whose image/audio body did not decode (omni-data's zero placeholder,
  ``Payload.error``) keeps its place in its pack; its targets are masked and it is counted per step
  (``skipped_payloads``). Everything the loader skipped (metadata and payloads) is reduced over the ranks
  each step by :class:`~omni_train.skip_metrics.SkipMetrics` into ``metrics.jsonl`` and ``summary.json``.

Determinism: one intra-op thread per process, parameters initialised from seeded private generators, no
dropout, data order from seeded shard shuffles and the deterministic mixture; a resumed run therefore
reproduces the uninterrupted run's losses step for step on CPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from omni_data import Modality, encoder_microbatch_ids
from omni_data.zero_redundancy import FilteredStep
from omni_parallel import GroupSpec, ParallelConfig, ParallelState, ReshardMode, mesh_device_type
from omni_parallel.encoder_zero import state_bytes
from omni_parallel.flops import matmul_params, measure_peak_flops
from omni_parallel.grad_clip import clip_grad_norm_
from omni_parallel.parallelize import training_dtypes
from omni_pipeline import (
    RECORDS_FILE,
    CPSharding,
    CPSpec,
    EncoderAnchor,
    EncoderDataConfig,
    EncoderParallel,
    EncoderParallelConfig,
    FlowRecord,
    PipelineExecutor,
    RecordWriter,
    SequenceLayout,
    StepBuilder,
    StepInputs,
    StepPlanner,
    StepRecord,
    StepResult,
    StepSpec,
    action_records,
    action_tokens,
    build_cp_sharding,
    build_schedule,
    stage_weights,
    static_flow,
)
from omni_train.checkpointing import TrainCheckpoint
from omni_train.config import Placement, RunConfig, load_tokenizer
from omni_train.data_pipeline import build_step_stream
from omni_train.encoders import Encoders
from omni_train.launch import restart_count
from omni_train.metrics import MetricsLogger, finish_run
from omni_train.optim import build_optimizer, lr_at
from omni_train.parallelize import parallelize, pipeline_groups
from omni_train.pipeline import build_rank_stages, image_merge, llm_shape, planner_spec, stage_split
from omni_train.profiling import StepProfiler
from omni_train.run_writes import RunWrites
from omni_train.skip_metrics import SkipMetrics
from omni_train.step_metrics import StepMetrics

__all__ = ["Trainer", "worker_main"]


@dataclass
class _RunOutputs:
    """What one run writes to as it steps, and its step clock.

    Attributes:
        clock: when the current step's wall time started (``time.perf_counter``; the end of the previous
            step's metrics reduction, so its logging and checkpoint count in the next step).
        checkpoint_s: the previous step's checkpoint save, reported in this step's time breakdown.
    """

    logger: MetricsLogger
    records: RecordWriter | None
    profiler: StepProfiler
    clock: float
    checkpoint_s: float = 0.0
    writes: RunWrites = field(default_factory=RunWrites)  # rank 0's file writes, off the step


class Trainer:
    """One worker's training run (the default process group must be initialised).

    Args:
        cfg: the validated run config.
        out_dir: the run directory (shared by all ranks).
        resume: continue from the last committed checkpoint under ``out_dir/checkpoints`` (if any).
        resume_step: with ``resume``, continue from this committed step instead; newer ones are set aside
            (:meth:`omni_train.checkpointing.TrainCheckpoint.restore`).
    """

    def __init__(
        self, cfg: RunConfig, out_dir: Path, *, resume: bool, resume_step: int | None = None
    ) -> None:
        self.cfg, self.out, self.resume, self.resume_step = cfg, out_dir, resume, resume_step
        self.out.mkdir(parents=True, exist_ok=True)
        par = cfg.parallel
        self.ps = ParallelState.build(
            ParallelConfig(tp=par.tp, pp=par.pp, cp=par.cp, ulysses=par.ulysses, dp=par.dp),
            groups=self._group_spec(),  # every group of the run, here, in one order
        )
        self.reorder_group_size = self.ps.reorder_size
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.pp_rank, self.pp = self.ps.local_rank("pp"), self.ps.size("pp")
        self.dp, self.tp, self.sp = self.ps.size("dp"), self.ps.size("tp"), self.ps.size("ulysses")
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == self.pp - 1
        # The device CUDA tensors need for this world's collectives: "cuda" for NCCL or a mixed
        # "cpu:gloo,cuda:nccl" backend, "cpu" for gloo (get_backend() returns a mixed config whole).
        cuda = mesh_device_type() == "cuda"
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        )
        torch.manual_seed(cfg.train.seed)
        self.tokenizer = load_tokenizer(cfg.data)
        self.schedule = build_schedule(par.schedule, par.pp, cfg.data.microbatches, par.virtual_stages)
        self._build_model()
        self._build_pipeline()
        self._build_executor()
        self.checkpoint = TrainCheckpoint(
            self.out / "checkpoints",
            cfg.checkpoint,
            cfg.train.steps,
            self.model,
            self.optimizer,
            self.stream,
            ps=self.ps,
            fixed={"data.reorder_group_size": self.reorder_group_size},
        )
        self.metrics = StepMetrics(
            cfg,
            self.ps,
            llm=self.llm_cfg,
            llm_matmul=self._summed_over_stages(self._llm_matmul),
            encoder_matmul={k: matmul_params(t) for k, t in self.encoders.towers.items()},
            peak_flops=measure_peak_flops(self.device),
            encoder_bytes=lambda: state_bytes(self.encoders.towers.values(), self.optimizer),
        )
        self.skips = SkipMetrics(self.stream, self.ps)

    def _build_model(self) -> None:
        """This rank's LLM stage and encoders, parallelised in ``parallelize``'s order, and AdamW."""
        m, train = self.cfg.model, self.cfg.train
        self.llm_cfg = m.llm_config(self.tokenizer.get_vocab_size())
        self.dtype, self.compute_dtype = training_dtypes(train.dtype)  # parameters, forward/backward
        sp_group = self.ps.group("ulysses") if self.sp > 1 else None
        self.split = stage_split(self.cfg.parallel, self.llm_cfg, self.cfg.data.max_seq_len)
        self.stage = build_rank_stages(
            self.llm_cfg, self.schedule, self.pp_rank, seed=m.seed, sp_group=sp_group, split=self.split
        )
        self.stage.to(self.device, self.dtype)
        self.encoders = Encoders(m.vit, m.audio, self.llm_cfg.dim, seed=m.seed).to(self.device, self.dtype)
        self._llm_matmul = matmul_params(self.stage)  # before TP: global parameter counts
        par = parallelize(
            self.stage,
            self.encoders,
            self.ps,
            train,
            encoder_zero=self.cfg.parallel.encoder_zero,
            num_stages=self.schedule.num_stages,
            device=self.device,
        )
        self.memory, self.sync_llm, self.sync_encoders = par.memory, par.sync_llm, par.sync_encoders
        self._step_media: frozenset[str] | None = None  # the running step's StepInputs.media (None: all)
        self.model = nn.ModuleDict({"llm": self.stage, "encoders": self.encoders})
        self.optimizer = build_optimizer([self.stage, self.encoders], self.cfg.optim)

    def _build_pipeline(self) -> None:
        """Schedule, data flow and the loader (which reads only what the flow runs on this rank)."""
        cfg, par = self.cfg, self.cfg.parallel
        microbatches = cfg.data.microbatches
        self.sharding = self._build_cp_sharding()
        encoder_inputs = encoder_microbatch_ids(microbatches, self.pp)
        weights = stage_weights(llm_shape(self.llm_cfg), self.split, cfg.data.max_seq_len)
        self.flow = static_flow(
            par.placement,
            self.schedule,
            encoder_inputs,
            weights,
            encoder_forward_share=par.encoder_forward_share,
        )
        self.planner: StepPlanner | None = None
        self._said_over_cap = False
        consumes: Any = set(self.flow.encoders_on(self.pp_rank))
        if par.placement == Placement.PLANNED:
            if self.sharding is None and self.reorder_group_size == 1:
                self.planner = StepPlanner(
                    planner_spec(cfg), self.schedule, encoder_inputs, weights, self.pp_rank
                )
                consumes = self.planner.consumes  # each step's flow, planned from its metadata
            elif self.rank == 0:
                print(
                    "omni-train: placement planned: the flow is planned once, ranks fixed (CP or reordering "
                    "across DP pair the same encoder microbatches on every step); parallel.planner_* do not "
                    "apply",
                    file=sys.stderr,
                )
        tp_or_sp = self.ps.group("tp") if self.tp > 1 else (self.ps.group("ulysses") if self.sp > 1 else None)
        options: dict[str, Any] = dict(
            dp_rank=self.ps.local_rank("dp"),
            dp_size=self.dp,
            dp_group=self.ps.loader_dp_group,  # the loader's thread has a DP group of its own
            consumes=consumes,
            read_text=self.is_first or self.is_last,
            # TP and Ulysses peers need identical packs: their rank 0 reads, the others get a broadcast
            # (validation refuses tp > 1 with ulysses > 1).
            tp_group=tp_or_sp,
            background=True,  # the next step's metadata (and plan) is made while this one trains,
            # from when this step's inputs are built (_train_step): both are Python, and a second thread
            # running then takes turns at the GIL with the input building instead of with the compute
            prepare_on_request=True,
        )
        self.stream = build_step_stream(cfg, self.tokenizer, **(options | self._cp_stream_options()))

    def _group_spec(self) -> GroupSpec:
        """The run's optional groups: the loader's DP copy, encoder P2P, the hybrid DP/CP blocks and the
        reordering groups across DP (``data.reorder_group_size``, ``None``: the node's replicas; 1 with
        ``parallel.reorder`` off and under CP, where validation refuses larger groups)."""
        par = self.cfg.parallel
        reorder = par.reorder and par.cp == 1 and not par.hybrid_cp
        size = self.cfg.data.reorder_group_size if reorder else 1
        return GroupSpec(loader_dp=True, reorder_group_size=size, encoder_p2p=True, hybrid_cp=par.hybrid_cp)

    def _build_cp_sharding(self) -> CPSharding | None:
        """CP or hybrid DP/CP layout (``omni_pipeline.cp_delivery``; its groups are ``self.ps``'s)."""
        cfg, par = self.cfg, self.cfg.parallel
        spec = CPSpec(
            par.cp_attention,
            hybrid=par.hybrid_cp,
            max_tokens=cfg.data.max_seq_len,
            attention_len=6 * self.llm_cfg.dim,
            microbatches=cfg.data.microbatches,
            slices=self.pp,
            balance=par.reorder,
            encoder_sp=par.encoder_sp if par.cp > 1 and not par.hybrid_cp else 1,
        )
        return build_cp_sharding(self.ps, spec)

    def _pack_tokens(self) -> int:
        """Pack capacity: ``data.max_seq_len``, or under hybrid DP/CP the stage's share of ranks times it."""
        hybrid = self.sharding is not None and self.sharding.hybrid
        return self.cfg.data.max_seq_len * (self.sharding.size if hybrid else 1)

    def _cp_stream_options(self) -> dict[str, Any]:
        """The loader under CP: each CP rank reads only the media it encodes; hybrid DP/CP ranks of a stage
        share one stream of ``dp * cp`` times larger packs and read only the text of their samples."""
        sh = self.sharding
        if sh is None:
            return {}
        if sh.encoder_sp > 1:
            # Long-short SP over the CP group: every CP rank needs the long images' pixels, so CP rank 0
            # reads whole encoder microbatches and broadcasts them to its CP peers, as for Ulysses.
            return {"tp_group": self.ps.group("cp")}
        if not sh.hybrid:
            return {"share": sh.share}
        return {
            "share": sh.share,
            "text_share": sh.text_share,
            "pack_tokens": self._pack_tokens(),
            "dp_rank": 0,
            "dp_size": 1,
            "dp_group": None,
        }

    def _build_executor(self) -> None:
        """The encoder anchor, the step builder and the executor over this rank's groups."""
        cfg = self.cfg
        anchor = EncoderAnchor(
            dict(self.encoders.towers.items()),
            EncoderParallelConfig(zero_stage=cfg.parallel.encoder_zero),
            EncoderDataConfig(max_seq_len=self._pack_tokens() * cfg.data.microbatches),
        )
        spec = StepSpec(
            {Modality.IMAGE: self._special("<|image|>"), Modality.AUDIO: self._special("<|audio|>")},
            self.llm_cfg.dim,
            self.compute_dtype,
            self.device,
            builds_text=self.is_first or self.is_last,
            sp=self.sp,
            sp_rank=self.ps.local_rank("ulysses"),
        )
        self.builder = StepBuilder(
            spec,
            schedule=self.schedule,
            flow=self.flow,
            encoders=self.encoders,
            pp_group=self.ps.group("pp") if self.pp > 1 else None,
            dp_group=self.ps.group("dp") if self.dp > 1 and not self.cfg.parallel.hybrid_cp else None,
            parallel=self._encoder_parallel(),
            cp=self.sharding,
            cp_group=self._cp_group(),
        )
        self.groups = pipeline_groups(self.ps)
        self.executor = PipelineExecutor(
            self.stage.chunks,
            anchor,
            None,  # per step: builder.functions(inputs), closures over that step's inputs
            self.groups,
            device=self.device,
            reduce_gradients=self._reduce_gradients,
        )

    def _planner_metrics(self) -> dict[str, float]:
        """Per-step ``planned`` with ``parallel.planner_memory_cap_mib``: ``planner_over_cap_bytes``, the
        step's plan's modelled bytes over the cap (0 when it holds), said once on stderr when it first
        does not."""
        if self.planner is None or self.planner.memory_cap_bytes is None:
            return {}
        over = self.planner.over_cap_bytes
        if over > 0 and not self._said_over_cap:
            self._said_over_cap = True
            print(
                f"omni-train: planned: no placement keeps every rank under parallel.planner_memory_cap_mib = "
                f"{self.cfg.parallel.planner_memory_cap_mib} (modelled); the step's plan is {over / 2**20:.1f} "
                "MiB over it (planner_over_cap_bytes in metrics.jsonl)",
                file=sys.stderr,
            )
        return {"planner_over_cap_bytes": over}

    def _cp_metrics(self) -> dict[str, int]:
        """Hybrid DP/CP: ``hybrid_cp_raised_caps``, the packs so far planned above ``data.max_seq_len``
        tokens per rank (``CPSharding.raised_caps``; the same on every rank of a stage, which all plan every
        pack)."""
        if self.sharding is None or not self.sharding.hybrid:
            return {}
        return {"hybrid_cp_raised_caps": self.sharding.raised_caps}

    def _cp_group(self) -> dist.ProcessGroup | None:
        """The ranks of a stage that share its packs under CP: the CP group, or dp_cp for hybrid DP/CP."""
        if self.sharding is None:
            return None
        return self.ps.group("dp_cp" if self.sharding.hybrid else "cp")

    def _encoder_parallel(self) -> EncoderParallel:
        """The encoders' groups (:mod:`omni_pipeline.encoder_parallel`): the stage's LLM sequence group,
        and the reordering group across DP (``self.ps.reorder_group``; ``None``: no reordering)."""
        par = self.cfg.parallel
        sp, mode, name = self.ps.size("ulysses"), ReshardMode.ULYSSES, "ulysses"
        if self.sharding is not None:
            # encoder_sp = cp: long-short SP over the CP group in its head-tail layout (cp_sharding's
            # module docstring); else cp_sharding splits and delivers, the encoders see no SP group.
            sp, mode, name = self.sharding.encoder_sp, ReshardMode.CP, "cp"
        return EncoderParallel(
            SequenceLayout(mode if sp > 1 else None, sp),
            sp_group=self.ps.group(name) if sp > 1 else None,
            sp_rank=self.ps.local_rank(name) if sp > 1 else 0,
            encoder_sp=par.encoder_sp,
            long_threshold=par.long_threshold,
            reorder_group=self.ps.reorder_group,
        )

    def _special(self, token: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer {self.cfg.data.tokenizer}: special token {token} is missing")
        return i

    @record_function("omni_train.reduce_gradients")
    def _reduce_gradients(self) -> float:
        """The LLM's and the encoders' gradient sync; returns the seconds spent first waiting for every
        rank to arrive (a one-element all-reduce over the world, which every rank's sync waits for
        anyway: the slowest rank's last backward), so that ``time_s_per_rank`` tells the pipeline's
        drain imbalance (``reduce_wait``) from the collectives' own cost (``grad_reduce``)."""
        start = time.perf_counter()
        if self.world > 1:
            dist.all_reduce(torch.zeros(1, device=self.device))
            if self.device.type == "cuda":  # the collective is asynchronous to the host there
                torch.cuda.synchronize(self.device)
        wait = time.perf_counter() - start
        self.sync_llm()
        self.sync_encoders(self._step_media)  # towers that ran nowhere this step have zeros to sum
        return wait

    def _summed_over_stages(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64)
        if self.pp > 1:
            dist.all_reduce(t, group=self.ps.group("pp"))
        return float(t)

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
            self.stream.close()

    def _run(self, after_backward: Callable[[int, StepInputs, StepResult], None] | None) -> dict[str, Any]:
        total = self.cfg.train.steps
        start = self.checkpoint.restore(self.resume_step) if self.resume else self._fresh_start()
        run = self._open_run(start)
        t_run, last = time.perf_counter(), None
        try:
            for step in range(start, total):
                result = self._train_step(step, run, after_backward)
                last = result if step == total - 1 else last
            run.profiler.stop()
            run.writes.close()
            self.checkpoint.close()
        except BaseException as exc:
            _close_after(exc, run)
            raise
        run.logger.close()
        if run.records is not None:
            run.records.close()
        summary = self._finish(last, time.perf_counter() - t_run, start) if self.rank == 0 else {}
        dist.barrier()
        return summary

    def _open_run(self, start: int) -> _RunOutputs:
        """The run's outputs from ``start`` on (metrics, records, profiler), the resolved config and the
        run's data flow (planned per step: each step's is in ``actions.jsonl``), and a restart notice
        under torchrun's elastic agent (or, after ``resume_step``, a notice naming what was set aside)."""
        self.skips.start()
        restarts = restart_count()
        if restarts and self.rank == 0:
            of = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
            print(f"omni-train: restarted ({restarts} of {of}), resuming from step {start}", file=sys.stderr)
        if self.resume_step is not None and self.rank == 0:  # renamed directories are not silent
            aside = ", ".join(self.checkpoint.set_aside) or "none (it was the newest)"
            print(
                f"omni-train: rolled back to step {start}; newer steps set aside (kept): {aside}",
                file=sys.stderr,
            )
        logger = MetricsLogger(self.out, self.cfg.train.steps, start, enabled=self.rank == 0)
        records = self._record_writer(start)
        if self.rank == 0:
            (self.out / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2))
            if self.planner is None:
                (self.out / "dataflow.json").write_text(self.flow.to_json())
        profiler = StepProfiler(
            self.out,
            self.rank,
            self.cfg.train.profile_steps,
            first_step=start,
            total_steps=self.cfg.train.steps,
            device=self.device,
        ).start()
        return _RunOutputs(logger, records, profiler, clock=time.perf_counter())

    def _train_step(
        self,
        step: int,
        run: _RunOutputs,
        after_backward: Callable[[int, StepInputs, StepResult], None] | None,
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
        self.stream.prepare()  # step + 1 from here on, on the loader's thread (see __init__)
        data_s = time.perf_counter() - t
        self.memory.start_step()
        with self.memory.track():
            result = self.executor.step(
                inputs.plan,
                inputs.encoder_work,
                functions=self.builder.functions(inputs),
                gather_timelines=step == self.cfg.train.steps - 1,
                step=step,
            )
        if after_backward is not None:
            after_backward(step, inputs, result)
        t = time.perf_counter()
        grad_norm = self._clip()
        self.optimizer.step()
        optimizer_s = time.perf_counter() - t
        self.stream.wait_prepared()  # skips found preparing step + 1 count in this step, as without it
        wall = time.perf_counter() - run.clock
        phases = {"data": data_s, "optimizer": optimizer_s, "checkpoint": run.checkpoint_s}
        # one collective for the step's numbers, memory peaks and skip count (step_metrics)
        row = self.metrics.reduce(
            inputs, result, wall, phases, peaks=self.memory.peaks(), skip_total=self.skips.local_total()
        )
        run.clock = (
            time.perf_counter()
        )  # the next step's clock starts here: logging and checkpoint count in it
        self._write_records(run, step, fs, inputs, result, wall)
        skipped = self.skips.step(row["skip_total"])
        if self.rank == 0:
            metrics = self.metrics.row(inputs, row, lr, grad_norm)
            extra = {**row["memory"], **skipped, **self._cp_metrics(), **self._planner_metrics()}
            run.writes.submit(f"{run.logger.path}, step {step}", run.logger.log, step, {**metrics, **extra})
        run.checkpoint_s = 0.0
        if self.checkpoint.due(step + 1):
            t = time.perf_counter()
            run.writes.drain()  # the steps before the checkpoint are on disk before it commits
            self.checkpoint.save(step + 1)
            run.checkpoint_s = time.perf_counter() - t
        run.profiler.step()
        return result

    def _record_writer(self, start: int) -> RecordWriter | None:
        """Rank 0: the writer of ``actions.jsonl``, cut back to the steps before ``start`` (a resumed run
        then holds one history, as ``metrics.jsonl``); other ranks: ``None``.

        A last line cut short (the run was killed while writing it) is of a step after the last
        checkpoint (records are written before the step's checkpoint) and goes with them.

        Raises:
            ValueError: a line before the last is not a JSON record (names the file and line).
        """
        if self.rank != 0:
            return None
        path = self.out / RECORDS_FILE
        if path.exists():
            lines, kept = path.read_text().splitlines(), []
            for n, line in enumerate(lines, start=1):
                try:
                    step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    if n == len(lines):
                        break
                    raise ValueError(
                        f"{path}:{n}: not a record of a step; cannot resume its records"
                    ) from None
                if step < start:
                    kept.append(line)
            path.write_text("".join(line + "\n" for line in kept))
        return RecordWriter(path)

    def _write_records(
        self,
        run: _RunOutputs,
        step: int,
        fs: FilteredStep,
        inputs: StepInputs,
        result: StepResult,
        wall: float,
    ) -> None:
        """This step's per-action, receive and step records of every rank of global rank 0's pipeline (the
        first DP replica's; TP/SP/CP rank 0), gathered to rank 0 over that pipeline group (collective over
        it) and queued on rank 0's writes (:class:`RunWrites`). Other ranks record nothing."""
        if any(self.ps.local_rank(a) for a in ("dp", "tp", "cp", "ulysses")):
            return
        llm, enc = action_tokens(inputs.packs, fs.microbatches, image_merge=image_merge(self.cfg))
        mine: list[Any] = action_records(step, result.timeline, llm, enc, result.waits)
        end = max((ev.end_s for ev in result.timeline), default=0.0)
        mine += [*result.p2p, StepRecord(step, self.pp_rank, wall, end)]
        if self.planner is not None and self.pp_rank == 0:
            mine.append(FlowRecord(step, inputs.plan.flow.to_json()))
        gathered: list[Any] | None = [mine]
        if self.pp > 1:
            gathered = [None] * self.pp if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0, group=self.ps.group("pp"))
        if run.records is not None and gathered is not None:
            records = [r for rank in gathered for r in rank]
            run.writes.submit(f"{run.records.path}, step {step}", run.records.write, records)

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
        return lr

    @record_function("omni_train.clip_grad_norm")
    def _clip(self) -> float:
        return clip_grad_norm_(
            list(self.stage.parameters()),
            list(self.encoders.parameters()),
            self.cfg.optim.grad_clip,
            self.ps.group("pp") if self.pp > 1 else None,
        )

    def _finish(self, last: StepResult | None, elapsed: float, start: int) -> dict[str, Any]:
        title = f"{self.cfg.name}: last step, {self.cfg.parallel.placement}"
        timelines = last.timelines if last is not None else None
        return finish_run(
            self.out,
            self.cfg.name,
            timelines,
            title,
            elapsed,
            start,
            checkpoints=self.checkpoint.steps(),
            skipped=self.skips.summary(),
        )


def _close_after(error: BaseException, run: _RunOutputs) -> None:
    """After ``error`` stopped the run: the queued writes of the steps that finished reach disk, the writes
    thread stops and the run's files are closed; what fails meanwhile is added to ``error`` as a note (it
    stays the error raised)."""
    closes = [run.writes.close, run.logger.close] + ([run.records.close] if run.records is not None else [])
    for close in closes:
        try:
            close()
        except Exception as also:  # not raised: the error that stopped the run stays the one raised
            if also is not error:
                error.add_note(f"omni-train: also, while closing the run's files: {also!r}")


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
