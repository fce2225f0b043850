"""Encoder parallelism in the trainer (issue 17) against one float64 process, losses and every gradient of
every step within 1e-10 (``train_reference``: the reference trains on the same packs, the DP replicas'
streams side by side):

* encoder ZeRO-2 and ZeRO-3 with pp=2 (FSDP2 on the step-scoped schedule: gathered once per step,
  reduce-scattered once per step as a plain sum), ZeRO-3 with tp=2 (divided by tp), and ZeRO-3's measured
  encoder parameter + optimizer bytes per rank below ZeRO-0's;
* grouped reordering across DP (dp=2, one reordering group of both replicas), with payloads moved;
* long-short SP for encoders (ulysses=2, encoder_sp=2): long images split over the SP group (Ulysses in
  the ViT), short ones whole, delivered by the Ulysses all-to-all of ``reshard_to_llm``;
* 4 processes: pp=2 x dp=2 with ZeRO-3 and reordering, dp=2 x ulysses=2 with all three;
* sparse media: a step where no rank has any media and steps where one rank has media and another none
  (ZeRO-3 and reordering must still join every collective: a hang fails after ``timeout_s``, naming ranks).

The CP path of the delivery is tested directly in ``test_train_encoder_delivery.py`` and in the trainer at
cp=2 with long images in ``test_train_cp_encoder_sp.py``.

Checkpointing with all of it on (dp=2 x ulysses=2, reordering across both replicas, ZeRO-3, long-short
SP): a worker SIGKILLs itself mid-run (its peers are killed with it), the run resumes from the last
committed checkpoint and reproduces the uninterrupted run's losses bit for bit (float32, CPU); a resume
at another reordering-group size is refused. The CLI's own launcher and ``--resume`` flag are covered by
``test_train_e2e.py``; here the workers are forked from the test harness, which starts in milliseconds
rather than a fresh interpreter per worker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
from train_fixtures import make_dataset, side_by_side, write_config
from train_reference import assert_runs_match, capture_run, reference_run, with_parallel

from omni_parallel.testing import WorldError, run_world
from omni_train.binder import load_config
from omni_train.config import MixturePhase

pytestmark = pytest.mark.slow


def _stats(trainer, step, inputs, out):
    works = inputs.encoder_work.values()
    out.append(
        {
            "own_rows": sum(len(p) for w in works for p in w.positions),
            "encoded_rows": sum(len(w.index) for w in works),
            "long": sum(len(w.long) for w in works),
        }
    )


def _parallel(rank, world_size, runs, root):
    out = []
    for name, cfg, par in runs:
        stats: list[dict] = []
        got = capture_run(
            with_parallel(cfg, **par),
            Path(root) / name,
            on_inputs=lambda t, step, inputs, s=stats: _stats(t, step, inputs, s),
        )
        metrics = None
        if rank == 0:
            lines = (Path(root) / name / "metrics.jsonl").read_text().splitlines()
            metrics = [json.loads(line) for line in lines]
        out.append((got, stats, metrics))
    return out


def _references(rank, world_size, refs, root):
    return [
        (
            reference_run(cfg, Path(root) / name, dp),
            json.loads((Path(root) / name / "metrics.jsonl").read_text().splitlines()[-1]),
        )
        for name, cfg, dp in refs
    ]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("encpar")
    data = make_dataset(tmp / "data")
    dense = load_config(str(write_config(tmp / "c.toml", data, steps=2, every=0, extra='dtype = "float64"')))
    # Step 0 text only (no rank has media); then rarely an image, so an LLM microbatch holds at most one
    # and a rank may have media while another has none.
    sparse = dataclasses.replace(
        load_config(str(write_config(tmp / "s.toml", data, steps=3, every=0, extra='dtype = "float64"'))),
        name="sparse",
    )
    sparse = dataclasses.replace(
        sparse,
        data=dataclasses.replace(
            sparse.data,
            mixture=[MixturePhase({"text": 1.0}, until_step=1), MixturePhase({"image": 0.12, "text": 0.88})],
        ),
    )
    # Under dp=2 each replica draws its own packs: at this weight the fixture's data has a step where one
    # replica has an image and the other none (checked below, so a change of the data shows here).
    sparse_dp = dataclasses.replace(
        sparse,
        data=dataclasses.replace(
            sparse.data,
            mixture=[MixturePhase({"text": 1.0}, until_step=1), MixturePhase({"image": 0.2, "text": 0.8})],
        ),
    )
    return tmp, dense, sparse, sparse_dp


def test_encoder_zero_reordering_and_long_short_sp_match_one_process(configs):
    tmp, dense, sparse, sparse_dp = configs
    long = {"encoder_sp": 2, "long_threshold": 2}
    runs2 = [
        ("pp2-zero2", dense, {"encoder_zero": 2}),
        ("pp2-zero3", dense, {"encoder_zero": 3}),
        ("dp2-reorder", dense, {"pp": 1, "dp": 2}),
        ("sp2-long", dense, {"pp": 1, "ulysses": 2, **long}),
        ("tp2-zero3", dense, {"pp": 1, "tp": 2, "encoder_zero": 3}),  # TP ranks encode alike: / tp
        ("sparse-pp2-zero3", sparse, {"encoder_zero": 3}),
        ("sparse-dp2-reorder-zero3", sparse_dp, {"pp": 1, "dp": 2, "encoder_zero": 3}),
    ]
    refs, w2 = side_by_side(  # other run folders: the references run on the core the 2 ranks leave idle
        lambda: run_world(
            _references,
            1,
            args=(
                [
                    ("dense1", dense, 1),
                    ("dense2", dense, 2),
                    ("sparse1", sparse, 1),
                    ("sparse2", sparse_dp, 2),
                ],
                str(tmp / "ref"),
            ),
            timeout_s=600,
        )[0],
        lambda: run_world(_parallel, 2, args=(runs2, str(tmp / "w2")), timeout_s=600),
    )
    (dense1, dense1_row), (dense2, _), (sparse1, _), (sparse2, _) = refs
    runs4 = [
        ("pp2dp2-zero3-reorder", dense, {"pp": 2, "dp": 2, "encoder_zero": 3}),
        ("dp2sp2-all", dense, {"pp": 1, "dp": 2, "ulysses": 2, "encoder_zero": 3, **long}),
    ]
    w4 = run_world(_parallel, 4, args=(runs4, str(tmp / "w4")), timeout_s=600)
    want = {
        "pp2-zero2": dense1,
        "pp2-zero3": dense1,
        "dp2-reorder": dense2,
        "sp2-long": dense1,
        "tp2-zero3": dense1,
        "sparse-pp2-zero3": sparse1,
        "sparse-dp2-reorder-zero3": sparse2,
        "pp2dp2-zero3-reorder": dense2,
        "dp2sp2-all": dense2,
    }
    results = {name: [r[i] for r in w2] for i, (name, _, _) in enumerate(runs2)}
    results |= {name: [r[i] for r in w4] for i, (name, _, _) in enumerate(runs4)}
    for name, per_rank in results.items():
        assert_runs_match(per_rank[0][0], want[name], name)
    # the layouts did what they are for
    rows = results["pp2-zero3"][0][2]
    zero3 = rows[-1]["encoder_state_bytes"]
    zero0 = dense1_row["encoder_state_bytes"]
    assert zero3["gathered"] == 0 and results["pp2-zero2"][0][2][-1]["encoder_state_bytes"]["gathered"] > 0
    assert zero3["parameters"] + zero3["optimizer"] < 0.6 * (zero0["parameters"] + zero0["optimizer"]), (
        zero3,
        zero0,
    )
    for name in ("dp2-reorder", "pp2dp2-zero3-reorder", "dp2sp2-all"):
        assert sum(r["reorder_bytes"] for r in results[name][0][2]) > 0, f"{name}: reordering moved nothing"
    for name in ("sp2-long", "dp2sp2-all"):
        assert any(s["long"] for r in results[name] for s in r[1]), f"{name}: no image was long"
    pp2 = results["sparse-pp2-zero3"]
    steps = range(len(pp2[0][1]))
    assert any(all(r[1][s]["own_rows"] == 0 for r in pp2) for s in steps), "no step without any media"
    assert any({r[1][s]["own_rows"] > 0 for r in pp2} == {True, False} for s in steps), (
        "no step where one rank has media and another none"
    )
    dp2 = results["sparse-dp2-reorder-zero3"]
    assert any({r[1][s]["own_rows"] > 0 for r in dp2} == {True, False} for s in steps), (
        "no step where one replica has media and the other none"
    )


def _train(rank, world_size, cfg, run, resume, kill_at, refused_cfg=None):
    from omni_train.trainer import Trainer

    refused = None
    if refused_cfg is not None:  # a resume at another reordering-group size first: it must be refused
        try:
            Trainer(refused_cfg, Path(run), resume=True).run()
        except RuntimeError as exc:
            refused = str(exc)

    def die(step, inputs, result):
        if step == kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    Trainer(cfg, Path(run), resume=resume).run(after_backward=die)
    losses = [json.loads(line)["loss"] for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return losses, refused


def test_sigkill_resume_with_every_encoder_parallelism_is_exact(configs):
    tmp, _, _, _ = configs
    data = {k: str(v) for k, v in make_dataset(tmp / "data-resume").items()}
    layout = "dp = 2\nulysses = 2\nencoder_zero = 3\nencoder_sp = 2\nlong_threshold = 2"
    cfg = load_config(str(write_config(tmp / "r.toml", data, steps=6, every=2, pp=1, parallel=layout)))
    a, b = str(tmp / "a"), str(tmp / "b")
    want, _ = run_world(_train, 4, args=(cfg, a, False, -1), timeout_s=400)[0]
    assert len(want) == 6
    killed = r"rank 1 failed: process exited without a result \(killed by signal SIGKILL\)"
    with pytest.raises(WorldError, match=killed):
        run_world(_train, 4, args=(cfg, b, False, 4), timeout_s=400)
    committed = int((Path(b) / "checkpoints" / "latest").read_text().removeprefix("step-"))
    assert 0 < committed <= 4
    other = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, reorder_group_size=1))
    got, refused = run_world(_train, 4, args=(cfg, b, True, -1, other), timeout_s=400)[0]
    assert refused is not None and refused.startswith(
        f"data.reorder_group_size: checkpoint step-{committed:08d} was saved with 2, this run has 1"
    ), refused
    assert got == want  # step for step, bit for bit
