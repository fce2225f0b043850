"""Differentiable collectives: each forward collective paired with its adjoint as the backward.

Adjoints (the transpose of the linear map each collective computes):
- all-to-all with split sizes (in -> out)  <->  all-to-all with the split sizes swapped;
- all-gather along dim 0                   <->  reduce-scatter (sum of every rank's slice-grad), done as
  an all-to-all plus a local sum so it also runs on gloo, which has no reduce-scatter;
- all-reduce (sum)                         <->  all-reduce (sum) of the gradients.

Every function takes the process group explicitly; tensors are made contiguous before they are sent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_gather_dim0", "all_reduce_sum", "all_to_all_dim0"]


def _a2a(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
    )
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # type: ignore[override]
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all_dim0(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    in_splits: Sequence[int] | None = None,
    out_splits: Sequence[int] | None = None,
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0.

    Args:
        x: ``[rows_in, *rest]``; rows ``in_splits[j]`` (in rank order) go to rank ``j``.
        group: the process group.
        in_splits: rows sent to each rank (default: equal, ``rows_in / group_size``).
        out_splits: rows received from each rank (default: equal).

    Returns:
        ``[sum(out_splits), *rest]``: rank ``j``'s rows, in rank order.

    Raises:
        ValueError: split lists of the wrong length or not summing to ``x``'s rows.
    """
    n = dist.get_world_size(group)
    rows = x.shape[0]
    if in_splits is None:
        if rows % n:
            raise ValueError(f"all_to_all_dim0: {rows} rows do not split equally over {n} ranks")
        in_splits = [rows // n] * n
    if out_splits is None:
        out_splits = [rows // n] * n if rows % n == 0 else None  # type: ignore[assignment]
        if out_splits is None:
            raise ValueError("all_to_all_dim0: out_splits is required for unequal splits")
    in_list, out_list = [int(s) for s in in_splits], [int(s) for s in out_splits]
    if len(in_list) != n or len(out_list) != n:
        raise ValueError(f"all_to_all_dim0: need {n} splits, got in={len(in_list)} out={len(out_list)}")
    if sum(in_list) != rows:
        raise ValueError(f"all_to_all_dim0: in_splits sum to {sum(in_list)}, x has {rows} rows")
    return _AllToAll.apply(x, out_list, in_list, group)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        n = dist.get_world_size(ctx.group)
        # Reduce-scatter: send slice j of my grad to rank j, sum what comes back.
        parts = _a2a(grad, [grad.shape[0] // n] * n, [grad.shape[0] // n] * n, ctx.group)
        return parts.view(n, grad.shape[0] // n, *grad.shape[1:]).sum(0), None


def all_gather_dim0(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-gather along dim 0: ``[rows, *rest]`` -> ``[group_size * rows, *rest]`` in rank
    order. Every rank must pass the same shape. Backward: reduce-scatter of the gradient."""
    return _AllGather.apply(x, group)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable sum all-reduce (out of place). Backward: sum all-reduce of the gradient."""
    return _AllReduce.apply(x, group)
