"""LLM ZeRO-1 and ZeRO-2 with each block's gradient collective issued during the step's last backward
(:meth:`omni_parallel.llm_zero.LLMGradientSync.arm`), on 2 gloo ranks of one data group: a stage of an
embedding, 4 blocks, norm and head, 3 microbatches per rank. A spy on ``torch.distributed`` (it records,
then calls the real collective) shows that no collective is issued in the earlier backwards, that by the
time the last backward accumulates the embedding's gradient (the stage's first layer: the blocks' backward
is through, the embedding's and the head's collectives are still to come) one async collective per block
has been issued, and that the sync issues the rest. Every shard's gradient then equals one float64
process's brute-force sum of the 6 microbatches' gradients (<= 1e-12)."""

import torch
import torch.nn.functional as F
from test_parallel_llm_zero import VOCAB, _Stage  # the same toy stage (its tests dir is on the path)
from torch.distributed.tensor import DTensor

from omni_parallel import ParallelConfig, ParallelState
from omni_parallel.llm_zero import apply_llm_zero
from omni_parallel.testing import run_world, spy_collectives

BLOCKS, MICRO = 4, 3  # MICRO microbatches per rank


def _stage():
    return _Stage(blocks=BLOCKS)


def _loss(model, m):
    g = torch.Generator().manual_seed(m)
    tokens, targets = torch.randint(0, VOCAB, (6,), generator=g), torch.randint(0, VOCAB, (6,), generator=g)
    return F.cross_entropy(model(tokens), targets, reduction="sum")


def _is_async(name, args, kwargs):
    """``(collective, async_op)`` of one reduce-scatter / all-reduce call (``async_op`` is positional
    argument 3 of ``all_reduce(tensor, op, group, async_op)``, 4 of ``reduce_scatter_tensor(output, input,
    op, group, async_op)``)."""
    at = 3 if name == "all_reduce" else 4
    return name, bool(kwargs.get("async_op", args[at] if len(args) > at else False))


def _world(rank, world_size):
    ps = ParallelState.build(ParallelConfig(pp=1, dp=world_size))
    ref = _stage()
    for m in range(world_size * MICRO):  # the one float64 process: every rank's microbatches, summed
        _loss(ref, m).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    out = {}
    for zero in (1, 2):
        model = _stage()
        sync = apply_llm_zero([model], ps, zero, blocks=model.layers)
        sync.attach()
        emb = model.tok_embeddings.weight  # gathered: the parameter the backward accumulates into
        seen = []
        with spy_collectives(_is_async) as calls:
            hook = emb.register_post_accumulate_grad_hook(lambda _p, seen=seen: seen.append(list(calls)))
            for k, m in enumerate(range(rank * MICRO, (rank + 1) * MICRO)):
                loss = _loss(model, m)
                if k == MICRO - 1:
                    sync.arm(model)
                loss.backward()
            hook.remove()
            before_sync = len(calls)
            sync()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())
        diff = max((grads[n] - want[n]).abs().max().item() for n in want)
        out[zero] = (seen, before_sync, calls, diff)
    return out


def test_block_collectives_issued_during_the_last_backward():
    results = run_world(_world, 2, timeout_s=60)
    for rank, out in enumerate(results):
        for zero, (seen, before_sync, calls, diff) in out.items():
            kind = "all_reduce" if zero == 1 else "reduce_scatter_tensor"
            where = f"rank {rank} ZeRO-{zero}"
            # the embedding's gradient accumulates once per backward: nothing issued in the first ones
            assert len(seen) == MICRO, (where, seen)
            assert all(s == [] for s in seen[:-1]), (where, seen)
            # in the last one, the 4 blocks' collectives are in flight before the embedding's is final
            assert seen[-1] == [(kind, True)] * BLOCKS, (where, seen[-1])
            assert before_sync == BLOCKS, (where, calls)
            # the sync: the root unit's (embedding, norm, head) collective, blocking
            assert calls[BLOCKS:] and all(c == (kind, False) for c in calls[BLOCKS:]), (where, calls)
            assert diff <= 1e-12, (where, diff)
