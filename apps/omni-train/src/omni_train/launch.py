"""Start worker processes on one machine through torch's elastic launcher, and what a worker learns
from the launcher's environment.

``omni-train run`` outside ``torchrun`` calls :func:`launch` with the trainer's worker entry point
(:func:`omni_train.worker.worker_main`): a :class:`LaunchConfig` with ``nproc`` workers, a c10d rendezvous
on 127.0.0.1 at a free port and ``max_restarts``; failed workers are restarted by the elastic agent and
resume from the last committed checkpoint (:func:`restart_count`). Under ``torchrun`` (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` ... set) :func:`under_torchrun` is true and the CLI runs the worker inline.
This module imports nothing of the trainer: the trainer reads :func:`restart_count` from it.

An expected restart is reported in one line per failure ("worker local rank 0 (pid 123) died: SIGKILL;
restarting the workers (restart 1 of 1)"), then rank 0 of the new workers says which step it resumes
from; the elastic agent's own per-failure traceback (of its process-joining code, not of the worker) is
left out. A run out of restarts raises :class:`ChildFailedError`, which names the rank and its error.

Three ways the workers end a run on purpose, each reported in one line through a report folder the
launcher makes for the run (:func:`report_dir`, passed in the environment):

* a hang: a worker's watchdog (:mod:`omni_parallel.watchdog`) names a hung rank in ``<folder>/hang`` and
  the survivors exit; the launcher says that line instead of the agent's failure record ("...; restarting
  the workers (restart 1 of 1)"), or raises :class:`RunStopped` with it when no restart is left;
* bad numerics: the numerics guard (:mod:`omni_parallel.numerics`) stops the run with one line naming the
  step and what was non-finite; rank 0 writes it to ``<folder>/numerics`` and the workers exit with
  :data:`NUMERICS_EXIT_CODE` (no traceback), reported like a hang (a restart resumes from the last
  committed checkpoint, which is finite: the guard never commits a non-finite one);
* a stop signal (:mod:`omni_parallel.preemption`): the launcher handles ``SIGTERM`` / ``SIGINT`` itself
  (the elastic agent's own handling would raise ``SignalException`` through the user's terminal and leave
  workers that finished waiting for it until ``SIGKILL``): it forwards the signal to the workers and
  kills them if they have not stopped within ``grace_s``; they finish their step, commit a checkpoint,
  rank 0 writes a :class:`StopReport` to ``<folder>/stopped``, and they return normally, so the agent
  ends the run as a success and the launcher raises :class:`RunStopped`. A signal sent to the workers
  alone ends the same way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

__all__ = [
    "NUMERICS_EXIT_CODE",
    "REPORT_DIR_ENV",
    "ChildFailedError",
    "RunStopped",
    "StopReport",
    "free_port",
    "launch",
    "report_dir",
    "restart_count",
    "under_torchrun",
]

REPORT_DIR_ENV = "OMNI_TRAIN_REPORT_DIR"
"""The environment variable that tells the workers the launcher's report folder."""

# Records of a worker failure the elastic agent logs (with its own traceback), of the survivors it
# terminates and of a stop signal it forwards: replaced by one line each (see the module docstring).
_AGENT_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.multiprocessing.spawn",
    "torch.distributed.elastic.agent.server.api",
)
_QUIET = ("Terminating process", "Closing process", "Received ", "Unable to shutdown process")


@dataclass(frozen=True)
class StopReport:
    """How the workers stopped on a signal (rank 0 writes it, the launcher reads it).

    Attributes:
        signal: the signal's name (``"SIGTERM"``).
        step: the steps done when the ranks stopped, which is the step of the checkpoint committed then.
    """

    signal: str
    step: int

    def write(self, folder: Path) -> None:
        tmp = folder / "stopped.tmp"
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, folder / "stopped")

    @classmethod
    def read(cls, folder: Path) -> StopReport | None:
        try:
            return cls(**json.loads((folder / "stopped").read_text()))
        except (OSError, ValueError, TypeError):
            return None


