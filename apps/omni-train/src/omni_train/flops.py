"""FLOPs counting for the MFU estimate.

Counting convention (Kaplan et al., 2020; the PaLM paper's MFU appendix): a multiply-add is 2 FLOPs;
training costs 3x the forward pass (forward + backward through activations + weights).

* LLM forward over a pack: ``2 * P_matmul * T`` for the weight matmuls (``P_matmul``: parameters of every
  Linear, LM head included, embedding excluded; ``T`` tokens) plus, per layer, ``2 * dim * n^2`` for each
  document of ``n`` tokens (``Q K^T`` and ``A V`` are ``n^2 * dim`` multiply-adds each, halved by the causal
  mask).
* Encoder forward over a sample of ``n`` encoder tokens: ``2 * P_matmul * n`` plus ``4 * dim * n^2`` per
  layer (bidirectional attention, no halving).

MFU = model FLOPs per second / peak FLOPs per second. There is no datasheet peak for a CPU core, so the
peak is *measured*: the best of a few dense float32 ``1024 x 1024`` matmuls on this process's threads
(:func:`measure_peak_flops`); on a GPU it is the same measurement. The estimate is therefore "fraction of
what this device does on a large dense matmul", which is what MFU means in practice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["attention_flops", "matmul_params", "measure_peak_flops", "model_flops"]


def matmul_params(module: nn.Module) -> int:
    """Parameters of every ``nn.Linear`` and ``nn.Conv1d`` weight in ``module`` (biases, norms, embeddings
    excluded): the ones that cost ``2`` FLOPs per token each in a forward pass."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear | nn.Conv1d))


def attention_flops(doc_lengths: Sequence[int], dim: int, n_layers: int, *, causal: bool) -> float:
    """Forward FLOPs of the score and value matmuls over packed documents (see module docstring)."""
    sq = float(sum(n * n for n in doc_lengths))
    return n_layers * (2.0 if causal else 4.0) * dim * sq


def model_flops(matmul_param_count: int, tokens: int, attn_flops: float, *, training: bool = True) -> float:
    """``(2 * P * T + attention) * (3 if training else 1)`` FLOPs."""
    fwd = 2.0 * matmul_param_count * tokens + attn_flops
    return 3.0 * fwd if training else fwd


def measure_peak_flops(device: torch.device | None = None, n: int = 1024, repeats: int = 3) -> float:
    """Best FLOPs/s of ``repeats`` dense float32 ``n x n`` matmuls on ``device`` (``2 n^3`` FLOPs each)."""
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
