"""The whole-step model: the alpha-beta collective formulas against ring / pairwise algorithms run step by
step on real data, the two-tier network, ZeRO-3 over DP adding exactly its gather and reduce-scatter,
memory dropping OOM plans, and the tuner's ranking."""

from __future__ import annotations

import dataclasses
import math

import pytest

from omni_pipeline.cost import (
    Network,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    reduce_scatter_s,
)
from omni_pipeline.step_model import ADAMW_BYTES_PER_ELEMENT, Device, Layout, predict_step, rank_memory
from omni_pipeline.tune import tune
from omni_pipeline.workload import parse_workload

BW, LAT = 7e9, 3e-6


def _timed(steps: list[list[float]]) -> float:
    """Seconds of a synchronous algorithm: per step, latency + the largest message any rank sends / bw."""
    return sum(LAT + max(s) / BW for s in steps)


def _ring_all_gather(chunks: list[list[float]]) -> tuple[list[list[list[float]]], list[list[float]]]:
    """Ring all-gather, run: rank i starts with chunk i; at step k it sends chunk (i - k) mod n to rank
    i + 1. Returns every rank's gathered chunks and the bytes (8 per float) each rank sent per step."""
    n = len(chunks)
    have = [{i: list(chunks[i])} for i in range(n)]
    sent = []
    for k in range(n - 1):
        msgs = [((i + 1) % n, (i - k) % n, list(have[i][(i - k) % n])) for i in range(n)]
        sent.append([8.0 * len(m[2]) for m in msgs])
        for dst, idx, data in msgs:
            have[dst][idx] = data
    return [[h[j] for j in range(n)] for h in have], sent


def _ring_reduce_scatter(bufs: list[list[float]]) -> tuple[list[list[float]], list[list[float]]]:
    """Ring reduce-scatter, run: each rank's buffer in n chunks; at step k rank i sends its partial sum of
    chunk (i - k - 1) mod n to rank i + 1, which adds its own. Rank i ends with chunk i summed."""
    n = len(bufs)
    size = len(bufs[0]) // n
    part = [[bufs[i][j * size : (j + 1) * size] for j in range(n)] for i in range(n)]
    sent = []
    for k in range(n - 1):
        msgs = [((i + 1) % n, (i - k - 1) % n, list(part[i][(i - k - 1) % n])) for i in range(n)]
        sent.append([8.0 * len(m[2]) for m in msgs])
        for dst, idx, data in msgs:
            part[dst][idx] = [a + b for a, b in zip(part[dst][idx], data, strict=True)]
    return [part[i][i] for i in range(n)], sent


def _pairwise_all_to_all(bufs: list[list[list[float]]]) -> tuple[list[list[list[float]]], list[list[float]]]:
    """Pairwise exchange, run: at step k (1 .. n-1) rank i sends its part for rank i + k to it."""
    n = len(bufs)
    out = [[None] * n for _ in range(n)]
    for i in range(n):
        out[i][i] = bufs[i][i]
    sent = []
    for k in range(1, n):
        sent.append([8.0 * len(bufs[i][(i + k) % n]) for i in range(n)])
        for i in range(n):
            out[(i + k) % n][i] = bufs[i][(i + k) % n]
    return out, sent


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_collective_formulas_equal_the_algorithms_run_step_by_step(n):
    per = 6  # floats per chunk
    chunks = [[float(100 * i + j) for j in range(per)] for i in range(n)]
    gathered, sent = _ring_all_gather(chunks)
    assert all(g == chunks for g in gathered)
    total = 8.0 * per * n  # the gathered buffer
    assert math.isclose(all_gather_s(total, n, BW, LAT), _timed(sent), rel_tol=1e-12, abs_tol=1e-18)

    bufs = [[float(i * 1000 + j) for j in range(per * n)] for i in range(n)]
    reduced, sent_rs = _ring_reduce_scatter(bufs)
    for i in range(n):
        assert reduced[i] == [sum(b[i * per + j] for b in bufs) for j in range(per)]
    assert math.isclose(reduce_scatter_s(total, n, BW, LAT), _timed(sent_rs), rel_tol=1e-12, abs_tol=1e-18)
    # all-reduce = reduce-scatter, then all-gather of the reduced chunks
    _, sent_ag = _ring_all_gather(reduced)
    assert math.isclose(
        all_reduce_s(total, n, BW, LAT), _timed(sent_rs + sent_ag), rel_tol=1e-12, abs_tol=1e-18
    )

    parts = [[[float(i), float(j)] * per for j in range(n)] for i in range(n)]
    out, sent_a2a = _pairwise_all_to_all(parts)
    assert all(out[j][i] == parts[i][j] for i in range(n) for j in range(n))
    assert math.isclose(
        all_to_all_s(8.0 * 2 * per * n, n, BW, LAT), _timed(sent_a2a), rel_tol=1e-12, abs_tol=1e-18
    )


