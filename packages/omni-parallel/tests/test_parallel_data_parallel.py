"""Bucketed gradient all-reduce on gloo against the brute-force sum of every rank's gradients (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_parallel.data_parallel import all_reduce_gradients
from omni_parallel.testing import run_world

SHAPES = [(3, 4), (5,), (2, 2, 2), (7,)]


def _grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    out = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    out[2] = out[2].float()  # a second dtype: its own buckets
    return out


def _params(rank: int) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads(rank)]
    for p, g in zip(params, _grads(rank)):
        p.grad = g.clone()
    params[3].grad = None  # no gradient: skipped, left None
    return [*params, params[0]]  # a parameter listed twice is reduced once


def _world(rank: int, world_size: int):
    out = {}
    for name, divide_by, bucket_bytes in (("sum", 1.0, 2**20), ("mean-small-buckets", 2.0, 40)):
        params = _params(rank)
        all_reduce_gradients(params, dist.group.WORLD, divide_by=divide_by, bucket_bytes=bucket_bytes)
        out[name] = [None if p.grad is None else p.grad.numpy().copy() for p in params[:4]]
    return out


def test_bucketed_all_reduce_equals_the_sum_over_ranks():
    results = run_world(_world, 2, timeout_s=60)
    for name, divide_by in (("sum", 1.0), ("mean-small-buckets", 2.0)):
        want = [(a + b) / divide_by for a, b in zip(_grads(0), _grads(1))]
        for r in range(2):
            got = results[r][name]
            assert got[3] is None
            for i in (0, 1, 2):
                torch.testing.assert_close(torch.from_numpy(got[i]), want[i], rtol=0, atol=1e-12)


def test_bucketed_all_reduce_refuses_bad_arguments_and_skips_single_rank_groups():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    all_reduce_gradients([p], None, divide_by=4.0)  # no group: nothing to do
    assert p.grad.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="divide_by must be > 0"):
        all_reduce_gradients([p], None, divide_by=0.0)
