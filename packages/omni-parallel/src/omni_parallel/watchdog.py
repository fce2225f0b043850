"""Hang watchdog: every rank beats a heartbeat through a key-value store; a rank that goes silent, or a run
that stops making progress, is named by the others and the run ends in bounded time.

A stopped process (``SIGSTOP``, a frozen host, a process wedged in the kernel) cannot report itself and the
elastic agent cannot see it: it is alive. Its peers block in their next collective with it until the
group's timeout (gloo's default is 30 minutes). MegaScale's production runs detect such ranks from the
heartbeats of every rank (MegaScale-Omni §7-8; MegaScale §5 "fault tolerance": a heartbeat per executor,
a driver that names the failing one). Here the ranks watch each other, no driver is needed:

* a daemon thread per rank writes ``beat/<rank>`` every ``interval_s``: a counter, the rank's host and
  pid, the training step, the last pipeline action (read through a callable, e.g. the executor's
  ``current_action`` attribute) and a progress counter (bumped by the training thread);
* the same thread reads its peers' beats. Time is measured on the observer's own monotonic clock (no
  clock agreement between hosts is needed): a peer whose beat counter has not changed for
  ``hang_timeout_s`` is **silent** (its process is stopped or gone); when no watched rank's progress
  counter has changed for ``hang_timeout_s`` the run is **stalled**, and the rank whose progress stopped
  first is named;
* the first observer to decide writes the verdict with ``compare_set`` (one verdict per run), and every
  watchdog that sees a verdict acts on it: writes its line to ``verdict_file`` (or, the decider only,
  prints it), kills the named process if it runs on this machine (``SIGKILL``: a stopped process handles
  no other signal; the pid is checked against the process's start time first, so a recycled pid is never
  killed) and exits with :data:`HANG_EXIT_CODE` (``os._exit``: the training thread may be blocked inside
  a collective that would never return). An elastic agent then restarts the workers from the last
  checkpoint or ends the run.

If the store itself stops answering for ``hang_timeout_s`` (it runs inside a stopped process, e.g. rank 0
under ``torchrun``), the watchdog names ``store_owner`` from its last beat and acts the same way,
without the store.

A rank that finishes calls :meth:`Watchdog.stop`, which beats once more as ``done``: a finished rank is
never taken for a silent one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

__all__ = [
    "HANG_EXIT_CODE",
    "HangVerdict",
    "Heartbeat",
    "Watchdog",
    "WatchdogSpec",
    "default_store_client",
    "kill_if_local",
    "process_start_ticks",
]

HANG_EXIT_CODE = 86
"""Exit status of a rank that stops because the watchdog named a hung rank (distinct from a crash's 1)."""


@dataclass(frozen=True)
class WatchdogSpec:
    """How a :class:`Watchdog` watches.

    Attributes:
        hang_timeout_s: seconds (> 0) without a heartbeat (a silent rank) or without progress on any
            watched rank (a stalled run) before the run is stopped.
        interval_s: seconds between beats and checks (> 0, below ``hang_timeout_s``); ``None``: a fifth of
            ``hang_timeout_s``, at most 5 s.
        prefix: key prefix in the store (one per attempt, so a restarted run never reads old beats).
        verdict_file: where every acting rank writes the verdict's one line (atomically; a launcher
            reports it); ``None``: the deciding rank prints it on stderr.
        exit_code: the exit status of a rank that stops on a verdict.
        kill_hung: ``SIGKILL`` the named rank's process when it runs on this machine (same host name and
            the same process start time as its heartbeat says).
        watch: how many ranks each rank watches, the next ones in rank order (wrapping); ``None``: every
            other rank (the store reads per check grow with it: bound it at large worlds).
        store_owner: the rank whose process hosts the store (named when the store stops answering);
            ``None``: not a rank (a launcher, a test harness).

    Raises:
        ValueError: a field out of range (named).
    """

    hang_timeout_s: float
    interval_s: float | None = None
    prefix: str = "omni/watchdog"
    verdict_file: str | None = None
    exit_code: int = HANG_EXIT_CODE
    kill_hung: bool = True
    watch: int | None = None
    store_owner: int | None = None

    def __post_init__(self) -> None:
        t = self.hang_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < float("inf"):
            raise ValueError(f"WatchdogSpec.hang_timeout_s must be a number of seconds > 0, got {t!r}")
        i = self.interval_s
        if i is not None and (isinstance(i, bool) or not isinstance(i, int | float) or not 0 < i < t):
            raise ValueError(f"WatchdogSpec.interval_s must be > 0 and below hang_timeout_s {t}, got {i!r}")
        if not isinstance(self.exit_code, int) or not 1 <= self.exit_code <= 255:
            raise ValueError(f"WatchdogSpec.exit_code must be an int in 1..255, got {self.exit_code!r}")
        if self.watch is not None and (not isinstance(self.watch, int) or self.watch < 1):
            raise ValueError(f"WatchdogSpec.watch must be a positive int or None, got {self.watch!r}")

    @property
    def interval(self) -> float:
        """Seconds between beats (``interval_s`` resolved)."""
        return self.interval_s if self.interval_s is not None else min(self.hang_timeout_s / 5, 5.0)


def process_start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), which
    tells a process from a later one that got the same pid; ``None`` off Linux or when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: count from the last ')'
    return int(stat[stat.rindex(")") + 2 :].split()[19])


