"""One training step's cost model from its packs' metadata: modelled FLOPs, or a fit of measured records.

Both are known before any payload is read: the packs give every LLM microbatch's documents and every
encoder microbatch's image patches and audio frames, so a step can be simulated or planned
(:mod:`omni_pipeline.step_plan`) the moment a loader has its metadata.

* **The token convention** (:func:`action_tokens`): the token counts a trainer records with each action
  in ``actions.jsonl`` (:func:`omni_pipeline.records.action_records`), the ones a calibration fits
  (:func:`omni_pipeline.calibrate.fit_cost_model`) and predicts from. LLM: a pack's tokens and the sum of
  its documents' squared lengths (attention runs per document); encoders: per tower, the samples'
  encoder sequence (``"image"``: ViT patches before the ``merge x merge`` patch merge, of images and of
  videos, which run on the image tower; ``"audio"``: frames after subsampling) and the sum of its
  attention documents' squares (an image, a clip, or one temporal slice of a video: see below).
* **Video** (Qwen2-VL's ViT, Wang et al. 2024 §2.1): a clip of ``T`` sampled frames (``SampleMeta.shape``
  ``(T, 3, H, W)``) is ``t = ceil(T / temporal_patch)`` temporal slices of equal patch grids, encoded by
  the image tower's weights with attention inside each slice (``cu_seqlens`` per slice,
  ``omni_train.models.vit``); its encoder sequence is ``media_tokens * merge**2`` patches, attention
  ``t`` documents of ``seq / t`` patches. Without the frame count (``frames=None``, or a sequence not
  divisible by ``t``) the clip is modelled as one attention document of ``seq`` patches: an upper bound
  on its attention FLOPs (``t`` times the slices' sum), matmul FLOPs exact.
* **Modelled** (:func:`modelled_step_costs`): each action's forward FLOPs from omni-parallel's one FLOP
  model (:mod:`omni_parallel.flops`: ``2 * params * tokens`` plus causal attention per document for the
  LLM, bidirectional per sample for the encoders) over a device rate; backward = 2x forward.
* **Calibrated** (:func:`calibrated_step_costs`): a fitted :class:`~omni_pipeline.cost.CostModel`'s
  coefficients applied to the step's token counts.

Modelled sizes (documented assumptions, not measurements): point-to-point :data:`P2P_LATENCY_S` (20 us)
and :data:`P2P_BANDWIDTH_BPS` (50 GB/s; see there); an activation of ``T`` tokens at width ``d`` is ``dtype_bytes * T * d`` bytes
(2 in bf16); a transformer layer stores ``34 * T * d`` bytes in bf16 (``17 * dtype_bytes * T * d``) from
forward to backward (Korthikanti et al., 2022, no recomputation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from omni_data import Modality, Pack
from omni_data.zero_redundancy import SampleIndex
from omni_parallel.flops import TransformerShape, attention_flops, model_flops
from omni_pipeline.cost import ActionTokens, CostModel

__all__ = [
    "MODEL_SCALES",
    "MODEL_SHAPES",
    "P2P_BANDWIDTH_BPS",
    "P2P_LATENCY_S",
    "ModelScale",
    "action_tokens",
    "calibrated_step_costs",
    "encoder_documents",
    "encoder_forward_flops",
    "encoder_tower",
    "model_scale",
    "modelled_step_costs",
    "sample_encoder_flops",
    "sample_frames",
]

# The one modelled interconnect of every simulator consumer (omni-train simulate, benchmarks/pipeline_sim.py):
# the paper's Cluster-A (§6, "8*400 Infiniband" per 8-GPU node) gives each GPU one 400 Gb/s NIC, 50 GB/s;
# pipeline neighbours sit on different nodes once TP fills a node, so P2P crosses that NIC. Latency: an
# assumption (NCCL send/recv of a small message between nodes is tens of us; 20 us taken), not a paper number.
P2P_LATENCY_S = 20e-6
P2P_BANDWIDTH_BPS = 50e9


@dataclasses.dataclass(frozen=True)
class ModelScale:
    """The sizes the cost model times: matmul parameters, width and layers of the LLM and of each
    encoder tower (keyed by modality name, ``"image"`` / ``"audio"``), and the image tower's patch
    merge (``image_merge x image_merge`` ViT patches per LLM token: the encoder sequence of an image) and
    its temporal patch (``temporal_patch`` frames per ViT patch: a video's temporal slices). Videos run on
    the ``"image"`` tower.

    Raises:
        ValueError: ``llm_params`` not > 0, ``llm_dim``, ``llm_layers``, ``image_merge`` or
            ``temporal_patch`` < 1 (the last two whole numbers), or a tower's parameters, width or layers
            not > 0 (naming the field and tower).
    """

    llm_params: float
    llm_dim: int
    llm_layers: int
    encoder_params: dict[str, float]
    encoder_dim: dict[str, int]
    encoder_layers: dict[str, int]
    image_merge: int = 2
    temporal_patch: int = 2

    def __post_init__(self) -> None:
        scalars = {
            "llm_params": self.llm_params,
            "llm_dim": self.llm_dim,
            "llm_layers": self.llm_layers,
            "image_merge": self.image_merge,
            "temporal_patch": self.temporal_patch,
        }
        for name in ("encoder_params", "encoder_dim", "encoder_layers"):
            scalars.update({f"{name}[{k!r}]": v for k, v in getattr(self, name).items()})
        for name, value in scalars.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"ModelScale.{name} must be a number > 0, got {value!r}")
        for name in ("image_merge", "temporal_patch"):
            if getattr(self, name) != int(getattr(self, name)):
                raise ValueError(f"ModelScale.{name} must be a whole number, got {getattr(self, name)!r}")


def model_scale(
    llm: TransformerShape,
    encoders: Mapping[str, TransformerShape],
    *,
    image_merge: int = 2,
    temporal_patch: int = 2,
) -> ModelScale:
    """The :class:`ModelScale` of models of these shapes (matmul parameters from
    :attr:`omni_parallel.flops.TransformerShape.matmul_params`: GQA, the MLP's width and gating
    honoured).

    Args:
        llm: the LLM's blocks. encoders: ``{modality name: tower blocks}``.
        image_merge: the image tower's patch-merge side. temporal_patch: its frames per patch (videos).
    """
    return ModelScale(
        llm.matmul_params,
        llm.dim,
        llm.n_layers,
        {k: e.matmul_params for k, e in encoders.items()},
        {k: e.dim for k, e in encoders.items()},
        {k: e.n_layers for k, e in encoders.items()},
        image_merge,
        temporal_patch,
    )


MODEL_SHAPES: dict[str, TransformerShape] = {
    # The paper's models (§2.2 and §6: ViT-1B, USM-2B, LLaMA-12B); it publishes names, not shapes, so:
    # LLaMA-12B: LLaMA-2-13B's blocks (width 5120, 40 layers, 40 heads, SwiGLU 13824), 12.7e9 matmul weights.
    "llama-12b": TransformerShape(dim=5120, n_layers=40, n_heads=40, ffn_dim=13824, gated_mlp=True),
    # ViT-1B: ViT-g/14 (Zhai et al., 2022; EVA's "ViT-1B"): width 1408, 40 layers, 16 heads, MLP 6144,
    # 1.0e9 matmul weights. (benchmarks/pipeline_sim.py once used width 1536; this is the one definition.)
    "vit-1b": TransformerShape(dim=1408, n_layers=40, n_heads=16, ffn_dim=6144),
    # USM-2B: a Conformer of width 1536 and 32 blocks (Zhang et al., 2023). A Conformer block's two
    # half-step 4x FFNs (16 d^2) and its conv module's pointwise convolutions (3 d^2) count as one MLP of
    # 9.5 d (attention 4 d^2 + 2 d * 9.5 d = 23 d^2 per block): 1.74e9 matmul weights; the depthwise
    # convolution (kernel 32: 32 d weights per block) is left out, as norms are.
    "usm-2b": TransformerShape(dim=1536, n_layers=32, n_heads=16, ffn_dim=9.5 * 1536),
}

MODEL_SCALES = {
    # MegaScale-Omni's triple-modality setup: ViT-1B, USM-2B, LLaMA-12B (§2.2), shapes from MODEL_SHAPES.
    "paper": model_scale(
        MODEL_SHAPES["llama-12b"], {"image": MODEL_SHAPES["vit-1b"], "audio": MODEL_SHAPES["usm-2b"]}
    ),
}


def encoder_tower(modality: Modality | str) -> str:
    """The tower a sample of ``modality`` runs on: ``"image"`` for images and videos (one ViT, Qwen2-VL),
    ``"audio"`` for audio.

    Raises:
        ValueError: ``modality`` is text or not a modality.
    """
    modality = Modality(modality)
    if modality is Modality.TEXT:
        raise ValueError("a text sample runs on no encoder tower")
    return "audio" if modality is Modality.AUDIO else "image"


def encoder_documents(
    modality: Modality | str,
    media_tokens: int,
    image_merge: int = 2,
    *,
    frames: int | None = None,
    temporal_patch: int = 2,
) -> list[int]:
    """A sample's encoder sequence as its attention documents (lengths in encoder tokens; their sum is the
    sequence): an image, ``[media_tokens * image_merge**2]`` ViT patches before the merge; audio,
    ``[media_tokens]`` frames after subsampling; a video of ``frames`` sampled frames,
    ``t = ceil(frames / temporal_patch)`` temporal slices of ``media_tokens * image_merge**2 / t`` patches
    each (the ViT attends inside a slice), or one document of the whole sequence when ``frames`` is
    ``None`` or the sequence does not divide into ``t`` equal slices (the module docstring's bound).
    ``[]`` for text or no media.
    """
    modality = Modality(modality)
    if modality is Modality.TEXT or media_tokens <= 0:
        return []
    if modality is Modality.AUDIO:
        return [media_tokens]
    seq = media_tokens * image_merge * image_merge
    t = -(-frames // temporal_patch) if modality is Modality.VIDEO and frames else 1
    return [seq // t] * t if seq % t == 0 else [seq]


def sample_frames(meta) -> int | None:
    """Sampled frames of a video sample (``shape[0]`` of its ``(T, 3, H, W)`` metadata), else ``None``."""
    if meta.modality is Modality.VIDEO and len(meta.shape) == 4:
        return int(meta.shape[0])
    return None


def _sample_documents(meta, image_merge: int, temporal_patch: int) -> list[int]:
    return encoder_documents(
        meta.modality,
        meta.media_tokens,
        image_merge,
        frames=sample_frames(meta),
        temporal_patch=temporal_patch,
    )


def encoder_forward_flops(
    ms: ModelScale, modality: Modality | str, media_tokens: int, *, frames: int | None = None
) -> float:
    """Forward FLOPs of one sample's encoder (:mod:`omni_parallel.flops`: matmul weights twice per token of
    its encoder sequence, bidirectional attention per attention document, :func:`encoder_documents`):
    what :func:`modelled_step_costs` times and what a sample's ``encoder_flops`` balances by. 0 for text.

    Args:
        ms: model sizes. modality: the sample's modality (``"image"`` and ``"video"`` run on the
            ``"image"`` tower, ``"audio"`` on ``"audio"``; ``"text"``: 0).
        media_tokens: the sample's LLM media tokens (images and videos: after the ``image_merge`` patch
            merge).
        frames: a video's sampled frames (``SampleMeta.shape[0]``), so attention runs per temporal slice
            of ``ms.temporal_patch`` frames; ``None``: one document over the whole clip (an upper bound).

    Raises:
        KeyError: ``ms`` has no tower for ``modality``.
    """
    docs = encoder_documents(
        modality, media_tokens, ms.image_merge, frames=frames, temporal_patch=ms.temporal_patch
    )
    if not docs:
        return 0.0
    kind = encoder_tower(modality)
    attention = attention_flops(docs, ms.encoder_dim[kind], ms.encoder_layers[kind], causal=False)
    return model_flops(ms.encoder_params[kind], sum(docs), attention, training=False)


def sample_encoder_flops(ms: ModelScale, meta) -> float:
    """:func:`encoder_forward_flops` of one sample's metadata (a video's frames from its shape)."""
    return encoder_forward_flops(ms, meta.modality, meta.media_tokens, frames=sample_frames(meta))


def action_tokens(
    packs: Sequence[Pack],
    mbs: Mapping[int, Sequence[SampleIndex]],
    *,
    image_merge: int = 2,
    temporal_patch: int = 2,
) -> tuple[dict[int, ActionTokens], dict[int, ActionTokens]]:
    """Token counts of one step's actions in the convention a trainer records them in (the one
    calibration fits and predicts with).

    * LLM microbatch ``k`` (pack ``k - 1``), every stage's F and B: ``{"llm": (T, sum L**2)}``, ``T``
      the pack's tokens, ``L`` each packed document's (sample's) tokens: attention runs per document
      (``omni_parallel.varlen.varlen_attention``).
    * Encoder microbatch ``e``: per tower that runs, ``(sum n, sum L**2)`` over its samples, ``n`` a
      sample's encoder sequence (``"image"``: ViT patches before the ``image_merge x image_merge``
      merge, of images and videos; ``"audio"``: frames after subsampling) and ``L`` its attention
      documents (:func:`encoder_documents`): per image, per audio clip, per temporal slice of a video.

    Args:
        packs: the step's packs. mbs: ``{e: [(pack, sample)]}`` (encoder microbatches).
        image_merge: the image tower's patch-merge side. temporal_patch: its frames per patch.

    Returns:
        ``({k: ActionTokens}, {e: ActionTokens})``.
    """
    llm = {
        k: ActionTokens.single("llm", p.num_tokens, sum(n * n for n in p.seqlens))
        for k, p in enumerate(packs, start=1)
    }
    enc = {}
    for e, items in mbs.items():
        seq: dict[str, list[float]] = {}
        for p, i in items:
            s = packs[p].samples[i]
            docs = _sample_documents(s, image_merge, temporal_patch)
            if not docs:
                continue
            acc = seq.setdefault(encoder_tower(s.modality), [0.0, 0.0])
            acc[0] += sum(docs)
            acc[1] += sum(n * n for n in docs)
        enc[e] = ActionTokens({m: (n, sq) for m, (n, sq) in seq.items()})
    return llm, enc


def _sizes(
    ms: ModelScale,
    packs: Sequence[Pack],
    mbs: Mapping[int, Sequence[SampleIndex]],
    pp: int,
    dtype_bytes: float,
) -> dict:
    """Byte sizes of one step (activations, stored activations, encoder outputs) and tokens/microbatch."""
    tokens = sum(p.num_tokens for p in packs) / len(packs)
    out_b, stored = {}, {}
    for e, items in mbs.items():
        o = st = 0.0
        for p, i in items:
            s = packs[p].samples[i]
            seq = sum(_sample_documents(s, ms.image_merge, ms.temporal_patch))
            if not seq:
                continue
            kind = encoder_tower(s.modality)
            o += dtype_bytes * s.media_tokens * ms.llm_dim
            st += 17.0 * dtype_bytes * ms.encoder_layers[kind] * seq * ms.encoder_dim[kind]
        out_b[e], stored[e] = o, st
    return {
        "llm_activation_bytes": dtype_bytes * tokens * ms.llm_dim,
        "llm_stored_bytes": 17.0 * dtype_bytes * tokens * ms.llm_dim * ms.llm_layers / pp,
        "encoder_output_bytes": out_b,
        "encoder_stored_bytes": stored,
        "tokens_per_microbatch": tokens,
    }


def calibrated_step_costs(
    fitted: CostModel,
    ms: ModelScale,
    packs: Sequence[Pack],
    mbs: Mapping[int, Sequence[SampleIndex]],
    pp: int,
    dtype_bytes: float = 4.0,
) -> CostModel:
    """``fitted`` (from :func:`~omni_pipeline.calibrate.fit_cost_model`) applied to one step: every
    action's seconds from its token counts (:func:`action_tokens`), byte sizes from ``ms``'s models in
    the run's dtype (``dtype_bytes`` per element).

    Args:
        pp: pipeline stages the fit timed.

    Raises:
        KeyError: the fit has no coefficients for a module this step runs (the run never ran it).
    """
    llm, enc = action_tokens(packs, mbs, image_merge=ms.image_merge, temporal_patch=ms.temporal_patch)
    return fitted.for_step(pp, llm, enc, **_sizes(ms, packs, mbs, pp, dtype_bytes))


def modelled_step_costs(
    ms: ModelScale,
    packs: Sequence[Pack],
    mbs: Mapping[int, Sequence[SampleIndex]],
    pp: int,
    rate: float,
    dp: int = 1,
    stage_weights: Sequence[float] | None = None,
) -> CostModel:
    """One step's cost model from modelled FLOPs (no measurement): each action's seconds are its matmul
    and attention forward FLOPs (:mod:`omni_parallel.flops`) over ``rate`` FLOP/s, backward twice the
    forward; P2P :data:`P2P_LATENCY_S` + bytes / :data:`P2P_BANDWIDTH_BPS`; byte sizes in bf16 as the module docstring says.

    Args:
        ms: model sizes (:data:`MODEL_SCALES` or :func:`model_scale`).
        packs, mbs: the step's packs and encoder microbatches ``{e: [(pack, sample)]}``.
        pp: pipeline stages; rate: FLOP/s; dp: data-parallel replicas.
        stage_weights: per stage, its LLM cost relative to the mean stage (embedding, LM head and loss
            counted: :func:`omni_pipeline.step_plan.stage_weights`); ``None``: every stage the mean.
    """
    llm_fwd = [
        model_flops(
            ms.llm_params,
            p.num_tokens,
            attention_flops(p.seqlens, ms.llm_dim, ms.llm_layers, causal=True),
            training=False,
        )
        for p in packs
    ]
    enc_fwd_s = {}
    for e, items in mbs.items():
        flops = sum(sample_encoder_flops(ms, packs[p].samples[i]) for p, i in items)
        enc_fwd_s[e] = flops / rate
    stage_fwd = sum(llm_fwd) / len(llm_fwd) / pp / rate
    fwd: float | list[float] = stage_fwd
    bwd: float | list[float] = 2 * stage_fwd
    if stage_weights is not None:
        fwd = [stage_fwd * w for w in stage_weights]
        bwd = [2 * f for f in fwd]
    return CostModel(
        llm_forward_s=fwd,
        llm_backward_s=bwd,
        encoder_forward_s=enc_fwd_s,
        p2p_latency_s=P2P_LATENCY_S,
        p2p_bandwidth_Bps=P2P_BANDWIDTH_BPS,
        data_parallel=dp,
        **_sizes(ms, packs, mbs, pp, 2.0),
    )
