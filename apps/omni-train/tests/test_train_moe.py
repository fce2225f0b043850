"""Mixture-of-experts LLM (``[model.llm] moe``) and expert parallelism (``parallel.ep``) in the trainer.

* ep = 2 on 2 gloo processes (dp = 2, pp = 1, media: image + audio + text; also with the LLM blocks
  recomputed in backward), float64, 3 steps: losses and
  every gradient (the experts' ``Shard(0)`` DTensor gradients made whole) equal the one-process
  reference over the same packs (``train_reference``, <= 1e-10), so dispatch/combine, the expert sum
  over the expert-data-parallel ranks only (none here: ep = dp) and the aux + z losses attached to the
  objective compose as one process. The per-step MoE metrics in ``metrics.jsonl`` (aux, z, tokens per
  expert per layer, max/mean load) equal the reference's, and the run is dropless: the rows the experts
  computed equal the (token, slot) rows routed, ``tokens x top_k`` per MoE layer.
* One process, one LLM stage: the gradient with ``aux_loss_coef`` / ``z_loss_coef`` equals autograd of
  ``CE + aux_coef * sum(aux) + z_coef * sum(z)`` over the MoE layers of the same stage built without
  coefficients (the losses reach the objective, with their coefficients, through the backward only).
* Preflight names the field of a wrong MoE / EP config.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from train_fixtures import make_dataset, write_config
from train_reference import assert_runs_match, capture_run, reference_run, relayout_run, with_parallel

from omni_parallel.testing import run_world
from omni_train.binder import load_config

pytestmark = pytest.mark.slow

MOE = "moe = { experts = 4, top_k = 2, shared_experts = 1, expert_ffn_dim = 24, aux_loss_coef = 0.1, z_loss_coef = 0.01 }"
LOAD_KEYS = ("moe_aux", "moe_z", "moe_tokens_routed", "moe_tokens_computed", "moe_tokens_per_expert")


@pytest.fixture(scope="module")
def moe_cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    data = make_dataset(tmp / "data")
    path = write_config(tmp / "c.toml", data, steps=3, extra='dtype = "float64"', model={"llm": MOE})
    return tmp, load_config(str(path))


def _runs(rank, world_size, cfg, root, runs):
    return [capture_run(with_parallel(cfg, **par), Path(root) / name) for name, par in runs]


RESUME_AT = 2  # the fixture's config checkpoints every 2 steps


def _ep2_then_resume_at_ep1(rank, world_size, cfg, root):
    """ep = 2 over dp = 2, then its step-2 checkpoint resumed at ep = 1 through the
    trainer's own ``--resume --resume-step``: the experts' Shard(0) DTensors and their AdamW moments
    loaded by omni-ckpt's box intersection into whole tensors."""
    ep2 = {"pp": 1, "dp": 2, "ep": 2}
    got, recomputed = _runs(rank, world_size, cfg, root, [("ep2", ep2)]) + _runs(
        rank, world_size, _recompute(cfg), root, [("ep2-recompute", ep2)]
    )
    saved = str(Path(root) / "ep2" / "checkpoints")
    resumed = relayout_run(with_parallel(cfg, pp=1, dp=2, ep=1), saved, Path(root) / "ep1", RESUME_AT)
    return got, resumed, recomputed


