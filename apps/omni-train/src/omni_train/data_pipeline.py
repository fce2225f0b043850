"""The run's data pipeline, built from omni-data's parts (DESIGN.md §omni-data; paper §5).

``WebDatasetSource`` per source -> ``MixtureStream`` (phases of the config's mixture, by step or by global
tokens) ->
``HybridPacker`` -> ``PackedLoader`` (``microbatches`` packs per step) -> ``ZeroRedundancyFilter`` (this
pipeline rank decodes only the payloads of the encoder microbatches the data flow places on it).

With ``data.replicas`` the packs come from data replicas independent of the DP size: this DP rank's
``replicas / dp`` replica loaders (each built as replica ``r`` of ``replicas``) merged in replica order by
omni-data's ``ReplicaMerge``, ``(replicas / dp) * microbatches`` packs per step (:func:`step_config` gives
the trainer that count), so the global step is the same at every DP size dividing ``replicas``.

Every rank of a pipeline (same DP rank) builds the same packs from metadata alone. The encoder work of
LLM microbatch ``k`` is split into ``pp`` encoder microbatches (``omni_data.encoder_microbatch_ids``).
With reordering on, the split balances encoder FLOPs with Karmarkar-Karp (omni-data's ``split_encoder_microbatches``:
grouped reordering inside the pipeline group, which needs no payload movement because every rank of the
group holds the same metadata); with reordering off, each LLM microbatch's media samples are cut in
arrival order into ``pp`` contiguous runs of equal count (the unbalanced baseline; ``balance=False``).

``--packing per_modality`` packs each source separately (a pack holds one modality) and the mixture then
draws packs instead of samples.

Your own data: audio sources are given the encoder's sample rate (``[model.audio] sample_rate``), so clips
at any rate and channel count are described and decoded as resampled to it; images of any mode decode to
RGB. Relative ``urls`` resolve against the config file's folder (:func:`omni_train.data_files.data_root`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from tokenizers import Tokenizer
from torchdata.nodes import BaseNode

from omni_data import (
    AudioTokens,
    ConsumesFn,
    EncoderCost,
    GenerationVocab,
    HybridPacker,
    ImageCodes,
    ImageTokens,
    JoinDocuments,
    MixtureSchedule,
    MixtureStream,
    Modality,
    PackedLoader,
    PayloadReader,
    ReplicaMerge,
    SampleMeta,
    VideoTokens,
    WebDatasetSource,
    ZeroRedundancyFilter,
    replica_ids,
)
from omni_train.config import ConfigError, DataConfig, Packing, RunConfig
from omni_train.data_files import bundled_data_dir, data_root, expand_urls

__all__ = [
    "build_sources",
    "build_step_stream",
    "generation_vocab",
    "image_codes",
    "image_tokenizer_candidates",
    "llm_vocab_size",
    "load_image_tokenizer",
    "mixture_schedule",
    "mixture_unit",
    "step_config",
    "step_microbatches",
]


def step_microbatches(cfg: RunConfig, dp_size: int) -> int:
    """LLM microbatches (packs) one DP rank trains per step: ``data.microbatches`` per data replica it
    runs, ``data.replicas / dp_size`` of them (one without ``data.replicas``)."""
    return cfg.data.microbatches * (cfg.data.replicas // dp_size if cfg.data.replicas else 1)


def step_config(cfg: RunConfig, dp_size: int) -> RunConfig:
    """``cfg`` as the step's consumers see it (schedule, model wiring, data flow, metrics): with
    ``data.replicas``, ``data.microbatches`` is the step's :func:`step_microbatches` and ``replicas`` 0;
    without, ``cfg`` itself. The loader (:func:`build_step_stream`) takes the run's own ``cfg``."""
    if not cfg.data.replicas:
        return cfg
    data = dataclasses.replace(cfg.data, microbatches=step_microbatches(cfg, dp_size), replicas=0)
    return dataclasses.replace(cfg, data=data)


