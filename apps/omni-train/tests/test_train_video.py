"""Video through the trainer (issue 30): Qwen2-VL's video path at pp = 2 equals one process.

A tiny run over images, audio, text and the bundled video clips (``omni_train/data/shards/video-*.tar``:
real footage, decoded with PyAV in the loader), with ``model.vit.temporal_patch = 2`` (videos and images
through the one ViT, Wang et al., "Qwen2-VL", 2024 §2.1) and ``model.llm.mrope_section`` set (M-RoPE:
every pack carries ``[3, T]`` positions from its samples' grids, on both stages), float64, 3 steps:

* pp = 2 (1F1B, GPipe, and interleaved 1F1B over 2 virtual stages per rank), tp = 2, pp = 2 with the ``planned`` placement (its step costs model videos on the image tower,
  attention per temporal slice: ``omni_pipeline.step_costs``), dp = 2 with grouped reordering across both
  replicas (video frames move in the payload all-to-all), and, without M-RoPE, ulysses = 2 and cp = 2
  with long-short SP (``encoder_sp = 2``, ``long_threshold = 2``: videos are long and split over the
  SP group; checked that some video of the run was split), each on 2 gloo processes: every loss and every gradient equals the one-process
  reference over the same packs (``train_reference``, <= 1e-10; dp = 2: both replicas' packs); video
  samples were in the step's packs and trained (their caption targets counted in
  ``targets_per_modality["video"]``, their frames encoded by the image tower); both stages built 3-D
  positions for every pack and they are the ones ``omni_pipeline.mrope`` gives.
* The run's ``summary.json`` counts the packs' video samples (``samples_per_modality``) and their sampled
  frames (``video_frames``), as do the steps' ``metrics.jsonl`` rows.
* Preflight accepts video sources and ``temporal_patch`` / ``mrope_section`` (and the ``vlm-video``
  recipe), and names the field of the combinations not wired: M-RoPE with Ulysses / CP / TP sequence
  parallelism; video with hybrid DP/CP.
* ``make-shards --write-config`` over videos gives the ViT Qwen2-VL's 2-frame temporal patches.

These are consistency checks (parallel runs against one process over the same code; positions against
``omni_pipeline.mrope``); that the video path computes what Qwen2-VL computes (patch layout, temporal
slices, M-RoPE positions, logits) is checked against transformers in ``test_train_hf_video.py``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from train_fixtures import make_dataset, side_by_side, write_config
from train_reference import assert_runs_match, capture_run, reference_run, with_llm_layers, with_parallel

from omni_data import Modality
from omni_parallel.testing import run_world
from omni_pipeline import PlacementPolicy, mrope_documents, mrope_position_ids
from omni_train.binder import load_config
from omni_train.config import ConfigError, MixturePhase, SourceConfig
from omni_train.data import SHARDS_DIR
from omni_train.preflight import validate

pytestmark = pytest.mark.slow

SECTION = [2, 1, 1]  # head_dim 8 (write_config's LLM: dim 32, 4 heads): 4 rotary frequencies


@pytest.fixture(scope="module")
def video_cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("video")
    data = make_dataset(tmp / "data", n_image=8, n_audio=4, n_text=8)
    path = write_config(
        tmp / "c.toml",
        data,
        steps=3,
        every=0,
        extra='dtype = "float64"',
        model={"llm": f"mrope_section = {SECTION}", "vit": "temporal_patch = 2"},
    )
    cfg = load_config(str(path))
    video = SourceConfig(name="video", modality="video", urls=str(SHARDS_DIR / "video-*.tar"))
    mixture = [MixturePhase({"image": 0.3, "audio": 0.1, "text": 0.2, "video": 0.4})]
    # the bundled tokenizer: a clip's caption is ~100 of its tokens (the fixture's byte-level one: ~220)
    tokenizer = str(SHARDS_DIR.parent / "tokenizer.json")
    data_cfg = dataclasses.replace(
        cfg.data, sources=[*cfg.data.sources, video], mixture=mixture, max_seq_len=128, tokenizer=tokenizer
    )
    return dataclasses.replace(cfg, data=data_cfg)


def _videos(inputs) -> tuple[int, int]:
    """Video samples (with media) in the step's packs, and their sampled frames."""
    vs = [s for p in inputs.packs for s in p.samples if s.modality == Modality.VIDEO and s.media_tokens]
    return len(vs), sum(s.shape[0] for s in vs)


