"""Tensor parallelism in the trainer: tp=2 reproduces the tp=1 losses and gradient norms step for step.

float64; reference: the pipelined tp=1 run, itself checked against one process in ``test_train_e2e.py``.
Both TP ranks of a stage read the same data (the zero-redundancy loader broadcasts from TP rank 0), the
LLM blocks are sharded Megatron-style (omni_parallel.tensor_parallel), the encoders run replicated. A
run resumed from a TP checkpoint (DTensor parameters and optimizer state) continues exactly, and
pp=2 x tp=2 over 4 processes matches too.
"""

import dataclasses
import json
from pathlib import Path

import pytest
from train_fixtures import make_dataset, side_by_side, write_config

from omni_parallel.testing import run_world
from omni_train.binder import load_config

pytestmark = pytest.mark.slow


def _train(rank, world_size, cfg, variants, root):
    from torch.distributed.tensor import DTensor

    from omni_train.trainer import Trainer

    out = []
    for name, par in variants:
        par = dict(par)
        steps = par.pop("steps", cfg.train.steps)
        resume = par.pop("resume", False)
        c = dataclasses.replace(
            cfg,
            parallel=dataclasses.replace(cfg.parallel, **par),
            train=dataclasses.replace(cfg.train, steps=steps),
        )
        run = Path(root) / name
        trainer = Trainer(c, run, resume=resume)
        sharded = sum(isinstance(p, DTensor) for p in trainer.stage.parameters())
        assert sharded == (7 * len(trainer.stage.layers) if c.parallel.tp > 1 else 0), (name, sharded)
        trainer.run()
        if rank == 0:
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            out.append(([r["loss"] for r in rows], [r["grad_norm"] for r in rows]))
        else:
            out.append(None)
    return out


def test_tp2_matches_tp1_and_resumes_exactly(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=3, every=0, extra='dtype = "float64"'))
    )
    variants = [
        ("pp2", {"pp": 2, "tp": 1}),
        ("dp2", {"pp": 1, "dp": 2}),
        ("tp2", {"pp": 1, "tp": 2}),
        ("tp2-resumed", {"pp": 1, "tp": 2, "steps": 2}),
        ("tp2-resumed", {"pp": 1, "tp": 2, "resume": True}),
    ]
    w4 = [("pp2tp2", {"pp": 2, "tp": 2}), ("dp2tp2", {"pp": 1, "dp": 2, "tp": 2})]
    w2, w4 = side_by_side(  # other run folders: each world runs on the cores the other leaves idle
        lambda: run_world(_train, 2, args=(cfg, variants, str(tmp_path / "w2")), timeout_s=300),
        lambda: run_world(_train, 4, args=(cfg, w4, str(tmp_path / "w4")), timeout_s=300),
    )
    base, dp2, tp2, _, resumed = w2[0]
    assert len(base[0]) == 3 and base[0][-1] < base[0][0]
    assert tp2[0] == pytest.approx(base[0], rel=1e-10, abs=1e-10)
    assert tp2[1] == pytest.approx(base[1], rel=1e-10, abs=1e-10)
    assert resumed == tp2  # the resumed run's metrics.jsonl holds steps 0-1 then the resumed step 2
    pp2tp2, dp2tp2 = w4[0]
    for got, want in ((pp2tp2, base), (dp2tp2, dp2)):  # dp2: DP ranks read other data than dp1
        assert got[0] == pytest.approx(want[0], rel=1e-10, abs=1e-10)
        assert got[1] == pytest.approx(want[1], rel=1e-10, abs=1e-10)
