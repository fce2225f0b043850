"""LLM ZeRO with tensor parallelism (``parallel.llm_zero`` with ``parallel.tp``, :mod:`omni_parallel.llm_zero`)
in the trainer against one float64 process, losses and every gradient of every step within 1e-10
(``train_reference``), in one world of 4 processes (pp=1 x dp=2 x tp=2, and pp=1 x cp=2 x tp=2); every run
reads its data as ``data.replicas = 2`` data replicas, so the one dp=2 reference serves the dp=1 run too:

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

The gradients the test compares are made whole over both mesh dims (``DTensor.full_tensor``), and the
trainer's recorded gradient norm (``omni_parallel.grad_clip`` over the 2-D shards) equals the reference's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config
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


def _norms(run: Path) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train(rank, world_size, cfg, runs, root):
    from torch.distributed.tensor import DTensor
    from train_reference import relayout_run

    out = []
    for name, par in runs:
        run = Path(root) / name
        seen = {}

        def on_inputs(trainer, step, inputs, seen=seen, zero=par["llm_zero"]):
            from omni_parallel.memory import planned_state_bytes, state_bytes

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
        out.append((got, _norms(run) if rank == 0 else None, seen["meshes"]))
    saved = str(Path(root) / RUNS[0][0] / "checkpoints")
    resumed = relayout_run(with_parallel(cfg, **RESUMED), saved, Path(root) / "resumed", RESUME_AT)
    return out, resumed


def _reference(rank, world_size, cfg, root):
    return reference_run(cfg, Path(root), 2), _norms(Path(root))


def test_llm_zero_with_tp_matches_one_process(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=2, every=1, extra='dtype = "float64"'))
    )
    want, want_norms = run_world(_reference, 1, args=(cfg, str(tmp_path / "ref")), timeout_s=300)[0]
    results, resumed = run_world(_train, 4, args=(cfg, RUNS, str(tmp_path / "w4")), timeout_s=300)[0]
    for (name, _), (got, norms, meshes) in zip(RUNS, results, strict=True):
        assert meshes == [("dp_rest",), ("dp_rest", "tp")], (name, meshes)  # dp_cp is dp_rest here
        assert_runs_match(got, want, name)
        assert norms == pytest.approx(want_norms, abs=1e-10), (name, norms, want_norms)
    assert len(resumed[0]) == cfg.train.steps - RESUME_AT
    assert_runs_match(resumed, (want[0][RESUME_AT:], want[1][RESUME_AT:]), "zero3-tp2-sp resumed")
