"""Context parallelism and hybrid DP/CP in the trainer, against one float64 process.

* cp=2 on 2 processes, all-gather and ring K/V, with media (each CP rank encodes its share of every
  encoder microbatch; the embeddings reach their head-tail chunks by the resharding all-reduce) and
  text only: losses, gradient norms and token counts equal one process running the whole model (pp=1),
  step for step (<= 1e-10). Documents of odd length (padding) are in every pack.
* hybrid DP/CP (dp=1 x cp=2 ranks per stage, pp=2, 4 processes) on a long-tailed length mix: the stage's
  two ranks share packs of 2 x max_seq_len tokens, short samples whole on one rank, long ones CP-sharded;
  equal to one process training on those packs whole (losses, gradient norms, tokens); at pp=1 (2
  processes, media) losses and every gradient too.
* a regression from the field: the hybrid plan's hash is the same on every rank for lengths
  7441/11949/12075 at cp=4.

The CP layout and media delivery on their own (a document of length 7, fewer images than CP ranks) are
tested in omni-pipeline's ``test_pipeline_cp_delivery.py``.
"""

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch.distributed as dist
from train_fixtures import make_dataset, side_by_side, write_config

from omni_parallel import local_sequence, plan_hybrid_cp
from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.preflight import validate

pytestmark = pytest.mark.slow

TOL = 1e-10


def _train(rank, world_size, cfg, variants, root):
    from omni_train.trainer import Trainer

    out = []
    for name, change in variants:
        change = dict(change)
        data = dataclasses.replace(cfg.data, **change.pop("data", {}))
        c = dataclasses.replace(cfg, data=data, parallel=dataclasses.replace(cfg.parallel, **change))
        validate(c, world_size)
        run = Path(root) / name
        trainer = Trainer(c, run, resume=False)
        trainer.run()
        cps = sorted(
            {
                s.cp
                for slots, _ in (trainer.sharding._cache.values() if trainer.sharding else [])
                for s in slots
            }
        )
        if rank == 0:
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            if c.parallel.hybrid_cp:
                # Every pack planned above the per-rank cap is in the metrics: count them from the plans.
                over = sum(
                    any(local_sequence(list(k), slots, r).tokens > c.data.max_seq_len for r in range(sh.size))
                    for sh in [trainer.sharding]
                    for k, (slots, _) in sh._cache.items()
                )
                assert rows[-1]["hybrid_cp_raised_caps"] == over, (
                    rows[-1].get("hybrid_cp_raised_caps"),
                    over,
                )
            out.append(
                ([r["loss"] for r in rows], [r["grad_norm"] for r in rows], [r["tokens"] for r in rows], cps)
            )
        else:
            out.append(None)
    return out


def _close(got, want):
    assert len(got[0]) == len(want[0])
    assert got[0] == pytest.approx(want[0], rel=TOL, abs=TOL)
    assert got[1] == pytest.approx(want[1], rel=TOL, abs=TOL)
    assert got[2] == want[2]


def test_cp2_allgather_and_ring_match_one_process(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=3, every=0, extra='dtype = "float64"'))
    )
    text = [dataclasses.replace(m, weights={"text": 1.0}) for m in cfg.data.mixture]
    refs = [("pp1", {"pp": 1}), ("pp1-text", {"pp": 1, "data": {"mixture": text}})]
    variants = [
        ("cp2", {"pp": 1, "cp": 2}),
        ("cp2-ring", {"pp": 1, "cp": 2, "cp_attention": "ring"}),
        ("cp2-ring-text", {"pp": 1, "cp": 2, "cp_attention": "ring", "data": {"mixture": text}}),
    ]
    one, two = side_by_side(  # other run folders: the one process runs on the core the 2 ranks leave idle
        lambda: run_world(_train, 1, args=(cfg, refs, str(tmp_path / "w1")), timeout_s=300),
        lambda: run_world(_train, 2, args=(cfg, variants, str(tmp_path / "w2")), timeout_s=400),
    )
    base, base_text = (r[:3] for r in one[0])
    assert base[0][-1] < base[0][0]
    cp2, ring, ring_text = two[0]
    _close(cp2, base)
    _close(ring, base)
    _close(ring_text, base_text)
    assert ring_text[0] != ring[0]


