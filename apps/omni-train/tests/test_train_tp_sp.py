"""Megatron sequence parallelism in the trainer (``parallel.sequence_parallel``) against one float64 process,
losses and every gradient of every step within 1e-10 (``train_reference``), with media (images and audio
scattered into stage 0's embeddings before its token shard is kept):

* tp=2 + SP (2 processes; also with the LLM blocks recomputed) and pp=2 x tp=2 + SP (4 processes): the norms and the residual stream hold
  ``ceil(T / 2)`` tokens per TP rank (packs padded to even length with a padding document), the stage
  boundary carries that shard (the executor's receive shapes), the norms' weight gradients are summed
  over TP once per step;
* saved activations per rank (``peak_activation_bytes_per_rank`` in ``metrics.jsonl``,
  :mod:`omni_parallel.activation_memory`) at tp=2 with SP are below tp=2 without it;
* across layouts (omni-ckpt's box intersection): the one-process run's step-1 checkpoint (plain tensors)
  resumes at tp=2 + SP, and the pp=2 x tp=2 + SP run's step-1 checkpoint (TP DTensor shards, replicated
  norm DTensors, AdamW state) resumes at pp=2 x tp=1; the two steps after it equal the uninterrupted reference. The
  resumes go through the trainer's own ``--resume --resume-step`` (``train_reference.relayout_run``).
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
    reference_run,
    relayout_run,
    with_parallel,
)

from omni_parallel.testing import run_world
from omni_train.binder import load_config

SP = {"tp": 2, "sequence_parallel": True}
RESUME_AT = 1  # step 2's gradients then depend on step 1's AdamW update from the loaded moments


def _shapes(trainer, step, inputs, out):
    """Per microbatch: (pack tokens, stage-boundary tokens the executor receives); and the LLM gradients
    still partial sums after the step's sync (none: the norms' were summed over TP in one bucket, not
    left to DTensor to all-reduce again in every optimizer and clipping op that reads them)."""
    from torch.distributed.tensor import DTensor

    partial = [
        n
        for n, p in trainer.stage.named_parameters()
        if isinstance(p.grad, DTensor) and any(x.is_partial() for x in p.grad.placements)
    ]
    out.append(
        ([(p.num_tokens, inputs.plan.llm_shapes[k][0]) for k, p in enumerate(inputs.packs, start=1)], partial)
    )


def _parallel(rank, world_size, runs, root):
    out = []
    for name, cfg, par in runs:
        if par.pop("relayout", None) is not None:
            saved = par.pop("saved")
            out.append(
                (relayout_run(with_parallel(cfg, **par), saved, Path(root) / name, RESUME_AT), [], None)
            )
            continue
        shapes: list = []
        got = capture_run(
            with_parallel(cfg, **par),
            Path(root) / name,
            on_inputs=lambda t, s, i, o=shapes: _shapes(t, s, i, o),
        )
        rows = None
        if rank == 0:
            rows = [
                json.loads(line) for line in (Path(root) / name / "metrics.jsonl").read_text().splitlines()
            ]
        out.append((got, shapes, rows))
    return out


def _references(rank, world_size, refs, root):
    return [reference_run(cfg, Path(root) / name, 1) for name, cfg in refs]


def test_sequence_parallel_config_is_checked(tmp_path):
    from omni_train.config import ConfigError
    from omni_train.preflight import validate

    data = make_dataset(tmp_path / "data", n_image=4, n_audio=2, n_text=4)
    cfg = load_config(str(write_config(tmp_path / "c.toml", data, pp=1)))
    validate(with_parallel(cfg, **SP), 2)
    for par, nproc, msg in (
        ({"sequence_parallel": True}, 1, "needs parallel.tp > 1"),
        ({"tp": 2, "sequence_parallel": 1}, 2, "must be true or false"),
    ):
        with pytest.raises(ConfigError, match=msg) as exc:
            validate(with_parallel(cfg, **par), nproc)
        assert str(exc.value).startswith("parallel.sequence_parallel: "), exc.value


@pytest.mark.slow
def test_tp2_sequence_parallel_matches_one_process_saves_activations_and_resumes(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=3, every=1, extra='dtype = "float64"'))
    )
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, keep_last=3))
    refs, w4 = side_by_side(  # other run folders: the reference runs on the world's idle core time
        lambda: run_world(_references, 1, args=([("ref", cfg)], str(tmp_path / "ref")), timeout_s=600),
        lambda: run_world(
            _parallel, 4, args=([("pp2tp2-sp", cfg, {"pp": 2, **SP})], str(tmp_path / "w4")), timeout_s=600
        ),
    )
    (want,) = refs[0]
    tail = (want[0][RESUME_AT:], want[1][RESUME_AT:])

    recompute = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute=["llm"]))
    runs2 = [
        ("tp2-sp", cfg, {"pp": 1, **SP}),
        ("tp2", cfg, {"pp": 1, "tp": 2}),
        ("tp2-sp-recompute", recompute, {"pp": 1, **SP}),  # the all-gathers re-run in backward
        # the one-process run's checkpoint at tp=2 + SP; pp=2 x tp=2 + SP's at pp=2 x tp=1
        ("from-tp1", cfg, {"pp": 1, **SP, "relayout": 1, "saved": str(tmp_path / "ref" / "ref" / "checkpoints")}),
        ("from-pp2tp2-sp", cfg, {"pp": 2, "relayout": 1, "saved": str(tmp_path / "w4" / "pp2tp2-sp" / "checkpoints")}),
    ]  # fmt: skip
    w2 = run_world(_parallel, 2, args=(runs2, str(tmp_path / "w2")), timeout_s=900)
    pp2tp2, (sp, sp_shapes, sp_rows), (_, _, tp_rows), (rc, _, _), from_tp1, from_sp = (
        w4[0][0], *w2[0]
    )  # fmt: skip
    assert_runs_match(pp2tp2[0], want, "pp2tp2-sp")
    assert_runs_match(sp, want, "tp2-sp")
    assert_runs_match(rc, want, "tp2-sp-recompute")
    for name, (got, _, _) in (("from-tp1", from_tp1), ("from-pp2tp2-sp", from_sp)):
        assert len(got[0]) == cfg.train.steps - RESUME_AT
        assert_runs_match(got, tail, name)

    # the layout did what it is for: stage boundaries carry half of each (padded) pack's tokens ...
    for shapes in (sp_shapes, pp2tp2[1]):
        assert not [n for _, partial in shapes for n in partial], shapes
        pairs = [pair for step, _ in shapes for pair in step]
        assert pairs and all(local == -(-tokens // 2) for tokens, local in pairs), pairs
        assert any(tokens % 2 for tokens, _ in pairs), "no odd pack: padding untested"
    # ... and every rank saves fewer activation bytes than at tp=2 without SP
    with_sp = [max(r["peak_activation_bytes_per_rank"][i] for r in sp_rows) for i in range(2)]
    without = [max(r["peak_activation_bytes_per_rank"][i] for r in tp_rows) for i in range(2)]
    print(f"peak saved activation bytes per rank, tp=2: with SP {with_sp}, without {without}")
    assert all(0 < a < b for a, b in zip(with_sp, without)), (with_sp, without)
