"""Pricing the reordering group across DP (:mod:`omni_pipeline.replica_balance`) and ``tune``'s search of it.

Oracles: the trainer's partition (``omni_data.reorder_destinations``, what ``GroupedReorderer.plan``
computes) applied to each encoder microbatch, the one-replica prediction
(:func:`omni_pipeline.step_model.predict_step` of each replica's own step), the encoder samples' modelled
FLOPs, and two workloads built so the answer is known: replicas of very unequal work with a fast all-to-all (the group that pools them must
win) and the same with a slow one (no group may win)."""

from __future__ import annotations

import dataclasses

import pytest

from omni_data import reorder_destinations, split_encoder_microbatches
from omni_pipeline.cost import Network
from omni_pipeline.replica_balance import deal_encoder_samples, group_sizes, price_group, replica_packs
from omni_pipeline.step_costs import sample_encoder_flops
from omni_pipeline.step_model import Device, Layout, predict_step
from omni_pipeline.tune import tune
from omni_pipeline.workload import parse_workload

MODEL = """
max_seq_len = 2048
microbatches = 4
[model]
llm = { dim = 256, n_layers = 4, n_heads = 4, n_kv_heads = 2, ffn_dim = 512, gated_mlp = true }
image = { dim = 512, n_layers = 6, n_heads = 4, mlp_ratio = 4 }
[[sources]]
name = "t"
modality = "text"
length = { fixed = 500 }
"""


def _images_in_phase(name: str, first: str, second: str, until_step: int):
    """A workload of fixed 500-token images and texts: phase ``first`` until ``until_step``, then ``second``."""
    return parse_workload(
        f'name = "{name}"\n'
        + MODEL
        + f"""
[[sources]]
name = "i"
modality = "image"
length = {{ fixed = 500 }}
text_tokens = 8
[[phases]]
weights = {{ {first} = 1 }}
until_step = {until_step}
[[phases]]
weights = {{ {second} = 1 }}
"""
    )


# steps 0-1 draw images only, later steps text only: replicas 0-1 carry all the encoder work
UNEQUAL = _images_in_phase("unequal", "i", "t", 2)

MIXED = parse_workload(
    'name = "mixed"\n'
    + MODEL
    + """
[[sources]]
name = "i"
modality = "image"
length = { lognormal = { median = 300, sigma = 1.2 }, min = 16, max = 2048 }
text_tokens = 8
[[phases]]
weights = { t = 1, i = 1 }
"""
)
FAST = Network()
SLOW = Network(intra_bandwidth_Bps=1e6)  # 1 MB/s inside a node: the all-to-all costs more than it buys


def test_the_deal_is_the_trainers_reordering_of_each_encoder_microbatch():
    """Four replicas of 4 packs, pp 2, groups of 2: each replica splits its media into encoder microbatches
    as the trainer's loader does (``split_encoder_microbatches``), and for every encoder microbatch the
    group's samples go where ``omni_data.reorder_destinations`` (the partition ``GroupedReorderer.plan``
    computes; ``test_data_reorder`` ties the two) sends them, in the trainer's received order; no sample
    is lost or doubled."""
    packs = replica_packs(MIXED, 4, 4)
    dealt = deal_encoder_samples(packs, 2, 2)
    own = [
        {
            e: [rep[p].samples[i] for p, i in items]
            for e, items in split_encoder_microbatches(rep, 4, 2).items()
        }
        for rep in packs
    ]
    assert deal_encoder_samples(packs, 1, 2) == own
    moved = 0
    for start in (0, 2):
        for e in own[start]:
            pooled = [own[start][e], own[start + 1][e]]
            dest = reorder_destinations([[s.encoder_flops for s in ss] for ss in pooled])
            for d in range(2):
                want = [s for r in range(2) for s, to in zip(pooled[r], dest[r]) if to == d]
                assert dealt[start + d][e] == want, (start, e, d)
                moved += sum(1 for s in want if not any(s is t for t in own[start + d][e]))
            assert sorted(id(s) for ss in pooled for s in ss) == sorted(
                id(s) for d in range(2) for s in dealt[start + d][e]
            )
    assert moved > 0  # not vacuous: samples changed replicas
    assert group_sizes(12, 16) == [1, 2, 4] and group_sizes(256, 16) == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="group 3 must be >= 1 and divide the 4 replicas"):
        deal_encoder_samples(packs, 3, 2)


