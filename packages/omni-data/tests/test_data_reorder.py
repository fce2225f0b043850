"""GroupedReorderer on gloo (2 and 4 ranks): bit-exact round trip vs a single-process float64 reference,
gradients included; 1 sample vs 0 samples; plan hash mismatch raises on every rank; the plan equals
``reorder_destinations`` of the same costs (the partition ``omni_pipeline.replica_balance`` prices with);
``reorder_destinations`` against hand-worked destinations."""

import random

import torch
import torch.distributed as dist

from omni_data import GroupedReorderer, Modality, PlanMismatchError, SampleMeta, reorder_destinations
from omni_parallel import karmarkar_karp
from omni_parallel.testing import run_world

D = 5


def _samples(counts, seed=0):
    """Per rank: metadata and a float64 payload per sample (deterministic, the same in every process)."""
    rng = random.Random(seed)
    out = []
    for r, n in enumerate(counts):
        rank = []
        for i in range(n):
            shape = (rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4))
            rows = rng.randint(1, 6)
            meta = SampleMeta(f"r{r}s{i}", "src", Modality.IMAGE, rows, 0, float(rng.randint(1, 100)), shape)
            x = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * r + i), dtype=torch.float64)
            rank.append((meta, x))
        out.append(rank)
    return out


def _params():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(8, D, generator=g, dtype=torch.float64).requires_grad_(True)
    b = torch.randn(8, D, generator=g, dtype=torch.float64)
    return a, b


def _encode(x, rows, a, b):
    return x.mean().tanh() * a[:rows] + (x * x).sum() * b[:rows]


def _weights(r, rows):
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(77 + r), dtype=torch.float64)


def _reference(counts):
    """Single process: every sample encoded where it is, no reordering."""
    a, b = _params()
    res = []
    for r, rank in enumerate(_samples(counts)):
        xs = [x.clone().requires_grad_(True) for _, x in rank]
        outs = [_encode(x, m.media_tokens, a, b) for (m, _), x in zip(rank, xs)]
        y = torch.cat(outs) if outs else torch.zeros(0, D, dtype=torch.float64)
        (y * _weights(r, y.shape[0])).sum().backward() if outs else None
        res.append((y.detach(), [x.grad for x in xs]))
    return res


def _world(rank, world_size, cases):
    results = []
    for counts in cases:
        a, b = _params()
        mine = _samples(counts)[rank]
        xs = [x.clone().requires_grad_(True) for _, x in mine]
        plan = GroupedReorderer(dist.group.WORLD).plan([m for m, _ in mine])
        got = plan.dispatch(xs, dtype=torch.float64, differentiable=True)
        outs = [_encode(x, plan.rows[r][i], a, b) for x, (r, i) in zip(got, plan.received)]
        enc = torch.cat(outs) if outs else a[:0] * 1.0
        y = plan.restore(enc)
        (y * _weights(rank, y.shape[0])).sum().backward()
        # numpy, not tensors: torch shares tensors between processes by fd, which dies with the rank
        results.append(
            (
                y.detach().numpy(),
                [x.grad.numpy() for x in xs],
                plan.load,
                plan.digest,
                len(plan.received),
                plan.dest,
            )
        )
    return results


def _world_with_errors(rank, world_size, cases):
    """The round trips, then (same world, saving a start) a plan mismatch and a bad payload shape."""
    import omni_data.reorder as reorder

    results = _world(rank, world_size, cases)
    mine = _samples([2, 2])[rank]
    plan = GroupedReorderer().plan([m for m, _ in mine])
    try:
        plan.dispatch([torch.zeros(1)] * 2)
        shape_error = "no error"
    except ValueError as e:
        shape_error = str(e)
    original = reorder.karmarkar_karp
    if rank == 1:  # simulate a rank running another partitioner version
        reorder.karmarkar_karp = lambda costs, k: [list(reversed(p)) for p in reversed(original(costs, k))]
    try:
        GroupedReorderer().plan([m for m, _ in mine])
        mismatch = "no error"
    except PlanMismatchError as e:
        mismatch = str(e)
    finally:
        reorder.karmarkar_karp = original
    return results, shape_error, mismatch


