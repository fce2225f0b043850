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
  FSDP2): llm_zero = 1 at dp = 2 (2 processes; one holder per EP shard) and llm_zero = 1 and 3 at dp = 4
  (4 processes, two expert-data-parallel ranks per shard, over which the experts are sharded at the same
  ZeRO stage), each in the world of the runs above: equal to one process likewise, their measured per-rank
  LLM state bytes equal ``omni-train memory``'s plan, and the experts' bytes measured from the storages are
  ``1/(ep x edp)`` of the parameters and AdamW moments (half those of the dp = 4 ZeRO-0 run), the gradients
  the EP shard's at ZeRO-1 and ``1/(ep x edp)`` at ZeRO-3.
* A run saved at ep = 2 resumes at ep = 1 (2 processes) and at ep = 4 (4 processes, dp = 4, from the
  llm_zero = 3 run's expert-data-parallel shards) as uninterrupted.
  Every run here has ``bias_update_rate`` set (the routers' selection-only expert bias, DeepSeek-V3's
  auxiliary-loss-free balancing, moved after every step): the resumes also restore that bias from the
  checkpoint (without it the resumed step routes otherwise).
* Extreme routings, forced through the expert bias (ep = 2, 2 processes): a step where experts 2 and 3
  (all of EP rank 1's) receive no token from any rank, and one where every token of every rank goes to
  expert 3; equal to one process, dropless, and the bias of every step the same on every rank and equal to
  the update rule written out over the global loads (loads injected per rank make a rank-local update
  differ).
* EP carved out of DP x CP (``ParallelConfig.ep_split``): ep = 2 over the two CP ranks (dp = 1, 2
  processes; plain CP and hybrid DP/CP, whose steps hold samples whole on one rank and CP-sharded ones)
  with a per-token objective (no aux / z loss or bias), and ep = 4 over dp = 2 x cp = 2 with ``llm_zero = 1``
  (4 processes) with aux + z losses and the bias of whole packs (reduced over each CP group; more under
  CP / Ulysses / hybrid DP/CP in ``test_train_moe_cp.py``), equal to one process; the per-rank state
  bytes equal ``omni-train memory``'s plan.
* Preflight names the field of a wrong MoE / EP config (also ``every_n_layers`` beyond the layers, ``ep``
  not carved out of DP x CP, EP over Ulysses ranks).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_fixtures import make_dataset, side_by_side, write_config
from train_reference import assert_runs_match, capture_run, reference_run, relayout_run, with_parallel

from omni_parallel.testing import run_world
from omni_train.binder import load_config

pytestmark = pytest.mark.slow

RATE = 0.01  # moe.bias_update_rate: every run below moves the routers' expert bias after each step
MOE = (
    "moe = { experts = 4, top_k = 2, shared_experts = 1, expert_ffn_dim = 24, aux_loss_coef = 0.1, "
    f"z_loss_coef = 0.01, bias_update_rate = {RATE} }}"
)
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
ZERO1_EDP = {"pp": 1, "dp": 4, "ep": 2, "llm_zero": 1}  # the experts' ZeRO-1 over their 2 edp ranks


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
    seen: list = []
    forced = capture_run(with_parallel(cfg, **ep2), Path(root) / "ep2-forced", on_inputs=_force(seen))
    (cp2,) = _runs(rank, world_size, _per_token(cfg), root, [("ep2-cp2", EP_CP)])
    cps: set[int] = set()

    def sharded(trainer, step, inputs) -> None:  # the CP sizes the hybrid plans gave the step's samples
        cps.update(s.cp for slots, _ in trainer.sharding._cache.values() for s in slots)

    hybrid = with_parallel(
        _per_token(cfg), **EP_CP, hybrid_cp=True, data_max_seq_len=cfg.data.max_seq_len // 2
    )
    hybrid_run = capture_run(hybrid, Path(root) / "ep2-hybrid-cp2", on_inputs=sharded)
    return got, resumed, recomputed, zero1, (forced, seen), cp2, (hybrid_run, sorted(cps))


EP_CP = {"pp": 1, "dp": 1, "cp": 2, "ep": 2}  # EP carved out of CP: the two CP ranks are the EP group
# EP over both DP ranks x both CP ranks (ep_split (2, 2)), the non-experts under LLM ZeRO-1
EP_DP_CP = {"pp": 1, "dp": 2, "cp": 2, "ep": 4, "llm_zero": 1}


def _per_token(cfg):
    """``cfg`` with the MoE objective per token (no aux / z loss, no expert bias): the routing, dispatch
    and expert compute alone (the pack-wide aux / z losses and loads under CP: ``test_train_moe_cp.py``)."""
    llm = cfg.model.llm
    moe = dataclasses.replace(llm.moe, aux_loss_coef=0.0, z_loss_coef=0.0, bias_update_rate=None)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, llm=dataclasses.replace(llm, moe=moe))
    )


