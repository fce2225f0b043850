"""Run configuration schema: the typed sections of a run config, and its plain form.

A config is a TOML file (read by :func:`omni_train.binder.load_config`, command-line overrides by
:func:`omni_train.binder.apply_overrides`) whose every section maps onto a dataclass here; the checks that
need the file system or more than one field (shards, the tokenizer, parallel sizes against the process
count, calibration runs) are :func:`omni_train.preflight.validate`'s. Every error is a
:class:`ConfigError` whose message starts with the dotted field name (``parallel.pp``,
``data.sources[1].urls``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from omni_parallel import CPAttention
from omni_pipeline import PlacementPolicy, ScheduleKind
from omni_train.models.audio import AudioConfig
from omni_train.models.llm import LLMConfig
from omni_train.models.vit import ViTConfig

__all__ = [
    "OFFLOAD",
    "RECOMPUTE",
    "RECOMPUTE_MODULES",
    "CheckpointConfig",
    "ConfigError",
    "DType",
    "DataConfig",
    "MixturePhase",
    "ModelConfig",
    "OptimConfig",
    "Packing",
    "ParallelConfigSection",
    "RunConfig",
    "SourceConfig",
    "TrainSection",
]


RECOMPUTE = ("llm", "image", "audio")  # train.recompute: the LLM blocks, the ViT's, the audio encoder's
OFFLOAD = RECOMPUTE  # train.offload: the same block families
# train.recompute_modules: the residual branches of a block (omni_parallel.parallelize.apply_ac)
RECOMPUTE_MODULES = ("attention", "mlp")


class ConfigError(ValueError):
    """A configuration value is wrong; the message starts with the dotted field name."""


class Packing(StrEnum):
    """``hybrid``: samples of all modalities share packs; ``per_modality``: a pack holds one modality."""

    HYBRID = "hybrid"
    PER_MODALITY = "per_modality"


@dataclass
class ModelConfig:
    """Model shapes, one class per section: ``[model.llm]`` is :class:`~omni_train.models.LLMConfig`
    (its ``vocab_size`` comes from the tokenizer), ``[model.vit]`` / ``[model.audio]`` the encoders'
    configs; ``vit``/``audio`` absent means the run has no such encoder."""

    llm: LLMConfig = field(default_factory=LLMConfig)
    vit: ViTConfig | None = None
    audio: AudioConfig | None = None
    seed: int = 0

    def llm_config(self, vocab_size: int) -> LLMConfig:
        """``[model.llm]`` with the tokenizer's vocabulary size.

        Raises:
            ConfigError: ``model.llm.vocab_size`` is set and differs from the tokenizer's.
        """
        if self.llm.vocab_size not in (None, vocab_size):
            raise ConfigError(
                f"model.llm.vocab_size: {self.llm.vocab_size} differs from the tokenizer's {vocab_size}; "
                "leave it out (it comes from data.tokenizer)"
            )
        return dataclasses.replace(self.llm, vocab_size=vocab_size)


@dataclass
class SourceConfig:
    """One WebDataset source. ``urls``: a glob or brace pattern, absolute, an fsspec URL
    (``scheme://...``), or relative to the folder of the config file (:func:`omni_train.data_files.data_root`; the bundled
    configs' to the bundled data directory ``omni_train/data``). ``min_pixels`` / ``max_pixels`` (image sources): this source's resize bounds
    instead of ``[model.vit]``'s, as datasets of different resolutions have (a recipe's image-size mix). ``join_tokens`` (text sources, 0 = off): the consecutive passages of
    one document (keys ``<doc>-000``, ``<doc>-001``, ...) are joined into documents of up to this many
    tokens (``omni_data.JoinDocuments``: whole plays for a long-context recipe)."""

    name: str
    modality: str
    urls: str
    min_pixels: int | None = None
    max_pixels: int | None = None
    join_tokens: int = 0


@dataclass
class MixturePhase:
    """Source weights until ``until_step`` (optimizer steps) or ``until_tokens`` (expanded LLM tokens drawn
    over all DP ranks, media tokens included: the paper's "for the first 10B tokens"), exclusive. A phase
    names one of the two; every phase of a mixture counts in the same unit; the last phase has neither
    and runs to the end (preflight refuses anything else)."""

    weights: dict[str, float]
    until_step: int | None = None
    until_tokens: int | None = None


@dataclass
class DataConfig:
    """Sources, mixture phases and packing. ``max_seq_len`` in LLM tokens per pack (= per microbatch).

    Attributes:
        tokenizer: the ``tokenizers`` JSON file; a relative path is looked for in the config file's folder
            first (as relative ``urls`` are), then among the bundled data (:func:`omni_train.data_files.tokenizer_candidates`).
        max_pack_age: packing rounds a part-full pack may be carried before it is emitted (omni-data's
            ``HybridPacker(max_pack_age=)``): a sample is trained within ``(max_pack_age + 1) *
            buffer_size`` draws, so the trained mixture tracks the schedule; >= 0.
        decode_workers: threads per rank decoding images and audio (``ZeroRedundancyFilter``); >= 1.
        mixture_interpolate: ``false``: each phase's weights hold until its ``until_step`` (or
            ``until_tokens``); ``true``:
            they move linearly from a phase's start to the next phase's start (``MixtureSchedule(
            interpolate=True)``), constant in the last phase.
        reorder_group_size: DP replicas per reordering group of the decentralised grouped reordering
            across DP (``omni_pipeline.encoder_parallel``, paper §5.1); must divide ``parallel.dp``; 1 turns
            it off; ``None`` (default): the replicas whose ranks share this rank's node
            (``LOCAL_WORLD_SIZE``, else every replica). Active only with ``parallel.reorder`` and
            without CP (under ``parallel.cp`` > 1 or ``hybrid_cp`` it is 1).
    """

    sources: list[SourceConfig]
    mixture: list[MixturePhase]
    max_seq_len: int = 512
    microbatches: int = 4
    buffer_size: int = 64
    packing: Packing = Packing.HYBRID
    tokenizer: str = "tokenizer.json"
    max_pack_age: int = 1
    decode_workers: int = 1
    mixture_interpolate: bool = False
    reorder_group_size: int | None = None


@dataclass
class ParallelConfigSection:
    """LLM parallel sizes (their product must equal the process count), the encoder placement and the
    encoder layout.

    Attributes:
        encoder_forward_share: planned forward time of one encoder microbatch, in units of one LLM
            stage's microbatch forward: the cost model the placement policy times the schedule with
            (``omni_pipeline.CostModel``, LLM forward 1, backward 2). It sets how early
            ``uniform_on_demand`` runs encoder forwards before stage 0 needs them; which rank runs an
            encoder microbatch does not depend on it (slice ``j`` of each LLM microbatch runs on
            pipeline rank ``j``). Must be > 0.
        encoder_zero: ZeRO stage of the encoders (``omni_parallel.parallelize.apply_encoder_zero``); 0:
            every rank holds them whole and their gradients are summed over every rank; 2: FSDP2 shards
            their gradients and optimizer state over every rank (the gathered parameters stay allocated
            between steps); 3: parameters too.
        encoder_sp: encoder sequence-parallel size (``omni_pipeline.encoder_parallel``): 1, or the LLM's
            sequence-parallel size, whose group it then shares: ``ulysses``, or ``cp`` under plain CP
            (not ``hybrid_cp``). With an LLM SP group the samples of each encoder microbatch are spread
            over it (each encoded once, short ones whole on single ranks balanced by cost); with
            ``encoder_sp`` > 1, images of more than ``long_threshold`` LLM tokens are also split along the
            sequence over the group, Ulysses inside the ViT's attention. Under CP with ``encoder_sp`` 1,
            ``omni_pipeline.cp_delivery`` splits each encoder microbatch's samples whole over the CP ranks
            (each reads only its own); with ``encoder_sp = cp`` the CP ranks run long-short SP and the
            outputs reach the head-tail layout by ``reshard_to_llm``'s all-reduce. Reordering across DP
            is off under CP either way.
        long_threshold: tokens (after the patch merge: the LLM tokens an image fills) above which an
            image is long (split over the encoder SP group); >= 1.
        cp_attention: attention of context-parallel groups: ``"allgather"`` (K/V all-gathered) or
            ``"ring"`` (K/V passed around the ring, overlapped with compute; less memory per rank).
        hybrid_cp: hybrid DP/CP (``omni_pipeline.cp_delivery``): the ``dp * cp`` ranks of a stage share
            packs of ``dp * cp * data.max_seq_len`` tokens; per pack ``omni_parallel.plan_hybrid_cp``
            keeps short samples whole on single ranks and CP-shards long ones over the smallest aligned
            block that fits ``data.max_seq_len`` tokens per rank. Works with ``pp > 1``.
        placement: where encoder microbatches run in the LLM pipeline (:class:`omni_pipeline.PlacementPolicy`):
            the paper's three policies, and ``planned`` (each step's ranks and slots searched by simulating
            that step's costs from its metadata, before any payload is read: ``omni_pipeline.step_plan``).
        schedule: the LLM pipeline schedule (:class:`omni_pipeline.ScheduleKind`): ``1f1b``
            (PipeDream-flush), ``gpipe`` (all forwards, then all backwards: MegaScale-Omni §7 for uneven
            microbatches), ``interleaved`` (interleaved 1F1B over ``virtual_stages`` stages per rank,
            Megatron-LM VPP).
        virtual_stages: LLM stages per pipeline rank (``>= 1``): the layers are split over
            ``pp * virtual_stages`` stages and rank ``r`` holds stages ``r, r + pp, ...``. More than 1
            needs ``schedule = "interleaved"`` or ``"gpipe"`` (looped GPipe); 1F1B holds one.
        stage_layers: the LLM layers of each of the ``pp * virtual_stages`` stages
            (``omni_train.pipeline.stage_split``): a list of counts (each >= 1, summing to
            ``model.llm.n_layers``); ``"auto"``: the split whose slowest stage is fastest by modelled
            per-token FLOPs, embedding on stage 0 and LM head + loss on the last counted
            (``omni_pipeline.balance_stages``); unset: layers shared out evenly, the first stages taking
            the remainder.
        planner_evaluations: simulations ``planned`` may spend per step (``omni_pipeline.plan_placement``'s
            ``max_evaluations``; each is about 50 microseconds at pp=2 with 8 microbatches); >= 1.
        planner_memory_cap_mib: ``planned``: peak stored activations per rank the plan may reach, MiB, in
            the cost model's modelled bytes (``omni_pipeline.step_costs``); unset: no cap; > 0.
        planner_calibration: ``planned``: a run directory of this config whose ``actions.jsonl`` (the
            measured per-action times) the planner's costs are fitted from; unset: modelled FLOPs.
        stage_calibration: with ``stage_layers = "auto"``: a run directory of this model (same
            ``model.llm`` shape, ``data.max_seq_len`` and tokenizer vocabulary, any split of >= 2
            stages and any pipeline size) whose measured
            per-stage LLM times replace the modelled FLOPs in the balance: per-layer and LM head + loss
            seconds fitted from them (``omni_train.pipeline.measured_layer_costs``,
            ``omni_pipeline.fit_layer_costs``); unset: modelled FLOPs. :func:`omni_train.binder.load_config` makes a
            relative path absolute (from the working directory), as the run's saved config keeps it.
    """

    pp: int = 2
    dp: int = 1
    tp: int = 1
    cp: int = 1
    ulysses: int = 1
    placement: PlacementPolicy = PlacementPolicy.UNIFORM_ON_DEMAND
    reorder: bool = True
    encoder_forward_share: float = 0.3
    encoder_zero: int = 0
    cp_attention: CPAttention = CPAttention.ALLGATHER
    hybrid_cp: bool = False
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    virtual_stages: int = 1
    encoder_sp: int = 1
    long_threshold: int = 8192
    stage_layers: list[int] | str | None = None
    planner_evaluations: int = 100
    planner_memory_cap_mib: float | None = None
    planner_calibration: str | None = None
    stage_calibration: str | None = None

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp * self.cp * self.ulysses


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr``."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0


@dataclass
class CheckpointConfig:
    """Checkpoint every ``every`` steps (0: only at the end), keep the last ``keep_last``."""

    every: int = 20
    keep_last: int = 2
    async_save: bool = True


class DType(StrEnum):
    """The training dtype. ``float32`` / ``float64``: parameters and activations in that dtype (float64
    for exactness checks against references); ``bfloat16``: mixed precision, float32 master parameters
    and optimizer, forward and backward under ``torch.autocast`` in bfloat16
    (``omni_parallel.parallelize.apply_mixed_precision``; on CUDA attention then runs the fused varlen kernel,
    see ``omni_parallel.varlen``)."""

    FLOAT32 = "float32"
    FLOAT64 = "float64"
    BFLOAT16 = "bfloat16"


@dataclass
class TrainSection:
    """Steps, the seed of every private generator, the training dtype and the model's execution options.

    Attributes:
        compile: ``torch.compile`` every LLM and encoder block, pack length dynamic
            (``omni_parallel.parallelize.apply_compile``).
        recompute: module families whose blocks recompute their activations in backward instead of
            keeping them (``torch.utils.checkpoint``; ``omni_parallel.parallelize.apply_ac``): any of
            ``"llm"``, ``"image"``, ``"audio"``.
        recompute_modules: which parts of each recomputed block recompute (selective recompute): any of
            ``"attention"`` (the attention branch: pre-norm, Q/K/V, attention, output projection) and
            ``"mlp"`` (the MLP branch); empty: the whole block.
        offload: module families whose blocks keep the activations they save for backward in host
            memory (``omni_parallel.activation_memory``, saved-tensor hooks; pinned copies on CUDA): any
            of ``"llm"``, ``"image"``, ``"audio"``.
        profile_steps: record this many steps with ``torch.profiler`` (CPU and CUDA activities) into
            ``<run>/profile/rank-<r>.json`` Chrome traces (``omni_train.profiling``); 0: off.
    """

    steps: int = 200
    seed: int = 1234
    dtype: DType = DType.FLOAT32
    compile: bool = False
    recompute: list[str] = field(default_factory=list)
    recompute_modules: list[str] = field(default_factory=list)
    offload: list[str] = field(default_factory=list)
    profile_steps: int = 0


@dataclass
class RunConfig:
    """A whole run. ``name`` is the config's name; ``source`` the file it came from."""

    name: str
    model: ModelConfig
    data: DataConfig
    parallel: ParallelConfigSection = field(default_factory=ParallelConfigSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainSection = field(default_factory=TrainSection)
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, StrEnum):
        return str(obj)
    return obj