@dataclass(frozen=True)
class Heartbeat:
    """One rank's beat as stored (``json``).

    Attributes:
        rank, host, pid: who beats. start_ticks: :func:`process_start_ticks` of ``pid``.
        beat: counter, +1 per beat. progress: the training thread's counter (:meth:`Watchdog.progress`).
        step: the training step the rank is in. action: its last pipeline action (``None``: outside one).
        done: the rank finished (:meth:`Watchdog.stop`).
    """

    rank: int
    host: str
    pid: int
    start_ticks: int | None
    beat: int
    progress: int
    step: int
    action: str | None
    done: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Heartbeat:
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class HangVerdict:
    """The rank the watchdog named and why.

    Attributes:
        rank, host, pid, start_ticks, step, action: the named rank, from its last heartbeat (``step`` -1
            and ``host`` ``"?"`` when it never beat).
        kind: ``"silent"`` (no heartbeat), ``"stalled"`` (no progress anywhere; it stopped first) or
            ``"store"`` (the store it hosts stopped answering).
        seconds: how long the observer saw nothing from it.
        timeout_s: the ``hang_timeout_s`` it was judged by.
        observer: the rank that decided.
    """

    rank: int
    host: str
    pid: int
    start_ticks: int | None
    step: int
    action: str | None
    kind: str
    seconds: float
    timeout_s: float
    observer: int

    def line(self) -> str:
        """The verdict in one line (what a launcher prints)."""
        what = {
            "silent": f"no heartbeat for {self.seconds:.1f} s",
            "stalled": f"no progress for {self.seconds:.1f} s (the first rank to stop; every rank stalled)",
            "store": f"the store it hosts did not answer for {self.seconds:.1f} s",
        }[self.kind]
        where = f"at step {self.step}" if self.step >= 0 else "before its first step"
        action = f", last pipeline action {self.action}" if self.action else ", outside a pipeline action"
        return (
            f"rank {self.rank} (host {self.host}, pid {self.pid}) hung {where}{action}: {what} "
            f"(hang timeout {self.timeout_s:g} s, seen by rank {self.observer})"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> HangVerdict:
        return cls(**json.loads(raw))


def default_store_client(timeout_s: float, prefix: str) -> dist.Store:
    """A new client of the default process group's TCP store (e.g. the one ``torchrun`` or an elastic
    launcher's rendezvous set up), with its own ``timeout_s``, under ``prefix``.

    Its own connection and timeout: the group's store client waits as long as the group's timeout, and a
    watchdog must notice in seconds when the store's process stops answering.

    Raises:
        RuntimeError: no default process group, or its store is not a TCP store (e.g. a ``file://`` one).
    """
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        raise RuntimeError(f"the watchdog needs a TCP store, the default group has {type(store).__name__}")
    client = dist.TCPStore(
        store.host, store.port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return dist.PrefixStore(prefix.rstrip("/") + "/", client)


class _Peer:
    """An observer's view of one watched rank: its last beat and when (observer's clock) it last moved."""

    def __init__(self, now: float) -> None:
        self.last: Heartbeat | None = None
        self.beat_at = now  # last time its beat counter changed (or the observer started)
        self.moved_at = now  # last time its progress counter changed


class Watchdog:
    """One rank's heartbeat and its watch over the others (a daemon thread; see the module docstring).

    The training thread reports where it is through plain attributes and :meth:`progress` (no lock, no
    store call on the training path): ``step`` is read at each beat, ``where()`` too.

    Args:
        spec: timeouts and what to do.
        store: a store every rank reaches (e.g. :func:`default_store_client`), with a timeout of its own
            shorter than ``spec.hang_timeout_s``.
        rank, world_size: this rank and the world.
        where: returns this rank's current pipeline action (``None``: outside one), e.g.
            ``lambda: executor.current_action``; read by the watchdog thread.
        on_verdict: called with the verdict instead of the default action (report, kill, ``os._exit``);
            for callers that stop the run their own way.
    """

    def __init__(
        self,
        spec: WatchdogSpec,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        where: Callable[[], object] | None = None,
        on_verdict: Callable[[HangVerdict], None] | None = None,
    ) -> None:
        self.spec, self.store, self.rank, self.world = spec, store, rank, world_size
        self.where = where or (lambda: None)
        self.on_verdict = on_verdict or self._act
        self.step = -1
        self._progress = 0
        self._moves = 0
        self._beat = 0
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._ticks = process_start_ticks(self._pid)
        n = world_size - 1 if spec.watch is None else min(spec.watch, world_size - 1)
        self.watched = [(rank + k) % world_size for k in range(1, n + 1)]
        self._peers: dict[int, _Peer] = {}
        self._store_ok_at = 0.0
        self._own = (0, 0.0)
        self._last_beat: Heartbeat | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # a new step: beat now
        self._thread: threading.Thread | None = None
        self.verdict: HangVerdict | None = None

    # -- the training thread's side ------------------------------------------------------------------
    def progress(self, step: int | None = None) -> None:
        """The training thread moved on (a step began, an action ran); ``step``: the step it is in, which
        also makes the thread beat at once (so the step a stopped rank is named with is not a beat old)."""
        self._progress += 1
        if step is not None:
            self.step = step
            self._wake.set()

    def start(self) -> Watchdog:
        """Beat once, then start the thread (every rank calls it at about the same point)."""
        now = time.monotonic()
        self._peers = {r: _Peer(now) for r in self.watched}
        self._store_ok_at = now
        self._own = (self._progress, now)  # this rank's progress (as beaten) and when it last changed
        self._write_beat(done=False)
        self._thread = threading.Thread(target=self._loop, name=f"omni-watchdog-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and beat once more as done (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._thread = None
        with contextlib.suppress(Exception):  # a store gone at the end of a run changes nothing
            self._write_beat(done=True)

    # -- the thread ---------------------------------------------------------------------------------------
    def _write_beat(self, *, done: bool) -> None:
        where = self.where()
        action = None if where is None else str(where)
        if self._last_beat is not None and action != self._last_beat.action:
            self._moves += 1  # a new pipeline action since the last beat is progress too
        beat = Heartbeat(
            self.rank,
            self._host,
            self._pid,
            self._ticks,
            self._beat,
            self._progress + self._moves,
            self.step,
            action,
            done,
        )
        self._beat += 1
        self._last_beat = beat
        self.store.set(f"beat/{self.rank}", beat.to_json())

    def _loop(self) -> None:
        due = time.monotonic() + self.spec.interval
        while not self._stop.is_set():
            woken = self._wake.wait(max(0.0, due - time.monotonic()))
            if self._stop.is_set():
                return
            if woken and time.monotonic() < due:
                self._wake.clear()
                with contextlib.suppress(RuntimeError, dist.DistStoreError):  # the next check reports it
                    self._write_beat(done=False)
                continue
            self._wake.clear()
            due = time.monotonic() + self.spec.interval
            verdict = self.check(time.monotonic())
            if verdict is not None and not self._stop.is_set():
                self.verdict = verdict
                self.on_verdict(verdict)
                return

    def check(self, now: float) -> HangVerdict | None:
        """One round: beat, read the verdict and the watched ranks' beats, decide (``now``: monotonic)."""
        try:
            self._write_beat(done=False)
            if self.store.check(["verdict"]):
                return HangVerdict.from_json(self.store.get("verdict"))
            for r in self.watched:
                if self.store.check([f"beat/{r}"]):
                    self._see(r, Heartbeat.from_json(self.store.get(f"beat/{r}")), now)
        except (RuntimeError, dist.DistStoreError):  # a store timeout is DistStoreError (a RuntimeError)
            if now - self._store_ok_at < self.spec.hang_timeout_s or self.spec.store_owner is None:
                return None
            return self._verdict(self.spec.store_owner, "store", now - self._store_ok_at, publish=False)
        self._store_ok_at = now
        return self._decide(now)

    def _see(self, rank: int, beat: Heartbeat, now: float) -> None:
        peer = self._peers[rank]
        if peer.last is None or beat.beat != peer.last.beat:
            peer.beat_at = now
        if peer.last is None or beat.progress != peer.last.progress or beat.step != peer.last.step:
            peer.moved_at = now
        peer.last = beat

    def _decide(self, now: float) -> HangVerdict | None:
        live = {r: p for r, p in self._peers.items() if p.last is None or not p.last.done}
        timeout = self.spec.hang_timeout_s
        silent = [r for r, p in live.items() if now - p.beat_at >= timeout]
        if silent:
            r = min(silent, key=lambda r: live[r].beat_at)
            return self._verdict(r, "silent", now - live[r].beat_at, publish=True)
        moving = [p for p in live.values() if now - p.moved_at < timeout]
        mine = self._last_beat.progress if self._last_beat is not None else 0
        if self._own[0] != mine:
            self._own = (mine, now)
        # A stopped rank stalls every rank before its own silence is due (it stopped moving first):
        # while any beat is late, wait for the silence verdict, which names the cause, not a victim.
        late = any(now - p.beat_at > 3 * self.spec.interval for p in live.values())
        # stalled: this rank too, since a rank still moving may be about to unblock the others
        if live and not moving and not late and now - self._own[1] >= timeout:
            moved = {r: p.moved_at for r, p in live.items()} | {self.rank: self._own[1]}
            r = min(moved, key=lambda r: (moved[r], r))  # this rank may be the one that stopped first
            return self._verdict(r, "stalled", now - moved[r], publish=True)
        return None

    def _verdict(self, rank: int, kind: str, seconds: float, *, publish: bool) -> HangVerdict:
        last = (
            self._last_beat if rank == self.rank else self._peers[rank].last if rank in self._peers else None
        )
        verdict = HangVerdict(
            rank=rank,
            host=last.host if last else "?",
            pid=last.pid if last else -1,
            start_ticks=last.start_ticks if last else None,
            step=last.step if last else -1,
            action=last.action if last else None,
            kind=kind,
            seconds=round(seconds, 1),
            timeout_s=self.spec.hang_timeout_s,
            observer=self.rank,
        )
        if not publish:
            return verdict
        mine = verdict.to_json()
        try:
            stored = self.store.compare_set("verdict", "", mine)
        except (RuntimeError, dist.DistStoreError):
            return verdict
        return HangVerdict.from_json(stored)

    # -- acting on a verdict ------------------------------------------------------------------------------
    def _act(self, verdict: HangVerdict) -> None:
        """Report the verdict, kill the named process if it is on this machine, exit the process."""
        if self.spec.verdict_file is not None:
            _write_atomic(Path(self.spec.verdict_file), verdict.line(), self.rank)
        elif verdict.observer == self.rank:
            print(f"omni-parallel watchdog: {verdict.line()}", file=sys.stderr, flush=True)
        if self.spec.kill_hung and verdict.rank != self.rank:
            kill_if_local(verdict)
        sys.stderr.flush()
        os._exit(self.spec.exit_code)


def kill_if_local(verdict: HangVerdict) -> bool:
    """``SIGKILL`` the verdict's process if it runs on this machine (same host name, and the pid's start
    time equals the one its heartbeat gave, so a recycled pid is left alone); returns whether it did."""
    if verdict.host != socket.gethostname() or verdict.pid <= 0 or verdict.start_ticks is None:
        return False
    if process_start_ticks(verdict.pid) != verdict.start_ticks:
        return False
    try:
        os.kill(verdict.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _write_atomic(path: Path, text: str, rank: int) -> None:
    tmp = path.with_name(f"{path.name}.{rank}.tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
