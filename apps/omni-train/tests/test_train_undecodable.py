"""Samples whose image body does not decode (omni-data's zero placeholder, ``Payload.error``) are not
trained on: their caption targets are masked on the last stage, wherever in the pipeline the image was
decoded, and counted per step as ``skipped_payloads`` (and not as trained samples in
``samples_per_modality``).

Reference: the same run on the undamaged copy of the data (same metadata, hence the same packs). At the
first step both models are identical and attention stays inside each sample, so the audio and text
cross-entropy sums must agree, the damaged run must have no image targets, and its loss must be the
clean run's audio+text loss; the per-step counts must match omni-data's own ``skipped`` counters.
"""

import json
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config

from omni_parallel.testing import run_world
from omni_train.binder import load_config


def _run_both(rank, world_size, configs, root):
    from omni_train.trainer import Trainer

    out = []
    for name, cfg in configs:
        trainer = Trainer(cfg, Path(root) / name, resume=False)
        trainer.run()
        rows = None
        if rank == 0:
            text = (Path(root) / name / "metrics.jsonl").read_text()
            rows = [json.loads(line) for line in text.splitlines()]
        out.append((rows, sum(trainer.stream.skipped.values())))
    return out


def test_undecodable_images_are_masked_and_counted(tmp_path):
    kw = {"n_image": 12, "n_audio": 6, "n_text": 12}
    clean = make_dataset(tmp_path / "clean", **kw)
    damaged = make_dataset(tmp_path / "damaged", damage_images=True, **kw)
    configs = [
        (name, load_config(str(write_config(tmp_path / f"{name}.toml", d, steps=2, every=0))))
        for name, d in (("clean", clean), ("damaged", damaged))
    ]
    res = run_world(_run_both, 2, args=(configs, str(tmp_path / "runs")), timeout_s=300)
    (clean_rows, clean_read), (bad_rows, _) = res[0]
    bad_read = sum(r[1][1] for r in res)  # every image is decoded by exactly one pipeline rank
    assert clean_read == 0 and all(r["skipped_payloads"] == 0 for r in clean_rows)
    assert sum(r["skipped_payloads"] for r in bad_rows) == bad_read > 0
    # samples_per_modality counts trained samples: the masked images are skipped_payloads, not images
    for cr, br in zip(clean_rows, bad_rows):
        assert br["samples_per_modality"]["image"] == 0
        assert br["skipped_payloads"] == cr["samples_per_modality"]["image"]
        assert {m: br["samples_per_modality"][m] for m in ("audio", "text")} == {
            m: cr["samples_per_modality"][m] for m in ("audio", "text")
        }
    c, b = clean_rows[0], bad_rows[0]
    assert c["targets_per_modality"]["image"] > 0 and b["targets_per_modality"]["image"] == 0
    assert "image" not in b["loss_per_modality"]
    n = {m: c["targets_per_modality"][m] for m in ("audio", "text") if c["targets_per_modality"][m]}
    assert n
    for m in n:
        assert b["targets_per_modality"][m] == n[m]
        assert b["loss_per_modality"][m] == pytest.approx(c["loss_per_modality"][m], rel=1e-5)
    want = sum(c["loss_per_modality"][m] * n[m] for m in n) / sum(n.values())
    assert b["loss"] == pytest.approx(want, rel=1e-5)
