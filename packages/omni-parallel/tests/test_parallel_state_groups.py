"""Every process group of a run comes from ``ParallelState.build`` (``GroupSpec``), on 4 gloo processes.

Reference: the pure topology (``rank_groups``, ``hybrid_cp_blocks``), computed with no process group. For
pp=2 x dp=2 and for a hybrid DP/CP layout (cp=2 x dp=2) each optional group's ranks equal the topology's
list, and an all-reduce of ``2 ** rank`` over each group equals the sum over those ranks (a group over
other ranks, or groups created in a different order on some rank, gives another sum or hangs). Also the
default reordering group size (the replicas on one node) and the errors of a bad spec.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from omni_parallel import (
    GroupSpec,
    ParallelConfig,
    ParallelState,
    default_reorder_group_size,
    hybrid_cp_blocks,
    rank_groups,
)
from omni_parallel.testing import run_world

ALL = GroupSpec(loader_dp=True, reorder_group_size=2, encoder_p2p=True, hybrid_cp=True)


def _sum(group: dist.ProcessGroup) -> int:
    x = torch.tensor([2 ** dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(x, group=group)
    return int(x)


def _world(rank: int, world_size: int, config: ParallelConfig, spec: GroupSpec):
    ps = ParallelState.build(config, groups=spec)
    out = {"reorder_size": ps.reorder_size}
    named = {
        "loader_dp": ps.loader_dp_group,
        "reorder": ps.reorder_group,
        "encoder_p2p": ps.encoder_p2p_group,
    }
    for name, group in named.items():
        out[name] = None if group is None else (dist.get_process_group_ranks(group), _sum(group))
    out["hybrid"] = {
        key: (dist.get_process_group_ranks(g), _sum(g)) for key, g in sorted(ps.hybrid_cp_groups.items())
    }
    out["dp_cp_rank"] = ps.local_rank("dp_cp")
    return out


def _mine(groups: list[list[int]], rank: int) -> list[int]:
    return next(g for g in groups if rank in g)


@pytest.mark.parametrize(
    "config",
    [ParallelConfig(pp=2, dp=2), ParallelConfig(cp=2, dp=2)],
    ids=["pp2xdp2", "cp2xdp2-hybrid"],
)
def test_every_group_equals_the_topology_and_reduces_over_its_ranks(config):
    results = run_world(_world, 4, args=(config, ALL), timeout_s=120)
    table = rank_groups(4, config)
    for rank, got in enumerate(results):
        dp, pp, dp_cp = (_mine(table[n], rank) for n in ("dp", "pp", "dp_cp"))
        want = {
            "loader_dp": dp,
            "reorder": dp,  # reorder_group_size 2 = the whole DP group here
            "encoder_p2p": pp if config.pp > 1 else None,
        }
        assert got["reorder_size"] == 2
        for name, ranks in want.items():
            if ranks is None:
                assert got[name] is None, (rank, name)
                continue
            assert got[name] == (ranks, sum(2**r for r in ranks)), (rank, name, got[name])
        local = dp_cp.index(rank)
        assert got["dp_cp_rank"] == local
        hybrid = {
            (c, local - local % c): next([dp_cp[i] for i in b] for b in blocks if local in b)
            for c, blocks in hybrid_cp_blocks(len(dp_cp)).items()
        }
        assert got["hybrid"] == {k: (r, sum(2**x for x in r)) for k, r in sorted(hybrid.items())}, rank
        if len(dp_cp) == 4:
            assert sorted(got["hybrid"]) == [(2, local - local % 2), (4, 0)]


def _reorder_world(rank: int, world_size: int):
    ps = ParallelState.build(ParallelConfig(dp=4), groups=GroupSpec(reorder_group_size=2))
    plain = ParallelState.build(ParallelConfig(dp=4))
    ranks = dist.get_process_group_ranks(ps.reorder_group)
    try:
        ParallelState.build(ParallelConfig(dp=4), groups=GroupSpec(reorder_group_size=3))
    except ValueError as exc:
        error = str(exc)
    else:
        error = None
    return (
        ranks,
        _sum(ps.reorder_group),
        plain.reorder_group,
        plain.reorder_size,
        plain.loader_dp_group,
        error,
    )


def test_reordering_groups_are_consecutive_replicas_and_off_by_default():
    for rank, (ranks, total, plain, size, loader, error) in enumerate(
        run_world(_reorder_world, 4, timeout_s=120)
    ):
        want = [0, 1] if rank < 2 else [2, 3]
        assert ranks == want and total == sum(2**r for r in want), rank
        assert plain is None and size == 1 and loader is None  # GroupSpec() creates no optional group
        assert error == "reordering group size 3 must divide the DP size 4", error


def test_default_reordering_group_is_the_replicas_on_one_node(monkeypatch):
    # pp=2 x dp=4 on 8 ranks (order tp-cp-ep-dp-pp): DP groups [0, 1, 2, 3] and [4, 5, 6, 7]
    ps = SimpleNamespace(world_size=8, config=ParallelConfig(pp=2, dp=4).resolve(8), order="tp-cp-ep-dp-pp")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_reorder_group_size(ps) == 4  # no node size known: every replica
    for local, want in ((8, 4), (4, 4), (2, 2), (1, 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        assert default_reorder_group_size(ps) == want, local


def test_default_reordering_group_divides_every_node_share(monkeypatch):
    # DP groups [0, 1, 2, 3] and [4, 5, 6, 7] over nodes of 6 ranks: the first group has 4 replicas on
    # node 0, the second 2 on node 0 and 2 on node 1, so only 2 divides every node's share; nodes of 3
    # ranks split the first group 3 + 1: only 1 does
    ps = SimpleNamespace(world_size=8, config=ParallelConfig(pp=2, dp=4).resolve(8), order="tp-cp-ep-dp-pp")
    for local, want in ((6, 2), (3, 1), (5, 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        assert default_reorder_group_size(ps) == want, local


def _no_dp_world(rank: int, world_size: int):
    ps = ParallelState.build(ParallelConfig(pp=2, dp=1), groups=GroupSpec(loader_dp=True, encoder_p2p=True))
    return ps.loader_dp_group, dist.get_process_group_ranks(ps.encoder_p2p_group)


def test_no_loader_copy_of_a_dp_group_of_one_rank():
    for rank, (loader, p2p) in enumerate(run_world(_no_dp_world, 2, timeout_s=120)):
        assert loader is None, rank  # documented: not created for dp 1
        assert p2p == [0, 1], rank


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"reorder_group_size": 0}, "GroupSpec.reorder_group_size must be a positive int or None, got 0"),
        ({"loader_dp": "yes"}, "GroupSpec.loader_dp must be a bool, got 'yes'"),
    ],
)
def test_bad_spec_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupSpec(**kwargs)


def _checkpoint_world(rank: int, world_size: int):
    bare = ParallelState.build(ParallelConfig(pp=2, dp=2))
    ps = ParallelState.build(ParallelConfig(pp=2, dp=2), groups=GroupSpec(checkpoint=True, encoder_sync=True))
    group, enc = ps.checkpoint_group, ps.encoder_sync_group
    return (
        (bare.checkpoint_group, bare.encoder_sync_group),
        (dist.get_process_group_ranks(enc), _sum(enc), enc is dist.group.WORLD),
        dist.get_process_group_ranks(group),
        dist.get_backend(group),
        _sum(group),
        group is dist.group.WORLD,
    )


def test_checkpoint_and_encoder_sync_groups_are_their_own_over_every_rank():
    for rank, (bare, enc, ranks, backend, total, is_world) in enumerate(run_world(_checkpoint_world, 4)):
        assert bare == (None, None), rank  # not asked for: not created
        assert enc == ([0, 1, 2, 3], 15, False), rank  # the encoders' reductions: every rank, not WORLD
        assert ranks == [0, 1, 2, 3] and backend == "gloo" and total == 15, rank
        assert not is_world, rank  # a communicator of its own, not the default group


def test_checkpoint_flag_must_be_a_bool():
    with pytest.raises(ValueError, match=r"GroupSpec.checkpoint must be a bool, got 'yes'"):
        GroupSpec(checkpoint="yes")
