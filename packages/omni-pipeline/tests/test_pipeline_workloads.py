"""Workloads as data (sampled lengths against their distributions, whole samples in packs, phases, bad
files named), one set of model shapes and P2P constants, and the paper's baselines in the simulator
(Megatron-LM's stage-0 load by brute force, Megatron-Dist's timeline checked action by action, Optimus'
static bubble filling valid and static)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter

import pytest

from omni_data import Modality, encoder_microbatch_ids, split_encoder_microbatches
from omni_pipeline import (
    MODEL_SCALES,
    MODEL_SHAPES,
    P2P_BANDWIDTH_BPS,
    P2P_LATENCY_S,
    Action,
    ActionKind,
    CostModel,
    Schedule1F1B,
    WorkloadError,
    disaggregated_programs,
    encoder_ranks_for,
    load_workload,
    modelled_step_costs,
    optimus_static,
    parse_workload,
    prepend_first_stage,
    simulate,
    simulate_disaggregated,
)
from omni_pipeline.graph import llm_encoder_deps
from omni_pipeline.simulator import action_times

EF, EB, F, B = (
    ActionKind.ENCODER_FORWARD,
    ActionKind.ENCODER_BACKWARD,
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
)

BASE = """
name = "t"
seed = 7
max_seq_len = {L}
microbatches = 8
packer_buffer = 64
[model]
llm = "llama-12b"
image = "vit-1b"
[[sources]]
name = "img"
modality = "image"
text_tokens = 8
length = {{ {img} }}
[[sources]]
name = "txt"
modality = "text"
length = {{ {txt} }}
[[phases]]
weights = {{ img = 1, txt = 1 }}
"""


def text(img="lognormal = { median = 1000, sigma = 0.5 }, min = 16, max = 4096", txt="fixed = 700", L=4096):
    return BASE.format(img=img, txt=txt, L=L)


def draws(w, step, n):
    src = w.samples(step)
    src.reset()
    return [next(src) for _ in range(n)]


def test_lognormal_lengths_have_the_median_and_spread_asked():
    w = parse_workload(text(img="lognormal = { median = 1000, sigma = 0.5 }, min = 1, max = 4096"))
    w = w.with_weights({"img": 1})
    lengths = [s.num_tokens for s in draws(w, 0, 20000)]
    assert statistics.median(lengths) == pytest.approx(1000, rel=0.03)
    # log-lengths: sd = sigma (clipping at 4096 = 4 sigma above the median touches 3e-5 of them)
    logs = [math.log(n) for n in lengths]
    assert statistics.pstdev(logs) == pytest.approx(0.5, rel=0.03)
    assert all(s.text_tokens == 8 and s.media_tokens == s.num_tokens - 8 for s in draws(w, 1, 100))


def test_histogram_lengths_follow_the_bins_by_brute_force():
    w = parse_workload(
        text(img="histogram = { edges = [10, 20, 50, 100], weights = [1, 2, 1] }", txt="fixed = 5")
    ).with_weights({"img": 1})
    lengths = [s.num_tokens for s in draws(w, 3, 20000)]
    assert min(lengths) >= 10 and max(lengths) < 100
    counts = Counter(0 if n < 20 else 1 if n < 50 else 2 for n in lengths)
    for b, share in enumerate((0.25, 0.5, 0.25)):
        assert counts[b] / len(lengths) == pytest.approx(share, abs=0.015)
    # uniform inside a bin: the first bin's 10 values each near 1/40 of the draws
    inner = Counter(n for n in lengths if n < 20)
    assert set(inner) == set(range(10, 20))
    assert all(abs(c / len(lengths) - 0.025) < 0.006 for c in inner.values())


def test_packs_hold_whole_samples_and_never_exceed_the_pack_length():
    w = parse_workload(text(txt="lognormal = { median = 3000, sigma = 1.0 }, max = 40000"))
    drawn = {s.uid: s for s in draws(w, 2, 400)}
    packs = w.step_packs(2)
    assert len(packs) == 8
    seen, split = Counter(), 0
    for p in packs:
        assert 0 < p.num_tokens <= 4096
        for s in p.samples:
            seen[s.uid] += 1
            if s.modality is Modality.IMAGE:
                assert s == drawn[s.uid]  # a media sample is never cut
            elif s.text_range is None:
                assert s == drawn[s.uid]
            else:  # only text longer than a pack is split, into pieces of the drawn sample
                split += 1
                whole = drawn[f"{s.source}/{s.key}"]
                assert whole.num_tokens > 4096 and s.text_range[1] <= whole.num_tokens
    assert max(seen.values()) == 1 and split > 0
    # encoder_flops is the sample's own encoder cost: what the encoder split balances
    mbs = split_encoder_microbatches(packs, 8, 4)
    assert sorted((p, i) for items in mbs.values() for p, i in items) == sorted(
        (p, i) for p, pack in enumerate(packs) for i, s in enumerate(pack.samples) if s.media_tokens
    )


def test_steps_are_deterministic_alone_and_phases_switch_by_step():
    src = text() + "until_step = 3\n[[phases]]\nweights = { img = 0, txt = 1 }\n"
    w = parse_workload(src)
    a = [p.to_dict() for p in w.step_packs(1)]
    assert a == [p.to_dict() for p in parse_workload(src).step_packs(1)]
    assert a != [p.to_dict() for p in w.step_packs(2)]
    assert (
        w.phase(2).weights["img"] == 1
        and w.phase(3).weights["img"] == 0
        and w.phase(10**6).until_step is None
    )
    assert any(s.modality is Modality.IMAGE for p in w.step_packs(2) for s in p.samples)
    assert all(s.modality is Modality.TEXT for p in w.step_packs(3) for s in p.samples)


@pytest.mark.parametrize(
    "mutate,key",
    [
        (lambda t: t.replace("max_seq_len = 4096\n", ""), "max_seq_len: missing"),
        (
            lambda t: t.replace("max_seq_len = 4096", "max_seq_len = 1e9"),
            "max_seq_len: must be a whole number",
        ),
        (lambda t: t.replace("sigma = 0.5", "sigma = -1"), "sources[0].length.lognormal.sigma"),
        (lambda t: t.replace("max = 4096", "max = 9000"), "sources[0].length.max"),
        (
            lambda t: t.replace("weights = { img = 1, txt = 1 }", "weights = { img = 1, vid = 1 }"),
            "phases[0].weights",
        ),
        (
            lambda t: t.replace("weights = { img = 1, txt = 1 }", "weights = { img = 0, txt = 0 }"),
            "phases[0].weights",
        ),
        (lambda t: t.replace('modality = "image"', 'modality = "smell"'), "sources[0].modality"),
        (lambda t: t.replace('image = "vit-1b"', 'image = "vit-99b"'), "model.image: unknown model"),
        (lambda t: t.replace('image = "vit-1b"\n', ""), "model.image: missing"),
        (lambda t: t.replace("seed = 7", "seed = 7\nsede = 8"), "sede: unknown key"),
        (
            lambda t: t.replace("fixed = 700", "fixed = 700, lognormal = { median = 3, sigma = 1 }"),
            "sources[1].length",
        ),
        (
            lambda t: t.replace(
                "lognormal = { median = 1000, sigma = 0.5 }",
                "histogram = { edges = [1, 5], weights = [1, 2] }",
            ),
            "sources[0].length.histogram",
        ),
        (
            lambda t: (
                t.replace("[[phases]]", "[[phases]]\nuntil_step = 5") + "[[phases]]\nweights = { img = 1 }\n"
                "until_step = 4\n"
            ),
            "phases[1].until_step",
        ),
        (lambda t: t + "[[phases\n", "not valid TOML"),
    ],
)
def test_bad_workloads_are_refused_naming_the_key(tmp_path, mutate, key):
    path = tmp_path / "w.toml"
    path.write_text(mutate(text()))
    with pytest.raises(WorkloadError) as err:
        load_workload(path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(str(path)) and key in msg, msg


def test_oversized_and_missing_files_are_refused(tmp_path):
    big = tmp_path / "big.toml"
    big.write_text(text() + "#" * (1 << 20))
    with pytest.raises(WorkloadError, match="more than a workload may hold"):
        load_workload(big)
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(tmp_path / "none.toml")


def test_one_set_of_model_shapes_and_p2p_constants():
    vit, usm, llama = MODEL_SHAPES["vit-1b"], MODEL_SHAPES["usm-2b"], MODEL_SHAPES["llama-12b"]
    assert (vit.dim, vit.n_layers) == (1408, 40) and vit.matmul_params == pytest.approx(1.009e9, rel=1e-3)
    assert llama.matmul_params == pytest.approx(12.69e9, rel=1e-3) and usm.matmul_params == pytest.approx(
        1.736e9, rel=1e-3
    )
    paper = MODEL_SCALES["paper"]
    assert paper.encoder_dim == {"image": 1408, "audio": 1536} and paper.llm_params == llama.matmul_params
    assert (P2P_LATENCY_S, P2P_BANDWIDTH_BPS) == (20e-6, 50e9)
    w = parse_workload(text())
    packs = w.step_packs(0)
    costs = modelled_step_costs(w.model, packs, split_encoder_microbatches(packs, 8, 2), 2, 1e15)
    assert (costs.p2p_latency_s, costs.p2p_bandwidth_Bps) == (P2P_LATENCY_S, P2P_BANDWIDTH_BPS)


def step_costs(pp=4, m=8, seed_step=0):
    w = parse_workload(text())
    packs = w.step_packs(seed_step, m)
    costs = modelled_step_costs(w.model, packs, split_encoder_microbatches(packs, m, pp), pp, 4e14, 16)
    return Schedule1F1B(pp, m), encoder_microbatch_ids(m, pp), costs


def test_prepend_puts_every_encoder_second_on_stage_0():
    """Megatron-LM: stage 0's rank runs its LLM stage and every encoder forward and backward (brute-force sums)."""
    schedule, enc, costs = step_costs()
    flow = prepend_first_stage(schedule, enc)
    flow.validate(schedule)
    res = simulate(schedule, flow, costs)
    work = sum(costs.duration(Action(k, e)) for es in enc.values() for e in es for k in (EF, EB))
    assert work > 0
    assert res.encoder_busy_s[0] == pytest.approx(work, rel=1e-12)
    assert all(res.encoder_busy_s[r] == 0 for r in range(1, 4))
    llm0 = sum(costs.duration(Action(k, i, 0)) for i in range(8) for k in (F, B))
    busy0 = res.makespan_s * (1 - res.bubble_fraction[0])
    assert busy0 == pytest.approx(llm0 + work, rel=1e-9)


