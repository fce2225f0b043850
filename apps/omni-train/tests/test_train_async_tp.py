"""Async TP in the trainer (``parallel.async_tp``, :mod:`omni_parallel.async_tp`) against one float64 process:

* the config is checked: ``async_tp`` needs ``sequence_parallel`` (so ``tp > 1``), is a bool, and is refused
  with CP / Ulysses (accepted with ``train.compile`` and recompute);
* tp=2 + SP + async TP (2 processes), also with the LLM blocks recomputed (the rings re-run in backward):
  the loss and every gradient of a step within 1e-10 of the one-process run (``train_reference``), with
  media scattered into stage 0's embeddings; every LLM block's attention and MLP ran through the async-TP
  rings (their projections' forwards are :class:`omni_parallel.async_tp.AsyncTPRegion`'s), with the plain
  SP plan's placements (so checkpoints load across ``async_tp`` either way). One step: what async TP
  changes is the step's forward and backward; the optimizer and the step after it are SP's, tested in
  ``test_train_tp_sp.py``. The overlap itself is checked in omni-parallel's ``test_parallel_async_tp.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from train_fixtures import make_dataset, side_by_side, write_config
from train_reference import assert_runs_match, capture_run, reference_run, with_parallel

from omni_parallel.testing import run_world
from omni_train.binder import load_config

ASYNC = {"tp": 2, "sequence_parallel": True, "async_tp": True, "pp": 1}


def _async_regions(trainer, step, inputs, out):
    """Per step: (blocks whose attention and MLP projections run through async TP, their placements)."""
    from torch.distributed.tensor import DTensor

    blocks = list(trainer.stage.layers.values())
    ran = [
        all(
            getattr(m, name).forward.__module__ == "omni_parallel.async_tp"
            for m, names in ((b.attn, ("wq", "wk", "wv", "wo")), (b.mlp, ("w1", "w3", "w2")))
            for name in names
        )
        for b in blocks
    ]
    placements = {n: str(p.placements) for n, p in trainer.stage.named_parameters() if isinstance(p, DTensor)}
    out.append((ran, placements))


def _parallel(rank, world_size, runs, root):
    out = []
    for name, cfg in runs:
        seen: list = []
        got = capture_run(
            cfg, Path(root) / name, on_inputs=lambda t, s, i, o=seen: _async_regions(t, s, i, o)
        )
        out.append((got, seen))
    return out


def _reference(rank, world_size, cfg, root):
    return reference_run(cfg, Path(root), 1)


def test_async_tp_config_is_checked(tmp_path):
    from omni_train.config import ConfigError
    from omni_train.preflight import validate

    data = make_dataset(tmp_path / "data", n_image=2, n_audio=2, n_text=4)
    cfg = load_config(str(write_config(tmp_path / "c.toml", data, pp=1)))
    validate(with_parallel(cfg, **ASYNC), 2)
    compiled = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=True, recompute=["llm"]))
    validate(with_parallel(compiled, **ASYNC), 2)  # compiled blocks break the graph around the rings
    for par, nproc, msg in (
        ({"tp": 2, "async_tp": True}, 2, "needs parallel.sequence_parallel = true"),
        ({"async_tp": True}, 1, "needs parallel.sequence_parallel = true"),
        ({**ASYNC, "async_tp": 1}, 2, "must be true or false"),
        ({**ASYNC, "ulysses": 2}, 4, "ulysses 2"),
        ({**ASYNC, "cp": 2}, 4, "parallel.cp 2"),
    ):
        with pytest.raises(ConfigError, match=msg) as exc:
            validate(with_parallel(cfg, **par), nproc)
        assert str(exc.value).startswith("parallel.async_tp: "), exc.value


@pytest.mark.slow
def test_tp2_async_tp_matches_one_process(tmp_path):
    data = make_dataset(tmp_path / "data", n_image=8, n_audio=4, n_text=12)
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=1, every=0, extra='dtype = "float64"'))
    )
    sp = with_parallel(cfg, **ASYNC)
    recompute = dataclasses.replace(sp, train=dataclasses.replace(sp.train, recompute=["llm"]))
    runs = [("async", sp), ("async-recompute", recompute)]
    reference, world = side_by_side(  # other run folders: the reference runs on the 2 ranks' idle core
        lambda: run_world(_reference, 1, args=(cfg, str(tmp_path / "ref")), timeout_s=300),
        lambda: run_world(_parallel, 2, args=(runs, str(tmp_path / "w2")), timeout_s=600),
    )
    (want,), results = reference[:1], world[0]
    for (name, _), (got, seen) in zip(runs, results):
        assert_runs_match(got, want, name)
        assert seen and all(all(ran) and ran for ran, _ in seen), (name, seen)
        # the plain SP plan's placements: Q/K/V, gate/up Shard(0); O, down Shard(1); norms Replicate
        for _, placements in seen:
            kinds = {n.rsplit(".", 2)[-2]: p for n, p in placements.items() if ".layers." in f".{n}"}
            assert kinds == {
                **dict.fromkeys(("wq", "wk", "wv", "w1", "w3"), "(Shard(dim=0),)"),
                **dict.fromkeys(("wo", "w2"), "(Shard(dim=1),)"),
                **dict.fromkeys(("attn_norm", "mlp_norm"), "(Replicate(),)"),
            }, placements