def test_network_tiers():
    net = Network(gpus_per_node=8, intra_bandwidth_Bps=400e9, intra_latency_s=1e-6, inter_bandwidth_Bps=50e9,
                  inter_latency_s=9e-6)  # fmt: skip
    assert net.link(8, 1) == (400e9, 1e-6) and net.link(4, 2) == (400e9, 1e-6)
    assert net.link(2, 8) == (50e9, 9e-6) and net.link(16, 1) == (50e9, 9e-6)
    with pytest.raises(ValueError, match="inter_bandwidth_Bps"):
        Network(inter_bandwidth_Bps=0)


def _text_workload(microbatches: int = 4):
    return parse_workload(
        f"""
name = "text"
max_seq_len = 2048
microbatches = {microbatches}
[model]
llm = {{ dim = 256, n_layers = 4, n_heads = 4, n_kv_heads = 2, ffn_dim = 512, gated_mlp = true }}
[[sources]]
name = "t"
modality = "text"
length = {{ fixed = 700 }}
[[phases]]
weights = {{ t = 1 }}
"""
    )


def test_zero3_over_dp_adds_exactly_its_gather_and_reduce_scatter():
    w = _text_workload()
    net, dev = Network(), Device()
    one = predict_step(w, Layout(pp=2, dp=1, llm_zero=3), device=dev, network=net)
    two = predict_step(w, Layout(pp=2, dp=16, llm_zero=3), device=dev, network=net)
    assert one.time_s["llm_all_gather"] == one.time_s["llm_reduce_scatter"] == 0.0
    assert two.simulation.makespan_s == one.simulation.makespan_s  # the pipeline of one replica is the same
    # the largest stage by hand: the last holds 2 blocks, the final norm and the LM head (vocab 32000)
    d, kv, f = 256, 2 * 64, 512
    block = d * (d + 2 * kv) + d * d + 3 * d * f + 2 * d
    params = 2 * block + d + 32000 * d
    bw, lat = net.inter_bandwidth_Bps, net.inter_latency_s  # 16 ranks span two nodes

    def ring(nbytes):  # a ring all-gather / reduce-scatter over 16 ranks
        return 15 / 16 * nbytes / bw + 15 * lat

    # pp 2 x 4 microbatches: "auto" holds the gathered stage through the step (llm_zero's torchtitan rule):
    # ONE gather of bf16 copies (2 bytes, MixedPrecisionPolicy), then float32 gradients reduce-scattered:
    # each block's during the rank's last backward (its share of it done, last block first, one at a time),
    # the norm's and head's after it; only what ends after that backward adds to the step
    last = max((ev for ev in two.simulation.timelines[1] if ev.kind == "B"), key=lambda ev: ev.end_s)
    share = (last.end_s - last.start_s) / 2
    comm = last.start_s + share + ring(4 * block)
    comm = max(comm, last.end_s) + ring(4 * block)
    comm = max(comm, last.end_s) + ring(4 * (d + 32000 * d))
    expected = ring(2 * params) + comm - last.end_s
    assert math.isclose(two.time_s["llm_all_gather"], ring(2 * params), rel_tol=1e-12)
    assert math.isclose(
        two.time_s["llm_all_gather"] + two.time_s["llm_reduce_scatter"], expected, rel_tol=1e-12
    )
    # and nothing else changes but the optimizer, which now steps 1/16 of the parameters
    opt = ADAMW_BYTES_PER_ELEMENT * params * (1 / 16 - 1) / dev.hbm_Bps
    assert math.isclose(two.step_time_s - one.step_time_s, expected + opt, rel_tol=1e-9)
    # tokens/s: 16 replicas' tokens over the longer step
    assert math.isclose(
        two.tokens_per_s / one.tokens_per_s, 16 * one.step_time_s / two.step_time_s, rel_tol=1e-12
    )
    # the step's memory peak: the whole stage's float32 gradients until the sync, and the gathered bf16
    # stage beside the between-step shards
    row = two.memory[1]
    assert row["llm_in_step_gradients"] == 4 * params and row["llm_in_step_gathered"] == 2 * params
    assert row["total"] == row["between_steps"] + 6 * params + row["activations"]


