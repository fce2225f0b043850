"""An async ``CheckpointManager.save`` cannot race the optimizer: by default it returns only once the state
is staged to host memory; the fast way (``return_before_staged=True``) is an explicit opt-in whose caller
waits on ``handle.staged``. Staging is slowed on purpose (a patched copy) so a race, if any, always loses."""

import threading
import time

import pytest
import torch

import omni_ckpt.transfer as transfer
from omni_ckpt import CheckpointManager

_real_fill = transfer._fill


def _slow_fill(delay_s: float, gate: threading.Event | None = None):
    def fill(*args, **kwargs):
        if gate is not None:
            assert gate.wait(timeout=60), "the test never released staging"
        time.sleep(delay_s)
        return _real_fill(*args, **kwargs)

    return fill


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 64, generator=g, dtype=torch.float64)},
        "optim": {"exp_avg": torch.randn(64, 64, generator=g, dtype=torch.float64)},
        "step": seed,
    }


def _optimizer_step(state: dict) -> None:
    # In place, as torch.optim does: the saved tensors themselves change.
    state["model"]["w"].add_(1.0)
    state["optim"]["exp_avg"].mul_(0.5)


def _loaded(mgr: CheckpointManager, step: int) -> dict:
    target = {
        "model": {"w": torch.zeros(64, 64, dtype=torch.float64)},
        "optim": {"exp_avg": torch.zeros(64, 64, dtype=torch.float64)},
        "step": -1,
    }
    mgr.load(step, target)
    return target


def test_ckpt_async_save_returns_staged_so_an_optimizer_step_right_after_does_not_leak(tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "_fill", _slow_fill(0.5))
    mgr = CheckpointManager(str(tmp_path), keep_last=None, async_save=True)
    state = _state(1)
    expected = {k: v.clone() for k, v in (("w", state["model"]["w"]), ("m", state["optim"]["exp_avg"]))}
    handle = mgr.save(1, state)
    assert handle is not None and handle.staged.done()
    _optimizer_step(state)  # at once, as a training loop does
    mgr.wait()
    got = _loaded(mgr, 1)
    assert torch.equal(got["model"]["w"], expected["w"])
    assert torch.equal(got["optim"]["exp_avg"], expected["m"])
    assert got["step"] == 1


def test_ckpt_async_save_fast_way_returns_before_staging_and_the_caller_waits(tmp_path, monkeypatch):
    gate = threading.Event()
    monkeypatch.setattr(transfer, "_fill", _slow_fill(0.0, gate))
    mgr = CheckpointManager(str(tmp_path), keep_last=None, async_save=True)
    state = _state(2)
    expected = state["model"]["w"].clone()
    handle = mgr.save(2, state, return_before_staged=True)
    assert handle is not None and not handle.staged.done()  # staging cannot start before the gate opens
    gate.set()
    handle.staged.result(timeout=60)  # the opt-in caller's duty, before the optimizer step
    _optimizer_step(state)
    handle.wait(timeout=60)
    assert torch.equal(_loaded(mgr, 2)["model"]["w"], expected)
    with pytest.raises(ValueError, match="return_before_staged"):
        CheckpointManager(str(tmp_path / "sync"), async_save=False).save(1, state, return_before_staged=True)
