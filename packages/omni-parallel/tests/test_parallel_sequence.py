"""Ulysses and CP attention against the single-process float64 reference (forward and input grads)."""

import torch
import torch.distributed as dist

from omni_parallel import EncoderLayout, ParallelConfig, ParallelState, all_reduce_sum
from omni_parallel.context_parallel import (
    context_parallel_attention,
    cp_layout,
    shard_for_cp,
    unshard_from_cp,
)
from omni_parallel.long_short import plan_long_short
from omni_parallel.reshard import ReshardPlan, reshard_to_llm
from omni_parallel.testing import run_world
from omni_parallel.ulysses import ulysses_attention
from omni_parallel.varlen import cu_seqlens_from_lengths, varlen_attention

TOL = 1e-10


def _inputs(seed, tokens, hq, hkv, d=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(tokens, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(tokens, hkv, d, generator=g, dtype=torch.float64)
    w = torch.randn(tokens, hq, d, generator=g, dtype=torch.float64)  # loss weights
    return q, k, v, w


def _reference(q, k, v, w, cu, causal):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = varlen_attention(q, k, v, cu, causal=causal)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _maxdiff(a, b):
    return (a - b).abs().max().item()


# (seed, doc lengths, heads_q, heads_kv, causal); tokens divisible by the world size for Ulysses.
ULYSSES_CASES = {
    2: [(1, [5, 9, 2], 28, 7, True), (2, [16], 4, 4, False), (3, [1, 7, 3, 1], 6, 2, True)],
    4: [(4, [5, 9, 2], 12, 3, True), (5, [3, 13], 7, 7, True), (6, [8, 8], 8, 2, False)],
}
CP_CASES = {
    2: [(7, [7], 4, 2, True), (8, [7, 1, 12, 3], 6, 3, True), (9, [5, 6], 4, 4, False)],
    4: [(10, [7, 16, 2], 4, 2, True), (11, [9], 3, 1, True), (12, [1, 30], 2, 2, False)],
}


def _sequence_world(rank, world_size):
    group = dist.group.WORLD
    results = []
    for seed, lengths, hq, hkv, causal in ULYSSES_CASES[world_size]:
        cu = cu_seqlens_from_lengths(lengths)
        q, k, v, w = _inputs(seed, int(cu[-1]), hq, hkv)
        ref = _reference(q, k, v, w, cu, causal)
        t = q.shape[0] // world_size
        sl = slice(rank * t, (rank + 1) * t)
        lq, lk, lv = (x[sl].clone().requires_grad_() for x in (q, k, v))
        out = ulysses_attention(lq, lk, lv, group, cu_seqlens=cu, causal=causal)
        (out * w[sl]).sum().backward()
        diffs = [_maxdiff(out, ref[0][sl])] + [_maxdiff(a.grad, b[sl]) for a, b in zip((lq, lk, lv), ref[1:])]
        results.append(("ulysses", seed, max(diffs)))
    for seed, lengths, hq, hkv, causal in CP_CASES[world_size]:
        cu = cu_seqlens_from_lengths(lengths)
        q, k, v, w = _inputs(seed, int(cu[-1]), hq, hkv)
        ref = _reference(q, k, v, w, cu, causal)
        lq, lk, lv = (shard_for_cp(x, cu, group).detach().requires_grad_() for x in (q, k, v))
        out = context_parallel_attention(lq, lk, lv, group, cu_seqlens=cu, causal=causal)
        lw = shard_for_cp(w, cu, group)
        (out * lw).sum().backward()
        # Compare through the shard map: local grads equal the reference grads at the same tokens.
        diffs = [_maxdiff(out, shard_for_cp(ref[0], cu, group))]
        diffs += [_maxdiff(a.grad, shard_for_cp(b, cu, group)) for a, b in zip((lq, lk, lv), ref[1:])]
        # Padding never leaks: padded output rows are exactly zero, and unshard restores the reference.
        src = torch.tensor(cp_layout(cu, world_size).source[rank])
        pad_out = out.detach()[src < 0]
        full = unshard_from_cp(out.detach(), cu, group)
        diffs.append(_maxdiff(full, ref[0]))
        results.append(("cp", seed, max(diffs), float(pad_out.abs().sum()) if pad_out.numel() else 0.0))
    # unshard_from_cp's backward (reduce-scatter): every rank back-propagates loss / cp.
    cu = cu_seqlens_from_lengths([7, 5])
    x = torch.randn(12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    wx = torch.randn(12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    lx = shard_for_cp(x, cu, group).requires_grad_()
    (unshard_from_cp(lx, cu, group) * wx).sum().div(world_size).backward()
    results.append(("unshard", 0, _maxdiff(lx.grad, shard_for_cp(wx, cu, group))))
    # all_reduce_sum: out = sum_r x_r on every rank; d(sum_r <out_r, w_r>)/dx = sum_r w_r.
    xs = [
        torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(40 + r))
        for r in range(world_size)
    ]
    ws = [
        torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(50 + r))
        for r in range(world_size)
    ]
    xr = xs[rank].clone().requires_grad_()
    summed = all_reduce_sum(xr, group)
    (summed * ws[rank]).sum().backward()
    results.append(("all_reduce", 0, max(_maxdiff(summed, sum(xs)), _maxdiff(xr.grad, sum(ws)))))
    results += _reshard_cases(rank, world_size, group)
    results += _long_short_cases(rank, world_size)
    return results


def _reshard_cases(rank, world_size, group):
    out = []
    g = torch.Generator().manual_seed(20 + world_size)
    cu = cu_seqlens_from_lengths([7, 9, 3, 5])  # 24 tokens: divisible by 2 and 4
    pack = int(cu[-1])
    filled = torch.randperm(pack, generator=g)[:17].tolist()  # the other 7 are text tokens
    cuts = sorted(torch.randint(0, 18, (world_size - 1,), generator=g).tolist())
    bounds = [0, *cuts, 17]
    positions = [filled[bounds[r] : bounds[r + 1]] for r in range(world_size)]  # uneven on purpose
    emb = torch.randn(pack, 5, generator=g, dtype=torch.float64)
    w = torch.randn(pack, 5, generator=g, dtype=torch.float64)
    full = torch.zeros(pack, 5, dtype=torch.float64)
    full[filled] = emb[filled]
    mask = torch.zeros(pack, dtype=torch.bool)
    mask[filled] = True
    plan = ReshardPlan(pack, positions, cu_seqlens=cu.tolist())
    for mode in ("ulysses", "cp", "cp"):  # cp twice: the reused buffer must not carry state over
        mine = emb[positions[rank]].clone().requires_grad_()
        local, ok = reshard_to_llm(mine, plan, group, mode)
        if mode == "ulysses":
            t = pack // world_size
            want, want_ok, lw = (
                full[rank * t : (rank + 1) * t],
                mask[rank * t : (rank + 1) * t],
                w[rank * t : (rank + 1) * t],
            )
        else:
            want = shard_for_cp(full, cu, group)
            want_ok = shard_for_cp(mask.unsqueeze(1).double(), cu, group).squeeze(1).bool()
            lw = shard_for_cp(w, cu, group)
        (local * lw).sum().backward()
        bad_mask = int((ok != want_ok).sum())
        out.append(
            (f"reshard-{mode}", bad_mask, max(_maxdiff(local, want), _maxdiff(mine.grad, w[positions[rank]])))
        )
    return out


def _long_short_cases(rank, world_size):
    # Encoder self-attention (bidirectional) over samples placed by the long-short plan.
    state = ParallelState.build(ParallelConfig())
    enc = state.encoder_state(EncoderLayout(sp=2, long_threshold=6))
    lengths = [11, 3, 8, 2, 5, 17, 1, 4]
    cu = cu_seqlens_from_lengths(lengths)
    q, k, v, w = _inputs(30 + world_size, int(cu[-1]), 4, 2)
    ref = _reference(q, k, v, w, cu, False)
    plan = plan_long_short(lengths, 2, 6, world_size)
    pieces = plan.pieces[rank]
    group_idx = rank // 2
    long_cu = plan.long_cu_seqlens[group_idx]
    chunk = long_cu[-1] // 2
    idx_long = [
        int(cu[p.sample]) + j for p in pieces if p.sample in plan.long_group for j in range(p.start, p.end)
    ]
    shorts = [p for p in pieces if p.sample not in plan.long_group]
    idx_short = [int(cu[p.sample]) + j for p in shorts for j in range(p.start, p.end)]
    lq, lk, lv = (x[idx_long].clone().requires_grad_() for x in (q, k, v))
    sq, sk, sv = (x[idx_short].clone().requires_grad_() for x in (q, k, v))
    pad = chunk - len(idx_long)
    padded = [torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in (lq, lk, lv)]
    out_long = ulysses_attention(*padded, enc.sp_group, cu_seqlens=long_cu, causal=False)[: len(idx_long)]
    out_short = varlen_attention(
        sq, sk, sv, cu_seqlens_from_lengths([p.tokens for p in shorts]), causal=False
    )
    loss = (out_long * w[idx_long]).sum() + (out_short * w[idx_short]).sum()
    loss.backward()
    diffs = [_maxdiff(out_long, ref[0][idx_long]), _maxdiff(out_short, ref[0][idx_short])]
    diffs += [_maxdiff(a.grad, b[idx_long]) for a, b in zip((lq, lk, lv), ref[1:])]
    diffs += [_maxdiff(a.grad, b[idx_short]) for a, b in zip((sq, sk, sv), ref[1:])]
    return [("long-short", len(idx_long) + len(idx_short), max(diffs))]


def _check(results):
    for rank, res in enumerate(results):
        for entry in res:
            assert entry[2] <= TOL, (rank, entry)
            if entry[0] == "cp":
                assert entry[3] == 0.0, (rank, entry)
            if entry[0].startswith("reshard"):
                assert entry[1] == 0, (rank, entry)
    # Long-short: every token of every sample encoded exactly once across ranks.
    assert sum(e[1] for res in results for e in res if e[0] == "long-short") == 51


def test_ulysses_and_cp_match_float64_reference_on_2_ranks():
    _check(run_world(_sequence_world, 2, timeout_s=120))


def test_ulysses_and_cp_match_float64_reference_on_4_ranks():
    _check(run_world(_sequence_world, 4, timeout_s=120))


def test_cp_layout_head_tail_chunks_of_a_length_7_document():
    layout = cp_layout([0, 7], 2)
    # Padded to 8, chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert layout.source == ((0, 1, 6, -1), (2, 3, 4, 5))
    assert layout.position == ((0, 1, 6, 7), (2, 3, 4, 5))
    assert layout.local_cu_seqlens == (0, 4)
    x = torch.arange(7.0).unsqueeze(1)
    assert shard_for_cp(x, [0, 7], cp_rank=0, cp_size=2).squeeze(1).tolist() == [0.0, 1.0, 6.0, 0.0]


def _dense_reference(q, k, v, lengths, causal):
    # Written out from the definition, independent of SDPA and of varlen_attention: one softmax over
    # the whole pack with a block-diagonal (and causal) mask; query head h reads KV head h // rep.
    tokens, hq, d = q.shape
    rep = hq // k.shape[1]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(tokens)
    allowed = doc.unsqueeze(1) == doc.unsqueeze(0)
    if causal:
        allowed &= pos.unsqueeze(1) >= pos.unsqueeze(0)
    out = torch.empty_like(q)
    for h in range(hq):
        scores = q[:, h] @ k[:, h // rep].T / d**0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // rep]
    return out


def test_varlen_reference_kernel_matches_dense_attention_by_definition():
    # varlen_attention is the oracle of every distributed test, so it is itself checked here.
    for seed, lengths, hq, hkv, causal in [(40, [5, 9, 2], 6, 2, True), (41, [1, 7, 3], 4, 4, False)]:
        cu = cu_seqlens_from_lengths(lengths)
        q, k, v, _ = _inputs(seed, sum(lengths), hq, hkv)
        got = varlen_attention(q, k, v, cu, causal=causal)
        assert _maxdiff(got, _dense_reference(q, k, v, lengths, causal)) <= TOL
