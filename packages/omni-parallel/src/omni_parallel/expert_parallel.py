"""Expert parallelism: token dispatch to the ranks holding their experts and combine back, over
``all_to_all_single`` on the EP group (communication only; the layer itself is :class:`omni_parallel.moe.MoE`).

The EP group of size ``ep`` shards ``E`` experts contiguously: rank ``r`` holds experts
``[r * E/ep, (r+1) * E/ep)``. One MoE forward on each rank:

1. the caller sorts its ``N`` (token, slot) rows by global expert (``counts [E]`` per expert); expert
   ownership is contiguous, so the rows are also grouped by destination rank;
2. :func:`dispatch` exchanges the per-expert counts (an all-to-all of ``[ep, E/ep]`` int64), then the rows
   (a differentiable all-to-all with the split sizes the counts give), and permutes the received rows from
   (source rank, local expert) order into (local expert, source rank) order, so each local expert's rows
   are contiguous for :class:`omni_parallel.moe.GroupedExperts`;
3. :func:`combine` undoes the permutation and sends every row back to its source (the reverse
   all-to-all), in the caller's sorted order.

Both all-to-alls are autograd functions whose backward is the reverse all-to-all of the gradients
(dispatch's backward sends row gradients back to the sources, combine's to the expert ranks). Dropless:
every row is sent, whatever the imbalance (a rank may receive nothing, or all rows of the group). A capacity
(:attr:`omni_parallel.moe.MoEConfig.capacity_factor`) is applied by the caller before dispatch, on its own
rows: per sending rank, so an expert may receive up to ``ep x capacity`` rows from the group.

Host syncs: one per dispatch, the all-to-all's split sizes (``send`` / ``recv``, read from the exchanged
counts in one ``tolist``; ``all_to_all_single`` takes them as Python ints). The permutation to expert-major
order is built on the device (``repeat_interleave``), without further syncs.

Source: the layout of Megatron-Core ``MoEAlltoAllTokenDispatcher`` and torchtitan's
``ExpertParallel`` (``_token_dispatch`` / ``_token_combine``); the separation of communication from the
module follows picotron.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

__all__ = ["ALL_TO_ALL", "DispatchPlan", "all_to_all", "combine", "dispatch"]

# The profiler label of every token all-to-all (forward and backward; the count exchange is apart), so a
# trace (omni-train --profile) names the time spent in them.
ALL_TO_ALL = "omni_parallel.ep_all_to_all"


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with explicit split sizes; backward is the reverse all-to-all."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        with record_function(ALL_TO_ALL):
            dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        with record_function(ALL_TO_ALL):
            dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0.

    Args:
        x: ``[sum(send), ...]``; rows ``send[:j]`` .. go to group rank ``j``.
        send: rows sent to each group rank (``ep`` ints). recv: rows received from each (``ep`` ints).
        group: the group (collective: every member calls it with matching sizes).

    Returns:
        ``[sum(recv), ...]``, the rows of group rank ``j`` at ``recv[:j]``. Backward: the reverse
        all-to-all of the gradient (``send`` and ``recv`` swapped).
    """
    return _AllToAll.apply(x, list(send), list(recv), group)


@dataclass(frozen=True)
class DispatchPlan:
    """What :func:`combine` needs to send rows back.

    Attributes:
        group: the EP group.
        send: rows this rank sent to each EP rank (``ep`` ints). recv: rows it received from each.
        local_counts: ``[E/ep]`` int64 rows received per local expert (all sources).
        order: ``[sum(recv)]`` int64: row ``i`` of the expert-major layout is received row ``order[i]``.
    """

    group: dist.ProcessGroup
    send: list[int]
    recv: list[int]
    local_counts: torch.Tensor
    order: torch.Tensor


def dispatch(
    rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, DispatchPlan]:
    """Send rows sorted by global expert to the EP ranks holding their experts.

    Args:
        rows: ``[N, dim]`` sorted by global expert id (contiguous per expert).
        counts: ``[E]`` int rows per global expert (``sum == N``); ``E`` divisible by the group size.
        group: the EP group (collective).

    Returns:
        ``(received, plan)``: ``received [M, dim]`` the rows for this rank's ``E/ep`` experts, contiguous
        per local expert (``plan.local_counts``), within an expert in source-rank order; ``plan`` for
        :func:`combine`.

    Raises:
        ValueError: ``E`` not divisible by the group size, or ``counts`` not summing to ``N``.
    """
    ep = dist.get_world_size(group)
    experts = counts.numel()
    if experts % ep:
        raise ValueError(f"{experts} experts are not divisible by the EP group size {ep}")
    local = experts // ep
    # 1. counts: recv_counts[s, l] = rows source s sends to local expert l of this rank
    send_counts = counts.to(torch.int64).reshape(ep, local).contiguous()
    recv_counts = torch.empty_like(send_counts)
    with record_function(ALL_TO_ALL + "_counts"):
        dist.all_to_all_single(recv_counts, send_counts, group=group)
    # the one host sync: the split sizes (and the check of counts against rows)
    sizes_host = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()
    send, recv = sizes_host[:ep], sizes_host[ep:]
    if sum(send) != rows.shape[0]:
        raise ValueError(f"counts sum to {sum(send)}, rows has {rows.shape[0]}")
    # 2. rows, in (source, local expert) order
    received = all_to_all(rows, send, recv, group)
    # 3. permute to (local expert, source) order: chunk (s, l) starts at start[s, l] in `received`; in
    # expert-major order, row i of chunk (l, s) is received row start[s, l] + (i - its chunk's offset)
    m = sum(recv)
    sizes = recv_counts.reshape(-1)
    start = torch.cumsum(sizes, 0) - sizes
    major_sizes = recv_counts.t().reshape(-1)  # chunk (l, s) in expert-major order
    major_start = start.reshape(ep, local).t().reshape(-1)
    major_offset = torch.cumsum(major_sizes, 0) - major_sizes
    shift = torch.repeat_interleave(major_start - major_offset, major_sizes, output_size=m)
    order = (torch.arange(m, device=shift.device) + shift).to(rows.device)
    plan = DispatchPlan(group, send, recv, recv_counts.sum(0), order)
    return received[order], plan


def combine(out: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Send expert outputs back to their sources; the inverse of :func:`dispatch`.

    Args:
        out: ``[M, dim]`` in the expert-major layout :func:`dispatch` returned.
        plan: that dispatch's plan.

    Returns:
        ``[N, dim]`` in the caller's original (sorted by global expert) row order.
    """
    unpermuted = torch.empty_like(out).index_copy(0, plan.order, out)
    return all_to_all(unpermuted, plan.recv, plan.send, plan.group)