def test_megatron_dist_runs_every_action_once_after_its_inputs():
    """Megatron-Dist / DistTrain: encoder ranks P..P+E-1; each action once; every start waits for its inputs
    (plus the P2P transfer across ranks), checked action by action against the dependency rules."""
    schedule, enc, costs = step_costs()
    E = 2
    programs, consumer = disaggregated_programs(schedule, enc, E, costs.encoder_forward_s)
    assert sorted(programs) == list(range(4 + E))
    actions = [a for prog in programs.values() for a in prog]
    assert len(actions) == len(set(actions))
    want = {a for prog in schedule.programs().values() for a in prog}
    want |= {Action(k, e) for es in enc.values() for e in es for k in (EF, EB)}
    assert set(actions) == want
    for r in range(4):
        assert programs[r] == schedule.programs()[r]
    rank_of, start, end, _ = action_times(programs, schedule.num_stages, consumer, costs)
    deps = llm_encoder_deps(schedule.num_stages, consumer)
    for a in actions:
        for d in deps(a):
            hop = costs.transfer_s(costs.message_bytes(d, a)) if rank_of[d] != rank_of[a] else 0.0
            assert start[a] >= end[d] + hop - 1e-12, (a, d)
    for prog in programs.values():
        assert all(end[x] <= start[y] + 1e-12 for x, y in itertools.pairwise(prog))
    res = simulate_disaggregated(schedule, enc, costs, E)
    # the same GPUs hold P / (P + E) as many replicas: throughput counts every GPU
    tokens = costs.tokens_per_microbatch * 8 * costs.data_parallel * 4 / (4 + E)
    assert res.throughput_tokens_per_s == pytest.approx(tokens / res.step_time_s)
    assert res.encoder_busy_s[4] + res.encoder_busy_s[5] == pytest.approx(
        sum(costs.duration(a) for a in want if a.kind.is_encoder)
    )
    assert all(res.encoder_busy_s[r] == 0 for r in range(4))


