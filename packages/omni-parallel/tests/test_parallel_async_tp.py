"""Async TP (:mod:`omni_parallel.async_tp`) on 2 and 4 gloo processes against one float64 process:

* ``all_gather_matmul`` (three weights of uneven widths) and ``matmul_reduce_scatter``: outputs and every
  gradient equal the brute-force float64 computation (<= 1e-12);
* blocks under ``llama_tp_plan(sequence_dim=0, async_tp=True)`` (2 ranks): the same parameter placements as
  the plain SP plan, outputs and every gradient equal to one process, with and without recompute (whole
  blocks, the MLP branch); under bfloat16 autocast the same dtypes and values (a few ulps) as plain SP;
  and (4 ranks, dp=2 x tp=2) under ZeRO-3 (FSDP2 over the TP DTensors) with recompute;
* it overlaps: in a profile of a block's forward and backward each ring step's transfers are posted before
  that step's matmuls start and waited for after they end, and no all-gather / reduce-scatter collective
  runs (the plain SP plan's profile, read the same way, has them).
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
from parallel_blocks import blocks
from torch.distributed.tensor import DTensor

from omni_parallel import ParallelConfig, ParallelState, apply_ac
from omni_parallel.async_tp import all_gather_matmul, matmul_reduce_scatter
from omni_parallel.llm_zero import apply_llm_zero
from omni_parallel.state import GroupSpec
from omni_parallel.tensor_parallel import apply_tensor_parallel, llama_tp_plan, reduce_partial_gradients
from omni_parallel.testing import run_world

T, D = 8, 16
OUTS = (3, 1, 2)  # per-rank widths of the three gathered weights (uneven)


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _functions_world(rank, tp):
    group = dist.group.WORLD  # the ring over every rank
    tl, rows = T // tp, slice(rank * T // tp, (rank + 1) * T // tp)
    diffs = {}
    # all_gather_matmul: Y_i = X W_i^T, W_i column-sharded; loss sum_i <Y_i, G_i>
    x = _randn(T, D, seed=1)
    ws = [_randn(o * tp, D, seed=10 + i) for i, o in enumerate(OUTS)]
    gs = [_randn(T, o * tp, seed=20 + i) for i, o in enumerate(OUTS)]
    ref_x, ref_ws = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
    ref_ys = [ref_x @ w.t() for w in ref_ws]
    sum((y * g).sum() for y, g in zip(ref_ys, gs)).backward()
    shard = [slice(rank * o, (rank + 1) * o) for o in OUTS]
    my_x = x[rows].clone().requires_grad_()
    my_ws = [w[s].clone().requires_grad_() for w, s in zip(ws, shard)]
    ys, x_full = all_gather_matmul(my_x, my_ws, group, return_gathered=True)
    sum((y * g[:, s]).sum() for y, g, s in zip(ys, gs, shard)).backward()
    diffs["ag x_full"] = (x_full - x).abs().max().item()
    for i, (y, ry, s) in enumerate(zip(ys, ref_ys, shard)):
        diffs[f"ag y{i}"] = (y - ry[:, s]).abs().max().item()
        diffs[f"ag dw{i}"] = (my_ws[i].grad - ref_ws[i].grad[s]).abs().max().item()
    diffs["ag dx"] = (my_x.grad - ref_x.grad[rows]).abs().max().item()
    # matmul_reduce_scatter: out = (Y W^T)[my rows], W row-sharded (its input features)
    f = 3 * tp
    y, w, g = _randn(T, f, seed=2), _randn(D, f, seed=3), _randn(T, D, seed=4)
    ref_y, ref_w = y.clone().requires_grad_(), w.clone().requires_grad_()
    ref_out = ref_y @ ref_w.t()
    (ref_out * g).sum().backward()
    cols = slice(rank * 3, (rank + 1) * 3)
    my_y, my_w = y[:, cols].clone().requires_grad_(), w[:, cols].clone().requires_grad_()
    out = matmul_reduce_scatter(my_y, my_w, group)
    (out * g[rows]).sum().backward()
    diffs["rs out"] = (out - ref_out[rows]).abs().max().item()
    diffs["rs dy"] = (my_y.grad - ref_y.grad[:, cols]).abs().max().item()
    diffs["rs dw"] = (my_w.grad - ref_w.grad[:, cols]).abs().max().item()
    assert out.shape == (tl, D)
    if tp == 4:
        diffs.update(_zero3(rank))
    return diffs


def _zero3(rank):
    """ZeRO-3 (FSDP2 over the TP DTensors: ``apply_llm_zero`` on the 2-D data x tp mesh, blocks freed
    after their forward) of blocks under async TP at dp=2 x tp=2, recomputed, against one float64 process
    of both replicas' losses summed."""
    ps = ParallelState.build(ParallelConfig(tp=2, pp=1, dp=2), groups=GroupSpec(data_mesh=True))
    ref = blocks(2)
    for d in range(2):
        (ref(_randn(T, D, seed=30 + d)) * _randn(T, D, seed=40 + d)).sum().backward()
    model = blocks(2)
    for block in model:
        apply_tensor_parallel(block, ps.device_mesh("tp"), llama_tp_plan(sequence_dim=0, async_tp=True))
    apply_ac(model)
    sync = apply_llm_zero([model], ps, 3, blocks=list(model), reshard_after_forward=True)
    sync.attach()
    d, t = ps.local_rank("dp_cp"), ps.local_rank("tp")
    rows = slice(t * T // 2, (t + 1) * T // 2)
    sync.arm(model)
    (model(_randn(T, D, seed=30 + d)[rows]) * _randn(T, D, seed=40 + d)[rows]).sum().backward()
    sync()
    want = dict(ref.named_parameters())
    return {
        f"zero3 {n}": (p.grad.full_tensor() - want[n].grad).abs().max().item()
        for n, p in model.named_parameters()
    }


def _forward_backward(model, x, rank, tp):
    rows = slice(rank * T // tp, (rank + 1) * T // tp)
    mine = x[rows].clone().requires_grad_()
    out = model(mine)
    (out * _randn(T, D, seed=5)[rows]).sum().backward()
    return out, mine


def _run_blocks(model, x, rank, tp):
    """Forward and backward of ``model`` on this rank's token shard; (output shard, input grad, grads)."""
    out, mine = _forward_backward(model, x, rank, tp)
    reduce_partial_gradients(model.parameters())
    grads = {
        n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for n, p in model.named_parameters()
    }
    return out.detach(), mine.grad, grads


def _profile(model, x, rank, tp):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _forward_backward(model, x, rank, tp)
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()]


def _watch_gathered(model):
    """Weak references to every gathered input the async TP regions of ``model`` hand their modules (in
    forward and in recompute): after backward none may be alive."""
    refs = []
    for block in model:
        for region in (block.attention, block.feed_forward):  # registered after AsyncTPRegion's own hook
            region.register_forward_pre_hook(lambda _m, args, refs=refs: refs.append(weakref.ref(args[0])))
    return refs


def _blocks_world(rank, tp):
    ps = ParallelState.build(ParallelConfig(tp=tp, pp=1))
    mesh = ps.device_mesh("tp")
    x = _randn(T, D, seed=6)
    ref = blocks(2)
    ref_x = x.clone().requires_grad_()
    (ref(ref_x) * _randn(T, D, seed=5)).sum().backward()
    rows = slice(rank * T // tp, (rank + 1) * T // tp)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    def build(async_tp, recompute=(), dtype=torch.float64):
        model = blocks(2, dtype)
        for block in model:
            apply_tensor_parallel(block, mesh, llama_tp_plan(sequence_dim=0, async_tp=async_tp))
        if recompute is not None:
            apply_ac(model, recompute)
        return model

    sp = build(False, None)
    placements = {
        n: tuple(p.placements) if isinstance(p, DTensor) else None for n, p in sp.named_parameters()
    }
    diffs, same_placements = {}, []
    for name, recompute in (
        ("async", None),
        ("async-recompute", ()),
        ("async-recompute-mlp", ["mlp_branch"]),
    ):
        model = build(True, recompute)
        gathered = _watch_gathered(model)
        same_placements.append(
            placements
            == {
                n: tuple(p.placements) if isinstance(p, DTensor) else None
                for n, p in model.named_parameters()
            }
        )
        out, dx, grads = _run_blocks(model, x, rank, tp)
        gc.collect()
        diffs[f"{name} gathered inputs alive"] = float(sum(r() is not None for r in gathered))
        ref_out = ref(x)[rows]
        diffs[f"{name} out"] = (out - ref_out).abs().max().item()
        diffs[f"{name} dx"] = (dx - ref_x.grad[rows]).abs().max().item()
        for n, g in grads.items():
            diffs[f"{name} {n}"] = (g - ref_grads[n]).abs().max().item()
    # bfloat16 autocast over float32 blocks: the same casts (and output dtype) as plain SP's F.linear
    bf16 = []
    for async_tp in (False, True):
        mine = x[rows].float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = build(async_tp, None, torch.float32)(mine)
        out.float().sum().backward()
        bf16.append((out.dtype, out.detach().float(), mine.grad))
    (sp_dtype, sp_out, sp_dx), (a_dtype, a_out, a_dx) = bf16
    diffs["bf16 dtype"] = float(sp_dtype != a_dtype)
    # bf16 rounding of O(1) values summed in another order
    diffs["bf16 out"] = (a_out - sp_out).abs().max().item()
    diffs["bf16 dx"] = (a_dx - sp_dx).abs().max().item()
    profiles = _profile(build(True, None), x, rank, tp), _profile(sp, x, rank, tp)
    return _functions_world(rank, tp), diffs, same_placements, *profiles


def _collectives(events):
    """The all-gather / reduce-scatter collectives in a profile (c10d and functional-collective ops, gloo)."""
    return sorted(
        {
            n
            for n, _, _ in events
            if n.lower().startswith(("c10d::", "_c10d_functional::", "gloo:"))
            and any(k in n.lower() for k in ("all_gather", "allgather", "reduce_scatter"))
        }
    )


def _check_overlap(events):
    """Every ring step's transfers are posted before its matmuls start and waited for after they end;
    returns the number of ring steps checked."""
    by_name: dict[str, list] = {}
    for name, start, end in sorted(events, key=lambda e: e[1]):
        if name.startswith("async_tp."):
            by_name.setdefault(name, []).append((start, end))
    steps = 0
    for name, spans in by_name.items():
        ring, phase, step = name.split(".")[1:]
        if phase != "post":
            continue
        matmuls, waits = by_name[f"async_tp.{ring}.matmul.{step}"], by_name[f"async_tp.{ring}.wait.{step}"]
        assert len(spans) == len(matmuls) == len(waits), name
        for (p0, _), (m0, m1), (w0, _) in zip(spans, matmuls, waits):
            assert p0 <= m0 and m1 <= w0, (name, p0, m0, m1, w0)
            steps += 1
    return steps


def _check_functions(diffs, tp):
    assert len(diffs) == 11 + (22 if tp == 4 else 0), sorted(diffs)
    for name, d in diffs.items():
        assert d <= 1e-12, (tp, name, d)


def test_functions_on_4_ranks_and_zero3_match_one_process():
    for diffs in run_world(_functions_world, 4, timeout_s=120):
        _check_functions(diffs, 4)


def test_functions_and_blocks_on_2_ranks_match_one_process_and_overlap():
    for functions, diffs, same_placements, async_events, sp_events in run_world(
        _blocks_world, 2, timeout_s=120
    ):
        _check_functions(functions, 2)
        assert all(same_placements)
        # out, dx, gathered inputs alive and 11 parameters x 2 blocks, three times; bf16 dtype, out, dx
        assert len(diffs) == 3 * (3 + 2 * 11) + 3, sorted(diffs)
        for name, d in diffs.items():
            assert d <= (0.1 if name.startswith("bf16") else 1e-12), (name, d)
        # forward: 2 blocks x 2 regions x (1 all-gather ring + 1 reduce-scatter ring) of 1 step each at
        # tp = 2; backward the same again
        assert _check_overlap(async_events) == 16
        assert not _collectives(async_events), _collectives(async_events)
        assert _collectives(sp_events), sorted({n for n, _, _ in sp_events})
