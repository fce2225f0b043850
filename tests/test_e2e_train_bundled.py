"""Every package on the bundled real data: two training steps of the default recipe on 2 processes.

Real PNG and FLAC payloads decoded by omni-data, the bundled BPE tokenizer, omni-parallel's groups,
omni-pipeline's executor (uniform on-demand placement), omni-ckpt's async checkpoint of the last step.
"""

import dataclasses
import json
from pathlib import Path

from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.config import MixturePhase
from omni_train.preflight import validate


def _train(rank, world_size, cfg, out):
    from omni_train.trainer import Trainer

    return Trainer(cfg, Path(out), resume=False).run()


def test_default_recipe_trains_on_bundled_data(tmp_path):
    cfg = load_config("omni-tiny")
    validate(cfg, 2)
    cfg = dataclasses.replace(
        cfg,
        # media only: the first packs of the default mixture are long Shakespeare passages
        data=dataclasses.replace(
            cfg.data,
            max_seq_len=256,
            microbatches=2,
            buffer_size=16,
            mixture=[MixturePhase(weights={"image": 0.6, "audio": 0.4})],
        ),
        train=dataclasses.replace(cfg.train, steps=2),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=0),
    )
    summary = run_world(_train, 2, args=(cfg, str(tmp_path)), timeout_s=300)[0]
    assert summary["steps"] == 2 and summary["checkpoints"] == [2]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # a fresh model over a 4096-token vocabulary starts near ln(4096) = 8.32 nats
    assert 7.5 < rows[0]["loss"] < 9.0
    assert all(0 < r["packing_fill"] <= 1 for r in rows)
    seen = {m for r in rows for m in r["loss_per_modality"]}
    assert seen == {"image", "audio"}, seen
    assert (tmp_path / "timeline.png").is_file() and (tmp_path / "loss.png").is_file()
