"""Virtual stages (interleaved 1F1B) in the whole-step model and the tuner: the step model's pipeline at
``virtual_stages = 2`` against a brute-force replay of the interleaved programs with hand-computed stage
seconds and P2P transfers; the in-flight activations of the interleaved program against Megatron's count
and the simulator's time-based peak; the tuner's step-time lower bound never above the simulated step;
the search covering virtual stages and encoder ZeRO, and picking interleaving where 1F1B's bubble is
large."""

from __future__ import annotations

import dataclasses
import math

import pytest

from omni_parallel.flops import attention_flops, model_flops
from omni_pipeline.actions import Action, ActionKind
from omni_pipeline.schedules import ScheduleInterleaved1F1B
from omni_pipeline.step_costs import P2P_BANDWIDTH_BPS, P2P_LATENCY_S
from omni_pipeline.step_model import Device, Layout, predict_step, rank_memory, step_time_lower_bound
from omni_pipeline.tune import candidate_layouts, tune
from omni_pipeline.workload import parse_workload

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


def _workload(microbatches: int = 4, layers: int = 4, image: bool = False, dim: int = 256):
    img = (
        """image = { dim = 128, n_layers = 2, n_heads = 2, mlp_ratio = 4 }
[[sources]]
name = "i"
modality = "image"
length = { fixed = 300 }
text_tokens = 8
"""
        if image
        else ""
    )
    weights = "t = 1, i = 1" if image else "t = 1"
    return parse_workload(
        f"""
name = "text"
max_seq_len = 2048
microbatches = {microbatches}
[model]
llm = {{ dim = {dim}, n_layers = {layers}, n_heads = 4, n_kv_heads = 2, ffn_dim = {2 * dim}, gated_mlp = true }}
{img}[[sources]]
name = "t"
modality = "text"
length = {{ fixed = 700 }}
[[phases]]
weights = {{ {weights} }}
"""
    )


def _replay(programs, stages: int, fwd_s: float, p2p_s: float, pp: int):
    """Brute force: run each rank's program in order; an action starts when its rank is free and its
    inputs arrived (the previous stage's forward / the next stage's backward, plus ``p2p_s`` from another
    rank; its own forward for a backward). Returns ``{str(action): (start, end)}`` and the P2P count."""
    end: dict[Action, float] = {}
    times: dict[str, tuple[float, float]] = {}
    pos = dict.fromkeys(programs, 0)
    free = dict.fromkeys(programs, 0.0)
    transfers = 0
    progress = True
    while progress:
        progress = False
        for r, prog in programs.items():
            while pos[r] < len(prog):
                a = prog[pos[r]]
                s, k = a.stage, a.microbatch
                if a.kind == F:
                    deps = [(Action(F, k, s - 1), (s - 1) % pp != r)] if s > 0 else []
                else:
                    deps = [(Action(F, k, s), False)]
                    if s < stages - 1:
                        deps.append((Action(B, k, s + 1), (s + 1) % pp != r))
                if any(d not in end for d, _ in deps):
                    break
                start = max([free[r]] + [end[d] + (p2p_s if far else 0.0) for d, far in deps])
                transfers += sum(far for _, far in deps)
                end[a] = free[r] = start + (fwd_s if a.kind == F else 2 * fwd_s)
                times[str(a)] = (start, end[a])
                pos[r] += 1
                progress = True
    assert all(pos[r] == len(p) for r, p in programs.items()), "the brute force deadlocked"
    return times, transfers


def test_interleaved_step_equals_a_brute_force_replay_with_hand_computed_stage_seconds():
    """pp = 2, 2 virtual stages, 4 microbatches of an LLM-only workload (4 layers: one per stage):
    every action's start and end in the step model's simulation equals the brute-force replay of
    Megatron's interleaved programs with each stage's forward = the microbatch's forward FLOPs / 4
    stages / (peak x efficiency), backward twice that, and every stage boundary (all cross a rank) one
    P2P of the bf16 boundary activation (``tokens x dim x 2`` bytes) at the step model's latency and
    bandwidth."""
    w, m, pp, v = _workload(), 4, 2, 2
    dev = Device()
    # text only: the encoder slices are empty; prepended to stage 0 they send nothing over P2P
    lay = Layout(pp=pp, virtual_stages=v, placement="prepend_first_stage")
    p = predict_step(w, lay, device=dev, microbatches=m)
    packs = w.step_packs(0, m)
    flops = [
        model_flops(w.model.llm_params, pk.num_tokens,
                    attention_flops(pk.seqlens, w.model.llm_dim, w.model.llm_layers, causal=True), training=False)
        for pk in packs
    ]  # fmt: skip
    fwd_s = sum(flops) / m / (pp * v) / (dev.peak_flops * dev.efficiency)
    tokens = sum(pk.num_tokens for pk in packs) / m
    p2p_s = P2P_LATENCY_S + 2 * tokens * 256 / P2P_BANDWIDTH_BPS
    programs = ScheduleInterleaved1F1B(pp, m, v).programs()
    want, transfers = _replay(programs, pp * v, fwd_s, p2p_s, pp)
    events = [ev for r in range(pp) for ev in p.simulation.timelines[r]]
    assert all(ev.end_s == ev.start_s for ev in events if ev.is_encoder)
    got = {ev.action: (ev.start_s, ev.end_s) for ev in events if not ev.is_encoder}
    assert got.keys() == want.keys()
    for a, (s0, e0) in want.items():
        assert math.isclose(got[a][0], s0, rel_tol=1e-12, abs_tol=1e-15), (a, got[a], s0)
        assert math.isclose(got[a][1], e0, rel_tol=1e-12, abs_tol=1e-15), (a, got[a], e0)
    # the ranks ran the interleaved programs in order (rank r holds stages r and r + 2)
    for r in range(pp):
        order = [ev.action for ev in p.simulation.timelines[r] if not ev.is_encoder]
        assert order == [str(a) for a in programs[r]]
    assert math.isclose(p.simulation.makespan_s, max(e for _, e in want.values()), rel_tol=1e-12)
    # 3 boundaries per microbatch, forward and backward: three times 1F1B's P2P
    assert transfers == 2 * m * (pp * v - 1)
    one = predict_step(w, dataclasses.replace(lay, virtual_stages=1), device=dev, microbatches=m)
    assert math.isclose(sum(p.time_s.values()), p.step_time_s, rel_tol=1e-12)
    # the work per rank is the same: only the idle time moves. This model's stage (~5 us) is shorter
    # than one P2P (20 us latency), so the extra transfers cost more than the bubble saved; at 8x the
    # width the bubble wins
    assert math.isclose(p.time_s["llm_compute"], one.time_s["llm_compute"], rel_tol=1e-9)
    assert p.time_s["pipeline_idle"] > one.time_s["pipeline_idle"]
    wide = _workload(dim=2048)
    idle = {
        lay.virtual_stages: predict_step(wide, lay, microbatches=m).time_s["pipeline_idle"]
        for lay in (lay, dataclasses.replace(lay, virtual_stages=1))
    }
    assert idle[2] < idle[1]
    with pytest.raises(ValueError, match="rounds"):
        predict_step(w, Layout(pp=2, virtual_stages=2), microbatches=5)
    with pytest.raises(ValueError, match="pp \\* virtual_stages"):
        predict_step(w, Layout(pp=2, virtual_stages=2), stage_layers=[2, 2])


