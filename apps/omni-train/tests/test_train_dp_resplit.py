"""Resume under another DP size: a run saved at dp=2 resumes at dp=1 with the loader states of both old DP
ranks re-split (omni-data's ``load_resplit``), and every sample of the first epoch is trained exactly
once over the two runs (a ledger of every sample of the dataset, read from the data we wrote, not from
the loader); a resume that changes the pipeline size is refused before the loader reads anything, with
the old and new layouts named."""

import dataclasses
import json
import math
import shutil
from collections import Counter
from pathlib import Path

from train_fixtures import make_dataset, write_config

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


def _dp2(rank, world_size, cfg, refused_cfg, root):
    import torch.distributed as dist

    from omni_data import LayoutMismatchError

    root = Path(root)
    trainer = _Recording(cfg, root / "run", resume=False)
    trainer.run()
    if rank == 0:
        shutil.copytree(root / "run" / "checkpoints", root / "other" / "checkpoints")
    dist.barrier()
    try:
        _Recording(refused_cfg, root / "other", resume=True).run()
    except LayoutMismatchError as e:
        return trainer.trained, str(e)
    return trainer.trained, None


def _dp1(rank, world_size, cfg, root):
    trainer = _Recording(cfg, Path(root) / "run", resume=True)
    trainer.run()
    return trainer.trained


def test_dp2_to_dp1_trains_every_sample_once_and_pp_change_is_refused(tmp_path):
    data = make_dataset(tmp_path / "data", n_image=N_IMAGE, n_audio=N_AUDIO, n_text=N_TEXT)
    path = write_config(tmp_path / "c.toml", data, steps=2, every=2, pp=1)
    path.write_text(path.read_text().replace("max_seq_len = 96", "max_seq_len = 256"))  # no text is split
    base = load_config(str(path))
    dp2 = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, dp=2))
    pp2 = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, pp=2))
    dp1 = dataclasses.replace(base, train=dataclasses.replace(base.train, steps=10))
    old = run_world(_dp2, 2, args=(dp2, pp2, str(tmp_path)), timeout_s=300)
    new = run_world(_dp1, 1, args=(dp1, str(tmp_path)), timeout_s=300)[0]

    refused = old[0][1]
    assert refused is not None and "saved with dp=2 pp=1" in refused and "resumed with dp=1 pp=2" in refused
    assert [len(steps) for steps, _ in old] == [2, 2] and len(new) == 8
    trained = Counter(x for steps, _ in old for step in steps for x in step)
    trained.update(x for step in new for x in step)
    every = [f"image/img{i:04d}" for i in range(N_IMAGE)] + [f"audio/aud{i:04d}" for i in range(N_AUDIO)]
    every += [f"text/txt{i:04d}" for i in range(N_TEXT)]
    assert Counter({u: n for (u, e), n in trained.items() if e == 0}) == Counter(every)  # each exactly once
    assert max(n for (_, e), n in trained.items() if e >= 1) == 1  # later epochs: no duplicates either
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10)) and all(math.isfinite(r["loss"]) for r in rows)