def _check(per_rank, world_size, cases):
    for c, counts in enumerate(cases):
        ref = _reference(counts)
        digests = {per_rank[r][c][3] for r in range(world_size)}
        assert len(digests) == 1
        for r in range(world_size):
            y, grads = per_rank[r][c][:2]
            assert torch.equal(torch.from_numpy(y), ref[r][0]), (counts, r)
            assert len(grads) == len(ref[r][1])
            for g, gr in zip(grads, ref[r][1]):
                assert torch.equal(torch.from_numpy(g), gr), (counts, r)
        # balance: the plan's loads are Karmarkar-Karp's part loads
        costs = [m.encoder_flops for rank in _samples(counts) for m, _ in rank]
        kk = sorted(sum(costs[i] for i in part) for part in karmarkar_karp(costs, world_size))
        assert sorted(per_rank[0][c][2]) == kk
        assert sum(per_rank[r][c][4] for r in range(world_size)) == sum(counts)
        # the plan is the pure partition omni_pipeline.replica_balance prices with
        dest = reorder_destinations([[m.encoder_flops for m, _ in rank] for rank in _samples(counts)])
        assert all(per_rank[r][c][5] == dest for r in range(world_size)), counts


def test_reorder_two_ranks_round_trip_mismatch_and_shape_errors():
    cases = [[1, 0], [0, 1], [7, 3], [0, 0]]  # 1 image vs 0 images: the collectives still match
    out = run_world(_world_with_errors, 2, args=(cases,), timeout_s=120)
    _check([o[0] for o in out], 2, cases)
    assert all("plan says" in o[1] for o in out), [o[1] for o in out]
    assert all("differs" in o[2] for o in out), [o[2] for o in out]  # raised on every rank


def test_reorder_four_ranks_round_trip():
    cases = [[3, 0, 5, 1], [1, 0, 0, 0], [6, 6, 6, 6]]
    _check(run_world(_world, 4, args=(cases,), timeout_s=120), 4, cases)


def test_reorder_destinations_hand_worked():
    """``reorder_destinations`` against destinations worked out by hand from its rule, not from the code:
    Karmarkar-Karp parts (parts by descending load, ties by smallest index), each part in that order to the
    free rank holding most of its cost, ties to the lowest rank."""
    # [5, 1] | [4, 4]: differencing 5, 4, 4, 1 -> {4, 4} (8) vs {5, 1} (6); {4, 4} is all on rank 1 and
    # {5, 1} all on rank 0: nothing moves
    assert reorder_destinations([[5, 1], [4, 4]]) == [[0, 0], [1, 1]]
    # [2, 3] | [2]: differencing 3, 2, 2 -> {2, 2} (4) vs {3} (3); the heavier part holds 2 on each rank:
    # a tie, so rank 0 takes it (rank 1's sample comes over) and the 3 goes to the free rank 1
    assert reorder_destinations([[2, 3], [2]]) == [[0, 1], [0]]
    # [1, 5] | [] | [3]: three samples over three ranks, one per part; 5 stays on rank 0, 3 on rank 2, and
    # the 1, whose holder (rank 0) is taken, goes to the one free rank, the empty rank 1
    assert reorder_destinations([[1, 5], [], [3]]) == [[1, 0], [], [2]]
    # every sample gets one destination in the group; the loads per destination are the parts' loads
    rng = random.Random(3)
    for size in (1, 2, 3, 4, 8):
        for _ in range(20):
            costs = [[rng.randint(0, 50) for _ in range(rng.randint(0, 5))] for _ in range(size)]
            dest = reorder_destinations(costs)
            assert [len(d) for d in dest] == [len(c) for c in costs]
            assert all(0 <= d < size for row in dest for d in row)
            loads = [0] * size
            for r, row in enumerate(dest):
                for i, d in enumerate(row):
                    loads[d] += costs[r][i]
            flat = [c for row in costs for c in row]
            parts = karmarkar_karp([float(c) for c in flat], size)
            assert sorted(loads) == sorted(sum(flat[i] for i in part) for part in parts)
