"""Decentralized grouped reordering (paper §5.1, Figure 11).

Inside a reordering group (default: the ranks of one node) every rank all-gathers per-sample metadata
(cost, payload shape, output rows, and the whole :class:`SampleMeta`, msgpack-encoded, so the rank that
encodes a sample knows what it is), partitions all samples with ``omni_parallel.karmarkar_karp`` into
one part per rank, checks that every rank computed the same plan (a hash all-gather: a mismatch raises
on every rank instead of hanging in the data all-to-all), then moves payloads with one all-to-all.
:meth:`ReorderPlan.restore` returns encoder outputs to their original rank and order; it is
differentiable, so gradients take the reverse path (the paper's "post-reorder" of gradients). When the
ranks that encode split samples further (sequence parallelism: each holds some rows of a sample),
``restore(outputs, held=...)`` returns just the rows each of them holds.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from omni_data.sample import SampleMeta
from omni_parallel import karmarkar_karp
from omni_parallel.comm import all_to_all_dim0

__all__ = ["GroupedReorderer", "PlanMismatchError", "ReorderPlan", "encoder_flops", "reorder_destinations"]

_MAX_DIMS = 4


class PlanMismatchError(RuntimeError):
    """Ranks of a reordering group computed different plans; raised on every rank before data moves."""


def encoder_flops(meta: SampleMeta) -> float:
    """Default cost: the sample's encoder forward FLOPs."""
    return meta.encoder_flops