def test_zero3_at_pp1_regathers_every_block_per_microbatch():
    """``auto`` at pp = 1 resolves to ``always`` (omni_parallel.llm_zero.reshard_after_forward): the root
    units (embedding, final norm, LM head) are gathered once, every block in each microbatch's forward and
    again in its backward: 1 + 2 x 4 microbatches x 4 blocks gathers, by hand."""
    m = 4
    w = _text_workload(m)
    net = Network()
    d, kv, f = 256, 2 * 64, 512
    block = d * (d + 2 * kv) + d * d + 3 * d * f + 2 * d
    roots = 32000 * d + d + 32000 * d  # embedding; final norm + LM head
    params = 4 * block + roots
    bw, lat = net.inter_bandwidth_Bps, net.inter_latency_s

    def ring(nbytes):
        return 15 / 16 * nbytes / bw + 15 * lat

    auto = predict_step(w, Layout(pp=1, dp=16, llm_zero=3), network=net)
    always = predict_step(w, Layout(pp=1, dp=16, llm_zero=3, llm_reshard="always"), network=net)
    never = predict_step(w, Layout(pp=1, dp=16, llm_zero=3, llm_reshard="never"), network=net)
    want = ring(2 * roots) + 2 * m * 4 * ring(2 * block)
    for p in (auto, always):
        assert math.isclose(p.time_s["llm_all_gather"], want, rel_tol=1e-12)
        assert math.isclose(p.time_s["llm_reduce_scatter"], ring(4 * params), rel_tol=1e-12)
        # in-step memory: roots + the running and the prefetched block gathered, whole float32 gradients
        assert p.memory[0]["llm_in_step_gathered"] == 2 * (roots + 2 * block)
        assert p.memory[0]["llm_in_step_gradients"] == 4 * params
    assert math.isclose(never.time_s["llm_all_gather"], ring(2 * params), rel_tol=1e-12)
    assert never.memory[0]["llm_in_step_gathered"] == 2 * params
    with pytest.raises(ValueError, match="llm_reshard"):
        Layout(llm_reshard="sometimes")


def test_collectives_of_tp_cp_ulysses_sit_inside_the_pipeline_actions():
    w = _text_workload()
    base = predict_step(w, Layout(pp=2, dp=1))
    for lay in (Layout(pp=2, tp=2), Layout(pp=2, tp=2, sequence_parallel=True), Layout(pp=2, cp=2),
                Layout(pp=2, cp=2, cp_attention="ring"), Layout(pp=2, ulysses=2)):  # fmt: skip
        p = predict_step(w, lay)
        kind = "tp" if lay.tp > 1 else ("cp" if lay.cp > 1 else "ulysses")
        assert p.time_s[kind] > 0
        assert math.isclose(sum(p.time_s.values()), p.step_time_s, rel_tol=1e-12)
        # half the compute per rank, plus the collectives
        assert math.isclose(p.time_s["llm_compute"], base.time_s["llm_compute"] / 2, rel_tol=1e-9)


def test_recompute_trades_memory_for_time_and_oom_plans_are_dropped():
    w = _text_workload(8)
    plain = predict_step(w, Layout(pp=2))
    rc = predict_step(w, Layout(pp=2, recompute=True))
    assert rc.step_time_s > plain.step_time_s
    assert rc.memory[0]["activations"] < plain.memory[0]["activations"]
    # a device between the two peaks: only recompute fits
    cap = (rc.peak_memory_bytes + plain.peak_memory_bytes) / 2
    dev = Device(memory_bytes=cap)
    assert predict_step(w, Layout(pp=2), device=dev).oom
    assert not predict_step(w, Layout(pp=2, recompute=True), device=dev).oom
    res = tune(w, 4, device=dev, global_batch=8)
    assert res.plans and all(p.peak_memory_bytes <= cap for p in res.plans)
    assert [p.tokens_per_s for p in res.plans] == sorted((p.tokens_per_s for p in res.plans), reverse=True)
    assert res.oom > 0
    with pytest.raises(ValueError, match="no layout of 4 GPUs fits"):
        tune(w, 4, device=Device(memory_bytes=1e6), global_batch=8)


def test_analytic_memory_without_a_simulation_is_the_schedules_in_flight_count():
    w = _text_workload(8)
    lay = Layout(pp=4, dp=2, llm_zero=2)
    mem = rank_memory(w, lay)
    p = predict_step(w, dataclasses.replace(lay, placement="isolated"))  # no encoders: LLM only
    for r in range(4):
        assert mem[r]["activations"] == p.memory[r]["activations"]
        assert mem[r]["llm_parameters"] == p.memory[r]["llm_parameters"]


