"""Data-parallel gradient synchronisation: one all-reduce per bucket of flattened gradients.

What DDP does after backward, without its hooks (so a pipeline executor that runs many microbatches
through one backward per microbatch decides when to reduce): gradients are grouped by device and dtype
into buckets of at most ``bucket_bytes``, each bucket is copied into one flat buffer, all-reduced once
and copied back (picotron's ``data_parallel.py`` bucketing; PyTorch DDP's 25 MiB default bucket). A
DTensor gradient (tensor parallelism) reduces its local shard: every rank of a data-parallel group holds
the same shard of it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["all_reduce_gradients"]

_BUCKET_BYTES = 25 * 2**20


def all_reduce_gradients(
    params: Iterable[torch.nn.Parameter],
    group: dist.ProcessGroup | None,
    *,
    divide_by: float = 1.0,
    bucket_bytes: int = _BUCKET_BYTES,
) -> None:
    """Sum ``.grad`` of ``params`` over ``group`` in place, then divide by ``divide_by``.

    Args:
        params: parameters (each counted once; those without ``.grad`` are skipped).
        group: the data-parallel group; ``None`` or a group of one rank: nothing to do.
        divide_by: divisor applied after the sum (the replica count for a mean; 1 for a sum).
        bucket_bytes: upper bound of one flat buffer (a larger gradient gets a bucket of its own).

    Raises:
        ValueError: ``divide_by <= 0`` or ``bucket_bytes < 1``.
    """
    if not divide_by > 0 or bucket_bytes < 1:
        raise ValueError(
            f"all_reduce_gradients: divide_by must be > 0 and bucket_bytes >= 1, got {divide_by}, {bucket_bytes}"
        )
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = _local_grads(params)
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if divide_by != 1:
            flat.div_(divide_by)
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


def _local_grads(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in params:
        if p.grad is not None and id(p) not in seen:
            seen[id(p)] = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
    return list(seen.values())


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    # Same order on every rank (parameter order), so the flat buffers line up element for element.
    open_: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}
    out: list[list[torch.Tensor]] = []
    for g in grads:
        key, nbytes = (g.device, g.dtype), g.numel() * g.element_size()
        if open_.get(key) and filled[key] + nbytes > bucket_bytes:
            out.append(open_.pop(key))
        open_.setdefault(key, []).append(g)
        filled[key] = (filled[key] if len(open_[key]) > 1 else 0) + nbytes
    out.extend(open_.values())
    return out