class _Join(torch.autograd.Function):
    """Identity on ``out`` that also hands ``tie`` a zero gradient, so ``tie``'s backward (the dispatch
    all-to-all) runs on every rank, even one that encoded nothing and whose loss does not depend on it."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
        ctx.tie_shape, ctx.tie_dtype = tie.shape, tie.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.zeros(ctx.tie_shape, dtype=ctx.tie_dtype, device=grad.device)


@dataclass(slots=True)
class ReorderPlan:
    """Where every sample of the group goes; identical on every rank of the group.

    Attributes:
        rank: this rank's index in the group.
        dest: ``dest[r][i]`` = group rank that encodes sample ``i`` of rank ``r``.
        shapes: ``shapes[r][i]`` payload shape of sample ``i`` of rank ``r``.
        rows: ``rows[r][i]`` encoder output rows (tokens) of that sample.
        costs: ``costs[r][i]`` its cost (as given by ``cost_fn``).
        received: ``[(src_rank, src_index)]`` samples this rank encodes, in received order.
        digest: hex digest of the plan (checked equal across the group).
        metas: ``metas[r][i]`` the :class:`SampleMeta` of sample ``i`` of rank ``r``.
    """

    rank: int
    group: Any
    dest: list[list[int]]
    shapes: list[list[tuple[int, ...]]]
    rows: list[list[int]]
    costs: list[list[float]]
    received: list[tuple[int, int]]
    digest: str
    metas: list[list[SampleMeta]]
    _dispatched: torch.Tensor | None = None

    @property
    def load(self) -> list[float]:
        """Total cost per group rank after reordering."""
        out = [0.0] * len(self.dest)
        for r, ds in enumerate(self.dest):
            for i, d in enumerate(ds):
                out[d] += self.costs[r][i]
        return out

    def received_by(self, rank: int) -> list[tuple[int, int]]:
        """``[(src_rank, src_index)]`` the samples group rank ``rank`` encodes, in its received order."""
        return [
            (r, i) for r in range(len(self.dest)) for i in range(len(self.dest[r])) if self.dest[r][i] == rank
        ]

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank's dispatch sends to other ranks (float32 transport)."""
        return 4 * sum(
            _numel(s) for s, d in zip(self.shapes[self.rank], self.dest[self.rank]) if d != self.rank
        )

    def _send_order(self) -> list[int]:
        mine = self.dest[self.rank]
        return sorted(range(len(mine)), key=lambda i: (mine[i], i))

    def dispatch(
        self,
        payloads: Sequence[torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        differentiable: bool = False,
    ) -> list[torch.Tensor]:
        """Move this rank's payloads (one per local sample, shape ``shapes[rank][i]``) with one all-to-all.

        Args:
            payloads: this rank's payload tensors, in local sample order.
            dtype: transport dtype (the same on every rank of the group).
            differentiable: gradients of the returned payloads flow back to ``payloads``. Must be the
                same on every rank: the backward is a collective, and :meth:`restore` then makes every
                rank run it (also a rank with no samples), so collectives always match.

        Returns:
            The payloads this rank encodes, in :attr:`received` order.

        Raises:
            ValueError: wrong number of payloads or a payload whose shape differs from its metadata.
        """
        mine = self.shapes[self.rank]
        if len(payloads) != len(mine):
            raise ValueError(
                f"dispatch: rank {self.rank} got {len(payloads)} payloads for {len(mine)} samples"
            )
        for i, (p, s) in enumerate(zip(payloads, mine)):
            if tuple(p.shape) != s:
                raise ValueError(
                    f"dispatch: rank {self.rank} sample {i} has shape {tuple(p.shape)}, plan says {s}"
                )
        size = len(self.dest)
        numel = [[_numel(s) for s in ss] for ss in self.shapes]
        send = [0] * size
        flat = [payloads[i].reshape(-1).to(dtype) for i in self._send_order()]
        for i, d in enumerate(self.dest[self.rank]):
            send[d] += numel[self.rank][i]
        recv = [0] * size
        for r, i in self.received:
            recv[r] += numel[r][i]
        x = torch.cat(flat) if flat else torch.zeros(0, dtype=dtype)
        if differentiable and not x.requires_grad:
            x = x.detach().requires_grad_(True)  # an empty rank still needs the backward exchange
        y = all_to_all_dim0(x, self.group, in_splits=send, out_splits=recv)
        self._dispatched = y if differentiable else None
        out, at = [], 0
        for r, i in self.received:
            n = numel[r][i]
            out.append(y[at : at + n].view(self.shapes[r][i]))
            at += n
        return out

    def restore(self, outputs: torch.Tensor, held: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """Bring encoder outputs back to the samples' original rank and order.

        Args:
            outputs: ``[rows held of the received samples, *feat]`` in :attr:`received` order.
            held: ``held[d][k]`` rows group rank ``d`` holds of the ``k``-th sample it received
                (:meth:`received_by`), the same table on every rank; default: every sample's
                :attr:`rows` (each encoded whole).

        Returns:
            ``[rows held of this rank's samples, *feat]`` in this rank's original sample order (each
            sample's held rows in the order its encoding rank held them). Differentiable: the backward
            sends gradients along the reverse path.

        Raises:
            ValueError: ``outputs`` has the wrong number of rows, or ``held`` does not match the plan.
        """
        size = len(self.dest)
        if held is None:
            held = [[self.rows[r][i] for r, i in self.received_by(d)] for d in range(size)]
        if len(held) != size or any(len(h) != len(self.received_by(d)) for d, h in enumerate(held)):
            raise ValueError(f"restore: held must list every received sample of the {size} group ranks")
        # rows of each sample that come back from its encoding rank
        back_rows = [[0] * len(ds) for ds in self.dest]
        for d in range(size):
            for (r, i), n in zip(self.received_by(d), held[d]):
                back_rows[r][i] = int(n)
        want = sum(held[self.rank])
        if outputs.shape[0] != want:
            raise ValueError(f"restore: rank {self.rank} got {outputs.shape[0]} rows, plan says {want}")
        send = [0] * size
        for (r, _), n in zip(self.received, held[self.rank]):
            send[r] += int(n)
        mine = back_rows[self.rank]
        recv = [0] * size
        for i, d in enumerate(self.dest[self.rank]):
            recv[d] += mine[i]
        if self._dispatched is not None and torch.is_grad_enabled():
            outputs = _Join.apply(outputs, self._dispatched)
        back = all_to_all_dim0(outputs, self.group, in_splits=send, out_splits=recv)
        # back holds rows in send order (by destination, then index); put them in original order
        starts, at = [0] * len(mine), 0
        for i in self._send_order():
            starts[i] = at
            at += mine[i]
        index = [s + k for i, s in enumerate(starts) for k in range(mine[i])]
        return back.index_select(0, torch.tensor(index, dtype=torch.int64))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class GroupedReorderer:
    """Plans and runs grouped reordering over ``group``.

    Args:
        group: the reordering group (a ``torch.distributed`` process group; ``None`` = default group).
        cost_fn: per-sample cost for balancing (default :func:`encoder_flops`).
        rows_fn: encoder output rows per sample (default ``meta.media_tokens``).
    """

    def __init__(
        self,
        group: Any = None,
        cost_fn: Callable[[SampleMeta], float] = encoder_flops,
        rows_fn: Callable[[SampleMeta], int] | None = None,
    ) -> None:
        self.group = group
        self.cost_fn = cost_fn
        self.rows_fn = rows_fn or (lambda m: m.media_tokens)

    def plan(self, samples: Sequence[SampleMeta]) -> ReorderPlan:
        """All-gather metadata, partition with Karmarkar-Karp, check the plan hash across the group.

        Every rank of the group must call this (with its own samples, possibly none): it runs the same
        five all-gathers (counts and metadata table, sizes and encoded ``SampleMeta`` bytes, plan hash)
        whatever the counts.

        Raises:
            ValueError: a payload shape with more than 4 dims.
            PlanMismatchError: ranks computed different plans (raised on every rank).
        """
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        blobs = [msgpack.packb(m.to_dict(), use_bin_type=True) for m in samples]
        table = torch.zeros((len(samples), 4 + _MAX_DIMS), dtype=torch.int64)
        for i, m in enumerate(samples):
            if len(m.shape) > _MAX_DIMS:
                raise ValueError(f"sample {m.uid}: payload shape {m.shape} has more than {_MAX_DIMS} dims")
            bits = struct.unpack("<q", struct.pack("<d", float(self.cost_fn(m))))[
                0
            ]  # exact float64 transport
            table[i, :4] = torch.tensor([bits, int(self.rows_fn(m)), len(blobs[i]), len(m.shape)])
            table[i, 4 : 4 + len(m.shape)] = torch.tensor(m.shape, dtype=torch.int64)
        gathered = _all_gather_rows(table, self.group)
        blob = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8) if blobs else None
        gathered_bytes = _all_gather_bytes(blob, self.group)
        metas = []
        for g, raw in zip(gathered, gathered_bytes):
            at, row = 0, []
            for n in g[:, 2].tolist():
                row.append(SampleMeta.from_dict(msgpack.unpackb(raw[at : at + n], strict_map_key=False)))
                at += n
            metas.append(row)
        costs = [
            [struct.unpack("<d", struct.pack("<q", int(b)))[0] for b in g[:, 0].tolist()] for g in gathered
        ]
        rows = [g[:, 1].tolist() for g in gathered]
        shapes = [[tuple(row[4 : 4 + row[3]]) for row in g.tolist()] for g in gathered]
        dest = reorder_destinations(costs)
        received = [(r, i) for r in range(size) for i in range(len(dest[r])) if dest[r][i] == rank]
        keys = [[m.uid for m in ms] for ms in metas]
        h = hashlib.sha256(
            repr((size, dest, rows, shapes, [[c.hex() for c in cs] for cs in costs], keys)).encode()
        )
        digest = h.hexdigest()
        mine = torch.tensor([int.from_bytes(h.digest()[:8], "little", signed=True)], dtype=torch.int64)
        hashes = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(hashes, mine, group=self.group)
        if len({int(x) for x in hashes}) != 1:
            bad = [r for r, x in enumerate(hashes) if int(x) != int(mine)]
            raise PlanMismatchError(
                f"reordering plan differs between group ranks: rank {rank} disagrees with {bad}"
            )
        return ReorderPlan(rank, self.group, dest, shapes, rows, costs, received, digest, metas)


def reorder_destinations(costs: Sequence[Sequence[float]]) -> list[list[int]]:
    """Where a reordering group sends its samples: the partition :meth:`GroupedReorderer.plan` computes
    on every rank, without the collectives (paper §5.1).

    The group's samples, flattened rank by rank in local order, are partitioned by
    ``omni_parallel.karmarkar_karp`` into one part per rank by cost; each part goes to the rank that
    already holds most of its cost (fewest payload bytes moved; ties to the lowest rank).

    Args:
        costs: ``costs[r][i]`` the cost of sample ``i`` of group rank ``r`` (``len(costs)`` = group size;
            a rank may hold none).

    Returns:
        ``dest[r][i]``: the group rank that encodes sample ``i`` of rank ``r``.

    Raises:
        ValueError: an empty group.
    """
    size = len(costs)
    if size < 1:
        raise ValueError("reorder_destinations: the group has no ranks")
    flat = [(r, i) for r in range(size) for i in range(len(costs[r]))]
    cost = [float(costs[r][i]) for r, i in flat]
    parts = karmarkar_karp(cost, size)
    owner = _match_parts(parts, flat, cost, size)
    dest = [[0] * len(c) for c in costs]
    for part, d in zip(parts, owner):
        for g in part:
            r, i = flat[g]
            dest[r][i] = d
    return dest


def _match_parts(
    parts: list[list[int]], flat: list[tuple[int, int]], costs: list[float], size: int
) -> list[int]:
    """Give each part to the rank already holding most of its cost (fewest bytes moved); deterministic."""
    free = set(range(size))
    owner = []
    for part in parts:
        held = [0.0] * size
        for g in part:
            held[flat[g][0]] += costs[g]
        best = max(sorted(free), key=lambda r: held[r])
        owner.append(best)
        free.discard(best)
    return owner


def _all_gather_bytes(blob: torch.Tensor | None, group: Any) -> list[bytes]:
    """All-gather one uint8 buffer per rank (possibly none): one count all-gather, one padded all-gather."""
    size = dist.get_world_size(group)
    n = torch.tensor([0 if blob is None else blob.numel()], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(counts, n, group=group)
    m = max(1, max(int(c) for c in counts))
    pad = torch.zeros(m, dtype=torch.uint8)
    if blob is not None:
        pad[: blob.numel()] = blob
    out = [torch.zeros(m, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(out, pad, group=group)
    return [o[: int(c)].numpy().tobytes() for o, c in zip(out, counts)]


def _all_gather_rows(rows: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """All-gather ``[n_r, W]`` int64 tables of differing ``n_r``: one count all-gather, one padded all-gather."""
    size = dist.get_world_size(group)
    n = torch.tensor([rows.shape[0]], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(counts, n, group=group)
    m = max(int(c) for c in counts)
    pad = torch.zeros((m, rows.shape[1]), dtype=torch.int64)
    pad[: rows.shape[0]] = rows
    out = [torch.zeros((m, rows.shape[1]), dtype=torch.int64) for _ in range(size)]
    dist.all_gather(out, pad, group=group)
    return [o[: int(c)] for o, c in zip(out, counts)]
