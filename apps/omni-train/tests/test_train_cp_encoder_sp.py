"""Long-short SP of the encoders over the CP group (``parallel.encoder_sp = parallel.cp``, issue 17's "CP
reshard path") in the trainer, against one float64 process: losses and every gradient of every step within
1e-10 (``train_reference``).

cp=2 on 2 gloo processes, ``long_threshold`` 2 merged tokens: every image above it is split along the
sequence over both CP ranks (Ulysses attention inside the ViT), audio and small images go whole to one CP
rank balanced by cost, and the rows reach each rank's head-tail slots by ``reshard_to_llm``'s CP
all-reduce. The run must really split: some encoder microbatch holds a long image and some a short
sample, and both CP ranks receive media rows. The encoders' layout (``SequenceLayout(ReshardMode.CP, 2)``)
must be the LLM's plain-CP layout (``CPSharding.local``) on every pack, or embeddings would land on the
wrong tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from train_fixtures import make_dataset, side_by_side, write_config
from train_reference import assert_runs_match, capture_run, reference_run, with_parallel

from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.preflight import validate

pytestmark = pytest.mark.slow


def _check_step(trainer, step, inputs, out):
    sh, par = trainer.sharding, trainer.builder.parallel
    rank = sh.rank
    for pack in inputs.packs:
        if par.layout.mode is not None and list(par.layout.sources(pack)[rank]) != list(
            sh.local(pack).source
        ):
            out["layout_mismatch"].append((step, pack.seqlens))
    for work in inputs.encoder_work.values():
        out["long"] += len(work.long)
        out["short"] += len(work.short)
    out["media_rows"] += sum(int(p.numel()) for p in inputs.media_positions.values())


def _cp_world(rank, world_size, cfg, root):
    validate(cfg, world_size)
    seen = {"layout_mismatch": [], "long": 0, "short": 0, "media_rows": 0}
    got = capture_run(cfg, Path(root), on_inputs=lambda t, s, i: _check_step(t, s, i, seen))
    return got, seen


def _reference(rank, world_size, cfg, root):
    return reference_run(cfg, Path(root), 1)


def test_cp2_encoder_sp2_long_images_match_one_process(tmp_path):
    data = make_dataset(tmp_path / "data", n_image=12, n_audio=6, n_text=20)
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=2, every=0, pp=1, extra='dtype = "float64"'))
    )
    par = with_parallel(cfg, cp=2, encoder_sp=2, long_threshold=2)
    reference, results = side_by_side(  # other run folders: the reference runs on the 2 ranks' idle core
        lambda: run_world(_reference, 1, args=(cfg, str(tmp_path / "ref")), timeout_s=300),
        lambda: run_world(_cp_world, 2, args=(par, str(tmp_path / "cp2")), timeout_s=300),
    )
    want = reference[0]
    assert_runs_match(results[0][0], want, "cp2-encoder_sp2")
    for rank, (_, seen) in enumerate(results):
        assert not seen["layout_mismatch"], f"rank {rank}: encoder layout is not the LLM's CP layout"
        assert seen["long"] > 0, f"rank {rank}: no image was long (split over the CP group)"
        assert seen["media_rows"] > 0, f"rank {rank}: received no media rows"
    assert sum(seen["short"] for _, seen in results) > 0, "no sample went whole to one CP rank"
    # The CP ranks' own split of the encoder microbatches (encoder_sp 1: CPSharding's share and delivery),
    # all-gather and ring K/V: every gradient too, not only the norms test_train_cp.py compares.
    # (the two 2-process worlds side by side, other run folders: each runs on the other's idle core time)
    attentions = ("allgather", "ring")
    worlds = side_by_side(
        *(
            lambda attention=attention: run_world(
                _cp_world,
                2,
                args=(with_parallel(cfg, cp=2, cp_attention=attention), str(tmp_path / f"cp2-{attention}")),
                timeout_s=300,
            )
            for attention in attentions
        )
    )
    for attention, results in zip(attentions, worlds):
        assert_runs_match(results[0][0], want, f"cp2-{attention}")
        assert all(seen["media_rows"] > 0 for _, seen in results), "a CP rank received no media rows"
