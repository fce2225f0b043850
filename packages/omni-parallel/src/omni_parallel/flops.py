"""The one FLOP model of a transformer stack, shared by the data balancer, the pipeline planner and
simulator, and a trainer's MFU.

Counting convention (Kaplan et al., 2020, §2.1; Chowdhery et al., 2022, PaLM, appendix B): a
multiply-add is 2 FLOPs; training costs 3x the forward pass (forward + backward through activations and
through weights).

Per layer of width ``d`` (``h`` query heads of ``d_h = d / h`` features, ``h_kv`` key/value heads: GQA,
Ainslie et al., 2023), per token:

* Q, K, V and output projections: ``2 * (d*d + 2*d*h_kv*d_h + d*d)`` FLOPs;
* the MLP of hidden width ``f`` (``ffn_dim``, or ``mlp_ratio * d``): ``2 * 2*d*f`` for a two-matmul
  (GELU) MLP, ``2 * 3*d*f`` for a gated one (SwiGLU: gate, up and down projections; Shazeer, 2020);

and per document of ``n`` tokens: ``Q K^T`` and ``A V`` are ``n^2 * d`` multiply-adds each, ``4 * d * n^2``
FLOPs, halved under a causal mask (the convention of PaLM's MFU and Megatron-LM: the diagonal's
``2 * d * n`` is not counted). Attention runs per packed document (varlen attention), so a pack's
attention term is a sum over its documents, not its length squared. Norms, activations, softmax,
rotary embeddings and biases are not counted (lower order in ``d``).

MFU = model FLOPs per second / peak FLOPs per second. Without a datasheet peak (a CPU core has none)
the peak is *measured*: the best of a few dense float32 ``n x n`` matmuls (:func:`measure_peak_flops`),
on a GPU the same measurement; the estimate is then "the fraction of what this device does on a large
dense matmul".
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "TransformerShape",
    "attention_flops",
    "forward_flops",
    "layer_flops_per_token",
    "matmul_params",
    "measure_peak_flops",
    "model_flops",
]


@dataclass(frozen=True, slots=True)
class TransformerShape:
    """The sizes of a stack of identical transformer blocks that set its FLOPs.

    Args:
        dim: model width ``d``, features.
        n_layers: blocks.
        n_heads: query heads ``h`` (``d`` must be a multiple of it).
        n_kv_heads: key/value heads ``h_kv`` (GQA); ``None``: ``n_heads`` (multi-head attention).
        ffn_dim: MLP hidden width ``f``, features; ``None``: ``mlp_ratio * dim``.
        mlp_ratio: MLP hidden width over ``dim`` when ``ffn_dim`` is not given.
        gated_mlp: a gated MLP (SwiGLU: 3 matmuls) rather than a two-matmul one (GELU).

    Raises:
        ValueError: ``dim``, ``n_layers`` or ``n_heads`` < 1, ``dim`` not a multiple of ``n_heads``,
            ``n_kv_heads`` not a divisor of ``n_heads``, or a negative or non-finite MLP width.
    """

    dim: int
    n_layers: int = 1
    n_heads: int = 1
    n_kv_heads: int | None = None
    ffn_dim: float | None = None
    mlp_ratio: float = 4.0
    gated_mlp: bool = False

    def __post_init__(self) -> None:
        if self.dim < 1 or self.n_layers < 1 or self.n_heads < 1:
            raise ValueError(
                f"TransformerShape: dim ({self.dim}), n_layers ({self.n_layers}) and n_heads "
                f"({self.n_heads}) must be >= 1"
            )
        if self.dim % self.n_heads:
            raise ValueError(f"TransformerShape: dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        kv = self.n_kv_heads
        if kv is not None and not (1 <= kv <= self.n_heads and self.n_heads % kv == 0):
            raise ValueError(f"TransformerShape: n_kv_heads {kv} must divide n_heads {self.n_heads}")
        width = self.mlp_dim
        if not (width >= 0 and math.isfinite(width)):
            raise ValueError(
                f"TransformerShape: the MLP width (ffn_dim {self.ffn_dim}, mlp_ratio {self.mlp_ratio}) must "
                "be finite and >= 0"
            )

    @property
    def head_dim(self) -> int:
        """Features per attention head, ``d / h``."""
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (and of the V) projection, ``h_kv * d_h``."""
        return (self.n_heads if self.n_kv_heads is None else self.n_kv_heads) * self.head_dim

    @property
    def mlp_dim(self) -> float:
        """MLP hidden width ``f``: ``ffn_dim``, or ``mlp_ratio * dim``."""
        return float(self.ffn_dim) if self.ffn_dim is not None else self.mlp_ratio * self.dim

    @property
    def layer_matmul_params(self) -> float:
        """Weights of one block's matmuls (Q, K, V, output, MLP): each costs 2 FLOPs per token."""
        d = float(self.dim)
        attention = 2.0 * d * d + 2.0 * d * self.kv_dim
        return attention + (3.0 if self.gated_mlp else 2.0) * d * self.mlp_dim

    @property
    def matmul_params(self) -> float:
        """Weights of every block's matmuls, ``n_layers * layer_matmul_params``."""
        return self.n_layers * self.layer_matmul_params


