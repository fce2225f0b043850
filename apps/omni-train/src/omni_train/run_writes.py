"""Rank 0's run files written off the training thread.

Rank 0 writes each step's ``actions.jsonl`` records and its ``metrics.jsonl`` row (with TensorBoard and the
progress bar). Done inline, that JSON encoding and file I/O sits between the step's last collective and
the next step's first one, so every other rank waits for it there (it showed as a few ms per step in
``time_s_per_rank["other"]`` and ``["data"]`` of the other ranks). :class:`RunWrites` runs those writes in
order on one thread of its own (a one-worker ``concurrent.futures.ThreadPoolExecutor``: FIFO, started on
the first write, so ranks that write nothing start no thread), overlapping the next step.

What a checkpoint promises is kept: the trainer calls :meth:`RunWrites.drain` before a checkpoint commits,
so the records and metrics of every step before it are on disk first, as with inline writes (a resumed run
cuts both files back to the steps before its checkpoint). On an error the trainer closes it, so the writes
of the steps that finished still reach disk and the thread stops.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["RunWrites"]


class RunWrites:
    """Writes run in submission order on one background thread; errors come back to the caller.

    Raises (from :meth:`submit`, :meth:`drain`, :meth:`close`):
        RuntimeError: an earlier write failed, named by what its :meth:`submit` said (file and step; the
            write's own error is its ``__cause__``); nothing after it is written, and every later call
            raises the same error.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-train-writes")
        self._pending: list[tuple[str, Future[Any]]] = []
        self._failed = False  # set on the writes thread by a failed write; later writes then do nothing
        self._error: RuntimeError | None = None

    def submit(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` behind the writes already queued (``args`` must not change afterwards);
        ``what`` names the write in its error (e.g. ``"<run>/metrics.jsonl, step 3"``)."""
        self._check(wait=False)
        self._pending.append((what, self._pool.submit(self._run, fn, args)))

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if self._failed:  # a file must not go on past a write that failed (a gap in its steps)
            return
        try:
            fn(*args)
        except BaseException:
            self._failed = True
            raise

    def drain(self) -> None:
        """Wait until every queued write is done."""
        self._check(wait=True)

    def close(self) -> None:
        """Drain, then stop the thread (also when a write failed)."""
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _check(self, *, wait: bool) -> None:
        if self._error is not None:
            raise self._error
        keep = []
        for what, f in self._pending:
            if wait or f.done():
                error = f.exception()
                if error is not None:
                    self._pool.shutdown(wait=False, cancel_futures=True)
                    self._pending = []
                    self._error = RuntimeError(f"omni-train: writing {what} failed: {error!r}")
                    raise self._error from error
            else:
                keep.append((what, f))
        self._pending = keep
