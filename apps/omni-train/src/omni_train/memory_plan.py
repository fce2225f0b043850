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

Encoder ZeRO 2/3 shards every tower over the whole world; FSDP2 cuts each parameter into one chunk per
rank when it shards, which at thousands of ranks dominates a build (ViT-1B over 4,096 fake ranks: 46 of
the 53 s of a 4-rank plan on an idle 2-core CPU). The towers are therefore built whole and each planned
rank's shards computed from their shapes by FSDP2's own rule
(:func:`omni_parallel.memory.planned_fsdp_bytes`: ``torch.chunk``'s rows, every shard padded to the
first's); ``shard_encoders=True`` builds them sharded instead, and the two agree byte for byte
(apps/omni-train/tests/test_train_memory_shapes.py).

``scale="paper"``: LLaMA-12B + ViT-1B + USM-2B (``omni_pipeline.step_costs.MODEL_SHAPES``; the app's
encoders take whole-number MLP ratios: ViT ``round(6144 / 1408) = 4``, audio ``round(9.5) = 10``) at the
``paper-omni`` workload's pack length and microbatches, LLaMA-2's 32000-token vocabulary, bfloat16
(float32 master parameters, bf16 activations).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from omni_parallel.llm_zero import reshard_after_forward
from omni_parallel.memory import KINDS, block_activation_bytes, planned_fsdp_bytes, planned_state_bytes
from omni_parallel.parallelize import training_dtypes
from omni_parallel.testing import fake_world
from omni_pipeline import ActionKind, build_schedule
from omni_pipeline.step_costs import MODEL_SHAPES
from omni_train import wiring
from omni_train.config import ConfigError, RunConfig
from omni_train.data_pipeline import step_config
from omni_train.pipeline import stage_split
from omni_train.preflight import validate

__all__ = ["PAPER_VOCAB", "format_plan", "in_step_bytes", "memory_plan", "paper_config", "step_peak"]

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
        # a tower the config lacks (vlm-tiny: no audio) stays absent
        vit=m.vit and dataclasses.replace(m.vit, dim=vit.dim, n_layers=vit.n_layers, n_heads=vit.n_heads,
                                          mlp_ratio=round(vit.ffn_dim / vit.dim)),
        audio=m.audio and dataclasses.replace(m.audio, dim=audio.dim, n_layers=audio.n_layers,
                                              n_heads=audio.n_heads, mlp_ratio=round(audio.ffn_dim / audio.dim)),
    )  # fmt: skip
    data = dataclasses.replace(cfg.data, max_seq_len=work.max_seq_len, microbatches=work.microbatches)
    train = dataclasses.replace(cfg.train, dtype="bfloat16")  # float32 masters, bf16 compute
    return dataclasses.replace(cfg, model=model, data=data, train=train)


