"""``omni_parallel.parallelize`` over plain modules (``parallel_blocks.Block``), each step against the same
model without it, in float64:

* recompute (whole blocks, one residual branch), compile and offload leave outputs, every gradient and
  parameter names unchanged; recompute and offload keep fewer bytes where they claim to;
* mixed precision casts exactly what crosses a pipeline wire and autocasts the rest;
* TP (2 gloo ranks) gives the unsharded block's outputs and input gradients;
* the LLM sync is the brute-force sum over the DP ranks, the encoders' ZeRO-0 sync the sum over every
  rank divided by ``tp``, skipping towers that ran nowhere.
"""

from __future__ import annotations

import pytest
import torch
from parallel_blocks import Block, blocks
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch.distributed.tensor import DTensor

from omni_parallel import GroupSpec, ParallelConfig, ParallelState
from omni_parallel.activation_memory import ActivationMemory
from omni_parallel.parallelize import (
    apply_ac,
    apply_compile,
    apply_dp,
    apply_encoder_zero,
    apply_mixed_precision,
    apply_offload,
    apply_tp,
    training_dtypes,
)
from omni_parallel.tensor_parallel import llama_tp_plan
from omni_parallel.testing import fake_world, run_world

D = torch.float64


def _x(t: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, 16, dtype=D, generator=torch.Generator().manual_seed(seed))