def mixture_schedule(data: DataConfig) -> MixtureSchedule:
    """``data.mixture``'s phases as a :class:`MixtureSchedule`: indexed by step when the phases end at
    ``until_step``, by global drawn tokens (``unit="token"``, expanded LLM tokens over all DP ranks) when
    they end at ``until_tokens``. Weights missing in a phase are 0; with ``data.mixture_interpolate``
    linear between the phases' starts, in either unit.

    Raises:
        ConfigError: phases mixing ``until_step`` and ``until_tokens`` (preflight says so first).
    """
    names = [s.name for s in data.sources]
    unit = mixture_unit(data)
    points, start = [], 0
    for ph in data.mixture:
        points.append((start, {n: float(ph.weights.get(n, 0.0)) for n in names}))
        end = ph.until_tokens if unit == "token" else ph.until_step
        start = end if end is not None else start
    return MixtureSchedule(points, unit=unit, interpolate=data.mixture_interpolate)


def mixture_unit(data: DataConfig) -> str:
    """``"token"`` when the mixture's phases end at ``until_tokens``, else ``"step"``.

    Raises:
        ConfigError: some phases end at ``until_step`` and others at ``until_tokens``, or one names both.
    """
    steps = [i for i, ph in enumerate(data.mixture) if ph.until_step is not None]
    tokens = [i for i, ph in enumerate(data.mixture) if ph.until_tokens is not None]
    if steps and tokens:
        both = sorted(set(steps) & set(tokens))
        at = both[0] if both else max(steps[0], tokens[0])
        raise ConfigError(
            f"data.mixture[{at}]: phases end at until_step or at until_tokens, one unit for the whole "
            f"mixture (until_step in phases {steps}, until_tokens in {tokens})"
        )
    return "token" if tokens else "step"


def image_tokenizer_candidates(cfg: RunConfig) -> list[Path]:
    """Where ``[model.image_tokenizer] path`` is looked for, in order: itself if absolute; else the config
    file's folder, then the bundled data directory (``omni_train/data``: the committed weights)."""
    assert cfg.model.image_tokenizer is not None
    p = Path(cfg.model.image_tokenizer.path)
    if p.is_absolute():
        return [p]
    root = data_root(cfg)
    return [root / p] + ([bundled_data_dir() / p] if root != bundled_data_dir() else [])


def load_image_tokenizer(cfg: RunConfig):
    """The frozen :class:`~omni_train.models.image_tokenizer.ImageTokenizer` of ``[model.image_tokenizer]``
    (the first of :func:`image_tokenizer_candidates` that exists; ``None`` without the section).

    Raises:
        ImageTokenizerFileError: the file is missing, too large, damaged, of another checksum or config
            (the message names it; preflight reports it as ``model.image_tokenizer.path``).
    """
    if cfg.model.image_tokenizer is None:
        return None
    from omni_train.models.image_tokenizer import ImageTokenizer

    paths = image_tokenizer_candidates(cfg)
    return ImageTokenizer.load(next((p for p in paths if p.is_file()), paths[0]))


def generation_vocab(cfg: RunConfig, text_vocab: int, image_tokenizer=None) -> GenerationVocab | None:
    """The token layout of text and image tokens (``omni_data.GenerationVocab``: ``boi = V``, ``eoi = V+1``,
    code ``c`` -> ``V + 2 + c``) with ``[model.image_tokenizer]``, else ``None``. ``image_tokenizer``: the
    loaded one (default: :func:`load_image_tokenizer`)."""
    tok = image_tokenizer if image_tokenizer is not None else load_image_tokenizer(cfg)
    if tok is None:
        return None
    return GenerationVocab(text_vocab, int(tok.codebook_size), tuple(tok.grid))


def llm_vocab_size(cfg: RunConfig, text_vocab: int, image_tokenizer=None) -> int:
    """The LLM's vocabulary: the text tokenizer's ``V``, or ``V + 2 + K`` with ``[model.image_tokenizer]``
    (``boi``, ``eoi`` and its ``K`` codes). ``image_tokenizer``: the loaded one (default: loaded here)."""
    vocab = generation_vocab(cfg, text_vocab, image_tokenizer)
    return text_vocab if vocab is None else vocab.size


def image_codes(cfg: RunConfig, text_vocab: int, image_tokenizer=None) -> ImageCodes | None:
    """What the loader's decode workers turn a generation sample's image into code tokens with: the
    frozen image tokenizer and its input (:func:`omni_train.models.image_tokenizer.letterbox` to
    ``S x S``); ``None`` without ``[model.image_tokenizer]``. ``image_tokenizer``: the loaded one
    (default: loaded here)."""
    tok = image_tokenizer if image_tokenizer is not None else load_image_tokenizer(cfg)
    if tok is None:
        return None
    from omni_train.models.image_tokenizer import letterbox

    size = tok.config.image_size

    def to_input(pixels):
        return letterbox(pixels, size)

    vocab = generation_vocab(cfg, text_vocab, tok)
    assert vocab is not None
    return ImageCodes(vocab, tok, to_input)


