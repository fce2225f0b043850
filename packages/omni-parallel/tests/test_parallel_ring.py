"""Ring attention and hybrid DP/CP local sequences against the single-process float64 reference.

The oracle is ``varlen_attention`` on the whole packed sequence (itself checked against dense attention
written from the definition in ``test_parallel_sequence.py``); forward outputs and the gradients of q, k
and v must agree to 1e-10 through the head-tail shard map, and ring must agree with all-gather.
"""

import pytest
import torch
import torch.distributed as dist
from test_parallel_sequence import _inputs, _reference  # the float64 inputs and reference of the CP tests

from omni_parallel import (
    CPSequence,
    HybridCPSlot,
    context_parallel_attention,
    cp_layout,
    cp_sequence_attention,
    hybrid_cp_blocks,
    local_sequence,
    plan_hybrid_cp,
    ring_attention,
    shard_for_cp,
)
from omni_parallel.testing import run_world
from omni_parallel.varlen import cu_seqlens_from_lengths, masked_attention

TOL = 1e-10

# (seed, document lengths, heads_q, heads_kv, causal): lengths 7 and 1 and 3 at cp=4 pad heavily (a rank
# may hold only padding of a document), 28/7 is GQA with an odd KV count, 2600 tokens span several
# query tiles per block.
RING_CASES = {
    2: [
        (1, [7], 4, 2, True),
        (2, [7, 1, 12, 3], 6, 3, True),
        (3, [5, 6], 4, 4, False),
        (4, [9, 16], 28, 7, True),
        (13, [2600, 5], 2, 1, True),
    ],
    4: [
        (5, [7, 16, 2], 4, 2, True),
        (6, [3], 2, 1, True),
        (7, [1, 30], 2, 2, False),
        (8, [40, 9], 4, 1, True),
    ],
}


