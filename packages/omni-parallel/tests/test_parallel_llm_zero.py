"""LLM ZeRO 0-3 (:func:`omni_parallel.llm_zero.apply_llm_zero`) on 2 gloo ranks of one data group against
one float64 process: two optimizer steps of a small stage (embedding with an odd row count, two blocks,
norm and head), each rank running its own 2 of the step's 4 microbatches; the one process runs all 4 and
sums. Gradients after the sync and parameters after each AdamW step equal the one process's (<= 1e-10), so
the sum is a sum (no mean over the mesh), the shards are the right rows, and the update reaches the next
step's gathered copy. Per-rank bytes (``omni_parallel.memory.state_bytes``) show what each stage shards."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from omni_parallel import ParallelConfig, ParallelState
from omni_parallel.llm_zero import LLMGradientSync, apply_llm_zero
from omni_parallel.memory import state_bytes
from omni_parallel.testing import run_world

pytestmark = pytest.mark.slow

VOCAB, DIM, MICRO = 9, 8, 4  # VOCAB odd: rank 1's embedding shard is shorter (5 + 4 rows)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        return x + self.w2(F.silu(self.w1(x)))


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.double()

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h)
        return self.output(self.norm(h))


def _batch(step, m):
    g = torch.Generator().manual_seed(100 * step + m)
    return torch.randint(0, VOCAB, (6,), generator=g), torch.randint(0, VOCAB, (6,), generator=g)


def _loss(model, step, m):
    tokens, targets = _batch(step, m)
    return F.cross_entropy(model(tokens), targets, reduction="sum") / (MICRO * 6)


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model, sync, micro, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
    grads, params, nbytes = [], [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        sync.attach()
        # gathered once per step before the first forward: no DTensor left (FSDP2's own per-forward
        # all-gather would be a collective at a point of each rank's schedule)
        assert not any(isinstance(p, DTensor) for p in model.parameters()), f"step {step}: not gathered"
        for m in micro:
            _loss(model, step, m).backward()
        sync()
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        params.append({n: _full(p) for n, p in model.named_parameters()})
        nbytes = state_bytes([model], opt)
    return grads, params, nbytes


def _world(rank, world_size):
    ps = ParallelState.build(ParallelConfig(pp=1, dp=world_size))
    ref = _Stage()
    ref_grads, ref_params, _ = _train(ref, LLMGradientSync(lambda: None), range(MICRO))
    out = {}
    for zero in (0, 1, 2, 3):
        model = _Stage()
        sync = apply_llm_zero([model], ps, zero, blocks=model.layers)
        mine = range(rank * MICRO // world_size, (rank + 1) * MICRO // world_size)
        grads, params, nbytes = _train(model, sync, mine)
        diff = max(
            (a[n] - b[n]).abs().max().item()
            for got, want in ((grads, ref_grads), (params, ref_params))
            for a, b in zip(got, want)
            for n in b
        )
        locals_ = {
            n: tuple(p.to_local().shape) for n, p in model.named_parameters() if isinstance(p, DTensor)
        }
        out[zero] = (diff, nbytes, locals_)
    return out


def test_llm_zero_stages_match_one_process_and_shard_their_state():
    per_rank = run_world(_world, 2, timeout_s=240)
    numel = sum(p.numel() for p in _Stage().parameters())
    for rank, out in enumerate(per_rank):
        for zero, (diff, _, _) in out.items():
            assert diff <= 1e-10, (rank, zero, diff)
        b0, b1, b2, b3 = (out[z][1] for z in range(4))
        assert out[3][2]["tok_embeddings.weight"] == ((5, DIM), (4, DIM))[rank]
        shard = sum(torch.Size(s).numel() for s in out[3][2].values())  # this rank's rows of every parameter
        assert b0["parameters"] == b0["gradients"] == numel * 8 and b0["gathered"] == 0
        steps = 4 * len(out[3][2])  # AdamW's float32 step counters
        assert b0["optimizer"] == 2 * numel * 8 + steps
        for b in (b1, b2, b3):
            assert b["optimizer"] == 2 * shard * 8 + steps
        assert b1["gradients"] == numel * 8  # ZeRO-1: the whole summed gradient stays
        assert b2["gradients"] == b3["gradients"] == shard * 8
        assert b3["gathered"] == 0
        # FSDP2 pads each shard's storage to ceil(rows / 2) rows on both ranks
        padded = sum(-(-p.shape[0] // 2) * p[0].numel() for p in _Stage().parameters())
        assert b1["parameters"] == b2["parameters"] == b3["parameters"] == padded * 8
        assert b1["gathered"] == b2["gathered"] == 2 * padded * 8


def test_llm_zero_refuses_unknown_stage():
    with pytest.raises(ValueError, match="ZeRO stage 4"):
        apply_llm_zero([], None, 4)