def in_step_bytes(modules: Any, *, zero: int, reshard_after_forward: bool = False) -> dict[str, int]:
    """Bytes a rank holds only inside a step, on top of the between-step state of
    :func:`omni_parallel.memory.planned_state_bytes`, for the FSDP2 units inside ``modules`` (LLM ZeRO of
    :mod:`omni_parallel.llm_zero`, encoder ZeRO of :mod:`omni_parallel.encoder_zero`: both step-scoped).

    * ``gradients``: ZeRO-2/3 (``zero >= 2``): every microbatch's backward accumulates into the UNSHARDED
      gradient (the shard's dtype: float32 under a bf16 ``MixedPrecisionPolicy``) until the step's one
      reduce-scatter, so the rank holds its stage's whole gradients (each parameter's unsharded numel x
      the shard's element size) and, at the sync, the new shards beside them. ZeRO-0/1 hold whole
      gradients between steps already (counted there): 0.
    * ``gathered``: ZeRO-3 only (ZeRO-1/2 keep the gathered copy between steps, counted there): the
      gathered parameters in ``MixedPrecisionPolicy.param_dtype`` (bf16 under ``train.dtype =
      "bfloat16"``; else the shard's dtype). ``reshard_after_forward`` False: every unit, from the step's
      all-gather to the sync. True: the root units (gathered at attach, kept) plus the two largest other
      units (the block running and the next one FSDP2 prefetches; an assumption, not measured).

    Routed experts and other parameters outside FSDP2 hold their gradients between steps: not counted.

    Args:
        modules: the stage modules (or encoder towers) of one rank's build.
        zero: the ZeRO stage (``parallel.llm_zero`` / ``encoder_zero``).
        reshard_after_forward: :func:`omni_parallel.llm_zero.reshard_after_forward` of the run.

    Returns:
        ``{"gradients": bytes, "gathered": bytes}``.
    """
    from omni_parallel.encoder_zero import sharded_units

    modules = list(modules)

    def size(dtype: torch.dtype) -> int:
        return torch.empty((), dtype=dtype, device="meta").element_size()

    grads = 0
    units = []
    for u in sharded_units(modules):
        fps = [fp for g in u._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params]
        # the unsharded (gathered) numel: the whole parameter, under TP its TP-local tensor
        g = sum(math.prod(fp._orig_size) * size(fp.sharded_param.dtype) for fp in fps)
        p = sum(  # the all-gather output: padded shard x shard ranks (FSDPParam.init_all_gather_outputs)
            fp.padded_sharded_param_size.numel()
            * fp.mesh_info.shard_mesh_size
            * size(fp.mp_policy.param_dtype or fp.sharded_param.dtype)
            for fp in fps
        )
        grads += g
        units.append((u, p))
    out = {"gradients": grads if zero >= 2 else 0, "gathered": 0}
    if zero == 3 and units:
        if not reshard_after_forward:
            out["gathered"] = sum(p for _, p in units)
        else:
            roots = [p for u, p in units if any(u is m for m in modules)]
            rest = sorted((p for u, p in units if not any(u is m for m in modules)), reverse=True)
            out["gathered"] = sum(roots) + sum(rest[:2])
    return out


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


def _encoders_from_shapes(cfg: RunConfig, shard_encoders: bool) -> bool:
    """Whether :func:`_rank_plan` computes the encoders' ZeRO-2/3 shards from their shapes
    (:func:`omni_parallel.memory.planned_fsdp_bytes`) instead of building them sharded over the world."""
    # the one difference of the two builds: the optimizer over FSDP2's DTensors runs unfused
    # (omni_train.optim), whose AdamW step tensor is 8 bytes under a float64 default dtype, not 4
    return (
        cfg.parallel.encoder_zero in (2, 3)
        and not shard_encoders
        and torch.get_default_dtype() != torch.float64
    )


