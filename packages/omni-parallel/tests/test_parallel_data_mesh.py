"""``GroupSpec(data_mesh=True)``: the data mesh of LLM ZeRO with TP (``ParallelState.data_mesh``,
:mod:`omni_parallel.llm_zero`), built over torch's fake backend (no process runs a collective).

Reference: the pure topology (``rank_groups``): for every rank of tp=2 x cp=2 x dp=2, tp=2 x ulysses=2 x dp=2
(pp=2), tp=2 x dp=4 and tp=2 x cp=2 x ulysses=2 x dp=2, the data mesh is exactly the rank's ``dp_cp`` group,
in its order (flattened from the mesh's ``dp_rest``, ``cp`` and ``ulysses`` dimensions, or the one dimension
sliced; the rank's position in it is its ``dp_cp`` local rank), and FSDP2's 2-D mesh
(``DeviceMesh._concatenate`` of it and the TP mesh, which raises for meshes of different roots, e.g. one
``DeviceMesh.from_group`` builds) is the rank's ``dp_cp`` x ``tp`` block of the same pipeline stage, row by
row.
Without TP, or without the spec, there is none.
"""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import DeviceMesh

from omni_parallel import GroupSpec, ParallelConfig, ParallelState, rank_groups
from omni_parallel.testing import fake_world

LAYOUTS = [
    ParallelConfig(tp=2, cp=2, dp=2),
    ParallelConfig(tp=2, ulysses=2, dp=2, pp=2),
    ParallelConfig(tp=2, dp=4),
    ParallelConfig(tp=2, cp=2, ulysses=2, dp=2),
]


@pytest.mark.parametrize(
    "config", LAYOUTS, ids=["tp2-cp2-dp2", "tp2-ulysses2-dp2-pp2", "tp2-dp4", "tp2-cp2-ulysses2-dp2"]
)
def test_data_mesh_is_the_dp_cp_group_as_one_dimension_of_the_device_mesh(config):
    world = config.tp * config.cp * config.ulysses * config.dp * config.pp
    table = rank_groups(world, config.resolve(world), "tp-cp-ep-dp-pp")
    for rank in (0, 3, world - 1):
        with fake_world(world, rank=rank):
            ps = ParallelState.build(config, groups=GroupSpec(data_mesh=True))
            mine = next(g for g in table["dp_cp"] if rank in g)
            # in the dp_cp group's order, not only its set: FSDP2's shard index is the position in this
            # dimension (ZeRO's Shard(0) rows, the checkpoint boxes), the group's the data order
            assert ps.data_mesh.mesh.tolist() == mine == ps.members["dp_cp"], (rank, ps.data_mesh)
            assert ps.data_mesh.get_local_rank() == mine.index(rank) == ps.local_rank("dp_cp")
            assert ps.data_mesh.get_group().size() == len(mine)
            both = DeviceMesh._concatenate([ps.data_mesh, ps.mesh["tp"]])
            tp = next(g for g in table["tp"] if rank in g)
            assert both.mesh.tolist() == [[a + t - rank for t in tp] for a in mine], (rank, both)


def test_no_data_mesh_without_tp_or_the_spec():
    with fake_world(4, rank=1):
        assert ParallelState.build(ParallelConfig(dp=4), groups=GroupSpec(data_mesh=True)).data_mesh is None
    with fake_world(4, rank=1):
        assert ParallelState.build(ParallelConfig(tp=2, dp=2)).data_mesh is None
