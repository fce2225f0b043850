"""Async TP's pricing (:attr:`omni_pipeline.step_model.Layout.async_tp`): each SP ring overlapped with its
projection matmuls, only the exposed part priced (:func:`~omni_pipeline.step_model.async_tp_exposed_s`,
:func:`~omni_pipeline.step_model.async_tp_layer_s`), against a brute-force two-stream schedule of
:mod:`omni_parallel.async_tp`'s ring loops and hand counts; never above plain SP, the difference exposed
when communication-bound, the state unchanged and the activations lower by the projections' copies; and the tuner choosing it when it wins."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from omni_parallel.flops import model_flops
from omni_pipeline.cost import Network, all_reduce_s
from omni_pipeline.step_model import (
    Device,
    Layout,
    async_tp_exposed_s,
    async_tp_layer_s,
    predict_step,
    step_collectives,
)
from omni_pipeline.tune import candidate_layouts, tune
from omni_pipeline.workload import parse_workload

D, KV, FFN, T = 256, 128, 512, 2048


def _workload(dim: int = D, ffn: int = FFN, kv_heads: int = 2, seq: int = T, moe: str = ""):
    return parse_workload(
        f"""
name = "async"
max_seq_len = {seq}
microbatches = 4
[model]
llm = {{ dim = {dim}, n_layers = 4, n_heads = 4, n_kv_heads = {kv_heads}, ffn_dim = {ffn}, gated_mlp = true }}
{moe}
[[sources]]
name = "t"
modality = "text"
length = {{ fixed = {seq} }}
[[phases]]
weights = {{ t = 1 }}
"""
    )


def _schedule(tasks: dict[str, tuple[str, float, list[str]]], order: dict[str, list[str]]) -> float:
    """Brute force: the makespan of ``tasks`` (``name: (stream, seconds, dependencies)``), each stream
    running its tasks one at a time in ``order[stream]``, a task starting when its stream is free and its
    dependencies have ended."""
    end: dict[str, float] = {}
    free = dict.fromkeys(order, 0.0)
    pending = {s: list(names) for s, names in order.items()}
    while any(pending.values()):
        progressed = False
        for s, names in pending.items():
            if names and all(d in end for d in tasks[names[0]][2]):
                name = names.pop(0)
                start = max([free[s], *(end[d] for d in tasks[name][2])])
                end[name] = free[s] = start + tasks[name][1]
                progressed = True
        assert progressed, "deadlock"
    return max(end.values())


def _brute_ring(kind: str, tp: int, comm: float, mm: float) -> float:
    """Seconds a ring of :mod:`omni_parallel.async_tp` takes beyond its ``tp`` matmuls, from its loop's
    dependencies. ``ag`` (``_ag_ring``): transfer ``s`` (the chunk for step ``s``) is posted at step
    ``s - 1`` after that step's predecessors (the previous transfer, and the matmul before on the
    compute stream: NCCL orders a posted transfer after the current stream's work), matmul ``s`` needs
    its chunk. ``rs`` (``_rs_ring``): transfer ``s`` sends the accumulator, so it needs matmul ``s - 1``
    and transfer ``s - 1``; matmul ``s`` runs after the wait of step ``s - 1``."""
    tasks: dict[str, tuple[str, float, list[str]]] = {}
    for s in range(tp):
        if kind == "ag":
            tasks[f"M{s}"] = ("compute", mm, [f"C{s}"] if s else [])
            if s:
                tasks[f"C{s}"] = ("comm", comm, [f"C{s - 1}"] * (s > 1) + [f"M{s - 2}"] * (s > 1))
        else:
            tasks[f"M{s}"] = ("compute", mm, [f"C{s - 1}"] if s > 1 else [])
            if s:
                tasks[f"C{s}"] = ("comm", comm, [f"M{s - 1}"] + [f"C{s - 1}"] * (s > 1))
    order = {"compute": [f"M{s}" for s in range(tp)], "comm": [f"C{s}" for s in range(1, tp)]}
    return _schedule(tasks, order) - tp * mm


def test_ring_exposure_equals_the_brute_force_schedule():
    # by hand, tp = 2: one transfer of 3 us beside one matmul of 1 us leaves 2 us; of 1 us beside 3 us, none
    assert async_tp_exposed_s(2, 3e-6, 1e-6) == pytest.approx(2e-6)
    assert _brute_ring("ag", 2, 3e-6, 1e-6) == pytest.approx(2e-6)
    assert _brute_ring("rs", 2, 3e-6, 1e-6) == pytest.approx(2e-6)
    assert async_tp_exposed_s(2, 1e-6, 3e-6) == 0.0 == _brute_ring("rs", 2, 1e-6, 3e-6)
    for tp, comm, mm in itertools.product((1, 2, 3, 4, 8), (0.0, 0.5, 1.0, 2.0, 7.0), (0.25, 1.0, 3.0)):
        want = async_tp_exposed_s(tp, comm, mm)
        for kind in ("ag", "rs"):
            assert math.isclose(_brute_ring(kind, tp, comm, mm), want, abs_tol=1e-12), (kind, tp, comm, mm)
        # never above the plain ring of the same steps
        assert want <= (tp - 1) * comm
    with pytest.raises(ValueError, match="async_tp_exposed_s"):
        async_tp_exposed_s(2, -1.0, 1.0)


def test_step_collectives_price_each_ring_by_hand():
    w = _workload()
    dev = Device(peak_flops=1e12, efficiency=0.5)
    net = Network(intra_bandwidth_Bps=1e9, intra_latency_s=1e-5)
    rate, tp = 5e11, 2
    step = 1e-5 + 2 * T * D / tp / 1e9  # one P2P step: T/tp tokens of D bf16 features

    def mm(weights):  # one chunk: T/tp rows against the rank's 1/tp of the weights
        return 2 * (T / tp) * weights / tp / rate

    rings = {"attention": (D * (D + 2 * KV), D * D), "mlp": (2 * D * FFN, D * FFN)}
    fwd = {
        b: sum(_brute_ring(k, tp, step, mm(x)) for k, x in zip(("ag", "rs"), ws)) for b, ws in rings.items()
    }
    # the hand case is mixed: Q/K/V, the output projection and down exposed, gate/up covered
    assert fwd["attention"] > 0 and fwd["mlp"] > 0 and mm(2 * D * FFN) > step > mm(D * FFN)
    # the chunks over tp ranks and tp steps are the layer's matmul FLOPs the actions are timed from
    layer = sum(tp * mm(x) for ws in rings.values() for x in ws)
    action = model_flops(w.model.llm_params, T, 0.0, training=False) / (rate * tp) / 4
    assert math.isclose(layer, action, rel_tol=1e-12)
    base = dict(pp=1, dp=1, tp=tp, sequence_parallel=True)
    for mods, redo in (((), ()), (("attention",), ("attention",)), ((), ("attention", "mlp"))):
        L = Layout(**base, async_tp=True, recompute=bool(redo), recompute_modules=mods)
        per, _ = step_collectives(w, L, net, dev, tokens=T)
        assert math.isclose(per["tp_fwd"], sum(fwd.values()), rel_tol=1e-12)
        # backward: the adjoint rings pair with matmuls of the same FLOPs; recompute repeats forward's
        want = sum(fwd.values()) + sum(fwd[b] for b in redo)
        assert math.isclose(per["tp_bwd"], want, rel_tol=1e-12), (mods, redo)
        plain, _ = step_collectives(w, dataclasses.replace(L, async_tp=False), net, dev, tokens=T)
        assert per["tp_fwd"] < plain["tp_fwd"] and per["tp_bwd"] < plain["tp_bwd"]
    got = async_tp_layer_s(w.shapes["llm"], T, tp, 1e9, 1e-5, rate)
    assert all(math.isclose(g[b], fwd[b], rel_tol=1e-12) for g in got for b in fwd)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_async_tp_never_exceeds_plain_sp_and_comm_bound_leaves_the_difference(tp):
    w, dev = _workload(dim=512, ffn=1024, kv_heads=4), Device()
    shape = w.shapes["llm"]
    rate = dev.peak_flops * dev.efficiency
    for bw in (1e6, 1e9, 5e10, 4.5e11, 1e14):
        net = Network(intra_bandwidth_Bps=bw, intra_latency_s=1e-9 if bw == 1e14 else 5e-6)
        L = Layout(tp=tp, sequence_parallel=True, async_tp=True, recompute=True)
        per, _ = step_collectives(w, L, net, dev, tokens=T)
        plain, _ = step_collectives(w, dataclasses.replace(L, async_tp=False), net, dev, tokens=T)
        assert 0 <= per["tp_fwd"] <= plain["tp_fwd"] and 0 <= per["tp_bwd"] <= plain["tp_bwd"]
        ring = all_reduce_s(2 * T * shape.dim, tp, bw, net.intra_latency_s) / 2  # plain SP: one AG (or RS)
        if bw == 1e6:  # communication-bound: every ring exposed, shorter by exactly its tp - 1 chunk matmuls
            chunks = sum(2 * (T / tp) * x / tp / rate for x in (
                shape.dim * (shape.dim + 2 * shape.kv_dim), shape.dim**2, 2 * shape.dim * shape.mlp_dim,
                shape.dim * shape.mlp_dim))  # fmt: skip
            assert math.isclose(per["tp_fwd"], 4 * ring - (tp - 1) * chunks, rel_tol=1e-12)
            assert per["tp_fwd"] > 0.99 * plain["tp_fwd"]
        if bw == 1e14:  # links far faster than the matmuls: every ring covered
            assert per["tp_fwd"] == per["tp_bwd"] == 0.0


def test_predict_step_adds_only_the_exposed_rings_and_counts_one_gathered_input_per_region():
    w = _workload()
    net = Network(intra_bandwidth_Bps=1e9)
    plain = predict_step(w, Layout(pp=1, dp=1, tp=2, sequence_parallel=True), network=net)
    fast = predict_step(w, Layout(pp=1, dp=1, tp=2, sequence_parallel=True, async_tp=True), network=net)
    m, layers = 4, 4
    per, _ = step_collectives(w, fast.layout, net, Device(), tokens=T)
    assert math.isclose(fast.time_s["tp"], m * layers * (per["tp_fwd"] + per["tp_bwd"]), rel_tol=1e-12)
    assert 0 < fast.time_s["tp"] < plain.time_s["tp"]
    # pp = 1: the step is its actions in sequence, so it is shorter by exactly the TP seconds saved
    saved = plain.time_s["tp"] - fast.time_s["tp"]
    assert math.isclose(plain.step_time_s - fast.step_time_s, saved, rel_tol=1e-9)
    # memory: the state is plain SP's; each block keeps one gathered bf16 input per region instead of one
    # autocast copy per projection (3 + 2 -> 1 + 1), for every token of the one microbatch in flight
    (p,), (f,) = plain.memory.values(), fast.memory.values()
    assert {k: v for k, v in p.items() if k not in ("activations", "total")} == {
        k: v for k, v in f.items() if k not in ("activations", "total")
    }
    assert p["activations"] - f["activations"] == layers * T * 3 * w.shapes["llm"].dim * 2
    assert math.isclose(fast.step_time_s, sum(fast.time_s.values()), rel_tol=1e-12)


def test_async_tp_needs_sp_and_a_dense_llm():
    with pytest.raises(ValueError, match="async_tp needs sequence_parallel"):
        Layout(tp=2, async_tp=True)
    with pytest.raises(ValueError, match="async_tp needs sequence_parallel"):
        Layout(tp=1, async_tp=True)
    moe = _workload(moe="moe = { experts = 4, top_k = 2, expert_ffn_dim = 256 }")
    with pytest.raises(ValueError, match=r"Layout\.async_tp: priced for a dense LLM"):
        step_collectives(
            moe, Layout(tp=2, sequence_parallel=True, async_tp=True), Network(), Device(), tokens=T
        )
    # the tuner tries async TP for every tp > 1 layout of a dense LLM, never for an MoE one
    dense = list(candidate_layouts(_workload(), 4, 4, max_virtual=1, recompute=("off",)))
    assert {(lay.tp > 1) for lay, _ in dense} == {True, False}
    assert all(lay.async_tp == (lay.tp > 1) for lay, _ in dense)
    assert not any(lay.async_tp for lay, _ in candidate_layouts(moe, 4, 4, max_virtual=1, recompute=("off",)))


# a 4-layer LLM at 4 GPUs where TP is worth it only with async TP (about 0.1 s per search)
SEARCH = dict(
    global_batch=4, top=3, refine=0, max_virtual=1, recompute=("off",), max_splits=0, max_sp=1, vocab=1024
)


def test_tune_chooses_async_tp_when_it_wins_and_falls_back_when_refused():
    w = _workload(dim=1024, ffn=4096, kv_heads=4, seq=4096)
    res = tune(w, 4, **SEARCH)
    best = res.plans[0]
    assert best.layout.tp == 2 and best.layout.async_tp, best.layout
    # the oracle: the same layout with plain SP, and the plain search's best (TP not worth it there)
    twin = predict_step(w, dataclasses.replace(best.layout, async_tp=False), microbatches=4 // best.layout.dp,
                        vocab=1024)  # fmt: skip
    plain = tune(w, 4, async_tp=False, **SEARCH)
    assert not any(p.layout.async_tp for p in plain.plans) and plain.plans[0].layout.tp == 1
    assert best.tokens_per_s > plain.plans[0].tokens_per_s > twin.tokens_per_s
    assert res.considered == plain.considered and res.simulated == plain.simulated  # no larger search
    # a check refusing async TP: the plain-SP form is searched instead, as the plain search does
    refused = tune(w, 4, check=lambda L: "parallel.async_tp: refused" if L.async_tp else None, **SEARCH)
    assert refused.async_fallbacks > 0 and refused.refused == 0
    assert [p.layout for p in refused.plans] == [p.layout for p in plain.plans]