# the routers' expert bias set by hand after the backward of step s (so from step s + 1 on), before
# that step's update: +2 on experts 0 and 1 (EP rank 0's), then +2 on expert 3 alone
FORCED = {0: [2.0, 2.0, 0.0, 0.0], 1: [0.0, 0.0, 0.0, 2.0]}
# loads added to each rank's own before step 1's update (rank 0 on expert 0, rank 1 on expert 3; one
# process: both), so that a rank updating on its own loads alone would move its bias otherwise
INJECT = {1: [[1000, 0, 0, 0], [0, 0, 0, 1000]]}


def _injected(step: int, rank: int, world: int) -> list[int]:
    if step not in INJECT:
        return [0, 0, 0, 0]
    rows = INJECT[step] if world > 1 else [[sum(c) for c in zip(*INJECT[step])]]
    return rows[rank]


def _force(seen: list):
    """``on_inputs``: record every rank's router biases (those the step's forward used) and its own loads
    of the step (the counts the update will sum over the ranks), then set :data:`FORCED`'s bias for the
    next step."""

    def on_inputs(trainer, step, inputs) -> None:
        from omni_parallel.moe import moe_layers

        layers = moe_layers([trainer.stage])
        everyone: list = [None] * dist.get_world_size()
        mine = [(m.router.expert_bias.tolist(), m.pending_load.tolist()) for m in layers]
        dist.all_gather_object(everyone, mine)
        seen.append(everyone)
        extra = torch.tensor(_injected(step, dist.get_rank(), dist.get_world_size()))
        for m in layers:
            m.pending_load = m.pending_load + extra
        for m in layers if step in FORCED else ():
            for e, v in enumerate(FORCED[step]):
                m.router.expert_bias[e] = v

    return on_inputs


