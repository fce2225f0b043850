"""``require_finite``: a step whose state holds a NaN or Inf is refused before anything is written, and
pruning never removes the last good step for it (issue 29: an lr blow-up committed steps 8 and 10 with
333 non-finite tensors each and pruned the good steps 2-6).

Reference: the committed steps and their tensors read back whole (``read_full``) against the saved ones.
"""

from __future__ import annotations

import math

import pytest
import torch

from omni_ckpt import CheckpointError, CheckpointManager, read_full
from omni_ckpt.save import nonfinite_tensors


def _state(w: torch.Tensor) -> dict:
    return {"model": {"w": w, "b": torch.ones(3), "ids": torch.arange(4)}, "step": 0}


@pytest.mark.parametrize("async_save", [False, True])
def test_a_non_finite_step_is_refused_and_the_good_ones_stay(tmp_path, async_save):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(str(root), keep_last=2, async_save=async_save, require_finite=True)
    good = [torch.full((2, 3), float(s)) for s in range(3)]
    for s in (1, 2):
        mgr.save(s, _state(good[s].clone()))
    mgr.wait()
    bad = good[2].clone()
    bad[0, 1], bad[1, 2] = math.nan, -math.inf
    for s in (3, 4):
        with pytest.raises(CheckpointError) as refused:
            mgr.save(s, _state(bad))
        msg = str(refused.value)
        assert f"step-{s:08d}: refusing to save non-finite values" in msg and "'model.w' (2)" in msg, msg
        assert "\n" not in msg
    mgr.close()
    assert mgr.steps() == [1, 2]  # keep_last 2: nothing pruned for the refused steps
    assert not (root / "step-00000003").exists() and not (root / "step-00000004").exists()
    for s in (1, 2):
        tensors, _ = read_full(mgr.step_url(s))
        assert torch.equal(tensors["model.w"], good[s])


def test_without_require_finite_a_nan_is_saved_as_before(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ckpt"), async_save=False)
    w = torch.tensor([[math.nan, 1.0]])
    mgr.save(1, _state(w))
    tensors, _ = read_full(mgr.step_url(1))
    assert torch.equal(tensors["model.w"].isnan(), w.isnan())


def test_nonfinite_tensors_counts_floating_tensors_only():
    t = torch.tensor([1.0, math.nan, math.inf, -math.inf])
    pieces = [("a", t), ("a", torch.tensor([math.nan])), ("b", torch.ones(2)), ("i", torch.arange(3))]
    assert nonfinite_tensors(iter(pieces)) == {"a": 4}
    assert nonfinite_tensors(iter([])) == {}
    # finite values whose float32 sum overflows: suspected by the sum, cleared by the count
    assert nonfinite_tensors(iter([("big", torch.full((4,), 3e38))])) == {}
