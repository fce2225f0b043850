"""The LLM pipeline of a run: the stages one pipeline rank holds, and the mapping from the run config to
omni-pipeline's specs (the model's shapes, the layer split, the planner's cost model).

With ``V = parallel.virtual_stages`` the layers are split over ``pp * V`` stages (:func:`stage_split`:
``parallel.stage_layers``, by omni-pipeline's :func:`omni_pipeline.split_layers`) and pipeline rank ``r``
holds stages ``r, r + pp, ..., r + (V - 1) pp`` (``Schedule.rank_stages``, Megatron-LM's and torch's
round-robin; the schedule itself: :func:`omni_pipeline.build_schedule`). Each stage is an
:class:`~omni_train.models.LLMStage`; the executor runs them as separate modules. The trainer sees them
as one :class:`RankStages` whose parameter names are those of a single ``LLMStage`` over the same layers
(``tok_embeddings.weight``, ``layers.<global index>.*``, ``norm.weight``, ``output.weight``), so a
checkpoint (model and optimizer, saved by name) loads under every schedule, ``pp`` and ``V``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist
from torch import nn

from omni_parallel.flops import TransformerShape
from omni_pipeline import (
    CostModel,
    LLMShape,
    ModelScale,
    PlannerSpec,
    RecordError,
    Schedule,
    calibrated_layer_costs,
    model_scale,
    read_records,
    split_layers,
    stage_slices,
)
from omni_pipeline import fitted_cost_model as fit_planner_costs
from omni_train.binder import config_from_dict
from omni_train.config import ConfigError, ParallelConfigSection, RunConfig
from omni_train.data_files import load_tokenizer
from omni_train.models.llm import LLMConfig, LLMStage

__all__ = [
    "RankStages",
    "build_rank_stages",
    "config_scale",
    "fitted_cost_model",
    "image_merge",
    "llm_shape",
    "measured_layer_costs",
    "planner_spec",
    "stage_split",
]

# model.llm fields a calibration run must share with the run it calibrates (what a layer's time depends on)
_SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "qkv_bias", "tie_embeddings")


def llm_shape(cfg: LLMConfig) -> LLMShape:
    """``cfg``'s sizes as omni-pipeline's cost model sees them."""
    return LLMShape(cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size)


def image_merge(cfg: RunConfig) -> int:
    """The ViT's patch-merge side (2 without a ViT): ``media_tokens * merge**2`` patches per image."""
    return cfg.model.vit.merge if cfg.model.vit is not None else 2


def config_scale(cfg: RunConfig) -> ModelScale:
    """The config's own model sizes for the cost model (:func:`omni_pipeline.model_scale`): the LLM's
    SwiGLU GQA blocks and each encoder's GELU blocks of its ``mlp_ratio``."""
    encoders = {
        name: TransformerShape(dim=e.dim, n_layers=e.n_layers, n_heads=e.n_heads, mlp_ratio=e.mlp_ratio)
        for name, e in (("image", cfg.model.vit), ("audio", cfg.model.audio))
        if e is not None
    }
    tp = cfg.model.vit.temporal_patch if cfg.model.vit is not None else 2  # a video's temporal slices
    return model_scale(
        llm_shape(cfg.model.llm).blocks, encoders, image_merge=image_merge(cfg), temporal_patch=tp
    )


def fitted_cost_model(cfg: RunConfig) -> CostModel:
    """The cost model fitted from ``parallel.planner_calibration``'s ``actions.jsonl``
    (:func:`omni_pipeline.fitted_cost_model`, its first step dropped as warm-up when it has more).

    Raises:
        ConfigError: naming ``parallel.planner_calibration``: no readable records there, or they were
            recorded with another pipeline size than ``parallel.pp``.
    """
    run = Path(cfg.parallel.planner_calibration or "")
    try:
        return fit_planner_costs(run, cfg.parallel.pp)
    except (OSError, ValueError) as exc:  # RecordError is a ValueError
        raise ConfigError(f"parallel.planner_calibration: {run}: {exc}") from None


