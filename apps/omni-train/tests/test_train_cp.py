"""Context parallelism and hybrid DP/CP in the trainer, against one float64 process.

* cp=2 on 2 processes, all-gather and ring K/V, with media (each CP rank encodes its share of every
  encoder microbatch; the embeddings reach their head-tail chunks by the resharding all-reduce) and
  text only: losses, gradient norms and token counts equal one process running the whole model (pp=1),
  step for step (<= 1e-10). Documents of odd length (padding) are in every pack.
* hybrid DP/CP (dp=1 x cp=2 ranks per stage, pp=2, 4 processes) on a long-tailed length mix: the stage's
  two ranks share packs of 2 x max_seq_len tokens, short samples whole on one rank, long ones CP-sharded;
  equal to one process training on those packs whole (losses, gradient norms, tokens); at pp=1 (2
  processes, media) losses and every gradient too.
* regressions from the field: a document of length 7 at cp=2 (padding tokens carry no target and every
  real token is held once); a microbatch with fewer images than CP ranks (a rank without media still
  joins the resharding all-reduce, forward and backward); RoPE positions per CP rank equal the
  reference (the pack's positions through the head-tail shard map); the hybrid plan's hash is the same on
  every rank for lengths 7441/11949/12075 at cp=4.
"""

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from train_fixtures import make_dataset, write_config

from omni_data import Modality, Pack, SampleMeta
from omni_parallel import cp_layout, local_sequence, plan_hybrid_cp, shard_for_cp
from omni_parallel.testing import run_world
from omni_train.batch import IGNORE, build_llm_microbatch
from omni_train.config import load_config, validate
from omni_train.cp_sharding import CPSharding

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
    base, base_text = (
        r[:3] for r in run_world(_train, 1, args=(cfg, refs, str(tmp_path / "w1")), timeout_s=300)[0]
    )
    assert base[0][-1] < base[0][0]
    variants = [
        ("cp2", {"pp": 1, "cp": 2}),
        ("cp2-ring", {"pp": 1, "cp": 2, "cp_attention": "ring"}),
        ("cp2-ring-text", {"pp": 1, "cp": 2, "cp_attention": "ring", "data": {"mixture": text}}),
    ]
    cp2, ring, ring_text = run_world(_train, 2, args=(cfg, variants, str(tmp_path / "w2")), timeout_s=400)[0]
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
    ref = run_world(
        _train,
        1,
        args=(cfg, [("pp1", {"pp": 1, "data": {"max_seq_len": 96}})], str(tmp_path / "w1")),
        timeout_s=300,
    )[0][0]
    hybrid = [("hybrid", {"pp": 2, "cp": 2, "hybrid_cp": True, "data": {"max_seq_len": 48}})]
    (digests, (got,)), *_ = run_world(
        _hybrid_world, 4, args=(cfg, hybrid, str(tmp_path / "w4")), timeout_s=600
    )
    assert len({d[0] for d in digests}) == 1  # every rank planned the same slots
    assert all(t <= 8192 for t in digests[0][1]) and digests[0][2] == [2, 4]
    _close(got, ref[:3])
    assert got[3] == [1, 2]  # short samples whole on one rank and long ones CP-sharded, in the same run


def _pack(lengths_media):
    samples = []
    for i, (media, text) in enumerate(lengths_media):
        mod = Modality.IMAGE if media else Modality.TEXT
        flops = 1.0 + i if media else 0.0
        shape = (3, 28, 28) if media else (text,)
        samples.append(SampleMeta(f"s{i}", mod.value, mod, media, text, flops, shape))
    return Pack(samples, sum(m + t for m, t in lengths_media))


