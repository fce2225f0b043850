"""Async saves: staged vs done, the host-memory budget, background errors at the next call, no races."""

import os
import time

import pytest
import torch

from omni_ckpt import CheckpointError, CheckpointManager, PlanCache, async_save, load


def test_async_save_stages_within_budget_then_commits(tmp_path):
    w = torch.randn(32, 32)
    state = {"w": w, "v": torch.randn(100), "tiny": torch.arange(3), "meta": {"epoch": 2}}
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    h = async_save(state, str(tmp_path / "c"), host_budget_bytes=1024)
    h.staged.result(timeout=60)
    w.add_(1.0)  # training resumes: must not reach the checkpoint
    h.wait(timeout=60)
    assert h.peak_staged_bytes <= 32 * 32 * 4  # the largest box alone exceeds the budget
    target = {
        "w": torch.zeros(32, 32),
        "v": torch.zeros(100),
        "tiny": torch.zeros(3, dtype=torch.int64),
        "meta": {},
    }
    target["meta"] = {"epoch": 0}
    load(target, str(tmp_path / "c"))
    for k in ("w", "v", "tiny"):
        assert torch.equal(target[k], saved[k])
    assert target["meta"] == {"epoch": 2}
    with pytest.raises(ValueError, match="host_budget_bytes"):
        async_save(state, str(tmp_path / "d"), host_budget_bytes=0)
    # Saves sharing a plan cache never overlap: the second plans only once the first is durable.
    cache = PlanCache()
    slow = lambda: time.sleep(0.3)  # noqa: E731 - the first commit is still running when the second starts
    first = async_save(state, str(tmp_path / "e1"), plan_cache=cache, on_commit=slow)
    second = async_save(state, str(tmp_path / "e2"), plan_cache=cache, host_budget_bytes=1024)
    assert first.done.done() and cache.in_flight is second.done
    second.wait(timeout=60)
    assert cache.hits == 1 and cache.misses == 1


def test_manager_background_error_surfaces_and_saves_serialise(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=2, async_save=True)
    state = {"w": torch.randn(8, 8), "step": 0}
    os.makedirs(tmp_path / "step-00000002" / "rank-00000.safetensors")  # the writer will fail on it
    mgr.save(1, state)
    handle = mgr.save(2, state)  # waits for step 1 first
    with pytest.raises(Exception, match="IsADirectoryError"):
        handle.wait(timeout=60)
    with pytest.raises(CheckpointError, match=r"background save of step 2 failed"):
        mgr.save(3, state)
    assert mgr.latest() == 1
    for step in (3, 4, 5):
        state["step"] = step
        mgr.save(step, state)  # each waits for the previous one
    mgr.close()
    assert mgr.steps() == [4, 5] and mgr.latest() == 5
    target = {"w": torch.zeros(8, 8), "step": -1}
    assert mgr.load_latest(target) == 5 and target["step"] == 5 and torch.equal(target["w"], state["w"])
    with pytest.raises(CheckpointError, match="already there"):
        mgr.save(5, state)
