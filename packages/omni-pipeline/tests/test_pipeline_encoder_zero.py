"""Encoder ZeRO through the public API (``EncoderState.shard`` + ``EncoderAnchor(zero_stage=2|3)`` +
``PipelineExecutor``) against one float64 process running the same microbatches (issue 17's three bugs):

* uneven encoder work (one rank runs an encoder microbatch, the other none) must not hang: FSDP2's
  per-forward all-gather on the rank that encodes used to wait for a rank that never enters it;
* gradients are the plain sum the objective defines (FSDP2's own reduce-scatter averages over its mesh,
  which gave exactly 0.5x on two ranks);
* ZeRO-2 (``reshard_after_forward=False``) reduces DTensor gradients (the executor used to all-reduce
  them, which DTensor refuses for sharded gradients).

A hang fails the test after ``timeout_s`` with the ranks that did not finish named (``WorldTimeoutError``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omni_parallel import EncoderLayout, ParallelConfig, ParallelState
from omni_parallel.testing import WorldTimeoutError, run_world
from omni_pipeline import (
    EncoderAnchor,
    EncoderDataConfig,
    EncoderParallelConfig,
    PipelineExecutor,
    PipelineGroups,
    Schedule1F1B,
    StepFunctions,
    StepPlan,
    uniform_on_demand,
)

H, VOCAB, D_IMG, MB = 6, 11, 5, 2


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, H)
        self.body = nn.Linear(H, H)
        self.head = nn.Linear(H, VOCAB)
        self.image = nn.Sequential(nn.Linear(D_IMG, H), nn.Tanh(), nn.Linear(H, H))
        self.double()


def _data(consumes: dict[int, list[int]]):
    g = torch.Generator().manual_seed(7)
    llm, enc = {}, {}
    for k, es in consumes.items():
        tokens = 6 + k
        llm[k] = (
            torch.randint(0, VOCAB, (tokens,), generator=g),
            torch.randint(0, VOCAB, (tokens,), generator=g),
        )
        for j, e in enumerate(es):
            n = 1 + (e % 2)
            enc[e] = (torch.randn(n, D_IMG, generator=g, dtype=torch.float64), torch.arange(2 * j, 2 * j + n))
    return llm, enc


def _reference(consumes):
    model = Model()
    llm, enc = _data(consumes)
    total = torch.zeros((), dtype=torch.float64)
    for k, (ids, labels) in llm.items():
        h = model.embed(ids)
        for e in consumes[k]:
            h = h.index_copy(0, enc[e][1], model.image(enc[e][0]))
        total = total + nn.functional.cross_entropy(model.head(torch.tanh(model.body(h))), labels) / MB
    total.backward()
    return {n: p.grad.clone() for n, p in model.image.named_parameters()}


def _world(rank: int, world_size: int, consumes, zero_stage: int):
    ps = ParallelState.build(ParallelConfig(pp=2))
    model = Model()
    llm, enc = _data(consumes)
    layout = EncoderLayout(sp=1, fsdp=True, reshard_after_forward=zero_stage == 3)
    ps.encoder_state(layout).shard(model.image, blocks=[model.image[0]])
    stage = nn.ModuleDict({"embed": model.embed}) if rank == 0 else nn.ModuleDict({"body": model.body})

    def first_stage_input(k, outs):
        h = model.embed(llm[k][0])
        for e in consumes[k]:
            h = h.index_copy(0, enc[e][1], outs[e])
        return h

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mods = stage

        def forward(self, x):
            return x if rank == 0 else model.head(torch.tanh(model.body(x)))

    def loss(k, logits):
        return nn.functional.cross_entropy(logits, llm[k][1]) / MB

    fn = StepFunctions(first_stage_input, loss, lambda e, x: model.image(x))
    schedule = Schedule1F1B(2, MB)
    flow = uniform_on_demand(schedule, consumes)
    anchor = EncoderAnchor(
        {"image": model.image}, EncoderParallelConfig(zero_stage=zero_stage), EncoderDataConfig(64)
    )
    groups = PipelineGroups(pp=ps.group("pp"), encoder_dp=ps.group("encoder_dp"))
    executor = PipelineExecutor({rank: Stage()}, anchor, fn, groups)
    plan = StepPlan(
        schedule,
        flow,
        {k: (len(ids), H) for k, (ids, _) in llm.items()},
        {e: (len(x), H) for e, (x, _) in enc.items()},
        dtype=torch.float64,
    )
    mine = {e: enc[e][0] for e in flow.encoders_on(rank)}
    executor.step(plan, mine)
    return len(mine), {n: p.grad.full_tensor().numpy().copy() for n, p in model.image.named_parameters()}


def _check(consumes, zero_stage: int) -> None:
    ref = _reference(consumes)
    try:
        results = run_world(_world, 2, args=(consumes, zero_stage), timeout_s=60)
    except WorldTimeoutError as exc:
        pytest.fail(f"encoder ZeRO-{zero_stage} hung: {exc}")
    for rank, (_, grads) in enumerate(results):
        for n, g in ref.items():
            got = torch.from_numpy(grads[n])
            diff = (got - g).abs().max().item()
            ratio = float((got * g).sum() / (g * g).sum())
            assert diff <= 1e-10, f"rank {rank}: {n} differs by {diff} (got = {ratio:.6f} x reference)"


def test_zero3_does_not_hang_when_only_one_rank_encodes():
    consumes = {1: [1], 2: []}  # one encoder microbatch in the step: one rank encodes, the other never does
    _check(consumes, 3)


def test_zero3_gradients_are_the_plain_sum_not_fsdp_mean():
    _check({1: [1, 2], 2: [3, 4]}, 3)  # every rank encodes: FSDP2's mean over 2 ranks gave exactly 0.5x


def test_zero2_reshard_after_forward_false_reduces_dtensor_gradients():
    _check({1: [1, 2], 2: [3, 4]}, 2)
