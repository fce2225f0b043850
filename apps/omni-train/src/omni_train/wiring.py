"""The run config mapped to the packages' specs and objects: plain functions the trainer calls in order.

Each function reads the :class:`~omni_train.config.RunConfig` fields it names and returns a package object
(or a small typed bundle of them); none runs inside a step. The trainer calls them in this module's order,
which is the order the ranks create groups, draw parameters from seeded generators and start the loader:

1. :func:`parallel_state`: every process group of the run (``omni_parallel.ParallelState.build``, one
   place, one order: the loader's DP copy, encoder P2P, hybrid DP/CP blocks, reordering across DP).
2. :func:`training_device`, then :func:`build_model`: this pipeline rank's LLM stages and the encoders,
   parallelised (:func:`omni_train.parallelize.parallelize`: TP, activation checkpointing, compile,
   offload, mixed precision, the gradient syncs), the MoE losses' scale, and AdamW.
3. :func:`cp_sharding`, :func:`data_flow`, :func:`step_stream`: CP / hybrid-CP delivery
   (``omni_pipeline.cp_delivery``), the data flow of the placement policy (or the per-step planner of
   ``placement = "planned"``), and the loader, which reads only what the flow runs on this rank.
4. :func:`step_builder`, :func:`executor`: the step-input bridge (``omni_pipeline.StepBuilder`` with the
   encoders' groups of :func:`encoder_parallel`) and the pipeline executor over the encoder anchor.
5. :func:`checkpoint`, :func:`step_metrics`, :func:`skip_metrics`: the run's checkpoint, per-step metrics
   (``omni_pipeline.step_metrics``) and the loader's skips over all ranks (``omni_data.SkipMetrics``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from torch import nn

from omni_data import Modality, encoder_microbatch_ids
from omni_data.skip_metrics import SkipMetrics
from omni_data.zero_redundancy import ZeroRedundancyFilter
from omni_parallel import GroupSpec, ParallelConfig, ParallelState, ReshardMode, mesh_device_type
from omni_parallel.activation_memory import ActivationMemory
from omni_parallel.flops import matmul_params, measure_peak_flops
from omni_parallel.llm_zero import LLMGradientSync, reshard_after_forward
from omni_parallel.memory import state_bytes
from omni_parallel.moe import update_expert_bias
from omni_parallel.parallelize import EncoderGradientSync, training_dtypes
from omni_parallel.watchdog import Watchdog, WatchdogSpec, default_store_client
from omni_pipeline import (
    CPSharding,
    CPSpec,
    DataFlow,
    EncoderAnchor,
    EncoderDataConfig,
    EncoderParallel,
    EncoderParallelConfig,
    PipelineExecutor,
    PipelineGroups,
    PlacementPolicy,
    Schedule,
    SequenceLayout,
    StepBuilder,
    StepPlanner,
    StepSpec,
    build_cp_sharding,
    stage_weights,
    static_flow,
)
from omni_pipeline.step_metrics import StepMetrics
from omni_train.checkpointing import TrainCheckpoint
from omni_train.config import RunConfig
from omni_train.data_pipeline import build_step_stream
from omni_train.encoders import Encoders
from omni_train.launch import report_dir, restart_count
from omni_train.models import LLMConfig
from omni_train.models.llm import moe_forwards_per_step, set_moe_loss_scale, set_moe_pack_group
from omni_train.optim import build_optimizer
from omni_train.parallelize import parallelize
from omni_train.pipeline import RankStages, build_rank_stages, llm_shape, planner_spec, stage_split
from omni_train.step_metrics import step_metrics_spec

__all__ = [
    "DataFlowParts",
    "ModelParts",
    "build_model",
    "checkpoint",
    "cp_sharding",
    "data_flow",
    "encoder_parallel",
    "executor",
    "group_spec",
    "pack_tokens",
    "parallel_state",
    "skip_metrics",
    "step_builder",
    "step_metrics",
    "step_stream",
    "training_device",
    "watchdog",
]


def group_spec(cfg: RunConfig) -> GroupSpec:
    """The run's optional groups: the loader's DP copy, encoder P2P, the encoders' gradient-reduction
    group, the hybrid DP/CP blocks, the data mesh of LLM ZeRO with TP, the checkpoint manager's gloo group and the reordering groups across DP (``data.reorder_group_size``, ``None``: the node's replicas; 1 with
    ``parallel.reorder`` off and under CP, where validation refuses larger groups)."""
    par = cfg.parallel
    reorder = par.reorder and par.cp == 1 and not par.hybrid_cp
    size = cfg.data.reorder_group_size if reorder else 1
    return GroupSpec(
        loader_dp=True,
        reorder_group_size=size,
        encoder_p2p=True,
        hybrid_cp=par.hybrid_cp,
        checkpoint=True,
        expert_dp=par.ep > 1,
        data_mesh=bool(par.llm_zero) and par.tp > 1,  # LLM ZeRO over TP: FSDP2's 2-D (dp_cp, tp) mesh
        encoder_sync=True,
    )


def parallel_state(cfg: RunConfig, *, checkpoint_group: bool = True) -> ParallelState:
    """Every process group of the run, in one order (collective: every rank of the default group calls
    it); ``checkpoint_group=False`` leaves out the checkpoint's gloo group (the memory plan over torch's
    fake backend, which cannot build a gloo group). Raises as :meth:`omni_parallel.ParallelState.build`
    (sizes that do not multiply to the world)."""
    par = cfg.parallel
    spec = group_spec(cfg)
    return ParallelState.build(
        ParallelConfig(tp=par.tp, pp=par.pp, cp=par.cp, ulysses=par.ulysses, ep=par.ep, dp=par.dp),
        groups=spec if checkpoint_group else dataclasses.replace(spec, checkpoint=False),
        timeout=timedelta(seconds=cfg.train.collective_timeout_s),
    )


def training_device() -> torch.device:
    """The device CUDA tensors need for this world's collectives: ``cuda:LOCAL_RANK`` for NCCL or a mixed
    ``"cpu:gloo,cuda:nccl"`` backend, ``cpu`` for gloo (``get_backend()`` returns a mixed config whole)."""
    if mesh_device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


@dataclass(frozen=True)
class ModelParts:
    """This rank's model, as :func:`build_model` builds it.

    Attributes:
        llm_cfg: the LLM's config (vocabulary set from the tokenizer).
        dtype, compute_dtype: the parameters' (master) dtype and the forward/backward dtype.
        split: the LLM layers of each stage of the whole pipeline (``pp * virtual_stages`` ranges).
        stage: this pipeline rank's LLM stages.
        encoders: the encoder towers (whole on every rank, or FSDP2-sharded under encoder ZeRO 2/3).
        model: ``{"llm": stage, "encoders": encoders}`` (the checkpoint's state dict).
        optimizer: AdamW over both.
        memory: the rank's activation accounting.
        sync_llm, sync_encoders: the gradient syncs that define the objective's reduction (a sum).
        llm_matmul: this rank's LLM matmul parameters before TP (global counts).
    """

    llm_cfg: LLMConfig
    dtype: torch.dtype
    compute_dtype: torch.dtype
    split: list[range]
    stage: RankStages
    encoders: Encoders
    model: nn.ModuleDict
    optimizer: torch.optim.Optimizer
    memory: ActivationMemory
    sync_llm: LLMGradientSync
    sync_encoders: EncoderGradientSync
    llm_matmul: int


def build_model(
    cfg: RunConfig, ps: ParallelState, schedule: Schedule, vocab_size: int, device: torch.device
) -> ModelParts:
    """This rank's LLM stages and encoders on ``device``, parallelised in
    :func:`omni_train.parallelize.parallelize`'s order, and AdamW (collective under TP and encoder ZeRO
    2/3). Parameters come from generators seeded with ``model.seed``.

    Raises:
        ValueError, ConfigError: as :func:`omni_train.pipeline.stage_split` (``parallel.stage_layers``
            that do not fit the layers, or a ``parallel.stage_calibration`` that cannot calibrate them).
    """
    m, train = cfg.model, cfg.train
    llm_cfg = m.llm_config(vocab_size)
    dtype, compute_dtype = training_dtypes(train.dtype)
    sp_group = ps.group("ulysses") if ps.size("ulysses") > 1 else None
    split = stage_split(cfg.parallel, llm_cfg, cfg.data.max_seq_len)
    # on "meta" (the memory plan, omni_train.memory_plan) the modules are made there: no values drawn
    with torch.device("meta") if device.type == "meta" else contextlib.nullcontext():
        ep = ps.group("ep") if ps.size("ep") > 1 else None  # parallel.ep: MoE experts sharded over it
        stage = build_rank_stages(
            llm_cfg, schedule, ps.local_rank("pp"), seed=m.seed, sp_group=sp_group, split=split, ep_group=ep
        )
        encoders = Encoders(m.vit, m.audio, llm_cfg.dim, seed=m.seed)
    stage.to(device, dtype)
    encoders.to(device, dtype)
    llm_matmul = matmul_params(stage)  # before TP: global parameter counts
    par = parallelize(
        stage,
        encoders,
        ps,
        train,
        encoder_zero=cfg.parallel.encoder_zero,
        llm_zero=cfg.parallel.llm_zero,
        llm_reshard_after_forward=reshard_after_forward(
            cfg.parallel.llm_reshard_after_forward, pp=cfg.parallel.pp, microbatches=cfg.data.microbatches
        ),
        sequence_parallel=cfg.parallel.sequence_parallel,
        async_tp=cfg.parallel.async_tp,
        num_stages=schedule.num_stages,
        device=device,
    )
    # [model.llm] moe: aux / z losses and loads of whole packs (reduced over the ranks sharing one: the
    # Ulysses or CP group, the dp_cp group under hybrid DP/CP), as coef x their mean over the step's packs
    # and MoE layers
    pack = "dp_cp" if cfg.parallel.hybrid_cp else ("cp" if ps.size("cp") > 1 else "ulysses")
    set_moe_pack_group(stage, ps.group(pack) if ps.size(pack) > 1 else None)
    forwards = moe_forwards_per_step(
        cfg.data.microbatches,
        world=ps.world_size,
        pp=ps.size("pp"),
        tp=ps.size("tp"),
        pack_ranks=ps.size(pack),
    )
    set_moe_loss_scale(stage, llm_cfg, forwards)
    model = nn.ModuleDict({"llm": stage, "encoders": encoders})
    optimizer = build_optimizer([stage, encoders], cfg.optim)
    if llm_cfg.moe is not None and llm_cfg.moe.bias_update_rate is not None:
        # [model.llm] moe.bias_update_rate: the routers' expert bias moved after every optimizer step by
        # the step's loads summed over the stage's data ranks (the same update on each of them)
        loads = ps.group("dp_cp") if ps.size("dp_cp") > 1 else None
        optimizer.register_step_post_hook(lambda *_: update_expert_bias([stage], loads))
    return ModelParts(
        llm_cfg, dtype, compute_dtype, split, stage, encoders, model, optimizer,
        par.memory, par.sync_llm, par.sync_encoders, llm_matmul,
    )  # fmt: skip


def cp_sharding(cfg: RunConfig, ps: ParallelState, llm_cfg: LLMConfig) -> CPSharding | None:
    """CP or hybrid DP/CP layout (``omni_pipeline.cp_delivery``; its groups are ``ps``'s); ``None``
    without CP."""
    par = cfg.parallel
    spec = CPSpec(
        par.cp_attention,
        hybrid=par.hybrid_cp,
        max_tokens=cfg.data.max_seq_len,
        attention_len=6 * llm_cfg.dim,
        microbatches=cfg.data.microbatches,
        slices=ps.size("pp"),
        balance=par.reorder,
        encoder_sp=par.encoder_sp if par.cp > 1 and not par.hybrid_cp else 1,
    )
    return build_cp_sharding(ps, spec)


@dataclass(frozen=True)
class DataFlowParts:
    """The run's data flow, as :func:`data_flow` builds it.

    Attributes:
        flow: the flow of ``parallel.placement`` (with ``planned`` and a planner: the flow of its
            first plan's placement; each step's own flow is the planner's).
        planner: the per-step planner of ``placement = "planned"``; ``None``: the flow is fixed.
        consumes: the encoder microbatch ids this pipeline rank runs, or the planner's per-step function
            of them (the loader's ``consumes``).
    """

    flow: DataFlow
    planner: StepPlanner | None
    consumes: Any


def data_flow(
    cfg: RunConfig,
    ps: ParallelState,
    schedule: Schedule,
    llm_cfg: LLMConfig,
    split: list[range],
    sharding: CPSharding | None,
) -> DataFlowParts:
    """The data flow of ``parallel.placement`` over ``schedule``, and with ``planned`` the per-step
    planner: only without CP and without reordering across DP (which pair the same encoder microbatches
    on every step; then rank 0 says on stderr that the flow is planned once).

    Raises:
        ConfigError: as :func:`omni_train.pipeline.planner_spec` (a bad planner calibration).
    """
    par, microbatches, pp_rank = cfg.parallel, cfg.data.microbatches, ps.local_rank("pp")
    encoder_inputs = encoder_microbatch_ids(microbatches, ps.size("pp"))
    weights = stage_weights(llm_shape(llm_cfg), split, cfg.data.max_seq_len)
    flow = static_flow(
        par.placement, schedule, encoder_inputs, weights, encoder_forward_share=par.encoder_forward_share
    )
    planner: StepPlanner | None = None
    consumes: Any = set(flow.encoders_on(pp_rank))
    if par.placement == PlacementPolicy.PLANNED:
        if sharding is None and ps.reorder_size == 1:
            planner = StepPlanner(planner_spec(cfg), schedule, encoder_inputs, weights, pp_rank)
            consumes = planner.consumes  # each step's flow, planned from its metadata
        elif ps.rank == 0:
            print(
                "omni-train: placement planned: the flow is planned once, ranks fixed (CP or reordering "
                "across DP pair the same encoder microbatches on every step); parallel.planner_* do not "
                "apply",
                file=sys.stderr,
            )
    return DataFlowParts(flow, planner, consumes)


def pack_tokens(cfg: RunConfig, sharding: CPSharding | None) -> int:
    """Pack capacity: ``data.max_seq_len``, or under hybrid DP/CP the stage's share of ranks times it."""
    hybrid = sharding is not None and sharding.hybrid
    return cfg.data.max_seq_len * (sharding.size if hybrid else 1)


def _cp_stream_options(cfg: RunConfig, ps: ParallelState, sharding: CPSharding | None) -> dict[str, Any]:
    """The loader under CP: each CP rank reads only the media it encodes; hybrid DP/CP ranks of a stage
    share one stream of ``dp * cp`` times larger packs and read only the text of their samples."""
    if sharding is None:
        return {}
    if sharding.encoder_sp > 1:
        # Long-short SP over the CP group: every CP rank needs the long images' pixels, so rank 0 of the
        # TP x CP group reads whole encoder microbatches and broadcasts them to its peers, as for Ulysses.
        return {"tp_group": ps.group("tp_cp")}
    if not sharding.hybrid:
        return {"share": sharding.share}
    return {
        "share": sharding.share,
        "text_share": sharding.text_share,
        "pack_tokens": pack_tokens(cfg, sharding),
        "dp_rank": 0,
        "dp_size": 1,
        "dp_group": None,
    }


def step_stream(
    cfg: RunConfig,
    tokenizer: Tokenizer,
    ps: ParallelState,
    consumes: Any,
    sharding: CPSharding | None,
    image_tokenizer: Any = None,
) -> ZeroRedundancyFilter:
    """This rank's loader (:func:`omni_train.data_pipeline.build_step_stream`), reading only what
    ``consumes`` runs on this pipeline rank, text only on the first and last stage; ``image_tokenizer``:
    the run's loaded one (default: loaded there)."""
    pp_rank, pp = ps.local_rank("pp"), ps.size("pp")
    # TP and Ulysses peers need identical packs: rank 0 of the TP x Ulysses group (tp_cp) reads, the
    # others get a broadcast; CP ranks read shares of their own, so under CP only TP peers share
    peers = "tp" if ps.size("cp") > 1 else "tp_cp"
    options: dict[str, Any] = dict(
        dp_rank=ps.local_rank("dp"),
        dp_size=ps.size("dp"),
        dp_group=ps.loader_dp_group,  # the loader's thread has a DP group of its own
        consumes=consumes,
        read_text=pp_rank == 0 or pp_rank == pp - 1,
        # an undecodable generation image is counted once: by the last stage (its labels), CP rank 0
        # unless hybrid DP/CP ranks read text shares of their own
        count_text_skips=pp_rank == pp - 1
        and (ps.local_rank("cp") == 0 or (sharding is not None and sharding.hybrid)),
        tp_group=ps.group(peers) if ps.size(peers) > 1 else None,
        background=True,  # the next step's metadata (and plan) is made while this one trains,
        # from when this step's inputs are built (the trainer's step): both are Python, and a second
        # thread running then takes turns at the GIL with the input building instead of with the compute
        prepare_on_request=True,
    )
    options["image_tokenizer"] = image_tokenizer
    return build_step_stream(cfg, tokenizer, **(options | _cp_stream_options(cfg, ps, sharding)))


def encoder_parallel(cfg: RunConfig, ps: ParallelState, sharding: CPSharding | None) -> EncoderParallel:
    """The encoders' groups (:mod:`omni_pipeline.encoder_parallel`): the stage's LLM sequence group,
    and the reordering group across DP (``ps.reorder_group``; ``None``: no reordering)."""
    par = cfg.parallel
    sp, mode, name = ps.size("ulysses"), ReshardMode.ULYSSES, "ulysses"
    if sharding is not None:
        # encoder_sp = cp: long-short SP over the CP group in its head-tail layout (cp_sharding's
        # module docstring); else cp_sharding splits and delivers, the encoders see no SP group.
        sp, mode, name = sharding.encoder_sp, ReshardMode.CP, "cp"
    return EncoderParallel(
        SequenceLayout(mode if sp > 1 else None, sp),
        sp_group=ps.group(name) if sp > 1 else None,
        sp_rank=ps.local_rank(name) if sp > 1 else 0,
        encoder_sp=par.encoder_sp,
        long_threshold=par.long_threshold,
        reorder_group=ps.reorder_group,
    )


def _special(cfg: RunConfig, tokenizer: Tokenizer, token: str) -> int:
    i = tokenizer.token_to_id(token)
    if i is None:
        raise ValueError(f"tokenizer {cfg.data.tokenizer}: special token {token} is missing")
    return i


def step_builder(
    cfg: RunConfig,
    ps: ParallelState,
    tokenizer: Tokenizer,
    parts: ModelParts,
    schedule: Schedule,
    flow: DataFlow,
    sharding: CPSharding | None,
    device: torch.device,
) -> StepBuilder:
    """The step-input bridge (loader step -> executor plan, shapes, encoder-row positions, labels).

    Raises:
        ValueError: the tokenizer lacks ``<|image|>`` or ``<|audio|>`` (names the tokenizer file).
    """
    pp_rank, pp, dp = ps.local_rank("pp"), ps.size("pp"), ps.size("dp")
    special = {Modality.IMAGE: "<|image|>", Modality.AUDIO: "<|audio|>"}
    placeholders = {m: _special(cfg, tokenizer, token) for m, token in special.items()}
    # a video's slots: <|video|> where the tokenizer has it, else <|image|> (one vision tower; stage 0
    # overwrites the slots with its rows either way, and they are never targets)
    video = tokenizer.token_to_id("<|video|>")
    placeholders[Modality.VIDEO] = placeholders[Modality.IMAGE] if video is None else video
    vit = cfg.model.vit
    spec = StepSpec(
        placeholders,
        parts.llm_cfg.dim,
        parts.compute_dtype,
        device,
        builds_text=pp_rank == 0 or pp_rank == pp - 1,
        sp=ps.size("ulysses"),
        sp_rank=ps.local_rank("ulysses"),
        tp_sp=ps.size("tp") if cfg.parallel.sequence_parallel else 1,
        routes=parts.encoders.routes,  # videos to the image tower
        # [model.llm] mrope_section: packs carry M-RoPE positions [3, T] from the ViT's grids
        mrope=(vit.patch, vit.merge, vit.temporal_patch)
        if parts.llm_cfg.mrope_section is not None and vit is not None
        else None,
    )
    # the ranks of a stage that share its packs under CP: the CP group, or dp_cp for hybrid DP/CP
    cp_group = None if sharding is None else ps.group("dp_cp" if sharding.hybrid else "cp")
    return StepBuilder(
        spec,
        schedule=schedule,
        flow=flow,
        encoders=parts.encoders,
        pp_group=ps.group("pp") if pp > 1 else None,
        dp_group=ps.group("dp") if dp > 1 and not cfg.parallel.hybrid_cp else None,
        parallel=encoder_parallel(cfg, ps, sharding),
        cp=sharding,
        cp_group=cp_group,
    )


def executor(
    cfg: RunConfig,
    ps: ParallelState,
    parts: ModelParts,
    sharding: CPSharding | None,
    device: torch.device,
    reduce_gradients: Callable[[], float],
) -> tuple[PipelineGroups, PipelineExecutor]:
    """The executor's groups (``PipelineGroups.from_state``) and the executor over this
    rank's stages and the encoder anchor; ``reduce_gradients`` is its hook after the step's last
    backward. Each step's functions are the step builder's (closures over that step's inputs)."""
    anchor = EncoderAnchor(
        dict(parts.encoders.towers.items()),
        EncoderParallelConfig(zero_stage=cfg.parallel.encoder_zero),
        EncoderDataConfig(max_seq_len=pack_tokens(cfg, sharding) * cfg.data.microbatches),
    )
    groups = PipelineGroups.from_state(ps)
    return groups, PipelineExecutor(
        parts.stage.chunks, anchor, None, groups, device=device, reduce_gradients=reduce_gradients
    )


def watchdog(cfg: RunConfig, ps: ParallelState, executor: PipelineExecutor) -> Watchdog | None:
    """The run's hang watchdog (``train.hang_timeout_s``; ``None`` when 0), not started: heartbeats
    through a client of the default group's store under a prefix per elastic attempt, naming the
    executor's current action. Under :func:`omni_train.launch.launch` the verdict goes to the launcher's
    report folder (it prints it) and rank 0 hosts the store; each rank watches its next 64 ranks at most."""
    hang = cfg.train.hang_timeout_s
    if hang == 0 or ps.world_size == 1:  # one process: no other rank to name it
        return None
    reports = report_dir()
    spec = WatchdogSpec(
        hang_timeout_s=hang,
        prefix=f"omni-train/watchdog/{restart_count()}",
        verdict_file=str(reports / "hang") if reports is not None else None,
        watch=None if ps.world_size <= 65 else 64,
        store_owner=0 if reports is not None else None,
    )
    try:
        store = default_store_client(spec.interval, spec.prefix)
    except RuntimeError as exc:  # e.g. a file:// rendezvous: said, not skipped silently
        if ps.rank == 0:
            print(f"omni-train: no hang watchdog (train.hang_timeout_s): {exc}", file=sys.stderr)
        return None
    return Watchdog(spec, store, ps.rank, ps.world_size, where=lambda: executor.current_action)


def checkpoint(
    cfg: RunConfig, out: Path, ps: ParallelState, parts: ModelParts, stream: ZeroRedundancyFilter
) -> TrainCheckpoint:
    """The run's checkpoint under ``out/checkpoints``; the reordering group size is a fact a resume
    must share (which replicas trade samples decides which rank encodes what)."""
    fixed = {"data.reorder_group_size": ps.reorder_size}
    return TrainCheckpoint(
        cfg.checkpoint.url or out / "checkpoints",
        cfg.checkpoint,
        cfg.train.steps,
        parts.model,
        parts.optimizer,
        stream,
        ps=ps,
        fixed=fixed,
    )


def step_metrics(cfg: RunConfig, ps: ParallelState, parts: ModelParts, device: torch.device) -> StepMetrics:
    """The per-step metrics, with the whole LLM's matmul parameters (summed over the pipeline ranks:
    collective over ``pp``) and the measured peak FLOP/s of ``device``."""
    llm_matmul = torch.tensor([float(parts.llm_matmul)], dtype=torch.float64)
    if ps.size("pp") > 1:
        dist.all_reduce(llm_matmul, group=ps.group("pp"))
    towers = parts.encoders.towers
    return StepMetrics(
        step_metrics_spec(cfg, parts.llm_cfg),
        ps,
        llm_matmul=float(llm_matmul),
        encoder_matmul={k: matmul_params(t) for k, t in towers.items()},
        peak_flops=measure_peak_flops(device),
        encoder_bytes=_measured_once(lambda: state_bytes(towers.values(), parts.optimizer)),
        # the stage modules (each an FSDP2 root under parallel.llm_zero), not RankStages: it does not
        # register them, so their root units' gathered storage would be missed
        llm_bytes=_measured_once(lambda: state_bytes(parts.stage.chunks.values(), parts.optimizer)),
    )


def skip_metrics(ps: ParallelState, stream: ZeroRedundancyFilter) -> SkipMetrics:
    """The loader's skips reduced over the world each step (``omni_data.SkipMetrics``); rank 0's first
    notice of a source says where the run's counts are."""

    def notice(line: str) -> None:
        logging.getLogger("omni_train").warning(
            "omni-train: %s. Counts per step are in metrics.jsonl ('skipped'), totals in summary.json", line
        )

    return SkipMetrics(stream, ps, notice=notice)


def _measured_once(measure: Callable[[], dict[str, int]]) -> Callable[[], dict[str, int]]:
    """``measure``, re-run each step until its bytes include the optimizer state (the first step that
    stepped AdamW), then that measurement: parameters, gathered copies, gradients and AdamW state keep
    their storages' sizes from step to step, so the walk over every tensor is not repeated."""
    held: list[dict[str, int]] = []

    def read() -> dict[str, int]:
        if held:
            return held[0]
        out = measure()
        if out.get("optimizer", 0) > 0:
            held.append(out)
        return out

    return read