def _recompute(cfg):
    """``cfg`` with the LLM blocks recomputed in backward (the MoE all-to-alls run again there)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute=["llm"]))


@pytest.fixture(scope="module")
def worlds(moe_cfg):
    """The 2-process world of :func:`_ep2_then_resume_at_ep1` and the one-process world of
    :func:`_references`, side by side (other run folders): the reference runs on the core the 2 ranks
    leave idle."""
    tmp, cfg = moe_cfg
    return side_by_side(
        lambda: run_world(_ep2_then_resume_at_ep1, 2, args=(cfg, str(tmp / "w2")), timeout_s=300)[0],
        lambda: run_world(_references, 1, args=(cfg, str(tmp / "w1"), (2, 4)), timeout_s=300)[0],
    )


@pytest.fixture(scope="module")
def ep2_world(worlds):
    return worlds[0]


def _capacity(cfg, factor: float = 0.5):
    """``cfg`` with an expert capacity (rows beyond it dropped), one step."""
    llm = cfg.model.llm
    moe = dataclasses.replace(llm.moe, capacity_factor=factor)
    model = dataclasses.replace(cfg.model, llm=dataclasses.replace(llm, moe=moe))
    return dataclasses.replace(cfg, model=model, train=dataclasses.replace(cfg.train, steps=1))


def _references(rank, world_size, cfg, root, dps):
    from omni_train.models.llm import MoEFeedForward

    refs = {dp: reference_run(cfg, Path(root) / f"ref{dp}", dp) for dp in dps}
    seen: list = []
    refs["forced"] = (reference_run(cfg, Path(root) / "ref-forced", 2, on_inputs=_force(seen)), seen)
    refs["per_token"] = reference_run(_per_token(cfg), Path(root) / "ref-per-token", 1)
    scales: list[float] = []

    def on_inputs(trainer, step, inputs) -> None:
        scales.extend(m.moe.loss_scale for m in trainer.stage.modules() if isinstance(m, MoEFeedForward))

    capture_run(with_parallel(_capacity(cfg), pp=1, dp=1), Path(root) / "capacity", on_inputs=on_inputs)
    return refs, scales


@pytest.fixture(scope="module")
def references(worlds):
    """The one-process references of the dp = 2 and dp = 4 runs (one world), and the loss scales of the
    one-process capacity run (one world with them)."""
    refs, scales = worlds[1]
    return {**refs, "capacity_scales": scales}


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


def test_forced_routings_and_the_expert_bias_update_match_one_process(moe_cfg, references, ep2_world):
    """ep = 2 (dp = 2) with the routing forced through the routers' selection-only expert bias
    (:data:`FORCED`, set on every rank and in the reference): step 1 routes every token of every rank to
    experts 0 and 1 (EP rank 0's), so experts 2 and 3 receive no token and EP rank 1's experts compute no
    row; step 2 routes every token of every rank to expert 3. Losses and every gradient equal one process
    (<= 1e-10), the metrics show those loads, the run is dropless, and the bias each step's forward used
    (moved after every step by ``bias_update_rate``) is the same on both ranks and in the reference and
    equals the rule ``b += rate * sign(mean load - load_e)`` written out over the metrics' global loads."""
    tmp, cfg = moe_cfg
    moe = cfg.model.llm.moe
    layers = [i for i in range(cfg.model.llm.n_layers) if moe.is_moe_layer(i)]
    (got, seen), (ref, ref_seen) = ep2_world[4], references["forced"]
    assert_runs_match(got, ref, "ep2 forced routing")
    _check_metrics(cfg, tmp / "w2" / "ep2-forced", tmp / "w1" / "ref-forced")
    rows = _rows(tmp / "w2" / "ep2-forced")
    for step, row in enumerate(rows):
        tokens, per = int(row["tokens"]), row["moe_tokens_per_expert"]
        for i in layers:
            load = [per[f"L{i}/e{e}"] for e in range(moe.experts)]
            if step == 1:
                assert load == [tokens, tokens, 0, 0], (step, i, load)
            if step == 2:
                assert load[3] == tokens and sum(load) == 2 * tokens, (step, i, load)

    def rule(bias: list[float], load: list[int]) -> list[float]:
        mean = sum(load) / len(load)
        return [b + RATE * ((mean > v) - (mean < v)) for b, v in zip(bias, load)]

    want = [[0.0] * moe.experts for _ in layers]
    local_rule_differs = False
    for step, (everyone, (ref_layers,)) in enumerate(zip(seen, ref_seen, strict=True)):
        biases = [[b for b, _ in rank_layers] for rank_layers in everyone]
        assert biases[0] == biases[1] == [b for b, _ in ref_layers] == want, (step, biases, ref_layers, want)
        per = rows[step]["moe_tokens_per_expert"]
        for j, i in enumerate(layers):
            load = [per[f"L{i}/e{e}"] for e in range(moe.experts)]
            # the loads the update sums: each rank's own, adding up to the step's global loads
            assert [sum(v) for v in zip(*(r[j][1] for r in everyone))] == load == ref_layers[j][1]
            base = FORCED.get(step, want[j])
            extra = _injected(step, 0, 1)
            want[j] = rule(base, [v + x for v, x in zip(load, extra)])
            local = [[v + x for v, x in zip(r[j][1], _injected(step, k, 2))] for k, r in enumerate(everyone)]
            local_rule_differs |= any(rule(base, v) != want[j] for v in local)
    assert seen[1][0][0][0] != FORCED[0]  # step 0's update moved the bias set by hand
    assert local_rule_differs  # a rank updating on its own loads alone would have drifted apart


def test_expert_parallel_carved_out_of_context_parallel_matches_one_process(moe_cfg, references, ep2_world):
    """ep = 2 over the two CP ranks of a stage (dp = 1, cp = 2: ``ParallelConfig.ep_split`` = (1, 2)),
    each rank holding half of every pack and half of the experts: losses and every gradient equal one
    process training the packs whole (<= 1e-10; per-token objective, :func:`_per_token`), and dropless
    (the experts computed every routed row); its state bytes as planned. The same two ranks under hybrid
    DP/CP (packs of 2 x ``max_seq_len / 2``) likewise."""
    tmp, cfg = moe_cfg
    assert_runs_match(ep2_world[5], references["per_token"], "ep2 x cp2")
    _check_dropless(tmp / "w2" / "ep2-cp2")
    _check_plan(_per_token(cfg), tmp / "w2" / "ep2-cp2", EP_CP, 2)
    # hybrid DP/CP over the same two ranks (packs of 2 x max_seq_len / 2 tokens): short samples whole on
    # one rank, long ones CP-sharded, the EP all-to-alls between them; equal to one process likewise
    hybrid, cps = ep2_world[6]
    assert cps == [1, 2], cps
    assert_runs_match(hybrid, references["per_token"], "ep2 x hybrid cp2")
    _check_dropless(tmp / "w2" / "ep2-hybrid-cp2")


def _check_dropless(run: Path) -> None:
    """Every step: the experts computed every routed (token, slot) row (CP padding rows are routed
    nowhere)."""
    for row in _rows(run):
        assert row["moe_tokens_computed"] == row["moe_tokens_routed"] > 0 and row["moe_tokens_dropped"] == 0
        assert sum(row["moe_tokens_per_expert"].values()) == row["moe_tokens_routed"]


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


def _expert_bytes(seen: dict):
    """``on_inputs``: after step 1 (AdamW's state exists from step 0), this rank's routed experts' bytes
    measured from the tensor storages (parameters, gradients, AdamW ``exp_avg`` + ``exp_avg_sq``), the
    experts' global elements and their parameters' placements."""

    def on_inputs(trainer, step, inputs) -> None:
        from omni_parallel.memory import storage_bytes
        from omni_parallel.moe import expert_parameters

        if step != 1:
            return
        params = expert_parameters([trainer.stage])
        state = [trainer.optimizer.state[p] for p in params]
        seen.update(
            parameters=storage_bytes(params),
            gradients=storage_bytes(p.grad for p in params),
            moments=storage_bytes(st[k] for st in state for k in ("exp_avg", "exp_avg_sq")),
            elements=sum(p.numel() for p in params),
            placements=sorted({str(tuple(p.placements)) for p in params}),
        )

    return on_inputs


def _runs_then_resume_at_ep4(rank, world_size, cfg, root, runs):
    """The 4-process runs (each rank's experts' bytes measured, :func:`_expert_bytes`), then
    ``dp4-ep2-zero3``'s step-2 checkpoint (experts sharded over their 2 expert-data-parallel ranks: boxes
    of half an EP shard) resumed at ep = 4 (dp = 4, llm_zero = 0): each rank loads one expert of those
    boxes, and its AdamW moments."""
    got, sizes = [], []
    for name, par in runs:
        seen: dict = {}
        got.append(capture_run(with_parallel(cfg, **par), Path(root) / name, on_inputs=_expert_bytes(seen)))
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, seen)
        sizes.append(everyone)
    saved = str(Path(root) / "dp4-ep2-zero3" / "checkpoints")
    resumed = relayout_run(with_parallel(cfg, pp=1, dp=4, ep=4), saved, Path(root) / "dp4-ep4", RESUME_AT)
    # and the other way: dp4-ep2's whole EP shards loaded into expert-data-parallel shards (llm_zero = 1)
    plain = str(Path(root) / "dp4-ep2" / "checkpoints")
    into_edp = relayout_run(
        with_parallel(cfg, **ZERO1_EDP), plain, Path(root) / "dp4-ep2-to-zero1", RESUME_AT
    )
    (mixed,) = _runs(rank, world_size, cfg, root, [("dp2-cp2-ep4", EP_DP_CP)])
    return [*got, (resumed, into_edp), mixed, sizes]


