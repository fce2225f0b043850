"""LLM ZeRO with tensor parallelism (``parallel.llm_zero`` with ``parallel.tp``, :mod:`omni_parallel.llm_zero`)
in the trainer against one float64 process, losses and every gradient of every step within 1e-10
(``train_reference``), in one world of 4 processes (pp=1 x dp=2 x tp=2, pp=1 x cp=2 x tp=2 and pp=2 x tp=2); every run
reads its data as ``data.replicas = 2`` data replicas, so the one dp=2 reference serves the dp=1 runs too:

* ``llm_zero = 2``: FSDP2 over the 2-D ``(dp_cp, tp)`` mesh sliced from the parallel state's one device
  mesh (``ParallelState.data_mesh``) (torchtitan's FSDP2 + TP): each TP DTensor's TP-local tensor sharded along dim 0 over the data group
  (``_StridedShard(0)`` before a column-parallel weight's ``Shard(0)``), gathered once per step, its gradient
  reduce-scattered once per step into those shards;
* ``llm_zero = 1`` with Megatron sequence parallelism: the norms' ``Partial`` weight gradients summed over
  TP inside the ZeRO sync, then the whole gradients all-reduced over the data group, each shard's gradient
  a view of its rows;
* a resume across layouts and ZeRO stages: the ``llm_zero = 2`` run's step-1 checkpoint (the strided 2-D
  shards of the parameters and AdamW moments, omni-ckpt's ``dtensor_box``) loaded at pp=1 x cp=2 x tp=2
  with sequence parallelism and ``llm_zero = 3`` through the trainer's ``--resume --resume-step``: FSDP2
  over the CP and DP ranks flattened into one dimension of the device mesh (``ParallelState.data_mesh``);
  step 2 there equals the reference's (the norms' partial sums over TP before the reduce-scatter).

* pp=2 x tp=2 with sequence parallelism and ``llm_zero = 3``: the data group has one rank, so
  ``apply_llm_zero`` falls back to stage 0 (``apply_dp``: ``reduce_partial_gradients`` sums the norms'
  ``Partial`` gradients over TP on both pipeline stages). A pp > 1 run with FSDP2 + TP (a data group > 1)
  needs 8 ranks and is not here.

The gradients the test compares are made whole over both mesh dims (``DTensor.full_tensor``), rank 0's
merge of every rank's (``capture_run``) and each rank's own, every rank's checked by name; no LLM gradient
is still ``Partial`` after the sync on any rank (``full_tensor`` and AdamW would sum one silently). The
trainer's recorded gradient norm (``omni_parallel.grad_clip`` over the 2-D shards) equals the reference's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from train_fixtures import make_dataset, side_by_side, write_config
from train_reference import assert_runs_match, capture_run, reference_run, with_parallel

from omni_parallel.testing import run_world
from omni_train.binder import load_config

pytestmark = pytest.mark.slow

BASE = {"pp": 1, "dp": 2, "tp": 2, "data_replicas": 2}
RUNS = [
    ("zero2-tp2", {**BASE, "llm_zero": 2}),
    ("zero1-tp2-sp", {**BASE, "llm_zero": 1, "sequence_parallel": True}),
]
RESUMED = {**BASE, "dp": 1, "cp": 2, "llm_zero": 3, "sequence_parallel": True}  # zero2-tp2's step 1
RESUME_AT = 1
# pp = 2 x tp = 2 + SP at llm_zero = 3: with dp = 1 the stage's data group has one rank, so apply_llm_zero
# takes its one-rank branch (nothing to shard: stage 0, apply_dp, whose sync sums the norms' Partial
# gradients over TP with reduce_partial_gradients, on both pipeline stages). 4 ranks leave no room for a
# data group > 1 with pp = 2 and tp = 2 (8 ranks), so FSDP2 + TP at pp > 1 is not run here.
PIPELINED = ("zero3-pp2-tp2-sp", {**BASE, "pp": 2, "dp": 1, "llm_zero": 3, "sequence_parallel": True})


def _norms(run: Path) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _own_grads(trainer, mine: list) -> None:
    """This rank's own gradients made whole (collective over their meshes, every rank in the same order),
    appended to ``mine`` with the names of the LLM parameters whose gradient is still a ``Partial`` DTensor
    after the step's sync: each rank's result is compared with the reference, not only rank 0's merge.
    (``full_tensor`` and AdamW sum a ``Partial`` gradient themselves, so a missing TP sum of the norms'
    gradients would leave the values right; the placements show it.)"""
    from torch.distributed.tensor import DTensor
    from train_reference import _whole_grads

    partial = [
        n
        for n, p in trainer.stage.named_parameters()
        if isinstance(p.grad, DTensor) and any(x.is_partial() for x in p.grad.placements)
    ]
    mine.append((_whole_grads(trainer), partial))


def _relayout(cfg, saved: str, run: Path, resume_at: int, mine: list):
    """``train_reference.relayout_run`` with each rank's own gradients captured into ``mine``."""
    import shutil

    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(saved, run / "checkpoints")
    dist.barrier()
    out = capture_run(cfg, run, resume_step=resume_at, on_inputs=lambda t, s, i: _own_grads(t, mine))
    return None if out is None else (out[0][-(cfg.train.steps - resume_at) :], out[1])


