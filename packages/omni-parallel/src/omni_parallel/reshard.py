"""Adaptive resharding of encoder outputs to LLM ranks (§ adaptive resharding, Figure 12).

Encoder ranks produce embedding rows for arbitrary token positions of an LLM pack (where their
samples sit). LLM ranks need them in their sequence-parallel layout:

- Ulysses: LLM rank ``s`` holds the contiguous slice ``[s * T / sp, (s + 1) * T / sp)``. One
  ``all_to_all_single`` with split sizes moves every row straight to its owner (symmetric when the
  encoder work is uniformly sharded, as the paper arranges).
- CP: ownership is head-tail per document, so an all-to-all would be asymmetric. Instead each rank
  writes its rows into a reused zero buffer of the whole pack, one all-reduce sums the buffers, and each
  rank takes its head-tail chunks (:mod:`omni_parallel.context_parallel`).

Both are differentiable; gradients flow back to the encoder ranks by the adjoint collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch
import torch.distributed as dist

from omni_parallel.comm import all_to_all_dim0
from omni_parallel.context_parallel import cp_layout
from omni_parallel.varlen import as_cu_seqlens

__all__ = ["ReshardMode", "ReshardPlan", "reshard_to_llm"]


class ReshardMode(StrEnum):
    ULYSSES = "ulysses"
    CP = "cp"


@dataclass
class ReshardPlan:
    """Which pack positions each rank's embedding rows fill. Every rank holds the same plan.

    Attributes:
        pack_len: tokens in the LLM pack (``T``).
        positions: ``[group_size]`` lists: row ``i`` of rank ``r``'s embeddings goes to pack position
            ``positions[r][i]``. Positions are distinct across all ranks; positions nobody fills (text
            tokens) come out as zero rows with ``filled`` False.
        cu_seqlens: ``[docs + 1]`` document boundaries of the pack; needed for CP (head-tail chunks).
        staging: flat memory the CP buffer is a view of (see :meth:`buffer`): pass the previous plan's
            ``staging`` to reuse it for the next pack (grown when too small); ``None``: allocated on use.

    Raises (on construction):
        ValueError: ``pack_len`` negative, a position not an integer, out of range or filled twice
            (names the rank and row), or ``cu_seqlens`` not ending at ``pack_len``.
    """

    pack_len: int
    positions: list[list[int]]
    cu_seqlens: Sequence[int] | None = None
    # Staging memory, not part of the plan's value: excluded from ==, which would compare tensors.
    staging: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.pack_len, int) or isinstance(self.pack_len, bool) or self.pack_len < 0:
            raise ValueError(f"ReshardPlan.pack_len must be an int >= 0, got {self.pack_len!r}")
        seen: dict[int, tuple[int, int]] = {}
        for r, rows in enumerate(self.positions):
            for i, p in enumerate(rows):
                if isinstance(p, bool) or not hasattr(p, "__index__"):
                    raise ValueError(f"positions[{r}][{i}] = {p!r} is not an int pack position")
                if not 0 <= p < self.pack_len:
                    raise ValueError(
                        f"positions[{r}][{i}] = {p} is outside the pack of {self.pack_len} tokens"
                    )
                if p in seen:
                    raise ValueError(
                        f"pack position {p} is filled by rank {seen[p][0]} row {seen[p][1]} and rank {r} row {i}"
                    )
                seen[p] = (r, i)
        if self.cu_seqlens is not None:
            as_cu_seqlens(self.cu_seqlens, self.pack_len)

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        """The ``[pack_len, hidden]`` CP staging buffer, zeroed: a view of :attr:`staging` (reused across
        calls and across plans that share it; reallocated only when too small or of another dtype or
        device)."""
        shape = (self.pack_len, *like.shape[1:])
        n = 1
        for d in shape:
            n *= d
        b = self.staging
        if b is None or b.numel() < n or b.dtype != like.dtype or b.device != like.device:
            b = self.staging = like.new_zeros(max(n, 1))
        view = b[:n].view(shape)
        view.zero_()
        return view


def _ulysses(
    embeds: torch.Tensor, plan: ReshardPlan, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    if plan.pack_len % sp:
        raise ValueError(f"Ulysses resharding: pack of {plan.pack_len} tokens does not split over {sp} ranks")
    t = plan.pack_len // sp
    device = embeds.device

    def by_owner(rows: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(sp)]
        for i, p in enumerate(rows):
            out[p // t].append(i)
        return out

    mine = by_owner(plan.positions[rank])
    send_rows = torch.tensor([i for rows in mine for i in rows], dtype=torch.int64, device=device)
    in_splits = [len(rows) for rows in mine]
    # What each source rank sends me, in its row order: known from the shared plan, no size exchange.
    incoming = [[plan.positions[r][i] for i in by_owner(plan.positions[r])[rank]] for r in range(sp)]
    out_splits = [len(x) for x in incoming]
    recv = all_to_all_dim0(
        embeds.index_select(0, send_rows), group, in_splits=in_splits, out_splits=out_splits
    )
    local_pos = torch.tensor([p - rank * t for x in incoming for p in x], dtype=torch.int64, device=device)
    out = embeds.new_zeros((t, *embeds.shape[1:])).index_copy(0, local_pos, recv)
    filled = torch.zeros(t, dtype=torch.bool, device=device)
    filled[local_pos] = True
    return out, filled


class _ReshardCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, embeds, rows, take, buffer, group):  # type: ignore[override]
        ctx.save_for_backward(rows, take)
        ctx.group, ctx.pack = group, buffer.shape
        buffer.index_copy_(0, rows, embeds)
        dist.all_reduce(buffer, group=group)  # disjoint rows: the sum is the whole pack
        padded = torch.cat([buffer, buffer.new_zeros((1, *buffer.shape[1:]))])
        return padded.index_select(0, take)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        rows, take = ctx.saved_tensors
        full = grad.new_zeros((ctx.pack[0] + 1, *ctx.pack[1:])).index_add_(0, take, grad)[:-1].contiguous()
        # Adjoint of "all-reduce then take": scatter-add, all-reduce, then read my rows.
        dist.all_reduce(full, group=ctx.group)
        return full.index_select(0, rows), None, None, None, None


def _cp(
    embeds: torch.Tensor, plan: ReshardPlan, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    if plan.cu_seqlens is None:
        raise ValueError("CP resharding needs plan.cu_seqlens (head-tail chunks are per document)")
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = cp_layout(plan.cu_seqlens, cp)
    device = embeds.device
    rows = torch.tensor(plan.positions[rank], dtype=torch.int64, device=device)
    src = torch.tensor(layout.source[rank], dtype=torch.int64, device=device)
    take = torch.where(src < 0, plan.pack_len, src)
    out = _ReshardCP.apply(embeds, rows, take, plan.buffer(embeds), group)
    filled_all = torch.zeros(plan.pack_len + 1, dtype=torch.bool, device=device)
    filled_all[[p for rows_r in plan.positions for p in rows_r]] = True
    return out, filled_all[take]


def reshard_to_llm(
    embeds: torch.Tensor,
    plan: ReshardPlan,
    group: dist.ProcessGroup,
    mode: ReshardMode | str = ReshardMode.ULYSSES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move this rank's encoder embeddings to the LLM ranks' sequence-parallel layout.

    Args:
        embeds: ``[rows, hidden]``: row ``i`` belongs at pack position ``plan.positions[rank][i]``.
        plan: the shared :class:`ReshardPlan`.
        group: the LLM sequence-parallel group (Ulysses or CP), ranks in ``plan.positions`` order.
        mode: ``"ulysses"`` (contiguous slices, one all-to-all) or ``"cp"`` (head-tail chunks,
            reused buffer + one all-reduce).

    Returns:
        ``(local, filled)``: ``local`` ``[tokens_local, hidden]`` this rank's LLM tokens (zero rows
        where no encoder filled them; for CP, padding rows too), ``filled`` ``[tokens_local]`` bool.

    Raises:
        ValueError: ``embeds`` rows disagree with the plan, the group size disagrees with it, or the
            mode is unknown.
    """
    mode = ReshardMode(mode)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(plan.positions) != n:
        raise ValueError(f"plan has positions for {len(plan.positions)} ranks, the group has {n}")
    if embeds.shape[0] != len(plan.positions[rank]):
        raise ValueError(
            f"rank {rank}: embeds has {embeds.shape[0]} rows, the plan gives it {len(plan.positions[rank])}"
        )
    return _ulysses(embeds, plan, group) if mode is ReshardMode.ULYSSES else _cp(embeds, plan, group)
