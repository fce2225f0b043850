"""The LLM pipeline of a run: its schedule (``parallel.schedule``, ``parallel.virtual_stages``) and the
stages one pipeline rank holds.

With ``V = virtual_stages`` the layers are split over ``pp * V`` stages (:func:`stage_split`:
``parallel.stage_layers``, by omni-pipeline's one splitter) and pipeline rank ``r`` holds stages ``r, r + pp, ...,
r + (V - 1) pp`` (``Schedule.rank_stages``, Megatron-LM's and torch's round-robin). Each stage is an
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

from omni_pipeline import (
    RecordError,
    Schedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    balance_stages,
    explicit_stages,
    fit_layer_costs,
    read_records,
    stage_slices,
)
from omni_train.config import (
    ConfigError,
    ParallelConfigSection,
    PipelineSchedule,
    config_from_dict,
    load_tokenizer,
)
from omni_train.models.llm import LLMConfig, LLMStage

__all__ = [
    "RankStages",
    "build_rank_stages",
    "build_schedule",
    "layer_costs",
    "measured_layer_costs",
    "stage_split",
]

# model.llm fields a calibration run must share with the run it calibrates (what a layer's time depends on)
_SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "qkv_bias", "tie_embeddings")


def layer_costs(cfg: LLMConfig, max_seq_len: int) -> tuple[float, float, float]:
    """Modelled forward FLOPs per token (2 per multiply-add) of ``(one block, the embedding, the final
    norm + LM head + loss)``: a block's matmuls (GQA Q/K/V/O, SwiGLU MLP) plus attention over a whole
    ``max_seq_len``-token document (the most a pack holds); the embedding a ``dim``-wide row gather;
    the head its ``dim x vocab`` matmul plus about 5 operations per vocabulary entry for the log-softmax
    and the loss. Megatron-LM's account-for-embedding/loss split counts each as one layer instead.

    Raises:
        ValueError: ``cfg.vocab_size`` is not set.
    """
    if cfg.vocab_size is None:
        raise ValueError("layer_costs: LLMConfig.vocab_size is not set (take it from the tokenizer)")
    d, kv = cfg.dim, cfg.dim * cfg.n_kv_heads // cfg.n_heads
    block = 2.0 * (2 * d * d + 2 * d * kv + 3 * d * cfg.ffn_dim) + 4.0 * max_seq_len * d
    return block, float(d), 2.0 * d * cfg.vocab_size + 5.0 * cfg.vocab_size


def stage_split(par: ParallelConfigSection, cfg: LLMConfig, max_seq_len: int) -> list[range]:
    """The layers of each of the ``par.pp * par.virtual_stages`` stages from ``par.stage_layers``: a
    list of counts (:func:`omni_pipeline.explicit_stages`), ``"auto"``
    (:func:`omni_pipeline.balance_stages` over :func:`layer_costs`, or with ``par.stage_calibration``
    over :func:`measured_layer_costs`), or unset (:func:`omni_pipeline.stage_slices`, the equal-cost
    split).

    Raises:
        ValueError: counts that do not fit the layers (``validate`` in ``omni_train.config`` names the
            field first).
        ConfigError: ``par.stage_calibration`` cannot calibrate this model (see
            :func:`measured_layer_costs`).
    """
    return _split(par, cfg, max_seq_len, ())


def _split(
    par: ParallelConfigSection, cfg: LLMConfig, max_seq_len: int, seen: tuple[Path, ...]
) -> list[range]:
    stages = par.pp * par.virtual_stages
    if par.stage_layers is None:
        return stage_slices(cfg.n_layers, stages)
    if par.stage_layers == "auto":
        if par.stage_calibration:
            block, first, last = _measured(Path(par.stage_calibration), cfg, max_seq_len, seen)
        else:
            block, first, last = layer_costs(cfg, max_seq_len)
        return balance_stages([block] * cfg.n_layers, stages, first_stage_extra=first, last_stage_extra=last)
    split = explicit_stages(par.stage_layers, cfg.n_layers)
    if len(split) != stages:
        raise ValueError(f"parallel.stage_layers: {len(split)} stages given, the pipeline has {stages}")
    return split


def measured_layer_costs(run: str | Path, cfg: LLMConfig, max_seq_len: int) -> tuple[float, float, float]:
    """``(one block, the embedding, the final norm + LM head + loss)`` in measured seconds per LLM
    microbatch (forward + backward), from a run of the same model: its ``actions.jsonl`` gives each
    stage's mean F + B seconds per microbatch (the first recorded step dropped as warm-up), its
    ``config.json`` the layers of each stage (:func:`stage_split` of that config), and
    :func:`omni_pipeline.fit_layer_costs` solves ``stage s = layers_s * block + [s last] * head`` (least
    squares over the stages; exact with 2). The embedding, a row gather that one split cannot tell apart
    from the layers, is the modelled share of a block (:func:`layer_costs`) of the fitted block.

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
    steps = sorted({r.step for r in records.actions})
    first = steps[1] if len(steps) > 1 else (steps[0] if steps else 0)
    busy = [0.0] * len(split)
    seen_mb: list[set[tuple[int, int]]] = [set() for _ in split]
    for r in records.actions:
        if r.stage is not None and not 0 <= r.stage < len(split):
            raise ConfigError(
                f"{where}: actions.jsonl records LLM stage {r.stage} (step {r.step}), its config.json splits "
                f"the layers over {len(split)} stages; are the records another run's?"
            )
        if r.stage is not None and r.step >= first:
            busy[r.stage] += r.end_s - r.start_s
            seen_mb[r.stage].add((r.step, r.microbatch))
    missing = [s for s, mbs in enumerate(seen_mb) if not mbs]
    if missing:
        raise ConfigError(f"{where}: no LLM actions recorded for stages {missing} of its {len(split)}")
    per_mb = [b / len(mbs) for b, mbs in zip(busy, seen_mb)]
    counts = [len(r) for r in split]
    block_flops, first_flops, _ = layer_costs(dataclasses.replace(cfg, vocab_size=1), max_seq_len)  # no head
    block, head = fit_layer_costs(per_mb, counts)
    embedding = block * first_flops / block_flops
    block, head = fit_layer_costs(per_mb, counts, first_stage_extra=embedding)  # without it in the layers
    if block <= 0.0:  # balance_stages over zero-cost layers would return an arbitrary split
        raise ConfigError(
            f"{where}: the recorded stage times {per_mb} s per microbatch fit no positive seconds per layer"
        )
    return block, block * first_flops / block_flops, head


