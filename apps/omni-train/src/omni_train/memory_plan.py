"""``omni-train memory``: per-rank bytes of a layout before renting it, through the training build path.

Each planned rank is built in this process on the ``meta`` device over torch's fake process group
(``omni_parallel.testing.fake_world``: every collective returns at once, nothing is allocated) by the
functions a training rank calls (:func:`omni_train.wiring.parallel_state`, :func:`omni_train.wiring.build_model`:
``parallelize`` with TP, LLM and encoder ZeRO, AdamW), so every layout option applies as in a run. Its
bytes by kind come from :func:`omni_parallel.memory.planned_state_bytes` (what ``metrics.jsonl``'s
``*_state_bytes_per_rank`` will measure after the first step) and the LLM's saved activations from
:func:`omni_parallel.memory.block_activation_bytes` times the layers the schedule holds in flight.

Ranks with the same layout are built once: pipeline ranks whose stages hold the same layer counts (and
the same embedding / LM head) share one build (``same_pp_ranks``), of their first rank (every other
coordinate 0: the largest FSDP2 shards) and their last (the smallest); a 1F1B pipeline of equal stages
needs 6 builds whatever its size. Ranks of one stage differ only in the size of their last shards.

``scale="paper"``: LLaMA-12B + ViT-1B + USM-2B (``omni_pipeline.step_costs.MODEL_SHAPES``; the app's
encoders take whole-number MLP ratios: ViT ``round(6144 / 1408) = 4``, audio ``round(9.5) = 10``) at the
``paper-omni`` workload's pack length and microbatches, LLaMA-2's 32000-token vocabulary, bfloat16
(float32 master parameters, bf16 activations).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from omni_parallel.memory import KINDS, block_activation_bytes, planned_state_bytes
from omni_parallel.parallelize import training_dtypes
from omni_parallel.testing import fake_world
from omni_pipeline import ActionKind, build_schedule
from omni_pipeline.step_costs import MODEL_SHAPES
from omni_train import wiring
from omni_train.config import ConfigError, RunConfig
from omni_train.pipeline import stage_split
from omni_train.preflight import validate

__all__ = ["PAPER_VOCAB", "format_plan", "memory_plan", "paper_config"]

PAPER_VOCAB = 32000  # LLaMA-2's tokenizer (MODEL_SHAPES' llama-12b is LLaMA-2-13B's blocks)


def paper_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the paper's model sizes, pack length and microbatches (module docstring)."""
    from importlib import resources

    from omni_pipeline import load_workload

    llm, vit, audio = (MODEL_SHAPES[k] for k in ("llama-12b", "vit-1b", "usm-2b"))
    # the bundled workload file read directly: omni_train.simulate (its resolver) imports this module
    work = load_workload(
        Path(str(resources.files("omni_train") / "configs" / "workloads" / "paper-omni.toml"))
    )
    m = cfg.model
    model = dataclasses.replace(
        m,
        llm=dataclasses.replace(m.llm, dim=llm.dim, n_layers=llm.n_layers, n_heads=llm.n_heads,
                                n_kv_heads=llm.n_kv_heads or llm.n_heads, ffn_dim=int(llm.ffn_dim), vocab_size=None),
        vit=dataclasses.replace(m.vit, dim=vit.dim, n_layers=vit.n_layers, n_heads=vit.n_heads,
                                mlp_ratio=round(vit.ffn_dim / vit.dim)),
        audio=dataclasses.replace(m.audio, dim=audio.dim, n_layers=audio.n_layers, n_heads=audio.n_heads,
                                  mlp_ratio=round(audio.ffn_dim / audio.dim)),
    )  # fmt: skip
    data = dataclasses.replace(cfg.data, max_seq_len=work.max_seq_len, microbatches=work.microbatches)
    train = dataclasses.replace(cfg.train, dtype="bfloat16")  # float32 masters, bf16 compute
    return dataclasses.replace(cfg, model=model, data=data, train=train)


def _in_flight_bytes(schedule: Any, pp_rank: int, stage_bytes: dict[int, int]) -> int:
    """Peak over pipeline rank ``pp_rank``'s program of the activations it holds: each microbatch
    forwarded and not yet backwarded holds its stage's ``stage_bytes``."""
    live = peak = 0
    for a in schedule.actions(pp_rank):
        if a.kind is ActionKind.FORWARD:
            live += stage_bytes[a.stage]
        elif a.kind is ActionKind.BACKWARD:
            live -= stage_bytes[a.stage]
        peak = max(peak, live)
    return peak


