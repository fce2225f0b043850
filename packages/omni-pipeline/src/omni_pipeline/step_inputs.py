"""The step-input bridge: one step's loader output as executor inputs, and the executor's callables over it.

:meth:`StepBuilder.build` turns the loader's :class:`~omni_data.zero_redundancy.FilteredStep` (the step's
packs, its encoder microbatches and their decoded payloads, each sample's text ids) into a
:class:`StepInputs` before the step runs: the packs as LLM microbatches with labels
(:mod:`omni_pipeline.microbatch`), the media positions each encoder microbatch fills on stage 0 (its
planned output shape), the samples whose payload did not decode, the step's target count (the loss
denominator, :mod:`omni_pipeline.loss`), the encoder work of this rank and the executor's
:class:`~omni_pipeline.StepPlan`. :meth:`StepBuilder.functions` returns the
:class:`~omni_pipeline.StepFunctions` of that step, closures over that value. Nothing of a step is kept
on the builder.

What an adopter passes in (:class:`StepSpec`): the placeholder token id of each media modality, the LLM
width, the activation dtype and device, and this rank's stage role and Ulysses position; the encoder
towers as one module called ``encoders(payloads, long)`` (a :class:`~omni_pipeline.towers.ModalityRouter`
over its own towers and input builders); the groups. Stage 0's module then takes
``(input_ids, position_ids, cu_seqlens, media_embeds, media_rows)`` (CP: a
:class:`~omni_parallel.CPSequence` in place of ``cu_seqlens``) and scatters ``media_embeds`` into its
embedded ``input_ids`` at the local rows ``media_rows``; later stages take ``position_ids`` and
``cu_seqlens`` as keyword arguments; the last stage returns ``[tokens, vocab]`` logits.

Multimodal RoPE (``StepSpec.mrope``; Wang et al., "Qwen2-VL", 2024, §2.1): every pack's positions are
int64 ``[3, T]`` (temporal, height, width) from its samples' metadata (:mod:`omni_pipeline.mrope`: a
video's ``(t, h, w)`` grid, an image's ``(1, h, w)``, text 1-D on all three axes), built by every stage
from the pack (stage 0 in its input, later stages in their keyword arguments; stage boundaries carry only
hidden states). Videos reach the vision tower through the router's ``routes`` (``StepSpec.routes``).

Ulysses (``sp > 1``): each SP rank holds a contiguous ``1/sp`` chunk of every pack (padded to a multiple
of ``sp`` with a padding document that has no targets), its global RoPE positions and the whole pack's
``cu_seqlens``. Encoder work goes through :mod:`omni_pipeline.encoder_parallel` (reordering across DP,
long-short SP over the stage's SP group, resharding into the LLM layout): each encoder microbatch's
samples are encoded once, spread over the SP ranks, and SP rank ``u`` of stage 0 receives exactly the
media rows of its chunk, which it scatters into its placeholder slots.

Megatron sequence parallelism (``tp_sp > 1``): every TP rank gets the whole pack (or Ulysses chunk),
padded the Ulysses way to a multiple of ``sp * tp_sp``, and its stage boundaries carry its ``1/tp_sp``
token shard (``[T_pad / (sp * tp_sp), llm_dim]``: the executor's receive shapes); media positions stay
the pack's (or the chunk's), stage 0 scatters the media rows before keeping its shard.

CP and hybrid DP/CP (``cp``, :mod:`omni_pipeline.cp_delivery`): each rank holds its head-tail share of
every pack (or, hybrid, its whole samples and its shares of the long ones), the RoPE positions of those
tokens, and a :class:`~omni_parallel.CPSequence` in place of ``cu_seqlens``; its encoder microbatches are
its share of each slice, and their embeddings reach their tokens through ``CPSharding.deliver_media``
(the CP path of ``omni_parallel.reshard_to_llm``); :mod:`omni_pipeline.encoder_parallel` then only runs
the encoders on that share (no reordering across DP). With ``CPSpec.encoder_sp = cp`` (plain CP) the
encoders instead run long-short SP over the CP group like Ulysses, and each output already holds the
rows of this CP rank's head-tail slots, scattered there as under Ulysses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from omni_data import Modality, Pack
from omni_data.payload import Payload
from omni_data.zero_redundancy import FilteredStep, SampleIndex
from omni_pipeline.cp_delivery import CPSharding
from omni_pipeline.dataflow import DataFlow
from omni_pipeline.encoder_parallel import EncoderParallel, EncoderWork, SequenceLayout
from omni_pipeline.executor import StepFunctions, StepPlan
from omni_pipeline.loss import microbatch_loss
from omni_pipeline.microbatch import (
    MODALITIES,
    LLMMicrobatch,
    build_llm_microbatch,
    step_targets,
    ulysses_chunk,
    ulysses_layout,
)
from omni_pipeline.mrope import mrope_documents, mrope_position_ids
from omni_pipeline.schedules import Schedule

__all__ = ["StepBuilder", "StepInputs", "StepSpec", "undecodable_samples"]

_MEDIA = (Modality.IMAGE, Modality.AUDIO, Modality.VIDEO)  # the modalities an encoder tower encodes


@dataclass(frozen=True)
class StepInputs:
    """Everything one step reads, built before it runs.

    Attributes:
        step: the step index (from 0).
        packs: the step's packs (metadata), pack ``k - 1`` is LLM microbatch ``k``.
        microbatches: ``{k: LLMMicrobatch}`` (this SP rank's chunk); on the first and last stage only.
        masked: ``(pack, sample)`` whose payload did not decode on any rank of the pipeline: in their packs
            with no targets, counted as ``skipped_payloads``.
        targets: target tokens of the whole step on every DP replica (the loss denominator, >= 1).
        media_positions: ``{e: int64 [rows_e]}`` this SP rank's local slots (pack positions without SP)
            the output of encoder microbatch ``e`` fills on stage 0, in output (slot) order; ``rows_e``
            is the planned output shape.
        payloads: ``{e: [Payload]}`` for the encoder microbatches the data flow runs on this rank.
        plan: what the executor runs.
        encoder_work: ``{e: EncoderWork}`` for the encoder microbatches the data flow runs on this rank
            (the executor's encoder inputs; payload exchange across DP already done).
        media: the encoder towers (``"image"``, ``"audio"``; a modality routed to another's tower,
            ``StepSpec.routes``, counts as that tower: a video as ``"image"``) with at least one media
            sample in the step on any DP replica: a tower outside it ran nowhere in the step, so its
            gradients are zero on every rank and need no reduction.
    """

    step: int
    packs: list[Pack]
    microbatches: dict[int, LLMMicrobatch]
    masked: frozenset[tuple[int, int]]
    targets: int
    media_positions: dict[int, torch.Tensor]
    payloads: Mapping[int, list[Payload]]
    plan: StepPlan
    encoder_work: Mapping[int, EncoderWork] = field(default_factory=dict)
    media: frozenset[str] = frozenset({str(Modality.IMAGE), str(Modality.AUDIO)})


@dataclass(frozen=True)
class StepSpec:
    """What a rank's :class:`StepBuilder` needs to know of the model and of its place in the layout.

    Attributes:
        placeholders: ``{modality: token id}`` of each media modality's placeholder token (``<|image|>``,
            ``<|audio|>``): the id at its samples' media slots, which stage 0 overwrites with encoder rows.
        llm_dim: the LLM width (the stage-boundary activation's and encoder outputs' last dim).
        dtype: activation dtype on the wire (stage boundaries, encoder outputs).
        device: where model inputs go.
        builds_text: this rank builds LLM inputs or labels (first or last pipeline stage).
        sp, sp_rank: Ulysses size and this rank's index in the Ulysses group.
        tp_sp: Megatron sequence parallelism: the TP size when it is on, else 1. Each pack (each
            Ulysses chunk) is padded to a multiple of ``sp * tp_sp`` tokens (a padding document without
            targets) and a stage boundary carries ``1 / tp_sp`` of its tokens (the TP rank's shard);
            every TP rank gets the whole (chunk's) token ids, positions, ``cu_seqlens`` and labels.
        routes: ``{modality: tower}`` for a modality encoded by another's tower (the encoders'
            ``ModalityRouter.routes``; Qwen2-VL: ``{"video": "image"}``): :attr:`StepInputs.media` names
            towers.
        mrope: ``(patch, merge, temporal_patch)`` of the vision tower: the LLM takes multimodal RoPE
            positions (Wang et al., "Qwen2-VL", 2024, §2.1 M-RoPE; :mod:`omni_pipeline.mrope`), every
            pack's ``position_ids`` are int64 ``[3, T]`` (temporal, height, width) from its samples'
            metadata, on every stage; ``None``: the pack's 1-D ``[T]`` positions.

    Raises:
        ValueError: ``llm_dim``, ``sp`` or ``tp_sp`` below 1, or ``sp_rank`` outside ``[0, sp)`` (or not ints);
            ``builds_text`` not a bool; a placeholder keyed by something other than ``image`` / ``audio``
            / ``video``, or a token id that is not an int >= 0; ``mrope`` not three ints >= 1, or with
            ``sp`` or ``tp_sp`` > 1 (positions are not split into Ulysses chunks / TP shards in 3-D).
    """

    placeholders: Mapping[Modality, int]
    llm_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    builds_text: bool = True
    sp: int = 1
    sp_rank: int = 0
    tp_sp: int = 1
    routes: Mapping[str, str] = field(default_factory=dict)
    mrope: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("llm_dim", "sp", "sp_rank", "tp_sp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"StepSpec.{name} must be an int, got {value!r}")
        if not isinstance(self.builds_text, bool):
            raise ValueError(f"StepSpec.builds_text must be a bool, got {self.builds_text!r}")
        media = {str(m) for m in _MEDIA}
        for modality, token in self.placeholders.items():
            if modality not in media:
                raise ValueError(
                    f"StepSpec.placeholders: {modality!r} is not a media modality (one of {sorted(media)})"
                )
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(
                    f"StepSpec.placeholders[{modality!r}] must be a token id >= 0, got {token!r}"
                )
        if self.llm_dim < 1 or self.sp < 1 or self.tp_sp < 1 or not 0 <= self.sp_rank < self.sp:
            raise ValueError(
                f"StepSpec: llm_dim {self.llm_dim}, sp {self.sp} and tp_sp {self.tp_sp} must be >= 1 and "
                f"sp_rank {self.sp_rank} in [0, sp)"
            )
        if self.mrope is not None:
            ok = len(self.mrope) == 3 and all(isinstance(v, int) and v >= 1 for v in self.mrope)
            if not ok:
                raise ValueError(
                    f"StepSpec.mrope must be (patch, merge, temporal_patch) >= 1, got {self.mrope!r}"
                )
            if self.sp > 1 or self.tp_sp > 1:
                raise ValueError(
                    f"StepSpec.mrope: M-RoPE positions with sp {self.sp} / tp_sp {self.tp_sp} > 1 are not "
                    "supported (3-D positions are not cut into Ulysses chunks or TP shards)"
                )


class StepBuilder:
    """Builds a rank's :class:`StepInputs` and the executor's callables for them.

    Args:
        spec: placeholder ids, LLM width, dtype, device, stage role and Ulysses position.
        schedule, flow: the LLM schedule and the run's data flow (a step may bring its own: :meth:`build`).
        encoders: the encoder towers, ``encoders(payloads, long) -> [rows, llm_dim]``
            (:class:`~omni_pipeline.towers.ModalityRouter`).
        pp_group: the pipeline group (shares which samples failed to decode); ``None`` for pp=1.
        dp_group: the DP group (sums the step's target count); ``None`` for dp=1 (and for hybrid DP/CP,
            whose ranks share one stream of packs).
        parallel: the encoders' groups and layout (:class:`~omni_pipeline.encoder_parallel.EncoderParallel`);
            default: none (no SP, no reordering across DP).
        cp: this rank's CP / hybrid DP/CP layout; ``None`` without CP.
        cp_group: the ranks of a stage that share the packs under ``cp`` (the CP group, or dp_cp for
            hybrid DP/CP): they share which samples failed to decode.

    Raises:
        ValueError: ``spec.mrope`` with ``cp`` (M-RoPE positions are not cut into CP shares).
    """

    def __init__(
        self,
        spec: StepSpec,
        *,
        schedule: Schedule,
        flow: DataFlow,
        encoders: torch.nn.Module,
        pp_group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
        parallel: EncoderParallel | None = None,
        cp: CPSharding | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.spec = spec
        if spec.mrope is not None and cp is not None:
            raise ValueError("StepBuilder: M-RoPE positions (StepSpec.mrope) under CP are not supported")
        self.cp, self.cp_group = cp, cp_group
        self.schedule, self.flow, self.encoders = schedule, flow, encoders
        self.placeholders = dict(spec.placeholders)
        self.llm_dim, self.dtype, self.device = spec.llm_dim, spec.dtype, spec.device
        self.builds_text, self.sp, self.sp_rank = spec.builds_text, spec.sp, spec.sp_rank
        self.multiple = spec.sp * spec.tp_sp  # packs are padded to a multiple of this
        self.pp_group, self.dp_group = pp_group, dp_group
        self.parallel = parallel or EncoderParallel(SequenceLayout())

    def build(self, fs: FilteredStep, flow: DataFlow | None = None) -> StepInputs:
        """The step's inputs under ``flow`` (the step's data flow when it is planned per step; default the
        run's) (collective over the pipeline and DP groups, and over the reordering group across DP: every
        rank calls it)."""
        flow = flow or self.flow
        packs = fs.packs
        masked = self._undecodable(fs)
        mbs: dict[int, LLMMicrobatch] = {}
        if self.builds_text:
            for k, (pack, row) in enumerate(zip(packs, fs.text_ids), start=1):
                ids = {s.uid: t for s, t in zip(pack.samples, row) if t is not None}
                if self.cp is not None:
                    ids = self.cp.fill_unread(pack, ids)
                mb = build_llm_microbatch(pack, ids, self.placeholders, {i for p, i in masked if p == k - 1})
                mb.position_ids = self.positions(pack)
                mbs[k] = self._local_microbatch(mb, pack)
        positions = {
            e: torch.tensor(self.parallel.slots(packs, items), dtype=torch.int64)
            for e, items in fs.microbatches.items()
        }
        consumer = flow.encoder_consumer
        work = {e: self.parallel.plan(fs, e, consumer[e]) for e in sorted(fs.payloads)}
        # the step's target count and its media samples per modality, summed over the DP replicas at once
        counts = [
            sum(s.modality == m and s.media_tokens > 0 for p in packs for s in p.samples) for m in _MEDIA
        ]
        targets = torch.tensor([step_targets(packs, masked), *counts], dtype=torch.int64)
        if self.dp_group is not None:
            dist.all_reduce(targets, group=self.dp_group)
        routes = self.spec.routes
        media = frozenset(routes.get(str(m), str(m)) for m, n in zip(_MEDIA, targets[1:].tolist()) if n > 0)
        plan = StepPlan(
            self.schedule,
            flow,
            llm_shapes={k: (self._local_tokens(p), self.llm_dim) for k, p in enumerate(packs, start=1)},
            encoder_shapes={e: (int(pos.numel()), self.llm_dim) for e, pos in positions.items()},
            dtype=self.dtype,
        )
        return StepInputs(
            fs.step, packs, mbs, masked, max(1, int(targets[0])), positions, fs.payloads, plan, work, media
        )

    def positions(self, pack: Pack) -> torch.Tensor:
        """The pack's RoPE position ids: int64 ``[T]`` (restarting at 0 per sample), or with
        ``StepSpec.mrope`` its M-RoPE ids ``[3, T]`` (:func:`omni_pipeline.mrope.mrope_position_ids` of
        its samples' metadata: the vision grids from their decoded shapes).

        Raises:
            ValueError: as :func:`omni_pipeline.mrope.mrope_documents` (an image or video whose shape
                does not give its media tokens; the sample is named).
        """
        if self.spec.mrope is None:
            return pack.position_ids
        patch, merge, temporal_patch = self.spec.mrope
        docs = mrope_documents(pack.samples, patch=patch, merge=merge, temporal_patch=temporal_patch)
        return mrope_position_ids(docs, merge)

    def _local_microbatch(self, mb: LLMMicrobatch, pack: Pack) -> LLMMicrobatch:
        """This rank's part of a whole-pack microbatch: its Ulysses chunk or its CP share."""
        if self.cp is not None:
            return self.cp.microbatch(mb, pack)
        return ulysses_chunk(mb, self.sp, self.sp_rank, self.multiple) if self.multiple > 1 else mb

    def _local_tokens(self, pack: Pack) -> int:
        """Tokens of a stage-boundary activation: the CP share, or the Ulysses chunk's TP shard."""
        if self.cp is not None:
            return self.cp.local(pack).tokens
        return -(-pack.num_tokens // self.multiple)

    def functions(self, inputs: StepInputs) -> StepFunctions:
        """The executor's callables for ``inputs`` (closures over it)."""

        def first_stage_input(k: int, outs: Mapping[int, torch.Tensor]) -> tuple:
            mb = inputs.microbatches[k]
            es = [e for e in inputs.plan.flow.encoder_inputs[k] if e in outs]
            media = torch.cat([outs[e] for e in es]) if es else None
            # With an encoder SP group each output already holds exactly this rank's rows, in its local
            # slots (encoder_parallel's resharding): Ulysses chunk, or CP head-tail share.
            pos = torch.cat([inputs.media_positions[e] for e in es]).to(self.device) if es else None
            if self.cp is not None:
                return self._cp_first_stage_input(inputs, k, media, pos)
            dev = self.device
            return mb.input_ids.to(dev), mb.position_ids.to(dev), mb.cu_seqlens.to(dev), media, pos

        def stage_kwargs(stage: int, k: int) -> dict[str, Any]:
            pack = inputs.packs[k - 1]
            # Ulysses: the unpadded pack's tokens (the chunks' rows past it are padding; MoE statistics)
            extra = {"pack_tokens": pack.num_tokens} if self.sp > 1 else {}
            if stage == 0:
                return extra
            if self.cp is not None:
                pos = torch.tensor(self.cp.local(pack).position, dtype=torch.int64, device=self.device)
                return {"position_ids": pos, "cu_seqlens": self.cp.sequence(pack)}
            cu = torch.zeros(len(pack.samples) + 1, dtype=torch.int64)
            cu[1:] = torch.cumsum(torch.tensor(pack.seqlens, dtype=torch.int64), 0)
            pos = self.positions(pack)
            if self.multiple > 1:
                pos, cu, _, _ = ulysses_layout(pos, cu, self.sp, self.sp_rank, self.multiple)
            return {"position_ids": pos.to(self.device), "cu_seqlens": cu.to(self.device), **extra}

        def loss(k: int, logits: torch.Tensor):
            value, stats = microbatch_loss(logits, _to(inputs.microbatches[k], self.device), inputs.targets)
            metrics = {}
            for i, mod in enumerate(MODALITIES):
                metrics[f"ce_{mod}"] = float(stats[i, 0])
                metrics[f"n_{mod}"] = float(stats[i, 1])
            return value, metrics

        def encode(e: int, work: EncoderWork) -> torch.Tensor:
            return self.parallel.encode(self.encoders, work, self.dtype)

        return StepFunctions(first_stage_input, loss, encode, stage_kwargs)

    def _cp_first_stage_input(
        self, inputs: StepInputs, k: int, media: torch.Tensor | None, slots: torch.Tensor | None
    ) -> tuple:
        """Stage 0's input under CP: this rank's tokens, RoPE positions and CP sequence, and the media
        embeddings of its tokens: delivered from the ranks that encoded them (``CPSharding.deliver_media``)
        or, with encoder SP over the CP group, already resharded into its local ``slots``."""
        assert self.cp is not None
        mb, pack, dev = inputs.microbatches[k], inputs.packs[k - 1], self.device
        embeds, rows = None, None
        if self.cp.encoder_sp > 1:
            embeds, rows = media, slots
        elif pack.spans:
            positions = self.cp.rank_positions(inputs.packs, k)
            mine = media if media is not None else torch.zeros(0, self.llm_dim, dtype=self.dtype, device=dev)
            embeds, rows = self.cp.deliver_media(pack, mine, positions)
            rows = rows.to(dev)
        return mb.input_ids.to(dev), mb.position_ids.to(dev), self.cp.sequence(pack), embeds, rows

    def _undecodable(self, fs: FilteredStep) -> frozenset[tuple[int, int]]:
        """``(pack, sample)`` whose payload failed to decode on any rank of this pipeline: only the rank
        that ran the sample's encoder microbatch knows, the last stage needs it (labels), every stage
        needs the count (the step's targets)."""
        offsets = [0]
        for p in fs.packs:
            offsets.append(offsets[-1] + len(p.samples))
        flags = torch.zeros(offsets[-1], dtype=torch.int32)
        for p, i in undecodable_samples(fs):
            flags[offsets[p] + i] = 1
        if self.pp_group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.pp_group)
        if self.cp_group is not None:  # CP ranks of a stage decode different shares of the packs
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.cp_group)
        return frozenset(
            (p, i)
            for p in range(len(fs.packs))
            for i in range(len(fs.packs[p].samples))
            if flags[offsets[p] + i]
        )


def undecodable_samples(fs: FilteredStep) -> list[SampleIndex]:
    """``(pack, sample)`` of every payload this rank read whose image/audio body did not decode.

    omni-data's :class:`~omni_data.ZeroRedundancyFilter` keeps such a sample in its pack (every rank
    planned the pack from metadata) with zeros of the metadata's shape and ``Payload.error`` set; it must
    not be trained on (its caption/transcript targets are masked). Only the rank that ran the sample's
    encoder microbatch knows; :meth:`StepBuilder.build` shares the result over the pipeline group. Also
    the generation samples whose image did not decode where their ids were read
    (``FilteredStep.text_errors``: their code targets are masked).
    """
    return sorted(
        {
            idx
            for e, payloads in fs.payloads.items()
            for idx, p in zip(fs.microbatches[e], payloads)
            if p.error is not None
        }
        | set(fs.text_errors)
    )


def _to(mb: LLMMicrobatch, device: torch.device) -> LLMMicrobatch:
    if device.type == "cpu":
        return mb
    return LLMMicrobatch(
        mb.input_ids.to(device),
        mb.position_ids.to(device),
        mb.cu_seqlens.to(device),
        mb.labels.to(device),
        mb.label_modality.to(device),
        mb.spans,
        mb.samples,
    )
