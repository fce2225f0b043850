"""Resume under another DP size: a run saved at dp=2 resumes at dp=1 with the loader states of both old DP
ranks re-split (omni-data's ``load_resplit``), and every sample of the first epoch is trained exactly
once over the two runs (a ledger of every sample of the dataset, read from the data we wrote, not from
the loader). A resume that changes the pipeline size too (dp=2 x pp=1 -> dp=1 x pp=2) re-splits the same
way (the old rows read at one old position: the packs' metadata is the same at every position) and
trains the very packs the dp=1 x pp=1 resume trains, on both pipeline ranks.

What cannot be re-split is refused by ``omni-train run --resume`` before any worker starts, in one line
naming the fields and both values, exit status 2 (``omni_train.preflight.check_resume_layout``): another
DP size with a text source's ``join_tokens`` or ``data.packing = "per_modality"``, another DP or CP size
under ``parallel.hybrid_cp``."""

import dataclasses
import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config
from train_reference import with_parallel

from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.trainer import Trainer

N_IMAGE, N_AUDIO, N_TEXT = 8, 4, 8


class _Recording(Trainer):
    """A trainer that notes ``(uid, epoch)`` of every sample in the packs of each step it trains."""

    def _loader_step(self, step):
        fs = super()._loader_step(step)
        self.trained = [
            *getattr(self, "trained", []),
            [(s.uid, s.epoch) for p in fs.packs for s in p.samples],
        ]
        return fs


def _dp2(rank, world_size, cfg, pp2_cfg, root):
    import torch.distributed as dist

    root = Path(root)
    trainer = _Recording(cfg, root / "run", resume=False)
    trainer.run()
    if rank == 0:
        shutil.copytree(root / "run" / "checkpoints", root / "other" / "checkpoints")
    dist.barrier()
    pp2 = _Recording(pp2_cfg, root / "other", resume=True)  # dp=1 x pp=2: DP and pipeline sizes change
    pp2.run()
    return trainer.trained, pp2.trained


def _dp1(rank, world_size, cfg, root):
    trainer = _Recording(cfg, Path(root) / "run", resume=True)
    trainer.run()
    return trainer.trained


def test_dp2_to_dp1_trains_every_sample_once_also_with_the_pipeline_size_changed(tmp_path):
    data = make_dataset(tmp_path / "data", n_image=N_IMAGE, n_audio=N_AUDIO, n_text=N_TEXT)
    path = write_config(tmp_path / "c.toml", data, steps=2, every=2, pp=1)
    path.write_text(path.read_text().replace("max_seq_len = 96", "max_seq_len = 256"))  # no text is split
    base = load_config(str(path))
    dp2 = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, dp=2))
    pp2 = dataclasses.replace(
        base,
        parallel=dataclasses.replace(base.parallel, pp=2),
        train=dataclasses.replace(base.train, steps=4),
    )
    dp1 = dataclasses.replace(base, train=dataclasses.replace(base.train, steps=10))
    old = run_world(_dp2, 2, args=(dp2, pp2, str(tmp_path)), timeout_s=300)
    new = run_world(_dp1, 1, args=(dp1, str(tmp_path)), timeout_s=300)[0]

    assert [len(steps) for steps, _ in old] == [2, 2] and len(new) == 8
    # dp=1 x pp=2 from the same checkpoint: both pipeline ranks train what dp=1 x pp=1 trains
    assert old[0][1] == old[1][1] == new[:2], (old[0][1], new[:2])
    trained = Counter(x for steps, _ in old for step in steps for x in step)
    trained.update(x for step in new for x in step)
    every = [f"image/img{i:04d}" for i in range(N_IMAGE)] + [f"audio/aud{i:04d}" for i in range(N_AUDIO)]
    every += [f"text/txt{i:04d}" for i in range(N_TEXT)]
    assert Counter({u: n for (u, e), n in trained.items() if e == 0}) == Counter(every)  # each exactly once
    assert max(n for (_, e), n in trained.items() if e >= 1) == 1  # later epochs: no duplicates either
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10)) and all(math.isfinite(r["loss"]) for r in rows)


def test_resume_refuses_what_it_cannot_re_split_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    import omni_train.launch
    from omni_train.cli import main
    from omni_train.config import ConfigError, Packing
    from omni_train.preflight import check_resume_layout

    data = make_dataset(tmp_path / "data", n_image=4, n_audio=2, n_text=4)
    path = write_config(tmp_path / "c.toml", data, pp=1)
    cfg = load_config(str(path))
    joined = dataclasses.replace(cfg.data.sources[2], join_tokens=64)
    saved = with_parallel(cfg, dp=2)
    saved = dataclasses.replace(
        saved, data=dataclasses.replace(saved.data, sources=[*cfg.data.sources[:2], joined])
    )
    run = tmp_path / "run"  # as the trainer leaves it: config.json, a committed step (its manifest)
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "checkpoints" / "step-00000002" / "manifest.msgpack").write_bytes(b"")
    (run / "config.json").write_text(json.dumps(saved.to_dict(), indent=2))

    def no_workers(*args, **kwargs):
        raise AssertionError("workers were started on a resume that cannot re-split its loader")

    monkeypatch.setattr(omni_train.launch, "launch", no_workers)
    argv = [
        "run",
        "--config",
        str(path),
        "--out",
        str(run),
        "--resume",
        "--data.sources[2].join_tokens",
        "64",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == (
        "omni-train: configuration error: parallel.dp: 2 -> 1 with data.sources[2].join_tokens = 64 ('text') cannot "
        "resume: the documents it joins cannot be re-split over other DP ranks; resume with parallel.dp = 2"
    ), lines[0]

    # what may change is accepted: the same DP size with joined documents; another DP size without them
    check_resume_layout(saved, with_parallel(saved, dp=2, pp=2))
    check_resume_layout(with_parallel(cfg, dp=2), with_parallel(cfg, pp=2, tp=2))
    per_modality = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, packing=Packing.PER_MODALITY))
    hybrid = with_parallel(cfg, pp=1, cp=2, hybrid_cp=True)
    for old, new, msg in (
        (
            with_parallel(per_modality, dp=2),
            per_modality,
            "parallel.dp: 2 -> 1 with data.packing = 'per_modality'",
        ),
        (with_parallel(hybrid, dp=2), hybrid, "parallel.dp: 2 -> 1 with parallel.hybrid_cp = true"),
        (hybrid, with_parallel(hybrid, cp=4), "parallel.cp: 2 -> 4 with parallel.hybrid_cp = true"),
    ):
        with pytest.raises(ConfigError) as exc:
            check_resume_layout(old, new)
        assert str(exc.value).startswith(msg) and "\n" not in str(exc.value), exc.value