def _rank_plan(cfg: RunConfig, gpus: int, rank: int, vocab: int) -> dict[str, Any]:
    par, train = cfg.parallel, cfg.train
    with fake_world(gpus, rank=rank):
        ps = wiring.parallel_state(cfg, checkpoint_group=False)
        schedule = build_schedule(par.schedule, par.pp, cfg.data.microbatches, par.virtual_stages)
        parts = wiring.build_model(cfg, ps, schedule, vocab, torch.device("meta"))
        whole = getattr(par, "llm_zero", 0) == 1 and ps.size("dp_cp") > 1  # ZeRO-1: gradients whole
        # the stage modules, not the RankStages holding their submodules: each stage module is an FSDP2
        # root unit (embedding, final norm, LM head) that RankStages does not register
        llm = planned_state_bytes(parts.stage.chunks.values(), parts.optimizer, whole_gradients=whole)
        enc = planned_state_bytes(parts.encoders.towers.values(), parts.optimizer)
        pp_rank = ps.local_rank("pp")
        c = parts.llm_cfg
        tokens = cfg.data.max_seq_len // (ps.size("cp") * ps.size("ulysses"))
        master, compute = (
            torch.empty((), dtype=d, device="meta").element_size() for d in training_dtypes(train.dtype)
        )
        block = block_activation_bytes(
            tokens, c.dim, c.n_kv_heads * c.head_dim, c.ffn_dim, heads=c.n_heads, tp=ps.size("tp"),
            sequence_parallel=bool(getattr(par, "sequence_parallel", False)),
            bytes_per=compute, master_bytes=master, recompute="llm" in train.recompute,
            recompute_branches=tuple(train.recompute_modules),
            # the fused varlen kernel runs for float16 / bfloat16 on CUDA (omni_parallel.varlen); a float32
            # or float64 run uses the reference kernel wherever it runs
            kernel="flash" if compute == 2 else "reference",
        )  # fmt: skip
        # + the loss's float32 log-softmax over the vocabulary on the last stage (omni_pipeline.loss)
        last = schedule.num_stages - 1
        per_stage = {
            s: block * len(r) + (tokens * c.vocab_size * 4 if s == last else 0)
            for s, r in enumerate(parts.split)
        }
        act = _in_flight_bytes(schedule, pp_rank, per_stage)
    return {"rank": rank, "pp_rank": pp_rank, "llm": llm, "encoders": enc, "llm_activations_estimate": act}