def _diff(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


def _ring_world(rank, world_size):
    group = dist.group.WORLD
    results = []
    for seed, lengths, hq, hkv, causal in RING_CASES[world_size]:
        cu = cu_seqlens_from_lengths(lengths)
        q, k, v, w = _inputs(seed, int(cu[-1]), hq, hkv)
        ref = _reference(q, k, v, w, cu, causal)
        lw = shard_for_cp(w, cu, group)
        outs = {}
        for name, attend in (("ring", ring_attention), ("allgather", context_parallel_attention)):
            lq, lk, lv = (shard_for_cp(x, cu, group).detach().requires_grad_() for x in (q, k, v))
            out = attend(lq, lk, lv, group, cu_seqlens=cu, causal=causal)
            (out * lw).sum().backward()
            outs[name] = out.detach()
            diffs = [_diff(out, shard_for_cp(ref[0], cu, group))]
            diffs += [_diff(a.grad, shard_for_cp(b, cu, group)) for a, b in zip((lq, lk, lv), ref[1:])]
            pad = torch.tensor(cp_layout(cu, world_size).source[rank]) < 0
            results.append((name, seed, max(diffs), float(out.detach()[pad].abs().sum())))
        results.append(("ring-vs-allgather", seed, _diff(outs["ring"], outs["allgather"]), 0.0))
    results += _hybrid_cases(rank, world_size)
    return results


def _hybrid_slots(world_size):
    # Whole samples on single ranks next to CP blocks of every size, blocks overlapping on some ranks.
    if world_size == 2:
        return [13, 2, 5, 9], [HybridCPSlot(0, 0, 0, 2), HybridCPSlot(1, 0, 1, 1), HybridCPSlot(2, 0, 0, 1),
                               HybridCPSlot(3, 0, 0, 2)]  # fmt: skip
    lengths = [13, 2, 5, 30, 3, 7, 11]
    slots = [(0, 0, 2), (1, 2, 1), (2, 3, 1), (3, 0, 4), (4, 2, 2), (5, 1, 1), (6, 2, 2)]
    return lengths, [HybridCPSlot(s, 0, f, c) for s, f, c in slots]


def _hybrid_cases(rank, world_size):
    out = []
    lengths, slots = _hybrid_slots(world_size)
    blocks = hybrid_cp_blocks(world_size)
    groups = {}
    for c, members in blocks.items():
        for m in members:
            g = dist.new_group(m)  # collective: every rank creates every block, in the same order
            groups[(c, m[0])] = g
    cu = cu_seqlens_from_lengths(lengths)
    q, k, v, w = _inputs(99 + world_size, int(cu[-1]), 4, 2)
    ref = _reference(q, k, v, w, cu, True)
    seq = local_sequence(lengths, slots, rank)
    src = torch.tensor(seq.source, dtype=torch.int64)
    real = src >= 0
    take = torch.where(real, src, 0)

    def local(x):
        return (x[take] * real.view(-1, *([1] * (x.dim() - 1)))).detach()

    for method in ("allgather", "ring"):
        mine = {(s.cp, s.first): groups[(s.cp, s.first)] for s in seq.segments if s.cp > 1}
        lq, lk, lv = (local(x).requires_grad_() for x in (q, k, v))
        o = cp_sequence_attention(lq, lk, lv, CPSequence(seq.segments, mine, method))
        (o * local(w)).sum().backward()
        diffs = [_diff(o.detach()[real], ref[0][src[real]])]
        diffs += [_diff(a.grad[real], b[src[real]]) for a, b in zip((lq, lk, lv), ref[1:])]
        pos = torch.tensor(seq.position)[real]
        # positions are those of the whole pack (RoPE): inside-document offsets of the source tokens
        want = torch.cat([torch.arange(n) for n in lengths])[src[real]]
        out.append((f"hybrid-{method}", int(real.sum()), max(diffs), float((pos != want).sum())))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_matches_float64_reference_and_allgather(world_size):
    results = run_world(_ring_world, world_size, timeout_s=180)
    for rank, res in enumerate(results):
        for entry in res:
            assert entry[2] <= TOL, (rank, entry)
            assert entry[3] == 0.0, (rank, entry)  # padding rows zero; hybrid: RoPE positions exact
    # every token of the hybrid pack is held by exactly one rank (both methods see the same layout)
    lengths, _ = _hybrid_slots(world_size)
    held = sum(e[1] for res in results for e in res if e[0] == "hybrid-ring")
    assert held == sum(lengths)


def test_local_sequences_cover_every_token_once_under_a_hybrid_plan():
    lengths = [7441, 11949, 12075, 300, 40, 5000, 2, 900]
    plan = plan_hybrid_cp(lengths, 4, 12288)
    assert {s.cp for s in plan.slots} == {1, 2, 4}  # whole samples, and blocks of both CP sizes
    seen = []
    for r in range(4):
        seq = local_sequence(lengths, plan.slots, r)
        assert [s.start for s in seq.segments] == sorted(s.start for s in seq.segments)
        assert sum(s.rows for s in seq.segments) == seq.tokens
        assert seq.tokens == plan.tokens[0][r]  # the plan's per-rank token count, CP padding included
        seen += [x for x in seq.source if x >= 0]
    assert sorted(seen) == list(range(sum(lengths)))
    assert hybrid_cp_blocks(8) == {
        2: [[0, 1], [2, 3], [4, 5], [6, 7]],
        4: [[0, 1, 2, 3], [4, 5, 6, 7]],
        8: [list(range(8))],
    }
    with pytest.raises(ValueError, match="not aligned"):
        local_sequence([4, 4], [HybridCPSlot(0, 0, 1, 2), HybridCPSlot(1, 0, 0, 1)], 0)


def test_ring_tile_kernels_fused_and_plain_agree():
    # The fused CPU flash kernel and the plain-ops path (other devices) of one tile, forward and backward.
    from omni_parallel.ring_attention import _tile_backward, _tile_forward

    g = torch.Generator().manual_seed(5)
    for tq, tk, causal in ((9, 9, True), (7, 12, False)):
        q = torch.randn(tq, 3, 4, generator=g, dtype=torch.float64)
        k, v = (torch.randn(tk, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
        dout = torch.randn(tq, 3, 4, generator=g, dtype=torch.float64)
        (o1, l1), (o2, l2) = (_tile_forward(q, k, v, causal, 0.5, fused=f) for f in (True, False))
        assert _diff(o1, o2) <= TOL and _diff(l1, l2) <= TOL
        g1, g2 = (_tile_backward(dout, q, k, v, o1, l1, causal, 0.5, fused=f) for f in (True, False))
        assert max(_diff(a, b) for a, b in zip(g1, g2)) <= TOL
        ref = masked_attention(q, k, v, causal=causal, scale=0.5)
        assert _diff(o1, ref) <= TOL
