"""Run configuration schema: the typed sections of a run config, and its plain form.

A config is a TOML file (read by :func:`omni_train.binder.load_config`, command-line overrides by
:func:`omni_train.binder.apply_overrides`) whose every section maps onto a dataclass here; the checks that
need the file system or more than one field (shards, the tokenizer, parallel sizes against the process
count, calibration runs) are :func:`omni_train.preflight.validate`'s. Every number has its range in
:data:`FIELD_BOUNDS` (:func:`check_bounds`, run when a config is read and first in ``validate``). Every
error is a :class:`ConfigError` whose message starts with the dotted field name (``parallel.pp``,
``data.sources[1].urls``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from omni_data import DEFAULT_MAX_IMAGE_PIXELS
from omni_parallel import CPAttention
from omni_parallel.numerics import OnNonFinite
from omni_pipeline import PlacementPolicy, ScheduleKind
from omni_train.models.audio import AudioConfig
from omni_train.models.llm import LLMConfig
from omni_train.models.vit import ViTConfig

__all__ = [
    "FIELD_BOUNDS",
    "OFFLOAD",
    "RECOMPUTE",
    "RECOMPUTE_MODULES",
    "Bounds",
    "CheckpointConfig",
    "ConfigError",
    "DType",
    "DataConfig",
    "ImageTokenizerSection",
    "MixturePhase",
    "ModelConfig",
    "OptimConfig",
    "Packing",
    "ParallelConfigSection",
    "RunConfig",
    "SourceConfig",
    "TrainSection",
    "check_bounds",
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
class ImageTokenizerSection:
    """``[model.image_tokenizer]``: the frozen VQ image tokenizer of ``generation`` sources
    (:class:`omni_train.models.image_tokenizer.ImageTokenizer`). ``path``: its safetensors weights (the
    JSON sidecar beside it), absolute, or relative to the config file's folder, then to the bundled data
    directory (``"image-tokenizer.safetensors"``: the committed weights). With it the LLM's vocabulary is
    ``V + 2 + K`` (text ids, ``boi``, ``eoi``, ``K`` image codes: ``omni_data.GenerationVocab``)."""

    path: str = "image-tokenizer.safetensors"


@dataclass
class ModelConfig:
    """Model shapes, one class per section: ``[model.llm]`` is :class:`~omni_train.models.LLMConfig`
    (its ``vocab_size`` comes from the tokenizer, plus ``boi``, ``eoi`` and the image codes with
    ``[model.image_tokenizer]``; ``[model.llm.moe]`` / ``moe = {experts, top_k, ...}``
    its mixture-of-experts layers, :class:`~omni_train.models.llm.MoESpec`), ``[model.vit]`` / ``[model.audio]`` the encoders'
    configs; ``vit``/``audio`` absent means the run has no such encoder; ``[model.image_tokenizer]``
    (:class:`ImageTokenizerSection`) the frozen image tokenizer of generation sources."""

    llm: LLMConfig = field(default_factory=LLMConfig)
    vit: ViTConfig | None = None
    audio: AudioConfig | None = None
    seed: int = 0
    image_tokenizer: ImageTokenizerSection | None = None

    def llm_config(self, vocab_size: int) -> LLMConfig:
        """``[model.llm]`` with the vocabulary the run needs, ``vocab_size``: the text tokenizer's ``V``, or
        ``V + 2 + K`` with ``[model.image_tokenizer]`` (``boi``, ``eoi`` and ``K`` image codes:
        ``omni_data.GenerationVocab``).

        Raises:
            ConfigError: ``model.llm.vocab_size`` is set and differs from ``vocab_size``.
        """
        if self.llm.vocab_size not in (None, vocab_size):
            needs = (
                f"the vocabulary the run needs ({vocab_size} = data.tokenizer's ids + boi, eoi + the image "
                "codes of [model.image_tokenizer])"
                if self.image_tokenizer is not None
                else f"the tokenizer's {vocab_size}"
            )
            raise ConfigError(
                f"model.llm.vocab_size: {self.llm.vocab_size} differs from {needs}; leave it out (it comes "
                "from data.tokenizer" + (" and [model.image_tokenizer])" if self.image_tokenizer else ")")
            )
        return dataclasses.replace(self.llm, vocab_size=vocab_size)


@dataclass
class SourceConfig:
    """One WebDataset source of one ``modality`` (``image``, ``audio``, ``text``, ``video`` or
    ``generation``; a video source is encoded by ``[model.vit]``, frames sampled at 2 per second; a
    generation source reads image shards with captions as text-to-image samples, caption then the
    image's code tokens from ``[model.image_tokenizer]``, trained on the codes: ``omni_data.image_generation``). ``urls``: a glob or brace pattern, absolute, an fsspec URL
    (``scheme://...``), or relative to the folder of the config file (:func:`omni_train.data_files.data_root`; the bundled
    configs' to the bundled data directory ``omni_train/data``). ``min_pixels`` / ``max_pixels`` (image and video sources; a video's per frame): this source's resize bounds
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
        max_image_pixels: the most ``width * height`` a source image may declare in its header (before
            any resize); a larger one (a decompression bomb) is skipped and counted, never decoded
            (omni-data's ``WebDatasetSource`` and ``PayloadReader(max_image_pixels=)``); 1 to 2**28.
        replicas: data replicas ``R``, independent of the DP size: the data is read as ``R`` loaders
            (replica ``r`` reads share ``r`` of ``R`` of each source's shards and packs ``microbatches``
            packs per step), DP rank ``d`` runs replicas ``d * R / dp ..`` and trains ``(R / dp) *
            microbatches`` microbatches per step (omni-data's ``ReplicaMerge``). The global batch is then
            the same at every DP size that divides ``R``, and a checkpoint resumes exactly at another
            ``parallel.dp``. Must be a multiple of ``parallel.dp``; 0 (default): ``parallel.dp`` replicas
            as separate DP loaders (a resume at another DP size re-splits their states instead).
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
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    replicas: int = 0


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
        llm_zero: ZeRO stage of the LLM stages over each stage's data group (DP x Ulysses / CP ranks,
            ``omni_parallel.llm_zero.apply_llm_zero``, FSDP2 gathered once per step and reduced once per
            step as a plain sum); 0: replicated, gradients all-reduced; 1: AdamW state sharded (gradients
            all-reduced whole, each rank steps its rows); 2: gradients sharded too (one reduce-scatter per
            step; the gathered parameters stay allocated between steps); 3: parameters too (freed between
            steps). With ``tp > 1`` (not with ``ep > 1``) each TP shard is sharded over the data group
            (FSDP2's 2-D data x tp mesh). With one rank per stage's data group nothing is sharded.
            With ``train.dtype = "bfloat16"`` the units gather bf16 copies of the float32 shards and
            reduce the gradients in float32 (FSDP2 ``MixedPrecisionPolicy``).
        llm_reshard_after_forward: ``llm_zero = 3``'s reshard policy
            (``omni_parallel.llm_zero.reshard_after_forward``): ``"never"``: every block stays gathered
            from the step's start to its gradient sync (no collective inside the step); ``"always"``:
            each block is gathered before its forward and freed after it (gathered again for backward:
            less memory, one more all-gather per block and microbatch); ``"auto"``: ``never`` under
            pipeline parallelism with more than one microbatch (``pp > 1``, ``data.microbatches > 1``,
            torchtitan's default), ``always`` otherwise. Stages 1 and 2 keep the gathered blocks anyway.
        sequence_parallel: Megatron sequence parallelism over the TP group (needs ``tp`` > 1;
            ``omni_parallel.tensor_parallel``): the norms and the residual stream between the attention
            and MLP regions hold ``1/tp`` of each pack's tokens per TP rank (packs padded to a multiple of
            ``tp`` with a padding document without targets), all-gathered into attention and the MLP and
            reduce-scattered out of them; stage boundaries send ``1/tp`` of the tokens. Stage 0 embeds the
            whole pack with its media rows and keeps its shard; the LM head sees every token.
        async_tp: async tensor parallelism (needs ``sequence_parallel``, hence ``tp`` > 1;
            ``omni_parallel.async_tp``): each attention and MLP region's SP all-gather and reduce-scatter
            is decomposed into ``tp`` ring steps of point-to-point sends overlapped with the projection
            matmuls (collective matmul, Wang et al., ASPLOS'23): Q/K/V (gate/up) as one
            all-gather-matmul, the output (down) projection as one matmul-reduce-scatter. Same parameter
            placements, checkpoints and results as plain SP (within floating-point rounding).
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
        ep: expert-parallel size (``model.llm.moe``'s routed experts sharded over ``ep`` ranks of each
            stage's data group, tokens exchanged by all-to-all: ``omni_parallel.expert_parallel``); carved
            out of the ``dp x cp`` ranks of a stage (not a factor of the process count), as Megatron-Core
            and torchtitan do: ``ep`` divides ``dp``, or ``ep / gcd(ep, dp)`` divides ``cp`` (EP then
            spans CP ranks too, plain or ``hybrid_cp``; not with ``ulysses``).
            Expert gradients are summed over the ``dp x cp / ep`` expert-data-parallel ranks
            (``omni_parallel.topology.expert_groups``), the rest over the stage's data group as without
            EP; with ``llm_zero`` 1-3 the experts are also sharded over those ranks at the same ZeRO
            stage (``omni_parallel.llm_zero``). 1: every expert on every rank.
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
    sequence_parallel: bool = False
    async_tp: bool = False
    cp: int = 1
    ulysses: int = 1
    placement: PlacementPolicy = PlacementPolicy.UNIFORM_ON_DEMAND
    reorder: bool = True
    encoder_forward_share: float = 0.3
    encoder_zero: int = 0
    llm_zero: int = 0
    llm_reshard_after_forward: str = "auto"
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
    ep: int = 1

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
    """Checkpoint every ``every`` steps (0: only at the end), keep the last ``keep_last``.

    ``url``: where the steps go, any fsspec URL (``s3://bucket/run-1/checkpoints``; s3fs installed, its
    endpoint and credentials from the environment s3fs reads: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``); empty: ``<out>/checkpoints``.

    ``sample_rows``: with ``[model.image_tokenizer]``, captions (rows) of the ``samples/step-N.png`` grid
    that rank 0 has a child process (``omni-train sample``, :class:`omni_train.generate.SampleWriter`)
    draw after each committed checkpoint, off the training thread; 0: no grids.
    """

    every: int = 20
    keep_last: int = 2
    async_save: bool = True
    url: str = ""
    sample_rows: int = 4


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
        on_nonfinite: a step whose loss, gradient norm or an encoder's output holds a NaN or Inf, or
            whose loss spikes (``spike_zscore``): ``"skip_step"`` (no optimizer update, the data moves
            on), ``"rollback"`` (parameters and optimizer state back to the newest committed checkpoint
            before the step, the data moves on) or ``"stop"`` (``omni_parallel.numerics``; MegaScale-Omni
            §7-8).
        max_nonfinite_steps: bad steps in a row after which the run stops anyway; >= 1.
        spike_zscore: a step whose loss lies this many standard deviations above the mean of the last
            ``spike_window`` good steps is a loss spike, handled as ``on_nonfinite`` says; 0: off; >= 0.
        spike_window: good steps the spike detector's mean and deviation are taken over; >= 2.
        collective_timeout_s: seconds any collective of any process group waits for the other ranks
            before it raises (``omni_parallel.ParallelState.build(timeout=)``, the default group's too);
            0 < value <= 86400.
        hang_timeout_s: seconds without a heartbeat from a rank (its process stopped), or without
            progress on any rank, before the others name it (rank, host, step, last pipeline action) and
            end the run or, under ``--max-restarts``, restart it from the last checkpoint
            (``omni_parallel.watchdog``); below ``collective_timeout_s`` (refused otherwise); keep it
            above the longest single pipeline action (a first step's compile); 0: no watchdog;
            0 <= value <= 86400.
        preempt_grace_s: on SIGTERM / SIGINT, seconds the launcher lets the workers finish their step
            and commit a checkpoint before it kills them (``omni_parallel.preemption``); keep it below
            the scheduler's own kill delay; 0 < value <= 86400.
    """

    steps: int = 200
    seed: int = 1234
    dtype: DType = DType.FLOAT32
    compile: bool = False
    recompute: list[str] = field(default_factory=list)
    recompute_modules: list[str] = field(default_factory=list)
    offload: list[str] = field(default_factory=list)
    profile_steps: int = 0
    on_nonfinite: OnNonFinite = OnNonFinite.SKIP_STEP
    max_nonfinite_steps: int = 3
    spike_zscore: float = 0.0
    spike_window: int = 50
    collective_timeout_s: float = 1800.0
    hang_timeout_s: float = 600.0
    preempt_grace_s: float = 30.0


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


# -- numeric ranges ------------------------------------------------------------------------------------
# Every int and float field of a run config has its allowed range here, one row per field (lists of
# tables as ``[i]``, table entries as ``.KEY``, as ``omni_train.binder.field_paths`` writes them), so a
# field added to a section gets its range next to the others and a test (test_train_config_ranges.py)
# fails while one is missing. The upper bounds are far beyond any run this code can train (the paper's
# LLaMA-12B has dim 5120 and 40 layers) but refuse values that only a typo or a hostile config gives: a
# pack of 1e10 tokens or a million decode threads would exhaust memory long after the workers started,
# a dimension of -128 or 0 fails inside torch with a traceback from every rank. Cross-field rules (heads
# dividing dims, parallel sizes against the process count, phases in order) stay in
# ``omni_train.preflight.validate``.


@dataclass(frozen=True)
class Bounds:
    """The allowed values of one numeric config field: finite, ``lo <= value <= hi`` (``lo < value`` with
    ``lo_open``, ``value < hi`` with ``hi_open``). ``unit`` (e.g. ``"a number of MiB"``) is said in the
    message. For the entries of a list field, ``item`` names one entry in the message (``"stage"``: "stage 1
    must hold >= 1") with ``verb`` ("hold" instead of "be")."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    unit: str = ""
    item: str = ""
    verb: str = "be"

    def check(self, value: float, where: str, *, subject: str = "", shown: Any = None) -> None:
        """Raise :class:`ConfigError` (``"<where>: [<subject> ]must be ..., got <shown or value>"``)
        unless ``value`` is allowed."""
        said = f"{where}: {subject} must {self.verb}" if subject else f"{where}: must {self.verb}"
        got = value if shown is None else shown
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{said} finite, got {got}")
        unit = f"{self.unit} " if self.unit else ""
        if value < self.lo or (self.lo_open and value == self.lo):
            op = ">" if self.lo_open else ">="
            raise ConfigError(f"{said} {unit}{op} {_num(self.lo)}, got {got}")
        if value > self.hi or (self.hi_open and value == self.hi):
            op = "<" if self.hi_open else "<="
            raise ConfigError(f"{said} {unit}{op} {_num(self.hi)}, got {got}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**63 else f"{x:g}"


_COUNT = Bounds(1, 2**20)  # layers, heads, sizes of parallel groups: >= 1
_WIDTH = Bounds(1, 2**16)  # model widths (features)
_LAYERS = Bounds(1, 1024)
_THETA = Bounds(0, 1e12, lo_open=True)  # RoPE base
_EPS = Bounds(0, 1, lo_open=True)  # norm epsilon
_PIXELS = Bounds(1, 2**28)  # resized image area: 16384 x 16384 at most
_SEED = Bounds(0, 2**32 - 1)  # every RNG this code feeds (torch, numpy, random) takes these
_STEPS = Bounds(0, 2**40)
_LR = Bounds(0, 1e9)  # finite; large values (a blow-up test's 1e6) are the numerics guard's to catch


def _encoder_bounds(section: str) -> dict[str, Bounds]:
    return {
        f"{section}.dim": _WIDTH,
        f"{section}.n_layers": _LAYERS,
        f"{section}.n_heads": _LAYERS,
        f"{section}.rope_theta": _THETA,
        f"{section}.mlp_ratio": Bounds(1, 64),
        f"{section}.norm_eps": _EPS,
    }


FIELD_BOUNDS: dict[str, Bounds] = {
    "model.llm.vocab_size": Bounds(1, 2**24),
    "model.llm.dim": _WIDTH,
    "model.llm.n_layers": _LAYERS,
    "model.llm.n_heads": _LAYERS,
    "model.llm.n_kv_heads": _LAYERS,
    "model.llm.ffn_dim": _COUNT,
    "model.llm.rope_theta": _THETA,
    "model.llm.norm_eps": _EPS,
    "model.llm.moe.experts": Bounds(1, 4096),
    "model.llm.moe.top_k": Bounds(1, 64),
    "model.llm.moe.shared_experts": Bounds(0, 64),
    "model.llm.moe.every_n_layers": _LAYERS,
    "model.llm.moe.expert_ffn_dim": _COUNT,
    "model.llm.moe.shared_expert_ffn_dim": _COUNT,
    "model.llm.moe.aux_loss_coef": Bounds(0, 1e3),
    "model.llm.moe.z_loss_coef": Bounds(0, 1e3),
    "model.llm.moe.capacity_factor": Bounds(0, 1e3, lo_open=True),
    "model.llm.moe.bias_update_rate": Bounds(0, 1e3),
    **_encoder_bounds("model.vit"),
    "model.vit.patch": Bounds(1, 256),  # pixels per patch side
    "model.vit.merge": Bounds(1, 16),  # patches per merged-token side
    "model.vit.min_pixels": _PIXELS,
    "model.vit.max_pixels": _PIXELS,
    "model.vit.projector_hidden": _COUNT,
    "model.vit.temporal_patch": Bounds(1, 16),  # frames per patch (Qwen2-VL: 2)
    **_encoder_bounds("model.audio"),
    "model.audio.n_mels": Bounds(1, 1024),
    "model.audio.sample_rate": Bounds(1000, 384_000),  # Hz: telephone to studio rates
    "model.audio.n_fft": Bounds(2, 2**16),  # samples
    "model.audio.hop": Bounds(1, 2**16),  # samples
    "model.audio.subsample": Bounds(1, 64),
    "model.audio.max_positions": _COUNT,
    "model.seed": _SEED,
    "data.sources[i].min_pixels": _PIXELS,
    "data.sources[i].max_pixels": _PIXELS,
    "data.sources[i].join_tokens": Bounds(0, 2**24),
    "data.mixture[i].weights.KEY": Bounds(0, 1e12),
    "data.mixture[i].until_step": Bounds(1, 2**40),
    "data.mixture[i].until_tokens": Bounds(1, 2**62),
    "data.max_seq_len": Bounds(1, 2**24),  # tokens per pack: 16M
    "data.microbatches": Bounds(1, 2**16),
    "data.buffer_size": _COUNT,
    "data.max_pack_age": Bounds(0, 2**16),
    "data.decode_workers": Bounds(1, 256),  # threads per rank
    "data.reorder_group_size": _COUNT,
    "data.max_image_pixels": _PIXELS,  # declared source image area (PIL itself refuses > 178,956,970)
    "data.replicas": Bounds(0, 2**20),  # 0: parallel.dp
    "parallel.pp": _COUNT,
    "parallel.dp": _COUNT,
    "parallel.tp": _COUNT,
    "parallel.cp": _COUNT,
    "parallel.ulysses": _COUNT,
    "parallel.ep": _COUNT,
    "parallel.encoder_forward_share": Bounds(0, 1e6, lo_open=True),
    "parallel.encoder_zero": Bounds(0, 3),  # preflight allows 0, 2 and 3
    "parallel.llm_zero": Bounds(0, 3),
    "parallel.virtual_stages": _LAYERS,
    "parallel.encoder_sp": _COUNT,
    "parallel.long_threshold": Bounds(1, 2**31),  # tokens
    "parallel.stage_layers[i]": dataclasses.replace(_LAYERS, item="stage", verb="hold"),
    "parallel.planner_evaluations": Bounds(1, 10**7),
    "parallel.planner_memory_cap_mib": Bounds(0, 2**40, lo_open=True, unit="a number of MiB"),
    "optim.lr": _LR,
    "optim.min_lr": _LR,
    "optim.warmup_steps": _STEPS,
    "optim.weight_decay": Bounds(0, 1e3),
    "optim.beta1": Bounds(0, 1, hi_open=True),  # torch's AdamW needs 0 <= beta < 1
    "optim.beta2": Bounds(0, 1, hi_open=True),
    "optim.grad_clip": Bounds(0, 1e12),  # 0: measure the norm only
    "checkpoint.every": _STEPS,
    "checkpoint.keep_last": _COUNT,
    "checkpoint.sample_rows": Bounds(0, 64),
    "train.steps": Bounds(1, 2**40),
    "train.seed": _SEED,
    "train.profile_steps": Bounds(0, 2**20),
    "train.collective_timeout_s": Bounds(0, 86400, lo_open=True, unit="a number of seconds"),
    "train.hang_timeout_s": Bounds(0, 86400, unit="a number of seconds"),
    "train.preempt_grace_s": Bounds(0, 86400, lo_open=True, unit="a number of seconds"),
    "train.max_nonfinite_steps": Bounds(1, 2**20),
    "train.spike_zscore": Bounds(0, 1e6),  # standard deviations; 0: no spike detection
    "train.spike_window": Bounds(2, 2**20),  # steps
}


def check_bounds(cfg: RunConfig) -> None:
    """Check every int and float field of ``cfg`` against :data:`FIELD_BOUNDS` (unset optional fields
    skipped; a numeric field missing from the table must at least be finite).

    Raises:
        ConfigError: the first field out of range, named (``"optim.lr: must be finite, got nan"``,
            ``"data.sources[1].max_pixels: must be <= 268435456, got 10000000000"``); an entry of a
            table by the table, shown whole (``"data.mixture[0].weights: weights must be >= 0, got
            {'image': -1.0, 'text': 1.0}"``).
    """
    _check_value(cfg, "", "")


def _check_value(value: Any, where: str, pattern: str) -> None:
    if value is None or isinstance(value, bool | str):
        return
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            if f.init and f.name != "source":
                name = f"{where}.{f.name}".lstrip(".")
                _check_value(getattr(value, f.name), name, f"{pattern}.{f.name}".lstrip("."))
    elif isinstance(value, list):
        entry = FIELD_BOUNDS.get(f"{pattern}[i]")
        for i, item in enumerate(value):
            if (
                entry is not None
                and entry.item
                and isinstance(item, int | float)
                and not isinstance(item, bool)
            ):
                _check_number(item, f"{where}[{i}]", f"{pattern}[i]", subject=f"{entry.item} {i}")
            else:
                _check_value(item, f"{where}[{i}]", f"{pattern}[i]")
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, int | float) and not isinstance(item, bool):
                # a table of numbers (mixture weights) is named and shown whole: one entry means
                # little without the others
                _check_number(item, where, f"{pattern}.KEY", subject=where.rsplit(".", 1)[-1], shown=value)
            else:
                _check_value(item, f"{where}.{key}", f"{pattern}.KEY")
    elif isinstance(value, int | float):
        _check_number(value, where, pattern)


def _check_number(value: float, where: str, pattern: str, *, subject: str = "", shown: Any = None) -> None:
    bounds = FIELD_BOUNDS.get(pattern)
    if bounds is None:  # not in the table (a test fails meanwhile): at least finite
        bounds = Bounds(-math.inf, math.inf)
    bounds.check(value, where, subject=subject, shown=shown)