def test_expert_parallel_with_pipeline_and_expert_data_parallel_matches_one_process(moe_cfg, references):
    """ep = 2 x pp = 2 x dp = 2 with media (one MoE layer per stage), ep = 2 x dp = 4 (two
    expert-data-parallel ranks per expert shard: expert gradients summed over them only), the latter
    with ``llm_zero = 3`` and ``1`` (the non-expert parameters FSDP2-sharded over the 4 ranks, the experts
    outside FSDP2 sharded over their 2 expert-data-parallel ranks at the same stage), 4 processes. The
    per-rank state bytes those runs measured (``metrics.jsonl``) equal ``omni-train memory``'s plan of the
    layout, and the experts' own bytes are as :func:`_check_expert_bytes` says. Then
    ``dp4-ep2-zero3``'s step-2 checkpoint resumed at ep = 4, and ``dp4-ep2``'s (ZeRO-0) resumed with
    ``llm_zero = 1`` (into expert-data-parallel shards), continue as ``dp4-ep2`` uninterrupted. Last, ep = 4 over
    dp = 2 x cp = 2 with ``llm_zero = 1`` (EP carved out of DP x CP; aux + z losses and the expert bias
    of whole packs, reduced over each CP group) equal to one process, with its metrics and state bytes as
    the reference's and the plan."""
    tmp, cfg = moe_cfg
    runs = [("pp2-ep2", {"pp": 2, "dp": 2, "ep": 2}), ("dp4-ep2", {"pp": 1, "dp": 4, "ep": 2}),
            ("dp4-ep2-zero3", ZERO3), ("dp4-ep2-zero1", ZERO1_EDP)]  # fmt: skip
    pp2, dp4, zero3, zero1, (ep4, into_edp), mixed, sizes = run_world(
        _runs_then_resume_at_ep4, 4, args=(cfg, str(tmp / "w4"), runs), timeout_s=400)[0]  # fmt: skip
    assert_runs_match(pp2, references[2], "pp2-ep2")
    assert_runs_match(dp4, references[4], "dp4-ep2")
    assert_runs_match(zero3, references[4], "dp4-ep2-zero3")
    assert_runs_match(zero1, references[4], "dp4-ep2-zero1")
    _check_metrics(cfg, tmp / "w4" / "pp2-ep2", tmp / "w1" / "ref2")
    _check_metrics(cfg, tmp / "w4" / "dp4-ep2", tmp / "w1" / "ref4")
    _check_metrics(cfg, tmp / "w4" / "dp4-ep2-zero3", tmp / "w1" / "ref4")
    _check_plan(cfg, tmp / "w4" / "dp4-ep2-zero3", ZERO3, 4)
    _check_plan(cfg, tmp / "w4" / "dp4-ep2-zero1", ZERO1_EDP, 4)
    _check_expert_bytes(dict(zip([name for name, _ in runs], sizes, strict=True)))
    assert len(ep4[0]) == 3 - RESUME_AT
    assert_runs_match(ep4, (dp4[0][RESUME_AT:], dp4[1][RESUME_AT:]), "resume ep2 -> ep4")
    assert_runs_match(into_edp, (dp4[0][RESUME_AT:], dp4[1][RESUME_AT:]), "resume ep2 -> ep2 edp-sharded")
    ref = references[4]
    assert_runs_match(ep4, (ref[0][RESUME_AT:], ref[1][RESUME_AT:]), "resume ep2 -> ep4 vs reference")
    # EP carved out of DP x CP: ep = 4 over dp = 2 x cp = 2 with llm_zero = 1, aux + z + bias per pack
    assert_runs_match(mixed, references[2], "dp2 x cp2 x ep4")
    _check_metrics(cfg, tmp / "w4" / "dp2-cp2-ep4", tmp / "w1" / "ref2")
    _check_plan(cfg, tmp / "w4" / "dp2-cp2-ep4", EP_DP_CP, 4)


