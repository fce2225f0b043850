"""Balanced LLM stages against a brute-force oracle over every contiguous split."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_pipeline.stage_balance import balance_stages, explicit_stages, fit_layer_costs, stage_costs


def brute_force(costs, stages, first, last):
    """(least slowest stage, least sum of squares among those) over every composition of the layers."""
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        split = [range(bounds[s], bounds[s + 1]) for s in range(stages)]
        c = stage_costs(split, costs, first_stage_extra=first, last_stage_extra=last)
        key = (max(c), sum(x * x for x in c))
        best = key if best is None or key < best else best
    return best


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 20), min_size=1, max_size=9),
    st.integers(1, 5),
    st.integers(0, 40),
    st.integers(0, 40),
)
def test_split_is_the_brute_force_optimum(costs, stages, first, last):
    # integer costs: sums are exact in float64, so the oracle's optimum is compared exactly
    stages = min(stages, len(costs))
    split = balance_stages(costs, stages, first_stage_extra=first, last_stage_extra=last)
    assert [i for r in split for i in r] == list(range(len(costs)))
    assert all(len(r) >= 1 for r in split) and len(split) == stages
    c = stage_costs(split, costs, first_stage_extra=first, last_stage_extra=last)
    assert (max(c), sum(x * x for x in c)) == brute_force(costs, stages, first, last)


def test_issue_case_lm_head_moves_a_layer_to_stage_0():
    """omni-tiny: 4 equal blocks (~200-260k multiply-adds per token) and an LM head + loss of 524k on the
    last stage: the even split [2, 2] makes stage 1 about twice stage 0; balanced is [3, 1]."""
    split = balance_stages([230e3] * 4, 2, last_stage_extra=524e3)
    assert [len(r) for r in split] == [3, 1]
    c = stage_costs(split, [230e3] * 4, last_stage_extra=524e3)
    assert max(c) / min(c) < 1.1
    even = stage_costs([range(0, 2), range(2, 4)], [230e3] * 4, last_stage_extra=524e3)
    assert max(even) / min(even) > 2


def test_equal_layers_and_no_extras_split_evenly():
    assert [len(r) for r in balance_stages([1.0] * 8, 4)] == [2, 2, 2, 2]
    assert [len(r) for r in balance_stages([1.0] * 3, 3)] == [1, 1, 1]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="2 layers cannot fill 3 stages"):
        balance_stages([1.0, 1.0], 3)
    with pytest.raises(ValueError, match=r"layer costs must be finite and >= 0, got \{1: -1.0\}"):
        balance_stages([1.0, -1.0], 1)
    with pytest.raises(ValueError, match="last_stage_extra"):
        balance_stages([1.0], 1, last_stage_extra=float("nan"))
    with pytest.raises(ValueError, match=r"stage layers \[3, 0\]: need one int >= 1 per stage"):
        explicit_stages([3, 0])
    with pytest.raises(ValueError, match=r"sum to 5, the LLM has 4 layers"):
        explicit_stages([3, 2], 4)
    assert explicit_stages([3, 1], 4) == [range(0, 3), range(3, 4)]


def test_fit_layer_costs_recovers_layer_and_head_then_balances():
    layer, head = 0.02, 0.05
    for split in ([2, 2], [3, 1]):
        times = [split[0] * layer, split[1] * layer + head]
        got = fit_layer_costs(times, split)
        assert got == pytest.approx((layer, head), rel=1e-9)
    # three stages: over-determined, still exact on consistent data
    assert fit_layer_costs([0.04, 0.04, 0.02 + head], [2, 2, 1]) == pytest.approx((layer, head))
    fitted_layer, fitted_head = fit_layer_costs([2 * layer, 2 * layer + head], [2, 2])
    assert [len(r) for r in balance_stages([fitted_layer] * 4, 2, last_stage_extra=fitted_head)] == [3, 1]
