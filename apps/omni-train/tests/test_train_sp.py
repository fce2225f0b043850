"""Ulysses sequence parallelism in the trainer: ulysses=2 reproduces the ulysses=1 losses and grad norms.

float64; reference: the pipelined ulysses=1 run (pp=2 on 2 processes), itself checked against one process
in ``test_train_e2e.py``. Each SP rank holds half of every pack (padded to an even length), attention runs
through omni_parallel's ``ulysses_attention``; pp=1 x ulysses=2 (2 processes) and pp=2 x ulysses=2
(4 processes) must match step for step, and dp=2 x ulysses=2 the dp=2 run. A model with one query/KV head (not divisible by sp = 2) is
accepted: omni_parallel's Ulysses pads KV groups with zero heads, and the runs match too.
"""

import dataclasses
import json
from pathlib import Path

import pytest
from train_fixtures import make_dataset, side_by_side, write_config

from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.config import ConfigError
from omni_train.preflight import validate

pytestmark = pytest.mark.slow


def _train(rank, world_size, cfg, variants, root):
    from omni_train.trainer import Trainer

    out = []
    for name, par in variants:
        par = dict(par)
        heads = par.pop("heads", None)
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **par))
        if heads is not None:
            llm = dataclasses.replace(cfg.model.llm, n_heads=heads, n_kv_heads=heads)
            c = dataclasses.replace(c, model=dataclasses.replace(cfg.model, llm=llm))
            validate(c, world_size)
        run = Path(root) / name
        trainer = Trainer(c, run, resume=False)
        assert trainer.sp == c.parallel.ulysses
        trainer.run()
        if rank == 0:
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            out.append(
                ([r["loss"] for r in rows], [r["grad_norm"] for r in rows], [r["tokens"] for r in rows])
            )
        else:
            out.append(None)
    return out


def test_ulysses2_matches_ulysses1(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=3, every=0, extra='dtype = "float64"'))
    )
    # Ulysses with TP is wired (tests/test_train_4d.py); with CP it is refused (USP is not built)
    with pytest.raises(ConfigError, match=r"^parallel\.cp: choose one LLM sequence-parallel flavour"):
        validate(
            dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=1, cp=2, ulysses=2)), 4
        )
    variants = [
        ("pp2", {"pp": 2, "ulysses": 1}),
        ("sp2", {"pp": 1, "ulysses": 2}),
        ("pp2-h1", {"pp": 2, "ulysses": 1, "heads": 1}),
        ("sp2-h1", {"pp": 1, "ulysses": 2, "heads": 1}),
        ("dp2", {"pp": 1, "dp": 2, "ulysses": 1}),
    ]
    w4 = [("pp2sp2", {"pp": 2, "ulysses": 2}), ("dp2sp2", {"pp": 1, "dp": 2, "ulysses": 2})]
    w2, w4 = side_by_side(  # other run folders: each world runs on the cores the other leaves idle
        lambda: run_world(_train, 2, args=(cfg, variants, str(tmp_path / "w2")), timeout_s=300),
        lambda: run_world(_train, 4, args=(cfg, w4, str(tmp_path / "w4")), timeout_s=300),
    )
    base, sp2, h1, sp2_h1, dp2 = w2[0]
    assert len(base[0]) == 3 and base[0][-1] < base[0][0]
    assert sp2[0] == pytest.approx(base[0], rel=1e-10, abs=1e-10)
    assert sp2[1] == pytest.approx(base[1], rel=1e-10, abs=1e-10)
    assert sp2[2] == base[2]
    assert h1[0] != base[0]  # the one-head model is another model
    assert sp2_h1[0] == pytest.approx(h1[0], rel=1e-10, abs=1e-10)
    assert sp2_h1[1] == pytest.approx(h1[1], rel=1e-10, abs=1e-10)
    pp2sp2, dp2sp2 = w4[0]
    for got, want in ((pp2sp2, base), (dp2sp2, dp2)):  # dp2: DP ranks read other data than dp1
        assert got[0] == pytest.approx(want[0], rel=1e-10, abs=1e-10)
        assert got[1] == pytest.approx(want[1], rel=1e-10, abs=1e-10)
