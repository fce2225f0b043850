"""Encoder parallelism: grouped reordering across DP replicas, long-short sequence
parallelism over the stage's LLM sequence group, and delivery of encoder outputs into the LLM's
sequence-parallel layout (MegaScale-Omni §4.1 decoupled parallelism, §5.1 decentralised grouped
reordering, Figure 11, §5.3 adaptive resharding, Figure 12).

Encoder microbatch ``e`` is slice ``j`` of LLM microbatch ``k`` and runs on pipeline rank ``j`` of every
DP replica at the same point of the (identical) schedules. On the ranks ``(d, j, u)`` (DP replica ``d``,
LLM sequence-parallel rank ``u``; TP ranks repeat the same work), one encoder microbatch goes through:

1. **Read** (zero redundancy, before the exchange): replica ``d``'s loader on pipeline rank ``j`` decodes
   exactly the payloads of its own slice ``j`` (TP/SP rank 0 reads, its TP or SP peers get a broadcast:
   ``omni_data.ZeroRedundancyFilter``); no rank decodes a payload another rank of its replica decodes.
2. **Reorder across DP** (:class:`omni_data.GroupedReorderer`, before the step, collective over the
   reordering group: ``ParallelState.reorder_group``, ``GroupSpec.reorder_group_size`` consecutive DP
   replicas at this ``(j, u)``, by default those of one node): all-gather
   every member's sample metadata and costs, Karmarkar-Karp them into one part per replica, check the
   plan hash (a mismatch raises on every rank before any payload moves) and move the payloads with one
   all-to-all. Replica ``d`` then encodes the samples ``R_d`` the plan gives it, from any replica. The
   SP ranks of a replica plan from identical metadata, so they all hold the same ``R_d``.
3. **Long-short SP** (:func:`omni_parallel.plan_long_short` over the SP group of ``(d, j)``, which is the
   stage's LLM sequence group, Ulysses or CP): images and videos of ``R_d`` with more than
   ``long_threshold`` merged tokens (with ``encoder_sp`` > 1) form one packed sequence cut into ``sp``
   equal chunks, encoded with Ulysses attention inside the ViT (2-D RoPE rows and columns of each chunk's
   own patches; a video's temporal slices stay separate attention documents); the other
   samples (audio always: its convolution stem would need halo exchange) go whole to single SP ranks,
   balanced by encoder FLOPs. No sample is encoded twice.
4. **Restore** (differentiable): rows go back to the replica whose pack they belong to with one
   all-to-all in the reordering group at fixed ``u`` (``ReorderPlan.restore`` with the rows each rank
   holds), so ``(d, j, u)`` holds the rows of replica ``d``'s samples that SP position ``u`` encoded.
5. **Reshard to the LLM layout** (:func:`omni_parallel.reshard_to_llm` in the SP group of ``(d, j)``):
   Ulysses, one all-to-all; CP, the reused zero buffer of the whole pack and one all-reduce (Figure 12).
   SP rank ``u`` then holds exactly the rows LLM SP rank ``u`` of stage 0 needs (its chunk's media
   positions, in slot order), and the executor sends them ``(d, j, u) -> (d, 0, u)`` with shapes planned
   from metadata on both sides.

The backward runs the same collectives in reverse (each one's adjoint) inside the encoder backward; a
rank that holds no rows still joins every collective its groups run for ``e`` (its empty rows are made
part of the autograd graph), and whether a group runs one is decided from metadata every member holds,
so collectives always match. Without SP, reordering or both, the steps collapse to local permutations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from omni_data import GroupedReorderer, Modality, Pack, ReorderPlan
from omni_data.payload import Payload
from omni_data.zero_redundancy import FilteredStep, SampleIndex
from omni_parallel import LongShortPlan, ReshardMode, ReshardPlan, plan_long_short
from omni_parallel.context_parallel import cp_layout
from omni_parallel.reshard import reshard_to_llm

__all__ = ["EncoderParallel", "EncoderWork", "SequenceLayout"]


@dataclass(frozen=True)
class SequenceLayout:
    """Which pack positions each rank of the LLM's sequence-parallel group holds.

    Attributes:
        mode: ``ulysses`` (rank ``u`` holds the contiguous chunk ``[u t, (u + 1) t)`` of the pack padded
            to ``t * size`` tokens), ``cp`` (head-tail chunks per document,
            :func:`omni_parallel.cp_layout`), or ``None`` (no sequence parallelism, ``size`` 1).
        size: the group size.
    """

    mode: ReshardMode | None = None
    size: int = 1

    def sources(self, pack: Pack) -> list[list[int]]:
        """``[size][local slots]``: the pack position each local slot of each rank holds (-1: padding)."""
        t = pack.num_tokens
        if self.mode is ReshardMode.CP:
            return [list(s) for s in cp_layout(_pack_cu(pack), self.size).source]
        local = -(-t // self.size)
        return [[p if p < t else -1 for p in range(u * local, (u + 1) * local)] for u in range(self.size)]

    def pack_len(self, pack: Pack) -> int:
        """The ``ReshardPlan.pack_len`` of ``pack`` (Ulysses: padded to a multiple of ``size``)."""
        t = pack.num_tokens
        return -(-t // self.size) * self.size if self.mode is ReshardMode.ULYSSES else t

    def slots(self, pack: Pack, positions: Sequence[int], rank: int) -> list[int]:
        """Local slots of ``rank`` holding any of ``positions``, in slot order."""
        want = set(positions)
        return [i for i, p in enumerate(self.sources(pack)[rank]) if p in want]


def _pack_cu(pack: Pack) -> list[int]:
    cu = [0]
    for n in pack.seqlens:
        cu.append(cu[-1] + n)
    return cu


@dataclass
class EncoderWork:
    """What this rank runs for encoder microbatch ``e`` (planned before the step from metadata; the
    payload exchange of step 2 is already done).

    Attributes:
        e: the encoder microbatch.
        pack: the pack of its LLM microbatch (metadata).
        short: payloads this rank encodes whole, in production order.
        long: the long images of this rank's SP group (the same on every SP rank), packed in this order;
            empty: no long-short split.
        index: rows of the encoders' output (``short`` rows, then this rank's chunk) in sample order
            (each sample's piece at this SP position; the chunk's padding rows left out).
        reorder: the reordering plan (``None``: no reordering across DP).
        held: ``held[d][k]`` rows SP position ``u`` of group replica ``d`` holds of the ``k``-th sample
            that replica encodes (``ReorderPlan.restore``'s table).
        any_in_group / any_in_replica: some replica of the reordering group / this replica has samples
            in ``e`` (every member of the group knows both from metadata).
        positions: ``[sp][rows]`` pack positions of the rows each SP rank of this replica holds after the
            restore (the ``ReshardPlan``).
        slots: this rank's LLM-local slots of ``e``'s media positions, in slot order (``[rows_out]``).
        select: rows of the resharded (SP) or restored (no SP) rows that fill ``slots``, in slot order.
        flops_before / flops_after: modelled encoder FLOPs this rank runs for ``e`` without / with the
            reordering across DP (the long-short split over SP applied to both).
        bytes_sent: payload bytes this rank's exchange sent to other replicas.
    """

    e: int
    pack: Pack
    short: list[Payload] = field(default_factory=list)
    long: list[Payload] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    reorder: ReorderPlan | None = None
    held: list[list[int]] = field(default_factory=list)
    any_in_group: bool = False
    any_in_replica: bool = False
    positions: list[list[int]] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    select: list[int] = field(default_factory=list)
    flops_before: float = 0.0
    flops_after: float = 0.0
    bytes_sent: int = 0


class EncoderParallel:
    """Plans and runs encoder microbatches over this rank's encoder groups (see the module docstring).

    Args:
        layout: the LLM's sequence-parallel layout (mode and size).
        sp_group, sp_rank: the stage's LLM sequence group (Ulysses or CP), which the encoders share;
            ``None`` / 0 without SP.
        encoder_sp: 1 (samples are never split) or ``layout.size`` (long images are split over the group).
        long_threshold: merged tokens above which an image is long.
        reorder_group: the reordering group across DP (``None``: no reordering across DP).

    Raises:
        ValueError: ``encoder_sp`` neither 1 nor the layout's size.
    """

    def __init__(
        self,
        layout: SequenceLayout,
        *,
        sp_group: dist.ProcessGroup | None = None,
        sp_rank: int = 0,
        encoder_sp: int = 1,
        long_threshold: int = 8192,
        reorder_group: dist.ProcessGroup | None = None,
    ) -> None:
        if encoder_sp not in (1, layout.size):
            raise ValueError(
                f"encoder_sp {encoder_sp} must be 1 or the LLM sequence-parallel size {layout.size}"
            )
        self.layout, self.sp_group, self.sp_rank = layout, sp_group, sp_rank
        self.encoder_sp, self.long_threshold = encoder_sp, long_threshold
        self.reorder_group = reorder_group
        self.reorderer = GroupedReorderer(reorder_group) if reorder_group is not None else None
        self._staging: torch.Tensor | None = None

    # -- planning (before the step) ----------------------------------------------------------------------
    def slots(self, packs: Sequence[Pack], items: Sequence[SampleIndex]) -> list[int]:
        """This rank's LLM-local slots of the media of ``items`` (one pack's samples), in slot order: where
        stage 0 puts encoder microbatch's rows, and how many rows it receives."""
        if not items:
            return []
        pack = packs[items[0][0]]
        return self.layout.slots(pack, _positions(pack, [i for _, i in items]), self.sp_rank)

    def plan(self, fs: FilteredStep, e: int, pack_index: int) -> EncoderWork:
        """The work of encoder microbatch ``e`` (of pack ``pack_index``) on this rank; collective over the
        reordering group (metadata all-gathers, hash check, payload all-to-all) when there is one.

        Raises:
            omni_data.PlanMismatchError: the reordering group's ranks computed different plans.
            ValueError: ``e`` holds samples of another pack.
        """
        pack = fs.packs[pack_index]
        items = fs.microbatches.get(e, [])
        if any(p != pack_index for p, _ in items):
            raise ValueError(f"encoder microbatch {e} holds samples of several packs: {items}")
        own = [s for _, s in items]
        metas = [pack.samples[s] for s in own]
        payloads = fs.payloads.get(e, [])
        sp, u = self.layout.size, self.sp_rank
        work = EncoderWork(e, pack, slots=self.slots(fs.packs, items), any_in_replica=bool(own))
        before = self._long_short(metas)
        work.flops_before = _load(before, metas, u)
        spans = _spans(pack, own)
        if self.reorderer is None:
            mine, work.any_in_group = payloads, bool(own)

            def piece(i: int, v: int) -> tuple[int, int]:
                return _piece(before, metas, i, v)

        else:
            plan = self.reorderer.plan(metas)
            received = plan.dispatch([_payload_tensor(p) for p in payloads], dtype=torch.float32)
            mine = [_rebuild(plan.metas[r][i], x) for (r, i), x in zip(plan.received, received)]
            work.reorder, work.bytes_sent = plan, plan.bytes_sent
            work.any_in_group = any(plan.dest)
            sets = [[plan.metas[r][i] for r, i in plan.received_by(d)] for d in range(len(plan.dest))]
            plans = [self._long_short(ms) for ms in sets]
            work.held = [
                [b - a for a, b in (_piece(ls, ms, k, u) for k in range(len(ms)))]
                for ls, ms in zip(plans, sets)
            ]

            def piece(i: int, v: int) -> tuple[int, int]:
                d = plan.dest[plan.rank][i]
                return _piece(plans[d], sets[d], plan.received_by(d).index((plan.rank, i)), v)

        # Pack positions of the rows SP position v holds of this replica's samples once restored:
        # sample by sample in this replica's order, each its piece encoded at v.
        for v in range(sp):
            work.positions.append([spans[s] + t for i, s in enumerate(own) for t in range(*piece(i, v))])
        ls = self._long_short([p.meta for p in mine])
        work.flops_after = _load(ls, [p.meta for p in mine], u)
        self._production(work, mine, ls)
        if sp > 1:
            work.select = list(work.slots)  # reshard_to_llm returns this rank's whole chunk, slot order
        else:
            where = {p: i for i, p in enumerate(work.positions[0])}
            work.select = [where[p] for p in sorted(work.positions[0])]
        return work

    def _long_short(self, metas: Sequence) -> LongShortPlan | None:
        if self.layout.size == 1:
            return None
        return plan_long_short(
            [m.media_tokens for m in metas],
            self.layout.size,
            self.long_threshold,
            self.layout.size,
            costs=[m.encoder_flops for m in metas],
            splittable=[self.encoder_sp > 1 and m.modality in _SPLITTABLE for m in metas],
        )

    def _production(self, work: EncoderWork, mine: list[Payload], ls: LongShortPlan | None) -> None:
        """What this rank feeds the encoders (``short`` whole, then its chunk of ``long``) and the
        permutation of their output rows into sample order (``mine``'s order, each sample's piece here;
        a chunk's padding rows left out)."""
        u = self.sp_rank
        if ls is None:
            work.short = list(mine)
            work.index = list(range(sum(p.meta.media_tokens for p in mine)))
            return
        long_ids = list(ls.long_samples)
        work.long = [mine[k] for k in long_ids]
        shorts = [pc.sample for pc in ls.pieces[u] if pc.sample not in ls.long_group]
        work.short = [mine[k] for k in shorts]
        # output row of every (sample, merged token) this rank produces
        row: dict[int, list[int]] = {}
        at = 0
        for k in shorts:
            row[k] = list(range(at, at + mine[k].meta.media_tokens))
            at += mine[k].meta.media_tokens
        if long_ids:
            cu = ls.long_cu_seqlens[0]
            chunk = cu[-1] // self.layout.size
            start = {k: cu[j] for j, k in enumerate(long_ids)}
            for pc in ls.pieces[u]:
                if pc.sample in ls.long_group:
                    lo = at + start[pc.sample] + pc.start - u * chunk
                    row[pc.sample] = list(range(lo, lo + pc.tokens))
        work.index = [r for k in sorted(row) for r in row[k]]

    # -- running (inside the step: the encoder forward of ``e``) ----------------------------------------
    def encode(self, encoders: torch.nn.Module, work: EncoderWork, dtype: torch.dtype) -> torch.Tensor:
        """``[len(work.slots), llm_dim]``: the rows LLM SP rank ``u`` of stage 0 needs from ``e``, in slot
        order (collective over this rank's SP and reordering groups when they run one for ``e``).

        ``encoders(payloads, long)`` returns ``[rows, llm_dim]``: each payload's rows in the given order,
        then, with ``long = (images, sp_group)``, this rank's ``ceil(L / sp)`` rows of the long images'
        ``L`` packed rows (a :class:`omni_pipeline.towers.ModalityRouter` over the towers)."""
        long = (work.long, self.sp_group) if work.long else None
        out = encoders(work.short, long).to(dtype)
        rows = out.index_select(0, torch.tensor(work.index, dtype=torch.int64, device=out.device))
        if work.reorder is not None:
            if not work.any_in_group:
                return rows[:0]
            rows = work.reorder.restore(_joined(rows), held=work.held)
        if not work.any_in_replica:
            return rows[:0]
        if self.layout.size > 1:
            # CP: every encoder microbatch stages its pack in the same reused zero buffer (Figure 12).
            cu = _pack_cu(work.pack) if self.layout.mode is ReshardMode.CP else None
            plan = ReshardPlan(self.layout.pack_len(work.pack), work.positions, cu, staging=self._staging)
            rows, _ = reshard_to_llm(_joined(rows), plan, self.sp_group, self.layout.mode)
            self._staging = plan.staging
        return rows.index_select(0, torch.tensor(work.select, dtype=torch.int64, device=rows.device))


