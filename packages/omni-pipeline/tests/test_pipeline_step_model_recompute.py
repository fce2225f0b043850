"""Selective recompute and the Alpa-style stage split in the whole-step model, against hand-computed and
brute-force references: a recomputed branch costs exactly its forward FLOPs again in backward (LLM and
encoder, counted here from the shapes in closed form), its collectives are repeated and the others are
not; :func:`~omni_pipeline.step_model.encoder_aware_stage_layers` minimises the busiest stage over every
split (all compositions of a small model), and under ``prepend_first_stage`` its split is the one of all
splits whose simulated pipeline has the least busy rank."""

from __future__ import annotations

import itertools
import math

import pytest

from omni_pipeline.cost import Network, all_reduce_s
from omni_pipeline.step_model import (
    Device,
    Layout,
    encoder_aware_stage_layers,
    predict_step,
    step_collectives,
)
from omni_pipeline.workload import parse_workload

DIM, LAYERS, HEADS, KV_HEADS, FFN = 256, 4, 4, 2, 512
VIT_DIM, VIT_LAYERS, VIT_MLP = 128, 2, 4
MERGE = 2


def _workload(microbatches: int = 2, layers: int = LAYERS):
    return parse_workload(
        f"""
name = "sel"
max_seq_len = 2048
microbatches = {microbatches}
[model]
llm = {{ dim = {DIM}, n_layers = {layers}, n_heads = {HEADS}, n_kv_heads = {KV_HEADS}, ffn_dim = {FFN}, gated_mlp = true }}
image = {{ dim = {VIT_DIM}, n_layers = {VIT_LAYERS}, n_heads = 2, mlp_ratio = {VIT_MLP} }}
image_merge = {MERGE}
[[sources]]
name = "i"
modality = "image"
length = {{ fixed = 300 }}
text_tokens = 8
[[sources]]
name = "t"
modality = "text"
length = {{ fixed = 700 }}
[[phases]]
weights = {{ t = 1, i = 1 }}
"""
    )


def _busy(p, kind: str) -> float:
    """Seconds of ``kind`` actions (``"llm"`` or ``"encoder"``) over every pipeline rank."""
    return sum(
        ev.end_s - ev.start_s
        for evs in p.simulation.timelines.values()
        for ev in evs
        if ev.is_encoder == (kind == "encoder")
    )


def _hand_branches(w, packs):
    """Closed-form forward FLOPs of the step's LLM and image-encoder branches (the FLOP convention of
    ``omni_parallel.flops``: 2 per weight per token; attention scores + values: 2 d n^2 per layer causal,
    4 d n^2 bidirectional), summed over the packs and their image samples."""
    kv = DIM // HEADS * KV_HEADS
    llm = {"attention": 0.0, "mlp": 0.0}
    enc = {"attention": 0.0, "mlp": 0.0}
    for p in packs:
        t = p.num_tokens
        llm["attention"] += LAYERS * (
            2 * t * (2 * DIM * DIM + 2 * DIM * kv) + 2 * DIM * sum(n * n for n in p.seqlens)
        )
        llm["mlp"] += LAYERS * 2 * t * 3 * DIM * FFN
        for s in p.samples:
            if s.modality != "image":
                continue
            n = s.media_tokens * MERGE * MERGE  # ViT patches before the merge
            enc["attention"] += VIT_LAYERS * (2 * n * 4 * VIT_DIM * VIT_DIM + 4 * VIT_DIM * n * n)
            enc["mlp"] += VIT_LAYERS * 2 * n * 2 * VIT_DIM * VIT_MLP * VIT_DIM
    return llm, enc


