"""Save plans: who writes which box where, how ranks agree on one, and the persistent plan cache.

A rank's *local plan* is the sorted list of ``(name, dtype, global shape, box)`` it holds. The *global
plan* dedupes identical boxes (replicas), picks one writer per box (the holder with the fewest bytes so
far, so replicated tensors spread over ranks), validates every tensor's boxes (in bounds, disjoint,
covering) and lays out each writer's data file. Building it needs every rank's local plan: one
``all_gather_object``, the "plan exchange" that costs minutes at thousands of ranks
(MegaScale-Omni §7, ByteCheckpoint).

The plan is persisted in every checkpoint (the manifest's boxes plus per-rank fingerprints). When a
restarted job saves with an unchanged layout, each rank compares its local fingerprint with the cached
one and the ranks agree with a single ``all_reduce`` (:func:`agree_on_cache`) instead of exchanging plans.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgpack
import torch
import torch.distributed as dist

from omni_ckpt.box import Box, check_boxes
from omni_ckpt.layout import FORMAT_VERSION, SMALL_BOX_BYTES, Write, itemsize, layout_rank
from omni_ckpt.storage import CheckpointError

__all__ = ["LocalPlan", "PlanCache", "SavePlan", "agree_on_cache", "build_save_plan", "local_plan"]

LocalItem = tuple[str, str, tuple[int, ...], Box]


@dataclass(frozen=True)
class LocalPlan:
    """What one rank holds: sorted ``(name, dtype, global_shape, box)`` items and their fingerprint.

    ``error`` carries a rank's planning failure to every rank, so all of them raise together
    instead of hanging in the next collective.
    """

    rank: int
    world_size: int
    items: tuple[LocalItem, ...]
    fingerprint: bytes
    error: str | None = None


def local_plan(rank: int, world_size: int, items: Sequence[LocalItem]) -> LocalPlan:
    """The local plan of ``rank`` with its fingerprint (blake2b over format version, world size, rank,
    small-box threshold and every item's name, dtype, shape and box)."""
    ordered = tuple(sorted(items, key=lambda it: (it[0], it[3].offsets)))
    payload = msgpack.packb(
        [
            FORMAT_VERSION,
            SMALL_BOX_BYTES,
            world_size,
            rank,
            [(n, d, s, b.offsets, b.sizes) for n, d, s, b in ordered],
        ]
    )
    return LocalPlan(rank, world_size, ordered, hashlib.blake2b(payload, digest_size=16).digest())


@dataclass
class SavePlan:
    """The global plan every rank follows.

    Attributes:
        world_size: ranks in the saving process group.
        rank_fingerprints: each rank's local-plan fingerprint (the cache key).
        tensors: ``name -> (dtype name, global shape)``.
        writes: per rank, the boxes it writes in file order (byte offsets relative to its data section).
        entries: per rank, the safetensors header entries of its data file.
    """

    world_size: int
    rank_fingerprints: list[bytes]
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    writes: list[list[Write]]
    entries: list[list[tuple[str, str, list[int], int, int]]] = field(default_factory=list)

    @property
    def key(self) -> int:
        """A 62-bit digest of all rank fingerprints; ranks compare it in :func:`agree_on_cache`."""
        digest = hashlib.blake2b(b"".join(self.rank_fingerprints), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 2


def build_save_plan(plans: Sequence[LocalPlan]) -> SavePlan:
    """The global plan from every rank's local plan (pure; every rank computes the same one).

    Raises:
        CheckpointError: a rank reported an error (named).
        ValueError: ranks disagree on a tensor's dtype or shape, or a
            tensor's boxes are out of bounds, overlap, or leave a region uncovered (tensor and region named).
    """
    for p in plans:
        if p.error is not None:
            raise CheckpointError(f"rank {p.rank} could not plan its save: {p.error}")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    holders: dict[tuple[str, Box], list[int]] = {}
    for p in plans:
        for name, dt, shape, box in p.items:
            seen = tensors.setdefault(name, (dt, shape))
            if seen != (dt, shape):
                raise ValueError(
                    f"tensor {name!r}: rank {p.rank} has dtype {dt} shape {shape}, another rank {seen[0]} {seen[1]}"
                )
            holders.setdefault((name, box), []).append(p.rank)
    by_tensor: dict[str, list[Box]] = {name: [] for name in tensors}
    for name, box in holders:
        by_tensor[name].append(box)
    for name, boxes in by_tensor.items():
        check_boxes(name, tensors[name][1], boxes)
    load = [0] * len(plans)
    assigned: list[list[tuple[str, Box, str]]] = [[] for _ in plans]
    for (name, box), ranks in sorted(holders.items(), key=lambda kv: (kv[0][0], kv[0][1].offsets)):
        dt = tensors[name][0]
        writer = ranks[0] if len(ranks) == 1 else min(ranks, key=lambda r: (load[r], r))
        load[writer] += math.prod(box.sizes) * itemsize(dt)
        assigned[writer].append((name, box, dt))
    shapes = {name: shape for name, (_, shape) in tensors.items()}
    writes, entries = [], []
    for items in assigned:
        w, e = layout_rank(items, shapes)
        writes.append(w)
        entries.append(e)
    return SavePlan(len(plans), [p.fingerprint for p in plans], tensors, writes, entries)


@dataclass
class PlanCache:
    """The last save plan, persisted in each checkpoint's manifest and reloaded after a restart.

    ``hits`` and ``misses`` count how saves were planned (for logs and tests). ``in_flight`` is the
    ``done`` future of the last :func:`~omni_ckpt.async_save` planned with this cache: the next save with the
    same cache waits for it before its first collective, so two saves never interleave collectives on one
    process group (its error stays with its own handle).
    """

    plan: SavePlan | None = None
    hits: int = 0
    misses: int = 0
    in_flight: Future[None] | None = None


def agree_on_cache(
    cache: PlanCache, mine: LocalPlan, process_group: dist.ProcessGroup | None, *, device: torch.device
) -> bool:
    """Whether every rank can reuse ``cache.plan``: one ``all_reduce(MIN)`` of three int64s.

    Each rank contributes ``[hit, key, -key]`` where ``hit`` says its own fingerprint matches the cached
    plan's entry for its rank and ``key`` identifies the cached plan; the reduced ``min(key) == max(key)``
    shows every rank holds the same cached plan.
    """
    plan = cache.plan
    hit = int(
        plan is not None
        and plan.world_size == mine.world_size
        and plan.rank_fingerprints[mine.rank] == mine.fingerprint
    )
    key = plan.key if plan is not None else -1
    if process_group is None:
        return bool(hit)
    t = torch.tensor([hit, key, -key], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=process_group)
    return bool(t[0].item() == 1 and t[1].item() == -t[2].item())
