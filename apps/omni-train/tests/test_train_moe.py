"""Mixture-of-experts LLM (``[model.llm] moe``) and expert parallelism (``parallel.ep``) in the trainer.

* ep = 2 on 2 gloo processes (dp = 2, pp = 1, media: image + audio + text; also with the LLM blocks
  recomputed in backward), float64, 3 steps: losses and
  every gradient (the experts' ``Shard(0)`` DTensor gradients made whole) equal the one-process
  reference over the same packs (``train_reference``, <= 1e-10), so dispatch/combine, the expert sum
  over the expert-data-parallel ranks only (none here: ep = dp) and the aux + z losses attached to the
  objective compose as one process. The per-step MoE metrics in ``metrics.jsonl`` (aux, z, tokens per
  expert per layer, max/mean load) equal the reference's, the (token, slot) rows routed before any
  capacity equal the step's ``tokens`` metric x top_k x MoE layers, and the run is dropless: the experts
  computed every routed row. With a capacity (one process, one step) rows are dropped and counted:
  ``moe_tokens_dropped = routed - computed > 0``.
* The aux / z terms of the objective are ``coef x`` their mean over the step's packs and MoE layers (the
  trainer's :func:`~omni_train.models.llm.set_moe_loss_scale`): autograd of ``CE + coef x mean`` on a
  stage built without coefficients, and the same gradient at dp = 1 and dp = 2 over the same packs per
  replica (a mean does not grow with the DP size); the trainer sets that scale.
* One process, one LLM stage: the gradient with ``aux_loss_coef`` / ``z_loss_coef`` equals autograd of
  ``CE + aux_coef * sum(aux) + z_coef * sum(z)`` over the MoE layers of the same stage built without
  coefficients (the losses reach the objective, with their coefficients, through the backward only).
* ``parallel.llm_zero`` beside ep = 2 (the non-expert parameters FSDP2-sharded, the experts EP shards outside
  FSDP2): llm_zero = 1 at dp = 2 (2 processes) and llm_zero = 3 at dp = 4 (4 processes, two
  expert-data-parallel ranks per shard), each in the world of the runs above: equal to one process likewise,
  and their measured per-rank LLM state bytes equal ``omni-train memory``'s plan.
* A run saved at ep = 2 resumes at ep = 1 (2 processes) and at ep = 4 (4 processes, dp = 4) as uninterrupted.
* Preflight names the field of a wrong MoE / EP config (also ``every_n_layers`` beyond the layers).
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
ZERO1 = {"pp": 1, "dp": 2, "ep": 2, "llm_zero": 1}
ZERO3 = {"pp": 1, "dp": 4, "ep": 2, "llm_zero": 3}


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
    (zero1,) = _runs(rank, world_size, cfg, root, [("ep2-zero1", ZERO1)])
    return got, resumed, recomputed, zero1


def _recompute(cfg):
    """``cfg`` with the LLM blocks recomputed in backward (the MoE all-to-alls run again there)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute=["llm"]))


@pytest.fixture(scope="module")
def ep2_world(moe_cfg):
    tmp, cfg = moe_cfg
    return run_world(_ep2_then_resume_at_ep1, 2, args=(cfg, str(tmp / "w2")), timeout_s=300)[0]


def _capacity(cfg, factor: float = 0.5):
    """``cfg`` with an expert capacity (rows beyond it dropped), one step."""
    llm = cfg.model.llm
    moe = dataclasses.replace(llm.moe, capacity_factor=factor)
    model = dataclasses.replace(cfg.model, llm=dataclasses.replace(llm, moe=moe))
    return dataclasses.replace(cfg, model=model, train=dataclasses.replace(cfg.train, steps=1))


def _references(rank, world_size, cfg, root, dps):
    from omni_train.models.llm import MoEFeedForward

    refs = {dp: reference_run(cfg, Path(root) / f"ref{dp}", dp) for dp in dps}
    scales: list[float] = []

    def on_inputs(trainer, step, inputs) -> None:
        scales.extend(m.moe.loss_scale for m in trainer.stage.modules() if isinstance(m, MoEFeedForward))

    capture_run(with_parallel(_capacity(cfg), pp=1, dp=1), Path(root) / "capacity", on_inputs=on_inputs)
    return refs, scales


@pytest.fixture(scope="module")
def references(moe_cfg):
    """The one-process references of the dp = 2 and dp = 4 runs (one world), and the loss scales of the
    one-process capacity run (one world with them)."""
    tmp, cfg = moe_cfg
    refs, scales = run_world(_references, 1, args=(cfg, str(tmp / "w1"), (2, 4)), timeout_s=300)[0]
    refs["capacity_scales"] = scales
    return refs


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
    # llm_zero = 1 beside ep = 2: equal, and the plan counts the experts' gradients as their EP shards
    # (only the FSDP2 units' gradients are whole under ZeRO-1)
    assert_runs_match(ep2_world[3], references[2], "ep2-zero1")
    _check_plan(cfg, tmp / "w2" / "ep2-zero1", ZERO1, 2)


