"""From packs to LLM inputs and labels: one pack as an LLM microbatch, its Ulysses chunk, a step's targets.

Token layout of a pack (omni-data's :class:`~omni_data.packing.Pack`): sample after sample, each
``media_tokens`` placeholder slots (``<|image|>``, ``<|audio|>`` or a video's placeholder, replaced by
encoder embeddings on stage 0) then its text token ids. The training target is next-token prediction
inside each sample: the token at position ``t`` is predicted from positions ``<= t - 1`` of the same
sample, and only text tokens are targets (the first caption token is predicted from the image embeddings: the captioning loss).
A generation sample (caption, ``boi``, an image's code tokens, ``eoi``: :mod:`omni_data.image_generation`)
has targets on its codes and ``eoi`` only (the caption is the prompt), and its statistics are its own
(``generation`` in :data:`MODALITIES`): the generation loss, apart from the understanding and text losses.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from omni_data.image_generation import generation_targets
from omni_data.packing import ModalitySpan, Pack
from omni_data.sample import Modality, SampleMeta

__all__ = [
    "IGNORE",
    "MODALITIES",
    "LLMMicrobatch",
    "build_llm_microbatch",
    "step_targets",
    "ulysses_chunk",
    "ulysses_layout",
]

IGNORE = -100  # label of a position with no target (``torch.nn.functional.cross_entropy``'s ignore_index)
# the order of per-modality statistics (added ones last: the indices of the others are what they were)
MODALITIES = (Modality.IMAGE, Modality.AUDIO, Modality.TEXT, Modality.VIDEO, Modality.GENERATION)


@dataclass
class LLMMicrobatch:
    """One pack as tensors.

    Attributes:
        input_ids: int64 ``[T]`` (placeholders at media slots).
        position_ids: int64 ``[T]``, restarting at 0 per sample (the pack's); ``[3, T]`` M-RoPE ids when
            the step builder sets them (``StepSpec.mrope``, :mod:`omni_pipeline.mrope`).
        cu_seqlens: int64 ``[num_samples + 1]``.
        labels: int64 ``[T]``: ``labels[t]`` is the target predicted at ``t`` (``IGNORE`` where none).
        label_modality: int64 ``[T]``: index into :data:`MODALITIES` of the sample each position is in.
        spans: the pack's media spans (``ModalitySpan``), in pack order.
        samples: the pack's sample metadata, in pack order.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor
    label_modality: torch.Tensor
    spans: list[ModalitySpan]
    samples: list[SampleMeta] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE).sum())


def build_llm_microbatch(
    pack: Pack,
    text_ids: dict[str, torch.Tensor],
    placeholder_ids: dict[Modality, int],
    masked: Collection[int] = (),
) -> LLMMicrobatch:
    """Tensors for one pack.

    Args:
        pack: the pack (metadata only).
        text_ids: ``uid -> int64 [text_tokens]`` for every sample of the pack that has text.
        placeholder_ids: token id of each media modality's placeholder (``<|image|>``, ``<|audio|>``, a
            video's).
        masked: indices (in the pack) of samples with no targets: those whose image/audio did not decode
            (``Payload.error``); their tokens stay in the pack, every label is ``IGNORE``.

    Raises:
        ValueError: a sample's text ids are missing or their count differs from its metadata (names it).
    """
    ids, labels, mods = [], [], []
    for j, s in enumerate(pack.samples):
        t = text_ids.get(s.uid, torch.zeros(0, dtype=torch.int64))
        if t.numel() != s.text_tokens:
            raise ValueError(f"sample {s.uid}: {t.numel()} text token ids, metadata says {s.text_tokens}")
        media = torch.full((s.media_tokens,), placeholder_ids.get(s.modality, 0), dtype=torch.int64)
        seq = torch.cat([media, t.to(torch.int64)])
        lab = torch.full_like(seq, IGNORE)
        if s.modality is Modality.GENERATION:
            if j not in masked:  # positions boi .. last code predict the codes and eoi
                first, count = generation_targets(s)
                lab[first : first + count] = seq[first + 1 : first + count + 1]
        elif seq.numel() > 1 and j not in masked:
            # position p predicts token p + 1 when that token is text (not a media slot)
            is_text = torch.arange(1, seq.numel()) >= s.media_tokens
            lab[:-1] = torch.where(is_text, seq[1:], IGNORE)
        ids.append(seq)
        labels.append(lab)
        mods.append(torch.full_like(seq, MODALITIES.index(s.modality)))
    cu = torch.zeros(len(pack.samples) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor([s.num_tokens for s in pack.samples], dtype=torch.int64), 0)
    return LLMMicrobatch(
        input_ids=torch.cat(ids),
        position_ids=pack.position_ids,
        cu_seqlens=cu,
        labels=torch.cat(labels),
        label_modality=torch.cat(mods),
        spans=pack.spans,
        samples=list(pack.samples),
    )


