"""Optimizer state by parameter name, so it reshards and reloads into a fresh optimizer.

``torch.optim.Optimizer.state_dict()`` keys state by the parameter's position across ``param_groups``
(0, 1, ...). :func:`optimizer_state_dict` maps position ``i`` to ``model.named_parameters()``'s name of
the ``i``-th parameter in ``param_groups`` order::

    {"state": {"layer.weight": {"exp_avg": T, "exp_avg_sq": T, "step": T}, ...},
     "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], ..., "params": ["layer.weight", ...]}, ...]}

The tensors in it are the optimizer's own (no copies), so :func:`omni_ckpt.load` fills them in place;
:func:`load_optimizer_state_dict` then hands the result (hyperparameters included) back to the optimizer.

An optimizer that has not stepped yet has no state tensors to load into. torch offers no public way to
create them, so :func:`init_optimizer_state` runs one step with zero gradients and ``lr = 0`` (what
``torch.distributed.checkpoint.state_dict`` does too); parameters stay bit-identical (checked for Adam with
amsgrad and L2 decay, AdamW with decoupled decay, SGD with momentum, NAdam, RAdam, Adagrad: AdamW's decay
multiplies by ``1 - 0 * wd``, Adam's update is ``0 * m / (sqrt(v) + eps)``). LBFGS, whose ``step`` needs a
closure, is not supported.
:func:`optimizer_state_dict` then takes that state back out of the optimizer, so building a load target
never changes how a fresh optimizer trains (``step`` counts and moments start from nothing if no checkpoint
is loaded).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["init_optimizer_state", "load_optimizer_state_dict", "optimizer_state_dict"]


def _ordered_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"optimizer param_groups[{g}] holds a parameter that is not in the model")
            out.append(names[id(p)])
    return out


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state tensors without changing any parameter.

    Runs one ``step()`` with zero gradients and every group's ``lr`` set to 0, then restores each group's
    ``lr`` and each parameter's gradient as they were. The optimizer keeps the state this creates (Adam's
    ``step`` is then 1): call it only to load into; :func:`optimizer_state_dict` does so and takes the state
    back out. Does nothing if any state exists already.
    """
    if any(optimizer.state.values()):
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved_grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (see the module docstring).

    For an optimizer that has not stepped yet, the state tensors are created as load targets (by
    :func:`init_optimizer_state`) and only returned: the optimizer itself is left without state, so it
    trains exactly as if this was never called unless :func:`load_optimizer_state_dict` hands it a loaded
    state. Those placeholder tensors (``step`` 1, zero moments) are not the state of an optimizer that has
    not stepped: save an optimizer after its first step.

    Raises:
        ValueError: a parameter of the optimizer is not in ``model``.
    """
    names = _ordered_names(model, optimizer)
    fresh = not any(optimizer.state.values())
    init_optimizer_state(optimizer)
    sd = optimizer.state_dict()
    state = {names[i]: dict(s) for i, s in sd["state"].items()}
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]]
    if fresh:
        optimizer.state.clear()
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Give ``optimizer`` a name-keyed state (from :func:`optimizer_state_dict`, loaded), hyperparameters
    included.

    Raises:
        ValueError: a name in ``state`` is not a parameter the optimizer holds.
    """
    names = _ordered_names(model, optimizer)
    index = {n: i for i, n in enumerate(names)}
    unknown = [n for n in state["state"] if n not in index]
    unknown += [n for g in state["param_groups"] for n in g["params"] if n not in index]
    if unknown:
        raise ValueError(
            f"optimizer state names parameters the optimizer does not hold: {sorted(set(unknown))[:5]}"
        )
    sd = {
        "state": {index[n]: s for n, s in state["state"].items()},
        "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in state["param_groups"]],
    }
    optimizer.load_state_dict(sd)