def _moe_workload():
    return parse_workload(
        """
name = "moe"
max_seq_len = 2048
microbatches = 4
[model]
llm = { dim = 256, n_layers = 4, n_heads = 4, n_kv_heads = 2, ffn_dim = 512, gated_mlp = true }
moe = { experts = 8, top_k = 2, expert_ffn_dim = 128, every_n_layers = 2 }
[[sources]]
name = "t"
modality = "text"
length = { fixed = 700 }
[[phases]]
weights = { t = 1 }
"""
    )


def test_ep_adds_dispatch_and_combine_all_to_alls_and_shards_the_experts():
    w = _moe_workload()
    d, kv, f, E, k, h = 256, 128, 512, 8, 2, 128
    # expert compute: a token runs through the router, top_k experts (no dense SwiGLU) in layers 1 and 3
    dense = d * (d + 2 * kv) + d * d + 3 * d * f
    moe_layer = d * (d + 2 * kv) + d * d + E * d + k * 3 * d * h
    assert w.model.llm_params == 2 * dense + 2 * moe_layer
    net, dev = Network(), Device()
    one = predict_step(w, Layout(pp=2, dp=4), device=dev, network=net)
    four = predict_step(w, Layout(pp=2, dp=4, ep=4), device=dev, network=net)
    packs = w.step_packs(0, 4)
    T = sum(p.num_tokens for p in packs) / len(packs)
    # one all-to-all: each rank's T * top_k rows of dim bf16 features, 3/4 of them leave it; 4 ranks
    # 1 apart lie inside a node. Per MoE layer: dispatch + combine in forward, their adjoints in backward.
    bw, lat = net.intra_bandwidth_Bps, net.intra_latency_s
    a2a = 3 / 4 * (2 * T * k * d) / bw + 3 * lat
    # the busiest stage has one MoE layer and runs 4 forwards and 4 backwards
    assert one.time_s["ep"] == 0.0
    assert math.isclose(four.time_s["ep"], 1 * (4 * 2 + 4 * 2) * a2a, rel_tol=1e-12)
    assert math.isclose(sum(four.time_s.values()), four.step_time_s, rel_tol=1e-12)
    # the same expert compute per rank (balanced routing), the all-to-alls on top
    assert math.isclose(four.time_s["llm_compute"], one.time_s["llm_compute"], rel_tol=1e-9)
    # each rank holds 1/ep of the routed experts (float32 masters; gradients and AdamW's moments alike)
    experts = E * 3 * d * h  # one MoE layer per stage
    for r in (0, 1):
        for kind, copies in (("parameters", 1), ("gradients", 1)):
            diff = one.memory[r][f"llm_{kind}"] - four.memory[r][f"llm_{kind}"]
            assert math.isclose(diff, copies * 4 * experts * 3 / 4, rel_tol=1e-12), (r, kind)
    # expert gradients: all-reduced over dp / ep = 4 ranks at ep 1; at ep 4 every rank has its own shard
    assert math.isclose(
        one.time_s["expert_all_reduce"], 2 * (3 / 4 * 4 * experts / bw + 3 * lat), rel_tol=1e-12
    )
    assert four.time_s.get("expert_all_reduce", 0.0) == 0.0
    # llm_zero >= 1 shards each EP shard over its expert-data-parallel group (dp / ep = 2 ranks): one
    # all-gather per step, then the gradient all-reduced (ZeRO-1) or reduce-scattered (ZeRO-2)
    xb, x_lat = 4 * experts / 2, net.intra_latency_s  # one rank's EP shard at ep 2, float32
    for zero, reduce in ((1, "expert_all_reduce"), (2, "expert_reduce_scatter")):
        sharded = predict_step(w, Layout(pp=2, dp=4, ep=2, llm_zero=zero), device=dev, network=net)
        assert math.isclose(sharded.time_s["expert_all_gather"], 1 / 2 * xb / bw + x_lat, rel_tol=1e-12)
        ring = (2 if reduce == "expert_all_reduce" else 1) * (1 / 2 * xb / bw + x_lat)
        assert math.isclose(sharded.time_s[reduce], ring, rel_tol=1e-12), zero
    # the tuner searches ep for an MoE workload only; bad sizes are named
    from omni_pipeline.tune import candidate_layouts

    assert {lay.ep for lay, _ in candidate_layouts(w, 8, 8)} == {1, 2, 4, 8}
    assert {lay.ep for lay, _ in candidate_layouts(_text_workload(), 8, 8)} == {1}
    with pytest.raises(ValueError, match="ep 3 must divide dp 4"):
        Layout(pp=2, dp=4, ep=3)
    with pytest.raises(ValueError, match=r"Layout\.ep: 2 needs an MoE LLM"):
        predict_step(_text_workload(), Layout(pp=2, dp=2, ep=2))