def _record(seen: list):
    def on_inputs(trainer, step, inputs):
        b = trainer.builder
        vit = trainer.cfg.model.vit
        for k, pack in enumerate(inputs.packs, start=1):
            want = mrope_position_ids(
                mrope_documents(pack.samples, patch=vit.patch, merge=vit.merge, temporal_patch=2), vit.merge
            )
            got = b.functions(inputs).stage_kwargs(1, k)["position_ids"]
            assert torch.equal(got, want), (step, k)  # a later stage's positions: 3-D, from the grids
            if k in inputs.microbatches:
                assert torch.equal(inputs.microbatches[k].position_ids, want), (step, k)
        encoded = sum(1 for ps in inputs.payloads.values() for p in ps if p.meta.modality == Modality.VIDEO)
        seen.append((step, *_videos(inputs), encoded))

    return on_inputs


def _no_mrope(cfg):
    llm = dataclasses.replace(cfg.model.llm, mrope_section=None)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, llm=llm))


def _long_videos(trainer, step, inputs, out):
    """Videos among the long samples of the step's encoder work (long-short SP)."""
    out.append(sum(p.meta.modality == Modality.VIDEO for w in inputs.encoder_work.values() for p in w.long))


def _pp2(rank, world_size, cfg, root):
    seen: list = []
    got = capture_run(with_parallel(cfg, pp=2), Path(root) / "pp2", on_inputs=_record(seen))
    tp2 = capture_run(with_parallel(cfg, pp=1, tp=2), Path(root) / "tp2")
    # the planner's per-step costs model videos (omni_pipeline.step_costs: image tower, per slice)
    planned = capture_run(with_parallel(cfg, pp=2, placement=PlacementPolicy.PLANNED), Path(root) / "planned")
    # grouped reordering across both DP replicas: video frames move with the payload all-to-all
    dp2 = capture_run(with_parallel(cfg, pp=1, dp=2, reorder=True), Path(root) / "dp2")
    # long-short SP over Ulysses: every video longer than long_threshold is split over the 2 SP ranks
    longs: list = []
    sp2 = capture_run(
        with_parallel(_no_mrope(cfg), pp=1, ulysses=2, encoder_sp=2, long_threshold=2),
        Path(root) / "sp2",
        on_inputs=lambda t, step, inputs: _long_videos(t, step, inputs, longs),
    )
    # the same over CP: long videos split over the CP group, delivered by the reused zero buffer
    cp_longs: list = []
    cp2 = capture_run(
        with_parallel(_no_mrope(cfg), pp=1, cp=2, encoder_sp=2, long_threshold=2),
        Path(root) / "cp2",
        on_inputs=lambda t, step, inputs: _long_videos(t, step, inputs, cp_longs),
    )
    # the other schedules: GPipe, and interleaved 1F1B over 2 virtual stages per rank (each builds M-RoPE)
    gpipe = capture_run(with_parallel(cfg, pp=2, schedule="gpipe"), Path(root) / "gpipe")
    inter = capture_run(
        with_parallel(with_llm_layers(cfg, 4), pp=2, schedule="interleaved", virtual_stages=2),
        Path(root) / "inter",
    )
    return got, seen, tp2, planned, dp2, sp2, longs, cp2, cp_longs, gpipe, inter


def _reference(rank, world_size, cfg, root):
    return (
        reference_run(cfg, Path(root) / "ref", 1),
        reference_run(cfg, Path(root) / "ref-dp2", 2),
        reference_run(_no_mrope(cfg), Path(root) / "ref-nomrope", 1),
        reference_run(with_llm_layers(cfg, 4), Path(root) / "ref-4l", 1),
    )