def _train(rank, world_size, cfg, runs, root):
    from torch.distributed.tensor import DTensor

    out = []
    for name, par in runs:
        run = Path(root) / name
        seen = {"mine": []}

        def on_inputs(trainer, step, inputs, seen=seen, zero=par["llm_zero"]):
            from omni_parallel.memory import planned_state_bytes, state_bytes

            _own_grads(trainer, seen["mine"])
            # every LLM parameter an FSDP2 shard; the TP ones over the 2-D (dp_rest, tp) mesh
            meshes = {
                p.device_mesh.mesh_dim_names for p in trainer.stage.parameters() if isinstance(p, DTensor)
            }
            seen["meshes"] = sorted(meshes)
            # the bytes the memory plan predicts (TP shard / dp; ZeRO-1's whole TP-local gradients) are the
            # ones held after the sync of a step with AdamW state (the last step's win)
            chunks = list(trainer.stage.chunks.values())
            seen["bytes"] = (
                state_bytes(chunks, trainer.optimizer),
                planned_state_bytes(chunks, trainer.optimizer, whole_gradients=zero == 1),
            )

        got = capture_run(with_parallel(cfg, **par), run, on_inputs=on_inputs)
        measured, planned = seen["bytes"]
        assert measured == planned, (name, rank, measured, planned)
        out.append((got, _norms(run) if rank == 0 else None, seen["meshes"], seen["mine"]))
    saved = str(Path(root) / RUNS[0][0] / "checkpoints")
    mine: list = []
    resumed = _relayout(with_parallel(cfg, **RESUMED), saved, Path(root) / "resumed", RESUME_AT, mine)
    return out, (resumed, mine)


def _reference(rank, world_size, cfg, root):
    return reference_run(cfg, Path(root), 2), _norms(Path(root))


def _assert_every_rank_matches(per_rank: list[list[dict]], want_grads: list[dict], name: str) -> None:
    """Every rank's own whole gradients, step by step, within 1e-10 of the reference's, by name (a rank
    holds its pipeline stage's LLM parameters and the encoders), none still ``Partial`` after the sync;
    together the ranks hold every parameter."""
    held: set[str] = set()
    for rank, mine in enumerate(per_rank):
        assert len(mine) == len(want_grads), (name, rank, len(mine))
        for step, ((g, partial), r) in enumerate(zip(mine, want_grads, strict=True)):
            assert partial == [], f"{name}: rank {rank} step {step}: still Partial after the sync: {partial}"
            assert set(g) <= set(r), (
                f"{name}: rank {rank} step {step} holds {set(g) - set(r)} (not the reference's)"
            )
            held |= set(g)
            for n, x in g.items():
                diff = float(np.abs(x - r[n]).max()) if x.size else 0.0
                assert diff <= 1e-10, f"{name}: rank {rank} step {step} gradient of {n} differs by {diff}"
    assert held == set(want_grads[0]), (name, set(want_grads[0]) - held)


def test_llm_zero_with_tp_matches_one_process(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=2, every=1, extra='dtype = "float64"'))
    )
    runs = [*RUNS, PIPELINED]
    reference, world = side_by_side(  # other run folders: the reference runs on the world's idle core time
        lambda: run_world(_reference, 1, args=(cfg, str(tmp_path / "ref")), timeout_s=300),
        lambda: run_world(_train, 4, args=(cfg, runs, str(tmp_path / "w4")), timeout_s=300),
    )
    want, want_norms = reference[0]
    results, (resumed, _) = world[0]
    for i, ((name, _), (got, norms, meshes, _)) in enumerate(zip(runs, results, strict=True)):
        if name == PIPELINED[0]:  # stage 0 at dp_cp = 1: TP DTensors, no FSDP2 mesh
            assert meshes == [("tp",)], (name, meshes)
        else:
            assert meshes == [("dp_rest",), ("dp_rest", "tp")], (name, meshes)  # dp_cp is dp_rest here
        assert_runs_match(got, want, name)
        assert norms == pytest.approx(want_norms, abs=1e-10), (name, norms, want_norms)
        _assert_every_rank_matches([r[0][i][3] for r in world], want[1], name)
    assert len(resumed[0]) == cfg.train.steps - RESUME_AT
    tail = (want[0][RESUME_AT:], want[1][RESUME_AT:])
    assert_runs_match(resumed, tail, "zero3-tp2-sp resumed")
    _assert_every_rank_matches([r[1][1] for r in world], tail[1], "zero3-tp2-sp resumed")