def test_given_encoder_microbatches_move_only_encoder_work():
    """``predict_step(encoder_microbatches=)``: its own split reproduces the one-replica prediction
    exactly; another replica's samples change only the encoder actions (each ``EF`` its samples' modelled
    FLOPs at the device's rate), not the LLM actions, tokens or the outputs the all-to-all returns."""
    lay = Layout(pp=2, dp=2, reorder_group=2)
    packs = replica_packs(MIXED, 2, 4)
    own = deal_encoder_samples(packs, 1, 2)[0]
    dealt = deal_encoder_samples(packs, 2, 2)[0]
    base = predict_step(MIXED, lay, network=FAST, packs=packs[0])
    same = predict_step(MIXED, lay, network=FAST, packs=packs[0], encoder_microbatches=own)
    assert same.step_time_s == base.step_time_s and same.time_s == base.time_s and same.memory == base.memory
    moved = predict_step(MIXED, lay, network=FAST, packs=packs[0], encoder_microbatches=dealt)

    def durations(p, encoder):
        return {
            (r, ev.action): ev.end_s - ev.start_s
            for r, evs in p.simulation.timelines.items()
            for ev in evs
            if ev.is_encoder == encoder
        }

    assert durations(moved, False) == pytest.approx(durations(base, False), rel=1e-9)  # LLM actions untouched
    assert moved.tokens_per_s * moved.step_time_s == pytest.approx(
        base.tokens_per_s * base.step_time_s, rel=1e-12
    )
    assert moved.time_s["reorder_all_to_all"] == base.time_s["reorder_all_to_all"] > 0
    rate = Device().peak_flops * Device().efficiency
    fwd = {a: d for (_, a), d in durations(moved, True).items() if a.startswith("EF")}
    assert fwd and fwd != {a: d for (_, a), d in durations(base, True).items() if a.startswith("EF")}
    for a, d in fwd.items():
        want = sum(sample_encoder_flops(MIXED.model, s) for s in dealt[int(a[2:])]) / rate
        assert d == pytest.approx(want, rel=1e-12), a
    with pytest.raises(ValueError, match="encoder_microbatches must be keyed"):
        predict_step(MIXED, lay, network=FAST, packs=packs[0], encoder_microbatches={1: []})


def test_temporary_packs_never_hit_another_lists_cache_entry():
    """``predict_step`` keys its cache by the identity of ``packs``: the cache holds each list, so a list
    built and dropped per call (whose id Python may hand to the next one) never finds another's entry."""
    lay = Layout(pp=2, dp=2)
    packs = replica_packs(MIXED, 4, 4)
    cache: dict = {}
    shared = [predict_step(MIXED, lay, network=FAST, packs=list(p), cache=cache).step_time_s for p in packs]
    alone = [predict_step(MIXED, lay, network=FAST, packs=list(p)).step_time_s for p in packs]
    assert shared == alone and len(set(alone)) > 1


def test_a_group_of_one_is_each_replicas_one_replica_prediction():
    lay = Layout(pp=2, dp=4)
    g1 = price_group(MIXED, lay, 1, network=FAST)
    alone = [predict_step(MIXED, lay, network=FAST, step=r) for r in range(4)]
    assert g1.replicas == 4 and g1.replica_step_s == [p.step_time_s for p in alone]
    slow = max(p.step_time_s for p in alone)
    assert g1.step_time_s == slow and g1.reorder_all_to_all_s == 0.0
    mean_job_tokens = sum(p.tokens_per_s * p.step_time_s for p in alone) / 4
    assert g1.tokens_per_s == pytest.approx(mean_job_tokens / slow, rel=1e-12)
    assert g1.prediction.layout.reorder_group == 1


