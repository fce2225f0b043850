"""The LLM ZeRO 1-3 gradient reduction overlapped with each pipeline rank's last backward
(:func:`omni_pipeline.step_model.exposed_reduction_s`, :mod:`omni_parallel.llm_zero`'s Schedule): the
exposed seconds against hand counts, for the function alone and through :func:`predict_step` at pp 1 and
pp 2 (4 blocks) with each block's collective shorter and longer than its share of the last backward;
memory is what it was (the whole float32 gradients until the sync)."""

from __future__ import annotations

import math

import pytest
from test_pipeline_sim_step_model import _text_workload  # the same 4-layer text workload

from omni_pipeline.cost import Network, all_reduce_s, reduce_scatter_s
from omni_pipeline.step_model import Device, Layout, exposed_reduction_s, predict_step, step_collectives

D, KV, FFN, VOCAB = 256, 2 * 64, 512, 32000
BLOCK = (
    D * (D + 2 * KV) + D * D + 3 * D * FFN + 2 * D
)  # one block's parameters (q, kv, o, gated MLP, 2 norms)


def test_exposed_reduction_by_hand():
    # one stage, last backward 0-8 s over 4 blocks (2 s each, last block first), the root's 0.5 s after
    # collectives of 1 s: each starts when its block is done (2, 4, 6, 8), the last ends at 9, the root at 9.5
    assert exposed_reduction_s([(0.0, 8.0, [1.0] * 4)], 0.5) == pytest.approx(1.5)
    # of 3 s: back to back from 2 s: 5, 8, 11, 14, then the root: 14.5 - 8
    assert exposed_reduction_s([(0.0, 8.0, [3.0] * 4)], 0.5) == pytest.approx(6.5)
    # two stages on one rank (virtual stages): the first's collectives end inside the second's backward
    assert exposed_reduction_s([(6.0, 10.0, [1.0, 1.0]), (0.0, 4.0, [1.0, 1.0])], 0.5) == pytest.approx(1.5)
    # nothing to overlap with: the whole reduction after the pipeline
    assert exposed_reduction_s([], 2.0) == 2.0
    with pytest.raises(ValueError, match="bad windows"):
        exposed_reduction_s([(3.0, 1.0, [1.0])])


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("fast", [True, False])  # a block's collective shorter / longer than its share
def test_predict_step_prices_only_the_exposed_reduction(pp, zero, fast):
    w, dev = _text_workload(), Device()
    net = (
        Network(inter_bandwidth_Bps=5e14, inter_latency_s=1e-9) if fast else Network(inter_bandwidth_Bps=2e9)
    )
    layout = Layout(pp=pp, dp=16, llm_zero=zero)
    pred = predict_step(w, layout, device=dev, network=net)
    bw, lat = net.inter_bandwidth_Bps, net.inter_latency_s  # 16 ranks span two nodes
    reduce = all_reduce_s if zero == 1 else reduce_scatter_s
    # the busiest rank: the last stage (its blocks, final norm and LM head; the embedding is one norm
    # smaller), its last backward the simulated one; its blocks' share of it each
    rank, blocks = pp - 1, 4 // pp
    roots = D + VOCAB * D if pp == 2 else VOCAB * D + D + VOCAB * D
    last = max((ev for ev in pred.simulation.timelines[rank] if ev.kind == "B"), key=lambda ev: ev.end_s)
    share = (last.end_s - last.start_s) / blocks
    c, rest = reduce(4 * BLOCK, 16, bw, lat), reduce(4 * roots, 16, bw, lat)
    if c <= share:  # each block's collective done before the next block's share: only the last one shows
        want = c + rest
    else:  # back to back from the first block's share on
        want = share + blocks * c - (last.end_s - last.start_s) + rest
    assert (c <= share) == fast, (c, share)
    key = "llm_all_reduce" if zero == 1 else "llm_reduce_scatter"
    assert math.isclose(pred.time_s[key], want, rel_tol=1e-9), (pred.time_s[key], want)
    whole = reduce(4 * (blocks * BLOCK + roots), 16, bw, lat)
    assert pred.time_s[key] < blocks * c + rest  # the same collectives one after another, after the pipeline
    # without a timeline (the tuner's bounds): the least any backward leaves, never above the simulated
    _, bound = step_collectives(w, layout, net, dev, tokens=1.0, microbatches=4)
    assert math.isclose(bound[key], min(c + rest, whole), rel_tol=1e-12)
    assert bound[key] <= pred.time_s[key] * (1 + 1e-12)
    # the step is the pipeline plus what is priced after it (sums as before)
    assert math.isclose(pred.step_time_s, sum(pred.time_s.values()), rel_tol=1e-12)
    # memory: the whole float32 gradients are held until the sync, as before (ZeRO-1 between steps)
    row = pred.memory[rank]
    params = blocks * BLOCK + roots
    if zero == 2:
        assert row["llm_in_step_gradients"] == 4 * params
    else:
        assert row["llm_gradients"] == 4 * params and row["llm_in_step_gradients"] == 0


def test_zero3_resharding_per_microbatch_and_zero0_keep_the_whole_reduction():
    w, net = _text_workload(), Network()
    bw, lat = net.inter_bandwidth_Bps, net.inter_latency_s
    params = 4 * BLOCK + 2 * VOCAB * D + D
    lazy = predict_step(w, Layout(pp=1, dp=16, llm_zero=3, llm_reshard="always"), network=net)
    assert math.isclose(
        lazy.time_s["llm_reduce_scatter"], reduce_scatter_s(4 * params, 16, bw, lat), rel_tol=1e-12
    )
    zero0 = predict_step(w, Layout(pp=1, dp=16, llm_zero=0), network=net)
    assert math.isclose(zero0.time_s["llm_all_reduce"], all_reduce_s(4 * params, 16, bw, lat), rel_tol=1e-12)
