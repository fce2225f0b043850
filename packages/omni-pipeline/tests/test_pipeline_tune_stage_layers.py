"""``tune``'s uneven ``stage_layers`` search (:func:`omni_pipeline.tune.tune`, module docstring "Stage
splits"): against brute force over every split of every layout the search enumerates (the oracle:
:func:`~omni_pipeline.step_model.predict_step` of each), on a small encoder-heavy workload where an uneven
split wins, and where only an uneven split fits in memory; and :func:`~omni_pipeline.tune.split_candidates`'
modelled splits against brute force over every composition of the layers."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from omni_pipeline.step_model import Device, Layout, even_stage_layers, predict_step
from omni_pipeline.tune import (
    SPLIT_BOUND_SLACK,
    SPLIT_PLACEMENTS,
    _split_span,
    candidate_layouts,
    split_candidates,
    tune,
)
from omni_pipeline.workload import parse_workload

# a heavy ViT beside a 6-layer LLM (pp 2, 4 microbatches): an uneven split wins; payload decode free
WORKLOAD = """
name = "split"
max_seq_len = 4096
microbatches = 4
[model]
llm = { dim = 256, n_layers = 6, n_heads = 4, n_kv_heads = 2, ffn_dim = 768, gated_mlp = true }
image = { dim = 512, n_layers = 6, n_heads = 4, mlp_ratio = 4 }
[[sources]]
name = "i"
modality = "image"
length = { fixed = 1000 }
text_tokens = 8
decode_ms = 0
[[sources]]
name = "t"
modality = "text"
length = { fixed = 1000 }
[[phases]]
weights = { i = 3, t = 1 }
"""
GPUS, BATCH = 2, 4
SEARCH = dict(max_sp=1, max_virtual=1, recompute=("off", "block"))


def _check(layout):
    """Keep the space small: pp 2, no ZeRO, no offload (the split search's 1F1B layouts)."""
    if layout.pp != 2 or layout.llm_zero or layout.encoder_zero or getattr(layout, "offload", ()):
        return "test: pp 2, no ZeRO, no offload"
    return None


def _compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield tuple(b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True))


def _brute_force(w, device: Device):
    """Every (layout, placement, split) the search covers, predicted: ``[(tokens/s, split, prediction)]``."""
    out = []
    for layout, m in candidate_layouts(w, GPUS, BATCH, **SEARCH):
        if _check(layout) is not None:
            continue
        for placement in SPLIT_PLACEMENTS:
            lay = dataclasses.replace(layout, placement=placement)
            for split in _compositions(w.shapes["llm"].n_layers, lay.pp):
                p = predict_step(w, lay, device=device, microbatches=m, stage_layers=list(split))
                out.append((p.tokens_per_s, split, p))
    return out


def test_split_search_returns_the_brute_force_best():
    w = parse_workload(WORKLOAD)
    device = Device()
    every = _brute_force(w, device)
    fits = [x for x in every if not x[2].oom]
    best = max(x[0] for x in fits)
    winners = {(x[1], x[2].layout) for x in fits if x[0] == best}
    even = tuple(even_stage_layers(w.shapes["llm"].n_layers, 2))
    assert all(split != even for split, _ in winners), winners  # not vacuous: an uneven split wins
    res = tune(w, GPUS, device=device, global_batch=BATCH, top=1, refine=0, check=_check, **SEARCH)
    top = res.plans[0]
    assert top.tokens_per_s == pytest.approx(best, rel=1e-12)
    assert (tuple(res.stage_layers[0]), top.layout) in winners
    assert res.split_bounded > 0  # the bound pruned some splits, and still kept the best
    # the even split alone (the search before uneven splits) is slower
    flat = tune(
        w, GPUS, device=device, global_batch=BATCH, top=1, refine=0, check=_check, max_splits=0, **SEARCH
    )
    assert flat.stage_layers[0] == list(even) and flat.plans[0].tokens_per_s < best


def test_only_an_uneven_split_fits():
    w = parse_workload(WORKLOAD)
    every = _brute_force(w, Device())
    even = tuple(even_stage_layers(w.shapes["llm"].n_layers, 2))
    # a device between the smallest peak of any split and the smallest peak of an even-split plan
    low = min(x[2].peak_memory_bytes for x in every)
    high = min(x[2].peak_memory_bytes for x in every if x[1] == even)
    assert low < high  # stage 0 holds two microbatches in flight under 1F1B: fewer layers there fit
    device = Device(memory_bytes=(low + high) / 2)
    fitting = [x for x in every if x[2].peak_memory_bytes <= device.memory_bytes]
    assert fitting and all(x[1] != even for x in fitting)
    best = max(x[0] for x in fitting)
    res = tune(w, GPUS, device=device, global_batch=BATCH, top=1, refine=0, check=_check, **SEARCH)
    top = res.plans[0]
    assert tuple(res.stage_layers[0]) != even and not top.oom
    assert top.tokens_per_s == pytest.approx(best, rel=1e-12)
    assert top.peak_memory_bytes <= device.memory_bytes
    with pytest.raises(ValueError, match="no layout"):  # the even split alone: nothing fits
        tune(
            w, GPUS, device=device, global_batch=BATCH, top=1, refine=0, check=_check, max_splits=0, **SEARCH
        )