def test_video_at_pp2_with_mrope_matches_one_process(video_cfg, tmp_path):
    cfg = video_cfg
    validate(with_parallel(cfg, pp=2), 2)
    results, reference = side_by_side(  # other run folders: the reference runs on the pipeline's idle core
        lambda: run_world(_pp2, 2, args=(cfg, str(tmp_path)), timeout_s=300),
        lambda: run_world(_reference, 1, args=(cfg, str(tmp_path)), timeout_s=300),
    )
    ref, ref_dp2, ref_nomrope, ref_4l = reference[0]
    got = results[0][0]
    assert_runs_match(got, ref, "pp=2 with video and M-RoPE")
    assert_runs_match(results[0][2], ref, "tp=2 with video and M-RoPE")
    assert_runs_match(results[0][3], ref, "pp=2, planned placement, with video")
    assert_runs_match(results[0][4], ref_dp2, "dp=2 with reordering and video")
    assert_runs_match(results[0][5], ref_nomrope, "ulysses=2 with long-short SP of long videos")
    assert all(sum(r[6]) > 0 for r in results), "no video was split over the SP group"
    assert_runs_match(results[0][7], ref_nomrope, "cp=2 with long-short SP of long videos")
    assert all(sum(r[8]) > 0 for r in results), "no video was split over the CP group"
    assert_runs_match(results[0][9], ref, "pp=2, GPipe, with video and M-RoPE")
    assert_runs_match(
        results[0][10], ref_4l, "pp=2, interleaved 1F1B (2 virtual stages), with video and M-RoPE"
    )
    moved = [
        json.loads(x)["reorder_bytes"] for x in (tmp_path / "dp2" / "metrics.jsonl").read_text().splitlines()
    ]
    assert sum(moved) > 0, "reordering moved no payload"
    # video samples were in the packs, their frames decoded and encoded (each on the one rank that runs
    # its encoder microbatch), and their caption targets trained
    seen0, seen1 = results[0][1], results[1][1]
    videos = sum(n for _, n, _, _ in seen0)
    assert videos > 0 and sum(f for _, _, f, _ in seen0) >= 2 * videos
    assert sum(e for *_, e in seen0) + sum(e for *_, e in seen1) == videos
    rows = [json.loads(x) for x in (tmp_path / "pp2" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["targets_per_modality"]["video"] for r in rows) > 0
    # the summary counts the packs' video samples and their sampled frames (all of the run's steps)
    summary = json.loads((tmp_path / "pp2" / "summary.json").read_text())
    frames = sum(f for _, _, f, _ in seen0)
    assert summary["samples_per_modality"]["video"] == videos and summary["video_frames"] == frames
    assert [r["video_frames"] for r in rows] == [f for _, _, f, _ in seen0]


def test_preflight_takes_video_and_mrope_and_names_what_is_not_wired(video_cfg):
    cfg = video_cfg
    validate(cfg, 2)
    validate(load_config("vlm-video"), 2)
    validate(with_parallel(cfg, pp=1, tp=2), 2)
    for par in ({"pp": 1, "ulysses": 2}, {"pp": 1, "cp": 2}, {"pp": 1, "tp": 2, "sequence_parallel": True}):
        with pytest.raises(ConfigError, match=r"^model.llm.mrope_section: M-RoPE positions are not wired"):
            validate(with_parallel(cfg, **par), 2)
    no_mrope = _no_mrope(cfg)
    validate(with_parallel(no_mrope, pp=1, dp=2, reorder=False), 2)  # video without M-RoPE, at dp = 2
    for par in (  # verified in the world above
        {"pp": 1, "ulysses": 2, "encoder_sp": 2},
        {"pp": 1, "cp": 2, "encoder_sp": 2},
        {"pp": 1, "dp": 2, "reorder": True},
        {"placement": PlacementPolicy.PLANNED},
    ):
        validate(with_parallel(no_mrope, **par), 2)
    with pytest.raises(ConfigError, match=r"^data.sources\[3\].modality: video source 'video' with"):
        validate(with_parallel(no_mrope, pp=1, dp=2, hybrid_cp=True), 2)


def test_make_shards_config_takes_videos_in_temporal_patches(tmp_path):
    from omni_train.make_shards import write_run_config

    def lines(modality):
        src = f'name = "{modality}"\nmodality = "{modality}"\nurls = "{SHARDS_DIR}/{modality}-*.tar"'
        return f"[[data.sources]]\n{src}\n\n[[data.mixture]]\nweights = {{ {modality} = 1.0 }}\n"

    video = load_config(str(write_run_config(tmp_path / "v.toml", lines("video"))))
    image = load_config(str(write_run_config(tmp_path / "i.toml", lines("image"))))
    assert (video.model.vit.temporal_patch, image.model.vit.temporal_patch) == (2, 1)
    validate(video, video.parallel.world_size)