def attention_flops(doc_lengths: Sequence[int], dim: int, n_layers: int, *, causal: bool) -> float:
    """Forward FLOPs of the score and value matmuls (``Q K^T``, ``A V``) over packed documents:
    ``n_layers * (2 if causal else 4) * dim * sum(n**2)`` (see the module docstring).

    Args:
        doc_lengths: tokens of each document (attention runs within a document).
        dim: query width ``h * d_h``, features.
        n_layers: attention layers.
        causal: a causal mask (half the products counted).
    """
    sq = float(sum(n * n for n in doc_lengths))
    return n_layers * (2.0 if causal else 4.0) * dim * sq


def forward_flops(shape: TransformerShape, doc_lengths: Sequence[int], *, causal: bool) -> float:
    """Forward FLOPs of ``shape``'s blocks over documents of ``doc_lengths`` tokens: every matmul
    weight twice per token plus :func:`attention_flops` per document (no embedding, LM head or loss).

    Raises:
        ValueError: a negative document length.
    """
    if any(n < 0 for n in doc_lengths):
        raise ValueError(f"forward_flops: document lengths must be >= 0 tokens, got {list(doc_lengths)}")
    tokens = float(sum(doc_lengths))
    return 2.0 * shape.matmul_params * tokens + attention_flops(
        doc_lengths, shape.dim, shape.n_layers, causal=causal
    )


def layer_flops_per_token(shape: TransformerShape, seq_len: int, *, causal: bool) -> float:
    """Forward FLOPs per token of ONE of ``shape``'s blocks over a document of ``seq_len`` tokens: its
    matmuls plus its share of the document's attention (``(2 if causal else 4) * dim * seq_len``).

    Raises:
        ValueError: ``seq_len < 1``.
    """
    if seq_len < 1:
        raise ValueError(f"layer_flops_per_token: seq_len must be >= 1 token, got {seq_len}")
    return 2.0 * shape.layer_matmul_params + attention_flops([seq_len], shape.dim, 1, causal=causal) / seq_len


def matmul_params(module: nn.Module) -> int:
    """Parameters of every ``nn.Linear`` and ``nn.Conv1d`` weight in ``module`` (biases, norms, embeddings
    excluded): the ones that cost 2 FLOPs per token each in a forward pass."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear | nn.Conv1d))


def model_flops(
    matmul_param_count: float, tokens: float, attn_flops: float, *, training: bool = True
) -> float:
    """``(2 * P * T + attention) * (3 if training else 1)`` FLOPs: ``P`` matmul weights (see
    :func:`matmul_params`) over ``T`` tokens plus ``attn_flops`` (:func:`attention_flops`)."""
    fwd = 2.0 * matmul_param_count * tokens + attn_flops
    return 3.0 * fwd if training else fwd


def measure_peak_flops(device: torch.device | None = None, n: int = 1024, repeats: int = 3) -> float:
    """Best FLOPs/s of ``repeats`` dense float32 ``n x n`` matmuls on ``device`` (``2 n^3`` FLOPs each;
    default the CPU)."""
    device = device or torch.device("cpu")
    # Values do not change a dense matmul's speed; constants keep the global RNG untouched.
    a = torch.full((n, n), 0.5, device=device)
    b = torch.full((n, n), 0.25, device=device)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best
