"""``omni_parallel.grad_clip.clip_grad_norm_`` across pipeline ranks and encoder replicas, against one
float64 process holding the whole model.

The model: one LLM stage per pipeline rank (each rank's own parameters and gradients) and an encoder that
every rank holds with the same, already reduced gradients, either as plain replicas or as FSDP2-style
``Shard(0)`` DTensor shards over the world. Reference: ``torch.nn.utils.clip_grad_norm_`` over the whole
model's parameters in one process (every stage once, the encoder once); with ``max_norm <= 0`` the norm
alone (``get_total_norm``) and unchanged gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from omni_parallel.grad_clip import clip_grad_norm_
from omni_parallel.testing import run_world

D = torch.float64
ENCODER_SHAPES = [(6, 4), (6,)]  # first dimension divisible by 2 and 3 ranks (Shard(0))


def _stage(rank: int) -> list[nn.Parameter]:
    """Stage ``rank``'s parameters with gradients (no gradient on one of them: skipped)."""
    g = torch.Generator().manual_seed(100 + rank)
    params = [nn.Parameter(torch.randn(3 + rank, 5, dtype=D, generator=g)) for _ in range(2)]
    params.append(nn.Parameter(torch.randn(4, dtype=D, generator=g)))
    for p in params[:2]:
        p.grad = torch.randn(p.shape, dtype=D, generator=g) * (rank + 1)
    return params


def _encoder() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(7)
    params = [nn.Parameter(torch.randn(s, dtype=D, generator=g)) for s in ENCODER_SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, dtype=D, generator=g) * 3
    return params


def _grads(params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def _reference(world: int, max_norm: float):
    stages = [_stage(r) for r in range(world)]
    encoder = _encoder()
    params = [p for s in stages for p in s] + encoder
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:  # measure only: the gradients stay as they are
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
    return float(norm), [_grads(s) for s in stages], _grads(encoder)


def _world(rank: int, world_size: int, max_norm: float, sharded: bool):
    owned, encoder = _stage(rank), _encoder()
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world_size,))
        sharded_params = []
        for p in encoder:
            q = nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
            q.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
            sharded_params.append(q)
        encoder = sharded_params
    norm = clip_grad_norm_(owned, encoder, max_norm, dist.group.WORLD)
    enc = [p.grad.full_tensor() if sharded else p.grad for p in encoder]
    return norm, _grads(owned), [g.detach().clone() for g in enc]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "dtensor-shards"])
@pytest.mark.parametrize("max_norm", [1.0, 0.0], ids=["clip", "measure-only"])
def test_clip_across_pipeline_ranks_and_encoder_replicas_equals_one_process(world, sharded, max_norm):
    ref_norm, ref_stages, ref_encoder = _reference(world, max_norm)
    assert max_norm == 0 or ref_norm > max_norm  # the clip case clips
    results = run_world(_world, world, args=(max_norm, sharded), timeout_s=120)
    for rank, (norm, owned, encoder) in enumerate(results):
        assert abs(norm - ref_norm) <= 1e-12 * ref_norm, (rank, norm, ref_norm)
        for got, want in zip(owned, ref_stages[rank], strict=True):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        for got, want in zip(encoder, ref_encoder, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_one_process_without_a_group_equals_torch():
    owned, encoder = _stage(0), _encoder()
    norm = clip_grad_norm_(owned, encoder, 1.0, None)
    ref_norm, ref_stages, ref_encoder = _reference(1, 1.0)
    assert abs(norm - ref_norm) <= 1e-12 * ref_norm
    for got, want in zip(_grads(owned) + _grads(encoder), ref_stages[0] + ref_encoder, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert clip_grad_norm_([], [], 1.0, None) == 0.0
