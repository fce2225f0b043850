"""Saving: every rank writes only its own boxes; rank 0 commits the manifest once all ranks succeeded.

Collectives per save on ``process_group`` (none without one):

1. planning: on a plan-cache hit one ``all_reduce`` of three int64s (:func:`~omni_ckpt.plan.agree_on_cache`);
   otherwise one ``all_gather_object`` of local plans (the plan exchange), preceded by that all-reduce
   when a cache is passed;
2. commit: one ``gather_object`` of per-rank write results (checksums, data offsets, or the rank's
   error) to rank 0, which writes ``manifest.msgpack.tmp``, renames it, runs ``on_commit``; then one
   ``broadcast_object_list`` of the outcome, so every rank returns or raises together.

No point-to-point traffic, ever (MegaScale-Omni §7).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, MutableMapping
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from fsspec import AbstractFileSystem

from omni_ckpt.box import Box
from omni_ckpt.checksum import ALGORITHM, crc
from omni_ckpt.layout import (
    CHUNK_BYTES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    dtype_name,
    encode_manifest,
    rank_file,
    safetensors_header,
)
from omni_ckpt.plan import LocalPlan, PlanCache, SavePlan, agree_on_cache, build_save_plan, local_plan
from omni_ckpt.sharding import describe, is_tensor_leaf
from omni_ckpt.state import flatten_state, gc_paused
from omni_ckpt.storage import (
    CheckpointError,
    FileSink,
    atomic_write,
    fsync_dir,
    is_local,
    join,
    local_path,
    open_url,
)
from omni_ckpt.transfer import (
    BufferPool,
    Segment,
    Source,
    host_bytes,
    plan_segments,
    write_segments,
)

__all__ = [
    "DEFAULT_HOST_BUDGET",
    "DEFAULT_IO_THREADS",
    "AsyncSaveHandle",
    "async_save",
    "nonfinite_tensors",
    "save",
    "save_ranks",
]

DEFAULT_HOST_BUDGET = 2 << 30
DEFAULT_IO_THREADS = 4


def _group_info(process_group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    if process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    if process_group is None:
        return None, 0, 1
    return process_group, dist.get_rank(process_group), dist.get_world_size(process_group)


def _device(process_group: dist.ProcessGroup | None) -> torch.device:
    """Where the tensors of this module's own collectives on ``process_group`` live (the plan-cache
    all-reduce): the CPU when the group has a backend for CPU tensors (gloo, or a mixed
    ``"cpu:gloo,cuda:nccl"`` group), else the current device of the one device type it serves (NCCL:
    CUDA). Read from ``dist.get_backend_config``: ``dist.get_backend`` returns a ``device:backend``
    config whole (``"cuda:nccl"``, ``"cpu:gloo,cuda:nccl"``), never equal to a bare ``"nccl"``."""
    if process_group is None:
        return torch.device("cpu")
    served = [entry.split(":", 1)[0] for entry in dist.get_backend_config(process_group).split(",")]
    if "cpu" in served:
        return torch.device("cpu")
    if served[0] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(served[0])


def pack_objects(objects: dict[str, Any]) -> bytes:
    """msgpack bytes of ``{name: value}``.

    Raises:
        TypeError: naming the first key whose value msgpack cannot store (no pickle fallback).
    """
    try:
        return msgpack.packb(objects, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        for name, value in objects.items():
            try:
                msgpack.packb(value, use_bin_type=True)
            except (TypeError, ValueError, OverflowError) as exc:
                raise TypeError(
                    f"state entry {name!r}: {type(value).__name__} is not msgpack-serialisable ({exc})"
                ) from None
        raise


@dataclass
class _Collected:
    items: list[tuple[str, str, tuple[int, ...], Box]]
    pieces: dict[tuple[str, Box], torch.Tensor]
    objects: bytes


def _collect(state: MutableMapping[Any, Any]) -> _Collected:
    items, pieces, objects = [], {}, {}
    names: dict[torch.dtype, str] = {}
    full: dict[tuple[int, ...], Box] = {}
    for name, _, _, value in flatten_state(state):
        if not is_tensor_leaf(value):
            objects[name] = value
            continue
        shape, dtype, parts = describe(value, full)
        dt = names.get(dtype) or names.setdefault(dtype, dtype_name(dtype))
        if not parts and 0 in shape:
            items.append((name, dt, shape, Box.full(shape)))
            pieces[(name, Box.full(shape))] = torch.empty(shape, dtype=dtype)
        for p in parts:
            items.append((name, dt, shape, p.box))
            pieces[(name, p.box)] = p.view
    return _Collected(items, pieces, pack_objects(objects))


@dataclass
class _Prepared:
    fs: AbstractFileSystem
    path: str
    pg: dist.ProcessGroup | None
    rank: int
    world_size: int
    plan: SavePlan | None
    collected: _Collected | None
    error: str | None


def _after_previous(cache: PlanCache | None) -> None:
    # The previous async save's commit collectives run on the same group in its thread; starting this
    # save's planning collectives before they end could interleave the two differently on each rank.
    if cache is not None and cache.in_flight is not None:
        futures.wait([cache.in_flight])
        cache.in_flight = None


def nonfinite_tensors(items: Iterator[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """``{name: NaN or Inf elements}`` of the floating-point tensors among ``items`` that hold any (summed
    over a tensor's pieces).

    Each tensor is summed first (one vectorised pass without allocation; a NaN or Inf anywhere makes the
    sum non-finite), one host synchronisation per device for all of them; only the tensors whose sum is
    not finite are counted element by element (a sum that merely overflowed counts nothing)."""
    named = [(n, t.detach()) for n, t in items if t.is_floating_point() or t.is_complex()]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    suspects = []
    for members in by_device.values():
        # complex128 holds any real or complex sum: one stack, one transfer per device
        sums = torch.stack([named[i][1].sum().to(torch.complex128) for i in members])
        suspects += [i for i, ok in zip(members, torch.isfinite(sums).tolist()) if not ok]
    out: dict[str, int] = {}
    for i in sorted(suspects):
        name, t = named[i]
        c = int(torch.count_nonzero(~torch.isfinite(t)))
        if c:
            out[name] = out.get(name, 0) + c
    return out


def _refuse_nonfinite(collected: _Collected, url: str) -> None:
    """Raises CheckpointError naming the tensors of this rank's share that hold a NaN or Inf."""
    bad = nonfinite_tensors((name, t) for (name, _), t in collected.pieces.items())
    if bad:
        first = ", ".join(f"{n!r} ({c})" for n, c in list(bad.items())[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise CheckpointError(
            f"{url}: refusing to save non-finite values (require_finite): NaN or Inf in {len(bad)} "
            f"tensor{'s' if len(bad) > 1 else ''} (elements): {first}{more}"
        )


def _prepare(
    state: MutableMapping[Any, Any],
    url: str,
    pg: dist.ProcessGroup | None,
    cache: PlanCache | None,
    require_finite: bool = False,
) -> _Prepared:
    _after_previous(cache)
    pg, rank, world = _group_info(pg)
    fs, path = open_url(url)
    collected, error = None, None
    try:
        if fs.exists(join(path, MANIFEST)):
            raise CheckpointError(f"{url}: a committed checkpoint is already there; refusing to overwrite it")
        with gc_paused():
            collected = _collect(state)
            if require_finite:
                _refuse_nonfinite(collected, url)
            mine = local_plan(rank, world, collected.items)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        mine = LocalPlan(rank, world, (), b"", error=error)
    if cache is not None and agree_on_cache(cache, mine, pg, device=_device(pg)):
        cache.hits += 1
        return _Prepared(fs, path, pg, rank, world, cache.plan, collected, error)
    if pg is None:
        plans = [mine]
    else:
        plans = [None] * world
        dist.all_gather_object(plans, mine, group=pg)
    with gc_paused():
        plan = build_save_plan(plans)  # raises on every rank alike, naming the failing rank
    if cache is not None:
        cache.plan = plan
        cache.misses += 1
    return _Prepared(fs, path, pg, rank, world, plan, collected, error)


def _write_rank(
    prep: _Prepared,
    sources: list[Source],
    segments: list[Segment],
    *,
    pool: BufferPool,
    stage_all: bool,
    threads: int,
    on_staged: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Write this rank's data file durably; returns its write result (data offset, header and per-chunk
    checksums, objects entry).

    Raises:
        OSError: a write, ``fsync`` or ``close`` failed (the file is then not durable).
    """
    plan, coll = prep.plan, prep.collected
    assert plan is not None and coll is not None
    writes = plan.writes[prep.rank]
    for w, src in zip(writes, sources):
        n = src.tensor.numel() * src.tensor.element_size()
        if n != w.length:
            raise CheckpointError(f"tensor {w.name!r} box {w.box.offsets}: {n} bytes, plan says {w.length}")
    header = safetensors_header(plan.entries[prep.rank], len(coll.objects), prep.rank)
    end = len(header) + sum(w.length for w in writes)
    prep.fs.makedirs(prep.path, exist_ok=True)
    sink = FileSink(prep.fs, join(prep.path, rank_file(prep.rank)))
    try:
        sink.write([header], 0)
        crcs = write_segments(
            sink,
            len(header),
            segments,
            sources,
            [w.length for w in writes],
            pool=pool,
            stage_all=stage_all,
            threads=threads,
            on_staged=on_staged,
        )
        sink.write([coll.objects], end)
        sink.finish()
    except BaseException:
        sink.abort()
        raise
    if is_local(prep.fs):  # the step directory's own entry, created by this save
        fsync_dir(local_path(prep.fs, prep.path).rsplit("/", 1)[0] or "/")
    return {
        "data_start": len(header),
        "header_crc": crc(header),
        "crcs": crcs,
        "objects": [prep.rank, end, len(coll.objects), crc(coll.objects)],
    }


def _sources(prep: _Prepared) -> list[Source]:
    return [Source(t, host_bytes(t)) for t in _lookup(prep)]


def _lookup(prep: _Prepared) -> Iterator[torch.Tensor]:
    assert prep.plan is not None and prep.collected is not None
    pieces = prep.collected.pieces
    for w in prep.plan.writes[prep.rank]:
        t = pieces.get((w.name, w.box))
        if t is None:
            raise CheckpointError(
                f"rank {prep.rank}: plan asks for tensor {w.name!r} box {w.box.offsets} it does not hold"
            )
        yield t


@dataclass
class ManifestSkeleton:
    """The manifest without what only the written files know (data offsets, checksums), built from the
    plan in the calling thread, so that a background commit only fills numbers in (no per-box allocation
    behind a busy caller). ``boxes[r]`` are rank r's box entries in its write order."""

    tensors: dict[str, list[Any]]
    boxes: list[list[list[Any]]]


def manifest_skeleton(plan: SavePlan) -> ManifestSkeleton:
    tensors: dict[str, list[Any]] = {
        name: [dt, list(shape), []] for name, (dt, shape) in plan.tensors.items()
    }
    boxes = []
    for r, writes in enumerate(plan.writes):
        mine = []
        for w in writes:
            entry = [list(w.box.offsets), list(w.box.sizes), r, w.rel_offset, w.length, None]
            tensors[w.name][2].append(entry)
            mine.append(entry)
        boxes.append(mine)
    return ManifestSkeleton(tensors, boxes)


def build_manifest(
    plan: SavePlan, results: list[dict[str, Any]], skeleton: ManifestSkeleton | None = None
) -> dict[str, Any]:
    """The manifest (see :mod:`omni_ckpt.layout`) from the plan and every rank's write result (consumes
    ``skeleton``, built from the same plan, if given)."""
    skel = skeleton or manifest_skeleton(plan)
    for mine, res in zip(skel.boxes, results):
        start = res["data_start"]
        for entry, crcs in zip(mine, res["crcs"]):
            entry[3] += start
            entry[5] = crcs
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "world_size": plan.world_size,
        "chunk_bytes": CHUNK_BYTES,
        "checksum": ALGORITHM,
        "files": [rank_file(r) for r in range(plan.world_size)],
        "data_start": [res["data_start"] for res in results],
        "header_crc": [res["header_crc"] for res in results],
        "tensors": skel.tensors,
        "objects": [res["objects"] for res in results],
        "rank_fingerprints": plan.rank_fingerprints,
    }


def _commit(
    prep: _Prepared,
    result: dict[str, Any] | str,
    on_commit: Callable[[], None] | None,
    *,
    in_caller: bool,
    skeleton: ManifestSkeleton | None = None,
) -> None:
    if prep.pg is None:
        results = [result]
    else:
        results = [None] * prep.world_size if prep.rank == 0 else None
        dist.gather_object(result, results, group=prep.pg, group_dst=0)
    status: list[Any] = [None]
    if prep.rank == 0:
        assert results is not None
        failed = [f"rank {r}: {res}" for r, res in enumerate(results) if isinstance(res, str)]
        if failed:
            status[0] = "save failed, nothing committed: " + "; ".join(failed)
        else:
            committed = False
            try:
                assert prep.plan is not None
                with gc_paused() if in_caller else contextlib.nullcontext():
                    data = encode_manifest(build_manifest(prep.plan, results, skeleton))  # type: ignore[arg-type]
                atomic_write(prep.fs, join(prep.path, MANIFEST), data)
                committed = True
                if on_commit is not None:
                    on_commit()
            except Exception as exc:
                if committed:
                    status[0] = (
                        f"{prep.path} is committed, but the step after the commit (latest pointer, pruning) "
                        f"failed on rank 0: {type(exc).__name__}: {exc}"
                    )
                else:
                    status[0] = f"rank 0 could not commit {prep.path}: {type(exc).__name__}: {exc}"
    if prep.pg is not None:
        dist.broadcast_object_list(status, group=prep.pg, group_src=0)
    if status[0] is not None:
        raise CheckpointError(status[0])


def _pool_for(sources: list[Source], budget: int) -> BufferPool:
    return BufferPool(budget, pin=any(src.tensor.device.type == "cuda" for src in sources))


def save(
    state_dict: MutableMapping[Any, Any],
    url: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    plan_cache: PlanCache | None = None,
    on_commit: Callable[[], None] | None = None,
    io_threads: int = DEFAULT_IO_THREADS,
    host_budget_bytes: int = DEFAULT_HOST_BUDGET,
    require_finite: bool = False,
) -> None:
    """Save a nested state dict to the checkpoint directory ``url``; returns once it is committed.

    Leaves: ``torch.Tensor`` (replicated: written once), ``DTensor``, :class:`~omni_ckpt.FlatShard`,
    :class:`~omni_ckpt.BoxShard`, and plain msgpack values (kept per rank); :class:`~omni_ckpt.Placeholder`
    subtrees are skipped. Collective over ``process_group`` (default: the default group when initialised,
    else a single process); see the module docstring for the exact collectives. ``plan_cache`` must be
    passed on all ranks or on none. Host tensors are written straight from their memory; device tensors
    go through host buffers of at most ``host_budget_bytes``.

    Args:
        state_dict: nested dicts (str or int keys).
        url: an fsspec URL of a directory that holds no committed checkpoint.
        process_group: the ranks saving together.
        plan_cache: reuse and update the cached save plan.
        on_commit: run on rank 0 right after the manifest is renamed into place.
        io_threads: writer threads per rank (positional writes on a local disk).
        host_budget_bytes: bytes of host staging buffers for device tensors.
        require_finite: refuse the save if a floating-point tensor of any rank holds a NaN or Inf (checked
            in the caller before planning: one ``isfinite`` pass over the state; every rank raises, naming
            the rank and the tensors, and nothing is written, committed or pruned).

    Raises:
        CheckpointError: a rank failed, including a failed ``fsync`` or ``close`` (all ranks raise, naming it;
            nothing is committed), ``url`` is already committed, or ``require_finite`` found NaN or Inf.
        ValueError: the boxes of a tensor overlap or leave a region uncovered (tensor and region named).
    """
    _check_budget(host_budget_bytes)
    prep = _prepare(state_dict, url, process_group, plan_cache, require_finite)
    result: dict[str, Any] | str
    if prep.error is not None:
        result = prep.error
    else:
        try:
            with gc_paused():
                sources = _sources(prep)
                pool = _pool_for(sources, host_budget_bytes)
                segments = plan_segments(prep.plan.writes[prep.rank], pool.piece_bytes)  # type: ignore[union-attr]
                try:
                    result = _write_rank(
                        prep, sources, segments, pool=pool, stage_all=False, threads=io_threads
                    )
                finally:
                    pool.close()
        except Exception as exc:
            result = f"{type(exc).__name__}: {exc}"
    _commit(prep, result, on_commit, in_caller=True)


def save_ranks(
    states: list[MutableMapping[Any, Any]], url: str, *, io_threads: int = DEFAULT_IO_THREADS
) -> None:
    """Save the states of ``len(states)`` ranks from one process, as if each rank had called :func:`save`.

    For offline conversion (build a sharded checkpoint for a layout without starting its processes) and for
    checking layouts: the same planner, writers and commit run, the plan exchange is a list.

    Raises:
        CheckpointError, ValueError, OSError: as :func:`save`, naming the rank; ValueError: ``states`` is empty.
    """
    if not states:
        raise ValueError("save_ranks: no rank states given")
    fs, path = open_url(url)
    if fs.exists(join(path, MANIFEST)):
        raise CheckpointError(f"{url}: a committed checkpoint is already there; refusing to overwrite it")
    world = len(states)
    with gc_paused():
        collected = [_collect(st) for st in states]
        plan = build_save_plan([local_plan(r, world, c.items) for r, c in enumerate(collected)])
    results = []
    for r, c in enumerate(collected):
        prep = _Prepared(fs, path, None, r, world, plan, c, None)
        sources = _sources(prep)
        pool = _pool_for(sources, DEFAULT_HOST_BUDGET)
        segments = plan_segments(plan.writes[r], pool.piece_bytes)
        try:
            results.append(
                _write_rank(prep, sources, segments, pool=pool, stage_all=False, threads=io_threads)
            )
        finally:
            pool.close()
    atomic_write(fs, join(path, MANIFEST), encode_manifest(build_manifest(plan, results)))


class AsyncSaveHandle:
    """An in-flight :func:`async_save`.

    Attributes:
        staged: future resolved once every box is copied to host memory: training may change weights.
        done: future resolved once the checkpoint is committed and durable (raises the save's error).
        peak_staged_bytes: most bytes of host staging buffers in use at once (at most the budget).
    """

    def __init__(self) -> None:
        self.staged: Future[None] = Future()
        self.done: Future[None] = Future()
        self.peak_staged_bytes = 0
        self._thread: threading.Thread | None = None

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed. Raises: the background error (:class:`CheckpointError`), TimeoutError."""
        self.done.result(timeout)


@dataclass
class _Staging:
    """What an async save prepares in the calling thread (collector paused, caller not yet busy), so the
    background thread does only the copies, writes and checksums: per-box Python work there runs at half
    speed behind a caller busy in Python, and its allocations set off full collections."""

    sources: list[Source]
    segments: list[Segment]
    skeleton: ManifestSkeleton | None  # rank 0 only: it writes the manifest


def _background(
    prep: _Prepared,
    staging: _Staging,
    handle: AsyncSaveHandle,
    pool: BufferPool,
    threads: int,
    on_commit: Callable[[], None] | None,
) -> None:
    result: dict[str, Any] | str
    if prep.error is not None:
        handle.staged.set_result(None)
        result = prep.error
    else:
        try:
            result = _write_rank(
                prep,
                staging.sources,
                staging.segments,
                pool=pool,
                stage_all=True,
                threads=threads,
                on_staged=lambda: handle.staged.set_result(None),
            )
        except Exception as exc:
            result = f"{type(exc).__name__}: {exc}"
        finally:
            handle.peak_staged_bytes = pool.peak_bytes
            pool.close()
            staging.sources.clear()  # the state's tensors are not referenced past staging
    if not handle.staged.done():
        handle.staged.set_exception(CheckpointError(f"rank {prep.rank}: staging stopped: {result}"))
    try:
        _commit(prep, result, on_commit, in_caller=False, skeleton=staging.skeleton)
        handle.done.set_result(None)
    except BaseException as exc:
        handle.done.set_exception(exc)


def _check_budget(budget: int) -> None:
    if budget <= 0:
        raise ValueError(f"host_budget_bytes must be > 0, got {budget}")


def async_save(
    state_dict: MutableMapping[Any, Any],
    url: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    plan_cache: PlanCache | None = None,
    on_commit: Callable[[], None] | None = None,
    host_budget_bytes: int = DEFAULT_HOST_BUDGET,
    io_threads: int = DEFAULT_IO_THREADS,
    require_finite: bool = False,
) -> AsyncSaveHandle:
    """Like :func:`save`, but stage to host memory and write in background threads.

    Planning (its collectives) runs in the caller; copying boxes into a pool of host buffers of at most
    ``host_budget_bytes`` in all (boxes larger than one buffer are copied and written piece by piece),
    writing (``io_threads`` writers), and the commit collectives run in the background. When the state is
    larger than the budget, ``handle.staged`` resolves only once all but the last budget's worth of bytes
    are written. Do not change the saved tensors before ``handle.staged`` resolves.
    Use a ``process_group`` that nothing else runs collectives on while the save is in flight (the
    :class:`~omni_ckpt.CheckpointManager` makes its own). A later save given the same ``plan_cache`` waits
    for this one's ``handle.done`` before its first collective; without a shared cache, do not start
    another save on the group before ``handle.done`` resolves.

    ``require_finite`` is checked in the caller, before planning, as in :func:`save`.

    Raises:
        ValueError: ``host_budget_bytes <= 0``; planning errors as in :func:`save` (raised here).
        CheckpointError: ``require_finite`` found NaN or Inf (raised here, on every rank).
    """
    _check_budget(host_budget_bytes)
    prep = _prepare(state_dict, url, process_group, plan_cache, require_finite)
    staging = _Staging([], [], None)
    pool = BufferPool(host_budget_bytes)
    if prep.error is None:
        assert prep.plan is not None
        try:
            with gc_paused():
                sources = _sources(prep)
                pool = _pool_for(sources, host_budget_bytes)
                segments = plan_segments(prep.plan.writes[prep.rank], pool.piece_bytes)
                skeleton = manifest_skeleton(prep.plan) if prep.rank == 0 else None
                staging = _Staging(sources, segments, skeleton)
        except Exception as exc:
            prep.error = f"{type(exc).__name__}: {exc}"
    handle = AsyncSaveHandle()
    handle._thread = threading.Thread(
        target=_background,
        args=(prep, staging, handle, pool, io_threads, on_commit),
        name="omni-ckpt-save",
    )
    handle._thread.start()
    if plan_cache is not None:
        plan_cache.in_flight = handle.done
    return handle
