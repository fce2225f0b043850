"""The run-directory lock: one ``omni-train run`` at a time trains into a ``--out``.

Two runs into one directory both start otherwise, and the first's ``metrics.jsonl`` interleaves the
second's steps (``[0, 0, 1, 1, 2, ...]``) until the second fails at its first save. ``omni-train run``
takes this lock before any worker starts (:func:`acquire_run_lock`) and gives it back when the run ends,
normally or by an exception (:meth:`RunLock.release`, a context manager); a second run is refused with
one line naming the holder (pid, host, since when) and the lock file, exit status 2.

The lock is a file ``<out>/run.lock`` created with ``O_EXCL`` semantics (``os.link`` of a fully written
temporary file, so a reader never sees it half written), holding the holder's pid, host name, process
start time and job as JSON. Why not ``fcntl.flock``: flock is per open file on one kernel; on NFS and
many FUSE or object-store mounts it is emulated or unsupported, it cannot say who holds it, and under
``torchrun`` the lock belongs to a whole job spread over processes and hosts, not to one descriptor. The
price is stale locks, left by a run that was SIGKILLed: a lock whose holder pid no longer runs on this
host (or runs as another process: its start time differs) is replaced, with a notice on stderr. A lock
from another host cannot be checked from here; the message says to delete it if that run is gone.

Who holds it: outside ``torchrun``, the ``omni-train run`` process that launches the workers (they are
its children and never touch the lock). Under ``torchrun`` every worker runs the CLI itself, on one or
more hosts, and no rank can wait for another's decision before the process group exists; so each rank
acquires with the job's identity (:func:`torchrun_job`): the first creates the lock, the others of the
same job (and its restarted workers) join it, and every rank of any other job finds the first job's lock
and exits 2 before ``init_process_group``; no rank waits for one that was refused. The rank that
created the file removes it when its worker returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from omni_train.config import ConfigError

__all__ = ["LOCK_NAME", "LockHolder", "RunLock", "acquire_run_lock", "refuse_if_locked", "torchrun_job"]

LOCK_NAME = "run.lock"


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or
    None where ``/proc`` does not say (not Linux, or no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # the command name (field 2) may hold spaces and parentheses: split after its last ")"
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run directory: ``pid`` on ``host`` (``socket.gethostname()``), its process start time
    (``started``, clock ticks since boot, None off Linux), its ``torchrun`` job (None outside one), and
    ``since`` (UTC, ISO 8601)."""

    pid: int
    host: str
    started: int | None
    job: str | None
    since: str

    @classmethod
    def me(cls, job: str | None) -> LockHolder:
        pid = os.getpid()
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return cls(pid, socket.gethostname(), _start_time(pid), job, since)

    def running(self) -> bool | None:
        """Whether the holder still runs: True or False on this host, None on another (not checkable)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: it exists
        if _zombie(self.pid):
            return False
        now = _start_time(self.pid)
        # the same pid with another start time is a later process that reused the number
        return self.started is None or now is None or now == self.started

    def describe(self) -> str:
        job = f", torchrun job {self.job}" if self.job else ""
        return f"pid {self.pid} on {self.host}{job}, since {self.since}"


def _read_holder(path: Path) -> LockHolder | None:
    """The holder a lock file names; None if there is no such file (it was just released).

    Raises:
        ConfigError: naming ``path`` when it is not a lock this module wrote.
    """
    try:
        with open(path, "rb") as f:
            content = f.read(1 << 16)  # a lock is ~150 bytes; whatever else is there is not one
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"--out: cannot read the lock file {path} ({exc.strerror})") from None
    try:
        raw = json.loads(content)
        holder = LockHolder(
            pid=int(raw["pid"]),
            host=str(raw["host"]),
            started=None if raw.get("started") is None else int(raw["started"]),
            job=None if raw.get("job") is None else str(raw["job"]),
            since=str(raw.get("since", "?")),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"--out: {path.parent} holds a lock file {path} that is not an omni-train lock ({exc}); "
            "delete it if no run is using that directory"
        ) from None
    if not 0 < holder.pid < 2**31:  # 0 and -1 would make os.kill signal a group or everything
        raise ConfigError(
            f"--out: the lock file {path} names pid {holder.pid}; delete it if no run is using it"
        )
    return holder


class RunLock:
    """A held run-directory lock (:func:`acquire_run_lock`); a context manager that releases it."""

    def __init__(self, path: Path, holder: LockHolder, owner: bool) -> None:
        self.path, self.holder, self.owner = path, holder, owner

    def release(self) -> None:
        """Remove the lock file if this process created it and it still names this process (a joiner of
        a ``torchrun`` job leaves it to the rank that created it). Idempotent."""
        if not self.owner:
            return
        self.owner = False
        with contextlib.suppress(OSError, ConfigError):
            current = _read_holder(self.path)
            if current is not None and (current.pid, current.host, current.started) == (
                self.holder.pid,
                self.holder.host,
                self.holder.started,
            ):
                self.path.unlink()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def torchrun_job() -> str | None:
    """The identity of the distributed job this process is a worker of (None outside one): the
    rendezvous id (``TORCHELASTIC_RUN_ID``), unique per job when given; with torchrun's default id
    ``none``, or under a launcher that sets only ``MASTER_ADDR`` / ``MASTER_PORT`` (SLURM or MPI
    scripts), the master's endpoint, which every rank of one job shares and a static rendezvous keeps
    over restarts."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is not None and run_id != "none":
        return run_id
    if run_id is None and "MASTER_ADDR" not in os.environ:
        return None
    return f"{run_id or 'job'}@{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def _refusal(out: Path, path: Path, holder: LockHolder, running: bool | None) -> ConfigError:
    where = "" if running else " (another host: cannot tell from here whether it still runs)"
    return ConfigError(
        f"--out: {out} is in use by another omni-train run ({holder.describe()}){where}; lock {path}; "
        "wait for it to end or choose another --out (delete the lock only if that run is gone)"
    )


