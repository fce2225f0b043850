"""Long-short SP and hybrid DP/CP plans: coverage (every token exactly once), caps, balance, determinism."""

import random

import pytest
import torch

from omni_parallel import (
    EncoderLayout,
    ParallelConfig,
    ReshardPlan,
    as_cu_seqlens,
    cu_seqlens_from_lengths,
    hybrid_cp_load,
    padded_heads,
    plan_hybrid_cp,
    plan_long_short,
    rank_groups,
    varlen_attention,
)


def _lengths(seed, n, mu=6.0, sigma=1.2, low=1, high=20000):
    rng = random.Random(seed)
    return [int(min(max(rng.lognormvariate(mu, sigma), low), high)) for _ in range(n)]


@pytest.mark.parametrize(("sp", "ranks"), [(1, 4), (2, 4), (4, 8), (2, 6)])
def test_long_short_covers_every_token_once(sp, ranks):
    lengths = [*_lengths(sp * 10 + ranks, 60), 0, 1]
    plan = plan_long_short(lengths, sp, 800, ranks)
    covered = [[0] * n for n in lengths]
    for rank_pieces in plan.pieces:
        for p in rank_pieces:
            for t in range(p.start, p.end):
                covered[p.sample][t] += 1
    assert all(c == 1 for row in covered for c in row)
    # Long samples live in exactly one SP group; short ones on exactly one rank.
    long_ = set(plan.long_samples)
    assert long_ == {i for i, n in enumerate(lengths) if sp > 1 and n > 800}
    for i in range(len(lengths)):
        holders = {r for r, ps in enumerate(plan.pieces) for p in ps if p.sample == i}
        if i in long_:
            assert {r // sp for r in holders} == {plan.long_group[i]}
        elif lengths[i]:
            assert len(holders) == 1
    # Each group's packed long sequence is cut into equal contiguous chunks, in sample order.
    for g, cu in enumerate(plan.long_cu_seqlens):
        chunk = cu[-1] // sp
        for j in range(sp):
            got = sum(p.tokens for p in plan.pieces[g * sp + j] if p.sample in long_)
            assert got == max(
                0, min(chunk, sum(lengths[i] for i in long_ if plan.long_group[i] == g) - j * chunk)
            )
    # Loads are the cost per rank, and balanced (brute-force recomputation).
    loads = [sum(p.tokens for p in ps) for ps in plan.pieces]
    assert loads == pytest.approx(list(plan.loads))
    assert plan.imbalance < 1.1
    assert plan_long_short(lengths, sp, 800, ranks) == plan


def test_long_short_errors():
    with pytest.raises(ValueError, match="must divide"):
        plan_long_short([5], 3, 2, 4)
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        plan_long_short([5, -1], 1, 2, 2)
    with pytest.raises(ValueError, match="costs has 1"):
        plan_long_short([5, 1], 1, 2, 2, costs=[1.0])
    # Short samples' costs used to be taken unchecked: a NaN made every load NaN.
    with pytest.raises(ValueError, match=r"costs\[0\] = nan \(sample 0\)"):
        plan_long_short([5, 3], 1, 4, 2, costs=[float("nan"), 2.0])
    with pytest.raises(ValueError, match=r"costs\[1\] = -1.0"):
        plan_long_short([5, 3], 1, 4, 2, costs=[1.0, -1.0])
    with pytest.raises(ValueError, match=r"lengths\[0\] = 5.5 is not an integer"):
        plan_long_short([5.5, 3], 1, 4, 2)
    with pytest.raises(ValueError, match="long_threshold = -1"):
        plan_long_short([5, 3], 2, -1, 4)


@pytest.mark.parametrize(("dp_cp", "mbs", "cap"), [(4, 1, 8192), (8, 4, 16384), (6, 2, 12000)])
def test_hybrid_cp_places_every_sample_within_caps(dp_cp, mbs, cap):
    pool = _lengths(dp_cp + mbs, 400, mu=7.5, sigma=1.2, low=100, high=cap * dp_cp // 2)
    lengths = []
    while sum(lengths) < 0.5 * dp_cp * mbs * cap:  # half the token capacity
        lengths.append(pool[len(lengths)])
    plan = plan_hybrid_cp(lengths, dp_cp, cap, num_microbatches=mbs)
    assert [s.sample for s in plan.slots] == list(range(len(lengths)))
    tokens = [[0] * dp_cp for _ in range(mbs)]
    loads = [[0.0] * dp_cp for _ in range(mbs)]
    for s in plan.slots:
        assert dp_cp % s.cp == 0 and s.first % s.cp == 0 and 0 <= s.microbatch < mbs
        share = lengths[s.sample] if s.cp == 1 else -(-lengths[s.sample] // (2 * s.cp)) * 2
        for r in range(s.first, s.first + s.cp):
            tokens[s.microbatch][r] += share
            loads[s.microbatch][r] += hybrid_cp_load(lengths[s.sample], s.cp)
    assert [list(t) for t in plan.tokens] == tokens
    assert max(max(t) for t in tokens) <= cap
    assert [x for row in plan.loads for x in row] == pytest.approx([x for row in loads for x in row])
    # Samples that fit one rank are CP-sharded only when placing them whole would overload a rank.
    assert sum(s.cp == 1 for s in plan.slots) >= sum(n <= cap for n in lengths) // 2
    # Every rank sees the same microbatch count (PP > 1), and rank_samples inverts the slots.
    for m in range(mbs):
        for r in range(dp_cp):
            for sample, cp, cp_rank in plan.rank_samples(r, m):
                slot = plan.slots[sample]
                assert (slot.cp, slot.first + cp_rank, slot.microbatch) == (cp, r, m)
    assert plan_hybrid_cp(lengths, dp_cp, cap, num_microbatches=mbs) == plan


def test_hybrid_cp_balance_on_long_tailed_lengths():
    lengths = _lengths(5, 400, mu=9.0, sigma=1.3, low=1024, high=131072)
    plan = plan_hybrid_cp(lengths, 16, 65536, num_microbatches=8)
    assert plan.imbalance <= 1.05
    assert sum(s.cp > 1 for s in plan.slots) < len(lengths) // 2


def test_hybrid_cp_errors_name_the_sample():
    with pytest.raises(ValueError, match=r"sample 1 \(70000 tokens\)"):
        plan_hybrid_cp([10, 70000], 4, 16384)
    with pytest.raises(ValueError, match="sample"):
        plan_hybrid_cp([16000] * 5, 4, 16384)  # 5 full samples, 4 rank-slots
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_hybrid_cp([1], 0, 10)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 10.5 is not an integer"):
        plan_hybrid_cp([10.5], 4, 100)
    with pytest.raises(ValueError, match="attention_len"):
        plan_hybrid_cp([10], 4, 100, attention_len=0)
    with pytest.raises(ValueError, match="dp_cp_size must be an int"):
        plan_hybrid_cp([10], 4.0, 100)


def test_bad_inputs_to_shared_helpers_are_named():
    with pytest.raises(ValueError, match=r"cu_seqlens\[1\] = 2.5"):
        as_cu_seqlens([0, 2.5, 5])  # int() would have moved the boundary silently
    with pytest.raises(ValueError, match="1-D"):
        as_cu_seqlens(torch.tensor([[0, 3]]))
    with pytest.raises(ValueError, match=r"lengths\[0\] = 2.5"):
        cu_seqlens_from_lengths([2.5])
    with pytest.raises(ValueError, match="head_dim 8 != k/v head_dim 6"):
        varlen_attention(torch.zeros(4, 2, 8), torch.zeros(4, 2, 6), torch.zeros(4, 2, 6), [0, 4])
    with pytest.raises(ValueError, match="not a multiple"):
        padded_heads(7, 2, 2)  # used to return (6, 2): a different GQA ratio
    assert padded_heads(28, 7, 2) == (32, 8) and padded_heads(7, 7, 4) == (8, 8)
    with pytest.raises(ValueError, match=r"positions\[0\]\[0\] = 1.5"):
        ReshardPlan(4, [[1.5]])
    with pytest.raises(ValueError, match="fsdp must be a bool"):
        EncoderLayout(fsdp="no")  # a truthy string would have turned FSDP on
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        rank_groups(4.0, ParallelConfig())
    with pytest.raises(ValueError, match="tp must be a positive int"):
        ParallelConfig(tp=True)
    # The plan's reused CP buffer is not part of its value: == must not compare tensors.
    plan = ReshardPlan(4, [[1], [2]], cu_seqlens=[0, 4])
    plan.buffer(torch.zeros(1, 3))
    assert plan == ReshardPlan(4, [[1], [2]], cu_seqlens=[0, 4])
    # Another plan reuses the staging memory (a view of it) while it is large enough.
    smaller = ReshardPlan(3, [[1], [2]], cu_seqlens=[0, 3], staging=plan.staging)
    assert smaller.buffer(torch.zeros(1, 3)).data_ptr() == plan.staging.data_ptr()
