"""Qwen2-VL's video path, ``transformers`` as the oracle (float32, tolerance 1e-5), models built from small
configs (random init, no hub).

* The vision tower at ``model.vit.temporal_patch = 2``: imported from a ``Qwen2VisionTransformerPretrainedModel``
  folder it computes ``transformers``' features on ``pixel_values_videos`` / ``video_grid_thw`` (and on
  images, the same weights); exported it loads with ``from_pretrained`` and computes ours; the Conv3d
  kernel travels whole (long-short SP over a video: ``test_train_video_vit.py``).
* Multimodal RoPE: ``omni_pipeline.mrope`` equals ``Qwen2VLModel.get_rope_index`` on our pack layout.
* The whole model: a ``Qwen2VLForConditionalGeneration`` checkpoint imported into our image tower and
  LLM (M-RoPE) gives ``transformers``' logits on video + text, image + text and text samples packed.

Frames are real-shaped uint8 RGB, rescaled and normalised with Qwen2-VL's processor constants; images go
through ``transformers``' own ``Qwen2VLImageProcessorPil``. ``Qwen2VLVideoProcessor`` needs torchvision,
which this environment lacks, so :func:`_processor_video_patches` writes out its ``patchify`` layout
(``video_processing_qwen2_vl.py``: view ``[t, T, C, h/m, m, p, w/m, m, p]``, permute to ``[t, h/m, w/m,
m, m, C, T, p, p]``, last frame repeated up to a multiple of ``T``) as the reference for ours.
"""

import os

import numpy as np
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from hf_oracle import assert_close_at_tol, perturb  # noqa: E402
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLVisionConfig  # noqa: E402
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel  # noqa: E402

from omni_pipeline.mrope import MRopeDocument, mrope_position_ids  # noqa: E402
from omni_train.hf import (  # noqa: E402
    LlamaAdapter,
    Qwen2VLVisionAdapter,
    llm_config_from_hf,
    read_config,
    read_family,
    read_weights,
    vit_config_from_hf,
    write_folder,
)
from omni_train.models import ImageTower, LLMStage, ViTConfig, patchify  # noqa: E402
from omni_train.models.vit import patchify_video  # noqa: E402

P, M, T = 14, 2, 2  # patch, merge, temporal patch


def _frames(g: torch.Generator, n: int, h: int, w: int) -> torch.Tensor:
    """``n`` uint8 RGB frames ``[n, H, W, 3]`` rescaled and normalised as Qwen2-VL's processor does:
    float ``[n, 3, H, W]``. Consecutive frames differ (a slow drift plus noise), as a clip's do."""
    base = torch.randint(0, 256, (h, w, 3), generator=g).float()
    drift = torch.randint(-40, 41, (n, 1, 1, 3), generator=g).float()
    noise = torch.randint(-8, 9, (n, h, w, 3), generator=g).float()
    rgb = (base + drift + noise).clamp(0, 255).round()
    x = rgb / 255.0
    x = (x - torch.tensor(OPENAI_CLIP_MEAN)) / torch.tensor(OPENAI_CLIP_STD)
    return x.permute(0, 3, 1, 2).float().contiguous()


