"""The hang watchdog (``omni_parallel.watchdog``), the stop-signal agreement (``omni_parallel.preemption``)
and the collective timeout of every group ``ParallelState.build`` creates, over real gloo worlds.

References: a rank that really stops (``SIGSTOP``, the failure the watchdog exists for) while its peers
block in a barrier with it, as a stopped worker leaves a training run; what it said in its last beat
(step, pipeline action, host, pid) is what the survivors must name; the run must end within
``hang_timeout_s`` plus a few beats. A stall (every rank alive, none moving) names the rank that stopped
moving first: known here because the test makes rank 1 stop 1.5 s before rank 0 does.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from omni_parallel import EncoderLayout, GroupSpec, ParallelConfig, ParallelState
from omni_parallel.preemption import PreemptionSpec, StopSignal
from omni_parallel.testing import WorldError, run_world
from omni_parallel.watchdog import (
    HANG_EXIT_CODE,
    HangVerdict,
    Watchdog,
    WatchdogSpec,
    default_store_client,
    process_start_ticks,
)

HANG_S = 2.0


def _stopped_rank(rank: int, world_size: int, verdict_file: str, stamp: str) -> None:
    spec = WatchdogSpec(hang_timeout_s=HANG_S, interval_s=0.25, verdict_file=verdict_file)
    wd = Watchdog(spec, default_store_client(1.0, "t/silent"), rank, world_size, where=lambda: "1F2")
    wd.progress(step=3)
    wd.start()
    dist.barrier()  # every rank beats before one stops
    if rank == 1:
        time.sleep(0.5)
        with open(stamp, "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its heartbeat thread stops with it
    dist.barrier()  # the survivors block here, as in a step's collective with the stopped rank


def test_a_stopped_rank_is_named_by_the_others_and_the_run_ends_in_bounded_time(tmp_path):
    verdict_file, stamp = tmp_path / "verdict", tmp_path / "stopped_at"
    with pytest.raises(WorldError) as failed:
        run_world(_stopped_rank, 3, timeout_s=300, args=(str(verdict_file), str(stamp)))
    elapsed = time.time() - float(stamp.read_text())  # from the stop to the end of the world
    line = verdict_file.read_text().strip()
    host = socket.gethostname()
    assert line.startswith(f"rank 1 (host {host}, pid "), line
    assert "hung at step 3, last pipeline action 1F2: no heartbeat for" in line, line
    assert f"(hang timeout {HANG_S:g} s, seen by rank " in line, line
    # the survivors exit with the watchdog's code and the stopped rank is killed (not left stopped)
    assert (
        f"exit code {HANG_EXIT_CODE}" in str(failed.value)
        or "SIGKILL" in str(failed.value)
        or ("exit code -9" in str(failed.value))
    ), str(failed.value)
    assert elapsed < HANG_S + 5, elapsed  # the group's timeout (300 s here; gloo's default 30 min) is not hit


def _stalled(rank: int, world_size: int) -> dict:
    got = threading.Event()
    seen: list[HangVerdict] = []

    def record(v: HangVerdict) -> None:
        seen.append(v)
        got.set()

    spec = WatchdogSpec(hang_timeout_s=HANG_S, interval_s=0.2)
    wd = Watchdog(spec, default_store_client(1.0, "t/stall"), rank, world_size, on_verdict=record)
    wd.progress(step=5)
    wd.start()
    dist.barrier()
    # rank 1's training thread stops moving at once (alive: its heartbeat goes on), rank 0's 1.5 s later
    end = time.monotonic() + (1.5 if rank == 0 else 0.0)
    while time.monotonic() < end:
        wd.progress()
        time.sleep(0.05)
    assert got.wait(30), "no verdict"
    wd.stop()
    return {"verdict": seen[0], "alive": True}


def test_a_stalled_run_names_the_rank_that_stopped_moving_first():
    results = run_world(_stalled, 2, timeout_s=300)
    verdicts = [r["verdict"] for r in results]
    assert verdicts[0] == verdicts[1]  # one verdict per run, whoever decided
    v = verdicts[0]
    assert (v.rank, v.kind, v.step, v.pid > 0) == (1, "stalled", 5, True), v
    assert v.seconds >= HANG_S and "no progress for" in v.line()


def _finished_rank(rank: int, world_size: int) -> HangVerdict | None:
    seen: list[HangVerdict] = []
    spec = WatchdogSpec(hang_timeout_s=1.0, interval_s=0.1)
    wd = Watchdog(spec, default_store_client(1.0, "t/done"), rank, world_size, on_verdict=seen.append)
    wd.start()
    dist.barrier()
    if rank == 1:
        wd.stop()  # finished: it stops beating, as done
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        wd.progress()
        time.sleep(0.05)
    wd.stop()
    return seen[0] if seen else None


def test_a_rank_that_finished_is_not_taken_for_a_hung_one():
    assert run_world(_finished_rank, 2, timeout_s=300) == [None, None]


def test_spec_fields_are_range_checked():
    for bad in (
        {"hang_timeout_s": 0},
        {"hang_timeout_s": float("nan")},
        {"hang_timeout_s": 5, "interval_s": 5},
    ):
        with pytest.raises(ValueError, match=r"WatchdogSpec\.(hang_timeout_s|interval_s)"):
            WatchdogSpec(**bad)
    assert WatchdogSpec(hang_timeout_s=60).interval == 5.0 and WatchdogSpec(hang_timeout_s=5).interval == 1.0
    assert process_start_ticks(os.getpid()) == process_start_ticks(os.getpid()) is not None
    with pytest.raises(ValueError, match="SIGNOPE"):
        PreemptionSpec(signals=("SIGNOPE",))


def _agree(rank: int, world_size: int) -> list[str | None]:
    stop = StopSignal().install()
    try:
        first = stop.agree()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # handled: recorded, the process goes on
        second = stop.agree()
        return [first, second.name if second else None, stop.received.name if stop.received else None]
    finally:
        stop.uninstall()


def test_a_stop_signal_on_one_rank_is_agreed_by_every_rank():
    assert run_world(_agree, 2, timeout_s=300) == [[None, "SIGTERM", "SIGTERM"]] * 2


def _groups(rank: int, world_size: int, pp: int) -> dict:
    timeout = timedelta(seconds=3)
    spec = GroupSpec(
        loader_dp=True, reorder_group_size=None, encoder_p2p=True, checkpoint=True, encoder_sync=True
    )
    ps = ParallelState.build(ParallelConfig(pp=pp), groups=spec, timeout=timeout)
    enc = ps.encoder_state(EncoderLayout(sp=1, fsdp=False))
    groups = {**ps.groups, "world": dist.group.WORLD, "edp": enc.dp_group, "esp": enc.sp_group}
    for name in (
        "loader_dp_group",
        "reorder_group",
        "encoder_p2p_group",
        "checkpoint_group",
        "encoder_sync_group",
    ):
        if getattr(ps, name) is not None:
            groups[name] = getattr(ps, name)
    timeouts = {n: g._get_backend(torch.device("cpu")).options._timeout for n, g in groups.items()}
    # and it holds: rank 0 alone in a collective fails after the timeout, not gloo's 30 minutes
    took = None
    if rank == 0:
        t = time.monotonic()
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1), group=ps.checkpoint_group)
        took = time.monotonic() - t
    return {"timeouts": timeouts, "took": took}


@pytest.mark.parametrize("pp", [1, 2])
def test_every_group_parallel_state_builds_has_the_collective_timeout(pp):
    out = run_world(_groups, 2, timeout_s=300, args=(pp,))
    for r in out:
        assert r["timeouts"] and set(r["timeouts"].values()) == {timedelta(seconds=3)}, r["timeouts"]
    assert 2.5 <= out[0]["took"] < 15, out[0]["took"]


def test_carried_counts_agree_like_the_all_reduce():
    """``counts`` summed over ranks (as the numerics guard's all-reduce carries them) then ``adopt`` give
    what ``agree``'s max over signal numbers gives: brute force over every mix of received signals."""
    spec = PreemptionSpec(("SIGTERM", "SIGINT"))
    choices = [None, signal.SIGTERM, signal.SIGINT]
    for mix in [(a, b, c) for a in choices for b in choices for c in choices]:
        ranks = [StopSignal(spec) for _ in mix]
        for r, sig in zip(ranks, mix, strict=True):
            if sig is not None:
                r.request(sig)
        summed = [sum(col) for col in zip(*(r.counts() for r in ranks), strict=True)]
        expected = max((int(s) for s in mix if s is not None), default=0)
        for r in ranks:
            agreed = r.adopt(summed)
            assert (0 if agreed is None else int(agreed)) == expected, (mix, summed)
            assert expected == 0 or int(r.received) in {expected, *(int(s) for s in mix if s is not None)}
    with pytest.raises(ValueError, match="1 sums for 2 signals"):
        StopSignal(spec).adopt([1.0])