def refuse_if_locked(out: Path, job: str | None = None) -> None:
    """Raise the refusal :func:`acquire_run_lock` would raise if ``out`` is held by a running run now
    (another job's), without taking the lock: for checks that would otherwise speak first (a running
    run's checkpoints). A stale or absent lock passes.

    Raises:
        ConfigError: ``out`` is held (the holder and the lock file named).
    """
    holder = _read_holder(out / LOCK_NAME)
    if holder is None or (job is not None and holder.job == job):
        return
    running = holder.running()
    if running is not False:
        raise _refusal(out, out / LOCK_NAME, holder, running)


def _create(path: Path, holder: LockHolder, out: Path) -> bool:
    """Create ``path`` holding ``holder`` as one atomic step; False if it exists."""
    tmp = out / f".{LOCK_NAME}.{holder.host}.{holder.pid}.tmp"
    with contextlib.suppress(OSError):
        tmp.unlink()  # left by an earlier process with our pid (pids are reused); the name is ours alone
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            json.dump(asdict(holder), f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise ConfigError(
            f"--out: {out} is not writable: cannot create {tmp.name} there ({exc.strerror})"
        ) from None
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        # a file system without hard links: O_EXCL on the lock itself (a reader may then, for a moment,
        # find it empty: _read_holder refuses with the file named, which is the safe side)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(holder), f)
        return True
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _print_notice(line: str) -> None:
    print(f"omni-train: {line}", file=sys.stderr)


def acquire_run_lock(
    out: Path, *, job: str | None = None, notice: Callable[[str], None] = _print_notice
) -> RunLock:
    """Create the run directory ``out`` if needed and take its lock (see the module docstring).

    Args:
        out: the run directory.
        job: the ``torchrun`` job of this worker (:func:`torchrun_job`); workers of one job share the
            lock; None: this process alone holds it.
        notice: where the one-line notice of a replaced stale lock goes (stderr).

    Returns:
        The held :class:`RunLock` (``owner`` False when this worker joined its job's lock).

    Raises:
        ConfigError: one line: ``out`` cannot be created (the OS's reason), is not writable, is held by
            a running run (its pid, host and the lock file named), or holds a lock file that is not one.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"--out: {out} is a file, not a directory; name a run directory") from None
    except OSError as exc:
        raise ConfigError(f"--out: cannot create the run directory {out} ({exc.strerror or exc})") from None
    me = LockHolder.me(job)
    path = out / LOCK_NAME
    for _ in range(8):  # each pass either takes the lock, joins or refuses, or saw it change under it
        if _create(path, me, out):
            return RunLock(path, me, owner=True)
        holder = _read_holder(path)
        if holder is None:
            continue  # released between our create and our read
        running = holder.running()
        if job is not None and holder.job == job and running is not False:
            return RunLock(path, holder, owner=False)
        if running is not False:
            raise _refusal(out, path, holder, running)
        # stale: its holder is gone. Moved aside (atomic: of two replacers one wins, the other finds the
        # new lock on its next pass), then checked to be the lock we judged, not a newer one.
        aside = out / f".{LOCK_NAME}.stale.{me.pid}"
        try:
            os.replace(path, aside)
        except FileNotFoundError:
            continue
        try:
            moved = _read_holder(aside)
        except ConfigError:
            moved = None
        if moved != holder:
            with contextlib.suppress(OSError):
                os.link(aside, path)  # put the newer lock back
            aside.unlink()
            continue
        aside.unlink()
        if holder.job is None or holder.job != job:
            notice(
                f"replaced a stale lock {path} of a run that is gone ({holder.describe()}; that process "
                "no longer runs)"
            )
    raise ConfigError(f"--out: the lock {path} keeps changing; another run is starting into {out}")
