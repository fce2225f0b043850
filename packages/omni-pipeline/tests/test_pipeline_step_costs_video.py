"""Video in the step cost model (issue 30): a clip runs on the image tower (Qwen2-VL's one ViT), its encoder
sequence is ``media_tokens * merge**2`` patches and its attention runs per temporal slice of
``temporal_patch`` frames (``omni_train.models.vit``: ``cu_seqlens`` per slice).

Reference: omni-parallel's FLOP model (:func:`omni_parallel.flops.forward_flops`) over the slices written
out by hand, and the equivalence a clip of ``t`` slices costs what ``t`` images of the slice's grid cost.
"""

from __future__ import annotations

import pytest

from omni_data import Modality, Pack, SampleMeta, split_encoder_microbatches
from omni_parallel.flops import TransformerShape, forward_flops
from omni_pipeline import (
    action_tokens,
    encoder_forward_flops,
    model_scale,
    modelled_step_costs,
    sample_encoder_flops,
)

LLM = TransformerShape(32, 2, 4, n_kv_heads=2, ffn_dim=64, gated_mlp=True)
VIT = TransformerShape(16, 2, 2, mlp_ratio=2)
AUDIO = TransformerShape(24, 1, 2, mlp_ratio=4)


def _video(key: str, frames: int, grid: tuple[int, int], merge: int = 2) -> SampleMeta:
    """A clip of ``frames`` sampled frames of ``grid`` ViT patches (14 px each), temporal patch 2."""
    t = -(-frames // 2)
    media = t * grid[0] * grid[1] // (merge * merge)
    return SampleMeta(key, "v", Modality.VIDEO, media, 3, 0.0, (frames, 3, 14 * grid[0], 14 * grid[1]))


def test_a_video_costs_its_temporal_slices_on_the_image_tower():
    ms = model_scale(LLM, {"image": VIT, "audio": AUDIO}, image_merge=2, temporal_patch=2)
    clip = _video("c", 7, (4, 6))  # 4 slices (7 frames, the last padded) of 24 patches
    got = sample_encoder_flops(ms, clip)
    assert got == pytest.approx(forward_flops(VIT, [24] * 4, causal=False), rel=1e-12)
    # = 4 images of the slice's grid (6 LLM tokens each); less than one attention over all 96 patches
    assert got == pytest.approx(4 * encoder_forward_flops(ms, Modality.IMAGE, 6), rel=1e-12)
    assert got < encoder_forward_flops(ms, Modality.VIDEO, clip.media_tokens)  # no frame count: bound
    # temporal patch 1: one slice per frame
    one = model_scale(LLM, {"image": VIT}, image_merge=2, temporal_patch=1)
    clip1 = SampleMeta("c1", "v", Modality.VIDEO, 7 * 6, 3, 0.0, (7, 3, 56, 84))
    assert sample_encoder_flops(one, clip1) == pytest.approx(forward_flops(VIT, [24] * 7, causal=False))


def test_video_action_tokens_and_step_costs():
    ms = model_scale(LLM, {"image": VIT, "audio": AUDIO}, image_merge=2, temporal_patch=2)
    img = SampleMeta("i", "i", Modality.IMAGE, 4, 2, 0.0, (3, 56, 56))
    aud = SampleMeta("a", "a", Modality.AUDIO, 5, 2, 0.0, (8000,))
    clip = _video("c", 4, (2, 4))  # 2 slices of 8 patches: 4 LLM tokens
    packs = [Pack([img, clip], 64), Pack([aud, _video("d", 6, (4, 4))], 64)]  # 3 slices of 16
    mbs = {1: [(0, 0), (0, 1)], 2: [(1, 0), (1, 1)]}
    _, enc = action_tokens(packs, mbs, image_merge=2, temporal_patch=2)
    # the clip's patches join the image tower's, its squares per slice
    assert enc[1].modules == {"image": (16 + 16, 16 * 16 + 2 * 8 * 8)}
    assert enc[2].modules == {"audio": (5, 25), "image": (48, 3 * 16 * 16)}
    mbs = split_encoder_microbatches(packs, 2, 2)
    costs = modelled_step_costs(ms, packs, mbs, 2, 1e9, 1)
    for e, items in mbs.items():
        want = 0.0
        for p, i in items:
            s = packs[p].samples[i]
            if s.modality is Modality.AUDIO:
                want += forward_flops(AUDIO, [s.media_tokens], causal=False)
            elif s.modality is Modality.IMAGE:
                want += forward_flops(VIT, [4 * s.media_tokens], causal=False)
            else:
                t = -(-s.shape[0] // 2)
                want += forward_flops(VIT, [4 * s.media_tokens // t] * t, causal=False)
        assert costs.encoder_forward_s[e] == pytest.approx(want / 1e9, rel=1e-12)
        assert costs.encoder_stored_bytes[e] > 0


def test_a_workload_draws_videos_costed_per_slice():
    from omni_pipeline import WorkloadError, parse_workload

    text = """
name = "v"
max_seq_len = 4096
microbatches = 4
[model]
llm = { dim = 32, n_layers = 2, n_heads = 4 }
image = { dim = 16, n_layers = 2, n_heads = 2, mlp_ratio = 2 }
[[sources]]
name = "clips"
modality = "video"
frames = 7
text_tokens = 8
length = { lognormal = { median = 600, sigma = 0.5 }, min = 64, max = 4096 }
[[sources]]
name = "t"
modality = "text"
length = { fixed = 500 }
[[phases]]
weights = { clips = 1, t = 1 }
"""
    w = parse_workload(text)
    ms = w.model
    clips = [s for p in w.step_packs(0) for s in p.samples if s.modality is Modality.VIDEO]
    assert clips and ms.temporal_patch == 2
    for s in clips:
        assert s.shape[0] == 7 and s.media_tokens % 4 == 0  # 4 slices of equal grids
        slice_patches = 4 * s.media_tokens // 4
        assert s.encoder_flops == pytest.approx(forward_flops(VIT, [slice_patches] * 4, causal=False))
        assert s.shape[2] * s.shape[3] // 14**2 == slice_patches
    with pytest.raises(WorkloadError, match=r"model.image: missing \(a source is video\)"):
        parse_workload(text.replace("image = { dim = 16, n_layers = 2, n_heads = 2, mlp_ratio = 2 }", ""))
    with pytest.raises(WorkloadError, match=r"sources\[1\].frames: sampled frames are for video"):
        parse_workload(text.replace("length = { fixed = 500 }", "length = { fixed = 500 }\nframes = 3"))
    with pytest.raises(WorkloadError, match=r"sources\[0\].frames: 4096 frames are 4096 temporal slices"):
        parse_workload(
            text.replace("frames = 7", "frames = 4096").replace("[model]", "[model]\ntemporal_patch = 1")
        )