def test_a_run_saved_at_ep2_resumes_at_ep1_as_uninterrupted(references, ep2_world):
    got = ep2_world[1]
    full = ep2_world[0]
    assert len(got[0]) == 3 - RESUME_AT
    assert_runs_match(got, (full[0][RESUME_AT:], full[1][RESUME_AT:]), "resume ep2 -> ep1")
    ref = references[2]
    assert_runs_match(got, (ref[0][RESUME_AT:], ref[1][RESUME_AT:]), "resume ep2 -> ep1 vs reference")


def test_capacity_drops_are_counted_and_the_trainer_scales_the_aux_losses(moe_cfg, references):
    """One process, one step with ``capacity_factor = 0.5``: routed counts every (token, slot) row before the
    drops, computed the rows kept, dropped the difference (> 0). The trainer set every MoE layer's loss
    scale to ``1 / (packs x MoE layers)``."""
    tmp, cfg = moe_cfg
    moe = cfg.model.llm.moe
    layers = sum(moe.is_moe_layer(i) for i in range(cfg.model.llm.n_layers))
    (row,) = _rows(tmp / "w1" / "capacity")
    assert row["moe_tokens_routed"] == int(row["tokens"]) * moe.top_k * layers, row
    assert row["moe_tokens_dropped"] == row["moe_tokens_routed"] - row["moe_tokens_computed"] > 0, row
    assert sum(row["moe_tokens_per_expert"].values()) == row["moe_tokens_routed"]
    assert references["capacity_scales"] == [1.0 / (cfg.data.microbatches * layers)] * layers


def _runs_then_resume_at_ep4(rank, world_size, cfg, root, runs):
    """The 4-process runs, then ``dp4-ep2``'s step-2 checkpoint resumed at ep = 4 (dp = 4): each rank
    loads one expert of the 2-expert Shard(0) boxes, and its AdamW moments."""
    got = _runs(rank, world_size, cfg, root, runs)
    saved = str(Path(root) / "dp4-ep2" / "checkpoints")
    resumed = relayout_run(with_parallel(cfg, pp=1, dp=4, ep=4), saved, Path(root) / "dp4-ep4", RESUME_AT)
    return [*got, resumed]


def test_expert_parallel_with_pipeline_and_expert_data_parallel_matches_one_process(moe_cfg, references):
    """ep = 2 x pp = 2 x dp = 2 with media (one MoE layer per stage), ep = 2 x dp = 4 (two
    expert-data-parallel ranks per expert shard: expert gradients summed over them only), and the same
    with ``llm_zero = 3`` (the non-expert parameters FSDP2-sharded over the 4 ranks, the experts EP shards
    outside FSDP2, summed over their 2 expert-data-parallel ranks), 4 processes. The per-rank state bytes
    the last run measured (``metrics.jsonl``) equal ``omni-train memory``'s plan of the layout. Then
    ``dp4-ep2``'s step-2 checkpoint resumed at ep = 4 continues as uninterrupted."""
    tmp, cfg = moe_cfg
    runs = [("pp2-ep2", {"pp": 2, "dp": 2, "ep": 2}), ("dp4-ep2", {"pp": 1, "dp": 4, "ep": 2}),
            ("dp4-ep2-zero3", ZERO3)]  # fmt: skip
    pp2, dp4, zero3, ep4 = run_world(_runs_then_resume_at_ep4, 4, args=(cfg, str(tmp / "w4"), runs),
                                     timeout_s=400)[0]  # fmt: skip
    assert_runs_match(pp2, references[2], "pp2-ep2")
    assert_runs_match(dp4, references[4], "dp4-ep2")
    assert_runs_match(zero3, references[4], "dp4-ep2-zero3")
    _check_metrics(cfg, tmp / "w4" / "pp2-ep2", tmp / "w1" / "ref2")
    _check_metrics(cfg, tmp / "w4" / "dp4-ep2", tmp / "w1" / "ref4")
    _check_metrics(cfg, tmp / "w4" / "dp4-ep2-zero3", tmp / "w1" / "ref4")
    _check_plan(cfg, tmp / "w4" / "dp4-ep2-zero3", ZERO3, 4)
    assert len(ep4[0]) == 3 - RESUME_AT
    assert_runs_match(ep4, (dp4[0][RESUME_AT:], dp4[1][RESUME_AT:]), "resume ep2 -> ep4")
    ref = references[4]
    assert_runs_match(ep4, (ref[0][RESUME_AT:], ref[1][RESUME_AT:]), "resume ep2 -> ep4 vs reference")


def _check_plan(cfg, run: Path, par: dict, gpus: int) -> None:
    """The per-rank LLM state bytes ``run`` measured (``metrics.jsonl``) equal ``omni-train memory``'s plan."""
    from omni_parallel.memory import KINDS
    from omni_train.memory_plan import memory_plan

    row = _rows(run)[-1]["llm_state_bytes_per_rank"]
    for r in memory_plan(with_parallel(cfg, **par), gpus)["ranks"]:
        got = {k: row[k][r["rank"]] for k in KINDS}
        assert r["llm"] == got, f"{run.name} rank {r['rank']}: planned {r['llm']}, measured {got}"