def build_sources(
    cfg: RunConfig, tokenizer: Tokenizer, *, dp_rank: int, dp_size: int, image_tokenizer=None
) -> dict[str, BaseNode[SampleMeta]]:
    """One :class:`WebDatasetSource` per ``[[data.sources]]`` entry, split over ``dp_size`` DP ranks, with
    the encoders' token accounting and FLOP costs and, for audio, the encoder's sample rate; a text source
    with ``join_tokens`` is wrapped in :class:`~omni_data.JoinDocuments`. A video source is encoded by the
    ViT (Qwen2-VL): :class:`~omni_data.VideoTokens` with ``model.vit``'s ``temporal_patch`` and each frame
    resized as the source's images would be (``[model.vit]`` or the source's ``min_pixels`` /
    ``max_pixels``); frames sampled at omni-data's defaults (2 per second, at least 4). A generation
    source gets the token layout of ``image_tokenizer`` (the loaded one; default: loaded here)."""
    m = cfg.model
    vit, aud = m.vit, m.audio
    image_tokens = (
        ImageTokens(patch=vit.patch, merge=vit.merge, min_pixels=vit.min_pixels, max_pixels=vit.max_pixels)
        if vit
        else None
    )
    audio_tokens = (
        AudioTokens(frame_ms=1000.0 * aud.hop / aud.sample_rate, subsample=aud.subsample) if aud else None
    )
    root = data_root(cfg)
    sources = {}
    gen = (
        generation_vocab(cfg, tokenizer.get_vocab_size(), image_tokenizer)
        if any(s.modality == Modality.GENERATION for s in cfg.data.sources)
        else None
    )
    for src in cfg.data.sources:
        modality = Modality(src.modality)
        cost = None
        if modality in (Modality.IMAGE, Modality.VIDEO) and vit is not None:
            cost = EncoderCost(hidden=vit.dim, layers=vit.n_layers, mlp_ratio=vit.mlp_ratio)
        elif modality is Modality.AUDIO and aud is not None:
            cost = EncoderCost(hidden=aud.dim, layers=aud.n_layers, mlp_ratio=aud.mlp_ratio)
        tokens = image_tokens
        if tokens is not None and (src.min_pixels is not None or src.max_pixels is not None):
            tokens = dataclasses.replace(
                tokens,
                min_pixels=src.min_pixels if src.min_pixels is not None else tokens.min_pixels,
                max_pixels=src.max_pixels if src.max_pixels is not None else tokens.max_pixels,
            )
        video_tokens = (
            VideoTokens(temporal_patch=vit.temporal_patch, frame=tokens)
            if modality is Modality.VIDEO and vit is not None and tokens is not None
            else None
        )
        sources[src.name] = source = WebDatasetSource(
            expand_urls(src.urls, root),
            modality=modality,
            name=src.name,
            tokenizer=tokenizer,
            image_tokens=tokens,
            audio_tokens=audio_tokens,
            video_tokens=video_tokens,
            generation=gen if modality is Modality.GENERATION else None,
            encoder_cost=cost,
            # clips at other rates are described (and decoded) as resampled to the encoder's rate
            sample_rate=aud.sample_rate if modality is Modality.AUDIO and aud is not None else None,
            rank=dp_rank,
            world_size=dp_size,
            shuffle_shards=True,
            seed=cfg.train.seed,
            epochs=None,
            max_image_pixels=cfg.data.max_image_pixels,
        )
        if src.join_tokens:
            sources[src.name] = JoinDocuments(source, src.join_tokens)
    return sources