def test_interleaved_in_flight_activations_match_megatrons_count_and_the_simulated_peak():
    """Rank r of interleaved 1F1B (pp = 2, v = 2, 4 microbatches) warms up with ``(v - 1) * 2 + 2 *
    (pp - 1 - r)`` forwards, so rank 0 holds 5 one-layer chunks at its peak against 1F1B's 2 microbatches
    of 2 layers: 5/4 of the bytes. The analytic bound (the program's count) equals the simulator's
    time-based peak, and the state is summed over each rank's two stages."""
    w = _workload(4)
    one, two = Layout(pp=2), Layout(pp=2, virtual_stages=2)
    a1, a2 = rank_memory(w, one), rank_memory(w, two)
    assert a2[0]["activations"] == pytest.approx(5 / 4 * a1[0]["activations"], rel=1e-12)
    p = predict_step(w, dataclasses.replace(two, placement="isolated"))  # no encoders: LLM only
    for r in range(2):
        assert a2[r]["activations"] == p.memory[r]["activations"]
        for k in ("llm_parameters", "llm_optimizer"):  # embedding on rank 0, LM head on rank 1 either way
            assert a2[r][k] == a1[r][k]


def test_the_tuners_lower_bound_never_exceeds_the_simulated_step():
    w = _workload(8, layers=8, image=True)
    for base in (Layout(pp=2, dp=2), Layout(pp=4, dp=1, tp=2, sequence_parallel=True, recompute=True)):
        sib = predict_step(w, base, microbatches=8)
        for v, z, ez in ((2, 0, 0), (4, 2, 3), (2, 3, 2)):
            if base.pp * v > 8:
                continue
            lay = dataclasses.replace(base, virtual_stages=v, llm_zero=z, encoder_zero=ez)
            for placement in ("uniform_on_demand", "isolated", "planned"):
                lay = dataclasses.replace(lay, placement=placement)
                lb = step_time_lower_bound(w, lay, sib, microbatches=8)
                got = predict_step(w, lay, microbatches=8).step_time_s
                assert 0 < lb <= got * (1 + 1e-12), (lay, lb, got)
    with pytest.raises(ValueError, match="sibling"):
        step_time_lower_bound(w, Layout(pp=2, dp=2, tp=2), sib, microbatches=8)


def test_tune_searches_virtual_stages_and_encoder_zero_and_interleaves_a_deep_pipeline():
    """The search space holds 1, 2 and 4 virtual stages and encoder ZeRO 0 / 2 / 3 (only 0 without
    encoders); where the trainer runs only pp = 4 (4 microbatches: 1F1B's bubble is 3/7 of the step),
    the best plan interleaves and beats the best 1F1B plan."""
    img = _workload(8, layers=8, image=True)
    axes = {(lay.virtual_stages, lay.encoder_zero) for lay, _ in candidate_layouts(img, 8, 16)}
    assert axes == {(v, ez) for v in (1, 2, 4) for ez in (0, 2, 3)}
    text = _workload(4, layers=8, dim=2048)
    assert {lay.encoder_zero for lay, _ in candidate_layouts(text, 4, 4)} == {0}

    def deep(layout: Layout) -> str | None:  # a trainer that runs pp = 4 only (e.g. its memory)
        return None if layout.pp == 4 else f"parallel.pp: {layout.pp} is not 4"

    res = tune(text, 4, global_batch=4, top=3, check=deep)
    flat = tune(text, 4, global_batch=4, top=3, check=deep, max_virtual=1)
    best = res.plans[0]
    assert best.layout.pp == 4 and best.layout.virtual_stages == 2, best.layout
    assert flat.plans[0].layout.virtual_stages == 1
    assert best.tokens_per_s > flat.plans[0].tokens_per_s
    # interleaving shrinks the bubble: the plan found is its 1F1B sibling with less idle time
    sib = predict_step(text, dataclasses.replace(best.layout, virtual_stages=1), microbatches=4)
    assert best.time_s["pipeline_idle"] < sib.time_s["pipeline_idle"]
