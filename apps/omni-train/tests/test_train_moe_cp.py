"""MoE aux loss, z-loss and expert-bias loads under context parallelism, Ulysses and hybrid DP/CP equal one
process (issue 28).

A pack sharded over the ranks of a stage (CP: head-tail chunks of every document, padded to ``2 cp``;
Ulysses: contiguous chunks of the pack padded to a multiple of ``sp``; hybrid DP/CP: short samples whole on
one rank, long ones CP-sharded) holds padding rows, and each rank routes only its share of the pack. The MoE
layers (:class:`omni_parallel.moe.PackShard`) exclude the padding rows and sum the per-expert statistics
(token counts, router-probability sums, z-loss sums, token count) over the ranks sharing the pack, and each
rank backpropagates its own rows' share of the loss; the trainer counts a shared pack once in the losses'
normalisation (``moe_forwards_per_step(pack_ranks=...)``).

One world of 2 gloo processes, float64, 3 steps, ``aux_loss_coef``, ``z_loss_coef`` and
``bias_update_rate`` all set: cp = 2 with ep = 2 carved out of the CP ranks (and the LLM blocks
recomputed in backward, so the reduction runs again there; recomputed forwards count once), ulysses = 2,
and hybrid DP/CP over dp = 1 x cp = 2 (packs of 2 x ``max_seq_len / 2``; steps hold samples whole on one
rank and CP-sharded ones), each against one process training the same packs whole: losses and every
gradient (<= 1e-10), the per-step metrics ``moe_aux`` / ``moe_z`` (<= 1e-10), the tokens per expert and
the max / mean expert load (exact, so each token is counted once: routed = computed = the step's tokens x
top_k x MoE layers, no padding row), the router bias each step's forward used (<= 1e-12) and the loads
each step's bias update sums over the ranks (exact). The runs are checked to hold padding rows (CP:
always; Ulysses: some pack of odd length).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from test_train_moe import LOAD_KEYS, MOE, _recompute, _rows
from train_fixtures import make_dataset, side_by_side, write_config
from train_reference import assert_runs_match, capture_run, reference_run, with_parallel

from omni_parallel.testing import run_world
from omni_train.binder import load_config

pytestmark = pytest.mark.slow

LAYOUTS = {
    "cp2-ep2": {"pp": 1, "dp": 1, "cp": 2, "ep": 2},
    "ulysses2": {"pp": 1, "dp": 1, "ulysses": 2},
    "hybrid-cp2": {"pp": 1, "dp": 1, "cp": 2, "hybrid_cp": True},
}


@pytest.fixture(scope="module")
def moe_cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-cp")
    data = make_dataset(tmp / "data", n_image=8, n_audio=4, n_text=16)
    path = write_config(tmp / "c.toml", data, steps=3, extra='dtype = "float64"', model={"llm": MOE})
    return tmp, load_config(str(path))


def _layout(cfg, name: str):
    par = dict(LAYOUTS[name])
    if par.get("hybrid_cp"):  # the stage's two ranks share packs of 2 x max_seq_len / 2 tokens
        par["data_max_seq_len"] = cfg.data.max_seq_len // 2
    if par.get("ep", 1) > 1:  # the LLM blocks recomputed in backward: the reduction and the
        cfg = _recompute(cfg)  # all-to-alls run again there, in the same order on every rank
    return with_parallel(cfg, **par)


def _recorder(seen: list):
    """``on_inputs``: every rank's router biases (those the step's forward used) and own loads of the step
    (what the bias update sums over the ranks), and the step's pack lengths."""

    def on_inputs(trainer, step, inputs) -> None:
        from omni_parallel.moe import moe_layers

        mine = [(m.router.expert_bias.tolist(), m.pending_load.tolist()) for m in moe_layers([trainer.stage])]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        sharding = trainer.sharding  # hybrid DP/CP: the CP sizes its plans gave the step's samples
        cps = (
            {s.cp for slots, _ in sharding._cache.values() for s in slots} if sharding is not None else set()
        )
        seen.append((everyone, [p.num_tokens for p in inputs.packs], cps))

    return on_inputs


def _parallel_runs(rank, world_size, cfg, root):
    out = {}
    for name in LAYOUTS:
        seen: list = []
        got = capture_run(_layout(cfg, name), Path(root) / name, on_inputs=_recorder(seen))
        out[name] = (got, seen)
    return out


def _reference(rank, world_size, cfg, root):
    seen: list = []
    return reference_run(cfg, Path(root) / "ref", 1, on_inputs=_recorder(seen)), seen


@pytest.fixture(scope="module")
def runs(moe_cfg):
    """The one-process reference and the 2-process runs, side by side (other run folders): the reference
    runs on the core the 2 ranks leave idle."""
    tmp, cfg = moe_cfg
    reference, parallel = side_by_side(
        lambda: run_world(_reference, 1, args=(cfg, str(tmp / "w1")), timeout_s=120),
        lambda: run_world(_parallel_runs, 2, args=(cfg, str(tmp / "w2")), timeout_s=240),
    )
    return reference[0], parallel[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_losses_and_bias_under_sequence_sharding_match_one_process(moe_cfg, runs, name):
    tmp, cfg = moe_cfg
    (ref, ref_seen), par = runs
    got, seen = par[name]
    moe = cfg.model.llm.moe
    layers = sum(moe.is_moe_layer(i) for i in range(cfg.model.llm.n_layers))
    assert_runs_match(got, ref, name)
    rows, ref_rows = _rows(tmp / "w2" / name), _rows(tmp / "w1" / "ref")
    assert len(rows) == len(ref_rows) == 3
    for step, (row, want) in enumerate(zip(rows, ref_rows)):
        for key in ("moe_aux", "moe_z"):
            assert abs(row[key] - want[key]) <= 1e-10, (name, step, key, row[key], want[key])
        for key in (*LOAD_KEYS[2:], "moe_load_max_over_mean"):
            assert row[key] == want[key], (name, step, key, row[key], want[key])
        # each token counted once, no padding row routed or computed
        routed = int(row["tokens"]) * moe.top_k * layers
        assert row["moe_tokens_routed"] == row["moe_tokens_computed"] == routed, (name, step, row)
    # the router bias each step's forward used equals one process's, the same on both ranks, and the
    # loads the update sums over the ranks are the one process's loads
    for step, ((everyone, _, _), (ref_everyone, _, _)) in enumerate(zip(seen, ref_seen, strict=True)):
        (ref_layers,) = ref_everyone
        for j, (bias, load) in enumerate(ref_layers):
            for r in everyone:
                assert max(abs(a - b) for a, b in zip(r[j][0], bias)) <= 1e-12, (name, step, j, r[j][0], bias)
            assert [sum(v) for v in zip(*(r[j][1] for r in everyone))] == load, (name, step, j)
    assert seen[-1][0][0][0][0] != [0.0] * moe.experts  # the bias moved
    if name == "ulysses2":  # the chunks held padding: some pack of odd length
        assert any(n % 2 for _, lengths, _ in seen for n in lengths), seen
    if name == "hybrid-cp2":  # samples whole on one rank and samples CP-sharded over both
        assert set().union(*(cps for _, _, cps in seen)) == {1, 2}, seen


def test_preflight_accepts_the_expert_bias_with_sequence_sharding(moe_cfg):
    from omni_train.preflight import validate

    _, cfg = moe_cfg
    for name in LAYOUTS:
        validate(_layout(cfg, name), 2)