def step_targets(packs: list[Pack], masked: Collection[tuple[int, int]] = ()) -> int:
    """Target tokens of a step from metadata alone (the labels :func:`build_llm_microbatch` sets): every
    text token of a sample with media (the first is predicted from the media embeddings), every text
    token but the first of a text-only sample, the ``h*w`` codes and ``eoi`` of a generation sample;
    none for a ``masked`` ``(pack, sample)``."""
    n = 0
    for p, pack in enumerate(packs):
        for i, s in enumerate(pack.samples):
            if (p, i) in masked:
                continue
            if s.modality is Modality.GENERATION:
                n += generation_targets(s)[1]
            else:
                n += s.text_tokens if s.media_tokens else max(s.text_tokens - 1, 0)
    return n


def ulysses_layout(
    position_ids: torch.Tensor, cu_seqlens: torch.Tensor, sp: int, sp_rank: int, multiple: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """This Ulysses rank's share of a pack (DeepSpeed-Ulysses: contiguous ``1/sp`` token chunks).

    The pack of ``T`` tokens is padded to ``T_pad``, the next multiple of ``multiple`` (default ``sp``),
    with a padding document of its own (so padding never attends to real tokens, nor they to it) and rank
    ``r`` holds tokens ``[r * T_pad / sp, (r + 1) * T_pad / sp)``. Megatron sequence parallelism over
    ``tp`` TP ranks pads to ``multiple = sp * tp`` (each chunk then splits evenly over TP; with ``sp = 1``
    the chunk is the whole padded pack).

    Args:
        position_ids: int64 ``[T]``; cu_seqlens: int64 ``[docs + 1]`` ending at ``T``.
        sp: Ulysses group size; sp_rank: this rank's index in it.
        multiple: pad to a multiple of this (a multiple of ``sp``); ``None``: ``sp``.

    Returns:
        ``(position_ids [T_pad / sp] of the chunk (global positions, padding counts 0, 1, ...),
        cu_seqlens [docs + 1 or docs + 2] of the padded pack, lo, hi)``: the chunk is ``[lo, hi)``.

    Raises:
        ValueError: ``multiple`` is not a positive multiple of ``sp``.
    """
    multiple = sp if multiple is None else multiple
    if multiple < 1 or multiple % sp:
        raise ValueError(f"ulysses_layout: multiple {multiple} is not a positive multiple of sp {sp}")
    t = int(position_ids.numel())
    pad = -t % multiple
    if pad:
        position_ids = torch.cat([position_ids, torch.arange(pad, dtype=position_ids.dtype)])
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([t + pad])])
    local = (t + pad) // sp
    lo, hi = sp_rank * local, (sp_rank + 1) * local
    return position_ids[lo:hi], cu_seqlens, lo, hi


def ulysses_chunk(mb: LLMMicrobatch, sp: int, sp_rank: int, multiple: int | None = None) -> LLMMicrobatch:
    """This Ulysses rank's chunk of ``mb`` (:func:`ulysses_layout`, padded to a multiple of ``multiple``,
    default ``sp``): padding tokens are id 0 with ``IGNORE`` labels (no targets); labels were set on the
    whole pack, so a chunk's last position still predicts the next chunk's first token. ``cu_seqlens``
    stay those of the whole (padded) pack."""
    pos, cu, lo, hi = ulysses_layout(mb.position_ids, mb.cu_seqlens, sp, sp_rank, multiple)
    pad = int(cu[-1]) - mb.num_tokens

    def padded(x: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([x, x.new_full((pad,), fill)])[lo:hi]

    return LLMMicrobatch(
        input_ids=padded(mb.input_ids, 0),
        position_ids=pos,
        cu_seqlens=cu,
        labels=padded(mb.labels, IGNORE),
        label_modality=padded(mb.label_modality, MODALITIES.index(Modality.TEXT)),
        spans=mb.spans,
        samples=mb.samples,
    )