def planner_spec(cfg: RunConfig) -> PlannerSpec:
    """``placement = "planned"``'s per-step planner settings (:class:`omni_pipeline.PlannerSpec`):
    ``parallel.planner_evaluations``, ``planner_memory_cap_mib`` and ``planner_calibration`` (fitted
    here), the config's model sizes and dtype.

    Raises:
        ConfigError: as :func:`fitted_cost_model`.
    """
    par = cfg.parallel
    cap = par.planner_memory_cap_mib
    return PlannerSpec(
        scale=config_scale(cfg),
        max_evaluations=par.planner_evaluations,
        memory_cap_bytes=None if cap is None else cap * 2**20,
        fitted=fitted_cost_model(cfg) if par.planner_calibration else None,
        dtype_bytes=8.0 if str(cfg.train.dtype) == "float64" else 4.0,
    )


def stage_split(par: ParallelConfigSection, cfg: LLMConfig, max_seq_len: int) -> list[range]:
    """The layers of each of the ``par.pp * par.virtual_stages`` stages from ``par.stage_layers``
    (:func:`omni_pipeline.split_layers`): a list of counts, ``"auto"`` (balanced over the modelled
    :func:`omni_pipeline.layer_costs`, or with ``par.stage_calibration`` over
    :func:`measured_layer_costs`), or unset (the equal-cost split).

    Raises:
        ValueError: counts that do not fit the layers (:func:`omni_train.preflight.validate` names the
            field first).
        ConfigError: ``par.stage_calibration`` cannot calibrate this model (see
            :func:`measured_layer_costs`).
    """
    return _split(par, cfg, max_seq_len, ())


def _split(
    par: ParallelConfigSection, cfg: LLMConfig, max_seq_len: int, seen: tuple[Path, ...]
) -> list[range]:
    costs = None
    if par.stage_layers == "auto" and par.stage_calibration:
        costs = _measured(Path(par.stage_calibration), cfg, max_seq_len, seen)
    return split_layers(
        llm_shape(cfg),
        par.pp * par.virtual_stages,
        par.stage_layers,
        max_seq_len=max_seq_len,
        costs=costs,
    )


def measured_layer_costs(run: str | Path, cfg: LLMConfig, max_seq_len: int) -> tuple[float, float, float]:
    """``(one block, the embedding, the final norm + LM head + loss)`` in measured seconds per LLM
    microbatch (forward + backward), from a run of the same model: its ``config.json`` gives the layers
    of each stage (:func:`stage_split` of that config), its ``actions.jsonl`` each stage's times, and
    :func:`omni_pipeline.calibrated_layer_costs` fits them.

    Raises:
        ConfigError: naming ``parallel.stage_calibration`` and ``run``: no readable ``config.json`` or
            records, a model shape (``model.llm`` dim, layers, heads, FFN width), ``data.max_seq_len``
            or (with ``cfg.vocab_size`` set) vocabulary other than this run's, a tokenizer that does
            not load, fewer than 2 recorded stages, a recorded stage without LLM actions
            or one outside the recorded split, stage times that fit no positive seconds per layer, or
            calibration runs that name each other in a cycle.
    """
    return _measured(Path(run), cfg, max_seq_len, ())


