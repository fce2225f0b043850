"""Token accounting against hand-computed Qwen2-VL values and the encoder FLOPs model against torch's counter."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from omni_data import AudioTokens, EncoderCost, ImageTokens


def test_image_tokens_hand_values():
    it = ImageTokens(patch=14, merge=2)
    assert it.resize(224, 224) == (224, 224)
    assert (it.patches(224, 224), it.tokens(224, 224)) == (256, 64)
    # 1000 / 28 = 35.7 -> 36 * 28 = 1008; 500 / 28 = 17.86 -> 18 * 28 = 504
    assert it.resize(1000, 500) == (1008, 504)
    assert it.tokens(1000, 500) == (72 * 36) // 4
    # tiny image: area below min_pixels (56*56) -> scaled up to 56x56
    assert it.resize(10, 10) == (56, 56)


@pytest.mark.parametrize("h,w", [(4000, 3000), (20, 900), (12345, 77), (56, 56), (1, 1)])
def test_image_resize_bounds(h, w):
    it = ImageTokens(patch=14, merge=2, min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    rh, rw = it.resize(h, w)
    assert rh % 28 == 0 and rw % 28 == 0 and rh >= 28 and rw >= 28
    assert rh * rw <= it.max_pixels or min(rh, rw) == 28
    assert it.tokens(h, w) * 4 == (rh // 14) * (rw // 14)


def test_image_tokens_errors():
    with pytest.raises(ValueError, match="positive"):
        ImageTokens().resize(0, 10)
    with pytest.raises(ValueError, match="min_pixels"):
        ImageTokens(min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError, match="hidden"):
        EncoderCost(hidden=0)
    with pytest.raises(ValueError, match="seq_len"):
        EncoderCost().flops(-1)


def test_audio_tokens():
    at = AudioTokens(frame_ms=10, subsample=4)
    assert at.frames(16000, 16000) == 100 and at.tokens(16000, 16000) == 25
    assert at.tokens(16160, 16000) == math.ceil(101 / 4)
    assert at.tokens(1, 8000) == 1
    with pytest.raises(ValueError, match="samples"):
        at.tokens(0, 16000)


def _layer(x, wqkv, wo, w1, w2, heads):
    n, d = x.shape
    q, k, v = (x @ wqkv).view(n, 3, heads, d // heads).permute(1, 2, 0, 3)
    a = F.scaled_dot_product_attention(q, k, v).permute(1, 0, 2).reshape(n, d)
    x = x + a @ wo
    return x + F.gelu(x @ w1) @ w2


@pytest.mark.parametrize("n", [1, 7, 33])
def test_encoder_cost_matches_flop_counter(n):
    d, layers, heads = 32, 3, 4
    g = torch.Generator().manual_seed(0)
    ws = [
        (
            torch.randn(d, 3 * d, generator=g),
            torch.randn(d, d, generator=g),
            torch.randn(d, 4 * d, generator=g),
            torch.randn(4 * d, d, generator=g),
        )
        for _ in range(layers)
    ]
    x = torch.randn(n, d, generator=g)
    with FlopCounterMode(display=False) as fc:
        for w in ws:
            x = _layer(x, *w, heads)
    assert EncoderCost(hidden=d, layers=layers, mlp_ratio=4).flops(n) == fc.get_total_flops()
