"""The preflight: every check of a run config that can run before any process starts.

:func:`validate` checks the sizes against each other and the process count, and what the config names on
the file system: each source's shards exist, the tokenizer loads, and the calibration runs
(``parallel.stage_calibration``, ``parallel.planner_calibration``) are readable runs of this model
(read by the same :mod:`omni_train.pipeline` functions the workers call, so a bad run directory is a
configuration error, not a traceback from every rank).
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

from omni_pipeline import PlacementPolicy, ScheduleKind
from omni_train.config import (
    OFFLOAD,
    RECOMPUTE,
    RECOMPUTE_MODULES,
    ConfigError,
    Packing,
    RunConfig,
    check_bounds,
)
from omni_train.data_files import data_root, expand_urls, load_tokenizer, tokenizer_candidates
from omni_train.data_pipeline import mixture_unit
from omni_train.pipeline import fitted_cost_model, stage_split

__all__ = ["check_resume_layout", "validate", "validate_sources"]


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


def validate(cfg: RunConfig, nproc: int, *, sources: bool = True) -> None:
    """Check everything that can be checked before processes start.

    ``sources=False`` leaves out what :func:`validate_sources` checks (the files the data and model name:
    shards and their media, the tokenizer, the image tokenizer), which no parallel size, schedule or
    memory option changes: a caller checking many layouts of one config (``omni-train tune``,
    :func:`omni_train.simulate.layout_check`) runs :func:`validate_sources` once and this per layout.

    Raises:
        ConfigError: naming the first field that is wrong: a number out of its range
        (:func:`omni_train.config.check_bounds`, checked first, so no rule below divides by a zero
        size or builds from a negative one), parallel sizes vs ``nproc``, head counts not
        divisible (GQA, TP, Ulysses), fewer layers than stages, a source whose ``urls`` name no shard
        (the message says where it looked), mixture weights naming unknown sources, phases out of
        order or mixing ``until_step`` with ``until_tokens``, non-positive sizes, a schedule that does
        not fit the layers or microbatches, unknown
        recompute/offload names, a tokenizer found in none of the places it is looked for
        (:func:`omni_train.data_files.tokenizer_candidates`), a ``parallel.stage_calibration`` or
        ``parallel.planner_calibration`` run that does not calibrate this model
        (:func:`omni_train.pipeline.stage_split`, :func:`omni_train.pipeline.fitted_cost_model`).
    """
    check_bounds(cfg)
    train = cfg.train
    # A stopped rank blocks the others in a collective; if that collective's timeout fires first, gloo's
    # timeout error ends the run and the watchdog never names the rank that hung.
    if 0 < train.collective_timeout_s <= train.hang_timeout_s:
        raise ConfigError(
            f"train.hang_timeout_s: {train.hang_timeout_s:g} s must be below train.collective_timeout_s "
            f"{train.collective_timeout_s:g} s (or 0: no hang watchdog), or a collective times out before "
            "the watchdog names the hung rank"
        )
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
        # USP (Ulysses inside CP attention) is not built: one sequence flavour per run, with TP beside it.
        raise ConfigError("parallel.cp: choose one LLM sequence-parallel flavour (cp or ulysses), not both")
    if llm.dim % llm.n_heads:
        raise ConfigError(f"model.llm.dim: {llm.dim} is not divisible by model.llm.n_heads {llm.n_heads}")
    if (llm.dim // llm.n_heads) % 2:
        raise ConfigError(f"model.llm.dim: head_dim {llm.dim // llm.n_heads} must be even for RoPE")
    if llm.n_heads % llm.n_kv_heads:
        raise ConfigError(
            f"model.llm.n_heads: {llm.n_heads} is not divisible by model.llm.n_kv_heads {llm.n_kv_heads} (GQA)"
        )
    if llm.mrope_section is not None:
        sec, half = llm.mrope_section, llm.dim // llm.n_heads // 2
        if len(sec) != 3 or min(sec) < 0 or sum(sec) != half:
            raise ConfigError(
                f"model.llm.mrope_section: {sec} must be 3 non-negative counts summing to head_dim / 2 = {half}"
            )
        # packs carry [3, T] positions (omni_pipeline.StepSpec.mrope), whole on every rank of a stage
        # (verified against one process at pp = 2 and tp = 2: tests/test_train_video.py)
        if par.cp > 1 or par.ulysses > 1 or par.hybrid_cp or par.sequence_parallel:
            raise ConfigError(
                f"model.llm.mrope_section: M-RoPE positions are not wired with parallel.cp {par.cp} / "
                f"ulysses {par.ulysses} / hybrid_cp {par.hybrid_cp} / sequence_parallel "
                f"{par.sequence_parallel}; use cp = ulysses = 1, hybrid_cp and sequence_parallel false"
            )
    # Column-parallel Q/K/V and SwiGLU gate/up shard whole heads and equal slices of ffn_dim per TP rank.
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(llm, name) % par.tp:
            raise ConfigError(
                f"model.llm.{name}: {getattr(llm, name)} is not divisible by parallel.tp {par.tp}"
            )
    _validate_cp(cfg)
    _validate_moe(cfg)
    # Ulysses pads heads that sp does not divide (omni_parallel.ulysses), so no head-count check here;
    # with TP it exchanges each TP rank's local heads (n_heads / tp), and the loader shares one pack
    # over the TP x Ulysses group (ParallelState group tp_cp).
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
    if sources and cfg.model.image_tokenizer is not None:
        _check_image_tokenizer(cfg)
    for i, src in enumerate(data.sources):
        if src.modality not in ("image", "audio", "text", "video", "generation"):
            raise ConfigError(
                f"data.sources[{i}].modality: {src.modality!r} is not image, audio, text, video or generation"
            )
        if src.modality == "generation":  # caption + boi + h*w codes + eoi must fit in a pack
            _check_generation_source(cfg, i, sources)
        if src.modality in ("image", "video") and cfg.model.vit is None:
            raise ConfigError(
                f"data.sources[{i}].modality: {src.modality} source {src.name!r} but no [model.vit]"
            )
        # Verified against one process (tests/test_train_video.py): pp, tp, the planned placement,
        # reordering across DP (frames moved), long-short SP over Ulysses and over CP (long videos
        # split). Hybrid DP/CP (per-pack CP blocks) of video is not.
        if src.modality == "video" and par.hybrid_cp:
            raise ConfigError(
                f"data.sources[{i}].modality: video source {src.name!r} with parallel.hybrid_cp: video is "
                "not verified under hybrid DP/CP; use hybrid_cp false (parallel.cp or ulysses carry long "
                "videos)"
            )
        if src.modality == "audio" and cfg.model.audio is None:
            raise ConfigError(f"data.sources[{i}].modality: audio source {src.name!r} but no [model.audio]")
        bounds = src.min_pixels is not None or src.max_pixels is not None
        if bounds and src.modality not in ("image", "video"):
            raise ConfigError(
                f"data.sources[{i}].min_pixels: resize bounds are for image and video sources only"
            )
        vit = cfg.model.vit
        if src.modality in ("image", "video") and vit is not None:
            lo = src.min_pixels if src.min_pixels is not None else vit.min_pixels
            hi = src.max_pixels if src.max_pixels is not None else vit.max_pixels
            if not 0 < lo <= hi:
                raise ConfigError(
                    f"data.sources[{i}].max_pixels: need 0 < min_pixels ({lo}) <= max_pixels ({hi})"
                )
        if sources:
            _check_source_files(cfg, i)
    if names.count(names[0]) != 1 or len(set(names)) != len(names):
        raise ConfigError(f"data.sources: source names must be unique, got {names}")
    if not data.mixture:
        raise ConfigError("data.mixture: at least one phase is needed")
    unit = mixture_unit(data)  # raises on phases mixing until_step and until_tokens
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
        field = "until_tokens" if unit == "token" else "until_step"
        end = ph.until_tokens if unit == "token" else ph.until_step
        if i < len(data.mixture) - 1:
            if end is None or isinstance(end, bool) or not isinstance(end, int) or end <= last:
                raise ConfigError(
                    f"data.mixture[{i}].{field}: phases need increasing integer {field} values, got {end!r}"
                )
            last = end
        elif end is not None:
            raise ConfigError(f"data.mixture[{i}].{field}: the last phase runs to the end; leave it out")
    if sources:
        _check_tokenizer(cfg)
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
    if isinstance(par.llm_zero, bool) or par.llm_zero not in (0, 1, 2, 3):
        raise ConfigError(
            f"parallel.llm_zero: {par.llm_zero!r} is not one of 0 (replicated), 1 (optimizer state "
            "sharded), 2 (gradients too) or 3 (parameters too)"
        )
    from omni_parallel.llm_zero import RESHARD_POLICIES

    if par.llm_reshard_after_forward not in RESHARD_POLICIES:
        raise ConfigError(
            f"parallel.llm_reshard_after_forward: {par.llm_reshard_after_forward!r} is not one of "
            f"{', '.join(RESHARD_POLICIES)}"
        )
    # llm_zero with tp > 1 composes (FSDP2 over a 2-D (dp x cp x ulysses, tp) mesh, omni_parallel.llm_zero);
    # not with ep > 1, which needs model.llm.moe, itself refused with tp > 1 (below)
    if not isinstance(par.sequence_parallel, bool):
        raise ConfigError(f"parallel.sequence_parallel: must be true or false, got {par.sequence_parallel!r}")
    if par.sequence_parallel and par.tp == 1:
        raise ConfigError(
            "parallel.sequence_parallel: needs parallel.tp > 1 (it shards the tokens over the TP group), "
            "got tp = 1"
        )
    # With plain CP or Ulysses at pp = 1 (no stage boundary) SP shards each rank's tokens over TP inside
    # the stage (tests/test_train_4d.py); a CP rank holds two head-tail chunks of every document padded to
    # 2 * cp tokens, so its token count is a multiple of 2 and only tp = 2 shards it evenly.
    if par.sequence_parallel and (par.hybrid_cp or ((par.cp > 1 or par.ulysses > 1) and par.pp > 1)):
        raise ConfigError(
            f"parallel.sequence_parallel: not combined with parallel.cp {par.cp} / hybrid_cp {par.hybrid_cp} "
            f"/ ulysses {par.ulysses} at parallel.pp {par.pp} yet (their step inputs do not shard the "
            "stage-boundary tokens over TP; with pp = 1, plain cp and ulysses are supported)"
        )
    if par.sequence_parallel and par.cp > 1 and par.tp != 2:
        raise ConfigError(
            f"parallel.sequence_parallel: with parallel.cp {par.cp} needs parallel.tp = 2 (got {par.tp}): a "
            "CP rank's tokens are a multiple of 2, not of tp, and SP shards them evenly over TP"
        )
    # async TP (omni_parallel.async_tp): SP's all-gathers / reduce-scatters as P2P rings over the TP group
    if not isinstance(par.async_tp, bool):
        raise ConfigError(f"parallel.async_tp: must be true or false, got {par.async_tp!r}")
    if par.async_tp and not par.sequence_parallel:
        raise ConfigError(
            "parallel.async_tp: needs parallel.sequence_parallel = true (and so parallel.tp > 1): it overlaps "
            "sequence parallelism's all-gathers and reduce-scatters with the projections"
        )
    if par.async_tp and (par.cp > 1 or par.ulysses > 1):
        raise ConfigError(
            f"parallel.async_tp: not combined with parallel.cp {par.cp} / ulysses {par.ulysses} yet "
            "(untested there); use cp = ulysses = 1"
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
    if par.placement == PlacementPolicy.PLANNED and par.planner_calibration is not None:
        # read here, before any worker starts, so a wrong run directory is a configuration error and not
        # a traceback from every rank
        fitted_cost_model(cfg)
    g = cfg.data.reorder_group_size
    if g is not None and (g < 1 or par.dp % g):
        raise ConfigError(f"data.reorder_group_size: {g} must be >= 1 and divide parallel.dp {par.dp}")
    r = cfg.data.replicas
    if r < 0 or r % par.dp:
        raise ConfigError(f"data.replicas: {r} must be 0 or a multiple of parallel.dp {par.dp}")
    if r and par.hybrid_cp:
        raise ConfigError(
            f"data.replicas: {r} with parallel.hybrid_cp: a stage's ranks share one stream of dp x cp times "
            "larger packs, not per-replica loaders; leave data.replicas = 0"
        )
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep_last < 1:
        raise ConfigError("checkpoint.every: must be >= 0 and checkpoint.keep_last >= 1")
    if cfg.checkpoint.url:
        _check_checkpoint_url(cfg.checkpoint.url)
    if cfg.train.profile_steps < 0:
        raise ConfigError(f"train.profile_steps: must be >= 0, got {cfg.train.profile_steps}")
    _validate_schedule_and_memory(cfg)


def validate_sources(cfg: RunConfig) -> None:
    """The checks of the files ``cfg`` names that no parallel layout changes, in :func:`validate`'s order:
    ``[model.image_tokenizer]`` loads, each source's shards exist and an image or generation source's
    first shard holds images, a generation sample fits ``data.max_seq_len``, the tokenizer is found and
    (with ``model.llm.vocab_size`` set) the LLM config builds with its vocabulary. :func:`validate` runs
    them too unless called with ``sources=False``.

    Raises:
        ConfigError: naming the field (``model.image_tokenizer.path``, ``data.sources[i].urls``,
            ``data.max_seq_len``, ``data.tokenizer``) and where it looked.
    """
    if cfg.model.image_tokenizer is not None:
        _check_image_tokenizer(cfg)
    for i, src in enumerate(cfg.data.sources):
        if src.modality == "generation" and cfg.model.image_tokenizer is not None:
            _check_generation_source(cfg, i, True)
        _check_source_files(cfg, i)
    _check_tokenizer(cfg)


def _check_source_files(cfg: RunConfig, i: int) -> None:
    """``data.sources[i].urls`` names shards that exist, and an image or generation source's first local
    shard holds images (:func:`_wrong_media`).

    Raises:
        ConfigError: ``data.sources[i].urls: ...`` saying where it looked.
    """
    src = cfg.data.sources[i]
    missing = _missing_shards(src.urls, data_root(cfg))
    if missing:
        raise ConfigError(f"data.sources[{i}].urls: {missing} (source {src.name!r})")
    wrong = _wrong_media(src.modality, src.urls, data_root(cfg))
    if wrong:
        raise ConfigError(f"data.sources[{i}].urls: {wrong} (source {src.name!r})")


def _check_tokenizer(cfg: RunConfig) -> None:
    """``data.tokenizer`` is found, and with ``model.llm.vocab_size`` set the LLM config builds with the
    tokenizer's vocabulary (``V``, or ``V + 2 + K`` with ``[model.image_tokenizer]``).

    Raises:
        ConfigError: ``data.tokenizer: ... not found`` with where it looked, or the LLM config's error.
    """
    looked = tokenizer_candidates(cfg)
    if not any(p.is_file() for p in looked):
        raise ConfigError(
            f"data.tokenizer: {cfg.data.tokenizer!r} not found; looked in {', '.join(str(p) for p in looked)}"
        )
    if cfg.model.llm.vocab_size is not None:
        from omni_train.data_pipeline import llm_vocab_size

        cfg.model.llm_config(llm_vocab_size(cfg, load_tokenizer(cfg.data).get_vocab_size()))


def _check_checkpoint_url(url: str) -> None:
    """``checkpoint.url`` names a filesystem fsspec has and whose package is installed (``s3://`` needs
    s3fs), so a typo or a missing backend is one line before any worker starts, not every rank's traceback.

    Raises:
        ConfigError: naming the field, the URL and what fsspec said.
    """
    import fsspec

    try:
        fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"checkpoint.url: {url!r}: {exc}") from None


def _check_image_tokenizer(cfg: RunConfig) -> None:
    """``[model.image_tokenizer] path`` names a weights file that loads (size, sha256, config and tensors
    checked against its sidecar: ``ImageTokenizer.load``).

    Raises:
        ConfigError: ``model.image_tokenizer.path: ...`` naming where it looked and what is wrong.
    """
    from omni_train.data_pipeline import image_tokenizer_candidates, load_image_tokenizer

    found = [p for p in image_tokenizer_candidates(cfg) if p.is_file()]
    if not found:
        where = ", ".join(str(p) for p in image_tokenizer_candidates(cfg))
        raise ConfigError(
            f"model.image_tokenizer.path: {cfg.model.image_tokenizer.path!r} found nowhere (looked at {where})"
        )
    try:
        load_image_tokenizer(cfg)
    except ValueError as exc:  # ImageTokenizerFileError names the file and the fault
        raise ConfigError(f"model.image_tokenizer.path: {exc}") from None


def _wrong_media(modality: str, pattern: str, root: Path, members: int = 64) -> str | None:
    """Why an image or generation source's first local shard holds no image but another medium (e.g.
    ``urls`` naming video shards), from its first ``members`` tar members; None otherwise (and for
    remote or compressed shards, which the loader's skip counts cover)."""
    if modality not in ("image", "generation"):
        return None
    from omni_data.source import AUDIO_EXTS, IMAGE_EXTS, VIDEO_EXTS
    from omni_data.tar_index import TarMember, iter_members

    urls = [u.removeprefix("file://") for u in expand_urls(pattern, root)]
    if not urls or "://" in urls[0] or not urls[0].endswith(".tar") or not os.path.isfile(urls[0]):
        return None
    exts = set()
    with open(urls[0], "rb") as f:
        for m in itertools.islice(iter_members(f, 0, os.path.getsize(urls[0])), members):
            if isinstance(m, TarMember):
                exts.add(m.name.rsplit("/", 1)[-1].split(".", 1)[-1].lower())
    if exts & set(IMAGE_EXTS):
        return None
    other = sorted(exts & set(VIDEO_EXTS + AUDIO_EXTS))
    if not other:
        return None
    return (
        f"{urls[0]} holds .{', .'.join(other)} members and no image (.{', .'.join(IMAGE_EXTS)}); a "
        f"{modality} source reads image shards"
    )


def _check_generation_source(cfg: RunConfig, i: int, files: bool = True) -> None:
    """A generation source needs ``[model.image_tokenizer]`` and (``files``: read from the tokenizer's
    weights, its code grid) packs that hold an image's codes.

    Raises:
        ConfigError: naming ``data.sources[i].modality`` or ``data.max_seq_len``.
    """
    src = cfg.data.sources[i]
    if cfg.model.image_tokenizer is None:
        raise ConfigError(
            f"data.sources[{i}].modality: generation source {src.name!r} but no [model.image_tokenizer] "
            "(its images become code tokens of a frozen image tokenizer)"
        )
    if not files:
        return
    from omni_train.data_pipeline import load_image_tokenizer

    h, w = load_image_tokenizer(cfg).grid
    if h * w + 2 >= cfg.data.max_seq_len:
        raise ConfigError(
            f"data.max_seq_len: {cfg.data.max_seq_len} tokens cannot hold a generation sample of source "
            f"{src.name!r} (a caption, boi, {h}x{w} = {h * w} image codes and eoi)"
        )


def _validate_cp(cfg: RunConfig) -> None:
    """CP and hybrid DP/CP: what the trainer's CP path (``omni_pipeline.cp_delivery``) supports."""
    par = cfg.parallel
    if par.hybrid_cp and cfg.train.compile:
        # Plain CP compiles (tests/test_train_4d.py, tp=2 x cp=2 ring); hybrid DP/CP's CP blocks, and with them
        # the attention's process groups, change per pack, and compiling over them is not verified.
        raise ConfigError("train.compile: not supported with parallel.hybrid_cp yet (plain parallel.cp is)")
    g = cfg.data.reorder_group_size
    if (par.cp > 1 or par.hybrid_cp) and g is not None and g > 1 and par.reorder:
        raise ConfigError(
            f"data.reorder_group_size: {g} with context parallelism (parallel.cp {par.cp}, hybrid_cp "
            f"{par.hybrid_cp}): the CP ranks already balance each encoder microbatch; reordering across DP "
            "is not combined with CP, set it to 1"
        )
    if par.hybrid_cp and par.dp * par.cp < 2:
        raise ConfigError(
            f"parallel.hybrid_cp: needs dp * cp >= 2 ranks per stage to share (got dp {par.dp} x cp {par.cp})"
        )
    if par.hybrid_cp and par.ulysses > 1:
        # Its CP blocks would be blocks of Ulysses groups: attention needs Ulysses inside CP (USP), which
        # the LLM does not run (parallel.cp with parallel.ulysses is refused above for the same reason).
        raise ConfigError(
            f"parallel.hybrid_cp: not with parallel.ulysses {par.ulysses}: a CP block of Ulysses groups "
            "needs Ulysses attention inside CP attention (USP), which the LLM does not run; use "
            "parallel.tp for the heads instead"
        )
    for i, src in enumerate(cfg.data.sources):
        if src.join_tokens < 0 or (src.join_tokens and src.modality != "text"):
            raise ConfigError(
                f"data.sources[{i}].join_tokens: joins text documents only, must be >= 0 "
                f"(got {src.join_tokens} on a {src.modality} source)"
            )


def _validate_moe(cfg: RunConfig) -> None:
    """``[model.llm] moe`` and ``parallel.ep``."""
    par, moe = cfg.parallel, cfg.model.llm.moe
    if par.ep > 1 and moe is None:
        raise ConfigError(
            f"parallel.ep: {par.ep} needs model.llm.moe (expert parallelism shards MoE experts)"
        )
    # moe.bias_update_rate with cp / ulysses / hybrid_cp: the loads exclude the padding rows and sum over
    # the ranks sharing a pack (omni_parallel.moe.PackShard), as one process (tests/test_train_moe_cp.py)
    ep_seq = par.ep // math.gcd(par.ep, par.dp)  # EP ranks across the sequence-parallel ranks
    if (par.cp * par.ulysses) % ep_seq:
        raise ConfigError(
            f"parallel.ep: {par.ep} must divide parallel.dp {par.dp}, or ep / gcd(ep, dp) = {ep_seq} must "
            f"divide parallel.cp {par.cp} x parallel.ulysses {par.ulysses} (EP is carved out of the DP x CP "
            "ranks of a stage)"
        )
    if ep_seq > 1 and par.ulysses > 1:
        raise ConfigError(
            f"parallel.ep: {par.ep} beyond parallel.dp {par.dp} spans sequence-parallel ranks, which is "
            f"supported over parallel.cp ranks only (not with parallel.ulysses {par.ulysses}); use an ep "
            "dividing parallel.dp"
        )
    if moe is None:
        return
    if moe.top_k > moe.experts:
        raise ConfigError(f"model.llm.moe.top_k: {moe.top_k} exceeds model.llm.moe.experts {moe.experts}")
    n_layers = cfg.model.llm.n_layers
    if moe.every_n_layers > n_layers:
        raise ConfigError(
            f"model.llm.moe.every_n_layers: {moe.every_n_layers} > model.llm.n_layers {n_layers}: no MoE layer"
        )
    if moe.experts % par.ep:
        raise ConfigError(f"model.llm.moe.experts: {moe.experts} is not divisible by parallel.ep {par.ep}")
    edp = par.dp * par.cp * par.ulysses // par.ep  # holders of each EP shard: sharded over at llm_zero 1-3
    if par.ep > 1 and par.llm_zero and edp > 1:  # each expert tensor along a dim edp divides (llm_zero)
        local, dim = moe.experts // par.ep, cfg.model.llm.dim
        hidden = moe.expert_ffn_dim if moe.expert_ffn_dim is not None else cfg.model.llm.ffn_dim
        for name, shape in (("gate_up_proj", (local, 2 * hidden, dim)), ("down_proj", (local, dim, hidden))):
            if all(n % edp for n in shape):
                raise ConfigError(
                    f"parallel.llm_zero: {par.llm_zero} shards each expert shard over its {edp} "
                    f"expert-data-parallel ranks (dp x cp x ulysses / ep), which divide no dim of the "
                    f"experts' {name} {shape} (model.llm.moe.experts / parallel.ep, model.llm.moe."
                    "expert_ffn_dim, model.llm.dim)"
                )
    if par.tp > 1:  # parallel.ep with parallel.llm_zero 1-3 composes: experts outside FSDP2 (llm_zero)
        raise ConfigError(
            f"model.llm.moe: with parallel.tp {par.tp} is not supported (no tensor-parallel plan for experts)"
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
    if v > 1 and par.schedule == ScheduleKind.ONE_F_ONE_B:
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
    if par.schedule == ScheduleKind.INTERLEAVED and m % rounds:
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
        from omni_train.data_pipeline import llm_vocab_size

        vocab = llm_vocab_size(cfg, load_tokenizer(cfg.data).get_vocab_size())  # found: checked above
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


def check_resume_layout(saved: RunConfig, cfg: RunConfig) -> None:
    """Resume checks of the parallel layout, before any worker starts: ``cfg`` resumes a committed step
    (after step 0) of a run saved with ``saved`` (its ``config.json``). Any parallel size may change
    (``omni_train.checkpointing``: the model and AdamW state through box intersection; the loader
    replayed at the same DP size, re-split under another, handed over whole by data replica with
    ``data.replicas``); refused are the combinations whose loader state cannot be carried over, which the
    workers would otherwise meet as a
    :class:`~omni_data.LayoutMismatchError` after they start.

    Raises:
        ConfigError: one line naming the fields and both values: another ``parallel.dp`` with
            ``data.packing = "per_modality"`` (the per-source packers' packs in flight cannot be dealt
            over other DP ranks) or with a text source's ``join_tokens`` (``omni_data.JoinDocuments``
            holds parts of documents it cannot re-split); another ``parallel.dp`` or ``parallel.cp``
            with ``parallel.hybrid_cp`` (a stage's ranks share one stream of ``dp x cp`` times larger
            packs: another product makes other packs, and the saved stream is not split by DP rank).
    """
    old, new = saved.parallel, cfg.parallel
    if new.hybrid_cp:
        for field in ("dp", "cp"):
            a, b = getattr(old, field), getattr(new, field)
            if a != b:
                raise ConfigError(
                    f"parallel.{field}: {a} -> {b} with parallel.hybrid_cp = true cannot resume: the ranks "
                    f"of a stage share one loader of packs of dp x cp = {old.dp * old.cp} x "
                    f"data.max_seq_len tokens; resume with parallel.{field} = {a}"
                )
    if old.dp == new.dp or (cfg.data.replicas and saved.data.replicas == cfg.data.replicas):
        return  # the same data replicas at any DP size: handed over whole (omni_train.checkpointing)
    if cfg.data.packing is not Packing.HYBRID:
        raise ConfigError(
            f"parallel.dp: {old.dp} -> {new.dp} with data.packing = {cfg.data.packing.value!r} cannot "
            f"resume: the per-source packers' packs in flight cannot be re-split over other DP ranks; "
            f"resume with parallel.dp = {old.dp}"
        )
    for i, src in enumerate(cfg.data.sources):
        if src.join_tokens:
            raise ConfigError(
                f"parallel.dp: {old.dp} -> {new.dp} with data.sources[{i}].join_tokens = {src.join_tokens} "
                f"({src.name!r}) cannot resume: the documents it joins cannot be re-split over other DP "
                f"ranks; resume with parallel.dp = {old.dp}"
            )
