"""RunWrites: rank 0's run files written in order on a thread of their own, errors back to the trainer."""

from __future__ import annotations

import threading

import pytest

from omni_train.run_writes import RunWrites


def test_writes_run_in_order_off_the_caller_and_drain_waits_for_them():
    gate, seen, threads = threading.Event(), [], set()

    def write(i: int) -> None:
        gate.wait(timeout=30)
        threads.add(threading.get_ident())
        seen.append(i)

    w = RunWrites()
    for i in range(20):
        w.submit(write, i)  # returns at once: the first write still waits on the gate
    assert seen == []
    gate.set()
    w.drain()
    assert seen == list(range(20))
    assert threads and threading.get_ident() not in threads
    w.close()


def test_a_failed_write_is_raised_with_its_cause_and_nothing_after_it_runs():
    gate, seen = threading.Event(), []

    def fail() -> None:
        gate.wait(timeout=30)  # fails only once the next write is queued behind it
        raise OSError(28, "No space left on device")

    w = RunWrites()
    w.submit(fail)
    w.submit(seen.append, 1)
    gate.set()
    with pytest.raises(RuntimeError, match=r"writing the run.s files failed.*No space left") as info:
        w.drain()
    assert isinstance(info.value.__cause__, OSError)
    assert seen == []
    w.close()


def test_a_write_error_surfaces_at_the_next_submit_once_it_happened():
    w = RunWrites()
    w.submit(lambda: 1 / 0)
    w._pending[-1].exception(timeout=30)  # let it fail
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        w.submit(print, "never")
    w.close()