class RunStopped(Exception):
    """The workers ended the run on purpose: a stop signal or a hang verdict, said in one line.

    Attributes:
        signal: the stop signal's name (``None``: a hang).
        report: the workers' :class:`StopReport` (``None``: they did not commit a checkpoint in time).
        hang: the watchdog's verdict line (``None``: a signal).
        grace_s: the grace period the workers had.
    """

    def __init__(
        self, *, signal: str | None = None, report: StopReport | None = None, hang: str | None = None,
        grace_s: float = 0.0,
    ) -> None:  # fmt: skip
        self.signal, self.report, self.hang, self.grace_s = signal, report, hang, grace_s
        super().__init__(hang or f"stopped by {signal}")

    @property
    def exit_code(self) -> int:
        """``128 + signal number`` for a signal (as a shell reports a process killed by it), 1 for a hang."""
        return 128 + int(signal.Signals[self.signal]) if self.signal else 1


class _RestartReporter(logging.Filter):
    """Turns the agent's failure records into one line on stderr and drops them and the SIGTERM notices."""

    def __init__(self, max_restarts: int, reports: Path | None = None) -> None:
        super().__init__()
        self.max_restarts, self.failures, self.reports = max_restarts, 0, reports

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("failed (exitcode"):
            code, local_rank, pid = record.args[:3]  # type: ignore[index]
            self.failures += 1
            hang = _hang_verdict(self.reports)
            if hang is not None:  # the watchdog's (or the guard's) line says more than an exit code
                if self.failures <= self.max_restarts:
                    restart = f"restart {self.failures} of {self.max_restarts}"
                    print(f"omni-train: {hang}; restarting the workers ({restart})", file=sys.stderr)
                    for name in _VERDICT_FILES:
                        (self.reports / name).unlink(missing_ok=True)  # type: ignore[operator]
                return False  # out of restarts: launch raises RunStopped with it
            how = f"exit code {code}"
            if isinstance(code, int) and code < 0:
                with contextlib.suppress(ValueError):
                    how = signal.Signals(-code).name
            then = (
                f"restarting the workers (restart {self.failures} of {self.max_restarts})"
                if self.failures <= self.max_restarts
                else "no restarts left"
            )
            print(
                f"omni-train: worker local rank {local_rank} (pid {pid}) died: {how}; {then}", file=sys.stderr
            )
            return False
        return not msg.startswith(_QUIET)


# What a worker leaves in the report folder when it ends the run on purpose, read in this order.
_VERDICT_FILES = ("hang", "numerics")

# The exit status of a worker the numerics guard stopped (a distinct code, as the watchdog's 86).
NUMERICS_EXIT_CODE = 87


def _hang_verdict(reports: Path | None) -> str | None:
    """The line of the worker that ended the run on purpose (a hang verdict or a numerics stop), if any."""
    if reports is None:
        return None
    for name in _VERDICT_FILES:
        try:
            line = (reports / name).read_text().strip()
        except OSError:
            continue
        if line:
            return line
    return None


@contextlib.contextmanager
def _reported_restarts(max_restarts: int, reports: Path | None = None) -> Iterator[None]:
    reporter = _RestartReporter(max_restarts, reports)
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    for lg in loggers:
        lg.addFilter(reporter)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(reporter)


