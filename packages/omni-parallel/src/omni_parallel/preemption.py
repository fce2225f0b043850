"""Preemption: a stop signal recorded by a handler, then agreed on by every rank at a step boundary.

A cluster scheduler sends ``SIGTERM`` (a user ``SIGINT``) some seconds before it kills a job. Signals reach
the ranks at different moments (one rank, the launcher only, every rank twice), and a rank that stopped on
its own would leave the others blocked in the next step's collectives. So a rank only *records* the
signal (:meth:`StopSignal.install`: the handler sets a field and returns; the training thread is never
interrupted mid-collective), and at the end of each step every rank learns whether any rank received one
through one all-reduce of a single integer (:meth:`StopSignal.agree`: the maximum signal number, 0 for
none, about a hundred microseconds on gloo), or with no collective of its own: :meth:`StopSignal.counts`
summed inside one the step already makes, then :meth:`StopSignal.adopt` (omni-train carries them in
the numerics guard's all-reduce, :meth:`omni_parallel.numerics.NumericsGuard.reduce`). Every rank then takes the same decision after the same step:
commit one synchronous checkpoint and stop (the caller's part; torchtitan and Megatron-LM stop on
``SIGTERM`` the same way, at a step boundary with a final checkpoint). The grace period is the launcher's:
how long it waits before ``SIGKILL``.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PreemptionSpec", "StopSignal"]


@dataclass(frozen=True)
class PreemptionSpec:
    """Which signals request a stop at the next step boundary.

    Attributes:
        signals: signal names (``"SIGTERM"``, ``"SIGINT"``, ...), at least one.

    Raises:
        ValueError: an empty list or a name that is not a signal of this platform (named).
    """

    signals: tuple[str, ...] = ("SIGTERM", "SIGINT")

    def __post_init__(self) -> None:
        if not self.signals:
            raise ValueError("PreemptionSpec.signals: give at least one signal name")
        for name in self.signals:
            if not isinstance(name, str) or not isinstance(getattr(signal, name, None), signal.Signals):
                raise ValueError(f"PreemptionSpec.signals: {name!r} is not a signal name of this platform")

    @property
    def resolved(self) -> tuple[signal.Signals, ...]:
        return tuple(signal.Signals[name] for name in self.signals)


class StopSignal:
    """The first stop signal this process received, and the ranks' agreement on it.

    Args:
        spec: the signals to handle.
    """

    def __init__(self, spec: PreemptionSpec | None = None) -> None:
        self.spec = spec or PreemptionSpec()
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> StopSignal:
        """Handle the spec's signals in this process (replacing their handlers until :meth:`uninstall`).

        Raises:
            RuntimeError: not on the main thread (Python runs signal handlers there only).
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignal.install: signal handlers can only be set on the main thread")
        for sig in self.spec.resolved:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def uninstall(self) -> None:
        """Restore the handlers :meth:`install` replaced."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        # Only the first counts: an elastic agent forwards the signal it got to workers that may have
        # received it already (Ctrl-C reaches the whole process group), and a repeat must not abort the
        # checkpoint in progress; the launcher's grace period (then SIGKILL) bounds the stop.
        if self.received is None:
            self.received = signal.Signals(signum)

    def request(self, sig: signal.Signals) -> None:
        """Record ``sig`` as if it had been received (a caller's own reason to stop)."""
        if self.received is None:
            self.received = signal.Signals(sig)

    def agree(self, group: dist.ProcessGroup | None = None) -> signal.Signals | None:
        """Whether any rank of ``group`` (default: the world) received a stop signal; the same answer on
        every rank (collective: every rank calls it at the same point, e.g. after each step).

        One all-reduce (max) of a CPU ``int64`` scalar: the largest signal number received, 0 for none.
        Without an initialised process group, this process's own signal. Returns the agreed signal or
        ``None``; a rank that received none adopts it (:attr:`received`).
        """
        mine = int(self.received) if self.received is not None else 0
        if not dist.is_initialized():
            return self.received
        flag = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return self._adopt(int(flag.item()))

    def counts(self) -> list[float]:
        """This rank's share of an agreement carried in another sum-all-reduce: one number per signal of
        the spec (1 for the one received, else 0); sum them over the ranks and pass the sums to
        :meth:`adopt`."""
        return [1.0 if self.received == sig else 0.0 for sig in self.spec.resolved]

    def adopt(self, summed: list[float]) -> signal.Signals | None:
        """The agreed signal from :meth:`counts` summed over the ranks (the same on every rank, as
        :meth:`agree`'s: the largest signal number any rank received), or ``None``; a rank that received
        none adopts it (:attr:`received`).

        Raises:
            ValueError: ``summed`` has not one number per signal of the spec.
        """
        signals = self.spec.resolved
        if len(summed) != len(signals):
            raise ValueError(
                f"StopSignal.adopt: {len(summed)} sums for {len(signals)} signals {self.spec.signals}"
            )
        received = [int(sig) for sig, n in zip(signals, summed, strict=True) if n > 0]
        return self._adopt(max(received, default=0))

    def _adopt(self, agreed: int) -> signal.Signals | None:
        if agreed == 0:
            return None
        if self.received is None:
            self.received = signal.Signals(agreed)
        return signal.Signals(agreed)
