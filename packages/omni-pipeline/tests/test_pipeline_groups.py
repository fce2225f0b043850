"""``PipelineGroups.from_state``: the executor's transfer groups are the ones ``ParallelState.build`` made.

Reference: the pure topology (``rank_groups``) on 4 gloo processes at pp=2 x dp=2. The LLM's group is the
state's ``pp`` group; the encoders' is a second communicator over the same ranks in the same order (an
all-reduce of ``2 ** rank`` over it gives the sum over the topology's pp ranks); both are distinct objects.
Without the encoders' group a pp > 1 state is refused by name; pp=1 needs no group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_parallel import GroupSpec, ParallelConfig, ParallelState, rank_groups
from omni_parallel.testing import run_world
from omni_pipeline import PipelineGroups


def _world(rank: int, world_size: int):
    ps = ParallelState.build(ParallelConfig(pp=2, dp=2), groups=GroupSpec(encoder_p2p=True))
    groups = PipelineGroups.from_state(ps)
    x = torch.tensor([2**rank], dtype=torch.int64)
    dist.all_reduce(x, group=groups.encoder_p2p)
    out = {
        "pp": dist.get_process_group_ranks(groups.pp),
        "encoder_p2p": dist.get_process_group_ranks(groups.encoder_p2p),
        "same_object": groups.pp is groups.encoder_p2p,
        "is_state_pp": groups.pp is ps.group("pp"),
        "sum": int(x),
        "reductions": (groups.llm_dp, groups.encoder_dp),
    }
    bare = ParallelState.build(ParallelConfig(pp=2, dp=2))
    try:
        PipelineGroups.from_state(bare)
    except ValueError as exc:
        out["error"] = str(exc)
    return out


def test_from_state_uses_the_states_groups_on_gloo():
    results = run_world(_world, 4, timeout_s=120)
    table = rank_groups(4, ParallelConfig(pp=2, dp=2))["pp"]
    for rank, got in enumerate(results):
        mine = next(g for g in table if rank in g)
        assert got["pp"] == mine and got["encoder_p2p"] == mine, rank
        assert not got["same_object"] and got["is_state_pp"], rank
        assert got["sum"] == sum(2**r for r in mine), rank
        assert got["reductions"] == (None, None), rank
        assert "GroupSpec(encoder_p2p=True)" in got["error"] and "pp 2" in got["error"], rank


def test_from_state_pp1_needs_no_group():
    class _PP1:
        def size(self, name: str) -> int:
            assert name == "pp"
            return 1

    assert PipelineGroups.from_state(_PP1()) == PipelineGroups()  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["pp", "encoder_p2p"])
def test_groups_default_to_none(name):
    assert getattr(PipelineGroups(), name) is None
