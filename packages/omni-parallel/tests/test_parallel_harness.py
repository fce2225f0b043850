"""Tests of the multi-process harness itself: results, rank errors, hangs, back-to-back worlds."""

import os
import time

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


def _sleep_on_rank2(rank: int, world_size: int) -> int:
    if rank == 2:
        time.sleep(3600)
    return rank


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


def test_hanging_rank_is_killed_and_named_within_timeout():
    run_world(
        _sum_ranks, 1, args=(1,), timeout_s=120
    )  # warm the fork server: its first start is not the rank's time
    t0 = time.monotonic()
    with pytest.raises(WorldTimeoutError) as info:
        run_world(_sleep_on_rank2, 3, timeout_s=20)
    elapsed = time.monotonic() - t0
    assert info.value.ranks == [2]
    assert "rank 2" in str(info.value)
    assert elapsed < 20 + 10, f"took {elapsed:.1f} s"


def test_two_worlds_back_to_back_do_not_clash():
    a = run_world(_sum_ranks, 2, args=(1,), timeout_s=60)
    b = run_world(_sum_ranks, 2, args=(2,), timeout_s=60)
    assert [o["sum"] for o in a] == [1.0, 1.0]
    assert [o["sum"] for o in b] == [2.0, 2.0]


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size"):
        run_world(_sum_ranks, 0)


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
