"""``tune``'s ranking of equal predictions (:func:`omni_pipeline.tune.rank_plans`): plans predicting exactly
the same tokens/s are listed simpler first (lower ``llm_zero``, then lower ``encoder_zero``, then fewer
virtual stages), whatever order they reach the ranking in; the oracle for the best plan is its own layout
re-predicted with every simpler ZeRO pair."""

from __future__ import annotations

import dataclasses
import itertools

from omni_pipeline.step_model import predict_step
from omni_pipeline.tune import rank_plans, tune
from omni_pipeline.workload import parse_workload

# a small ViT + LLM workload whose pp = 1 and pp = 2 layouts tie across ZeRO stages (about 0.4 s to tune)
WORKLOAD = """
name = "ties"
max_seq_len = 2048
microbatches = 8
[model]
llm = { dim = 256, n_layers = 8, n_heads = 4, n_kv_heads = 2, ffn_dim = 512, gated_mlp = true }
image = { dim = 128, n_layers = 2, n_heads = 2, mlp_ratio = 4 }
[[sources]]
name = "t"
modality = "text"
length = { fixed = 700 }
[[sources]]
name = "i"
modality = "image"
length = { fixed = 300 }
text_tokens = 8
[[phases]]
weights = { t = 1, i = 1 }
"""


def _rule(p):
    return p.layout.llm_zero, p.layout.encoder_zero, p.layout.virtual_stages


def test_equal_predictions_rank_the_simpler_plan_first():
    w = parse_workload(WORKLOAD)
    res = tune(w, 8, global_batch=16, top=40)
    plans = res.plans
    tied = [(a, b) for a, b in itertools.pairwise(plans) if a.tokens_per_s == b.tokens_per_s]
    # not vacuous: ties across llm_zero and across encoder_zero are in the list
    assert any(a.layout.llm_zero != b.layout.llm_zero for a, b in tied), [_rule(p) for p in plans]
    assert any(a.layout.encoder_zero != b.layout.encoder_zero for a, b in tied), [_rule(p) for p in plans]
    assert [p.tokens_per_s for p in plans] == sorted((p.tokens_per_s for p in plans), reverse=True)
    for a, b in tied:
        assert _rule(a) <= _rule(b), (a.layout, b.layout)
    # the order reaching the ranking does not matter: the plans reversed rank the same way
    again = rank_plans(reversed(plans))
    assert [(p.tokens_per_s, _rule(p)) for p in again] == [(p.tokens_per_s, _rule(p)) for p in plans]
    # peer oracle: every simpler ZeRO pair of the best layout that fits predicts a slower step
    best = plans[0]
    m = res.global_batch // best.layout.dp
    for z in range(4):
        for ez in (0, 2, 3):
            if (z, ez) >= (best.layout.llm_zero, best.layout.encoder_zero):
                continue
            q = predict_step(w, dataclasses.replace(best.layout, llm_zero=z, encoder_zero=ez), microbatches=m)
            assert q.oom or q.tokens_per_s < best.tokens_per_s, (z, ez, q.tokens_per_s, best.tokens_per_s)