def _rank_plan(
    cfg: RunConfig, gpus: int, rank: int, vocab: int, *, shard_encoders: bool = False
) -> dict[str, Any]:
    par, train = cfg.parallel, cfg.train
    shapes = _encoders_from_shapes(cfg, shard_encoders)
    # encoder ZeRO 2/3 shards every tower over the whole world (omni_parallel.parallelize's
    # apply_encoder_zero): FSDP2 cuts each parameter into `gpus` chunks at build, ~12 s a rank at 4,096
    # ranks for ViT-1B; the towers are built whole instead and their shards computed from the shapes,
    # byte for byte the same (tested)
    build = dataclasses.replace(cfg, parallel=dataclasses.replace(par, encoder_zero=0)) if shapes else cfg
    with fake_world(gpus, rank=rank):
        ps = wiring.parallel_state(build, checkpoint_group=False)
        schedule = build_schedule(par.schedule, par.pp, cfg.data.microbatches, par.virtual_stages)
        parts = wiring.build_model(build, ps, schedule, vocab, torch.device("meta"))
        whole = getattr(par, "llm_zero", 0) == 1 and ps.size("dp_cp") > 1  # ZeRO-1: gradients whole
        # the stage modules, not the RankStages holding their submodules: each stage module is an FSDP2
        # root unit (embedding, final norm, LM head) that RankStages does not register
        llm = planned_state_bytes(parts.stage.chunks.values(), parts.optimizer, whole_gradients=whole)
        towers = list(parts.encoders.towers.values())
        if shapes:  # EncoderState.shard: one mesh over every rank, no mixed-precision gather
            enc, unsharded = planned_fsdp_bytes(
                towers, parts.optimizer, world=gpus, rank=rank, keep_gathered=par.encoder_zero == 2
            )
            enc_in_step = {"gradients": unsharded["gradients"], "gathered": 0}
            if par.encoder_zero == 3:  # in_step_bytes, reshard_after_forward False: every unit gathered
                enc_in_step["gathered"] = unsharded["gathered"]
        else:
            enc = planned_state_bytes(towers, parts.optimizer)
            enc_in_step = in_step_bytes(towers, zero=par.encoder_zero)
        lazy = reshard_after_forward(
            getattr(par, "llm_reshard_after_forward", "never"), pp=par.pp, microbatches=cfg.data.microbatches
        )
        in_step = {
            "llm": in_step_bytes(
                list(parts.stage.chunks.values()),
                zero=getattr(par, "llm_zero", 0),
                reshard_after_forward=lazy,
            ),
            "encoders": enc_in_step,
        }
        pp_rank = ps.local_rank("pp")
        c = parts.llm_cfg
        tokens = cfg.data.max_seq_len // (ps.size("cp") * ps.size("ulysses"))
        master, compute = (
            torch.empty((), dtype=d, device="meta").element_size() for d in training_dtypes(train.dtype)
        )
        block = block_activation_bytes(
            tokens, c.dim, c.n_kv_heads * c.head_dim, c.ffn_dim, heads=c.n_heads, tp=ps.size("tp"),
            sequence_parallel=bool(getattr(par, "sequence_parallel", False)),
            async_tp=bool(getattr(par, "async_tp", False)),
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
    return {
        "rank": rank,
        "pp_rank": pp_rank,
        "llm": llm,
        "encoders": enc,
        "in_step": in_step,
        "llm_activations_estimate": act,
    }


def memory_plan(
    cfg: RunConfig,
    gpus: int,
    *,
    scale: str | None = None,
    vocab: int | None = None,
    shard_encoders: bool = False,
) -> dict[str, Any]:
    """Per-rank bytes of ``cfg``'s layout on ``gpus`` ranks (``parallel.dp`` = what the other sizes leave).

    Args:
        cfg: the run config (its ``[parallel]`` layout, overrides applied).
        gpus: world size.
        scale: ``None`` (the config's model) or ``"paper"``.
        vocab: the LLM's vocabulary (default: the config's tokenizer's; paper: :data:`PAPER_VOCAB`).
        shard_encoders: under encoder ZeRO 2/3, build the towers FSDP2-sharded over the ``gpus`` fake
            ranks (about 12 s per planned rank at 4,096 ranks for ViT-1B) instead of building them whole and
            computing each rank's shards from their shapes
            (:func:`omni_parallel.memory.planned_fsdp_bytes`, milliseconds); both give the same bytes
            (apps/omni-train/tests/test_train_memory_shapes.py). Under a float64 default dtype the towers
            are always built sharded.

    Returns:
        ``{"gpus", "layout", "ranks": [{"rank", "pp_rank", "same_pp_ranks", "llm": {kind: bytes},
        "encoders": {kind: bytes}, "in_step": {"llm" | "encoders": {"gradients", "gathered"}},
        "llm_activations_estimate", "step_peak"}]}``, ``in_step`` from :func:`in_step_bytes`,
        ``step_peak`` from :func:`step_peak`, kinds as
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
    # data.replicas: the step's microbatches, as the trainer runs them
    cfg = step_config(cfg, cfg.parallel.dp)
    if vocab is None:
        from omni_train.data_files import load_tokenizer
        from omni_train.data_pipeline import llm_vocab_size

        vocab = llm_vocab_size(cfg, load_tokenizer(cfg.data).get_vocab_size())  # + boi, eoi, image codes
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
            row = _rank_plan(cfg, gpus, r, vocab, shard_encoders=shard_encoders) | {"same_pp_ranks": same}
            plans.append(row | {"step_peak": step_peak(row)})
    layout = {k: getattr(cfg.parallel, k) for k in ("pp", "tp", "cp", "ulysses", "dp", "encoder_zero")}
    for k in ("llm_zero", "sequence_parallel", "async_tp"):
        if hasattr(cfg.parallel, k):
            layout[k] = getattr(cfg.parallel, k)
    return {"gpus": gpus, "layout": layout, "ranks": plans}


def _total(r: dict[str, Any]) -> int:
    """Between-step state plus the LLM activation estimate (the table's ``total``)."""
    return sum(r["llm"].values()) + sum(r["encoders"].values()) + r["llm_activations_estimate"]


def _in_step(r: dict[str, Any], kind: str) -> int:
    """In-step bytes of ``kind`` (``gradients`` / ``gathered``), LLM plus encoders (:func:`in_step_bytes`)."""
    return sum(r.get("in_step", {}).get(part, {}).get(kind, 0) for part in ("llm", "encoders"))


def step_peak(r: dict[str, Any]) -> int:
    """A planned rank's peak inside a step: between-step state + LLM activations + the in-step
    gradients and gathered parameters of :func:`in_step_bytes` (all held at the step's gradient sync,
    after the last backward: the shards being written beside the whole gradients; the activations'
    peak comes earlier, so this is an upper bound by at most the smaller of the two)."""
    return _total(r) + _in_step(r, "gradients") + _in_step(r, "gathered")


def _word(v: Any) -> str:
    """A layout value as a user reads it: booleans as ``on`` / ``off``."""
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


DEVICE_GB = (80.0, 141.0)  # H100 / H200 HBM, GB (1e9 bytes): the verdict when no device is named


def format_plan(plan: dict[str, Any], device_gb: float | None = None) -> str:
    """The plan as a table per planned rank (GiB, or MiB when every rank is below 1 GiB): LLM and
    encoders by kind (a two-line header: the owner above the kind's whole name), the LLM activation
    estimate, the between-step ``total``, the in-step gradients and gathered parameters
    (:func:`in_step_bytes`, LLM + encoders) and the step's ``peak`` (:func:`step_peak`); then the largest
    rank and a fits / OOM verdict of its peak against ``device_gb`` GB (1e9 bytes), or against 80 and
    141 GB (H100, H200) when ``None``."""
    big = max(step_peak(r) for r in plan["ranks"]) >= 2**30
    unit, div = ("GiB", 2**30) if big else ("MiB", 2**20)
    w = 1 + max(len(k) for k in KINDS)  # every kind's name whole (no truncation)
    owners = (
        ["", ""]
        + ["llm"] * len(KINDS)
        + ["encoders"] * len(KINDS)
        + ["llm", "", "in-step", "in-step", "step"]
    )
    head = ["rank", "pp ranks", *KINDS, *KINDS, "activations", "total", "gradients", "gathered", "peak"]
    lines = [
        f"omni-train memory: {plan['gpus']} ranks, "
        + ", ".join(f"{k} {_word(v)}" for k, v in plan["layout"].items())
        + f"; {unit} per rank; kinds held between steps; llm activations: the step's peak of saved LLM "
        "activations (estimate); total: between steps + activations; in-step: ZeRO-2/3's whole gradients "
        "and ZeRO-3's gathered parameters, held only inside a step; peak: total + in-step",
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
        vals += [_total(r), _in_step(r, "gradients"), _in_step(r, "gathered"), step_peak(r)]
        cells = [str(r["rank"]), where] + [f"{v / div:.2f}" for v in vals]
        lines.append("".join(f"{c:>{n}}" for c, n in zip(cells, widths, strict=True)))
    peak = max(plan["ranks"], key=step_peak)
    top = step_peak(peak)
    verdicts = [
        f"{'fits' if top <= gb * 1e9 else 'OOM'} in {gb:g} GB"
        for gb in ((device_gb,) if device_gb else DEVICE_GB)
    ]
    lines.append(
        f"largest: rank {peak['rank']}, step peak {top / 2**30:.2f} GiB ({top / 1e9:.1f} GB): "
        + ", ".join(verdicts)
        + " (temporaries, the allocator's fragmentation and the CUDA context not counted)"
    )
    return "\n".join(lines)