def _check_expert_bytes(sizes: dict) -> None:
    """The routed experts' bytes every rank measured (float64, ``X`` expert elements in all): ``1/ep`` of
    them at ZeRO-0 (dp = 4, ep = 2: the EP shard, whole on both of its expert-data-parallel ranks), ``1/4``
    (``1/(ep x edp)``) of the parameters and AdamW moments at ``llm_zero`` 1 and 3, the gradients the
    whole EP shard's at ZeRO-1 (summed whole, the shard's gradient a view) and ``1/4`` at ZeRO-3."""
    from omni_parallel.memory import analytic_state_bytes

    x = sizes["dp4-ep2"][0]["elements"]
    want = {  # run: (ZeRO stage, (parameters, gradients, moments) in elements per rank)
        "dp4-ep2": (0, (x / 2, x / 2, x)),
        "dp4-ep2-zero1": (1, (x / 4, x / 2, x / 2)),
        "dp4-ep2-zero3": (3, (x / 4, x / 4, x / 2)),
    }
    for run, (zero, (params, grads, moments)) in want.items():
        formula = analytic_state_bytes(0, bytes_per=8, zero=zero, shards=4, experts=x, ep=2, expert_shards=2)
        assert (formula["parameters"], formula["gradients"], formula["optimizer"]) == (
            8 * params, 8 * grads, 8 * moments)  # fmt: skip
        for rank, got in enumerate(sizes[run]):
            assert got["elements"] == x > 0, (run, rank, got)
            measured = (got["parameters"], got["gradients"], got["moments"])
            assert measured == (8 * params, 8 * grads, 8 * moments), (run, rank, measured)
    assert sizes["dp4-ep2"][0]["placements"] == ["(Shard(dim=0),)"]
    assert sizes["dp4-ep2-zero3"][0]["placements"] == ["(Shard(dim=0), Shard(dim=0))"]


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
    validate(with_parallel(cfg, pp=1, dp=1, cp=2, ep=2), 2)  # the expert bias under CP (test_train_moe_cp)
    per_token = _per_token(cfg)  # no aux / z loss, no bias
    validate(with_parallel(per_token, pp=1, dp=1, cp=2, ep=2), 2)  # EP carved out of CP
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 4 must divide parallel\.dp 1, or ep / gcd\(ep, dp\) = 4 "
                       r"must divide parallel\.cp 2 x parallel\.ulysses 1"):  # fmt: skip
        validate(with_parallel(per_token, pp=1, dp=1, cp=2, ep=4), 2)
    with pytest.raises(ConfigError, match=r"^parallel\.ep: 2 beyond parallel\.dp 1 .* parallel\.ulysses 2"):
        validate(with_parallel(per_token, pp=1, dp=1, cp=1, ulysses=2, ep=2), 2)
    validate(with_parallel(per_token, pp=1, dp=1, cp=2, ep=2, hybrid_cp=True), 2)
    for zero in (1, 2, 3):  # EP composes with LLM ZeRO (the experts stay out of FSDP2)
        validate(with_parallel(cfg, pp=1, dp=2, ep=2, llm_zero=zero), 2)
    # 5 expert-data-parallel ranks per EP shard (dp 10 / ep 2) divide no dim of gate_up_proj [2, 48, 32]
    validate(with_parallel(cfg, pp=1, dp=10, ep=2), 10)  # ZeRO-0: the EP shards are not split further
    validate(with_parallel(cfg, pp=1, dp=6, ep=2, llm_zero=2), 6)  # 3 divides 48: split along it
    with pytest.raises(ConfigError, match=r"^parallel\.llm_zero: 1 shards each expert shard over its 5 .*"
                       r"gate_up_proj \(2, 48, 32\)"):  # fmt: skip
        validate(with_parallel(cfg, pp=1, dp=10, ep=2, llm_zero=1), 10)


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
