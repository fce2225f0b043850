"""``omni_parallel.memory.planned_fsdp_bytes``: FSDP2's per-rank shards computed from the parameters' shapes
equal, byte for byte, what :func:`planned_state_bytes` reads from a real ``fully_shard`` build over torch's
fake process group (and the all-gather outputs and whole gradients FSDP2's ``FSDPParam`` reports), at
world sizes that are odd, that do not divide dim 0, and that exceed it (empty shards), for the first, a
middle and the last rank, ZeRO-2 (kept gathered copies) and ZeRO-3, a bf16 gather dtype, a frozen
parameter and AMSGrad's third moment. One process, meta device: no allocation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omni_parallel.memory import planned_fsdp_bytes, planned_state_bytes
from omni_parallel.testing import fake_world


class _Tower(nn.Module):
    """Blocks with dim 0 of 1, 3, 5, 7, 10 and 130 rows (and 1-D biases / norms), one frozen tensor."""

    def __init__(self) -> None:
        super().__init__()
        norm = nn.Sequential(nn.Linear(3, 5, bias=False), nn.LayerNorm(7))
        self.blocks = nn.ModuleList([nn.Linear(8, 3), norm, nn.Linear(5, 130)])
        self.head = nn.Linear(130, 1)
        self.table = nn.Embedding(10, 6)
        self.table.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # never run: fully_shard wants a forward
        return x


def _model() -> nn.Module:
    with torch.device("meta"):
        return _Tower()


def _optimizer(m: nn.Module, amsgrad: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], amsgrad=amsgrad, foreach=False)


def _built(world: int, rank: int, keep: bool, dtype: torch.dtype | None, amsgrad: bool):
    """The real build: ``fully_shard`` per block, then the root, on a 1-D mesh over ``world`` fake ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from omni_parallel.encoder_zero import configure_step_schedule, sharded_units

    with fake_world(world, rank=rank):
        m = _model()
        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=dtype)
        for block in m.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep)
        fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep)
        configure_step_schedule([m], keep_gathered=keep)
        state = planned_state_bytes([m], _optimizer(m, amsgrad))
        fps = [
            fp
            for u in sharded_units([m])
            for g in u._get_fsdp_state()._fsdp_param_groups
            for fp in g.fsdp_params
        ]
        whole = {
            "gradients": sum(fp.sharded_param.numel() * fp.sharded_param.element_size() for fp in fps),
            "gathered": sum(
                fp.padded_sharded_param_size.numel()
                * fp.mesh_info.shard_mesh_size
                * torch.empty((), dtype=fp.mp_policy.param_dtype or fp.sharded_param.dtype).element_size()
                for fp in fps
            ),
        }
    return state, whole


CASES = [  # world, keep gathered (ZeRO-2), gather dtype, amsgrad
    (1, True, None, False),
    (2, True, torch.bfloat16, False),
    (3, False, None, True),
    (7, True, None, False),
    (13, False, torch.bfloat16, False),
    (64, True, None, False),  # more ranks than 1, 3, 5, 7, 10 rows: empty shards
]


@pytest.mark.parametrize(("world", "keep", "dtype", "amsgrad"), CASES)
def test_shapes_equal_the_fake_world_build(world, keep, dtype, amsgrad):
    for rank in sorted({0, 1 % world, world // 2, world - 1}):
        m = _model()
        planned = planned_fsdp_bytes(
            [m], _optimizer(m, amsgrad), world=world, rank=rank, keep_gathered=keep, param_dtype=dtype
        )
        assert planned == _built(world, rank, keep, dtype, amsgrad), (world, rank)


def test_padding_and_empty_shards_by_hand():
    """130 rows over 64 ranks: chunks of 3 rows, ranks 0-42 hold 3, rank 43 holds 1, ranks 44-63 none;
    every rank's storage is 3 padded rows; ZeRO-2's gathered copy 192 rows."""
    with torch.device("meta"):
        m = nn.Linear(4, 130, bias=False)
    rows = {r: planned_fsdp_bytes([m], world=64, rank=r, keep_gathered=True)[0] for r in (0, 43, 44, 63)}
    assert {r: s["gradients"] for r, s in rows.items()} == {0: 3 * 16, 43: 1 * 16, 44: 0, 63: 0}
    assert {s["parameters"] for s in rows.values()} == {3 * 16}
    assert {s["gathered"] for s in rows.values()} == {192 * 16}
    with pytest.raises(ValueError, match="rank must be in"):
        planned_fsdp_bytes([m], world=4, rank=4, keep_gathered=False)