def test_pooling_unequal_replicas_wins_when_the_all_to_all_is_cheap_and_loses_when_it_is_not():
    lay = Layout(pp=2, dp=4)
    fast = {g: price_group(UNEQUAL, lay, g, network=FAST) for g in (1, 2, 4)}
    # replicas 0-1 hold every image: alone (or paired with each other) they set the step
    assert fast[1].spread > 4 and fast[2].spread > 4
    # the images spread over all four; what is left is LLM work, which stays on each replica
    assert fast[4].spread < 1.02 and fast[4].reorder_all_to_all_s > 0
    assert fast[4].tokens_per_s > 1.5 * fast[1].tokens_per_s
    assert fast[4].prediction.layout.reorder_group == 4
    slow = {g: price_group(UNEQUAL, lay, g, network=SLOW) for g in (1, 2, 4)}
    gain = max(slow[1].replica_step_s) - max(slow[4].replica_step_s) + slow[4].reorder_all_to_all_s
    assert slow[4].reorder_all_to_all_s > gain > 0  # what the group buys is less than its all-to-all
    assert slow[1].tokens_per_s > slow[4].tokens_per_s and slow[1].tokens_per_s > slow[2].tokens_per_s


def test_tune_picks_the_group_the_pricing_favours():
    """The oracle is the UNEQUAL workload's known outcome: at a fast all-to-all ``tune`` must list a group
    larger than 1, above its group 1; at 1 MB/s (``SLOW``) no group may win. That the listed plan's tokens/s
    equal ``price_group`` of its group (``again``) is only a consistency check (``tune`` reports the
    package's own pricing), not an oracle."""
    fast = tune(UNEQUAL, 4, network=FAST, global_batch=8, top=2, max_virtual=1, max_reorder_group=4)
    best = fast.plans[0]
    assert best.layout.reorder_group > 1, best.layout
    curve = fast.groups[0]
    assert [c.group for c in curve] == group_sizes(best.layout.dp, min(best.layout.dp, 16))
    assert best.tokens_per_s == max(c.tokens_per_s for c in curve) > curve[0].tokens_per_s
    again = price_group(
        UNEQUAL, dataclasses.replace(best.layout, reorder_group=1), best.layout.reorder_group, network=FAST,
        microbatches=8 // best.layout.dp,
    )  # fmt: skip
    assert again.tokens_per_s == best.tokens_per_s  # the plan is the package's pricing of its group
    # a trainer that runs dp = 4 only (``check``): at 1 MB/s every group of 2 or 4 is priced, and loses
    slow = tune(
        UNEQUAL, 4, network=SLOW, global_batch=8, top=2, max_virtual=1, max_reorder_group=4,
        check=lambda lay: None if lay.dp == 4 else f"parallel.dp: {lay.dp} is not 4",
    )  # fmt: skip
    assert slow.plans and all(p.layout.reorder_group == 1 for p in slow.plans), [p.layout for p in slow.plans]
    assert all([c.group for c in curve] == [1, 2, 4] for curve in slow.groups)
    # not searched: one-replica predictions, group 1
    flat = tune(UNEQUAL, 4, network=FAST, global_batch=8, top=2, max_virtual=1)
    assert not flat.groups and all(p.layout.reorder_group == 1 for p in flat.plans)


def test_a_plan_whose_replicas_run_out_of_memory_gives_way_to_the_next():
    """Step 0 draws text only, later steps images: the one-replica prediction (step 0) of the best layout
    fits in 1 GB, its image-drawing replicas do not at any group size, so the group search drops it and
    lists layouts whose every simulated replica fits."""
    late = _images_in_phase("late", "t", "i", 1)
    dev = Device(memory_bytes=1e9)
    flat = tune(late, 4, device=dev, global_batch=8, top=2, max_virtual=1)
    first = flat.plans[0].layout
    assert first.dp > 1 and flat.plans[0].peak_memory_bytes <= dev.memory_bytes
    m = 8 // first.dp
    curve = [price_group(late, first, g, device=dev, microbatches=m) for g in group_sizes(first.dp, first.dp)]
    assert all(c.prediction.oom for c in curve)  # not vacuous: every group of that layout is OOM
    grouped = tune(late, 4, device=dev, global_batch=8, top=2, max_virtual=1, max_reorder_group=4)
    assert grouped.plans and grouped.oom > flat.oom
    assert all(dataclasses.replace(p.layout, reorder_group=1) != first for p in grouped.plans)
    assert all(p.peak_memory_bytes <= dev.memory_bytes and not p.oom for p in grouped.plans)