def memory_plan(
    cfg: RunConfig, gpus: int, *, scale: str | None = None, vocab: int | None = None
) -> dict[str, Any]:
    """Per-rank bytes of ``cfg``'s layout on ``gpus`` ranks (``parallel.dp`` = what the other sizes leave).

    Args:
        cfg: the run config (its ``[parallel]`` layout, overrides applied).
        gpus: world size.
        scale: ``None`` (the config's model) or ``"paper"``.
        vocab: the LLM's vocabulary (default: the config's tokenizer's; paper: :data:`PAPER_VOCAB`).

    Returns:
        ``{"gpus", "layout", "ranks": [{"rank", "pp_rank", "same_pp_ranks", "llm": {kind: bytes},
        "encoders": {kind: bytes}, "llm_activations_estimate"}]}``, kinds as
        :data:`omni_parallel.memory.KINDS`; ``same_pp_ranks``: the pipeline ranks whose ranks at the same
        position hold these numbers (the activations of the first of them; later 1F1B stages hold fewer
        microbatches in flight).

    Raises:
        ConfigError: ``gpus`` < 1 or not a multiple of ``pp * tp * cp * ulysses``, an unknown ``scale``,
            or anything :func:`omni_train.preflight.validate` refuses (one line naming the field).
    """
    par = cfg.parallel
    if scale not in (None, "paper", "config"):
        raise ConfigError(f"--scale: paper or config, got {scale!r}")
    if scale == "paper":
        cfg = paper_config(cfg)
        vocab = PAPER_VOCAB if vocab is None else vocab
    model_ranks = par.pp * par.tp * par.cp * par.ulysses
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"--gpus: must be >= 1, got {gpus!r}")
    if gpus % model_ranks:
        raise ConfigError(
            f"--gpus: {gpus} is not a multiple of parallel.pp * tp * cp * ulysses = "
            f"{par.pp} * {par.tp} * {par.cp} * {par.ulysses} = {model_ranks}"
        )
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(par, dp=gpus // model_ranks))
    validate(cfg, gpus)
    if vocab is None:
        from omni_train.data_files import load_tokenizer

        vocab = load_tokenizer(cfg.data).get_vocab_size()
    # Pipeline ranks whose stages hold the same layer counts (and embedding / head) are built once.
    par = cfg.parallel
    split = stage_split(par, cfg.model.llm_config(vocab), cfg.data.max_seq_len)
    schedule = build_schedule(par.schedule, par.pp, cfg.data.microbatches, par.virtual_stages)
    alike: dict[tuple, list[int]] = {}
    for p in range(par.pp):
        stages = schedule.rank_stages(p)
        alike.setdefault(
            tuple((len(split[s]), s == 0, s == schedule.num_stages - 1) for s in stages), []
        ).append(p)
    per_stage = gpus // par.pp  # ranks order tp-cp-ep-dp-pp (pp slowest): a stage's ranks are contiguous
    plans = []
    for same in alike.values():
        for r in sorted({same[0] * per_stage, (same[0] + 1) * per_stage - 1}):
            plans.append(_rank_plan(cfg, gpus, r, vocab) | {"same_pp_ranks": same})
    layout = {k: getattr(cfg.parallel, k) for k in ("pp", "tp", "cp", "ulysses", "dp", "encoder_zero")}
    for k in ("llm_zero", "sequence_parallel"):
        if hasattr(cfg.parallel, k):
            layout[k] = getattr(cfg.parallel, k)
    return {"gpus": gpus, "layout": layout, "ranks": plans}


def _total(r: dict[str, Any]) -> int:
    return sum(r["llm"].values()) + sum(r["encoders"].values()) + r["llm_activations_estimate"]


def _word(v: Any) -> str:
    """A layout value as a user reads it: booleans as ``on`` / ``off``."""
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as a table per planned rank (GiB, or MiB when every rank is below 1 GiB): LLM and
    encoders by kind (a two-line header: the owner above the kind's whole name), the LLM activation
    estimate, the total; then the largest rank."""
    big = max(_total(r) for r in plan["ranks"]) >= 2**30
    unit, div = ("GiB", 2**30) if big else ("MiB", 2**20)
    w = 1 + max(len(k) for k in KINDS)  # every kind's name whole (no truncation)
    owners = ["", ""] + ["llm"] * len(KINDS) + ["encoders"] * len(KINDS) + ["llm", ""]
    head = ["rank", "pp ranks", *KINDS, *KINDS, "activations", "total"]
    lines = [
        f"omni-train memory: {plan['gpus']} ranks, "
        + ", ".join(f"{k} {_word(v)}" for k, v in plan["layout"].items())
        + f"; {unit} per rank held between steps; llm activations: the step's peak of saved LLM "
        "activations (estimate)",
        "".join(f"{h:>{max(w, len(x) + 1)}}" for h, x in zip(owners, head, strict=True)),
        "".join(f"{h:>{max(w, len(h) + 1)}}" for h in head),
    ]
    widths = [max(w, len(h) + 1) for h in head]
    for r in plan["ranks"]:
        same = r["same_pp_ranks"]
        where = f"{same[0]}-{same[-1]}" if len(same) > 1 else str(same[0])
        vals = (
            [r["llm"][k] for k in KINDS] + [r["encoders"][k] for k in KINDS] + [r["llm_activations_estimate"]]
        )
        cells = [str(r["rank"]), where] + [f"{v / div:.2f}" for v in [*vals, _total(r)]]
        lines.append("".join(f"{c:>{n}}" for c, n in zip(cells, widths, strict=True)))
    peak = max(plan["ranks"], key=_total)
    lines.append(f"largest: rank {peak['rank']}, {_total(peak) / 2**30:.2f} GiB")
    return "\n".join(lines)
