"""Bucketed gradient all-reduce on gloo against the brute-force sum of every rank's gradients (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_parallel.data_parallel import FlatGradients, all_reduce_gradients
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


def _flat_world(rank: int, world_size: int):
    """Two backward passes accumulate into the flat buffers; one gradient replaced after attach, one
    never computed (None); then the all-reduce, divided by 2."""
    torch.manual_seed(0)  # the same parameters on every rank
    a = torch.nn.Linear(4, 3).double()
    b = torch.nn.Linear(3, 2)  # float32: a buffer of its own
    c = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))  # no gradient from the graph
    flat = FlatGradients([*a.parameters(), *b.parameters(), c, a.weight])  # a.weight listed twice
    flat.attach()
    views = [p.grad for p in (*a.parameters(), *b.parameters(), c)]
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):
        x = torch.randn(6, 4, generator=g, dtype=torch.float64)
        b(a(x).float()).square().sum().backward()
    replaced = torch.full_like(b.bias, float(rank + 1))
    b.bias.grad = replaced  # set after attach: copied in, not lost
    c.grad = None
    kept = [p.grad is v for p, v in zip((*a.parameters(), b.weight), views)]
    flat.all_reduce(dist.group.WORLD, divide_by=2.0)
    same = [p.grad is v for p, v in zip((*a.parameters(), *b.parameters(), c), views)]
    return kept, same, [p.grad.double().numpy().copy() for p in (*a.parameters(), *b.parameters(), c)]


def _reference(rank: int) -> list[torch.Tensor]:
    """One rank's gradients the plain way (autograd's own tensors), each in its parameter's dtype."""
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 3).double()
    b = torch.nn.Linear(3, 2)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):
        x = torch.randn(6, 4, generator=g, dtype=torch.float64)
        b(a(x).float()).square().sum().backward()
    grads = [p.grad for p in (*a.parameters(), b.weight)]
    return [*grads, torch.full((2,), float(rank + 1)), torch.zeros(5, dtype=torch.float64)]


def test_flat_gradients_accumulate_in_place_and_all_reduce_to_the_plain_sum():
    results = run_world(_flat_world, 2, timeout_s=60)
    # the sum of the two ranks in each gradient's own dtype (as the all-reduce adds), then halved
    want = [((x + y) / 2).double() for x, y in zip(_reference(0), _reference(1))]
    for r, (kept, same, got) in enumerate(results):
        assert all(kept), f"rank {r}: autograd replaced a view instead of adding into it: {kept}"
        assert all(same), f"rank {r}: a gradient is not its view after the all-reduce: {same}"
        for i, (x, y) in enumerate(zip(got, want)):
            torch.testing.assert_close(torch.from_numpy(x), y, rtol=0, atol=0, msg=f"rank {r}, gradient {i}")


def _dtensor_refused(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    plain = torch.nn.Parameter(torch.zeros(3))
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Replicate()]))
    try:
        FlatGradients([plain, sharded])
    except TypeError as e:
        return str(e)
    return "accepted"


def test_flat_gradients_refuse_a_dtensor_parameter_by_position():
    (msg,) = run_world(_dtensor_refused, 1, timeout_s=60)
    assert "parameters [1]" in msg and "DTensor" in msg, msg


def test_flat_gradients_refuse_bad_divisors_and_skip_single_rank_groups():
    p = torch.nn.Parameter(torch.ones(2))
    flat = FlatGradients([p])
    flat.attach()
    p.grad.add_(3.0)
    flat.all_reduce(None)  # no group: the gradient stays, as its view
    assert p.grad.tolist() == [3.0, 3.0] and p.grad.data_ptr() == flat.buffers[(p.device, p.dtype)].data_ptr()
    with pytest.raises(ValueError, match="divide_by must be > 0"):
        flat.all_reduce(None, divide_by=0.0)
