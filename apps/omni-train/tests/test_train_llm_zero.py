"""LLM ZeRO (``parallel.llm_zero``, :mod:`omni_parallel.llm_zero`) in the trainer against one float64 process,
losses and every gradient of every step within 1e-10 (``train_reference``):

* ``llm_zero`` 0, 1, 2 and 3 at pp=2 x dp=2 with media and encoder ZeRO-3 (4 processes): FSDP2 over each
  stage's data group on the step-scoped schedule (gathered once per step, reduced once per step as a plain
  sum), composing with the encoders' own FSDP2 over the world; ZeRO-3 also with selective recompute and
  offload of the LLM blocks; ZeRO-2 with two stages on one rank (pp=1, looped GPipe, two FSDP2 roots);
  ZeRO-3 over a CP pair (cp=2 ring, ``data.replicas = 2`` so the global step is dp=2's) with
  ``train.compile`` (every block compiled, inductor, run on the gathered parameters, CP attention outside
  the graph; all compiling in step 0, none in the later steps' other pack lengths, document counts and
  CP shares);
* hybrid DP/CP (pp=2, cp=2 ranks per stage sharing packs) with ``llm_zero = 3``;
* measured bytes per rank (``omni_parallel.memory.state_bytes`` over the rank's LLM stages): AdamW
  state at ``llm_zero >= 1`` and parameters at ``llm_zero = 3`` are half of ``llm_zero = 0``'s (within 1%),
  gradients whole at 1 and half at 2 and 3, gathered storage kept at 1 and 2 only;
* across layouts: the ``llm_zero = 3`` pp=2 x dp=2 run's step-1 checkpoint (FSDP2 DTensor shards of
  parameters and AdamW moments over a 2-rank mesh per stage, encoder shards over 4 ranks) loads at pp=1 x
  dp=2 with ``llm_zero = 1`` and at pp=1 x dp=2 x tp=2 with Megatron SP (omni-ckpt's box intersection;
  the data replicas stay 2, so the packs are the same), and steps 2 and 3 there equal the uninterrupted
  run's and the reference's (step 3's gradients follow step 2's update from the loaded AdamW moments).
  The resumes go through the trainer's own ``--resume --resume-step`` (``train_reference.relayout_run``):
  at the same DP size it loads the model and the optimizer by box intersection and replays the loader
  over the committed steps (``omni_train.checkpointing``);
* across DP sizes: the same checkpoint at pp=2 x tp=2 + SP, dp=1 (the DP and TP sizes change together).
  Both runs read their data as ``data.replicas = 2`` data replicas (omni-data's ``ReplicaMerge``): the
  saved run one per DP rank (the same packs as dp=2's own loaders, so the same reference), the resumed
  one both on its one DP rank (2 x ``data.microbatches`` packs per step, in replica order), so the global
  step is the same and steps 2 and 3 equal the uninterrupted run's. (Without ``data.replicas`` a DP-size
  change re-splits the loader states and trains other data: the zero0 run's checkpoint at the same
  layout, whose oracle is one float64 process that resumes the dp=2 reference's own step-1 checkpoint
  with the reference's two replica loader states re-split in memory,
  ``train_reference.reference_resplit_run``; the test checks the losses differ from the uninterrupted
  run's.)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from train_fixtures import make_dataset, side_by_side, write_config
from train_reference import (
    assert_runs_match,
    capture_run,
    reference_resplit_run,
    reference_run,
    relayout_run,
    with_parallel,
)

from omni_parallel.testing import run_world
from omni_pipeline import ScheduleKind
from omni_train.binder import load_config

pytestmark = pytest.mark.slow

ZERO = {"pp": 2, "dp": 2, "encoder_zero": 3}
HYBRID = {"pp": 2, "cp": 2, "hybrid_cp": True, "llm_zero": 3, "encoder_zero": 3, "data_max_seq_len": 48}
RESUME_AT = 1  # step 3's gradients then depend on step 2's AdamW update from the loaded moments


def _observe(trainer, seen):
    """The rank's LLM bytes (the last step's wins), the CP sizes its hybrid DP/CP plans used, and the
    frames dynamo has compiled in this process after each step."""
    from torch._dynamo.utils import counters

    from omni_parallel.memory import state_bytes

    seen["bytes"] = state_bytes(trainer.stage.chunks.values(), trainer.optimizer)
    seen["frames"].append(counters["frames"]["total"])
    if trainer.sharding is not None:
        seen["cp"] |= {s.cp for slots, _ in trainer.sharding._cache.values() for s in slots}


def _parallel(rank, world_size, runs, root):
    out = []
    for name, cfg, par in runs:
        seen: dict = {"cp": set(), "frames": []}
        got = capture_run(
            with_parallel(cfg, **par),
            Path(root) / name,
            on_inputs=lambda t, step, inputs, s=seen: _observe(t, s),
        )
        # (..., frames compiled after step 0: train.compile compiles in step 0 only)
        out.append((got, seen["bytes"], sorted(seen["cp"]), seen["frames"][-1] - seen["frames"][0]))
    return out


def _references(rank, world_size, refs, root, resplit=None):
    """The references of ``refs``; with ``resplit`` (``(name of a dp > 1 reference, run name)``), then the
    one-process resume of that reference's step ``RESUME_AT`` on its replicas' re-split loader states."""
    out = [reference_run(cfg, Path(root) / name, dp) for name, cfg, dp in refs]
    if resplit is not None:
        (cfg,) = [c for name, c, _ in refs if name == resplit[0]]
        saved = str(Path(root) / resplit[0] / "checkpoints")
        out.append(reference_resplit_run(cfg, saved, Path(root) / resplit[1], RESUME_AT))
    return out


def _world2(rank, world_size, runs, root, cfg, saved, run):
    return _parallel(rank, world_size, runs, root), relayout_run(cfg, saved, Path(run), RESUME_AT)


def _world4(rank, world_size, runs, root, relayouts):
    """``runs``, then each ``(cfg, saved, run)`` of ``relayouts`` from step ``RESUME_AT`` of the checkpoint
    one of the runs wrote under ``saved``."""
    return (
        _parallel(rank, world_size, runs, root),
        *(relayout_run(cfg, saved, Path(run), RESUME_AT) for cfg, saved, run in relayouts),
    )


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llmzero")
    data = make_dataset(tmp / "data")
    cfg = load_config(str(write_config(tmp / "c.toml", data, steps=3, every=1, extra='dtype = "float64"')))
    return tmp, dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, keep_last=3))


def test_llm_zero_stages_hybrid_cp_and_a_resume_across_layouts_match_one_process(dense):
    tmp, cfg = dense
    # zero3 reads its data as 2 data replicas (data.replicas, one per DP rank: the same packs as dp=2's
    # own loaders, so the same reference), which a resume at another DP size keeps (below)
    runs = [(f"zero{z}", cfg, {**ZERO, "llm_zero": z, "data_replicas": 2 if z == 3 else 0}) for z in range(4)]
    # selective recompute of the LLM blocks' attention and offload of what they save, FSDP2 units alike
    memory = dataclasses.replace(
        cfg.train, recompute=["llm"], recompute_modules=["attention"], offload=["llm"]
    )
    runs.append(("zero3-recompute-offload", dataclasses.replace(cfg, train=memory), {**ZERO, "llm_zero": 3}))
    runs.append(("hybrid-zero3", cfg, HYBRID))
    # then the zero3 run's step-1 checkpoint at pp=1 x dp=2 x tp=2 + SP (llm_zero 0: not composed with TP)
    sp = with_parallel(cfg, pp=1, dp=2, tp=2, sequence_parallel=True, encoder_zero=3, data_replicas=2)
    # and at pp=2 x tp=2 + SP, dp=1 (the DP size changes with the TP size): its one DP rank runs both data
    # replicas (2 x data.microbatches packs per step, in replica order)
    pp2_sp = with_parallel(cfg, pp=2, tp=2, sequence_parallel=True, encoder_zero=3, data_replicas=2)
    saved = str(tmp / "w4" / "zero3" / "checkpoints")
    # and the zero0 run's (its own DP loaders, no data.replicas) at the same layout: re-split
    split = with_parallel(cfg, pp=2, tp=2, sequence_parallel=True, encoder_zero=3)
    relayouts = [
        (sp, saved, str(tmp / "relayout-sp")),
        (pp2_sp, saved, str(tmp / "relayout-pp2-sp")),
        (split, str(tmp / "w4" / "zero0" / "checkpoints"), str(tmp / "relayout-pp2-sp-resplit")),
    ]
    outs = run_world(_world4, 4, args=(runs, str(tmp / "w4"), relayouts), timeout_s=900)
    w4, (to_sp, to_pp2_sp, to_split) = [o[0] for o in outs], outs[0][1:]
    results = {name: [r[i] for r in w4] for i, (name, _, _) in enumerate(runs)}

    # the zero3 run's step-1 checkpoint at pp=1 x dp=2, llm_zero = 1: steps 2 and 3 as uninterrupted
    other = with_parallel(cfg, pp=1, dp=2, encoder_zero=3, llm_zero=1, data_replicas=2)
    compiled = dataclasses.replace(cfg.train, compile=True)
    # and two stages on one rank (looped GPipe, virtual_stages = 2): two FSDP2 roots gathered per step
    v2 = [
        (
            "v2-zero2",
            cfg,
            {"pp": 1, "dp": 2, "schedule": ScheduleKind.GPIPE, "virtual_stages": 2, "llm_zero": 2},
        ),
        # torch.compile of every block (FSDP2 units over the CP pair): the compiled forwards run on the
        # gathered parameters, ring attention outside the graph; both data replicas on the one DP rank
        (
            "cp2-ring-zero3-compile",
            dataclasses.replace(cfg, train=compiled),
            {"pp": 1, "cp": 2, "cp_attention": "ring", "llm_zero": 3, "data_replicas": 2},
        ),
    ]
    # the one-process references run side by side with this 2-process world (other run folders), on the
    # core its compiling ranks leave idle: hybrid DP/CP's 2 ranks per stage share packs of 2 x 48 tokens,
    # the reference trains them whole (96); and the dp2 reference's step-1 resume at pp=1 x dp=1 on its
    # two replicas' re-split loader states
    w2, refs = side_by_side(
        lambda: run_world(
            _world2, 2, args=(v2, str(tmp / "w2"), other, saved, str(tmp / "relayout")), timeout_s=900
        ),
        lambda: run_world(
            _references,
            1,
            args=([("dp2", cfg, 2), ("hybrid", cfg, 1)], str(tmp / "ref"), ("dp2", "resplit")),
            timeout_s=600,
        ),
    )
    (looped, compiled_run), got = w2[0]
    want, want_hybrid, want_resplit = refs[0]

    for name, per_rank in results.items():
        assert_runs_match(per_rank[0][0], want_hybrid if name.startswith("hybrid") else want, name)

    assert results["hybrid-zero3"][0][2] == [1, 2]  # short samples whole on one rank, long ones over 2

    # per-rank bytes of the rank's LLM stages, between the sync and the optimizer step of the last step
    for z in range(4):  # shown with pytest -s
        print(f"llm_zero {z}:", [results[f"zero{z}"][rank][1] for rank in range(4)])
    for rank in range(4):
        b0, b1, b2, b3 = (results[f"zero{z}"][rank][1] for z in range(4))
        for z, b in ((1, b1), (2, b2), (3, b3)):
            assert b["optimizer"] == pytest.approx(b0["optimizer"] / 2, rel=0.01), (rank, z, b, b0)
        assert b3["parameters"] == pytest.approx(b0["parameters"] / 2, rel=0.01), (rank, b3, b0)
        assert b1["gradients"] == b0["gradients"]  # ZeRO-1 keeps the whole summed gradient
        for b in (b2, b3):
            assert b["gradients"] == pytest.approx(b0["gradients"] / 2, rel=0.01), (rank, b, b0)
        assert b0["gathered"] == b3["gathered"] == 0 and b1["gathered"] > 0 and b2["gathered"] > 0

    # FSDP2's gathered parameters are parameters, not saved activations (ActivationMemory re-reads the
    # parameters' storages each step): the peaks equal the replicated run's
    peaks = {
        z: [
            json.loads(line)["peak_activation_bytes_per_rank"]
            for line in (tmp / "w4" / f"zero{z}" / "metrics.jsonl").read_text().splitlines()
        ]
        for z in (0, 3)
    }
    assert peaks[3] == peaks[0], peaks

    assert_runs_match(looped[0], want, "v2-zero2")
    assert_runs_match(compiled_run[0], want, "cp2-ring-zero3-compile")
    assert compiled_run[3] == 0, f"cp2-ring-zero3-compile: {compiled_run[3]} frames compiled after step 0"
    uninterrupted = results["zero3"][0][0]
    tail = (uninterrupted[0][RESUME_AT:], uninterrupted[1][RESUME_AT:])
    assert len(got[0]) == len(tail[0]) == cfg.train.steps - RESUME_AT
    assert_runs_match(got, tail, "relayout")
    assert_runs_match(got, (want[0][RESUME_AT:], want[1][RESUME_AT:]), "relayout vs reference")
    assert_runs_match(to_sp, tail, "relayout to tp2 + SP")
    # dp=2 -> dp=1 with data.replicas = 2 on both: the one DP rank runs both replicas, so the global
    # step is dp=2's and the run continues the uninterrupted one within 1e-10 (model and AdamW by box
    # intersection, the replicas' loaders carried over)
    assert len(to_pp2_sp[0]) == cfg.train.steps - RESUME_AT
    assert_runs_match(to_pp2_sp, tail, "relayout to pp2 x tp2 + SP (dp 2 -> 1, data.replicas 2)")
    # without data.replicas, dp=2 -> dp=1 cannot continue the uninterrupted run (a step's data is dp x
    # microbatches packs, each DP rank's from its own shards): it continues the one-process run on the
    # re-split data from the same state, within 1e-10 (the loader re-split at new positions)
    assert len(to_split[0]) == cfg.train.steps - RESUME_AT
    assert_runs_match(to_split, want_resplit, "relayout to pp2 x tp2 + SP (dp 2 -> 1, re-split)")
    assert abs(to_split[0][0] - tail[0][0]) > 1e-6, (to_split[0], tail[0])  # other data than dp=2's


def test_llm_zero_preflight_names_the_field(dense):
    from omni_train.config import ConfigError
    from omni_train.preflight import validate

    _, cfg = dense
    validate(with_parallel(cfg, pp=1, dp=2, tp=2, llm_zero=2), 4)  # FSDP2 over (dp, tp): test_train_zero_tp
    validate(with_parallel(cfg, pp=1, dp=1, tp=2, cp=2, llm_zero=2), 4)  # over (dp x cp, tp)
    with pytest.raises(ConfigError, match=r"^parallel\.llm_zero"):
        validate(with_parallel(cfg, llm_zero=4), 2)
    validate(with_parallel(cfg, pp=1, llm_zero=3), 1)  # one rank per stage: nothing to shard, accepted
    with pytest.raises(ConfigError, match=r"^data\.replicas: 3 must be 0 or a multiple of parallel\.dp 2"):
        validate(with_parallel(cfg, pp=1, dp=2, data_replicas=3), 2)
    validate(with_parallel(cfg, pp=1, dp=2, data_replicas=4), 2)
    # another DP size with per-modality packs resumes when the data replicas are kept (handed over whole)
    from omni_train.config import Packing
    from omni_train.preflight import check_resume_layout

    pm = with_parallel(cfg, data_packing=Packing.PER_MODALITY, data_replicas=2)
    check_resume_layout(with_parallel(pm, dp=2), with_parallel(pm, dp=1))
    with pytest.raises(ConfigError, match=r"^parallel\.dp: 2 -> 1 with data\.packing = 'per_modality'"):
        check_resume_layout(
            with_parallel(pm, dp=2, data_replicas=0), with_parallel(pm, dp=1, data_replicas=0)
        )
    with pytest.raises(ConfigError, match=r"^parallel\.llm_reshard_after_forward: 'sometimes' is not one of"):
        validate(with_parallel(cfg, llm_reshard_after_forward="sometimes"), 2)
    for policy in ("auto", "always", "never"):
        validate(with_parallel(cfg, pp=1, dp=2, llm_zero=3, llm_reshard_after_forward=policy), 2)
    validate(with_parallel(cfg, pp=1, dp=2, tp=2, llm_zero=0), 4)


def test_reshard_policy_per_schedule():
    from omni_parallel.llm_zero import reshard_after_forward

    # auto: torchtitan's default, kept gathered under PP with several microbatches per stage
    assert reshard_after_forward("auto", pp=2, microbatches=4) is False
    assert reshard_after_forward("auto", pp=1, microbatches=4) is True
    assert reshard_after_forward("auto", pp=2, microbatches=1) is True
    assert reshard_after_forward("always", pp=2, microbatches=4) is True
    assert reshard_after_forward("never", pp=1, microbatches=1) is False
    with pytest.raises(ValueError, match="policy 'x'"):
        reshard_after_forward("x", pp=1, microbatches=1)