def _joined(x: torch.Tensor) -> torch.Tensor:
    """``x`` as part of the autograd graph even when nothing this rank computed requires grad (no rows
    here): the collective it feeds then runs its adjoint in backward on this rank too."""
    if torch.is_grad_enabled() and not x.requires_grad:
        return x.detach().requires_grad_(True)
    return x


def _positions(pack: Pack, samples: Sequence[int]) -> list[int]:
    spans = _spans(pack, samples)
    return [spans[s] + t for s in samples for t in range(pack.samples[s].media_tokens)]


def _spans(pack: Pack, samples: Sequence[int]) -> dict[int, int]:
    want = set(samples)
    return {sp.sample: sp.start for sp in pack.spans if sp.sample in want}


def _load(ls: LongShortPlan | None, metas: Sequence, u: int) -> float:
    """Modelled encoder FLOPs SP position ``u`` runs of ``metas`` (all of them without SP)."""
    return ls.loads[u] if ls is not None else float(sum(m.encoder_flops for m in metas))


def _piece(ls: LongShortPlan | None, metas: Sequence, k: int, v: int) -> tuple[int, int]:
    """Merged-token range ``[a, b)`` of sample ``k`` that SP position ``v`` encodes (empty: none)."""
    if ls is None:
        return (0, metas[k].media_tokens) if v == 0 else (0, 0)
    for pc in ls.pieces[v]:
        if pc.sample == k:
            return pc.start, pc.end
    return 0, 0


