"""Moving a rank's boxes to its data file: segments, a reusable host buffer pool, parallel positional writes.

A rank's data section is cut into *segments* of at most ``piece_bytes``: runs of consecutive small boxes
(coalesced, so 20,000 tiny tensors cost a few writes and thread hand-offs, not 20,000) and pieces of big
boxes (a box larger than the budget is staged and written piece by piece). Pieces start at multiples of
``piece_bytes``, itself a multiple of the checksum chunk when the budget allows, so every chunk's CRC is
computed whole by the thread that writes it; with a budget under one chunk one thread does everything in
file order and the CRCs continue across pieces.

Host staging memory is a :class:`BufferPool` of equal buffers allocated once per save (anonymous ``mmap``
on CPU, so the pages go back to the OS when the save ends and the heap is not fragmented; pinned for CUDA
sources) and reused for every segment: at most ``budget`` bytes of staging exist at a time.

Writes go through a thread pool: ``os.pwritev`` at each segment's offset on a local disk (the GIL is
released for the copy into the page cache and for the CRC), one in-order stream elsewhere (an object store
upload is sequential).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_ckpt.checksum import chunk_count, crc, crc_into
from omni_ckpt.layout import CHUNK_BYTES, Write
from omni_ckpt.storage import FileSink

__all__ = [
    "WINDOW_BYTES",
    "BufferPool",
    "Part",
    "Segment",
    "Source",
    "host_bytes",
    "plan_segments",
    "pool_shape",
    "write_segments",
]

MAX_PIECE_BYTES = 32 << 20
WINDOW_BYTES = 512 << 10  # checksum then write (or read then checksum) this much at a time: still in L2
_SMALL_COPY = 64 << 10
_WRITEBACK_BYTES = 1 << 20  # segments this big start their write-back at once (smaller: a hand-off each)


def pool_shape(budget: int) -> tuple[int, int]:
    """``(piece_bytes, buffers)`` for a host budget of ``budget`` bytes: pieces of up to 32 MiB, a
    multiple of the checksum chunk, at least two buffers where the budget holds two chunks (so staging
    and writing overlap); one buffer of the whole budget below one chunk."""
    if budget < CHUNK_BYTES:
        return budget, 1
    piece = min(MAX_PIECE_BYTES, max(CHUNK_BYTES, budget // 4 // CHUNK_BYTES * CHUNK_BYTES))
    return piece, budget // piece


@dataclass(frozen=True, slots=True)
class Part:
    """Bytes ``[lo, hi)`` of write ``w`` (an index into the rank's writes)."""

    w: int
    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` contiguous bytes at ``offset`` from the start of the data section: ``parts`` in order."""

    offset: int
    length: int
    parts: tuple[Part, ...]


def plan_segments(writes: Sequence[Write], piece_bytes: int) -> list[Segment]:
    """Cut the data section into segments of at most ``piece_bytes`` (see the module docstring)."""
    out: list[Segment] = []
    run: list[Part] = []
    run_start = run_len = 0
    for i, w in enumerate(writes):
        if run and run_len + w.length > piece_bytes:
            out.append(Segment(run_start, run_len, tuple(run)))
            run, run_len = [], 0
        if w.length > piece_bytes:
            for lo in range(0, w.length, piece_bytes):
                hi = min(lo + piece_bytes, w.length)
                out.append(Segment(w.rel_offset + lo, hi - lo, (Part(i, lo, hi),)))
            continue
        if not run:
            run_start = w.rel_offset
        run.append(Part(i, 0, w.length))
        run_len += w.length
    if run:
        out.append(Segment(run_start, run_len, tuple(run)))
    return out


@dataclass(slots=True)
class Source:
    """Where a write's bytes come from: the box's tensor view, and its bytes when it is contiguous in host
    memory (``None`` for device or non-contiguous tensors, which are copied through the pool)."""

    tensor: torch.Tensor
    host: np.ndarray | None
    view: memoryview | None = None  # of ``host``, made by the caller: no allocation per box later
    flat: torch.Tensor | None = None  # contiguous bytes of a device or strided box, while it is staged

    def __post_init__(self) -> None:
        if self.host is not None and self.view is None:
            self.view = memoryview(self.host)


def host_bytes(t: torch.Tensor) -> np.ndarray | None:
    """The bytes of a contiguous CPU tensor as a flat uint8 array (no copy), else None. The array does
    not own or reference ``t``: it is valid while ``t`` (which the caller holds) is alive.

    The view is made over the tensor's address with ``ctypes`` rather than ``Tensor.numpy()``: freeing a
    ``numpy()`` view goes through torch's deleter, which releases the GIL, so dropping 20,000 of them in a
    background save waited a switch interval (5 ms) each behind a caller busy in Python (8-15 s).
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    n = t.numel() * t.element_size()
    if n == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer((ctypes.c_char * n).from_address(t.data_ptr()), dtype=np.uint8)


class BufferPool:
    """Up to ``count`` host buffers of ``piece_bytes``, allocated on first use and reused.

    ``acquire`` blocks while all of them are in use, which is what bounds staging to the budget.
    ``peak_bytes`` is the most bytes of buffers in use at once.
    """

    def __init__(self, budget: int, *, pin: bool = False) -> None:
        self.piece_bytes, self.count = pool_shape(budget)
        self.pin = pin
        self.peak_bytes = 0
        self._free: list[np.ndarray] = []
        self._maps: list[Any] = []
        self._made = 0
        self._in_use = 0
        self._cond = threading.Condition()

    def _allocate(self) -> np.ndarray:
        self._made += 1
        if self.pin:
            return torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=True).numpy()
        m = mmap.mmap(-1, self.piece_bytes)
        self._maps.append(m)
        return np.frombuffer(m, dtype=np.uint8)

    def acquire(self, abort: threading.Event | None = None) -> np.ndarray | None:
        """A free buffer (waiting for one if all are in use); None once ``abort`` is set."""
        with self._cond:
            while not self._free and self._made >= self.count:
                if abort is not None and abort.is_set():
                    return None
                self._cond.wait(0.1)
            if abort is not None and abort.is_set():
                return None
            buf = self._free.pop() if self._free else self._allocate()
            self._in_use += 1
            self.peak_bytes = max(self.peak_bytes, self._in_use * self.piece_bytes)
            return buf

    def release(self, buf: np.ndarray) -> None:
        with self._cond:
            self._free.append(buf)
            self._in_use -= 1
            self._cond.notify()

    def close(self) -> None:
        """Return the buffers' memory to the OS (no buffer may be in use)."""
        with self._cond:
            self._free.clear()
            maps, self._maps = self._maps, []
            self._made = 0
        for m in maps:
            with contextlib.suppress(BufferError):  # a view is still alive: the mapping goes with it
                m.close()


def _fill(
    buf: np.ndarray, seg: Segment, sources: Sequence[Source], crcs: list[list[int]]
) -> list[memoryview | None]:
    """Copy a segment's parts into ``buf``. Small whole boxes are checksummed here, from their source (the
    same bytes; no view is made per box); returns, per part, the view of ``buf`` still to checksum, or None."""
    views: list[memoryview | None] = []
    pos = 0
    mv = memoryview(buf)
    for p in seg.parts:
        n = p.hi - p.lo
        src = sources[p.w]
        if src.view is not None and n < _SMALL_COPY and n == len(src.view):
            mv[pos : pos + n] = src.view  # memcpy holding the GIL: no thread hand-off per box
            crcs[p.w][0] = crc(src.view)
            views.append(None)
            pos += n
            continue
        if src.host is not None:
            np.copyto(buf[pos : pos + n], src.host[p.lo : p.hi])  # releases the GIL for large copies
        elif n:
            if src.flat is None:  # once per box, not per piece (a no-op for a contiguous device tensor)
                src.flat = src.tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            torch.from_numpy(buf[pos : pos + n]).copy_(src.flat[p.lo : p.hi])
            if p.hi == src.flat.numel():  # the box's last piece (pieces are staged in order)
                src.flat = None
        views.append(mv[pos : pos + n])
        pos += n
    return views


class _Executor:
    """A thread pool of ``workers`` threads, or (0) running each job in the submitting thread."""

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="omni-ckpt-io") if workers else None

    def __enter__(self) -> _Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def submit(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        done: Future[None] = Future()
        try:
            fn(*args)
            done.set_result(None)
        except BaseException as exc:
            done.set_exception(exc)
        return done


def _write_window(
    sink: FileSink, window: list[tuple[Part, memoryview, int]], offset: int, crcs: list[list[int]]
) -> None:
    """Write a window of source bytes (one ``pwritev``), then fold them into their boxes' CRCs while they
    are still in cache from the write's own read (a CRC of cold memory runs at a third of the speed)."""
    sink.write([v for _, v, _ in window], offset)
    for p, v, lo in window:
        crc_into(crcs[p.w], v, lo, CHUNK_BYTES)


def write_segments(
    sink: FileSink,
    data_start: int,
    segments: Sequence[Segment],
    sources: Sequence[Source],
    lengths: Sequence[int],
    *,
    pool: BufferPool,
    stage_all: bool,
    threads: int,
    on_staged: Callable[[], None] | None = None,
) -> list[list[int]]:
    """Write every segment (copied through ``pool`` when ``stage_all`` or the source is not host
    memory) with ``threads`` writer threads; returns each write's per-chunk CRC-32Cs.

    Runs the staging in the calling thread and calls ``on_staged`` once every segment is copied out of
    the sources (they may change from then on).

    Raises:
        OSError, CheckpointError: the first write error (staging stops at it).
    """
    crcs = [[0] * chunk_count(n, CHUNK_BYTES) for n in lengths]
    in_order = not sink.parallel or pool.piece_bytes % CHUNK_BYTES != 0
    errors: list[BaseException] = []
    abort = threading.Event()

    def job(seg: Segment, part_views: list[memoryview | None], buf: np.ndarray | None) -> None:
        try:
            offset = data_start + seg.offset
            if buf is not None:
                whole = memoryview(buf)[: seg.length]
                p = seg.parts[0]
                if len(seg.parts) == 1 and part_views[0] is not None:  # a piece of a big box
                    for a in range(0, seg.length, WINDOW_BYTES):
                        sub = whole[a : a + WINDOW_BYTES]
                        sink.write([sub], offset + a)
                        crc_into(crcs[p.w], sub, p.lo + a, CHUNK_BYTES)  # hot from the write's read
                else:
                    for p, v in zip(seg.parts, part_views):  # staged boxes: CRC what _fill did not
                        if v is not None:
                            crc_into(crcs[p.w], v, p.lo, CHUNK_BYTES)
                    sink.write([whole], offset)
            else:
                window: list[tuple[Part, memoryview, int]] = []
                size, pos = 0, offset
                for p, v in zip(seg.parts, part_views):
                    assert v is not None
                    for a in range(0, len(v), WINDOW_BYTES):
                        sub = v[a : a + WINDOW_BYTES]
                        window.append((p, sub, p.lo + a))
                        size += len(sub)
                        if size >= WINDOW_BYTES:
                            _write_window(sink, window, pos, crcs)
                            pos, window, size = pos + size, [], 0
                if window:
                    _write_window(sink, window, pos, crcs)
            if seg.length >= _WRITEBACK_BYTES:
                sink.start_writeback(offset, seg.length)
        except BaseException as exc:
            errors.append(exc)
            abort.set()
            raise
        finally:
            if buf is not None:
                pool.release(buf)

    pending: list[Future[None]] = []
    # One segment (a state of small boxes) is written by this thread: a hand-off to a writer thread costs
    # a GIL switch interval (5 ms) each way behind a caller busy in Python, the write itself much less.
    workers = 0 if len(segments) <= 1 else 1 if in_order else max(1, threads)
    with _Executor(workers) as ex:
        for seg in segments:
            if abort.is_set():
                break
            if not stage_all and all(sources[p.w].view is not None for p in seg.parts):
                buf = None
                views = [sources[p.w].view[p.lo : p.hi] for p in seg.parts]  # type: ignore[index]
            else:
                buf = pool.acquire(abort)
                if buf is None:
                    break
                try:
                    views = _fill(buf, seg, sources, crcs)
                except BaseException:
                    pool.release(buf)
                    raise
            pending.append(ex.submit(job, seg, views, buf))
        if not abort.is_set() and on_staged is not None:
            on_staged()
    if errors:
        raise errors[0]
    for f in pending:
        f.result()
    return crcs