def test_document_of_length_7_at_cp2_and_rope_positions_per_rank():
    pack = _pack([(0, 7), (4, 3), (0, 12), (2, 1)])  # documents of 7, 7, 12 and 3 tokens
    ids = {s.uid: torch.arange(s.text_tokens) + 10 for s in pack.samples}
    mb = build_llm_microbatch(pack, ids, {Modality.IMAGE: 3})
    cu = mb.cu_seqlens
    held, targets = [], 0
    for r in range(2):
        sh = CPSharding(2, r, {}, "allgather", microbatches=1, slices=1)
        local = sh.microbatch(mb, pack)
        src = torch.tensor(sh.local(pack).source)
        real = src >= 0
        assert local.num_tokens == cp_layout(cu, 2).tokens_local
        # RoPE: every real token keeps its in-document position (not its row on this rank)
        want = shard_for_cp(pack.position_ids.unsqueeze(1), cu, cp_rank=r, cp_size=2).squeeze(1)
        assert torch.equal(local.position_ids[real], want[real])
        assert torch.equal(local.position_ids[real], pack.position_ids[src[real]])
        # padding: token 0, no target; real rows keep the whole pack's label (across chunk boundaries)
        assert (local.labels[~real] == IGNORE).all() and (local.input_ids[~real] == 0).all()
        assert torch.equal(local.labels[real], mb.labels[src[real]])
        held += src[real].tolist()
        targets += local.num_targets
    assert sorted(held) == list(range(mb.num_tokens)) and targets == mb.num_targets


def _media_world(rank, world_size):
    # Two packs, one image each: the image is encoded by CP rank 0 (its owner), rank 1 encodes nothing.
    # Pack 1: rank 1 holds two of the image's tokens; pack 2: rank 1 holds none of them. Either way both
    # ranks run the resharding all-reduce forward and backward, and the embeddings land where the
    # reference (the whole pack's embedding rows through the head-tail shard map) puts them.
    out = []
    for lengths in ([(4, 3), (0, 7)], [(1, 6), (0, 5)]):
        pack = _pack(lengths)
        sh = CPSharding(2, rank, {(2, 0): dist.group.WORLD}, "allgather", microbatches=1, slices=1)
        positions = sh.rank_positions([pack], 1)
        g = torch.Generator().manual_seed(len(lengths[0]) + lengths[0][0])
        emb = torch.randn(pack.num_tokens, 5, generator=g, dtype=torch.float64)
        w = torch.randn(pack.num_tokens, 5, generator=g, dtype=torch.float64)
        mine = emb[positions[rank]].clone().requires_grad_(True) if positions[rank] else None
        rows_in = mine if mine is not None else torch.zeros(0, 5, dtype=torch.float64)
        embeds, rows = sh.deliver_media(pack, rows_in, positions)
        cu = [0, *torch.cumsum(torch.tensor(pack.seqlens), 0).tolist()]
        h = torch.zeros(sh.local(pack).tokens, 5, dtype=torch.float64).index_put((rows,), embeds)
        full = torch.zeros_like(emb)
        media = [p for rank_rows in positions for p in rank_rows]
        full[media] = emb[media]
        want = shard_for_cp(full, cu, cp_rank=rank, cp_size=2)
        (h * shard_for_cp(w, cu, cp_rank=rank, cp_size=2)).sum().backward()
        grad_err = 0.0 if mine is None else (mine.grad - w[positions[rank]]).abs().max().item()
        out.append((len(positions[1]), (h - want).abs().max().item(), grad_err, int(rows.numel())))
    return out


def test_microbatch_with_fewer_images_than_cp_ranks():
    results = run_world(_media_world, 2, timeout_s=120)
    for rank, res in enumerate(results):
        for encoded_by_rank1, err, grad_err, _ in res:
            assert encoded_by_rank1 == 0, rank  # one image: rank 1 has nothing to encode
            assert err <= TOL and grad_err <= TOL, (rank, res)
    assert [r[3] for r in results[1]] == [
        2,
        0,
    ]  # rank 1 holds 2 of the first image's tokens, none of the second's


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
    want = run_world(_capture, 1, args=(ref, str(tmp_path / "ref")), timeout_s=300)[0][0]
    hybrid = with_parallel(cfg, cp=2, hybrid_cp=True, data_max_seq_len=48)
    got, cps = run_world(_capture, 2, args=(hybrid, str(tmp_path / "hybrid")), timeout_s=300)[0]
    assert cps == [1, 2], cps  # short samples whole on one rank, long ones CP-sharded
    assert_runs_match(got, want, "hybrid dp/cp")
