"""AdamW with decoupled weight decay on matrices only, linear warmup then cosine decay.

Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (2019). Norm/bias/embedding-free vectors get
no decay (the GPT-2 / LLaMA recipe). Global-norm clipping across pipeline ranks and encoder replicas is
``omni_parallel.grad_clip.clip_grad_norm_``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from omni_train.config import OptimConfig

__all__ = ["build_optimizer", "lr_at"]


def build_optimizer(modules: list[nn.Module], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over every parameter of ``modules``: weight decay on tensors with >= 2 dims only."""
    decay, no_decay = [], []
    for m in modules:
        for p in m.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # torch's fused kernel (one pass per tensor, no Python loop over parameters: 3x faster than the
    # for-loop on a CPU at omni-heavy's sizes) takes plain tensors only; DTensor parameters (TP, FSDP2
    # encoder ZeRO) keep the for-loop implementation
    fused = not any(isinstance(p, DTensor) for p in (*decay, *no_decay))
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=1e-8,
        foreach=False,
        fused=fused or None,
    )


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate at optimizer step ``step`` (from 0): linear warmup over ``warmup_steps`` to ``lr``,
    then cosine to ``min_lr`` at ``total_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * t))