def test_encoder_ranks_in_proportion_to_encoder_compute():
    schedule = Schedule1F1B(4, 4)
    enc = encoder_microbatch_ids(4, 4)
    costs = CostModel(
        llm_forward_s=1.0, llm_backward_s=2.0, encoder_forward_s={e: 0.5 for es in enc.values() for e in es}
    )
    # LLM: 4 stages x 4 mbs x 3 s = 48 s; encoders: 16 x 1.5 s = 24 s -> round(4 * 0.5) = 2
    assert encoder_ranks_for(costs, schedule) == 2
    assert encoder_ranks_for(CostModel(), schedule) == 1


def test_optimus_fills_bubbles_statically():
    """Optimus: a valid flow; forwards in the warm-up bubbles where they fit; the plan follows the mean
    encoder microbatch only (static), so two steps with the same mean but different spreads get one plan."""
    schedule, enc, costs = step_costs()
    flow = optimus_static(schedule, enc, costs)
    flow.validate(schedule)
    res = simulate(schedule, flow, costs)
    assert all(sum(1 for ev in res.timelines[r] if ev.kind == "EF") == 8 for r in range(4))
    fwd = costs.encoder_forward_s
    mean = sum(fwd.values()) / len(fwd)
    skewed = {e: (2 * mean if i % 2 else 0.0) for i, e in enumerate(sorted(fwd))}  # same mean
    other = CostModel(**{**costs.__dict__, "encoder_forward_s": skewed})
    assert optimus_static(schedule, enc, other) == flow
    assert optimus_static(schedule, enc, costs, static_encoder_s=mean) == flow
    # unit LLM costs, tiny encoders: rank r's warm-up bubble (r forwards long) takes its first forwards
    small = CostModel(encoder_forward_s={e: 0.01 for es in enc.values() for e in es})
    flow = optimus_static(schedule, enc, small)
    flow.validate(schedule)
    for r in (1, 2, 3):
        first_llm = schedule.programs()[r][0]
        prog = flow.programs(schedule)[r]
        assert prog.index(first_llm) > 0 and prog[0].kind is EF