def _recompute(cfg):
    """``cfg`` with the LLM blocks recomputed in backward (the MoE all-to-alls run again there)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute=["llm"]))


@pytest.fixture(scope="module")
def ep2_world(moe_cfg):
    tmp, cfg = moe_cfg
    return run_world(_ep2_then_resume_at_ep1, 2, args=(cfg, str(tmp / "w2")), timeout_s=300)[0]


def _references(rank, world_size, cfg, root, dps):
    return {dp: reference_run(cfg, Path(root) / f"ref{dp}", dp) for dp in dps}


@pytest.fixture(scope="module")
def references(moe_cfg):
    """The one-process references of the dp = 2 and dp = 4 runs (one world)."""
    tmp, cfg = moe_cfg
    return run_world(_references, 1, args=(cfg, str(tmp / "w1"), (2, 4)), timeout_s=300)[0]


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_expert_parallel_trainer_matches_one_process(moe_cfg, references, ep2_world):
    tmp, cfg = moe_cfg
    assert cfg.model.llm.moe is not None and cfg.model.llm.moe.experts == 4
    assert_runs_match(ep2_world[0], references[2], "ep2")
    _check_metrics(cfg, tmp / "w2" / "ep2", tmp / "w1" / "ref2")
    # activation recompute of the LLM blocks: equal, and the recomputed forwards are not counted twice
    assert_runs_match(ep2_world[2], references[2], "ep2-recompute")
    _check_metrics(cfg, tmp / "w2" / "ep2-recompute", tmp / "w1" / "ref2")


def test_a_run_saved_at_ep2_resumes_at_ep1_as_uninterrupted(references, ep2_world):
    got = ep2_world[1]
    full = ep2_world[0]
    assert len(got[0]) == 3 - RESUME_AT
    assert_runs_match(got, (full[0][RESUME_AT:], full[1][RESUME_AT:]), "resume ep2 -> ep1")
    ref = references[2]
    assert_runs_match(got, (ref[0][RESUME_AT:], ref[1][RESUME_AT:]), "resume ep2 -> ep1 vs reference")


def test_expert_parallel_with_pipeline_and_expert_data_parallel_matches_one_process(moe_cfg, references):
    """ep = 2 x pp = 2 x dp = 2 with media (one MoE layer per stage), and ep = 2 x dp = 4 (two
    expert-data-parallel ranks per expert shard: expert gradients summed over them only), 4 processes."""
    tmp, cfg = moe_cfg
    runs = [("pp2-ep2", {"pp": 2, "dp": 2, "ep": 2}), ("dp4-ep2", {"pp": 1, "dp": 4, "ep": 2})]
    pp2, dp4 = run_world(_runs, 4, args=(cfg, str(tmp / "w4"), runs), timeout_s=400)[0]
    assert_runs_match(pp2, references[2], "pp2-ep2")
    assert_runs_match(dp4, references[4], "dp4-ep2")
    _check_metrics(cfg, tmp / "w4" / "pp2-ep2", tmp / "w1" / "ref2")
    _check_metrics(cfg, tmp / "w4" / "dp4-ep2", tmp / "w1" / "ref4")


def _check_metrics(cfg, run: Path, ref_run: Path) -> None:
    moe = cfg.model.llm.moe
    layers = sum(moe.is_moe_layer(i) for i in range(cfg.model.llm.n_layers))
    for row, ref in zip(_rows(run), _rows(ref_run), strict=True):
        # dropless: every routed (token, slot) row computed, top_k per token per MoE layer
        assert row["moe_tokens_routed"] == row["moe_tokens_computed"], row
        per_layer = row["moe_tokens_routed"] // layers
        assert per_layer * layers == row["moe_tokens_routed"] and per_layer % moe.top_k == 0
        assert sum(row["moe_tokens_per_expert"].values()) == row["moe_tokens_routed"]
        assert row["moe_tokens_per_expert"] == ref["moe_tokens_per_expert"]
        assert row["moe_tokens_routed"] == ref["moe_tokens_routed"]
        for key in ("moe_aux", "moe_z"):
            assert abs(row[key] - ref[key]) <= 1e-10, (key, row[key], ref[key])
        loads = row["moe_load_max_over_mean"]
        assert set(loads) == {f"L{i}" for i in range(cfg.model.llm.n_layers) if moe.is_moe_layer(i)}
        assert all(v >= 1.0 for v in loads.values())


def test_aux_and_z_losses_reach_the_objective_with_their_coefficients(moe_cfg):
    from omni_train.models.llm import LLMStage, MoEFeedForward

    _, cfg = moe_cfg
    llm = dataclasses.replace(cfg.model.llm, vocab_size=50)
    moe = llm.moe
    bare = dataclasses.replace(llm, moe=dataclasses.replace(moe, aux_loss_coef=0.0, z_loss_coef=0.0))
    t = 24
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (t,), generator=gen)
    labels = torch.randint(0, 50, (t,), generator=gen)
    pos = torch.cat([torch.arange(10), torch.arange(14)])
    cu = torch.tensor([0, 10, 24])
    grads = []
    for c, with_losses in ((llm, False), (bare, True)):
        stage = LLMStage(c, seed=3).double()
        losses = []
        for m in stage.modules():
            if isinstance(m, MoEFeedForward):
                m.moe.register_forward_hook(
                    lambda mod, args, out, losses=losses: losses.append((out.aux, out.z))
                )
        loss = F.cross_entropy(stage(ids, pos, cu), labels)
        if with_losses:
            assert len(losses) == sum(moe.is_moe_layer(i) for i in range(llm.n_layers)) > 0
            loss = loss + sum(moe.aux_loss_coef * a + moe.z_loss_coef * z for a, z in losses)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in stage.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-12, rtol=0, msg=n)
    assert any("router" in n for n in grads[0])


def test_moe_preflight_names_the_field(moe_cfg):
    from omni_train.config import ConfigError
    from omni_train.preflight import validate

    _, cfg = moe_cfg
    with pytest.raises(ConfigError, match=r"^model\.llm\.moe\.experts: 4 is not divisible by parallel\.ep 3"):
        validate(with_parallel(cfg, pp=1, dp=6, ep=3), 6)
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 2 must divide parallel\.dp 1"):
        validate(with_parallel(cfg, pp=2, dp=1, ep=2), 2)
    no_moe = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, llm=dataclasses.replace(cfg.model.llm, moe=None))
    )
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 2 needs model\.llm\.moe"):
        validate(with_parallel(no_moe, pp=1, dp=2, ep=2), 2)
    with pytest.raises(ConfigError, match=r"^parallel\.llm_zero: 3 with parallel\.ep 2"):
        validate(with_parallel(cfg, pp=1, dp=2, ep=2, llm_zero=3), 2)
    validate(with_parallel(cfg, pp=1, dp=2, ep=2), 2)


def test_a_recomputed_forward_is_not_counted_twice(moe_cfg):
    """Recompute (``train.recompute``) re-runs an MoE layer's forward inside the backward; its load
    statistics count once. Early stop is off, so the recompute runs each forward to its end (with it on,
    torch stops the recompute at the layer's last saved tensor, before any statistics)."""
    from omni_parallel.parallelize import apply_ac
    from omni_train.models.llm import LLMStage, MoEFeedForward

    _, cfg = moe_cfg
    llm = dataclasses.replace(cfg.model.llm, vocab_size=50)
    ids, pos, cu = torch.randint(0, 50, (12,)), torch.arange(12), torch.tensor([0, 12])
    counted = {}
    for recompute in (False, True):
        stage = LLMStage(llm, seed=3).double()
        if recompute:
            apply_ac(list(stage.layers.values()))
        runs = []
        for m in stage.modules():
            if isinstance(m, MoEFeedForward):
                m.moe.register_forward_hook(lambda mod, args, out, runs=runs: runs.append(1))
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            stage(ids, pos, cu).sum().backward()
        counted[recompute] = [len(m.stats) for m in stage.modules() if isinstance(m, MoEFeedForward)]
        assert len(runs) == len(counted[recompute]) * (2 if recompute else 1)  # the recompute ran
    assert counted[True] == counted[False] == [1] * len(counted[False])
