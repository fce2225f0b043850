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

import queue
import threading
import zlib
from collections.abc import Callable, Iterator, MutableMapping
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist
from fsspec import AbstractFileSystem

from omni_ckpt.box import Box
from omni_ckpt.layout import (
    CHUNK_BYTES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    dtype_name,
    rank_file,
    safetensors_header,
)
from omni_ckpt.plan import LocalPlan, PlanCache, SavePlan, agree_on_cache, build_save_plan, local_plan
from omni_ckpt.sharding import describe, is_tensor_leaf
from omni_ckpt.state import flatten_state, gc_paused
from omni_ckpt.storage import CheckpointError, atomic_write, fsync_file, join, open_url

__all__ = ["AsyncSaveHandle", "async_save", "save", "save_ranks"]

DEFAULT_HOST_BUDGET = 2 << 30


def _group_info(process_group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    if process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    if process_group is None:
        return None, 0, 1
    return process_group, dist.get_rank(process_group), dist.get_world_size(process_group)


def _device(process_group: dist.ProcessGroup | None) -> torch.device:
    if process_group is not None and dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
    for name, _, _, value in flatten_state(state):
        if not is_tensor_leaf(value):
            objects[name] = value
            continue
        shape, dtype, parts = describe(value)
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


def _prepare(
    state: MutableMapping[Any, Any], url: str, pg: dist.ProcessGroup | None, cache: PlanCache | None
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


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    # Pieces are detached views already (sharding.describe).
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _crc_chunks(data: np.ndarray) -> list[int]:
    n = data.nbytes
    if n <= CHUNK_BYTES:
        return [zlib.crc32(data)]
    return [zlib.crc32(data[i : i + CHUNK_BYTES]) for i in range(0, n, CHUNK_BYTES)]


_COALESCE_BYTES = 1 << 20


def _write_rank(
    prep: _Prepared, buffers: Iterator[np.ndarray], release: Callable[[int], None]
) -> dict[str, Any]:
    """Write this rank's data file; returns its write result (data offset, checksums, objects entry)."""
    plan, coll = prep.plan, prep.collected
    assert plan is not None and coll is not None
    writes = plan.writes[prep.rank]
    entries = plan.entries[prep.rank]
    header = safetensors_header(entries, len(coll.objects), prep.rank)
    crcs: list[list[int]] = []
    prep.fs.makedirs(prep.path, exist_ok=True)
    with prep.fs.open(join(prep.path, rank_file(prep.rank)), "wb") as f:
        f.write(header)
        for w, buf in zip(writes, buffers):
            if buf.nbytes != w.length:
                raise CheckpointError(
                    f"tensor {w.name!r} box {w.box.offsets}: {buf.nbytes} bytes, plan says {w.length}"
                )
            f.write(memoryview(buf))
            crcs.append(_crc_chunks(buf))
            release(w.length)
        f.write(coll.objects)
        fsync_file(f)
    end = sum(w.length for w in writes)
    return {
        "data_start": len(header),
        "crcs": crcs,
        "objects": [prep.rank, len(header) + end, len(coll.objects), zlib.crc32(coll.objects)],
    }


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


def build_manifest(plan: SavePlan, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest (see :mod:`omni_ckpt.layout`) from the plan and every rank's write result."""
    tensors: dict[str, list[Any]] = {
        name: [dt, list(shape), []] for name, (dt, shape) in plan.tensors.items()
    }
    for r, (writes, res) in enumerate(zip(plan.writes, results)):
        start = res["data_start"]
        for w, crc in zip(writes, res["crcs"]):
            tensors[w.name][2].append(
                [list(w.box.offsets), list(w.box.sizes), r, start + w.rel_offset, w.length, crc]
            )
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "world_size": plan.world_size,
        "chunk_bytes": CHUNK_BYTES,
        "checksum": f"crc32 (zlib.crc32, IEEE 802.3 polynomial) per chunk of {CHUNK_BYTES} bytes of each box",
        "files": [rank_file(r) for r in range(plan.world_size)],
        "data_start": [res["data_start"] for res in results],
        "tensors": tensors,
        "objects": [res["objects"] for res in results],
        "rank_fingerprints": plan.rank_fingerprints,
    }


def _commit(prep: _Prepared, result: dict[str, Any] | str, on_commit: Callable[[], None] | None) -> None:
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
                with gc_paused():
                    manifest = build_manifest(prep.plan, results)  # type: ignore[arg-type]
                    data = msgpack.packb(manifest, use_bin_type=True)
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


def save(
    state_dict: MutableMapping[Any, Any],
    url: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    plan_cache: PlanCache | None = None,
    on_commit: Callable[[], None] | None = None,
) -> None:
    """Save a nested state dict to the checkpoint directory ``url``; returns once it is committed.

    Leaves: ``torch.Tensor`` (replicated: written once), ``DTensor``, :class:`~omni_ckpt.FlatShard`,
    :class:`~omni_ckpt.BoxShard`, and plain msgpack values (kept per rank). Collective over
    ``process_group`` (default: the default group when initialised, else a single process); see the module
    docstring for the exact collectives. ``plan_cache`` must be passed on all ranks or on none.

    Args:
        state_dict: nested dicts (str or int keys).
        url: an fsspec URL of a directory that holds no committed checkpoint.
        process_group: the ranks saving together.
        plan_cache: reuse and update the cached save plan.
        on_commit: run on rank 0 right after the manifest is renamed into place.

    Raises:
        CheckpointError: a rank failed (all ranks raise, naming it) or ``url`` is already committed.
        ValueError: the boxes of a tensor overlap or leave a region uncovered (tensor and region named).
    """
    prep = _prepare(state_dict, url, process_group, plan_cache)
    result: dict[str, Any] | str
    if prep.error is not None:
        result = prep.error
    else:
        try:
            result = _write_rank(prep, (_as_bytes(t) for t in _lookup(prep)), lambda n: None)
        except Exception as exc:
            result = f"{type(exc).__name__}: {exc}"
    _commit(prep, result, on_commit)


def save_ranks(states: list[MutableMapping[Any, Any]], url: str) -> None:
    """Save the states of ``len(states)`` ranks from one process, as if each rank had called :func:`save`.

    For offline conversion (build a sharded checkpoint for a layout without starting its processes) and for
    checking layouts: the same planner, writers and commit run, the plan exchange is a list.

    Raises:
        CheckpointError, ValueError: as :func:`save`, naming the rank; ValueError: ``states`` is empty.
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
        results.append(_write_rank(prep, (_as_bytes(t) for t in _lookup(prep)), lambda n: None))
    atomic_write(fs, join(path, MANIFEST), msgpack.packb(build_manifest(plan, results), use_bin_type=True))


class AsyncSaveHandle:
    """An in-flight :func:`async_save`.

    Attributes:
        staged: future resolved once every box is copied to host memory: training may change weights.
        done: future resolved once the checkpoint is committed and durable (raises the save's error).
        peak_staged_bytes: most bytes held in host staging buffers at once (bounded by the budget, or by
            the largest box when that alone exceeds it).
    """

    def __init__(self) -> None:
        self.staged: Future[None] = Future()
        self.done: Future[None] = Future()
        self.peak_staged_bytes = 0
        self._thread: threading.Thread | None = None

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed. Raises: the background error (:class:`CheckpointError`), TimeoutError."""
        self.done.result(timeout)


def _stage_copy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
    host.copy_(t)
    return host.reshape(-1).view(torch.uint8).numpy()


def _background(
    prep: _Prepared, handle: AsyncSaveHandle, budget: int, on_commit: Callable[[], None] | None
) -> None:
    result: dict[str, Any] | str
    if prep.error is not None:
        handle.staged.set_result(None)
        result = prep.error
    else:
        cond = threading.Condition()
        inflight = [0]
        aborted = threading.Event()
        # The writer starts once staging is complete or blocked on the budget, so it does not compete
        # with the copies for cores and memory bandwidth while the caller is waiting for `staged`.
        go = threading.Event()
        staged_q: queue.Queue[np.ndarray | BaseException] = queue.Queue()

        def release(n: int) -> None:
            with cond:
                inflight[0] -= n
                cond.notify_all()

        def stager() -> None:
            try:
                for t in _lookup(prep):
                    n = t.numel() * t.element_size()
                    with cond:
                        if not (inflight[0] == 0 or inflight[0] + n <= budget):
                            go.set()
                        # A box larger than the budget is staged alone rather than never.
                        cond.wait_for(
                            lambda n=n: aborted.is_set() or inflight[0] == 0 or inflight[0] + n <= budget
                        )
                        if aborted.is_set():
                            raise CheckpointError(f"rank {prep.rank}: staging stopped, the writer failed")
                        inflight[0] += n
                        handle.peak_staged_bytes = max(handle.peak_staged_bytes, inflight[0])
                    staged_q.put(_stage_copy(t))
                handle.staged.set_result(None)
            except BaseException as exc:
                handle.staged.set_exception(exc)
                staged_q.put(exc)
            finally:
                go.set()

        def buffers() -> Iterator[np.ndarray]:
            go.wait()
            while True:
                item = staged_q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item

        th = threading.Thread(target=stager, name="omni-ckpt-stage", daemon=True)
        th.start()
        try:
            result = _write_rank(prep, buffers(), release)
        except Exception as exc:
            result = f"{type(exc).__name__}: {exc}"
            with cond:
                aborted.set()
                cond.notify_all()
        th.join()
    try:
        _commit(prep, result, on_commit)
        handle.done.set_result(None)
    except BaseException as exc:
        if not handle.staged.done():
            handle.staged.set_exception(exc)
        handle.done.set_exception(exc)


def async_save(
    state_dict: MutableMapping[Any, Any],
    url: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    plan_cache: PlanCache | None = None,
    on_commit: Callable[[], None] | None = None,
    host_budget_bytes: int = DEFAULT_HOST_BUDGET,
) -> AsyncSaveHandle:
    """Like :func:`save`, but stage to host memory and write in a background thread.

    Planning (its collectives) runs in the caller; copying boxes to host buffers, writing, and the commit
    collectives run in the background. At most ``host_budget_bytes`` of staged, not yet written bytes
    exist at a time (a single larger box is staged alone), so ``handle.staged`` may resolve only after
    part of the data is written. Do not change the saved tensors before ``handle.staged`` resolves.
    Use a ``process_group`` that nothing else runs collectives on while the save is in flight (the
    :class:`~omni_ckpt.CheckpointManager` makes its own). A later save given the same ``plan_cache`` waits
    for this one's ``handle.done`` before its first collective; without a shared cache, do not start
    another save on the group before ``handle.done`` resolves.

    Raises:
        ValueError: ``host_budget_bytes <= 0``; planning errors as in :func:`save` (raised here).
    """
    if host_budget_bytes <= 0:
        raise ValueError(f"host_budget_bytes must be > 0, got {host_budget_bytes}")
    prep = _prepare(state_dict, url, process_group, plan_cache)
    handle = AsyncSaveHandle()
    handle._thread = threading.Thread(
        target=_background, args=(prep, handle, host_budget_bytes, on_commit), name="omni-ckpt-save"
    )
    handle._thread.start()
    if plan_cache is not None:
        plan_cache.in_flight = handle.done
    return handle