def _step(model: nn.Module, x: torch.Tensor, memory: ActivationMemory | None = None):
    """Output, every parameter gradient, the input gradient and the saved-activation peaks."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    memory = memory or ActivationMemory([model], torch.device("cpu"))
    memory.start_step()
    with memory.track():
        out = model(x)
        peaks = memory.peaks()
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=D)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.detach(), grads, x.grad.clone(), peaks


def _assert_same(a, b, atol: float = 0.0) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=atol)
    torch.testing.assert_close(a[2], b[2], rtol=0, atol=atol)
    assert a[1].keys() == b[1].keys()
    for n, g in a[1].items():
        torch.testing.assert_close(b[1][n], g, rtol=0, atol=atol, msg=n)


def test_recompute_is_exact_keeps_names_and_keeps_fewer_bytes():
    ref = _step(blocks(), _x())
    kept = {}
    for name, branches in (("block", ()), ("attention", ["attention_branch"]), ("mlp", ["mlp_branch"])):
        model = blocks()
        names = [n for n, _ in model.named_parameters()]
        apply_ac(model, branches)
        assert [n for n, _ in model.named_parameters()] == names
        got = _step(model, _x())
        _assert_same(ref, got)
        kept[name] = got[3].activation_bytes
    saved = ref[3].activation_bytes
    assert kept["block"] < kept["attention"] < saved and kept["block"] < kept["mlp"] < saved, (kept, saved)
    with pytest.raises(ValueError, match="no residual branch method 'moe_branch'"):
        apply_ac(blocks(), ["moe_branch"])


def test_offload_is_exact_and_moves_the_blocks_bytes_to_the_offloaded_count():
    ref = _step(blocks(), _x())
    model = blocks()
    memory = ActivationMemory([model], torch.device("cpu"))
    apply_offload(model, memory)
    got = _step(model, _x(), memory)
    _assert_same(ref, got)
    # on CPU the offloaded tensors stay where they are: the same bytes, counted as offloaded
    assert got[3].activation_bytes == 0 < got[3].offloaded_bytes == ref[3].activation_bytes


def test_compiled_blocks_match_eager_and_compile_once_for_every_length():
    eager, compiled = blocks(), blocks()
    counter = CompileCounter()
    apply_compile(compiled, backend=counter)
    seen = []
    for seed, t in enumerate((5, 13, 8)):
        _assert_same(_step(eager, _x(t, seed)), _step(compiled, _x(t, seed)), atol=1e-12)
        seen.append(counter.frame_count)
    assert seen[0] > 0 and seen == [seen[0]] * 3, seen  # no recompilation for a new length
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]


def test_training_dtypes():
    assert training_dtypes("bfloat16") == (torch.float32, torch.bfloat16)
    assert training_dtypes(torch.bfloat16) == (torch.float32, torch.bfloat16)
    assert training_dtypes("float32") == (torch.float32, torch.float32)
    assert training_dtypes("float64") == (torch.float64, torch.float64)
    with pytest.raises(ValueError, match="'float16' is not a training dtype"):
        training_dtypes("float16")


class _Stage(nn.Module):
    """A stage that records the dtype its own forward receives."""

    def __init__(self, embed: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8) if embed else None
        self.proj = nn.Linear(8, 8)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return self.proj(self.embed(x) if self.embed is not None else x)


def test_mixed_precision_casts_what_crosses_the_wire_and_autocasts_the_rest():
    torch.manual_seed(0)
    first, last, encoder = _Stage(True), _Stage(False), nn.Linear(4, 8)
    ref_first, ref_last, ref_encoder = (
        _Stage(True),
        _Stage(False),
        nn.Linear(4, 8),
    )
    for a, b in ((first, ref_first), (last, ref_last), (encoder, ref_encoder)):
        b.load_state_dict(a.state_dict(), strict=False)
    apply_mixed_precision({0: first, 1: last}, 2, torch.bfloat16, modules=[encoder])
    ids = torch.tensor([1, 4, 7])
    wire = first(ids)
    out = last(wire)
    assert wire.dtype == torch.bfloat16 and first.seen == [torch.int64]  # stage 0: ids as they are
    assert last.seen == [torch.float32]  # upcast back to the parameters' dtype on arrival
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_wire = ref_first(ids).to(torch.bfloat16)
        want_out = ref_last(want_wire.float())
        want_enc = ref_encoder(torch.ones(2, 4))
    assert out.dtype == want_out.dtype == torch.bfloat16  # the last stage's output: as autocast made it
    torch.testing.assert_close(wire, want_wire, rtol=0, atol=0)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(encoder(torch.ones(2, 4)), want_enc, rtol=0, atol=0)

    # a middle stage both upcasts its input and casts its output for the wire
    middle = _Stage(False)
    apply_mixed_precision({1: middle}, 3, torch.bfloat16)
    assert middle(wire).dtype == torch.bfloat16 and middle.seen == [torch.float32]

    same = _Stage(False)
    apply_mixed_precision({0: same}, 1, torch.float32)
    assert "forward" not in same.__dict__  # compute == parameter dtype: untouched
    with pytest.raises(ValueError, match=r"stage indices \[2\] outside \[0, 2\)"):
        apply_mixed_precision({2: _Stage(False)}, 2, torch.bfloat16)
    with pytest.raises(ValueError, match="no stages"):
        apply_mixed_precision({}, 2, torch.bfloat16)


def _tp(rank: int, world_size: int):
    ps = ParallelState.build(ParallelConfig(tp=world_size))
    block = Block(seed=3).to(D)
    apply_tp([block], ps, llama_tp_plan())
    sharded = sum(isinstance(p, DTensor) for p in block.parameters())
    out, _, x_grad, _ = _step(block, _x())
    return out, x_grad, sharded


def test_tp_blocks_equal_the_unsharded_block():
    ref_out, _, ref_x_grad, _ = _step(Block(seed=3).to(D), _x())
    for out, x_grad, sharded in run_world(_tp, 2, timeout_s=120):
        assert sharded == 7  # wq, wk, wv, wo, w1, w2, w3
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(x_grad, ref_x_grad, rtol=0, atol=1e-12)


def _grads_of(rank: int, module: nn.Module) -> None:
    g = torch.Generator().manual_seed(10 + rank)
    for p in module.parameters():
        p.grad = torch.randn(p.shape, dtype=D, generator=g)


def _encoders() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({"image": nn.Linear(3, 2), "audio": nn.Linear(2, 2), "proj": nn.Linear(2, 2)}).to(D)


def _syncs(rank: int, world_size: int):
    ps = ParallelState.build(ParallelConfig(dp=world_size), groups=GroupSpec(encoder_sync=True))
    llm = nn.Linear(4, 3).to(D)
    _grads_of(rank, llm)
    apply_dp([llm], ps)()
    encoders = _encoders()
    towers = {"image": encoders["image"], "audio": encoders["audio"]}
    sync = apply_encoder_zero(encoders, towers, ps, 0)
    out = {"llm": {n: p.grad.clone() for n, p in llm.named_parameters()}}
    for ran in (["image"], None):
        encoders.zero_grad(set_to_none=True)
        sync.attach()  # gradients become views of the flat buffers, zeroed
        assert all(p.grad is not None and not p.grad.any() for p in encoders.parameters())
        for p, g in zip(encoders.parameters(), _encoder_grads(rank), strict=True):
            p.grad += g  # what a backward would accumulate
        sync(ran)
        out[str(ran)] = {n: p.grad.clone() for n, p in encoders.named_parameters()}
    return out


def _encoder_grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(20 + rank)
    return [torch.randn(p.shape, dtype=D, generator=g) for p in _encoders().parameters()]


def test_llm_sync_sums_over_dp_and_encoder_sync_sums_the_towers_that_ran():
    world = 2
    results = run_world(_syncs, world, timeout_s=120)
    llms = []
    for r in range(world):
        llm = nn.Linear(4, 3).to(D)
        _grads_of(r, llm)
        llms.append({n: p.grad for n, p in llm.named_parameters()})
    names = [n for n, _ in _encoders().named_parameters()]
    summed = dict(
        zip(names, [sum(gs) for gs in zip(*(_encoder_grads(r) for r in range(world)))], strict=True)
    )
    for rank, got in enumerate(results):
        for n, g in got["llm"].items():
            torch.testing.assert_close(g, llms[0][n] + llms[1][n], rtol=0, atol=1e-15)
        own = dict(zip(names, _encoder_grads(rank), strict=True))
        for n in names:
            torch.testing.assert_close(got["None"][n], summed[n], rtol=0, atol=1e-15)
            # audio ran nowhere: not reduced (its local gradient stays); image and shared ones summed
            want = own[n] if n.startswith("audio") else summed[n]
            torch.testing.assert_close(got["['image']"][n], want, rtol=0, atol=1e-15, msg=n)


def test_encoder_zero_refuses_unknown_stages_and_towers():
    with fake_world(2):
        ps = ParallelState.build(ParallelConfig(dp=2), groups=GroupSpec(encoder_sync=True))
        encoders = _encoders()
        with pytest.raises(ValueError, match="ZeRO stage 1 is not supported"):
            apply_encoder_zero(encoders, {"image": encoders["image"]}, ps, 1)
        with pytest.raises(ValueError, match=r"blocks given for towers \['video'\]"):
            apply_encoder_zero(encoders, {"image": encoders["image"]}, ps, 3, blocks={"video": []})
        for stage in ("2", True, 2.0):  # not an int stage: refused, naming the value as given
            with pytest.raises(
                ValueError, match=rf"ZeRO stage {stage!r} is not supported \(zero_stage: 0, 2"
            ):
                apply_encoder_zero(encoders, {"image": encoders["image"]}, ps, stage)
        # the encoders' reductions need their own group, which only ParallelState.build creates
        plain = ParallelState.build(ParallelConfig(dp=2))
        assert plain.encoder_sync_group is None and ps.encoder_sync_group is not None
        with pytest.raises(ValueError, match=r"GroupSpec\(encoder_sync=True\)"):
            apply_encoder_zero(encoders, {"image": encoders["image"]}, plain, 0)
