"""Collectives used by omni_data, kept apart from the planning logic (picotron style)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["exchange", "gather_int_rows"]


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 whose backward is the reverse exchange (split sizes swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _Exchange.apply(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Send ``x[rows]`` in ``send[r]``-row chunks to rank ``r`` of ``group``; receive ``recv[r]`` rows.

    ``x``: ``[sum(send), *feat]``; returns ``[sum(recv), *feat]``. Differentiable (reverse exchange).
    """
    return _Exchange.apply(x, list(send), list(recv), group)


def gather_int_rows(rows: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """All-gather ``[n_r, W]`` int64 tables of differing ``n_r``: one count all-gather, one padded all-gather."""
    size = dist.get_world_size(group)
    n = torch.tensor([rows.shape[0]], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(counts, n, group=group)
    width = rows.shape[1]
    m = max(int(c) for c in counts)
    pad = torch.zeros((m, width), dtype=torch.int64)
    pad[: rows.shape[0]] = rows
    out = [torch.zeros((m, width), dtype=torch.int64) for _ in range(size)]
    dist.all_gather(out, pad, group=group)
    return [o[: int(c)] for o, c in zip(out, counts)]
