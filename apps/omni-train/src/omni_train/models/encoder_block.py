"""The bidirectional transformer block both encoders use (pre-LayerNorm, GELU-family MLP, optional RoPE,
per-sample attention)."""

from __future__ import annotations

from enum import StrEnum

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omni_parallel.ulysses import ulysses_attention
from omni_parallel.varlen import varlen_attention
from omni_train.models.attention import apply_rope

__all__ = ["Activation", "EncoderBlock", "activation", "init_linear_"]


class Activation(StrEnum):
    """MLP activation of an encoder block.

    ``gelu``: exact (erf) GELU (Hendrycks & Gimpel, 2016), Whisper's; ``quick_gelu``: ``x * sigmoid(1.702 x)``
    (CLIP's, the Qwen2-VL vision tower's); ``gelu_tanh``: the tanh approximation (SigLIP's).
    """

    GELU = "gelu"
    QUICK_GELU = "quick_gelu"
    GELU_TANH = "gelu_tanh"


def activation(x: torch.Tensor, kind: Activation | str) -> torch.Tensor:
    """Apply activation ``kind`` elementwise. Raises ``ValueError`` for an unknown name."""
    kind = Activation(kind)
    if kind is Activation.GELU:
        return F.gelu(x)
    if kind is Activation.QUICK_GELU:
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x, approximate="tanh")


def init_linear_(module: nn.Module, gen: torch.Generator, std: float = 0.02) -> None:
    """Draw every 2-D ``weight`` from N(0, std^2) with ``gen`` and zero every bias (deterministic init)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.is_meta:  # no values to draw (the memory plan builds on meta)
                continue
            elif name.endswith("weight") and p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).mul_(std).to(p.dtype))
            elif name.endswith("bias"):
                p.zero_()


class EncoderBlock(nn.Module):
    """``x + attn(ln(x))``, ``x + mlp(ln(x))``; attention is bidirectional inside each packed sample.

    Args:
        dim: features; ``n_heads`` must divide it.
        n_heads: attention heads.
        mlp_ratio: MLP hidden width ``mlp_ratio * dim``.
        norm_eps: LayerNorm epsilon (1e-5: torch's and Whisper's; 1e-6: Qwen2-VL's vision tower).
        act: MLP activation.

    Forward:
        x: ``[T, dim]`` packed tokens of several samples.
        rope: ``(cos, sin)`` each ``[T, head_dim // 2]``, or None for no rotary positions (an encoder with
            absolute positions added to its input, as Whisper's).
        cu_seqlens: int64 ``[num_samples + 1]`` sample boundaries (tokens).
        sp_group: encoder sequence parallelism (long-short SP): ``x`` is this rank's contiguous
            ``1/sp`` chunk of the packed sequence, ``rope`` its rows, ``cu_seqlens`` the whole
            sequence's; attention runs through ``omni_parallel.ulysses_attention`` (all-to-all
            tokens <-> heads). ``None``: the whole sequence is here.

    Returns:
        ``[T, dim]``.

    The two residual branches are methods, :meth:`attention_branch` and :meth:`mlp_branch`, so selective
    recompute (``omni_parallel.parallelize.apply_ac``, ``train.recompute_modules``) can checkpoint either.

    Raises:
        ValueError: ``dim`` not divisible by ``n_heads``.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        mlp_ratio: int = 4,
        *,
        norm_eps: float = 1e-5,
        act: Activation | str = Activation.GELU,
    ) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"encoder dim {dim} not divisible by n_heads {n_heads}")
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.act = Activation(act)
        self.ln1 = nn.LayerNorm(dim, eps=norm_eps)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim, eps=norm_eps)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cu_seqlens: torch.Tensor,
        sp_group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        x = x + self.attention_branch(x, rope, cu_seqlens, sp_group)
        return x + self.mlp_branch(x)

    def attention_branch(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cu_seqlens: torch.Tensor,
        sp_group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """``proj(attention(qkv(ln1(x))))``: ``[T, dim] -> [T, dim]``; with ``sp_group``, ``x`` is this
        rank's sequence chunk and attention runs Ulysses over the group (heads all-to-all)."""
        t = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).view(t, 3, self.n_heads, self.head_dim).unbind(1)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if sp_group is None:
            a = varlen_attention(q, k, v, cu_seqlens, causal=False)
        else:
            a = ulysses_attention(q, k, v, sp_group, cu_seqlens=cu_seqlens, causal=False)
        return self.proj(a.reshape(t, -1))

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        """``fc2(act(fc1(ln2(x))))``: ``[T, dim] -> [T, dim]``."""
        return self.fc2(activation(self.fc1(self.ln2(x)), self.act))