def _processor_video_patches(frames: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``Qwen2VLVideoProcessor.patchify``'s layout (see the module docstring): ``pixel_values_videos`` and
    the ``video_grid_thw`` row of one clip."""
    if pad := -frames.shape[0] % T:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    n, c, h, w = frames.shape
    t, gh, gw = n // T, h // P, w // P
    x = frames.view(t, T, c, gh // M, M, P, gw // M, M, P).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, c * T * P * P), [t, gh, gw]


def _image(g: torch.Generator, h: int, w: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, list[int]]:
    """An uint8 image, our patches of it at ``temporal_patch = 2``, and ``Qwen2VLImageProcessorPil``'s
    ``pixel_values`` / ``image_grid_thw`` row (no resize: the sides are already multiples of 28)."""
    rgb = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
    ref = Qwen2VLImageProcessorPil()(images=[rgb], do_resize=False, return_tensors="pt")
    mean, std = torch.tensor(OPENAI_CLIP_MEAN), torch.tensor(OPENAI_CLIP_STD)
    x = (torch.from_numpy(rgb).float() / 255.0 - mean) / std
    ours, _ = patchify(x.permute(2, 0, 1).float().contiguous(), P, M, T)
    return rgb, ours, ref["pixel_values"], ref["image_grid_thw"][0].tolist()


VISION = dict(
    depth=2,
    embed_dim=32,
    hidden_size=48,
    num_heads=4,
    hidden_act="quick_gelu",
    initializer_range=0.1,
    rope_parameters={"rope_type": "axial", "rope_theta": 1000.0},
)


def test_video_tower_from_hf_equals_qwen2vl_and_export_loads(tmp_path):
    torch.manual_seed(0)
    hf_model = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(**VISION)).eval()
    perturb(hf_model, 1)
    hf_model.save_pretrained(tmp_path / "hf")
    cfg, llm_dim = vit_config_from_hf(read_config(tmp_path / "hf"), ViTConfig(temporal_patch=2))
    assert cfg.temporal_patch == 2 and cfg.patch_features == 3 * 2 * 14 * 14
    adapter = Qwen2VLVisionAdapter(cfg, llm_dim)
    tower = ImageTower(cfg, llm_dim)
    tower.load_state_dict(adapter.from_hf(read_weights(tmp_path / "hf")), strict=True)
    conv = hf_model.patch_embed.proj.weight.detach()
    assert torch.equal(tower.encoder.patch_embed.weight, conv.reshape(conv.shape[0], -1))  # whole, not summed

    g = torch.Generator().manual_seed(2)
    clips = [_frames(g, 5, 56, 84), _frames(g, 4, 28, 56)]  # 5 frames: the last one repeats
    ours = [patchify_video(f, P, M, T) for f in clips]
    refs = [_processor_video_patches(f) for f in clips]
    for (x, grid), (rx, rgrid) in zip(ours, refs):
        assert list(grid) == rgrid and torch.equal(x, rx)
    patches = torch.cat([x for x, _ in ours])
    grids = torch.tensor([list(gr) for _, gr in ours])
    assert grids.tolist() == [[3, 4, 6], [2, 2, 4]]
    _, img, pixel_values, image_thw = _image(g, 56, 28)
    torch.testing.assert_close(img, pixel_values, rtol=0, atol=1e-6)  # the processor's image patches
    with torch.no_grad():
        ref = hf_model(patches, grid_thw=grids)  # pixel_values_videos, video_grid_thw
        assert_close_at_tol(tower(patches, grids), ref.pooler_output)
        assert_close_at_tol(
            tower.encoder(patches, grids), hf_model.merger.ln_q(ref.last_hidden_state).reshape(-1, 128)
        )
        ref_img = hf_model(pixel_values, grid_thw=torch.tensor([image_thw])).pooler_output
        assert_close_at_tol(tower(img, torch.tensor([image_thw[1:]])), ref_img)  # an image, [n, 2] grids
        # one packed call over videos and the image: each medium (each temporal slice) attends alone
        mixed = tower(torch.cat([patches, img]), torch.cat([grids, torch.tensor([image_thw])]))
        assert_close_at_tol(mixed, torch.cat([ref.pooler_output, ref_img]))

    mine = ImageTower(cfg, llm_dim, seed=5)
    perturb(mine, 3)
    sd = mine.state_dict()
    back = adapter.from_hf(adapter.to_hf(sd))
    assert all(torch.equal(back[k], sd[k]) for k in sd)  # the kernel survives the round trip exactly
    write_folder(tmp_path / "out", adapter.hf_config(), adapter.to_hf(sd))
    loaded = Qwen2VisionTransformerPretrainedModel.from_pretrained(tmp_path / "out").eval()
    assert loaded.config.temporal_patch_size == 2
    with torch.no_grad():
        assert_close_at_tol(mine(patches, grids), loaded(patches, grid_thw=grids).pooler_output)


# -- M-RoPE and the whole model ----------------------------------------------------------------------------
TEXT = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
)
IMAGE_ID, VIDEO_ID = 90, 91


def _full_model() -> Qwen2VLForConditionalGeneration:
    torch.manual_seed(0)
    cfg = Qwen2VLConfig(
        text_config=TEXT,
        vision_config={**VISION, "hidden_size": 64},
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        vision_start_token_id=92,
        vision_end_token_id=93,
    )
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    perturb(model, 1)
    return model


def _hf_rope_index(model, ids: torch.Tensor, kind: int, grid: list[int] | None) -> torch.Tensor:
    """``transformers``' ``get_rope_index`` of one sample (``kind``: 0 text, 1 image, 2 video)."""
    types = torch.where((ids == IMAGE_ID) | (ids == VIDEO_ID), kind, 0)[None]
    grids = {"image_grid_thw": None, "video_grid_thw": None}
    if grid is not None:
        grids["image_grid_thw" if kind == 1 else "video_grid_thw"] = torch.tensor([grid])
    pos, _ = model.model.get_rope_index(ids[None], mm_token_type_ids=types, **grids)
    return pos[:, 0]


def test_mrope_positions_and_the_whole_qwen2vl_model_equal_transformers(tmp_path):
    model = _full_model()
    g = torch.Generator().manual_seed(3)
    clip = _frames(g, 4, 56, 84)  # t = 2 temporal patches of 2 x 3 merged tokens
    long_clip = _frames(g, 8, 56, 56)  # t = 4 > max(h, w) = 2 merged tokens: the rules differ
    vx, vgrid = patchify_video(clip, P, M, T)
    lx, lgrid = patchify_video(long_clip, P, M, T)
    _, ix, _, igrid = _image(g, 28, 56)
    text = [torch.randint(0, 90, (n,), generator=g) for n in (5, 4, 6, 3)]
    media = [(VIDEO_ID, 2, vx, list(vgrid)), (IMAGE_ID, 1, ix, igrid), None, (VIDEO_ID, 2, lx, list(lgrid))]
    docs, ids, hf_pos = [], [], []
    for m, t in zip(media, text):
        grid = None if m is None else m[3]
        n_media = 0 if grid is None else grid[0] * grid[1] * grid[2] // M**2
        seq = torch.cat([torch.full((n_media,), m[0] if m else 0), t])
        docs.append(MRopeDocument(n_media, t.numel(), None if grid is None else tuple(grid)))
        ids.append(seq)
        hf_pos.append(_hf_rope_index(model, seq, 0 if m is None else m[1], grid))
    pos = mrope_position_ids(docs, M)
    lengths = [d.media_tokens + d.text_tokens for d in docs]
    ours_by_doc = pos.split(lengths, 1)
    for k in range(3):  # video (t <= max(h, w)), image, text: transformers' positions exactly
        assert torch.equal(ours_by_doc[k], hf_pos[k]), k
    # the long video: vision ids equal; its text starts at t = 4 (Qwen2-VL's max + 1), where
    # transformers 5 starts it at max(h, w) = 2 (mrope.py's module docstring)
    nv = docs[3].media_tokens
    assert torch.equal(ours_by_doc[3][:, :nv], hf_pos[3][:, :nv])
    assert ours_by_doc[3][0, nv] == 4 and torch.equal(ours_by_doc[3][:, nv:], hf_pos[3][:, nv:] + 2)

    # import the whole checkpoint: the tower from visual.*, the LLM from model.* and lm_head
    model.save_pretrained(tmp_path / "vlm")
    weights = read_weights(tmp_path / "vlm")
    vcfg, llm_dim = vit_config_from_hf(read_config(tmp_path / "vlm"), ViTConfig(temporal_patch=2))
    tower = ImageTower(vcfg, llm_dim)
    vis, _ = read_family(Qwen2VLVisionAdapter(vcfg, llm_dim), tmp_path / "vlm")
    tower.load_state_dict(vis, strict=True)
    lcfg = llm_config_from_hf(read_config(tmp_path / "vlm"), vocab_size=97)
    assert lcfg.mrope_section == [2, 3, 3] and lcfg.qkv_bias
    llm = LLMStage(lcfg)
    llm.load_state_dict(LlamaAdapter(lcfg).from_hf(weights), strict=True)

    # ours: the three media through one tower call, the four samples packed with M-RoPE positions
    media_x = torch.cat([m[2] for m in media if m is not None])
    media_g = torch.tensor([m[3] for m in media if m is not None])
    packed = torch.cat(ids)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()])
    slots = torch.nonzero((packed == IMAGE_ID) | (packed == VIDEO_ID)).flatten()
    with torch.no_grad():
        logits = llm(packed, pos, cu, tower(media_x, media_g), slots)
        refs = []
        for m, seq, p in zip(media, ids, ours_by_doc):
            kw = {}
            if m is not None:
                key = "pixel_values" if m[1] == 1 else "pixel_values_videos"
                kw = {key: m[2], ("image_grid_thw" if m[1] == 1 else "video_grid_thw"): torch.tensor([m[3]])}
            # our positions given to transformers: for the long video they are Qwen2-VL's (above)
            refs.append(model(input_ids=seq[None], position_ids=p[:, None], **kw).logits[0])
    assert_close_at_tol(logits, torch.cat(refs))
    with torch.no_grad():  # the video sample with the positions transformers computes itself
        own = model(
            input_ids=ids[0][None],
            pixel_values_videos=vx,
            video_grid_thw=torch.tensor([vgrid]),
            mm_token_type_ids=torch.where(ids[0] == VIDEO_ID, 2, 0)[None],
        ).logits[0]
    assert_close_at_tol(logits[: lengths[0]], own)
