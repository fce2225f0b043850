"""``wait_for_ranks`` measures how long a rank waits for the slowest one (2 gloo processes).

Reference: rank 1 sleeps 0.4 s before arriving, so rank 0 waits at least about that long, and rank 1,
arriving last, waits far less; with no process group there is nothing to wait for.
"""

from __future__ import annotations

import time

import torch

from omni_parallel.data_parallel import wait_for_ranks
from omni_parallel.testing import run_world


def _world(rank: int, world_size: int) -> float:
    wait_for_ranks(torch.device("cpu"))  # both ranks started: the next wait measures only the sleep
    if rank == 1:
        time.sleep(0.4)
    return wait_for_ranks(torch.device("cpu"))


def test_the_early_rank_waits_for_the_late_one():
    early, late = run_world(_world, 2, timeout_s=120)
    assert early >= 0.3, early
    assert late < early - 0.2, (early, late)


def test_no_process_group_waits_for_nothing():
    assert wait_for_ranks(torch.device("cpu")) == 0.0
