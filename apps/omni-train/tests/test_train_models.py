"""Models against float64 references: packed == one-by-one, stage split == whole model, mel filterbank."""

import math

import numpy as np
import pytest
import torch

from omni_parallel.varlen import varlen_attention
from omni_pipeline import stage_slices
from omni_train.models import (
    AudioConfig,
    AudioTower,
    ImageTower,
    LLMConfig,
    LLMStage,
    ViTConfig,
    log_mel,
    num_mel_frames,
    num_output_frames,
    patchify,
    smart_resize,
)
from omni_train.models.audio import mel_filterbank

D = torch.float64


def _cu(lengths):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)


def test_varlen_attention_matches_per_document_loop():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 5, 1]
    t = sum(lengths)
    q = torch.randn(t, 4, 8, generator=g, dtype=D)
    k = torch.randn(t, 2, 8, generator=g, dtype=D)
    v = torch.randn(t, 2, 8, generator=g, dtype=D)
    for causal in (True, False):
        out = varlen_attention(q, k, v, _cu(lengths), causal=causal)
        lo = 0
        for n in lengths:
            qs, ks, vs = q[lo : lo + n], k[lo : lo + n], v[lo : lo + n]
            ks, vs = ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1)
            s = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(8)
            if causal:
                s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), vs)
            torch.testing.assert_close(out[lo : lo + n], ref, rtol=0, atol=1e-12)
            lo += n


def test_llm_packed_equals_unpacked_and_stages_equal_whole():
    cfg = LLMConfig(vocab_size=50, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48)
    whole = LLMStage(cfg, 0, 1, seed=3).to(D)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 50, (n,), generator=g) for n in (4, 7, 2)]
    ids = torch.cat(docs)
    pos = torch.cat([torch.arange(len(d)) for d in docs])
    packed = whole(ids, pos, _cu([len(d) for d in docs]))
    lo = 0
    for d in docs:
        alone = whole(d, torch.arange(len(d)), _cu([len(d)]))
        torch.testing.assert_close(packed[lo : lo + len(d)], alone, rtol=0, atol=1e-12)
        lo += len(d)
    stages = [LLMStage(cfg, s, 2, seed=3).to(D) for s in range(2)]
    h = stages[0](ids, pos, _cu([len(d) for d in docs]))
    torch.testing.assert_close(stages[1](h, pos, _cu([len(d) for d in docs])), packed, rtol=0, atol=1e-12)


def test_llm_media_embeds_replace_placeholders_and_get_gradients():
    cfg = LLMConfig(vocab_size=20, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=24)
    m = LLMStage(cfg, seed=0).to(D)
    ids = torch.tensor([1, 5, 5, 3])
    emb = torch.randn(2, 16, dtype=D, requires_grad=True)
    out = m(ids, torch.arange(4), _cu([4]), emb, torch.tensor([1, 2]))
    # Reference: the same hidden states built by hand.
    h = m.tok_embeddings(ids).clone()
    h[1:3] = emb
    m2 = LLMStage(cfg, seed=0).to(D)
    m2.tok_embeddings = torch.nn.Identity()
    torch.testing.assert_close(out, m2(h, torch.arange(4), _cu([4])), rtol=0, atol=1e-12)
    out.sum().backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="placeholder positions"):
        m(ids, torch.arange(4), _cu([4]), emb, torch.tensor([1]))


def test_llm_stages_hold_the_layers_of_the_one_splitter():
    # omni_pipeline.stage_slices is the repo's one layer split: the first stages take the remainder
    # (the last stage also runs the LM head and the loss).
    assert [list(r) for r in stage_slices(4, 2)] == [[0, 1], [2, 3]]
    assert [list(r) for r in stage_slices(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    cfg = LLMConfig(vocab_size=20, dim=16, n_layers=5, n_heads=2, n_kv_heads=1, ffn_dim=24)
    assert [sorted(int(i) for i in LLMStage(cfg, s, 2).layers) for s in range(2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="n_layers"):
        stage_slices(1, 2)
    with pytest.raises(ValueError, match="vocab_size is not set"):
        LLMStage(LLMConfig(), 0, 1)


def test_vit_two_packed_images_equal_each_alone():
    cfg = ViTConfig(dim=16, n_layers=2, n_heads=2)
    tower = ImageTower(cfg, 24, seed=5).to(D)
    g = torch.Generator().manual_seed(2)
    imgs = [torch.rand(3, 56, 28, generator=g, dtype=D), torch.rand(3, 28, 84, generator=g, dtype=D)]
    parts = [patchify(im, 14, 2) for im in imgs]
    patches = torch.cat([p for p, _ in parts])
    grids = torch.tensor([gr for _, gr in parts])
    packed = tower(patches, grids)
    assert packed.shape == (2 + 3, 24)
    alone = [tower(p, torch.tensor([gr])) for p, gr in parts]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=1e-12)


def test_patchify_order_is_merge_window_major():
    img = torch.arange(3 * 28 * 56, dtype=D).view(3, 28, 56)
    patches, grid = patchify(img, 14, 2)
    assert grid == (2, 4)
    # second merged token = window (0, 1): patches at (0,2), (0,3), (1,2), (1,3)
    want = img[:, 0:14, 42:56].reshape(-1)
    torch.testing.assert_close(patches[5], want)
    with pytest.raises(ValueError, match="multiples"):
        patchify(torch.zeros(3, 30, 28), 14, 2)


def test_smart_resize_bounds():
    for h, w in [(256, 200), (17, 300), (1000, 1000), (30, 30)]:
        th, tw = smart_resize(h, w, 28, 56 * 56, 112 * 112)
        assert th % 28 == 0 and tw % 28 == 0
        assert th * tw <= 112 * 112
        assert th * tw >= 28 * 28


def test_mel_filterbank_triangles_and_log_mel_against_numpy():
    fb = mel_filterbank(10, 400, 16000)
    assert fb.shape == (201, 10)
    assert torch.all(fb >= 0) and torch.all(fb.max(0).values <= 1.0)
    cfg = AudioConfig(n_mels=10)
    g = torch.Generator().manual_seed(0)
    wave = torch.randn(1600, generator=g, dtype=D) * 0.1
    mel = log_mel(wave, cfg)
    assert mel.shape == (num_mel_frames(1600), 10)
    # numpy reference of the same front end: reflect-padded framing, Hann window, |rfft|^2.
    x = np.pad(wave.numpy(), 200, mode="reflect")
    win = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 400)
    frames = np.stack([x[i * 160 : i * 160 + 400] * win for i in range(1 + 1600 // 160)])
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    logm = np.log10(np.maximum(power @ fb.numpy(), 1e-10))
    logm = np.maximum(logm, logm.max() - 8.0)
    np.testing.assert_allclose(mel.numpy(), (logm + 4) / 4, rtol=0, atol=1e-9)


def test_audio_two_packed_clips_equal_each_alone():
    cfg = AudioConfig(dim=16, n_layers=1, n_heads=2, n_mels=8)
    tower = AudioTower(cfg, 24, seed=1).to(D)
    g = torch.Generator().manual_seed(4)
    clips = [torch.randn(n, 8, generator=g, dtype=D) for n in (9, 16)]
    out = tower(torch.cat(clips), torch.tensor([9, 16]))
    assert out.shape == (num_output_frames(9) + num_output_frames(16), 24) == (3 + 4, 24)
    alone = torch.cat([tower(c, torch.tensor([c.shape[0]])) for c in clips])
    torch.testing.assert_close(out, alone, rtol=0, atol=1e-12)
