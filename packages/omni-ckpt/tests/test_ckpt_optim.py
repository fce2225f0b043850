"""Optimizer state where some parameters have none: a frozen layer and experts no token was routed to are
saved as "no state" and resume bit-identically (parameters and every state tensor, per-parameter step
counts included) over 3 further steps, against the same run uninterrupted. The trainer's calls are used:
optimizer_state_dict / CheckpointManager.save / .load / load_optimizer_state_dict."""

import pytest
import torch
from torch import nn

from omni_ckpt import (
    CheckpointError,
    CheckpointManager,
    Placeholder,
    load,
    load_optimizer_state_dict,
    optimizer_state_dict,
    read_manifest,
    save,
)

ROUTES = [[0], [0], [0], [0, 1], [0], [0, 2]]  # expert 1 first routed after the checkpoint, expert 2 last
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True, weight_decay=0.01),
}


class Experts(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x, route):
        h = self.frozen(self.inp(x))
        return sum(self.experts[e](h) for e in route)


def _step(model, opt, k):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 + k))
    model(x, ROUTES[k]).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snapshot(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return params, state


def _bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_frozen_and_never_routed_parameters_resume_bit_identically(tmp_path, kind):
    make = OPTIMIZERS[kind]
    ref = Experts(0)
    ref_opt = make(ref.parameters())  # the frozen layer is in the optimizer too, as in many trainers
    for k in range(6):
        _step(ref, ref_opt, k)
    want_params, want_state = _snapshot(ref, ref_opt)
    assert "experts.1.weight" in want_state and "frozen.weight" not in want_state

    run = Experts(0)
    opt = make(run.parameters())
    for k in range(3):
        _step(run, opt, k)
    mgr = CheckpointManager(str(tmp_path), async_save=True)
    sd = optimizer_state_dict(run, opt)
    assert sd["no_state"] == ["frozen.weight", "frozen.bias", "experts.1.weight", "experts.1.bias",
                              "experts.2.weight", "experts.2.bias"]  # fmt: skip
    assert isinstance(sd["state"]["experts.1.weight"], Placeholder) and len(opt.state) == 4  # untouched
    mgr.save(3, {"model": run.state_dict(), "optim": sd})
    mgr.close()
    saved = read_manifest(mgr.step_url(3))["tensors"]
    assert "optim.state.experts.0.weight.exp_avg" in saved
    assert not [n for n in saved if n.startswith(("optim.state.experts.1", "optim.state.frozen"))]

    # Resume as a restarted trainer does: fresh model (another init) and fresh optimizer, then load.
    fresh = Experts(1)
    fresh_opt = make(fresh.parameters())
    state = {"model": fresh.state_dict(), "optim": optimizer_state_dict(fresh, fresh_opt)}
    result = CheckpointManager(str(tmp_path)).load(3, state)
    assert result.absent == [f"optim.state.{n}" for n in sorted(sd["no_state"])]
    load_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    assert len(fresh_opt.state) == 4  # inp and expert 0 only: "no state" stays no state
    assert all(s["step"].item() == 3 for s in fresh_opt.state.values())
    for k in range(3, 6):
        _step(fresh, fresh_opt, k)
    got_params, got_state = _snapshot(fresh, fresh_opt)
    assert all(_bits_equal(got_params[n], want_params[n]) for n in want_params)
    assert set(got_state) == set(want_state)
    for n, s in want_state.items():
        assert set(got_state[n]) == set(s)
        assert all(_bits_equal(got_state[n][k], v) for k, v in s.items()), n
    assert got_state["experts.2.weight"]["step"].item() == 1 and got_state["inp.weight"]["step"].item() == 6


def test_inconsistent_optimizer_state_is_refused(tmp_path):
    model = Experts(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, 0)
    save({"optim": optimizer_state_dict(model, opt)}, str(tmp_path / "c"))
    # A checkpoint with state for only some of a placeholder's tensors: named, nothing loaded.
    fresh = Experts(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    target = {"optim": optimizer_state_dict(fresh, fresh_opt)}
    target["optim"]["state"]["experts.1.weight"] = Placeholder(
        {"exp_avg": torch.zeros(4, 4), "step": torch.tensor(0.0)}
    )
    target["optim"]["state"]["inp.weight"] = Placeholder(
        {"exp_avg": torch.zeros(4, 4), "extra": torch.zeros(1), "step": torch.tensor(0.0)}
    )
    with pytest.raises(
        CheckpointError, match=r"'optim\.state\.inp\.weight' is only partly in the checkpoint"
    ):
        load(target, str(tmp_path / "c"))
    # State present for a parameter the no_state list names, or missing for one it does not.
    sd = optimizer_state_dict(model, opt)
    with pytest.raises(ValueError, match=r"'inp\.weight' is present but the state lists it under no_state"):
        load_optimizer_state_dict(model, opt, dict(sd, no_state=[*sd["no_state"], "inp.weight"]))
    dropped = dict(sd, state={n: s for n, s in sd["state"].items() if n != "inp.bias"})
    with pytest.raises(ValueError, match=r"no optimizer state for parameter 'inp\.bias'"):
        load_optimizer_state_dict(model, opt, dropped)
