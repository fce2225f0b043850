"""LLM ZeRO 0-3 (:func:`omni_parallel.llm_zero.apply_llm_zero`) on 2 gloo ranks of one data group against
one float64 process: two optimizer steps of a small stage (embedding with an odd row count, two blocks,
norm and head), each rank running its own 2 of the step's 4 microbatches; the one process runs all 4 and
sums. Gradients after the sync and parameters after each AdamW step equal the one process's (<= 1e-10), so
the sum is a sum (no mean over the mesh), the shards are the right rows, and the update reaches the next
step's gathered copy. Per-rank bytes (``omni_parallel.memory.state_bytes``) show what each stage shards."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from omni_parallel import ParallelConfig, ParallelState
from omni_parallel.llm_zero import LLMGradientSync, apply_llm_zero
from omni_parallel.memory import KINDS, analytic_state_bytes, state_bytes
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
    """A toy LLM stage in float64 (also test_llm_zero_overlap's): embedding, ``blocks`` MLP blocks, norm, head."""

    def __init__(self, blocks=2):
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([_Block() for _ in range(blocks)])
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


def _sharded(module):
    return [isinstance(p, DTensor) for p in module.parameters()]


def _train(model, sync, micro, steps=2, after_forward=None, peaks=None):
    """``steps`` AdamW steps; ``after_forward``: a list that gets, after each microbatch's forward and
    before its backward, whether the first block's parameters are sharded (DTensors); ``peaks``: a list
    that gets each step's peak of saved activations (``ActivationMemory``, forwards all before backwards,
    as a pipeline's warm-up holds them)."""
    from omni_parallel.activation_memory import ActivationMemory

    memory = ActivationMemory([model], torch.device("cpu")) if peaks is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
    grads, params, nbytes = [], [], None
    lazy = sync.reshard_after_forward
    walks = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        with _module_walks(walks if step else []):  # step 0's gather runs FSDP2's lazy init
            sync.attach()
        # gathered once per step before the first forward: no DTensor left (FSDP2's own per-forward
        # all-gather would be a collective at a point of each rank's schedule); with reshard after
        # forward the blocks gather in their own pre-forward hooks, the root at attach
        gathered = [p for b in ([model] if not lazy else []) for p in b.parameters()]
        assert not any(isinstance(p, DTensor) for p in gathered), f"step {step}: not gathered"
        if memory is not None:
            memory.start_step()
            with memory.track():
                losses = [_loss(model, step, m) for m in micro]
                for loss in losses:
                    loss.backward()
            del losses
            peaks.append(memory.peaks().activation_bytes)
        else:
            for m in micro:
                loss = _loss(model, step, m)
                if after_forward is not None:
                    after_forward.append(all(_sharded(model.layers[0])))
                loss.backward()
        with _module_walks(walks):
            sync()
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        params.append({n: _full(p) for n, p in model.named_parameters()})
        nbytes = state_bytes([model], opt)
    # the units and parameters were read once, at apply_llm_zero: the step's attach and sync walk no module
    assert walks == [], walks
    return grads, params, nbytes


@contextlib.contextmanager
def _module_walks(calls):
    """Record every ``nn.Module.modules`` / ``named_parameters`` / ``parameters`` call inside."""
    names = ("modules", "named_parameters", "parameters")
    saved = {n: getattr(nn.Module, n) for n in names}

    def counted(name):
        def walk(self, *args, **kwargs):
            calls.append(name)
            return saved[name](self, *args, **kwargs)

        return walk

    try:
        for n in names:
            setattr(nn.Module, n, counted(n))
        yield
    finally:
        for n in names:
            setattr(nn.Module, n, saved[n])


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
    # ZeRO-3 reshard policies: after forward the blocks are freed ("always") or kept ("never")
    for lazy in (True, False):
        model = _Stage()
        sync = apply_llm_zero([model], ps, 3, blocks=model.layers, reshard_after_forward=lazy)
        mine = range(rank * MICRO // world_size, (rank + 1) * MICRO // world_size)
        states: list[bool] = []
        grads, params, _ = _train(model, sync, mine, after_forward=states)
        diff = max(
            (a[n] - b[n]).abs().max().item()
            for got, want in ((grads, ref_grads), (params, ref_params))
            for a, b in zip(got, want)
            for n in b
        )
        out["always" if lazy else "never"] = (diff, states, sync.reshard_after_forward)
    # saved activations under ZeRO-3 with each reshard policy and replicated (ZeRO-0): the same tensors
    for zero, lazy in ((3, True), (3, False), (0, False)):
        model = _Stage()
        sync = apply_llm_zero([model], ps, zero, blocks=model.layers, reshard_after_forward=lazy)
        peaks: list[int] = []
        _train(model, sync, range(rank * MICRO // world_size, (rank + 1) * MICRO // world_size), peaks=peaks)
        out[("peaks", zero, lazy)] = peaks
    out["bf16"] = _bf16(rank, world_size, ps)
    return out


def _bf16(rank, world_size, ps):
    """One step of a float32 stage with bf16 parameters in forward / backward (``param_dtype``), per
    ZeRO stage: the reduced gradients against the oracle of float32 sums (each rank's microbatch
    gradients of the same bf16 model, accumulated in float32, summed over the ranks in float32)."""
    import torch.distributed as dist

    mine = range(rank * MICRO // world_size, (rank + 1) * MICRO // world_size)
    ref = _Stage().float().to(torch.bfloat16)
    want = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
    for m in mine:
        ref.zero_grad(set_to_none=True)
        _loss(ref, 0, m).backward()
        for n, p in ref.named_parameters():
            want[n] += p.grad.float()
    for g in want.values():
        dist.all_reduce(g)
    out = {}
    for zero in (1, 2, 3):
        model = _Stage().float()
        sync = apply_llm_zero([model], ps, zero, blocks=model.layers, param_dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
        sync.attach()
        gathered = {p.dtype for p in model.parameters()}
        for m in mine:
            _loss(model, 0, m).backward()
        sync()
        dtypes = {p.grad.dtype for p in model.parameters()} | {p.dtype for p in model.parameters()}
        err = max(
            ((_full(p.grad) - want[n]).abs().max() / want[n].abs().max()).item()
            for n, p in model.named_parameters()
        )
        opt.step()
        finite = all(torch.isfinite(_full(p)).all().item() for p in model.parameters())
        out[zero] = (gathered, dtypes, err, finite, state_bytes([model], opt))
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_world(_world, 2, timeout_s=240)


def test_llm_zero_stages_match_one_process_and_shard_their_state(per_rank):
    numel = sum(p.numel() for p in _Stage().parameters())
    for rank, out in enumerate(per_rank):
        for zero in range(4):
            diff = out[zero][0]
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
        # the analytic formula (omni_parallel.memory.analytic_state_bytes) for every kind at every stage,
        # up to FSDP2's padding of the uneven shards (2 x the padded rows' bytes at most)
        pad = padded * 8 - numel * 8 / 2
        tensors = len(list(_Stage().parameters()))
        for zero, b in enumerate((b0, b1, b2, b3)):
            want = analytic_state_bytes(
                0, replicated=numel, bytes_per=8, zero=zero, shards=2, tensors=tensors
            )
            for kind in KINDS:
                assert abs(b[kind] - want[kind]) <= 2 * pad, (rank, zero, kind, b[kind], want[kind])


def test_llm_zero3_reshard_policies_match_one_process(per_rank):
    for rank, out in enumerate(per_rank):
        for policy, resharded in (("always", True), ("never", False)):
            diff, states, lazy = out[policy]
            assert diff <= 1e-10, (rank, policy, diff)
            assert lazy is resharded
            # between each microbatch's forward and its backward the first block is freed or kept
            assert states == [resharded] * len(states) and len(states) == 2 * (MICRO // 2), (policy, states)


def test_saved_activations_exclude_blocks_gathered_in_their_forward(per_rank):
    """``ActivationMemory`` under ZeRO-3 with ``reshard_after_forward`` (each block gathered in its own
    pre-forward hook, after the step's first saved tensor): the gathered weights autograd saves are the
    model's, not activations; the peak equals the kept-gathered policy's and the replicated model's."""
    for rank, out in enumerate(per_rank):
        always, never, zero0 = out[("peaks", 3, True)], out[("peaks", 3, False)], out[("peaks", 0, False)]
        assert always == never == zero0 and len(always) == 2 and always[0] > 0, (rank, always, never, zero0)


def test_llm_zero_bf16_parameters_reduce_in_float32(per_rank):
    numel = sum(p.numel() for p in _Stage().parameters())
    pad = sum(-(-p.shape[0] // 2) * p[0].numel() for p in _Stage().parameters()) - numel / 2  # elements
    tensors = len(list(_Stage().parameters()))
    for rank, out in enumerate(per_rank):
        for zero, (gathered, dtypes, err, finite, nbytes) in out["bf16"].items():
            assert gathered == {torch.bfloat16}, (rank, zero, gathered)  # all-gathered as bf16 copies
            assert dtypes == {torch.float32}, (rank, zero, dtypes)  # float32 shards and gradients
            # float32 accumulation and reduction: equal to the float32 sums (a bf16 one is off by ~1e-3)
            assert err <= 1e-6, (rank, zero, err)
            assert finite
            # the analytic formula at this layout: float32 masters, gradients and moments, and ZeRO-1/2's
            # kept gathered copy in the MixedPrecisionPolicy's bf16 (2 bytes), up to FSDP2's padding
            want = analytic_state_bytes(
                0, replicated=numel, bytes_per=4, gathered_bytes_per=2, zero=zero, shards=2, tensors=tensors
            )
            for kind in KINDS:
                assert abs(nbytes[kind] - want[kind]) <= 2 * pad * 4, (rank, zero, kind, nbytes, want)
            assert (nbytes["gathered"] > 0) == (zero < 3), (rank, zero, nbytes)


def test_llm_zero_refuses_unknown_stage():
    with pytest.raises(ValueError, match="ZeRO stage 4"):
        apply_llm_zero([], None, 4)
