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
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Iterator

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

__all__ = ["ChildFailedError", "free_port", "launch", "restart_count", "under_torchrun"]

# Records of a worker failure the elastic agent logs (with its own traceback) and of the survivors it
# terminates: replaced by one line each failure (see the module docstring).
_AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")


class _RestartReporter(logging.Filter):
    """Turns the agent's failure records into one line on stderr and drops them and the SIGTERM notices."""

    def __init__(self, max_restarts: int) -> None:
        super().__init__()
        self.max_restarts, self.failures = max_restarts, 0

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("failed (exitcode"):
            code, local_rank, pid = record.args[:3]  # type: ignore[index]
            self.failures += 1
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
        return not msg.startswith("Terminating process")


@contextlib.contextmanager
def _reported_restarts(max_restarts: int) -> Iterator[None]:
    reporter = _RestartReporter(max_restarts)
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    for lg in loggers:
        lg.addFilter(reporter)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(reporter)


def under_torchrun() -> bool:
    """True when this process is a worker started by ``torchrun`` / an elastic agent."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def restart_count() -> int:
    """How many times torchrun's elastic agent restarted this worker (0: its first start, or no agent)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reports free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(worker: Callable[..., object], *args: object, nproc: int, max_restarts: int) -> dict[int, object]:
    """Run ``worker(*args)`` on ``nproc`` local processes; return rank -> result.

    Args:
        worker: the entry point of each process (e.g. :func:`omni_train.worker.worker_main`): a
            module-level function, as the processes are spawned and import it by name; ``args`` are
            pickled to them.
        max_restarts: how many times the elastic agent restarts the workers after one fails.

    Raises:
        ChildFailedError: a worker failed more than ``max_restarts`` times (names the rank and its error).
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
    )
    with _reported_restarts(max_restarts):
        return elastic_launch(config, worker)(*args)
