"""``omni_parallel.flops``: the one FLOP model against a brute-force count.

Oracle: ``torch.utils.flop_counter.FlopCounterMode`` counting the multiply-adds of an actual module's
forward (a GELU encoder block and a LLaMA-style GQA + SwiGLU decoder block) over packed documents, with
attention run per document. For causal attention the oracle computes each query row against only the keys
it may see (so the count is exactly the unmasked products) and the model must differ from it by the
documented convention alone: the diagonal's ``2 * d * n`` per document and layer is not counted.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from omni_parallel.flops import (
    TransformerShape,
    attention_flops,
    forward_flops,
    layer_flops_per_token,
    matmul_params,
    measure_peak_flops,
    model_flops,
)

D = torch.float64


class _Block(nn.Module):
    """Pre-norm transformer block: GQA attention per document, then a GELU or SwiGLU MLP."""

    def __init__(self, shape: TransformerShape) -> None:
        super().__init__()
        # sizes from the shape's fields, not from its derived properties (the model under test)
        d, kv = shape.dim, (shape.n_kv_heads or shape.n_heads) * (shape.dim // shape.n_heads)
        f = int(shape.ffn_dim) if shape.ffn_dim is not None else int(shape.mlp_ratio * shape.dim)
        self.shape = shape
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, kv), nn.Linear(d, kv)
        self.o = nn.Linear(d, d)
        self.up = nn.Linear(d, f)
        self.gate = nn.Linear(d, f) if shape.gated_mlp else None
        self.down = nn.Linear(f, d)

    def _attend(self, q, k, v, causal: bool) -> torch.Tensor:
        """``q``: ``[h, n, d_h]``, ``k``/``v``: ``[h, n, d_h]`` (KV heads repeated)."""
        if not causal:
            return F.scaled_dot_product_attention(q, k, v)
        rows = []
        for i in range(q.shape[1]):  # row i sees keys 0..i: exactly the unmasked products
            s = (q[:, i : i + 1] @ k[:, : i + 1].transpose(1, 2)) / math.sqrt(q.shape[-1])
            rows.append(torch.softmax(s, dim=-1) @ v[:, : i + 1])
        return torch.cat(rows, dim=1)

    def forward(self, x: torch.Tensor, docs: list[int], causal: bool) -> torch.Tensor:
        sh = self.shape
        h, hkv, dh = sh.n_heads, sh.n_kv_heads or sh.n_heads, sh.dim // sh.n_heads
        y = self.norm1(x)
        q = self.q(y).view(-1, h, dh).transpose(0, 1)
        k = self.k(y).view(-1, hkv, dh).transpose(0, 1).repeat_interleave(h // hkv, dim=0)
        v = self.v(y).view(-1, hkv, dh).transpose(0, 1).repeat_interleave(h // hkv, dim=0)
        outs, lo = [], 0
        for n in docs:
            outs.append(self._attend(q[:, lo : lo + n], k[:, lo : lo + n], v[:, lo : lo + n], causal))
            lo += n
        x = x + self.o(torch.cat(outs, dim=1).transpose(0, 1).reshape(-1, sh.dim))
        y = self.norm2(x)
        hidden = F.silu(self.gate(y)) * self.up(y) if self.gate is not None else F.gelu(self.up(y))
        return x + self.down(hidden)


def _counted(shape: TransformerShape, docs: list[int], causal: bool) -> tuple[int, nn.Module]:
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block(shape) for _ in range(shape.n_layers)).to(D)
    x = torch.randn(sum(docs), shape.dim, dtype=D)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        for b in blocks:
            x = b(x, docs, causal)
    return fc.get_total_flops(), blocks


SHAPES = {
    "encoder-gelu": TransformerShape(dim=32, n_layers=2, n_heads=4, mlp_ratio=3),
    "encoder-ffn-dim": TransformerShape(dim=24, n_layers=1, n_heads=2, ffn_dim=40),
    "llm-gqa-swiglu": TransformerShape(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, gated_mlp=True
    ),
    "llm-mqa-swiglu": TransformerShape(
        dim=24, n_layers=1, n_heads=6, n_kv_heads=1, ffn_dim=20, gated_mlp=True
    ),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("docs", [[1], [9], [5, 17, 3]])
def test_bidirectional_forward_equals_the_counted_module(name, docs):
    shape = SHAPES[name]
    counted, blocks = _counted(shape, docs, causal=False)
    assert forward_flops(shape, docs, causal=False) == counted
    assert matmul_params(blocks) == shape.matmul_params  # every Linear weight, no bias or norm


@pytest.mark.parametrize("name", ["llm-gqa-swiglu", "llm-mqa-swiglu"])
@pytest.mark.parametrize("docs", [[1], [7, 12]])
def test_causal_forward_is_the_unmasked_count_without_the_diagonal(name, docs):
    shape = SHAPES[name]
    counted, _ = _counted(shape, docs, causal=True)
    diagonal = shape.n_layers * 2 * shape.dim * sum(docs)  # Q K^T and A V of each token with itself
    assert forward_flops(shape, docs, causal=True) == counted - diagonal


def test_per_layer_per_token_cost_and_training_factor():
    shape = SHAPES["llm-gqa-swiglu"]
    for causal in (False, True):
        per_token = layer_flops_per_token(shape, 11, causal=causal)
        assert shape.n_layers * 11 * per_token == forward_flops(shape, [11], causal=causal)
    attn = attention_flops([3, 4], shape.dim, shape.n_layers, causal=True)
    assert model_flops(shape.matmul_params, 7, attn) == 3 * forward_flops(shape, [3, 4], causal=True)
    assert model_flops(shape.matmul_params, 7, attn, training=False) == forward_flops(
        shape, [3, 4], causal=True
    )


def test_bad_shapes_and_lengths_are_named():
    with pytest.raises(ValueError, match="dim 30 is not a multiple of n_heads 4"):
        TransformerShape(dim=30, n_heads=4)
    with pytest.raises(ValueError, match="n_kv_heads 3 must divide n_heads 4"):
        TransformerShape(dim=32, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="MLP width"):
        TransformerShape(dim=32, mlp_ratio=-1.0)
    with pytest.raises(ValueError, match="n_layers"):
        TransformerShape(dim=32, n_layers=0)
    with pytest.raises(ValueError, match="document lengths must be >= 0"):
        forward_flops(TransformerShape(dim=8), [3, -1], causal=False)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        layer_flops_per_token(TransformerShape(dim=8), 0, causal=True)


def test_matmul_params_counts_linear_and_conv1d_weights_only():
    # an audio stem's Conv1d costs 2 FLOPs per weight and output frame like a Linear: counted
    module = nn.Sequential(
        nn.Conv1d(3, 5, kernel_size=4), nn.LayerNorm(5), nn.Embedding(7, 5), nn.Linear(5, 6)
    )
    assert matmul_params(module) == 3 * 5 * 4 + 5 * 6


def test_measured_peak_is_a_positive_rate():
    peak = measure_peak_flops(n=128, repeats=2)
    assert math.isfinite(peak) and peak > 0
