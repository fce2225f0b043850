"""Data-parallel gradient synchronisation: one all-reduce per bucket of flattened gradients.

What DDP does after backward, without its hooks (so a pipeline executor that runs many microbatches
through one backward per microbatch decides when to reduce): gradients are grouped by device and dtype
into buckets of at most ``bucket_bytes``, each bucket is copied into one flat buffer, all-reduced once
and copied back (picotron's ``data_parallel.py`` bucketing; PyTorch DDP's 25 MiB default bucket). A
DTensor gradient (tensor parallelism) reduces its local shard: every rank of a data-parallel group holds
the same shard of it.

:class:`FlatGradients` skips both copies where the parameters' gradients can live in the flat buffer
itself (DDP's ``gradient_as_bucket_view``): each ``.grad`` is a view of one buffer per device and dtype,
autograd accumulates into it in place, and the buffer is all-reduced as it is. On ``omni-heavy``'s 10 MiB
of ViT gradients the flatten and copy-back cost 5-9 ms per step per rank.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["FlatGradients", "all_reduce_gradients", "wait_for_ranks"]

_BUCKET_BYTES = 25 * 2**20


def wait_for_ranks(device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """Block until every rank of ``group`` (default: the world) arrives; returns the seconds waited.

    A one-element all-reduce that every gradient sync would wait on anyway (the slowest rank's last
    backward); timed apart, it tells a pipeline's drain imbalance from the cost of the reduction itself.
    On CUDA the collective is asynchronous to the host, so the device is synchronised before the clock
    stops. 0.0 without an initialised process group or with one rank (no collective).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0.0
    start = time.perf_counter()
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


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


class FlatGradients:
    """The gradients of ``params`` as views of one flat buffer per (device, dtype), in parameter order.

    :meth:`attach` zeroes the buffers and sets every parameter's ``.grad`` to its view, so the backward
    passes that follow accumulate into the buffers in place (autograd adds into a defined ``.grad``);
    :meth:`all_reduce` then sums each buffer over the group with one all-reduce and no copy. The sums are
    those of :func:`all_reduce_gradients` bit for bit (zeros plus the first gradient is that gradient).
    Call :meth:`attach` after ``optimizer.zero_grad(set_to_none=True)``, before the step's backwards.

    Args:
        params: plain (non-DTensor) parameters that require grad; one listed twice is held once.

    Raises:
        TypeError: a parameter is a DTensor (its gradient is one too, and cannot be a view of a plain
            buffer: reduce it with :func:`all_reduce_gradients`).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        unique = list({id(p): p for p in params if p.requires_grad}.values())
        dtensors = [i for i, p in enumerate(unique) if isinstance(p, DTensor)]
        if dtensors:
            raise TypeError(
                f"FlatGradients: parameters {dtensors} (in order) are DTensors; they need their own sync"
            )
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        at: list[int] = []
        for p in unique:
            key = (p.device, p.dtype)
            at.append(sizes.get(key, 0))
            sizes[key] = at[-1] + p.numel()
        self.buffers = {key: torch.zeros(n, dtype=key[1], device=key[0]) for key, n in sizes.items()}
        self._views = [
            (p, self.buffers[(p.device, p.dtype)][a : a + p.numel()].view_as(p)) for p, a in zip(unique, at)
        ]

    def attach(self) -> None:
        """Zero the buffers and make every parameter's ``.grad`` its view."""
        for buf in self.buffers.values():
            buf.zero_()
        for p, view in self._views:
            p.grad = view

    def all_reduce(self, group: dist.ProcessGroup | None, *, divide_by: float = 1.0) -> None:
        """Sum the gradients over ``group`` in place, then divide by ``divide_by``; every parameter's
        ``.grad`` is its view afterwards. A gradient that is not its view (set after :meth:`attach`, or
        ``None``) is copied in first (``None``: zeros), so nothing is left out of the sum.

        Raises:
            ValueError: ``divide_by <= 0``.
        """
        if not divide_by > 0:
            raise ValueError(f"FlatGradients.all_reduce: divide_by must be > 0, got {divide_by}")
        for p, view in self._views:
            if p.grad is not view:
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view
        if group is None or dist.get_world_size(group) == 1:
            return
        for buf in self.buffers.values():
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
            if divide_by != 1:
                buf.div_(divide_by)