@pytest.mark.parametrize("modules", [(), ("attention",), ("mlp",)], ids=["block", "attention", "mlp"])
def test_recompute_costs_the_recomputed_branches_forward_again(modules):
    """pp 1, no collectives: the step's LLM and encoder busy seconds with recompute minus without equal
    the recomputed branches' forward FLOPs (whole block: both branches) over the device's rate."""
    w = _workload()
    dev = Device()
    rate = dev.peak_flops * dev.efficiency
    m = w.microbatches
    off = predict_step(w, Layout(pp=1, placement="isolated"), device=dev, microbatches=m)
    on = predict_step(w, Layout(pp=1, placement="isolated", recompute=True, recompute_modules=modules),
                      device=dev, microbatches=m)  # fmt: skip
    packs = w.step_packs(0, m)
    llm, enc = _hand_branches(w, packs)
    names = modules or ("attention", "mlp")
    # the step model times every LLM action from the step's mean pack: m of them per step = the sum
    want_llm = sum(llm[b] for b in names) / rate
    want_enc = sum(enc[b] for b in names) / rate
    assert want_llm > 0 and want_enc > 0
    assert math.isclose(_busy(on, "llm") - _busy(off, "llm"), want_llm, rel_tol=1e-9)
    assert math.isclose(_busy(on, "encoder") - _busy(off, "encoder"), want_enc, rel_tol=1e-9)


def test_selective_recompute_repeats_only_its_branches_collectives():
    """tp 2 + SP: per layer 2 TP all-reduces (one per branch) in forward, 2 + the recomputed branches'
    in backward."""
    w = _workload()
    net, dev = Network(), Device()
    tokens = 1000.0
    bw, lat = net.link(2, 1)
    one = all_reduce_s(2 * tokens * DIM, 2, bw, lat)
    for modules, redo in (((), 2), (("attention",), 1), (("mlp",), 1)):
        for recompute in (False, True):
            lay = Layout(
                pp=1, dp=1, tp=2, sequence_parallel=True, recompute=recompute, recompute_modules=modules
            )
            per, _ = step_collectives(w, lay, net, dev, tokens=tokens)
            assert math.isclose(per["tp_fwd"], 2 * one, rel_tol=1e-12)
            assert math.isclose(per["tp_bwd"], (2 + (redo if recompute else 0)) * one, rel_tol=1e-12)


def test_encoder_aware_split_is_the_brute_force_optimum():
    """Every composition of 7 layers into 2-4 stages: no split has a less busy busiest stage (stage 0
    carrying the encoder seconds) than the function's."""
    n = 7
    for stages in (2, 3, 4):
        comps = [
            (n - sum(c), *c) for c in itertools.product(range(1, n), repeat=stages - 1) if n - sum(c) >= 1
        ]
        for enc in (0.0, 0.4, 1.0, 2.5, 3.0, 9.0):
            got = encoder_aware_stage_layers(n, stages, enc, 1.0)
            assert sum(got) == n and len(got) == stages and min(got) >= 1
            cost = lambda c, e=enc: max(e + c[0], *c[1:])  # noqa: E731
            assert cost(got) == min(cost(c) for c in comps), (stages, enc, got)
    with pytest.raises(ValueError, match="cannot fill"):
        encoder_aware_stage_layers(2, 3, 1.0, 1.0)


def test_alpa_split_balances_the_prepended_pipeline():
    """prepend at pp 2: the split from the profiled encoder seconds on stage 0 and the LLM's seconds per
    layer is the one of all splits [k, 6 - k] whose simulated busiest rank (encoders included) is least
    busy, and it moves layers off stage 0."""
    w = _workload(microbatches=4, layers=6)
    lay = Layout(pp=2, placement="prepend_first_stage")

    def busiest(split):
        p = predict_step(w, lay, stage_layers=split)
        return max(sum(ev.end_s - ev.start_s for ev in evs) for evs in p.simulation.timelines.values()), p

    _, even = busiest([3, 3])
    tl = even.simulation.timelines
    enc = sum(ev.end_s - ev.start_s for ev in tl[0] if ev.is_encoder)
    llm = sum(ev.end_s - ev.start_s for evs in tl.values() for ev in evs if not ev.is_encoder)
    got = encoder_aware_stage_layers(6, 2, enc, llm / 6)
    assert got[0] < 3
    best = min(busiest([k, 6 - k])[0] for k in range(1, 6))
    assert math.isclose(busiest(got)[0], best, rel_tol=1e-12)


def test_recompute_modules_must_name_the_trainers_branches():
    with pytest.raises(ValueError, match="recompute_modules"):
        Layout(recompute=True, recompute_modules=("attn",))
    with pytest.raises(ValueError, match="recompute_modules"):
        Layout(recompute=True, recompute_modules=["mlp"])
    with pytest.raises(ValueError, match="recompute_modules"):
        Layout(recompute=True, recompute_modules=("mlp", "mlp"))