def _check_metrics(cfg, run: Path, ref_run: Path) -> None:
    moe = cfg.model.llm.moe
    layers = sum(moe.is_moe_layer(i) for i in range(cfg.model.llm.n_layers))
    for row, ref in zip(_rows(run), _rows(ref_run), strict=True):
        # routed: every token's top_k slots in every MoE layer, against the step's own token count
        assert row["moe_tokens_routed"] == int(row["tokens"]) * moe.top_k * layers, row
        # dropless: every routed (token, slot) row computed
        assert row["moe_tokens_computed"] == row["moe_tokens_routed"] and row["moe_tokens_dropped"] == 0
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


def test_aux_losses_are_a_mean_over_packs_and_layers_whatever_the_dp_size(moe_cfg):
    """The objective's aux / z term is ``coef x`` their mean over the step's packs (forwards) and MoE
    layers, as cross-entropy is a mean over the step's targets: the gradient with the trainer's scale
    (:func:`set_moe_loss_scale` with ``moe_forwards_per_step``) equals autograd of
    ``CE_mean + sum_coef coef x mean_(pack, layer) loss`` on a stage built without coefficients, and dp = 2
    over the same 2 packs per replica (4 global packs) gives the dp = 1 gradient (the mean does not grow with
    the DP size, nor would a resume at another dp change it)."""
    from omni_train.models.llm import LLMStage, MoEFeedForward, moe_forwards_per_step, set_moe_loss_scale

    _, cfg = moe_cfg
    llm = dataclasses.replace(cfg.model.llm, vocab_size=50)
    moe = llm.moe
    layers = sum(moe.is_moe_layer(i) for i in range(llm.n_layers))
    bare = dataclasses.replace(llm, moe=dataclasses.replace(moe, aux_loss_coef=0.0, z_loss_coef=0.0))
    gen = torch.Generator().manual_seed(7)
    packs = []
    for t in (20, 12):
        ids, labels = torch.randint(0, 50, (t,), generator=gen), torch.randint(0, 50, (t,), generator=gen)
        packs.append((ids, torch.arange(t), torch.tensor([0, t]), labels))

    def grads(c, dp: int, microbatches: int) -> dict:
        stage = LLMStage(c, seed=3).double()
        forwards = moe_forwards_per_step(microbatches, world=dp, pp=1, tp=1)
        assert set_moe_loss_scale(stage, c, forwards) == 1.0 / (dp * microbatches * layers)
        losses = []
        for m in stage.modules():
            if isinstance(m, MoEFeedForward):
                m.moe.register_forward_hook(
                    lambda mod, a, out, losses=losses: losses.append((out.aux, out.z))
                )
        step = packs * dp  # every replica the same packs
        targets = sum(p[3].numel() for p in step)
        for ids, pos, cu, labels in step:  # one backward per pack, gradients summed (the DP sum)
            losses.clear()
            loss = F.cross_entropy(stage(ids, pos, cu), labels, reduction="sum") / targets
            if c is bare:  # the objective written out: coef x mean over the step's packs and layers
                loss = loss + sum(moe.aux_loss_coef * a + moe.z_loss_coef * z for a, z in losses) / (
                    len(step) * layers
                )
            loss.backward()
        return {n: p.grad.clone() for n, p in stage.named_parameters()}

    want, dp1, dp2 = grads(bare, 1, 2), grads(llm, 1, 2), grads(llm, 2, 2)
    for n in want:
        torch.testing.assert_close(dp1[n], want[n], atol=1e-12, rtol=0, msg=n)
        torch.testing.assert_close(dp2[n], dp1[n], atol=1e-12, rtol=0, msg=n)


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
    few = dataclasses.replace(cfg.model.llm.moe, every_n_layers=cfg.model.llm.n_layers + 1)
    few = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, llm=dataclasses.replace(cfg.model.llm, moe=few)))  # fmt: skip
    n = cfg.model.llm.n_layers
    with pytest.raises(
        ConfigError, match=rf"^model\.llm\.moe\.every_n_layers: {n + 1} > model\.llm\.n_layers {n}: no MoE"
    ):
        validate(with_parallel(few, pp=1, dp=2, ep=2), 2)
    with pytest.raises(ConfigError, match=r"^model\.llm\.moe: with parallel\.tp 2"):
        validate(with_parallel(cfg, pp=1, dp=2, tp=2, ep=2), 4)
    validate(with_parallel(cfg, pp=1, dp=2, ep=2), 2)
    for zero in (1, 2, 3):  # EP composes with LLM ZeRO (the experts stay out of FSDP2)
        validate(with_parallel(cfg, pp=1, dp=2, ep=2, llm_zero=zero), 2)


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
