"""The omni-heavy recipe: it validates for 2 processes, sweeps the paper's mixtures, and its LLM splits
into two balanced stages by the per-token cost of a block against the LM head + loss."""

from omni_pipeline import balance_stages, stage_costs, stage_slices
from omni_train.binder import load_config
from omni_train.preflight import validate


def test_omni_heavy_validates_and_sweeps_the_papers_mixtures():
    cfg = load_config("omni-heavy")
    validate(cfg, 2)
    assert cfg.parallel.pp == 2 and cfg.model.vit is not None and cfg.model.audio is not None
    mix = [(p.weights["image"], p.weights["audio"], p.weights["text"]) for p in cfg.data.mixture]
    # image share sweep 1:9 -> 5:5 -> 9:1 (image:text), then the audio rise from 1:0:1 to 13:74:13
    assert mix[:3] == [(1, 0, 9), (5, 0, 5), (9, 0, 1)]
    assert mix[3] == (1, 0, 1) and mix[-1] == (13, 74, 13)
    audio = [a / (i + a + t) for i, a, t in mix[3:]]
    assert audio == sorted(audio) and all(i == t for i, _, t in mix[3:])
    until = [p.until_step for p in cfg.data.mixture[:-1]]
    assert until == sorted(until) and until[-1] < cfg.train.steps


def test_omni_heavy_llm_balances_as_two_layers_then_one_plus_the_head():
    """Forward FLOPs per token (2 per multiply-add): a block's matmuls (GQA attention projections and a
    SwiGLU MLP) plus attention over a whole 256-token document (the most a pack holds), against the LM
    head's 4096-word matmul; the embedding is a lookup. The balanced split is [2, 1], which is also the
    trainer's split (first stages take the remainder); [1, 2] would put two blocks and the head on stage
    1, more than twice stage 0."""
    cfg = load_config("omni-heavy")
    llm, seq, vocab = cfg.model.llm, cfg.data.max_seq_len, 4096
    kv = llm.dim * llm.n_kv_heads // llm.n_heads
    block = 2 * (2 * llm.dim * llm.dim + 2 * llm.dim * kv + 3 * llm.dim * llm.ffn_dim) + 4 * seq * llm.dim
    head = 2 * llm.dim * vocab
    split = balance_stages([block] * llm.n_layers, 2, last_stage_extra=head)
    assert [len(r) for r in split] == [2, 1]
    assert split == stage_slices(llm.n_layers, 2)
    balanced = stage_costs(split, [block] * 3, last_stage_extra=head)
    even = stage_costs([range(0, 1), range(1, 3)], [block] * 3, last_stage_extra=head)
    assert max(balanced) / min(balanced) < 1.2 < 2 < max(even) / min(even)