# Samples long-short SP may split over the SP group: images and videos (the ViT chunks a packed sequence
# of images' and clips' patches, 2-D RoPE per temporal slice; omni_train.models.vit). Audio never: its
# convolution stem would need halo exchange.
_SPLITTABLE = (Modality.IMAGE, Modality.VIDEO)


def _payload_tensor(p: Payload) -> torch.Tensor:
    """The tensor the reordering moves: pixels ``[3, H, W]``, video frames ``[T, 3, H, W]`` or waveform
    ``[num_samples]`` (the metadata's ``shape``).

    Raises:
        ValueError: the payload has no decoded tensor of its modality.
    """
    m = p.meta.modality
    x = p.pixels if m is Modality.IMAGE else p.frames if m is Modality.VIDEO else p.waveform
    if x is None:
        raise ValueError(f"sample {p.meta.uid}: no decoded {m} payload to move")
    return x


def _rebuild(meta, x: torch.Tensor) -> Payload:
    """The moved tensor as the payload of ``meta`` (the inverse of :func:`_payload_tensor`)."""
    if meta.modality is Modality.IMAGE:
        return Payload(meta, pixels=x)
    if meta.modality is Modality.VIDEO:
        return Payload(meta, frames=x)
    return Payload(meta, waveform=x, sample_rate=meta.sample_rate)
