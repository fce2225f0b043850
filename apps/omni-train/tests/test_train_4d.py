"""4-D layouts (issue 27): TP together with CP (all-gather and ring K/V) and with Ulysses, on 4 gloo
processes, against one float64 process (``train_reference``: losses and every gradient of every step
within 1e-10).

* tp=2 x cp=2, all-gather and ring: each CP rank encodes its share of the media (the loader's ``share``)
  and its TP peer reads nothing, getting the same share by broadcast over the TP group; attention runs
  on each TP rank's local heads (n_heads / tp) through ``cp_sequence_attention``. With long-short
  encoder SP over the CP group (``encoder_sp = cp``) the whole TP x CP group (``ParallelState`` group
  ``tp_cp``) shares one reader.
* tp=2 x ulysses=2: the TP x Ulysses ranks of a stage share one pack (one reader, group ``tp_cp``); the
  Ulysses all-to-all exchanges each TP rank's local heads (one KV head per TP rank here, padded to the
  Ulysses size), with long-short SP for the encoders too.
* the long-short SP variants also run encoder ZeRO-3 (its reduce-scatter divides by ``tp`` as well).
* Megatron SP (``parallel.sequence_parallel``) at tp=2 with cp=2 (all-gather and ring) and with
  ulysses=2, pp=1: each rank's CP share or Ulysses chunk is sharded over TP between blocks (checked: the
  first block's input rows are half those without SP).
* tp=2 x hybrid DP/CP (dp=1 x cp=2 per stage, packs of 2 x 48 tokens on a long-tailed length mix, equal
  to one process training the same 96-token packs whole).

``train.compile`` with CP ring attention (and LLM ZeRO-3) runs on 2 processes in
``test_train_llm_zero.py``: each rank compiles its own blocks, which on 4 processes sharing 2 cores took
most of this world's time.

Which ranks read media is checked too (the zero-redundancy filter's ``samples_read``): a loader sharing
over the wrong group reads twice (or, across CP ranks with different shares, fails in the broadcast).

Not covered here (refused by validation, with the reason): hybrid DP/CP with Ulysses and CP with
Ulysses (USP attention is not built), hybrid DP/CP with ``train.compile``, Megatron SP with hybrid DP/CP
or with CP / Ulysses at pp > 1 (8 processes; the CP step inputs do not shard stage boundaries over TP).

Encoder gradients are summed over every rank and divided by ``tp`` (TP peers encode alike); LLM
gradients are summed over ``dp_cp`` (the CP or Ulysses ranks), each TP rank its own shard.
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

LONG = {"encoder_sp": 2, "long_threshold": 2}
SP = {"tp": 2, "sequence_parallel": True}  # Megatron SP: each rank's tokens sharded over TP between blocks


def _parallel(rank, world_size, runs, root):
    out = []
    for name, cfg in runs:
        validate(cfg, world_size)
        read, rows = [0], []

        def count(trainer, step, inputs, read=read, rows=rows):
            read[0] = trainer.stream.samples_read  # media samples this rank's loader read itself
            if step == 0:  # from step 1 on: the rows of every first-block input (SP: this TP rank's shard)
                first = next(iter(trainer.stage.layers.values()))
                first.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[0]))

        got = capture_run(cfg, Path(root) / name, on_inputs=count)
        out.append((got, read[0], sum(rows)))
    return out


def _references(rank, world_size, refs, root):
    return [reference_run(cfg, Path(root) / name, 1) for name, cfg in refs]


def test_tp_with_cp_and_with_ulysses_match_one_process(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=3, every=0, pp=1, extra='dtype = "float64"'))
    )
    # hybrid DP/CP on a long-tailed length mix: packs of 2 x 48 tokens shared by the two CP ranks, short
    # samples whole on one, long ones CP-sharded; the reference trains the same 96-token packs whole
    mix = make_dataset(tmp_path / "mix", n_text=40, seed=3, text_words_lognormal=(2.8, 0.9))
    long_tail = load_config(
        str(write_config(tmp_path / "m.toml", mix, steps=3, every=0, pp=1, extra='dtype = "float64"'))
    )
    refs = [("ref", cfg), ("ref-mix", with_parallel(long_tail, data_max_seq_len=96))]
    hybrid = with_parallel(long_tail, tp=2, cp=2, hybrid_cp=True, data_max_seq_len=48)
    # Ranks 0-3: TP pairs (0, 1) and (2, 3); CP / Ulysses pairs (0, 2) and (1, 3). Each run's reference
    # ("ref" or "mix", computed side by side with the runs below). Who reads media:
    # under CP TP rank 0 of each CP rank (its share); with long-short SP or Ulysses one rank of all four.
    runs = [
        ("tp2-cp2", with_parallel(cfg, tp=2, cp=2), "ref", {0, 2}),
        ("tp2-cp2-ring", with_parallel(cfg, tp=2, cp=2, cp_attention="ring"), "ref", {0, 2}),
        ("tp2-cp2-long-zero3", with_parallel(cfg, tp=2, cp=2, encoder_zero=3, **LONG), "ref", {0}),
        ("tp2-ul2", with_parallel(cfg, tp=2, ulysses=2), "ref", {0}),
        ("tp2sp-cp2", with_parallel(cfg, **SP, cp=2), "ref", {0, 2}),
        ("tp2sp-cp2-ring", with_parallel(cfg, **SP, cp=2, cp_attention="ring"), "ref", {0, 2}),
        ("tp2sp-ul2", with_parallel(cfg, **SP, ulysses=2), "ref", {0}),
        ("tp2-ul2-long-zero3", with_parallel(cfg, tp=2, ulysses=2, encoder_zero=3, **LONG), "ref", {0}),
        ("tp2-hybrid-cp2", hybrid, "mix", {0, 2}),
    ]
    refs_out, ranks = side_by_side(  # other run folders: the references run on the world's idle core time
        lambda: run_world(_references, 1, args=(refs, str(tmp_path / "ref")), timeout_s=300),
        lambda: run_world(_parallel, 4, args=([r[:2] for r in runs], str(tmp_path / "w4")), timeout_s=900),
    )
    want, want_mix = refs_out[0]
    runs = [(name, c, want if ref == "ref" else want_mix, readers) for name, c, ref, readers in runs]
    assert want[0][-1] < want[0][0]
    failed = []  # every variant checked, then all failures named at once
    for i, (name, _, reference, readers) in enumerate(runs):
        try:
            assert_runs_match(ranks[0][i][0], reference, name)
        except AssertionError as exc:
            failed.append(str(exc))
        read = [got[i][1] for got in ranks]
        if {r for r in range(4) if read[r]} != readers:
            failed.append(f"{name}: media samples read per rank {read}, expected readers {sorted(readers)}")
    rows = {name: [got[i][2] for got in ranks] for i, (name, *_) in enumerate(runs)}
    # SP halves each rank's hidden-state rows between blocks: exactly under CP (a CP rank's tokens are
    # even), up to the padding of a Ulysses chunk to a multiple of tp (2 microbatches x 2 steps)
    for sp, whole in (("tp2sp-cp2", "tp2-cp2"), ("tp2sp-cp2-ring", "tp2-cp2"), ("tp2sp-ul2", "tp2-ul2")):
        if not all(0 <= 2 * a - b <= 2 * 4 for a, b in zip(rows[sp], rows[whole])):
            failed.append(f"{sp}: first-block input rows per rank {rows[sp]}, without SP {rows[whole]}")
    if rows["tp2sp-cp2"] != [b // 2 for b in rows["tp2-cp2"]]:
        failed.append(f"tp2sp-cp2: rows {rows['tp2sp-cp2']} are not half of {rows['tp2-cp2']}")
    assert not failed, "\n".join(failed)
