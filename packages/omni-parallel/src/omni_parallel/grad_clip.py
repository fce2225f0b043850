"""Global-norm gradient clipping across pipeline ranks and replicated (or sharded) encoders.

The norm is the L2 norm of every gradient of the whole model, however it is laid out over the ranks:

* each pipeline rank holds its own LLM stage(s) (``owned``): the stages' squared norms are summed over the
  pipeline group (as torchtitan's ``clip_grad_norm_`` does with a pp mesh);
* modules every rank of the pipeline group holds with identical, already reduced gradients (encoders
  under encoder data parallelism, ``replicated``) count once, not once per pipeline rank;
* DTensor gradients (tensor-parallel shards, FSDP2 / encoder ZeRO-2/3 shards) are made whole over their
  own mesh by torch's ``get_total_norm`` (shards add up, replicated placements count once).

torch's ``get_total_norm`` and ``clip_grads_with_norm_`` do the per-rank work; squared norms are summed in
float64. Source: Pascanu et al., "On the difficulty of training recurrent neural networks" (2013), global
norm clipping; torchtitan ``dist_utils.clip_grad_norm_`` for the pipeline reduction.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    owned: Iterable[nn.Parameter],
    replicated: Iterable[nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None,
) -> float:
    """Scale all gradients so the global L2 norm is at most ``max_norm``; return the norm before clipping.

    Collective over ``pp_group`` (one all-reduce of a float64 scalar) and over the mesh of every DTensor
    gradient (its norm's ``full_tensor``), so every rank of those groups calls it, in the same order.
    Parameters without a gradient are skipped.

    Args:
        owned: parameters only this pipeline rank holds (its LLM stages).
        replicated: parameters every rank of ``pp_group`` holds with identical, already reduced gradients
            (plain replicas, or DTensor shards over a mesh of their own, e.g. FSDP2-sharded encoders):
            counted once, not summed over ``pp_group``.
        max_norm: the bound (same unit as the gradients' L2 norm); ``<= 0``: measure only.
        pp_group: the pipeline group (``None``: one pipeline rank).

    Returns:
        The global gradient norm before clipping (a Python float; ``0.0`` with no gradients).
    """
    owned, replicated = list(owned), list(replicated)
    first = next(iter((*owned, *replicated)), None)
    device = first.device if first is not None else None
    sq = _squared_norm(owned, device)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    total = (sq + _squared_norm(replicated, device)).sqrt()
    if max_norm > 0:
        for params in (*_by_kind(owned), *_by_kind(replicated)):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def _by_kind(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters with a gradient, grouped: DTensor gradients per device mesh (in order of first
    appearance, e.g. FSDP2 shards over ``dp_cp`` and EP-sharded experts over ``ep``), then the plain ones:
    torch's foreach kernels take one kind, and DTensor ops one mesh, per call."""
    with_grad = [p for p in params if p.grad is not None]
    meshes: dict[int, list[nn.Parameter]] = {}
    for p in with_grad:
        if isinstance(p.grad, DTensor):
            meshes.setdefault(id(p.grad.device_mesh), []).append(p)
    return [*meshes.values(), [p for p in with_grad if not isinstance(p.grad, DTensor)]]


def _squared_norm(params: list[nn.Parameter], device: torch.device | None) -> torch.Tensor:
    """Squared L2 norm of the gradients of ``params``, a float64 scalar on ``device`` (a DTensor norm is
    made whole over its mesh: TP shards add up, replicated weights count once)."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for kind in _by_kind(params):
        if kind:
            norm = torch.nn.utils.get_total_norm([p.grad for p in kind], 2.0)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            sq = sq + norm.to(device=device, dtype=torch.float64) ** 2
    return sq
