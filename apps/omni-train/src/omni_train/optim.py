"""AdamW with decoupled weight decay on matrices only, linear warmup then cosine decay, global-norm clipping.

Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (2019). Norm/bias/embedding-free vectors get
no decay (the GPT-2 / LLaMA recipe). The gradient norm is global over every pipeline stage: each rank's
squared norm of the parameters it owns is summed over the pipeline group; encoder parameters, replicated
on every rank with equal (already reduced) gradients, are counted once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from omni_train.config import OptimConfig

__all__ = ["build_optimizer", "clip_grad_norm_", "lr_at"]


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
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=False)


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate at optimizer step ``step`` (from 0): linear warmup over ``warmup_steps`` to ``lr``,
    then cosine to ``min_lr`` at ``total_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * t))


def clip_grad_norm_(
    owned: list[nn.Parameter],
    replicated: list[nn.Parameter],
    max_norm: float,
    group: dist.ProcessGroup | None,
    *,
    tp_group: dist.ProcessGroup | None = None,
) -> float:
    """Scale all gradients so the global L2 norm is at most ``max_norm``; return the norm before clipping.

    Args:
        owned: parameters only this pipeline rank holds (its LLM stage).
        replicated: parameters every rank of ``group`` holds with identical gradients (encoders).
        group: the pipeline group the owned norms are summed over (``None``: no reduction).
        tp_group: the tensor-parallel group: owned DTensor gradients sharded over it add their local
            squared norms over it; replicated ones (norm weights) are counted once.
    """
    first = next(iter((*owned, *replicated)), None)
    sq = torch.zeros((), dtype=torch.float64, device=first.device if first is not None else None)
    sharded = torch.zeros_like(sq)
    for p in owned:
        if p.grad is None:
            continue
        g = p.grad.detach()
        if isinstance(g, DTensor):
            part = g.to_local().to(torch.float64).pow(2).sum()
            if any(pl.is_shard() for pl in g.placements):
                sharded += part
            else:
                sq += part
        else:
            sq += g.to(torch.float64).pow(2).sum()
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    sq += sharded
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    for p in replicated:
        if p.grad is not None:
            sq += p.grad.detach().to(torch.float64).pow(2).sum()
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in (*owned, *replicated):
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
