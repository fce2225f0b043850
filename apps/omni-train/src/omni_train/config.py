"""Run configuration: typed dataclasses loaded from TOML, validated before any process starts.

A config names its TOML file (``omni-tiny`` -> ``omni_train/configs/omni-tiny.toml``) or a path. Every
section maps onto a dataclass; an unknown key, a wrong type or an inconsistent size raises
:class:`ConfigError` whose message starts with the dotted field name (``parallel.pp``, ``data.sources[1].urls``).
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from omni_parallel import CPAttention
from omni_train.models.audio import AudioConfig
from omni_train.models.llm import LLMConfig
from omni_train.models.vit import ViTConfig

__all__ = [
    "OFFLOAD",
    "RECOMPUTE",
    "RECOMPUTE_MODULES",
    "RESUME_MAY_CHANGE",
    "CheckpointConfig",
    "ConfigError",
    "DType",
    "DataConfig",
    "MixturePhase",
    "ModelConfig",
    "OptimConfig",
    "Packing",
    "ParallelConfigSection",
    "PipelineSchedule",
    "Placement",
    "RunConfig",
    "SourceConfig",
    "TrainSection",
    "apply_overrides",
    "bundled_data_dir",
    "config_from_dict",
    "config_path",
    "data_root",
    "expand_urls",
    "field_paths",
    "load_config",
    "load_tokenizer",
    "resume_differences",
    "to_toml",
    "tokenizer_candidates",
    "tokenizer_path",
    "validate",
]


RECOMPUTE = ("llm", "image", "audio")  # train.recompute: the LLM blocks, the ViT's, the audio encoder's
OFFLOAD = RECOMPUTE  # train.offload: the same block families
# train.recompute_modules: the residual branches of a block (omni_parallel.parallelize.apply_ac)
RECOMPUTE_MODULES = ("attention", "mlp")


class ConfigError(ValueError):
    """A configuration value is wrong; the message starts with the dotted field name."""


class Placement(StrEnum):
    """Where encoder microbatches run in the LLM pipeline (omni-pipeline placement policies): the paper's
    three, and ``planned`` (``omni_pipeline.planner``: each step's ranks and slots searched by simulating
    that step's costs from its metadata, before any payload is read: ``omni_pipeline.step_plan``)."""

    PREPEND_FIRST_STAGE = "prepend_first_stage"
    ISOLATED = "isolated"
    UNIFORM_ON_DEMAND = "uniform_on_demand"
    PLANNED = "planned"


class PipelineSchedule(StrEnum):
    """The LLM pipeline schedule (omni-pipeline ``schedules``): ``1f1b`` (PipeDream-flush), ``gpipe``
    (all forwards, then all backwards: MegaScale-Omni §7 for uneven microbatches), ``interleaved``
    (interleaved 1F1B over ``parallel.virtual_stages`` stages per rank, Megatron-LM VPP)."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED = "interleaved"


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
    (``scheme://...``), or relative to the folder of the config file (:func:`data_root`; the bundled
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
    """Source weights until ``until_step`` (exclusive; the last phase has none and runs to the end)."""

    weights: dict[str, float]
    until_step: int | None = None


@dataclass
class DataConfig:
    """Sources, mixture phases and packing. ``max_seq_len`` in LLM tokens per pack (= per microbatch).

    Attributes:
        tokenizer: the ``tokenizers`` JSON file; a relative path is looked for in the config file's folder
            first (as relative ``urls`` are), then among the bundled data (:func:`tokenizer_candidates`).
        max_pack_age: packing rounds a part-full pack may be carried before it is emitted (omni-data's
            ``HybridPacker(max_pack_age=)``): a sample is trained within ``(max_pack_age + 1) *
            buffer_size`` draws, so the trained mixture tracks the schedule; >= 0.
        decode_workers: threads per rank decoding images and audio (``ZeroRedundancyFilter``); >= 1.
        mixture_interpolate: ``false``: each phase's weights hold until its ``until_step``; ``true``:
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
        schedule: the LLM pipeline schedule (:class:`PipelineSchedule`; ``omni_train.pipeline``).
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
            ``omni_pipeline.fit_layer_costs``); unset: modelled FLOPs. :func:`load_config` makes a
            relative path absolute (from the working directory), as the run's saved config keeps it.
    """

    pp: int = 2
    dp: int = 1
    tp: int = 1
    cp: int = 1
    ulysses: int = 1
    placement: Placement = Placement.UNIFORM_ON_DEMAND
    reorder: bool = True
    encoder_forward_share: float = 0.3
    encoder_zero: int = 0
    cp_attention: CPAttention = CPAttention.ALLGATHER
    hybrid_cp: bool = False
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
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


def bundled_data_dir() -> Path:
    """The directory holding the bundled tokenizer and shards (``omni_train/data``)."""
    return Path(str(resources.files("omni_train") / "data"))


def tokenizer_path(data: DataConfig) -> Path:
    """The tokenizer file ``data.tokenizer`` names (relative paths are inside the bundled data directory;
    :func:`load_config` has already made a path relative to the config file's folder absolute)."""
    p = Path(data.tokenizer)
    return p if p.is_absolute() else bundled_data_dir() / p


def load_tokenizer(data: DataConfig) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` at :func:`tokenizer_path`.

    Raises:
        Exception: ``tokenizers``' own, for a missing or unreadable file.
    """
    return Tokenizer.from_file(str(tokenizer_path(data)))


def tokenizer_candidates(cfg: RunConfig) -> list[Path]:
    """Where ``data.tokenizer`` is looked for, in order: itself if absolute; else the config file's
    folder (as relative ``urls`` are; not for a bundled config), then the bundled data directory (the
    bundled tokenizer names)."""
    p = Path(cfg.data.tokenizer)
    if p.is_absolute():
        return [p]
    root = data_root(cfg)
    return [root / p] + ([bundled_data_dir() / p] if root != bundled_data_dir() else [])


def config_path(name_or_path: str) -> Path:
    """Resolve ``omni-tiny`` to the bundled TOML, or return an existing path.

    Raises:
        ConfigError: neither a bundled config name nor an existing file.
    """
    p = Path(name_or_path)
    if p.suffix == ".toml" or os.sep in name_or_path:
        if not p.is_file():
            raise ConfigError(f"config: file {name_or_path} does not exist")
        return p
    bundled = Path(str(resources.files("omni_train") / "configs" / f"{name_or_path}.toml"))
    if not bundled.is_file():
        names = sorted(f.stem for f in bundled.parent.glob("*.toml"))
        raise ConfigError(f"config: no bundled config named {name_or_path!r} (have {names})")
    return bundled


def _build(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if isinstance(value, str) and str in args:  # e.g. parallel.stage_layers = "auto"
            return value
        return _build(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown key (allowed: {sorted(names)})".lstrip("."))
        kwargs = {k: _build(hints[k], v, f"{where}.{k}".lstrip(".")) for k, v in value.items()}
        try:
            return tp(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"{where or 'config'}: {exc}") from None
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_build(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
        _, vt = typing.get_args(tp)
        return {str(k): _build(vt, v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{where}: {value!r} is not one of {[str(m) for m in tp]}") from None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (
        not isinstance(value, tp) or (tp is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def load_config(
    name_or_path: str = "omni-tiny", overrides: Sequence[tuple[str, str | None]] = ()
) -> RunConfig:
    """Read and type-check a TOML run config (sizes are checked by :func:`validate`).

    Args:
        name_or_path: a bundled config name or a TOML path.
        overrides: ``(field, value)`` pairs from the command line (:func:`apply_overrides`), applied to
            the TOML's tables before type-checking, so they are checked exactly as the TOML is.

    Raises:
        ConfigError: missing file, TOML syntax error, unknown key, wrong type, bad override (message names
            the field).
    """
    path = config_path(name_or_path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config: {path}: {exc}") from None
    raw.setdefault("name", path.stem)
    apply_overrides(raw, overrides)
    cfg = _build(RunConfig, raw, "")
    cfg.source = str(path)
    # a tokenizer beside the config wins over a bundled one of the same name; made absolute so that
    # every reader of data.tokenizer (and the run's saved config) finds the same file
    first = tokenizer_candidates(cfg)[0]
    if first.is_file():
        cfg.data.tokenizer = str(first.resolve())
    # a calibration run is read again by later runs calibrated from this one (their chain is followed
    # through the saved configs): saved absolute, it names the same directory from wherever they start
    if cfg.parallel.stage_calibration and cfg.parallel.stage_calibration.strip():
        cfg.parallel.stage_calibration = str(Path(cfg.parallel.stage_calibration).resolve())
    return cfg


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """A run config from its plain form (:meth:`RunConfig.to_dict`, e.g. a run directory's ``config.json``),
    type-checked as :func:`load_config` checks TOML.

    Raises:
        ConfigError: unknown key or wrong type (message names the field).
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise ConfigError("config: expected a table with a string 'name'")
    return _build(RunConfig, raw, "")


def data_root(cfg: RunConfig) -> Path:
    """The folder relative ``data.sources[*].urls`` resolve against: the config file's folder, or the
    bundled data directory for a bundled config (and for a config with no file)."""
    if not cfg.source:
        return bundled_data_dir()
    path = Path(cfg.source).resolve()
    bundled = Path(str(resources.files("omni_train") / "configs")).resolve()
    return bundled_data_dir() if path.parent == bundled else path.parent


def expand_urls(pattern: str, root: str | os.PathLike[str] | None = None) -> list[str]:
    """Concrete shard URLs for a source pattern.

    Args:
        pattern: a glob, a brace pattern (``image-{000..003}.tar``), or an fsspec URL of either.
        root: the folder a relative local pattern is relative to (:func:`data_root`; default the bundled
            data directory).

    Brace patterns are passed through (absolute) for omni-data to expand; local globs and fsspec globs
    are listed here, sorted.
    """
    if "://" in pattern and not pattern.startswith("file://"):
        import fsspec

        fs, _, paths = fsspec.get_fs_token_paths(pattern)
        return sorted(fs.unstrip_protocol(p) for p in paths)
    local = pattern.removeprefix("file://")
    if not os.path.isabs(local):
        local = str(Path(root if root is not None else bundled_data_dir()) / local)
    if "{" in local:
        return [local]
    return sorted(p for p in glob.glob(local) if os.path.isfile(p))  # a folder is not a shard


def _missing_shards(pattern: str, root: Path) -> str | None:
    """Why a source pattern names no readable shard (where it looked), or None when it does."""
    urls = expand_urls(pattern, root)
    if "://" in pattern and not pattern.startswith("file://"):
        return None if urls else f"no shards match {pattern!r}"
    local = pattern.removeprefix("file://")
    where = local if os.path.isabs(local) else str(root / local)
    how = "" if os.path.isabs(local) else f"; relative urls resolve against {root}"
    if "{" in where:
        from webdataset.shardlists import expand_urls as expand_braces

        missing = [u for u in expand_braces(where) if not os.path.isfile(u)]
        if missing:
            return f"{len(missing)} shards of {pattern!r} do not exist (first: {missing[0]}{how})"
        return None
    return None if urls else f"no shards match {pattern!r} (looked for {where}{how})"


def validate(cfg: RunConfig, nproc: int) -> None:
    """Check everything that can be checked before processes start.

    Raises:
        ConfigError: naming the first field that is wrong: parallel sizes vs ``nproc``, head counts not
        divisible (GQA, TP, Ulysses), fewer layers than stages, a source whose ``urls`` name no shard
        (the message says where it looked), mixture weights naming unknown sources or phases out of
        order, non-positive sizes, a schedule that does not fit the layers or microbatches, unknown
        recompute/offload names.
    """
    par, llm = cfg.parallel, cfg.model.llm
    for name in ("pp", "dp", "tp", "cp", "ulysses"):
        if getattr(par, name) < 1:
            raise ConfigError(f"parallel.{name}: must be >= 1, got {getattr(par, name)}")
    if par.world_size != nproc:
        raise ConfigError(
            f"parallel: pp*dp*tp*cp*ulysses = {par.pp}*{par.dp}*{par.tp}*{par.cp}*{par.ulysses} = "
            f"{par.world_size} does not match the process count {nproc} (--nproc)"
        )
    if par.cp > 1 and par.ulysses > 1:
        raise ConfigError("parallel.cp: choose one LLM sequence-parallel flavour (cp or ulysses), not both")
    if llm.dim % llm.n_heads:
        raise ConfigError(f"model.llm.dim: {llm.dim} is not divisible by model.llm.n_heads {llm.n_heads}")
    if (llm.dim // llm.n_heads) % 2:
        raise ConfigError(f"model.llm.dim: head_dim {llm.dim // llm.n_heads} must be even for RoPE")
    if llm.n_heads % llm.n_kv_heads:
        raise ConfigError(
            f"model.llm.n_heads: {llm.n_heads} is not divisible by model.llm.n_kv_heads {llm.n_kv_heads} (GQA)"
        )
    # Column-parallel Q/K/V and SwiGLU gate/up shard whole heads and equal slices of ffn_dim per TP rank.
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(llm, name) % par.tp:
            raise ConfigError(
                f"model.llm.{name}: {getattr(llm, name)} is not divisible by parallel.tp {par.tp}"
            )
    _validate_cp(cfg)
    # Ulysses pads heads that sp does not divide (omni_parallel.ulysses), so no head-count check here.
    if par.ulysses > 1 and par.tp > 1:
        raise ConfigError(
            f"parallel.ulysses: {par.ulysses} together with parallel.tp {par.tp} is not supported "
            "(the loader shares one pack over either the TP or the Ulysses group)"
        )
    if llm.n_layers < par.pp:
        raise ConfigError(
            f"model.llm.n_layers: {llm.n_layers} layers cannot fill parallel.pp = {par.pp} stages"
        )
    if llm.tie_embeddings and par.pp > 1:
        raise ConfigError(
            f"model.llm.tie_embeddings: needs parallel.pp = 1 (got {par.pp}): the embedding and the LM head "
            "would sit on different stages"
        )
    audio = cfg.model.audio
    if audio is not None and audio.stem == "whisper" and audio.subsample != 2:
        raise ConfigError(f"model.audio.subsample: the whisper stem subsamples by 2, got {audio.subsample}")
    for enc in ("vit", "audio"):
        ec = getattr(cfg.model, enc)
        if ec is not None and ec.dim % ec.n_heads:
            raise ConfigError(
                f"model.{enc}.dim: {ec.dim} is not divisible by model.{enc}.n_heads {ec.n_heads}"
            )
        if ec is not None and (ec.dim // ec.n_heads) % 4:
            raise ConfigError(
                f"model.{enc}.dim: head_dim {ec.dim // ec.n_heads} must be a multiple of 4 (2-D RoPE)"
            )
    data = cfg.data
    for name in ("max_seq_len", "microbatches", "buffer_size", "decode_workers"):
        if getattr(data, name) < 1:
            raise ConfigError(f"data.{name}: must be >= 1, got {getattr(data, name)}")
    if data.max_pack_age < 0:
        raise ConfigError(f"data.max_pack_age: must be >= 0 rounds, got {data.max_pack_age}")
    if data.microbatches < par.pp:
        raise ConfigError(
            f"data.microbatches: {data.microbatches} microbatches cannot keep parallel.pp = {par.pp} stages busy"
        )
    if not data.sources:
        raise ConfigError("data.sources: at least one source is needed")
    names = [s.name for s in data.sources]
    for i, src in enumerate(data.sources):
        if src.modality not in ("image", "audio", "text"):
            raise ConfigError(f"data.sources[{i}].modality: {src.modality!r} is not image, audio or text")
        if src.modality == "image" and cfg.model.vit is None:
            raise ConfigError(f"data.sources[{i}].modality: image source {src.name!r} but no [model.vit]")
        if src.modality == "audio" and cfg.model.audio is None:
            raise ConfigError(f"data.sources[{i}].modality: audio source {src.name!r} but no [model.audio]")
        if (src.min_pixels is not None or src.max_pixels is not None) and src.modality != "image":
            raise ConfigError(f"data.sources[{i}].min_pixels: resize bounds are for image sources only")
        vit = cfg.model.vit
        if src.modality == "image" and vit is not None:
            lo = src.min_pixels if src.min_pixels is not None else vit.min_pixels
            hi = src.max_pixels if src.max_pixels is not None else vit.max_pixels
            if not 0 < lo <= hi:
                raise ConfigError(
                    f"data.sources[{i}].max_pixels: need 0 < min_pixels ({lo}) <= max_pixels ({hi})"
                )
        missing = _missing_shards(src.urls, data_root(cfg))
        if missing:
            raise ConfigError(f"data.sources[{i}].urls: {missing} (source {src.name!r})")
    if names.count(names[0]) != 1 or len(set(names)) != len(names):
        raise ConfigError(f"data.sources: source names must be unique, got {names}")
    if not data.mixture:
        raise ConfigError("data.mixture: at least one phase is needed")
    last = 0
    for i, ph in enumerate(data.mixture):
        bad = sorted(set(ph.weights) - set(names))
        if bad:
            raise ConfigError(f"data.mixture[{i}].weights: unknown source {bad[0]!r} (sources: {names})")
        if any(not math.isfinite(w) or w < 0 for w in ph.weights.values()) or sum(ph.weights.values()) <= 0:
            raise ConfigError(
                f"data.mixture[{i}].weights: weights must be finite and >= 0 with a positive sum, got "
                f"{dict(ph.weights)}"
            )
        if i < len(data.mixture) - 1:
            if ph.until_step is None or ph.until_step <= last:
                raise ConfigError(f"data.mixture[{i}].until_step: phases need increasing until_step values")
            last = ph.until_step
        elif ph.until_step is not None:
            raise ConfigError(f"data.mixture[{i}].until_step: the last phase runs to the end; leave it out")
    looked = tokenizer_candidates(cfg)
    if not any(p.is_file() for p in looked):
        raise ConfigError(
            f"data.tokenizer: {data.tokenizer!r} not found; looked in {', '.join(str(p) for p in looked)}"
        )
    if cfg.train.steps < 1:
        raise ConfigError(f"train.steps: must be >= 1, got {cfg.train.steps}")
    unknown = sorted(set(cfg.train.recompute) - set(RECOMPUTE))
    if unknown:
        raise ConfigError(f"train.recompute: {unknown[0]!r} is not one of {list(RECOMPUTE)}")
    if not par.encoder_forward_share > 0:
        raise ConfigError(f"parallel.encoder_forward_share: must be > 0, got {par.encoder_forward_share}")
    if par.encoder_zero not in (0, 2, 3):
        raise ConfigError(
            f"parallel.encoder_zero: {par.encoder_zero} is not one of 0 (encoders whole on every rank), "
            "2 (gradients and optimizer state sharded) or 3 (parameters too)"
        )
    sp_size = par.ulysses if par.ulysses > 1 else (par.cp if not par.hybrid_cp else 1)
    if par.encoder_sp < 1 or (par.encoder_sp > 1 and par.encoder_sp != sp_size):
        raise ConfigError(
            f"parallel.encoder_sp: {par.encoder_sp} must be 1 or the LLM's sequence-parallel size, whose "
            f"group the encoders share: parallel.ulysses ({par.ulysses}) or, for plain CP, parallel.cp "
            f"({par.cp}; not with parallel.hybrid_cp {par.hybrid_cp}, whose CP blocks change per pack)"
        )
    if par.long_threshold < 1:
        raise ConfigError(f"parallel.long_threshold: must be >= 1 token, got {par.long_threshold}")
    if par.planner_evaluations < 1:
        raise ConfigError(f"parallel.planner_evaluations: must be >= 1, got {par.planner_evaluations}")
    cap = par.planner_memory_cap_mib
    if cap is not None and not (math.isfinite(cap) and cap > 0):
        raise ConfigError(f"parallel.planner_memory_cap_mib: must be a number of MiB > 0, got {cap}")
    if par.placement == Placement.PLANNED and par.planner_calibration is not None:
        # read here, before any worker starts, so a wrong run directory is a configuration error and not
        # a traceback from every rank (lazy import: pipeline imports this module)
        from omni_train.pipeline import fitted_cost_model

        fitted_cost_model(cfg)
    g = cfg.data.reorder_group_size
    if g is not None and (g < 1 or par.dp % g):
        raise ConfigError(f"data.reorder_group_size: {g} must be >= 1 and divide parallel.dp {par.dp}")
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep_last < 1:
        raise ConfigError("checkpoint.every: must be >= 0 and checkpoint.keep_last >= 1")
    if cfg.train.profile_steps < 0:
        raise ConfigError(f"train.profile_steps: must be >= 0, got {cfg.train.profile_steps}")
    _validate_schedule_and_memory(cfg)


def _validate_cp(cfg: RunConfig) -> None:
    """CP and hybrid DP/CP: what the trainer's CP path (``omni_pipeline.cp_delivery``) supports."""
    par = cfg.parallel
    if (par.cp > 1 or par.hybrid_cp) and par.tp > 1:
        raise ConfigError(
            f"parallel.cp: context parallelism together with parallel.tp {par.tp} is not supported yet"
        )
    if (par.cp > 1 or par.hybrid_cp) and cfg.train.compile:
        raise ConfigError("train.compile: not supported with context parallelism (parallel.cp > 1) yet")
    g = cfg.data.reorder_group_size
    if (par.cp > 1 or par.hybrid_cp) and g is not None and g > 1 and par.reorder:
        raise ConfigError(
            f"data.reorder_group_size: {g} with context parallelism (parallel.cp {par.cp}, hybrid_cp "
            f"{par.hybrid_cp}): the CP ranks already balance each encoder microbatch; reordering across DP "
            "is not combined with CP, set it to 1"
        )
    if par.hybrid_cp and (par.ulysses > 1 or par.dp * par.cp < 2):
        raise ConfigError(
            f"parallel.hybrid_cp: needs dp * cp >= 2 ranks per stage to share (got dp {par.dp} x cp "
            f"{par.cp}) and no parallel.ulysses"
        )
    for i, src in enumerate(cfg.data.sources):
        if src.join_tokens < 0 or (src.join_tokens and src.modality != "text"):
            raise ConfigError(
                f"data.sources[{i}].join_tokens: joins text documents only, must be >= 0 "
                f"(got {src.join_tokens} on a {src.modality} source)"
            )


def _validate_stage_layers(layers: list[int] | str | None, stages: int, n_layers: int, sizes: str) -> None:
    """``parallel.stage_layers``: unset, ``"auto"``, or one count >= 1 per stage summing to the layers."""
    if layers is None or layers == "auto":
        return
    if isinstance(layers, str):
        raise ConfigError(f"parallel.stage_layers: {layers!r} is not 'auto' or a list of layer counts")
    if len(layers) != stages:
        raise ConfigError(
            f"parallel.stage_layers: {len(layers)} entries {layers}, need one per stage: parallel.pp * "
            f"parallel.virtual_stages = {sizes} = {stages}"
        )
    for s, n in enumerate(layers):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"parallel.stage_layers[{s}]: stage {s} must hold >= 1 layers, got {n!r}")
    if sum(layers) != n_layers:
        raise ConfigError(
            f"parallel.stage_layers: {layers} sum to {sum(layers)}, model.llm.n_layers is {n_layers}"
        )


def _validate_schedule_and_memory(cfg: RunConfig) -> None:
    """``parallel.schedule`` / ``virtual_stages`` against the model and the microbatches, and the
    activation memory options (``train.recompute_modules``, ``train.offload``)."""
    par, llm, train = cfg.parallel, cfg.model.llm, cfg.train
    v, m = par.virtual_stages, cfg.data.microbatches
    if v < 1:
        raise ConfigError(f"parallel.virtual_stages: must be >= 1, got {v}")
    if v > 1 and par.schedule == PipelineSchedule.ONE_F_ONE_B:
        raise ConfigError(
            f"parallel.virtual_stages: {v} stages per rank need parallel.schedule = 'interleaved' or "
            "'gpipe' (1f1b holds one stage per rank)"
        )
    if llm.n_layers < par.pp * v:
        raise ConfigError(
            f"model.llm.n_layers: {llm.n_layers} layers cannot fill parallel.pp * parallel.virtual_stages "
            f"= {par.pp} * {v} = {par.pp * v} stages"
        )
    if llm.tie_embeddings and par.pp * v > 1:
        raise ConfigError(
            f"model.llm.tie_embeddings: needs one LLM stage (parallel.pp * parallel.virtual_stages = "
            f"{par.pp * v}): the embedding and the LM head would sit on different stages"
        )
    # The interleaved schedule runs microbatches in rounds of max(1, M // pp) (torch's and Megatron's
    # ScheduleInterleaved1F1B rule), which must divide M.
    rounds = max(1, m // par.pp)
    if par.schedule == PipelineSchedule.INTERLEAVED and m % rounds:
        raise ConfigError(
            f"data.microbatches: {m} microbatches do not split into the interleaved schedule's "
            f"{rounds} rounds (max(1, microbatches // parallel.pp) with parallel.pp = {par.pp}, "
            f"parallel.virtual_stages = {v}); use a multiple of parallel.pp"
        )
    _validate_stage_layers(par.stage_layers, par.pp * v, llm.n_layers, f"{par.pp} * {v}")
    if par.stage_calibration is not None:
        if not par.stage_calibration.strip():  # "" would read the working directory, or be taken as unset
            raise ConfigError(
                "parallel.stage_calibration: an empty path; name a run directory, or leave it unset"
            )
        if par.stage_layers != "auto":
            raise ConfigError(
                f"parallel.stage_calibration: calibrates the 'auto' split; parallel.stage_layers is "
                f"{par.stage_layers!r}"
            )
        from omni_train.pipeline import stage_split  # lazy: pipeline imports this module

        vocab = load_tokenizer(cfg.data).get_vocab_size()  # found: checked above
        # read here: a bad run directory is a config error
        stage_split(par, cfg.model.llm_config(vocab), cfg.data.max_seq_len)
    for name, allowed in (("recompute_modules", RECOMPUTE_MODULES), ("offload", OFFLOAD)):
        unknown = sorted(set(getattr(train, name)) - set(allowed))
        if unknown:
            raise ConfigError(f"train.{name}: {unknown[0]!r} is not one of {list(allowed)}")
    both = sorted(set(train.offload) & set(train.recompute))
    if both and not train.recompute_modules:
        raise ConfigError(
            f"train.offload: {both[0]!r} is also in train.recompute with whole blocks recomputed (no "
            "train.recompute_modules): such a block keeps no activations to offload; choose one"
        )


# -- command-line overrides -----------------------------------------------------------------------------
# ``--parallel.pp 4 --optim.lr 3e-4 --data.sources[0].urls 'x-*.tar'``: each names a field by its dotted
# path (list items by ``[i]``, table entries such as mixture weights by ``.key``) and sets it in the raw
# TOML tables before ``_build`` type-checks them, so an override is checked exactly as the TOML is. The
# string is read by the field's type: ``str`` as is, ``int``/``float``/``bool`` (true/false, on/off,
# yes/no, 1/0) parsed, ``none`` for an optional field, a list of strings comma-separated or as a TOML array,
# any other list or table as a TOML value (``'{ image = 0.5, text = 0.5 }'``).

_PATH_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)$")
_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; anything else -> ``(tp, False)``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _split_path(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for piece in path.split("."):
        m = _PATH_PART.match(piece)
        if m is None:
            raise ConfigError(f"{path}: not a field path (expected e.g. parallel.pp or data.sources[0].urls)")
        parts.append(m.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", m.group(2)))
    return parts


def _fields(tp: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(tp)
    return {f.name: hints[f.name] for f in dataclasses.fields(tp) if f.init and f.name != "source"}


def _parse_value(tp: Any, text: str | None, where: str) -> Any:
    """The plain (TOML-like) value ``text`` stands for as a value of type ``tp``; ``None`` text: a bare
    flag (``--train.compile``), true for a bool field."""
    alternatives = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
    tp, optional = _unwrap(tp)
    if optional and text is not None and text.lower() in ("none", "null"):
        return None
    if text is not None and str in alternatives and not text.lstrip().startswith("["):
        return text  # a list-or-string field given a word (parallel.stage_layers auto)
    if text is None:
        if tp is bool:
            return True
        raise ConfigError(f"{where}: needs a value ({_describe(tp)})")
    if optional and text.lower() in ("none", "null"):
        return None
    if tp is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ConfigError(f"{where}: expected a bool (true/false, on/off), got {text!r}")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {text!r}") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {text!r}") from None
    if tp is str:
        return text
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        if text not in {str(m) for m in tp}:
            raise ConfigError(f"{where}: {text!r} is not one of {[str(m) for m in tp]}")
        return text
    if typing.get_origin(tp) is list and typing.get_args(tp) == (str,) and not text.lstrip().startswith("["):
        return [s.strip() for s in text.split(",") if s.strip()]
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(f"{where}: expected {_describe(tp)} as a TOML value, got {text!r}") from None


def _describe(tp: Any) -> str:
    tp, optional = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        name = "one of " + "|".join(str(m) for m in tp)
    elif dataclasses.is_dataclass(tp):
        name = "a table"
    elif typing.get_origin(tp) is list:
        name = "a list"
    elif typing.get_origin(tp) is dict:
        name = "a table"
    else:
        name = {bool: "a bool", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))
    return name + (" or none" if optional else "")


def apply_overrides(raw: dict[str, Any], overrides: Sequence[tuple[str, str | None]]) -> dict[str, Any]:
    """Set each ``(field path, value text)`` of ``overrides`` in the raw TOML tables ``raw`` (in place, in
    order; returns ``raw``). See the comment above for the syntax. ``[i]`` may be one past a list's end
    to append an item (given field by field). Types are checked here for the field and again by
    :func:`load_config`'s type-check of the whole config.

    Raises:
        ConfigError: naming the field: an unknown field (with the allowed names), an index out of range,
            a value that does not parse as the field's type (with the allowed values of an enum).
    """
    for path, text in overrides:
        parts = _split_path(path)
        tp: Any = RunConfig
        node: Any = raw
        where = ""
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            tp, _ = _unwrap(tp)
            if isinstance(part, int):
                if typing.get_origin(tp) is not list:
                    raise ConfigError(f"{where}: not a list, [{part}] does not apply")
                where = f"{where}[{part}]"
                (tp,) = typing.get_args(tp)
                if not isinstance(node, list):
                    raise ConfigError(f"{where}: the config has no list here")
                if part > len(node):
                    raise ConfigError(f"{where}: index out of range (the config has {len(node)} items)")
                if part == len(node):
                    node.append({})
                key: str | int = part
            elif dataclasses.is_dataclass(tp):
                fields = _fields(tp)
                where = f"{where}.{part}".lstrip(".")
                if part not in fields:
                    raise ConfigError(f"{where}: unknown field (allowed: {sorted(fields)})")
                tp, key = fields[part], part
            elif typing.get_origin(tp) is dict:
                where = f"{where}.{part}"
                tp, key = typing.get_args(tp)[1], part
            else:
                raise ConfigError(f"{where}: is {_describe(tp)}, it has no field {part!r}")
            if last:
                node[key] = _parse_value(tp, text, where)
                break
            child = node[key] if (isinstance(node, list) or key in node) else None
            if child is None:
                child = [] if typing.get_origin(_unwrap(tp)[0]) is list else {}
                node[key] = child
            if not isinstance(child, dict | list):
                raise ConfigError(f"{where}: is a value, it has no field {parts[i + 1]!r}")
            node = child
    return raw


def field_paths(tp: Any = None, prefix: str = "") -> list[tuple[str, str]]:
    """Every overridable field as ``(dotted path, type description)``: lists of tables as ``path[i]``."""
    out: list[tuple[str, str]] = []
    for name, ft in _fields(RunConfig if tp is None else tp).items():
        inner, _ = _unwrap(ft)
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(inner):
            out += field_paths(inner, path + ".")
        elif typing.get_origin(inner) is list and dataclasses.is_dataclass(typing.get_args(inner)[0]):
            out += field_paths(typing.get_args(inner)[0], path + "[i].")
        elif typing.get_origin(inner) is dict:
            out.append((path + ".KEY", _describe(typing.get_args(inner)[1])))
        else:
            out.append((path, _describe(ft)))
    return out


def _drop_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


def to_toml(cfg: RunConfig) -> str:
    """The config as TOML that :func:`load_config` reads back to an equal config (``source`` left out;
    unset optional fields, which TOML cannot write, left out, i.e. at their default ``None``)."""
    import tomli_w

    plain = cfg.to_dict()
    plain.pop("source", None)
    return tomli_w.dumps(_drop_none(plain))


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(obj, dict):
        if not obj and prefix:
            out[prefix] = {}
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}[{i}]", out)
        out[f"{prefix}.len"] = len(obj)
    else:
        out[prefix] = obj
    return out


# Fields a resumed run may change (``--resume``, checked by :func:`resume_differences` before any worker
# starts): the length of the run, its checkpoint cadence, the optimizer's hyperparameters and schedule
# (the saved AdamW moments load whatever the learning rate; the cosine schedule is recomputed over the
# new ``train.steps``), and execution options that leave the state unchanged. Everything else (the model,
# the data and its mixture, the parallel layout, the seed and the dtype) shapes the saved model,
# optimizer or loader state, or the data order the loader resumes in. From a step-0 checkpoint (weights
# only: ``omni-train import-hf``) only ``model`` must match.
RESUME_MAY_CHANGE = (
    "name",
    "train.steps",
    "train.compile",
    "train.recompute",
    "train.profile_steps",
    "train.recompute_modules",
    "train.offload",
    "checkpoint",
    "optim",
)


def resume_differences(saved: RunConfig, cfg: RunConfig, *, weights_only: bool = False) -> list[str]:
    """The fields in which ``cfg`` differs from the run's ``saved`` config and that a resume cannot change
    (see :data:`RESUME_MAY_CHANGE`), each as ``"field: saved -> new"``; empty if compatible.

    Args:
        weights_only: the checkpoint to resume holds weights only (step 0): only ``model.*`` counts.
    """
    old, new = _flatten(saved.to_dict(), "", {}), _flatten(cfg.to_dict(), "", {})
    out = []
    for key in sorted(set(old) | set(new)):
        if key == "source" or any(key == f or key.startswith((f + ".", f + "[")) for f in RESUME_MAY_CHANGE):
            continue
        if weights_only and not key.startswith("model."):
            continue
        if old.get(key, "(absent)") != new.get(key, "(absent)"):
            out.append(f"{key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}")
    return out
