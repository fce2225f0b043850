"""The encoders' gradient sync skips a tower that ran on no rank in the step (its gradients are the zeros
its flat buffer was reset to everywhere, so their sum is zeros) and reduces it whenever any DP replica ran
it.

Reference: every loss and every gradient of every step equals the one-process float64 run of the same
data (``train_reference``), over steps with no audio anywhere and steps with audio on one replica only
(both kinds must occur, or the test fails); the hook is checked to have been told exactly the towers
that ran somewhere."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from train_fixtures import make_dataset, side_by_side, write_config
from train_reference import assert_runs_match, capture_run, reference_run, with_parallel

from omni_data import Modality
from omni_parallel.parallelize import EncoderGradientSync
from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.config import MixturePhase

pytestmark = pytest.mark.slow


def _audio(inputs) -> int:
    return sum(s.modality == Modality.AUDIO and s.media_tokens > 0 for p in inputs.packs for s in p.samples)


def _dp2(rank, world_size, cfg, root):
    seen, told = [], []

    def on_inputs(trainer, step, inputs):
        if step == 0:  # from step 1 on, record what the gradient sync is told
            sync = trainer.sync_encoders

            def recording(towers=None):
                told.append(None if towers is None else sorted(towers))
                sync(towers)

            trainer.sync_encoders = EncoderGradientSync(recording, sync.attach)
        seen.append((step, _audio(inputs), sorted(inputs.media)))

    got = capture_run(cfg, Path(root) / "dp2", on_inputs=on_inputs)
    return got, seen, told


def _reference(rank, world_size, cfg, root):
    return reference_run(cfg, Path(root) / "ref", 2)


def test_a_tower_that_ran_nowhere_is_not_reduced_and_one_that_ran_on_one_replica_is(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=6, every=0, pp=1, extra='dtype = "float64"'))
    )
    mixture = [
        MixturePhase({"image": 0.6, "audio": 0.0, "text": 0.4}, until_step=2),
        MixturePhase({"image": 0.5, "audio": 0.12, "text": 0.38}),
    ]
    cfg = with_parallel(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, mixture=mixture)), dp=2)
    results, reference = side_by_side(  # other run folders: the reference runs on the 2 ranks' idle core
        lambda: run_world(_dp2, 2, args=(cfg, str(tmp_path)), timeout_s=300),
        lambda: run_world(_reference, 1, args=(cfg, str(tmp_path)), timeout_s=300),
    )
    ref = reference[0]
    assert_runs_match(results[0][0], ref, "dp=2 with idle towers")
    (_, seen0, told0), (_, seen1, told1) = results
    kinds = {"nowhere": 0, "one replica": 0}
    for (step, a0, media0), (_, a1, media1) in zip(seen0, seen1):
        want = ["image", "audio"] if a0 + a1 else ["image"]
        assert media0 == media1 == sorted(want), (step, a0, a1, media0, media1)
        if step >= 1:
            assert told0[step - 1] == told1[step - 1] == sorted(want), step
        kinds["nowhere"] += step >= 1 and a0 + a1 == 0
        kinds["one replica"] += step >= 1 and (a0 == 0) != (a1 == 0)
    assert all(kinds.values()), kinds  # both situations were trained and checked
