"""Tests of the multi-process harness itself: results, rank errors, crashes, hangs, back-to-back worlds."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from omni_parallel.testing import WorldError, WorldTimeoutError, fake_world, run_world


def _sum_ranks(rank: int, world_size: int, scale: int) -> dict:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": dist.get_world_size(), "sum": t.item() * scale, "pid": os.getpid()}


def _fail_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from the second rank")
    dist.barrier()  # the other ranks block here; the harness must not wait for them
    return rank


def _sleep_on_ranks(rank: int, world_size: int, sleepers: list[int], pid_dir: str) -> int:
    (Path(pid_dir) / f"{rank}.pid").write_text(str(os.getpid()))
    if rank in sleepers:
        time.sleep(3600)
    return rank


def _die_on_rank1(rank: int, world_size: int, how: str) -> int:
    if rank == 1:
        time.sleep(0.2)  # let the peers enter the all-reduce: they fail too once rank 1 is gone
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGSEGV)
    t = torch.ones(1)
    dist.all_reduce(t)
    return rank


def _return_lock(rank: int, world_size: int) -> object:
    return threading.Lock() if rank == 1 else rank


def test_results_come_back_per_rank():
    out = run_world(_sum_ranks, 3, args=(10,), timeout_s=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 for o in out)
    assert all(o["sum"] == 30.0 for o in out)  # (0+1+2) * 10
    assert len({o["pid"] for o in out}) == 3


def test_exception_on_rank1_names_rank_and_message():
    with pytest.raises(WorldError) as info:
        run_world(_fail_on_rank1, 3, timeout_s=60)
    assert info.value.rank == 1
    assert "rank 1" in str(info.value)
    assert "boom from the second rank" in str(info.value)
    assert "ValueError" in info.value.remote_traceback


def test_hanging_ranks_are_killed_and_named_within_timeout(tmp_path):
    # The timeout must let the finishing rank start and report even on a loaded machine, yet stay short:
    # scale it from a warm world of the same size measured now (the first call may start the fork server).
    run_world(_sum_ranks, 3, args=(1,), timeout_s=120)
    t0 = time.monotonic()
    run_world(_sum_ranks, 3, args=(1,), timeout_s=120)
    timeout_s = max(3.0, 5 * (time.monotonic() - t0))
    t0 = time.monotonic()
    with pytest.raises(WorldTimeoutError) as info:
        run_world(_sleep_on_ranks, 3, args=([0, 2], str(tmp_path)), timeout_s=timeout_s)
    elapsed = time.monotonic() - t0
    assert info.value.ranks == [0, 2]  # exactly the unfinished ranks; rank 1 returned
    assert "rank 0, rank 2 did not finish" in str(info.value)
    assert timeout_s <= elapsed < timeout_s + 5, f"took {elapsed:.1f} s with timeout {timeout_s:.1f} s"
    for rank in (0, 2):  # killed, not left sleeping
        pid = int((tmp_path / f"{rank}.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(("how", "said"), [("exit", "exit code 3"), ("segv", "signal SIGSEGV")])
def test_rank_dying_without_result_is_named(how, said):
    with pytest.raises(WorldError) as info:
        run_world(_die_on_rank1, 3, args=(how,), timeout_s=60)
    assert info.value.rank == 1  # not a peer whose all-reduce failed because rank 1 was gone
    assert "rank 1 failed: process exited without a result" in str(info.value)
    assert said in str(info.value)


def test_unpicklable_return_value_names_the_rank():
    with pytest.raises(WorldError) as info:
        run_world(_return_lock, 2, timeout_s=60)
    assert info.value.rank == 1
    assert "return value of fn (lock) cannot be pickled" in str(info.value)


def test_unpicklable_fn_or_args_fail_in_the_caller():
    t0 = time.monotonic()
    with pytest.raises(TypeError, match=r"fn .*lambda.* cannot be pickled .* module-level function"):
        run_world(lambda rank, world_size: rank, 2, timeout_s=60)
    with pytest.raises(TypeError, match=r"args\[1\] \(lock\) cannot be pickled"):
        run_world(_sum_ranks, 2, args=(1, threading.Lock()), timeout_s=60)
    assert time.monotonic() - t0 < 1.0  # before any process starts


def test_single_rank_world():
    assert [o["sum"] for o in run_world(_sum_ranks, 1, args=(7,), timeout_s=60)] == [0.0]


def test_two_worlds_back_to_back_do_not_clash():
    a = run_world(_sum_ranks, 2, args=(1,), timeout_s=60)
    b = run_world(_sum_ranks, 2, args=(2,), timeout_s=60)
    assert [o["sum"] for o in a] == [1.0, 1.0]
    assert [o["sum"] for o in b] == [2.0, 2.0]


def test_bad_world_size_and_timeout_are_rejected():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        run_world(_sum_ranks, 0)
    with pytest.raises(TypeError, match="world_size must be an int, got float"):
        run_world(_sum_ranks, 2.0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        run_world(_sum_ranks, 2, timeout_s=0)


def test_fake_world_builds_large_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(1024, rank=5):
        mesh = init_device_mesh("cpu", (8, 16, 8), mesh_dim_names=("pp", "dp", "tp"))
        assert mesh["tp"].size() == 8
        assert dist.get_world_size() == 1024
        assert dist.get_rank() == 5
    assert not dist.is_initialized()


def _return_tensor(rank: int, world_size: int):
    return torch.arange(4, dtype=torch.float64) * (rank + 1)


def test_tensors_survive_the_rank_process():
    out = run_world(_return_tensor, 2, timeout_s=60)
    assert torch.equal(out[0], torch.arange(4, dtype=torch.float64))
    assert torch.equal(out[1], 2 * torch.arange(4, dtype=torch.float64))
