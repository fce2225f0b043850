"""``dtensor_box`` of FSDP2 over a TP DTensor: ``(_StridedShard(d, split_factor=tp), Shard(d))`` over a
``(data, tp)`` mesh is the box of chunk ``i`` (data rank) of chunk ``j`` (TP rank) of dim ``d``, as
``torch.chunk`` splits (FSDP2's ``_chunk_with_empty`` of the TP-local tensor, torch's ``Shard``), uneven
sizes and empty chunks included; a strided shard whose split factor is not the later ``Shard(d)`` mesh
sizes is refused. Reference: the rows ``torch.chunk`` gives, on an ``arange`` tensor (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from omni_ckpt.sharding import dtensor_box


@pytest.mark.parametrize("rows", [1, 3, 7, 8, 13])
@pytest.mark.parametrize(("data", "tp"), [(2, 2), (3, 2), (2, 4)])
def test_strided_shard_before_a_tp_shard_is_the_nested_chunk(rows, data, tp):
    full = torch.arange(rows * 3).view(rows, 3)
    for j in range(tp):
        parts = full.chunk(tp, 0)
        tp_local = parts[j] if j < len(parts) else full[rows:]
        for i in range(data):
            held = tp_local.chunk(data, 0)
            mine = held[i] if i < len(held) else tp_local[tp_local.shape[0] :]
            box = dtensor_box((rows, 3), (data, tp), (i, j), [_StridedShard(0, split_factor=tp), Shard(0)])
            got = full[box.offsets[0] : box.offsets[0] + box.sizes[0]]
            assert box.sizes[1] == 3 and torch.equal(got, mine), (rows, data, tp, i, j, box)


def test_strided_shard_with_a_replicated_or_other_dim_tp_placement_and_refusals():
    # a row-parallel weight (TP Shard(1)) is no strided shard: FSDP2's Shard(0) x TP Shard(1)
    assert dtensor_box((6, 4), (2, 2), (1, 1), [Shard(0), Shard(1)]).offsets == (3, 2)
    assert dtensor_box((6, 4), (2, 2), (1, 0), [Shard(0), Replicate()]).offsets == (3, 0)
    with pytest.raises(ValueError, match=r"strided placement _S\(0, 4\)"):
        dtensor_box((8, 4), (2, 2), (0, 0), [_StridedShard(0, split_factor=4), Shard(0)])
    with pytest.raises(ValueError, match="strided placement"):
        dtensor_box((8, 4), (2, 2), (0, 0), [_StridedShard(0, split_factor=2), Shard(1)])