def _measured(
    run: Path, cfg: LLMConfig, max_seq_len: int, seen: tuple[Path, ...]
) -> tuple[float, float, float]:
    where = f"parallel.stage_calibration: {run}"
    key = run.resolve()
    if key in seen:
        raise ConfigError(f"{where}: calibration runs name each other in a cycle ({[str(p) for p in seen]})")
    try:
        recorded = config_from_dict(json.loads((run / "config.json").read_text()))
    except (OSError, ValueError, ConfigError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{where}: no readable run config config.json ({exc})") from None
    theirs, ours = recorded.model.llm, dataclasses.asdict(cfg)
    differ = [f for f in _SHAPE if getattr(theirs, f) != ours[f]]
    if recorded.data.max_seq_len != max_seq_len:
        differ.append("data.max_seq_len")
    if differ:
        raise ConfigError(
            f"{where}: recorded with another model shape ({', '.join(differ)} differ); calibrate with a run "
            "of this model"
        )
    try:  # that run's "auto" split weighed its own LM head: its vocabulary
        vocab = load_tokenizer(recorded.data).get_vocab_size()
    except Exception as exc:  # tokenizers raises its own Exception type for a missing or bad file
        raise ConfigError(
            f"{where}: its data.tokenizer {recorded.data.tokenizer} does not load ({exc})"
        ) from None
    if cfg.vocab_size is not None and vocab != cfg.vocab_size:
        raise ConfigError(
            f"{where}: recorded with a vocabulary of {vocab} (its data.tokenizer), this run's has "
            f"{cfg.vocab_size}: the LM head's time differs; calibrate with a run of this tokenizer"
        )
    split = _split(recorded.parallel, dataclasses.replace(cfg, vocab_size=vocab), max_seq_len, (*seen, key))
    if len(split) < 2:  # one stage holds the head and every layer: their costs cannot be told apart
        raise ConfigError(
            f"{where}: recorded with {len(split)} LLM stage (parallel.pp * virtual_stages); calibrate with a "
            "run of >= 2 stages"
        )
    try:
        records = read_records(run)
    except (OSError, RecordError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    try:
        return calibrated_layer_costs(records, split, llm_shape(cfg), max_seq_len)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


class RankStages(nn.Module):
    """The LLM stages of one pipeline rank, named as one model.

    The stages' submodules are registered here, not the stages themselves: the embedding (stage 0),
    every layer under ``layers.<global index>``, the final norm and LM head (last stage). The stage
    modules, for the executor, are :attr:`chunks` ``{stage: LLMStage}``; they share these submodules.

    Args:
        chunks: ``{global stage index: LLMStage}`` of this rank.

    Raises:
        ValueError: no stages, or two stages holding the same layer or the same non-layer submodule.
    """

    def __init__(self, chunks: Mapping[int, LLMStage]) -> None:
        super().__init__()
        if not chunks:
            raise ValueError("RankStages: a pipeline rank holds at least one LLM stage")
        self.layers = nn.ModuleDict()
        for s in sorted(chunks):
            for name, child in chunks[s].named_children():
                if name == "layers":
                    for i, block in child.items():
                        if i in self.layers:
                            raise ValueError(f"RankStages: layer {i} is held by two stages (stage {s})")
                        self.layers[i] = block
                elif hasattr(self, name):
                    raise ValueError(f"RankStages: {name} is held by two stages (stage {s})")
                else:
                    self.add_module(name, child)
        self.chunks: dict[int, LLMStage] = dict(sorted(chunks.items()))  # plain dict: not registered twice


def build_rank_stages(
    cfg: LLMConfig,
    schedule: Schedule,
    pp_rank: int,
    *,
    seed: int,
    sp_group: dist.ProcessGroup | None = None,
    split: list[range] | None = None,
    ep_group: dist.ProcessGroup | None = None,
) -> RankStages:
    """The stages ``schedule`` places on pipeline rank ``pp_rank``, each over its range of ``split``
    (:func:`stage_split`; default the equal split of ``schedule.num_stages`` stages), initialised per
    layer from ``seed``: any split holds the same weights (and any ``ep_group``, over which MoE experts
    are sharded)."""
    split = split or stage_slices(cfg.n_layers, schedule.num_stages)
    if len(split) != schedule.num_stages:
        raise ValueError(f"build_rank_stages: {len(split)} layer ranges for {schedule.num_stages} stages")
    return RankStages(
        {
            s: LLMStage(
                cfg, s, schedule.num_stages, seed=seed, sp_group=sp_group, layers=split[s], ep_group=ep_group
            )
            for s in schedule.rank_stages(pp_rank)
        }
    )