def build_schedule(par: ParallelConfigSection, microbatches: int) -> Schedule:
    """The LLM schedule over ``par.pp`` ranks and ``microbatches`` LLM microbatches.

    Raises:
        omni_pipeline.ScheduleError: sizes the schedule cannot run (``validate`` in
            ``omni_train.config`` names the field first).
    """
    kind, v = PipelineSchedule(par.schedule), par.virtual_stages
    if kind is PipelineSchedule.GPIPE:
        return ScheduleGPipe(par.pp, microbatches, v)
    if kind is PipelineSchedule.INTERLEAVED:
        return ScheduleInterleaved1F1B(par.pp, microbatches, v)
    return Schedule1F1B(par.pp, microbatches, v)


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
) -> RankStages:
    """The stages ``schedule`` places on pipeline rank ``pp_rank``, each over its range of ``split``
    (:func:`stage_split`; default the equal split of ``schedule.num_stages`` stages), initialised per
    layer from ``seed``: any split holds the same weights."""
    split = split or stage_slices(cfg.n_layers, schedule.num_stages)
    if len(split) != schedule.num_stages:
        raise ValueError(f"build_rank_stages: {len(split)} layer ranges for {schedule.num_stages} stages")
    return RankStages(
        {
            s: LLMStage(cfg, s, schedule.num_stages, seed=seed, sp_group=sp_group, layers=split[s])
            for s in schedule.rank_stages(pp_rank)
        }
    )
