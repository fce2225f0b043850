"""Optimizer state by parameter name, so it reshards and reloads into a fresh optimizer, with exact
"no state" for parameters that have none (frozen ones, experts no token was routed to yet).

``torch.optim.Optimizer.state_dict()`` keys state by the parameter's position across ``param_groups``
(0, 1, ...). :func:`optimizer_state_dict` maps position ``i`` to ``model.named_parameters()``'s name of
the ``i``-th parameter in ``param_groups`` order::

    {"state": {"layer.weight": {"exp_avg": T, "exp_avg_sq": T, "step": T}, ...},
     "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], ..., "params": ["layer.weight", ...]}, ...],
     "no_state": ["frozen.weight", "moe.expert7.w1", ...]}

The tensors of parameters that have state are the optimizer's own (no copies), so :func:`omni_ckpt.load`
fills them in place. A parameter without state (never stepped: frozen, never given a gradient, or the
optimizer is fresh) is listed in ``no_state`` and gets a :class:`~omni_ckpt.Placeholder` of state tensors
to load into: :func:`omni_ckpt.save` skips placeholders, so the checkpoint holds no moments and no step
for it, and :func:`omni_ckpt.load` fills a placeholder when the checkpoint has that parameter's state and
removes it when it has none. :func:`load_optimizer_state_dict` then hands the loaded state (hyperparameters
included; the implementation flags ``fused`` / ``foreach`` stay the loading optimizer's, which may run
another layout) back to the optimizer, checking it against the checkpoint's own ``no_state`` list, so a
parameter resumes with exactly the state it had: its moments and per-parameter ``step``, or none at all.

Placeholder tensors come from a throwaway optimizer of the same class and hyperparameters over zero
copies of those parameters, stepped once with zero gradients and ``lr = 0``: the real optimizer is never
stepped (no hooks run, no counters move) and no parameter is touched. An optimizer class that cannot be
rebuilt from its ``param_groups`` (LBFGS needs a closure to step) is not supported.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_ckpt.state import Placeholder

__all__ = ["init_optimizer_state", "load_optimizer_state_dict", "optimizer_state_dict"]

# param_groups keys that choose an implementation, not a hyperparameter: kept from the loading optimizer
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def _ordered(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[str], list[torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out, params = [], []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"optimizer param_groups[{g}] holds a parameter that is not in the model")
            out.append(names[id(p)])
            params.append(p)
    return out, params


def _placeholder_state(optimizer: torch.optim.Optimizer, wanted: set[int]) -> dict[int, dict[str, Any]]:
    """State tensors shaped as ``optimizer`` would create them for the parameters at positions ``wanted``
    (positions across ``param_groups``), from a throwaway optimizer; ``optimizer`` itself is not touched."""
    if not wanted:
        return {}
    groups, shadows = [], {}
    pos = 0
    for group in optimizer.param_groups:
        mine = []
        for p in group["params"]:
            if pos in wanted:
                s = torch.nn.Parameter(torch.zeros_like(p.detach()))
                s.grad = torch.zeros_like(s)
                shadows[pos] = s
                mine.append(s)
            pos += 1
        if mine:
            hyper = {k: v for k, v in group.items() if k != "params"}
            if "lr" in hyper:
                hyper["lr"] = torch.zeros_like(hyper["lr"]) if isinstance(hyper["lr"], torch.Tensor) else 0.0
            groups.append({**hyper, "params": mine})
    shadow_opt = type(optimizer)(groups)
    shadow_opt.step()
    return {i: dict(shadow_opt.state[s]) for i, s in shadows.items()}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of ``optimizer`` that has no state the state tensors its first step would create
    (``step`` 1, zero moments), without stepping ``optimizer`` or changing any parameter.

    The optimizer keeps this state: call it only to load into. :func:`optimizer_state_dict` does not need
    it (its placeholders are separate tensors and the optimizer stays as it was).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = {i for i, p in enumerate(params) if not optimizer.state.get(p)}
    for i, s in _placeholder_state(optimizer, missing).items():
        optimizer.state[params[i]] = s


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (see the module docstring): real state by reference,
    a :class:`~omni_ckpt.Placeholder` for each parameter without state, and their names in ``no_state``.

    The optimizer is left exactly as it was (nothing is stepped or added).

    Raises:
        ValueError: a parameter of the optimizer is not in ``model``.
    """
    names, params = _ordered(model, optimizer)
    missing = {i for i, p in enumerate(params) if not optimizer.state.get(p)}
    placeholders = _placeholder_state(optimizer, missing)
    sd = optimizer.state_dict()
    state: dict[str, Any] = {names[i]: dict(s) for i, s in sd["state"].items() if i not in missing}
    for i in sorted(missing):
        state[names[i]] = Placeholder(placeholders[i])
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups, "no_state": [names[i] for i in sorted(missing)]}


def load_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Give ``optimizer`` a name-keyed state (from :func:`optimizer_state_dict`, loaded), hyperparameters
    included. Parameters without state in it (no entry, or a placeholder the load did not fill) get none.

    Raises:
        ValueError: a name in ``state`` is not a parameter the optimizer holds, or the state disagrees with
            its own ``no_state`` list (a parameter has state but is listed, or has none and is not listed),
            naming the parameter.
    """
    names, _ = _ordered(model, optimizer)
    index = {n: i for i, n in enumerate(names)}
    unknown = [n for n in state["state"] if n not in index]
    unknown += [n for g in state["param_groups"] for n in g["params"] if n not in index]
    if unknown:
        raise ValueError(
            f"optimizer state names parameters the optimizer does not hold: {sorted(set(unknown))[:5]}"
        )
    real = {n: s for n, s in state["state"].items() if not isinstance(s, Placeholder)}
    if "no_state" in state:
        listed = set(state["no_state"])
        both = sorted(listed & set(real))
        if both:
            raise ValueError(
                f"optimizer state for {both[0]!r} is present but the state lists it under no_state"
            )
        neither = [n for n in names if n not in real and n not in listed]
        if neither:
            raise ValueError(
                f"no optimizer state for parameter {neither[0]!r}, and the state does not list it under no_state"
            )
    # How the optimizer computes (fused / foreach kernels) is the optimizer's own, never the checkpoint's:
    # a layout with DTensor parameters cannot run a fused kernel that a layout of plain tensors chose.
    own = [{k: g[k] for k in _IMPLEMENTATION if k in g} for g in optimizer.param_groups]
    groups = [dict(g, params=[index[n] for n in g["params"]]) for g in state["param_groups"]]
    sd = {
        "state": {index[n]: s for n, s in real.items()},
        "param_groups": [dict(g, **mine) for g, mine in zip(groups, own)] + groups[len(own) :],
    }
    optimizer.load_state_dict(sd)