def _hybrid_world(rank, world_size, cfg, variants, root):
    # The plan of a field report, on every rank: the same slots, whatever the process.
    plan = plan_hybrid_cp([7441, 11949, 12075], 4, 8192)
    digest = hashlib.sha256(repr(plan.slots).encode()).hexdigest()
    held = [local_sequence([7441, 11949, 12075], plan.slots, r).tokens for r in range(4)]
    digests: list = [None] * world_size
    dist.all_gather_object(digests, (digest, held, sorted({s.cp for s in plan.slots})))
    return digests, _train(rank, world_size, cfg, variants, root)


def test_hybrid_dp_cp_at_pp2_matches_one_process_on_a_long_tailed_mix(tmp_path):
    data = make_dataset(tmp_path / "data", n_text=40, seed=3, text_words_lognormal=(2.8, 0.9))
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=3, every=0, extra='dtype = "float64"'))
    )
    hybrid = [("hybrid", {"pp": 2, "cp": 2, "hybrid_cp": True, "data": {"max_seq_len": 48}})]
    one, four = side_by_side(  # other run folders: the one process runs on the world's idle core time
        lambda: run_world(
            _train,
            1,
            args=(cfg, [("pp1", {"pp": 1, "data": {"max_seq_len": 96}})], str(tmp_path / "w1")),
            timeout_s=300,
        ),
        lambda: run_world(_hybrid_world, 4, args=(cfg, hybrid, str(tmp_path / "w4")), timeout_s=600),
    )
    ref = one[0][0]
    (digests, (got,)), *_ = four
    assert len({d[0] for d in digests}) == 1  # every rank planned the same slots
    assert all(t <= 8192 for t in digests[0][1]) and digests[0][2] == [2, 4]
    _close(got, ref[:3])
    assert got[3] == [1, 2]  # short samples whole on one rank and long ones CP-sharded, in the same run


def _capture(rank, world_size, cfg, root):
    from train_reference import capture_run

    validate(cfg, world_size)
    cps: set[int] = set()

    def seen(trainer, step, inputs):
        if trainer.sharding is not None:
            cps.update(s.cp for slots, _ in trainer.sharding._cache.values() for s in slots)

    return capture_run(cfg, Path(root), on_inputs=seen), sorted(cps)


def test_hybrid_dp_cp_every_gradient_matches_one_process(tmp_path):
    """Hybrid DP/CP (dp=1 x cp=2 at pp=1, media and a long-tailed text mix): the losses and every gradient
    of every step equal one float64 process training the same packs of 2 x max_seq_len tokens whole."""
    from train_reference import assert_runs_match, with_parallel

    data = make_dataset(tmp_path / "data", n_text=40, seed=3, text_words_lognormal=(2.8, 0.9))
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=2, every=0, pp=1, extra='dtype = "float64"'))
    )
    ref = with_parallel(cfg, data_max_seq_len=96)
    hybrid = with_parallel(cfg, cp=2, hybrid_cp=True, data_max_seq_len=48)
    one, two = side_by_side(  # other run folders: the one process runs on the core the 2 ranks leave idle
        lambda: run_world(_capture, 1, args=(ref, str(tmp_path / "ref")), timeout_s=300),
        lambda: run_world(_capture, 2, args=(hybrid, str(tmp_path / "hybrid")), timeout_s=300),
    )
    want = one[0][0]
    got, cps = two[0]
    assert cps == [1, 2], cps  # short samples whole on one rank, long ones CP-sharded
    assert_runs_match(got, want, "hybrid dp/cp")