def build_step_stream(
    cfg: RunConfig,
    tokenizer: Tokenizer,
    *,
    dp_rank: int,
    dp_size: int,
    dp_group,
    consumes: set[int] | ConsumesFn,
    read_text: bool,
    tp_group=None,
    share=None,
    text_share=None,
    pack_tokens: int | None = None,
    sources: Mapping[str, BaseNode[SampleMeta]] | None = None,
    background: bool = False,
    prepare_on_request: bool = False,
    count_text_skips: bool = True,
    image_tokenizer=None,
) -> ZeroRedundancyFilter:
    """The per-step stream of this rank (see the module docstring); call ``reset()`` or
    ``reset(state)`` before use, ``close()`` after (it owns decode threads).

    Args:
        consumes: encoder microbatch ids this pipeline rank runs (from the data flow), or a function of
            each step's metadata giving them (``omni_pipeline.StepPlanner.consumes``).
        read_text: this rank builds LLM inputs or labels (first or last stage): read every sample's text.
        share, text_share: the zero-redundancy filter's narrowing of encoder microbatches and text reads
            to this rank's part (CP: ``omni_pipeline.CPSharding``); ``None``: everything.
        pack_tokens: pack capacity; default ``data.max_seq_len`` (hybrid DP/CP: the stage's ranks share
            packs of ``dp * cp * max_seq_len`` tokens).
        sources: metadata streams by source name in place of :func:`build_sources`' shards (e.g.
            ``omni_data.testing.SyntheticSource`` to measure the mixture the trainer's packs hold).
        background: prepare the next step's metadata on the filter's own thread while the caller trains
            (``ZeroRedundancyFilter(background=True)``); ``dp_group`` must then be a group no other
            thread uses.
        prepare_on_request: with ``background``, the preparation starts at the filter's ``prepare()``
            (the trainer calls it once the step's inputs are built), not when ``next`` returns.
        count_text_skips: this rank counts the generation samples whose image did not decode (one of
            the ranks that read the same text: ``ZeroRedundancyFilter(count_text_skips=...)``).
        image_tokenizer: the run's loaded image tokenizer (:func:`load_image_tokenizer`; default: loaded
            here, once, for every source and the reader).
    """
    schedule = mixture_schedule(cfg.data)
    d = cfg.data
    capacity = pack_tokens or d.max_seq_len
    if image_tokenizer is None:  # loaded (and its sha256 checked) once for the sources and the reader
        image_tokenizer = load_image_tokenizer(cfg)

    def packed(sources: Mapping[str, BaseNode[SampleMeta]], group) -> PackedLoader:
        if d.packing is Packing.HYBRID:
            mixture = MixtureStream(dict(sources), schedule)
            packer = HybridPacker(mixture, capacity, d.buffer_size, max_pack_age=d.max_pack_age)
        else:
            per_source = {
                n: HybridPacker(s, capacity, d.buffer_size, max_pack_age=d.max_pack_age)
                for n, s in sources.items()
            }
            # The mixture draws whole single-modality packs by the schedule's weights.
            packer = mixture = MixtureStream(per_source, schedule)
        return PackedLoader(packer, d.microbatches, mixture=mixture, dp_group=group)

    loader: PackedLoader | ReplicaMerge
    if d.replicas:  # data replicas independent of the DP size: this rank's replicas merged, in order
        if sources is not None:
            raise ValueError("build_step_stream: sources replace one DP rank's shards, not data.replicas'")
        loader = ReplicaMerge(
            {
                r: packed(
                    build_sources(
                        cfg, tokenizer, dp_rank=r, dp_size=d.replicas, image_tokenizer=image_tokenizer
                    ),
                    None,
                )
                for r in replica_ids(d.replicas, dp_rank, dp_size)
            },
            d.replicas,
            dp_group=dp_group if dp_size > 1 else None,
        )
    else:
        if sources is None:
            sources = build_sources(
                cfg, tokenizer, dp_rank=dp_rank, dp_size=dp_size, image_tokenizer=image_tokenizer
            )
        loader = packed(sources, dp_group if dp_size > 1 else None)
    return ZeroRedundancyFilter(
        loader,  # a ReplicaMerge is a step stream as a PackedLoader is
        consumes,
        microbatches=step_microbatches(cfg, dp_size),
        slices=cfg.parallel.pp,
        # generation samples' images become code tokens where their ids are read (first and last stage)
        reader=PayloadReader(
            tokenizer,
            max_image_pixels=d.max_image_pixels,
            image_codes=image_codes(cfg, tokenizer.get_vocab_size(), image_tokenizer) if read_text else None,
        ),
        tp_group=tp_group,
        prefetch=1,
        background=background,
        prepare_on_request=prepare_on_request,
        read_text=read_text,
        count_text_skips=count_text_skips,
        balance=cfg.parallel.reorder,
        decode_workers=d.decode_workers,
        share=share,
        text_share=text_share,
    )