def test_modelled_splits_are_the_brute_force_optima():
    """Beyond ``max_splits`` compositions the candidates are the min-max optima of their linear models."""
    rng = random.Random(7)
    n, pp = 20, 4  # C(19, 3) = 969 splits > 64
    splits = list(_compositions(n, pp))
    for _ in range(20):
        mem = [(rng.uniform(0, 30), rng.uniform(0.5, 4)) for _ in range(pp)]
        sec = [(rng.uniform(0, 10), rng.uniform(0.5, 2)) for _ in range(pp)]
        cap = rng.uniform(40, 80)

        def m_max(s, mem=mem):
            return max(c + d * k for (c, d), k in zip(mem, s, strict=True))

        def t_max(s, sec=sec):
            return max(e + lr * k for (e, lr), k in zip(sec, s, strict=True))

        cands = split_candidates(n, mem, cap, sec)
        assert cands[0] == tuple(even_stage_layers(n, pp)) and len(cands) <= 4
        assert all(sum(c) == n and min(c) >= 1 for c in cands)
        assert min(t_max(c) for c in cands) == pytest.approx(min(t_max(s) for s in splits))
        assert min(m_max(c) for c in cands) == pytest.approx(min(m_max(s) for s in splits))
        fit = [s for s in splits if m_max(s) <= cap]
        if fit:  # the fastest split that fits (by the models) is a candidate
            got = [c for c in cands if m_max(c) <= cap]
            assert got and min(t_max(c) for c in got) == pytest.approx(min(t_max(s) for s in fit))
    # few enough layers: every split
    assert sorted(split_candidates(6, [(0, 1)] * 2, 1e9, [(0, 1)] * 2)) == sorted(_compositions(6, 2))


MOE = "moe = { experts = 4, top_k = 2, expert_ffn_dim = 1536, every_n_layers = 3 }"


def _moe_workload() -> str:
    """``WORKLOAD`` with an MoE LLM whose every third layer is MoE: its layers' seconds differ."""
    return WORKLOAD.replace("gated_mlp = true }\n", "gated_mlp = true }\n" + MOE + "\n", 1)


def _busy(pred):
    """Per pipeline rank: seconds of LLM actions and of encoder actions in a prediction's timeline."""
    tl = pred.simulation.timelines
    llm = [sum(ev.end_s - ev.start_s for ev in tl[r] if not ev.is_encoder) for r in range(len(tl))]
    enc = [sum(ev.end_s - ev.start_s for ev in tl[r] if ev.is_encoder) for r in range(len(tl))]
    return llm, enc


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("pp", [2, 3])
def test_split_span_bounds_every_simulated_split(moe, pp):
    """``_split_span`` (what the search prunes splits by) never exceeds the simulated makespan of any split,
    under either split placement: the oracle is ``predict_step`` of each split."""
    w = parse_workload(_moe_workload() if moe else WORKLOAD)
    device, m, n = Device(), w.microbatches, w.shapes["llm"].n_layers
    even = tuple(even_stage_layers(n, pp))
    ref = predict_step(w, Layout(pp=pp, placement="uniform_on_demand"), device=device, microbatches=m)
    llm_r, enc_r = _busy(ref)
    assert sum(enc_r) > 0
    worst = 0.0
    for placement in SPLIT_PLACEMENTS:
        for split in _compositions(n, pp):
            lay = Layout(pp=pp, placement=placement)
            p = predict_step(w, lay, device=device, microbatches=m, stage_layers=list(split))
            span = _split_span(llm_r, enc_r, even, split, placement, m)
            # the bound is tight for some splits: equal up to the float rounding the prune allows for
            assert span <= p.simulation.makespan_s * (1 + SPLIT_BOUND_SLACK), (placement, split)
            worst = max(worst, span / p.simulation.makespan_s)
    assert worst > 0.99  # not vacuous: exact (up to rounding) for some split


def test_modelled_split_search_returns_the_best_candidate(monkeypatch):
    """``max_splits = 1`` at pp 3 (``C(5, 2) = 10`` splits): the search simulates only the modelled
    candidates, and its plan is the best of them by brute force (``predict_step`` of each candidate
    under its placement, and of the even split the layout search times)."""
    import omni_pipeline.tune as tune_module

    asked = []

    def spy(*args, **kwargs):
        out = split_candidates(*args, **kwargs)
        asked.append(out)
        return out

    def check(layout):
        if layout.pp != 3 or layout.llm_zero or layout.encoder_zero or getattr(layout, "offload", ()):
            return "test: pp 3, no ZeRO, no offload"
        return None

    monkeypatch.setattr(tune_module, "split_candidates", spy)
    w, device = parse_workload(WORKLOAD), Device()
    search = dict(max_sp=1, max_virtual=1, recompute=("off",))
    layouts = [(lay, m) for lay, m in candidate_layouts(w, 3, BATCH, **search) if check(lay) is None]
    assert len(layouts) == 1  # one layout: each split_candidates call is one of its placements
    (layout, m), n = layouts[0], w.shapes["llm"].n_layers
    res = tune(w, 3, device=device, global_batch=BATCH, top=1, refine=0, check=check, max_splits=1, **search)
    assert len(asked) == len(SPLIT_PLACEMENTS)
    even = tuple(even_stage_layers(n, 3))
    tried = {(layout.placement, even)}  # the layout search's even split
    for placement, cands in zip(SPLIT_PLACEMENTS, asked, strict=True):
        assert cands[0] == even and 1 < len(cands) < len(list(_compositions(n, 3)))  # modelled, not all
        tried |= {(placement, s) for s in cands[1:]}
    scored = []
    for placement, split in tried:
        lay = dataclasses.replace(layout, placement=placement)
        p = predict_step(w, lay, device=device, microbatches=m, stage_layers=list(split))
        if not p.oom:
            scored.append((p.tokens_per_s, placement, split))
    best = max(scored)
    assert best[2] != even  # not vacuous: a modelled candidate wins
    top = res.plans[0]
    assert top.tokens_per_s == pytest.approx(best[0], rel=1e-12)
    assert (top.layout.placement, tuple(res.stage_layers[0])) == best[1:]
