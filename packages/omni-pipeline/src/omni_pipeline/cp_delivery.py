"""Context parallelism of a step's inputs: which tokens of a pack a rank holds, which media it encodes, and
how encoder embeddings reach the CP ranks (DESIGN.md §omni-parallel; MegaScale-Omni § adaptive
resharding and §6.2; ByteScale's hybrid DP/CP). A rank's :class:`CPSharding` caches each pack's layout by
its sample lengths: the loader's thread and the step then plan a pack once.

Two modes, one code path (a pack's *slots* say which ranks run each of its samples; everything else
follows from them through :func:`omni_parallel.local_sequence`):

* **CP** (``ParallelConfig.cp = C``): the C CP ranks of a stage read the same packs; every sample of a
  pack is head-tail sharded over all of them (one CP block ``[0, C)`` over the CP group): rank ``r`` holds
  chunks ``r`` and ``2C - 1 - r`` of every document, with those tokens' in-document positions (RoPE).
* **Hybrid DP/CP** (``CPSpec.hybrid``): the ``dp * cp`` ranks of a stage (its ``dp_cp`` group) read
  one shared stream of packs of ``dp * cp * max_tokens`` tokens; for each pack
  :func:`omni_parallel.plan_hybrid_cp` (one microbatch, ``CPSpec.max_tokens`` tokens per rank) keeps short
  samples whole on single ranks and head-tail shards long ones over an aligned block of the smallest CP
  size that fits. Every rank plans from metadata alone, so every stage and rank agrees; pack ``k`` is
  LLM microbatch ``k`` on every rank, so each pipeline runs the same schedule with the same microbatch
  count (its token counts differ per rank; stage ``s`` rank ``r`` talks to stage ``s + 1`` rank ``r`` and
  both know the count). The CP sub-groups (every aligned block of every CP size,
  :func:`omni_parallel.hybrid_cp_blocks`) are created once, at startup, by ``ParallelState.build``
  (``GroupSpec(hybrid_cp=True)``), with every other group.

Data, zero redundancy (:meth:`CPSharding.share`, :meth:`CPSharding.text_share`, passed to the
zero-redundancy loader): the encoder microbatch slice ``j`` of LLM microbatch ``k`` runs on pipeline rank
``j`` as before; its media samples are split among that pipeline rank's CP ranks. A sample whole on rank
``r`` is encoded by rank ``r`` (its embeddings then need no resharding); the media samples of a CP block
are split over the block's ranks by Karmarkar-Karp on encoder FLOPs. Each payload is therefore read and
decoded once. Text ids are read by the ranks holding the sample's tokens (on the first and last stage):
under plain CP that is every CP rank (each holds two chunks of every document); under hybrid DP/CP a whole
sample's text is read by its one rank.

Media delivery (:meth:`CPSharding.deliver_media`, the CP path of ``omni_parallel.reshard_to_llm``): on
stage 0 each CP rank holds the embeddings it (or its pipeline peers) encoded; for every CP block with
media it writes its rows into a zero buffer of the block's documents, one all-reduce over the block sums
the buffers, and each rank takes its head-tail chunks; embeddings of whole samples go straight to their
rank's rows. Blocks are visited in ``(cp, first)`` order on every rank (collectives of overlapping blocks
never interleave differently), a rank with no media in a block still joins its all-reduce (a microbatch
may hold fewer images than CP ranks).

Long-short SP under CP (``CPSpec.encoder_sp = cp``, plain CP only): :meth:`owners` keeps samples whole,
so it cannot split a long image. Rather than grow a second long-short planner here, the encoders go to
:class:`omni_pipeline.encoder_parallel.EncoderParallel` with
``SequenceLayout(ReshardMode.CP, cp)`` over the CP group, the path Ulysses takes: its layout,
:func:`omni_parallel.cp_layout` of the whole pack, is this class's plain-CP :meth:`local` (one block
``[0, C)`` through :func:`omni_parallel.local_sequence` maps every row to the same pack position;
omni-train's ``test_train_cp_encoder_sp.py`` checks it on every pack), so its outputs are this rank's rows in local-slot order and stage 0
scatters them into its slots; :meth:`deliver_media` and :meth:`share` are not used. Images above
``EncoderParallel.long_threshold`` are split along the sequence over the CP ranks (Ulysses attention in the
ViT), the rest go whole to single CP ranks balanced by encoder FLOPs
(:func:`omni_parallel.plan_long_short`), and the rows reach the head-tail layout by ``reshard_to_llm``'s
CP all-reduce. Every CP rank needs the long images' pixels, so the loader reads whole encoder
microbatches on CP rank 0 and broadcasts them to its CP peers (the zero-redundancy filter's
``tp_group``), as for Ulysses: each payload is still read and decoded once, then sent. Hybrid DP/CP keeps
``encoder_sp`` 1: its CP blocks change per pack, and a fixed SP group cannot follow them.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from omni_data import Modality, Pack, split_encoder_microbatches
from omni_data.zero_redundancy import SampleIndex
from omni_parallel import (
    CPAttention,
    CPSequence,
    HybridCPSlot,
    LocalSequence,
    ParallelState,
    ReshardPlan,
    karmarkar_karp,
    local_sequence,
    plan_hybrid_cp,
    reshard_to_llm,
)
from omni_pipeline.microbatch import IGNORE, MODALITIES, LLMMicrobatch

__all__ = ["CPSharding", "CPSpec", "build_cp_sharding"]

logger = logging.getLogger(__name__)

_CAP_STEPS = 8  # a pack the plan cannot fit is retried with the per-rank cap raised by 1/8, this often


@dataclass
class CPSharding:
    """One rank's CP (or hybrid DP/CP) layout for the run (see the module docstring).

    Attributes:
        size: ranks sharing a pack: ``cp`` (CP) or ``dp * cp`` (hybrid).
        rank: this rank's index among them (CP rank, or dp_cp rank).
        groups: ``{(cp, first): ProcessGroup}`` of the CP blocks this rank belongs to.
        method: attention of the CP blocks.
        microbatches, slices, balance: the loader's encoder microbatch split
            (``omni_data.split_encoder_microbatches``), to know every rank's share of each slice.
        hybrid: plan each pack with ``plan_hybrid_cp`` (else every sample is sharded over all ranks).
        max_tokens: hybrid only: tokens per rank and microbatch.
        attention_len: hybrid only: the plan's cost model (``omni_parallel.hybrid_cp_load``), the sample
            length at which attention costs as much as the rest of the model (about ``6 * dim``).
        raised_caps: hybrid only: packs planned above ``max_tokens`` per rank (see :meth:`_plan`).
        encoder_sp: plain CP only: ``cp`` when the encoders run long-short SP over the CP group (see "Long-short SP under CP" in the module docstring): the loader
            then reads whole encoder microbatches (not :meth:`share`) and the encoder outputs arrive in
            this rank's local layout (not through :meth:`deliver_media`); 1 otherwise.
    """

    size: int
    rank: int
    groups: Mapping[tuple[int, int], dist.ProcessGroup]
    method: CPAttention
    microbatches: int
    slices: int
    balance: bool = True
    hybrid: bool = False
    max_tokens: int = 0
    attention_len: int = 16384
    raised_caps: int = 0
    encoder_sp: int = 1
    _cache: dict[tuple[int, ...], tuple[tuple[HybridCPSlot, ...], LocalSequence]] = field(
        default_factory=dict, repr=False
    )

    # -- layout --------------------------------------------------------------------------------------------
    def _layout(self, pack: Pack) -> tuple[tuple[HybridCPSlot, ...], LocalSequence]:
        key = tuple(pack.seqlens)
        got = self._cache.get(key)
        if got is None:
            slots = (
                self._plan(pack)
                if self.hybrid
                else tuple(HybridCPSlot(i, 0, 0, self.size) for i in range(len(key)))
            )
            got = (slots, local_sequence(key, slots, self.rank))
            if len(self._cache) > 256:  # a step's packs, reused by the loader thread and the step
                self._cache.clear()
            self._cache[key] = got
        return got

    def _plan(self, pack: Pack) -> tuple[HybridCPSlot, ...]:
        """``plan_hybrid_cp`` of one pack. A pack fills its ranks' token caps to within CP padding, so a
        fragmented one may not fit; it is planned with the cap raised by 1/8 (up to ``_CAP_STEPS``
        times), logged and counted in :attr:`raised_caps`: more activation memory that step, same math."""
        cap = self.max_tokens
        for _ in range(_CAP_STEPS):
            try:
                slots = plan_hybrid_cp(pack.seqlens, self.size, cap, attention_len=self.attention_len).slots
            except ValueError:
                cap += -(-self.max_tokens // 8)
                continue
            if cap > self.max_tokens:
                self.raised_caps += 1
                logger.warning(
                    "hybrid DP/CP: samples %s fit %d ranks only at %d tokens per rank (max_tokens %d)",
                    pack.seqlens, self.size, cap, self.max_tokens,
                )  # fmt: skip
            return slots
        raise ValueError(
            f"hybrid DP/CP: a pack of samples {pack.seqlens} does not fit {self.size} ranks even at "
            f"{cap} tokens per rank (max_tokens {self.max_tokens}); raise the tokens per rank"
        )

    def slots(self, pack: Pack) -> tuple[HybridCPSlot, ...]:
        """Which ranks run each sample of ``pack`` (sample order)."""
        return self._layout(pack)[0]

    def local(self, pack: Pack) -> LocalSequence:
        """This rank's tokens of ``pack`` (sources in the pack, positions, segments)."""
        return self._layout(pack)[1]

    def sequence(self, pack: Pack) -> CPSequence:
        """What the LLM's attention layers take for ``pack`` on this rank (``LLMStage``'s ``cu_seqlens``)."""
        segs = self.local(pack).segments
        return CPSequence(
            segs, {(s.cp, s.first): self.groups[(s.cp, s.first)] for s in segs if s.cp > 1}, self.method
        )

    # -- who encodes and who reads what --------------------------------------------------------------------
    def owners(self, packs: list[Pack], items: Sequence[SampleIndex]) -> list[int]:
        """The rank encoding each media sample of one encoder microbatch: a whole sample's own rank; a CP
        block's samples split over the block by Karmarkar-Karp on encoder FLOPs."""
        blocks: dict[tuple[int, int, int], list[int]] = {}
        for j, (p, i) in enumerate(items):
            s = self.slots(packs[p])[i]
            blocks.setdefault((p, s.cp, s.first), []).append(j)
        out = [0] * len(items)
        for (_, cp, first), idx in blocks.items():
            costs = [packs[items[j][0]].samples[items[j][1]].encoder_flops for j in idx]
            for part, members in enumerate(karmarkar_karp(costs, cp)):
                for m in members:
                    out[idx[m]] = first + part
        return out

    def share(self, packs: list[Pack], mbs: dict[int, list[SampleIndex]]) -> dict[int, list[SampleIndex]]:
        """The zero-redundancy loader's ``share``: each encoder microbatch narrowed to this rank's samples."""
        return {
            e: [x for x, o in zip(items, self.owners(packs, items)) if o == self.rank]
            for e, items in mbs.items()
        }

    def text_share(self, packs: list[Pack]) -> set[SampleIndex]:
        """The zero-redundancy loader's ``text_share``: samples with tokens on this rank."""
        return {
            (p, s.sample)
            for p, pack in enumerate(packs)
            for s in self.slots(pack)
            if s.first <= self.rank < s.first + s.cp
        }

    def rank_positions(self, packs: list[Pack], k: int) -> list[list[int]]:
        """``[size]`` lists: the pack positions of the media rows each rank holds for LLM microbatch ``k``
        (from 1), in the order its encoder outputs come: encoder microbatch order, and within one, pack
        position order (``omni_pipeline.encoder_parallel`` returns an encoder microbatch's rows by slot)."""
        mbs = split_encoder_microbatches(packs, self.microbatches, self.slices, balance=self.balance)
        out: list[list[int]] = [[] for _ in range(self.size)]
        for j in range(self.slices):
            items = mbs[(k - 1) * self.slices + j + 1]
            rows: list[list[int]] = [[] for _ in range(self.size)]
            for (p, i), o in zip(items, self.owners(packs, items)):
                rows[o].extend(
                    x
                    for sp in packs[p].spans
                    if sp.sample == i
                    for x in range(sp.start, sp.start + sp.length)
                )
            for o in range(self.size):
                out[o].extend(sorted(rows[o]))
        return out

    # -- model inputs --------------------------------------------------------------------------------------
    def fill_unread(self, pack: Pack, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``ids`` plus zeros for the samples of ``pack`` whose tokens this rank does not hold (hybrid: their
        text was never read here), so the whole pack's tensors can be built before this rank's are taken."""
        held = {i for (q, i) in self.text_share([pack]) if q == 0}
        out = dict(ids)
        for i, s in enumerate(pack.samples):
            if i not in held and s.uid not in out:
                out[s.uid] = torch.zeros(s.text_tokens, dtype=torch.int64)
        return out

    def microbatch(self, mb: LLMMicrobatch, pack: Pack) -> LLMMicrobatch:
        """This rank's tokens of the whole-pack microbatch ``mb``: CP padding is token 0 with no target."""
        local = self.local(pack)
        src = torch.tensor(local.source, dtype=torch.int64)
        take = torch.where(src < 0, mb.num_tokens, src)

        def rows(x: torch.Tensor, fill: int) -> torch.Tensor:
            return torch.cat([x, x.new_full((1,), fill)]).index_select(0, take)

        return LLMMicrobatch(
            input_ids=rows(mb.input_ids, 0),
            position_ids=torch.tensor(local.position, dtype=torch.int64),
            cu_seqlens=mb.cu_seqlens,
            labels=rows(mb.labels, IGNORE),
            label_modality=rows(mb.label_modality, MODALITIES.index(Modality.TEXT)),
            spans=mb.spans,
            samples=mb.samples,
        )

    def deliver_media(
        self, pack: Pack, embeds: torch.Tensor, positions: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder embeddings of one pack to the ranks holding their tokens (see the module docstring).

        Args:
            pack: the pack (LLM microbatch).
            embeds: ``[rows, dim]`` this rank's encoder outputs for the pack, row ``i`` at pack position
                ``positions[self.rank][i]``.
            positions: :meth:`rank_positions` of the pack (every rank's rows).

        Returns:
            ``(media_embeds [M, dim], local_rows int64 [M])``: embeddings for this rank's tokens and their
            rows in its local sequence (differentiable: gradients flow back to every encoding rank).
        """
        local, slots = self.local(pack), self.slots(pack)
        starts = [0]
        for n in pack.seqlens:
            starts.append(starts[-1] + n)

        def sample_of(x: int) -> int:
            return bisect.bisect_right(starts, x) - 1

        mine = positions[self.rank]
        out_e: list[torch.Tensor] = []
        out_rows: list[torch.Tensor] = []
        whole = [j for j, x in enumerate(mine) if slots[sample_of(x)].cp == 1]
        if whole:
            where = {x: r for r, x in enumerate(local.source[: local.segments[0].rows])}
            out_e.append(embeds[whole])
            out_rows.append(torch.tensor([where[mine[j]] for j in whole], dtype=torch.int64))
        for seg in local.segments:
            if seg.cp == 1:
                continue
            docs = [s.sample for s in slots if (s.cp, s.first) == (seg.cp, seg.first)]
            at = {i: seg.cu_seqlens[d] for d, i in enumerate(docs)}  # block offset of each document
            per_rank = [
                [
                    at[sample_of(x)] + x - starts[sample_of(x)]
                    for x in positions[seg.first + b]
                    if sample_of(x) in at
                ]
                for b in range(seg.cp)
            ]
            if not any(per_rank):
                continue
            idx = [j for j, x in enumerate(mine) if sample_of(x) in at]
            part = embeds[idx]
            if torch.is_grad_enabled() and not part.requires_grad:
                # No rows of its own (fewer media than CP ranks: its encoder output has no graph), but its
                # peers' backward all-reduce waits for this rank's: join the graph with an empty leaf.
                part = part.detach().requires_grad_(True)
            plan = ReshardPlan(seg.cu_seqlens[-1], per_rank, cu_seqlens=list(seg.cu_seqlens))
            group = self.groups[(seg.cp, seg.first)]
            rows, filled = reshard_to_llm(part, plan, group, "cp")
            hit = torch.nonzero(filled.cpu()).squeeze(1)
            out_e.append(rows.index_select(0, hit.to(rows.device)))
            out_rows.append(seg.start + hit)
        if not out_e:
            return embeds[:0], torch.zeros(0, dtype=torch.int64)
        return torch.cat(out_e), torch.cat(out_rows)


@dataclass(frozen=True)
class CPSpec:
    """What a rank's :class:`CPSharding` is built from (besides its ``ParallelState``).

    Attributes:
        method: attention of the CP blocks (:class:`omni_parallel.CPAttention`: ``allgather`` or ``ring``).
        hybrid: hybrid DP/CP over the stage's ``dp_cp`` ranks (the ``ParallelState`` must hold the blocks:
            ``GroupSpec(hybrid_cp=True)``); else plain CP over the ``cp`` group.
        max_tokens: hybrid only: LLM tokens per rank and microbatch (the packs hold ``dp * cp`` times it).
        attention_len: hybrid only: the sample length at which attention costs as much as the rest of the
            model (``omni_parallel.hybrid_cp_load``; about ``6 * hidden``).
        microbatches, slices, balance: the loader's encoder microbatch split (LLM microbatches per step,
            encoder microbatches per LLM microbatch: the pipeline size, Karmarkar-Karp balancing;
            ``omni_data.split_encoder_microbatches``).
        encoder_sp: 1, or (plain CP only) ``cp``: the encoders run long-short SP over the CP group.

    Raises:
        ValueError: an unknown ``method``; a count below 1 (``max_tokens``: below 0, or below 1 under
            ``hybrid``) or not an int; a flag not a bool; ``encoder_sp`` > 1 under ``hybrid``.
    """

    method: CPAttention | str = CPAttention.ALLGATHER
    hybrid: bool = False
    max_tokens: int = 0
    attention_len: int = 16384
    microbatches: int = 1
    slices: int = 1
    balance: bool = True
    encoder_sp: int = 1

    def __post_init__(self) -> None:
        methods = [str(m) for m in CPAttention]
        if self.method not in methods:
            raise ValueError(f"CPSpec.method must be one of {methods}, got {self.method!r}")
        for name in ("attention_len", "microbatches", "slices", "encoder_sp", "max_tokens"):
            value, least = getattr(self, name), int(name != "max_tokens")
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"CPSpec.{name} must be an int, got {value!r}")
            if value < least:
                raise ValueError(f"CPSpec.{name} must be >= {least}, got {value!r}")
        for name in ("hybrid", "balance"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CPSpec.{name} must be a bool, got {getattr(self, name)!r}")
        if self.hybrid and self.encoder_sp != 1:
            raise ValueError(f"CPSpec.encoder_sp must be 1 under hybrid DP/CP, got {self.encoder_sp!r}")
        if self.hybrid and self.max_tokens < 1:
            raise ValueError(f"CPSpec.max_tokens must be >= 1 under hybrid DP/CP, got {self.max_tokens!r}")


def build_cp_sharding(ps: ParallelState, spec: CPSpec) -> CPSharding | None:
    """This rank's :class:`CPSharding` (``None`` without CP: ``cp`` 1 and not hybrid). Creates no group:
    hybrid DP/CP takes its blocks from ``ps.hybrid_cp_groups``, plain CP the ``cp`` group.

    Raises:
        ValueError: ``spec.encoder_sp`` neither 1 nor ``cp``, or > 1 with ``hybrid``; ``hybrid`` with a
            ``ParallelState`` built without ``GroupSpec(hybrid_cp=True)``, or with a ``dp_cp`` group of one
            rank.
    """
    cp = ps.size("cp")
    if spec.encoder_sp != 1 and (spec.hybrid or spec.encoder_sp != cp):
        raise ValueError(
            f"encoder_sp {spec.encoder_sp}: must be 1 or, under plain CP (not hybrid DP/CP), the CP size {cp}"
        )
    method = CPAttention(spec.method)
    common = dict(method=method, microbatches=spec.microbatches, slices=spec.slices, balance=spec.balance)
    if spec.hybrid:
        if not ps.spec.hybrid_cp:
            raise ValueError(
                "hybrid DP/CP needs the CP blocks: build the ParallelState with GroupSpec(hybrid_cp=True)"
            )
        size, rank = ps.size("dp_cp"), ps.local_rank("dp_cp")
        if size < 2:
            raise ValueError(
                f"hybrid DP/CP needs dp * cp >= 2 ranks per stage to share packs, got dp {ps.size('dp')} "
                f"x cp {cp}"
            )
        return CPSharding(
            size,
            rank,
            dict(ps.hybrid_cp_groups),
            hybrid=True,
            max_tokens=spec.max_tokens,
            attention_len=spec.attention_len,
            **common,
        )
    if cp > 1:
        groups = {(cp, 0): ps.group("cp")}
        return CPSharding(cp, ps.local_rank("cp"), groups, encoder_sp=spec.encoder_sp, **common)
    return None
