"""``omni_parallel.memory``: the bytes planned before the first step (on ``meta`` or a real device) equal
the bytes measured from the storages after it, for replicated, TP-sharded and FSDP2 (ZeRO-2 kept
gathered copies, ZeRO-3, uneven shards with padding) parameters on a 2-process gloo world; the analytic
formula agrees with both on even shapes; storages are counted once (views, flat buffers, meta tensors).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from omni_parallel.memory import (
    KINDS,
    adamw_state_bytes,
    analytic_state_bytes,
    block_activation_bytes,
    planned_state_bytes,
    saved_activation_bytes,
    state_bytes,
    storage_bytes,
)
from omni_parallel.testing import run_world


def test_storages_count_once_meta_included():
    a = torch.zeros(4, 4)
    assert storage_bytes([a, a[1:], a.view(-1)]) == 64
    m = torch.empty(4, 4, device="meta")
    assert storage_bytes([m, m[2:], torch.empty(3, device="meta"), None]) == 64 + 12
    seen: set[int] = set()
    assert storage_bytes([a], seen) == 64 and storage_bytes([a[0]], seen) == 0


def _model(device: str) -> nn.Module:
    with torch.device(device):
        # 3 and 5 rows over 2 ranks: FSDP2 pads the shards (2 + 1 rows, 3 + 2 rows)
        return nn.Sequential(nn.Linear(8, 3), nn.Linear(3, 5, bias=False), nn.Linear(5, 8))


def _shard(model: nn.Module, zero: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from omni_parallel.encoder_zero import configure_step_schedule

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    configure_step_schedule([model], keep_gathered=zero == 2)


def _world(rank, world_size):
    """Planned (before the step) and measured (after it) bytes per layout on this rank."""
    from omni_parallel.encoder_zero import gather_parameters, reduce_scatter_gradients

    out = {}
    for name, zero in (("replicated", 0), ("zero2", 2), ("zero3", 3)):
        torch.manual_seed(0)
        model = _model("cpu")
        if zero:
            _shard(model, zero)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        planned = planned_state_bytes([model], opt)
        if zero:
            gather_parameters([model])
        model(torch.randn(4, 8)).sum().backward()
        if zero:
            reduce_scatter_gradients([model], divide_by=1.0)
        else:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        if zero == 2:
            gather_parameters([model])  # the next step's gather fills the kept storage
            for unit in model:
                unit.reshard()
        out[name] = (planned, state_bytes([model], opt))
    return out


@pytest.mark.slow
def test_planned_equals_measured_on_gloo():
    for rank, per in enumerate(run_world(_world, 2, timeout_s=120)):
        for name, (planned, measured) in per.items():
            assert planned == measured, f"rank {rank} {name}: planned {planned}, measured {measured}"
        rep, z2, z3 = per["replicated"][1], per["zero2"][1], per["zero3"][1]
        assert z2["gathered"] > 0 and z3["gathered"] == 0 and rep["gathered"] == 0
        assert z3["optimizer"] < rep["optimizer"]


def test_planned_on_meta_equals_analytic():
    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(3))).to("meta")
    opt = torch.optim.AdamW(model.parameters(), fused=False)
    planned = planned_state_bytes([model], opt)
    want = analytic_state_bytes(3 * 64 * 64, tensors=3)
    assert planned == {k: int(want[k]) for k in KINDS}
    assert planned_state_bytes([model], opt, whole_gradients=True)["gradients"] == planned["gradients"]


def test_analytic_formula_stages():
    z = {s: analytic_state_bytes(1000, zero=s, shards=4, tp=2) for s in range(4)}
    assert z[0] == {"parameters": 2000, "gathered": 0, "gradients": 2000, "optimizer": 4000}
    assert z[1]["optimizer"] == 1000 and z[1]["gradients"] == 2000 and z[1]["gathered"] == 2000
    assert z[2]["gradients"] == 500 and z[3]["parameters"] == 500 and z[3]["gathered"] == 0
    # ZeRO 1 and 2 keep FSDP2 shards as the parameters, beside the whole gathered copy
    assert z[1]["parameters"] == z[2]["parameters"] == 500 and z[2]["gathered"] == 2000
    # TP-replicated parameters (norms, embedding, LM head) are not divided by tp
    r = analytic_state_bytes(1000, replicated=100, tp=2, tensors=3, step_bytes=8)
    assert r["parameters"] == (500 + 100) * 4 and r["optimizer"] == 2 * 600 * 4 + 3 * 8
    # bf16 gathered copies (MixedPrecisionPolicy param_dtype) over float32 masters: only `gathered` halves
    b = {s: analytic_state_bytes(1000, zero=s, shards=4, tp=2, gathered_bytes_per=2) for s in range(4)}
    assert [b[s]["gathered"] for s in range(4)] == [0, 1000, 1000, 0]
    assert all({k: v for k, v in b[s].items() if k != "gathered"} == {k: v for k, v in z[s].items()
               if k != "gathered"} for s in range(4))  # fmt: skip
    # routed experts: 1/ep of them per rank at every ZeRO stage, never gathered
    e = {s: analytic_state_bytes(1000, zero=s, shards=4, tp=2, experts=800, ep=2) for s in range(4)}
    for s in range(4):
        assert (
            e[s]["parameters"] == z[s]["parameters"] + 1600 and e[s]["gradients"] == z[s]["gradients"] + 1600
        )
        assert e[s]["optimizer"] == z[s]["optimizer"] + 3200 and e[s]["gathered"] == z[s]["gathered"]
    with pytest.raises(ValueError, match="zero in 0-3"):
        analytic_state_bytes(1, zero=4)
    with pytest.raises(ValueError, match="ep >= 1"):
        analytic_state_bytes(1, ep=0)
    with pytest.raises(ValueError, match="gathered_bytes_per must be >= 1"):
        analytic_state_bytes(1, gathered_bytes_per=0)


def test_adamw_state_step_dtype_and_refusal():
    p = nn.Parameter(torch.zeros(10, dtype=torch.float64))
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        opt = torch.optim.AdamW([p], foreach=False)
        planned = adamw_state_bytes(opt)
        p.grad = torch.zeros_like(p)
        opt.step()
        assert planned == state_bytes([nn.ParameterList([p])], opt)["optimizer"] == 2 * 80 + 8
    finally:
        torch.set_default_dtype(old)
    with pytest.raises(TypeError, match="Adam/AdamW only"):
        adamw_state_bytes(torch.optim.SGD([p]))


def test_block_activation_estimate_scales_with_tp_and_sp():
    # exactness against the app's block: apps/omni-train/tests/test_train_memory.py
    base = block_activation_bytes(1024, 512, 128, 1536)
    tp = block_activation_bytes(1024, 512, 128, 1536, tp=4)
    sp = block_activation_bytes(1024, 512, 128, 1536, tp=4, sequence_parallel=True)
    assert sp < tp < base
    # SP shards the norms' terms (2 x (2 dim + 1) per token) only: the projections' inputs are gathered
    assert (tp - sp) * 4 == 1024 * 2 * (2 * 512 + 1) * 4 * 3
    assert block_activation_bytes(1024, 512, 128, 1536, recompute=True) == 1024 * 512 * 4
    both = block_activation_bytes(
        1024, 512, 128, 1536, recompute=True, recompute_branches=("attention", "mlp")
    )
    assert both == 2 * 1024 * 512 * 4  # each checkpointed branch keeps its input
    with pytest.raises(ValueError, match="kernel"):
        block_activation_bytes(1, 1, 1, 1, kernel="xformers")
    x = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    n, _out = saved_activation_bytes(lambda: torch.tanh(x @ w), [w])
    assert n == 16 * 8 * 4 * 2  # x (the matmul's input) and tanh's output; w is a parameter


def test_fake_world_restores_excepthook():
    import sys

    from omni_parallel.testing import fake_world

    hook = sys.excepthook
    with fake_world(8, rank=3):
        assert dist.get_world_size() == 8
    # init_process_group installs a "[rank3]:" prefixing hook; it must not outlive the fake world
    assert sys.excepthook is hook and not dist.is_initialized()