class _StopForwarder:
    """The launcher's ``SIGTERM`` / ``SIGINT``: forwarded to the workers; after ``grace_s`` the workers
    still alive are killed and the launcher exits (``128 + signal``), saying so with ``hint``."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float, hint: str) -> None:
        self.grace_s, self.hint = grace_s, hint
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._timer: threading.Timer | None = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def uninstall(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return  # the workers have it; the grace period runs
        self.received = signal.Signals(signum)
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()
        for child in multiprocessing.active_children():  # the workers (the agent spawned them here)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)  # type: ignore[arg-type]

    def _expire(self) -> None:
        for child in multiprocessing.active_children():
            child.kill()
        sig = self.received or signal.SIGTERM  # set before the timer starts
        print(  # the workers were killed mid-step: rank 0's progress bar has no newline yet
            f"\nomni-train: stopped by {sig.name}; the workers did not stop within "
            f"{self.grace_s:g} s (train.preempt_grace_s) and were killed; {self.hint}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + int(sig))


def under_torchrun() -> bool:
    """True when this process is a worker started by ``torchrun`` / an elastic agent."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def restart_count() -> int:
    """How many times torchrun's elastic agent restarted this worker (0: its first start, or no agent)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def report_dir() -> Path | None:
    """The launcher's report folder for this run's workers (``None``: not started by :func:`launch`)."""
    folder = os.environ.get(REPORT_DIR_ENV)
    return Path(folder) if folder else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reports free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    worker: Callable[..., object],
    *args: object,
    nproc: int,
    max_restarts: int,
    grace_s: float = 30.0,
    resume_hint: str = "resume with --resume",
) -> dict[int, object]:
    """Run ``worker(*args)`` on ``nproc`` local processes; return rank -> result.

    Args:
        worker: the entry point of each process (e.g. :func:`omni_train.worker.worker_main`): a
            module-level function, as the processes are spawned and import it by name; ``args`` are
            pickled to them.
        max_restarts: how many times the elastic agent restarts the workers after one fails.
        grace_s: on ``SIGTERM`` / ``SIGINT`` to the launcher, seconds the workers get to stop on their
            own before ``SIGKILL`` (then the launcher exits with ``128 + signal``, saying ``resume_hint``).

    Raises:
        ChildFailedError: a worker failed more than ``max_restarts`` times (names the rank and its error).
        RunStopped: a stop signal (to the launcher or the workers), or a hang the workers' watchdog named
            with no restart left.
    """
    # One OpenMP/MKL thread per worker (as torchrun does), set before the workers start: threads created
    # later (the async checkpoint writer, the loader's prefetch) then cannot change how a kernel splits
    # its work, which keeps float results bit-identical from run to run (exact --resume).
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    # Workers get their own store per attempt instead of sharing the rendezvous store: with the shared
    # store, restarted workers read the previous attempt's gloo addresses and never connect
    # (pytorch/pytorch#135712), which breaks --max-restarts.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    reports = Path(tempfile.mkdtemp(prefix="omni-train-reports-"))
    before = os.environ.get(REPORT_DIR_ENV)
    os.environ[REPORT_DIR_ENV] = str(reports)  # spawned workers inherit it
    try:
        return _launch(worker, args, nproc, max_restarts, grace_s, reports, resume_hint)
    finally:
        if before is None:
            os.environ.pop(REPORT_DIR_ENV, None)
        else:
            os.environ[REPORT_DIR_ENV] = before
        shutil.rmtree(reports, ignore_errors=True)


def _launch(
    worker: Callable[..., object],
    args: tuple[object, ...],
    nproc: int,
    max_restarts: int,
    grace_s: float,
    reports: Path,
    resume_hint: str,
) -> dict[int, object]:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"omni-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": 120},
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        local_addr="127.0.0.1",
        # SIGTERM and SIGINT are the launcher's own (_StopForwarder), the rest the agent's
        signals_to_handle="SIGHUP,SIGQUIT",
    )
    forwarder = _StopForwarder(grace_s, resume_hint)
    forwarder.install()
    # A worker killed on purpose (a hung one, or one past the grace period) leaves its semaphores to
    # multiprocessing's resource tracker, which warns about them at exit; it is started with this
    # interpreter's -W options, so this keeps the run's last line the one that says what happened.
    quiet_tracker = "ignore::UserWarning:multiprocessing.resource_tracker"
    added = quiet_tracker not in sys.warnoptions
    if added:
        sys.warnoptions.append(quiet_tracker)
    with _reported_restarts(max_restarts, reports):
        try:
            results = elastic_launch(config, worker)(*args)
        except SignalException as exc:  # SIGHUP / SIGQUIT: the agent stopped the workers
            name = signal.Signals(exc.sigval).name
            raise RunStopped(signal=name, report=StopReport.read(reports), grace_s=grace_s) from None
        except ChildFailedError:
            hang = _hang_verdict(reports)
            if hang is not None:
                raise RunStopped(hang=f"{hang}; no restarts left", grace_s=grace_s) from None
            raise
        finally:
            forwarder.uninstall()
            if added:
                sys.warnoptions.remove(quiet_tracker)
    report = StopReport.read(reports)
    if report is not None:  # the workers got the signal themselves and stopped cleanly
        raise RunStopped(signal=report.signal, report=report, grace_s=grace_s)
    return results
