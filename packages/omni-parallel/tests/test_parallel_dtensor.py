"""Tensor parallelism (DTensor plans) and encoder FSDP2 against single-process float64 runs, in one
world: both import DTensor, which costs seconds per process, so they share it. The encoder oracle is the
plain sum of every rank's slice (the objective's reduction), with uneven work per rank (one rank none)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omni_parallel import EncoderLayout, ParallelConfig, ParallelState
from omni_parallel.encoder_zero import gather_parameters, reduce_scatter_gradients
from omni_parallel.tensor_parallel import apply_tensor_parallel, check_tp_heads, llama_tp_plan
from omni_parallel.testing import run_world
from omni_parallel.varlen import varlen_attention


class _Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, cu):
        t = x.shape[0]
        q = self.wq(x).view(t, -1, self.head_dim)  # -1: the local heads under TP
        k = self.wk(x).view(t, -1, self.head_dim)
        v = self.wv(x).view(t, -1, self.head_dim)
        return self.wo(varlen_attention(q, k, v, cu).reshape(t, -1))


class _MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = _Attention(16, 4, 2)
        self.feed_forward = _MLP(16, 24)

    def forward(self, x, cu):
        h = x + self.attention(x, cu)
        return h + self.feed_forward(h)


def _make(seed):
    torch.manual_seed(seed)
    return _Block().double()


def _dtensor_world(rank, world_size):
    state = ParallelState.build(ParallelConfig(tp=world_size))
    cu = torch.tensor([0, 5, 12])
    x = torch.randn(12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = torch.randn(12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref = _make(0)
    xr = x.clone().requires_grad_()
    out_ref = ref(xr, cu)
    (out_ref * w).sum().backward()

    tp = apply_tensor_parallel(_make(0), state.device_mesh("tp"), llama_tp_plan())
    xt = x.clone().requires_grad_()
    out = tp(xt, cu)
    (out * w).sum().backward()
    diffs = {"out": (out - out_ref).abs().max().item(), "x.grad": (xt.grad - xr.grad).abs().max().item()}
    ref_params = dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        diffs[name] = (p.grad.full_tensor() - ref_params[name].grad).abs().max().item()
    sharded = {n: tuple(p.to_local().shape) for n, p in tp.named_parameters()}

    # Encoder FSDP2 over every rank (ZeRO-3) on the step-scoped schedule: rank r encodes rows [0, 3r) of
    # the batch (rank 0 none), the summed gradient is the whole batch's (no mean over the mesh).
    enc = state.encoder_state(EncoderLayout(sp=1, reshard_after_forward=True))
    model, ref2 = _make(3).feed_forward, _make(3).feed_forward
    xe = torch.randn(world_size * 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ref2(xe[: sum(3 * r for r in range(world_size))]).pow(2).sum().backward()
    enc.shard(model, blocks=[model.w1])
    gather_parameters([model])
    if rank:
        lo = sum(3 * r for r in range(rank))
        model(xe[lo : lo + 3 * rank]).pow(2).sum().backward()
    reduce_scatter_gradients([model])
    for (name, p), q in zip(model.named_parameters(), ref2.parameters()):
        diffs[f"fsdp.{name}"] = (p.grad.full_tensor() - q.grad).abs().max().item()
    return diffs, sharded


def test_tensor_parallel_block_and_encoder_fsdp_match_single_process():
    for diffs, sharded in run_world(_dtensor_world, 2, timeout_s=180):
        assert sharded["attention.wq.weight"] == (8, 16)  # 2 of 4 heads
        assert sharded["attention.wk.weight"] == (4, 16)  # 1 of 2 KV heads
        assert sharded["attention.wo.weight"] == (16, 8)
        assert sharded["feed_forward.w2.weight"] == (16, 12)
        for name, d in diffs.items():
            assert d <= 1e-10, (name, d)


def test_plan_names_and_checks():
    plan = llama_tp_plan(attention="self_attn", mlp="mlp", q_proj="q_proj")
    assert "self_attn.q_proj" in plan and "mlp.w2" in plan
    with pytest.raises(ValueError, match="must divide"):
        check_tp_heads(28, 7, 2)
    check_tp_heads(28, 7, 7)


def test_plan_with_unknown_module_is_a_clear_error():
    # Names are checked before the mesh is touched, so no process group is needed here.
    with pytest.raises(ValueError, match=r"self_attn\.wq"):
        apply_tensor_parallel(_make(0), None, llama_tp_plan(attention="self_attn"))
