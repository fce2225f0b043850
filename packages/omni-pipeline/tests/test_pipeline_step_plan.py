"""The planning side moved out of the trainer: the schedule factory, the LLM layer split and its costs,
the records' token convention, the per-step cost model, the per-step planner and the calibrations.

Oracles: brute force (every contiguous split; ``FlopCounterMode`` over an actual decoder block and LM
head), hand counts of the token convention, synthetic records made from known seconds, and the planner
against itself in a second instance (every rank must plan the same flow).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from omni_data import Modality, Pack, SampleMeta, encoder_microbatch_ids, split_encoder_microbatches
from omni_parallel.flops import TransformerShape, forward_flops
from omni_pipeline import (
    ActionRecord,
    LLMShape,
    PlannerSpec,
    RecordWriter,
    RunRecords,
    Schedule1F1B,
    ScheduleError,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    StepPlanner,
    StepRecord,
    action_tokens,
    build_schedule,
    calibrated_layer_costs,
    fitted_cost_model,
    layer_costs,
    model_scale,
    modelled_step_costs,
    simulate,
    split_layers,
    stage_costs,
    stage_weights,
    static_flow,
)

SHAPE = LLMShape(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=400)


def test_build_schedule_by_name():
    assert type(build_schedule("1f1b", 2, 4)) is Schedule1F1B
    gpipe = build_schedule("gpipe", 2, 4, 2)
    assert type(gpipe) is ScheduleGPipe and gpipe.num_stages == 4
    inter = build_schedule("interleaved", 2, 4, 2)
    assert type(inter) is ScheduleInterleaved1F1B and inter.rank_stages(1) == [1, 3]
    with pytest.raises(ValueError, match="'zigzag' is not a valid ScheduleKind"):
        build_schedule("zigzag", 2, 4)
    with pytest.raises(ScheduleError, match="one stage per rank"):
        build_schedule("1f1b", 2, 4, 2)


def _block_and_head_flops(shape: LLMShape, n: int) -> tuple[int, int]:
    """FlopCounterMode over one decoder block (GQA, SwiGLU) on one ``n``-token document, and the LM head."""
    g = torch.Generator().manual_seed(0)
    d, h, hkv, dh, f = shape.dim, shape.n_heads, shape.n_kv_heads, shape.dim // shape.n_heads, shape.ffn_dim

    def w(i, o):
        return torch.randn(o, i, generator=g, dtype=torch.float64)

    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    wq, wk, wv, wo = w(d, d), w(d, hkv * dh), w(d, hkv * dh), w(d, d)
    w1, w3, w2, head = w(d, f), w(d, f), w(f, d), w(d, shape.vocab_size)
    with FlopCounterMode(display=False) as block:
        q = F.linear(x, wq).view(n, h, dh).transpose(0, 1)
        k = F.linear(x, wk).view(n, hkv, dh).transpose(0, 1).repeat_interleave(h // hkv, 0)
        v = F.linear(x, wv).view(n, hkv, dh).transpose(0, 1).repeat_interleave(h // hkv, 0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(n, d)
        y = x + F.linear(a, wo)
        y = y + F.linear(F.silu(F.linear(y, w1)) * F.linear(y, w3), w2)
    with FlopCounterMode(display=False) as lm_head:
        F.linear(y, head)
    return block.get_total_flops(), lm_head.get_total_flops()


def test_layer_costs_count_the_block_and_head_per_token():
    n = 24
    block, head = _block_and_head_flops(SHAPE, n)
    got_block, got_embedding, got_head = layer_costs(SHAPE, n)
    # the counter counts every score product (as the split's cost does: no causal halving)
    assert got_block * n == block
    assert got_embedding == SHAPE.dim
    assert got_head == head / n + 5 * SHAPE.vocab_size  # + the log-softmax and loss per vocabulary entry
    with pytest.raises(ValueError, match="vocab_size is not set"):
        layer_costs(LLMShape(32, 4, 4, 2, 64), n)


def _key(costs: tuple[float, float, float], counts: list[int]) -> tuple[float, float]:
    """A split's slowest stage, then its sum of squared stage costs (the balance's two objectives)."""
    block, first, last = costs
    t = [c * block for c in counts]
    t[0] += first
    t[-1] += last
    return max(t), sum(x * x for x in t)


def _best_split(costs: tuple[float, float, float], layers: int, stages: int) -> list[int]:
    """Brute force over every contiguous split: the best :func:`_key` (the first such, by cut positions)."""
    splits = [
        [b - a for a, b in itertools.pairwise((0, *cuts, layers))]
        for cuts in itertools.combinations(range(1, layers), stages - 1)
    ]
    return min(splits, key=lambda counts: _key(costs, counts))


@pytest.mark.parametrize(("stages", "seq"), [(2, 96), (3, 16), (4, 512)])
def test_auto_split_is_the_brute_force_best(stages, seq):
    shape = LLMShape(32, 8, 4, 2, 64, 4000)
    for costs in (layer_costs(shape, seq), (1.0, 0.0, 4.5)):  # modelled; a head of 4.5 layers
        kwargs = {"costs": costs} if costs[1] == 0.0 else {"max_seq_len": seq}
        got = [len(r) for r in split_layers(shape, stages, "auto", **kwargs)]
        assert sum(got) == 8 and min(got) >= 1
        # no split is better (ties between equally good splits are the splitter's own rule)
        assert _key(costs, got) == pytest.approx(_key(costs, _best_split(costs, 8, stages)), rel=1e-12)


def test_default_and_explicit_splits():
    assert split_layers(SHAPE, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert split_layers(SHAPE, 2, [3, 1]) == [range(0, 3), range(3, 4)]
    with pytest.raises(ValueError, match="stage_layers: 2 stages given, the pipeline has 4"):
        split_layers(SHAPE, 4, [3, 1])
    with pytest.raises(ValueError, match="needs costs or max_seq_len"):
        split_layers(SHAPE, 2, "auto")


def test_stage_weights_are_relative_stage_costs():
    split = [range(0, 3), range(3, 4)]
    block, first, last = layer_costs(SHAPE, 96)
    want = [3 * block + first, block + last]
    got = stage_weights(SHAPE, split, 96)
    assert got == pytest.approx([2 * c / sum(want) for c in want], rel=1e-12)
    assert sum(got) == pytest.approx(2.0)
    assert got == pytest.approx(
        [
            2 * c / sum(want)
            for c in stage_costs(split, [block] * 4, first_stage_extra=first, last_stage_extra=last)
        ]
    )


def _sample(i: int, modality: Modality, media: int, text: int) -> SampleMeta:
    return SampleMeta(f"k{i}", str(modality), modality, media, text, 0.0, (1,))


def _packs() -> list[Pack]:
    img, aud, txt = Modality.IMAGE, Modality.AUDIO, Modality.TEXT
    return [
        Pack([_sample(0, img, 4, 3), _sample(1, txt, 0, 9)], 64),
        Pack([_sample(2, aud, 6, 2), _sample(3, img, 9, 1), _sample(4, aud, 3, 5)], 64),
        Pack([_sample(5, img, 16, 4)], 64),
        Pack([_sample(6, txt, 0, 20), _sample(7, aud, 12, 1)], 64),
    ]


def test_action_tokens_follow_the_recorded_convention():
    packs = _packs()
    mbs = {1: [(0, 0)], 2: [(1, 0), (1, 1)], 3: [(1, 2), (2, 0)]}
    llm, enc = action_tokens(packs, mbs, image_merge=2)
    assert llm[1].modules == {"llm": (16, 7 * 7 + 9 * 9)}  # per document, not the pack squared
    assert llm[2].modules == {"llm": (26, 8 * 8 + 10 * 10 + 8 * 8)}
    assert enc[1].modules == {"image": (16, 16 * 16)}  # 4 LLM tokens = 16 ViT patches before the merge
    assert enc[2].modules == {"audio": (6, 36), "image": (36, 36 * 36)}
    assert enc[3].modules == {"audio": (3, 9), "image": (64, 64 * 64)}


def test_modelled_step_costs_time_the_flop_model():
    packs = _packs()
    llm = SHAPE.blocks
    towers = {
        "image": TransformerShape(16, 2, 2, mlp_ratio=2),
        "audio": TransformerShape(24, 1, 2, mlp_ratio=4),
    }
    ms = model_scale(llm, towers, image_merge=2)
    assert ms.encoder_params["image"] == 2 * (4 + 2 * 2) * 16 * 16  # the tower's mlp_ratio honoured
    mbs = split_encoder_microbatches(packs, 2, 2)
    rate, pp = 1e9, 2
    costs = modelled_step_costs(ms, packs, mbs, pp, rate, 1, [1.5, 0.5])
    fwd = sum(forward_flops(llm, p.seqlens, causal=True) for p in packs) / len(packs) / pp / rate
    assert costs.llm_forward_s == pytest.approx([1.5 * fwd, 0.5 * fwd], rel=1e-12)
    assert costs.llm_backward_s == pytest.approx([3 * fwd, fwd], rel=1e-12)
    for e, items in mbs.items():
        want = 0.0
        for p, i in items:
            s = packs[p].samples[i]
            n = s.media_tokens * 4 if s.modality is Modality.IMAGE else s.media_tokens
            want += forward_flops(towers[str(s.modality)], [n], causal=False) / rate
        assert costs.encoder_forward_s[e] == pytest.approx(want, rel=1e-12)


def test_the_planner_is_deterministic_and_its_cap_reaches_the_plan():
    packs = _packs() * 2
    schedule = Schedule1F1B(2, 4)
    enc = encoder_microbatch_ids(4, 2)
    mbs = split_encoder_microbatches(packs, 4, 2)
    towers = {"image": TransformerShape(64, 4, 4), "audio": TransformerShape(64, 4, 4)}
    spec = PlannerSpec(scale=model_scale(SHAPE.blocks, towers))
    weights = stage_weights(SHAPE, split_layers(SHAPE, 2), 64)
    a, b = (StepPlanner(spec, schedule, enc, weights, pp_rank=r) for r in (0, 1))
    reads = [a.consumes(7, packs, mbs), b.consumes(7, packs, mbs)]
    flow = a.flow(7, packs, mbs)
    assert flow == b.plan(packs, mbs)  # every rank plans the same flow
    assert reads == [frozenset(flow.encoders_on(0)), frozenset(flow.encoders_on(1))]
    assert reads[0] | reads[1] == set(mbs) and not reads[0] & reads[1]
    costs = modelled_step_costs(spec.scale, packs, mbs, 2, spec.rate_flops, 1, weights)
    free = simulate(schedule, flow, costs).peak_activation_bytes[0]
    capped = StepPlanner(
        PlannerSpec(scale=spec.scale, memory_cap_bytes=0.5 * free), schedule, enc, weights, 0
    )
    assert capped.memory_cap_bytes == 0.5 * free
    assert simulate(schedule, capped.plan(packs, mbs), costs).peak_activation_bytes[0] < free
    with pytest.raises(ValueError, match="max_evaluations must be >= 1"):
        PlannerSpec(scale=spec.scale, max_evaluations=0)


@pytest.mark.parametrize("policy", ["isolated", "uniform_on_demand", "planned"])
def test_static_flow_keeps_the_fixed_rank_rule(policy):
    schedule = Schedule1F1B(3, 4)
    enc = encoder_microbatch_ids(4, 3)
    flow = static_flow(policy, schedule, enc, [1.2, 1.0, 0.8], encoder_forward_share=0.3)
    flow.validate(schedule)
    assert {e: flow.encoder_rank(e) for es in enc.values() for e in es} == {
        e: j for es in enc.values() for j, e in enumerate(es)
    }


def test_static_planned_flow_sees_the_stage_weights(monkeypatch):
    import omni_pipeline.step_plan as step_plan

    seen = []
    real = step_plan.place
    monkeypatch.setattr(step_plan, "place", lambda *a, **kw: seen.append(a[3]) or real(*a, **kw))
    enc = encoder_microbatch_ids(4, 3)
    static_flow("planned", Schedule1F1B(3, 4), enc, [1.2, 1.0, 0.8], encoder_forward_share=0.3)
    static_flow("uniform_on_demand", Schedule1F1B(3, 4), enc, [1.2, 1.0, 0.8], encoder_forward_share=0.3)
    planned, uniform = seen
    assert planned.llm_forward_s == [1.2, 1.0, 0.8] and planned.llm_backward_s == [2.4, 2.0, 1.6]
    assert (
        planned.encoder_forward_s == uniform.encoder_forward_s == {e: 0.3 for es in enc.values() for e in es}
    )


def test_the_planner_reports_bytes_over_a_cap_and_forgets_steps_that_never_ran():
    packs = _packs() * 2
    schedule, enc = Schedule1F1B(2, 4), encoder_microbatch_ids(4, 2)
    mbs = split_encoder_microbatches(packs, 4, 2)
    scale = model_scale(
        SHAPE.blocks, {"image": TransformerShape(64, 4, 4), "audio": TransformerShape(64, 4, 4)}
    )
    weights = stage_weights(SHAPE, split_layers(SHAPE, 2), 64)
    tight = StepPlanner(PlannerSpec(scale=scale, memory_cap_bytes=1.0), schedule, enc, weights, 0)
    for step in (5, 6, 7):  # the loader prepared three steps; 5 and 6 never ran
        tight.consumes(step, packs, mbs)
    tight.flow(7, packs, mbs)
    assert not tight._flows  # nothing kept for steps that will never run
    assert tight.over_cap_bytes > 0  # 1 byte: no placement meets it
    loose = StepPlanner(PlannerSpec(scale=scale, memory_cap_bytes=1e30), schedule, enc, weights, 0)
    loose.flow(7, packs, mbs)
    assert loose.over_cap_bytes == 0.0


def _records(stage_seconds: list[float], steps: int = 3, microbatches: int = 2) -> list:
    """F + B of each microbatch on stage ``s`` take ``stage_seconds[s]`` (one third forward)."""
    recs: list = []
    for step in range(steps):
        for s, sec in enumerate(stage_seconds):
            t = 0.0
            for mb in range(microbatches):
                for kind, part in (("F", 1 / 3), ("B", 2 / 3)):
                    recs.append(
                        ActionRecord(step, s, kind, s, mb, {"llm": 96}, {"llm": 96 * 96}, t, t + sec * part)
                    )
                    t += sec * part
            recs.append(StepRecord(step, s, t, t))
    return recs


def test_calibrated_layer_costs_recover_the_seconds_they_were_made_from():
    layer, head = 0.010, 0.030
    block_flops, first_flops, _ = layer_costs(SHAPE, 96)
    embedding = layer * first_flops / block_flops  # the embedding: its modelled share of a block
    split = [range(0, 2), range(2, 4)]
    records = RunRecords(
        actions=[
            r for r in _records([2 * layer + embedding, 2 * layer + head]) if isinstance(r, ActionRecord)
        ]
    )
    got = calibrated_layer_costs(records, split, SHAPE, 96)
    # the embedding's share is taken of a first fit that has it in the layers (one refinement step):
    # exact up to that share's share, ~1e-7 here
    assert got == pytest.approx((layer, embedding, head), rel=1e-5)
    assert [len(r) for r in split_layers(SHAPE, 2, "auto", costs=got)] == _best_split(got, 4, 2) == [3, 1]
    with pytest.raises(ValueError, match="recorded with 1 LLM stage"):
        calibrated_layer_costs(records, [range(0, 4)], SHAPE, 96)
    one = RunRecords(actions=[r for r in records.actions if r.stage == 0])
    with pytest.raises(ValueError, match=r"no LLM actions recorded for stages \[1\] of its 2"):
        calibrated_layer_costs(one, split, SHAPE, 96)
    three = RunRecords(actions=[r for r in _records([1.0, 1.0, 1.0]) if isinstance(r, ActionRecord)])
    with pytest.raises(ValueError, match=r"records LLM stage 2 .*over 2 stages"):
        calibrated_layer_costs(three, split, SHAPE, 96)
    idle = RunRecords(actions=[r for r in _records([0.0, 0.0]) if isinstance(r, ActionRecord)])
    with pytest.raises(ValueError, match="fit no positive seconds per layer"):
        calibrated_layer_costs(idle, split, SHAPE, 96)


def test_fitted_cost_model_checks_the_pipeline_it_times(tmp_path: Path):
    with RecordWriter(tmp_path / "actions.jsonl") as w:
        w.write(_records([0.02, 0.05], steps=4))
    fitted = fitted_cost_model(tmp_path, 2)
    assert fitted.llm_forward_s == pytest.approx([0.02 / 3, 0.05 / 3])
    with pytest.raises(ValueError, match="recorded 2 pipeline stages, the pipeline to time has 1"):
        fitted_cost_model(tmp_path, 1)
    with pytest.raises(FileNotFoundError):
        fitted_cost_model(tmp_path / "none", 2)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_placement_planner_and_policy_import_one_way():
    """The baselines do not import the search that starts from them, nor the dispatch by name, even
    inside a function."""
    src = Path(__file__).resolve().parents[1] / "src" / "omni_pipeline"
    assert not {"omni_pipeline.planner", "omni_pipeline.policy"} & _imports(src / "placement.py")
    assert "omni_pipeline.policy" not in _imports(src / "planner.py")
