"""A checkpoint saved by two pipeline ranks (each holding its own stage, its own AdamW state and a loader
position of its own) loads into one process holding the whole model: weights, name-keyed moments and
per-parameter step counts equal the saved ranks', the next optimizer step equals theirs (float64,
exact), and each rank's plain state comes back from its row. The plain ``optimizer_state_dict`` (per-rank
parameter lists) does not load there: the gap ``portable_optimizer_state_dict`` closes."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from omni_ckpt import (
    CheckpointError,
    CheckpointManager,
    load_object_rows,
    load_optimizer_state_dict,
    load_portable_optimizer_state_dict,
    object_rows,
    optimizer_state_dict,
    portable_optimizer_state_dict,
)
from omni_parallel.testing import run_world


def _model() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {"s0": nn.Linear(4, 3, dtype=torch.float64), "s1": nn.Linear(3, 2, dtype=torch.float64)}
    )


def _grad(p: torch.Tensor, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + p.numel())
    return torch.randn(p.shape, generator=g, dtype=torch.float64)


def _stage(rank: int) -> nn.ModuleDict:
    """What pipeline rank ``rank`` holds of :func:`_model`: its own stage, under the whole model's names."""
    whole = _model()
    return nn.ModuleDict({f"s{rank}": whole[f"s{rank}"]})


def _save(rank, world_size, root, portable):
    model = _stage(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(2):
        for p in model.parameters():
            p.grad = _grad(p, step)
        opt.step()
    optim = portable_optimizer_state_dict(model, opt) if portable else optimizer_state_dict(model, opt)
    loader = object_rows({"rank": rank, "position": [rank, 7 * rank]}, (rank,), (world_size,))
    mgr = CheckpointManager(root, async_save=False)
    mgr.save(2, {"model": model.state_dict(), "optim": optim, "loader": loader})
    mgr.close()
    for p in model.parameters():  # the step after the checkpoint, for the oracle
        p.grad = _grad(p, 2)
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, {
        n: {k: v.clone() for k, v in s.items()} for n, s in optimizer_state_dict(model, opt)["state"].items()
    }


def _load(rank, world_size, root, portable):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    mgr = CheckpointManager(root)
    if not portable:
        state = {"model": model.state_dict(), "optim": optimizer_state_dict(model, opt)}
        with pytest.raises(CheckpointError, match="differs across the 2 saved ranks"):
            mgr.load(2, state)
            load_optimizer_state_dict(model, opt, state["optim"])
        return None
    state = {"model": model.state_dict(), "optim": portable_optimizer_state_dict(model, opt)}
    mgr.load(2, state)
    load_portable_optimizer_state_dict(model, opt, state["optim"])
    rows = load_object_rows(mgr.step_url(2), "loader", [(1,), (0,)])
    for p in model.parameters():
        p.grad = _grad(p, 2)
    opt.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return after, optimizer_state_dict(model, opt)["state"], rows


def test_a_pipeline_checkpoint_loads_into_one_process(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = run_world(_save, 2, args=(root, True))
    after, moments, rows = run_world(_load, 1, args=(root, True))[0]
    assert rows == [{"rank": 1, "position": [1, 7]}, {"rank": 0, "position": [0, 0]}]
    want_params = {**saved[0][0], **saved[1][0]}
    want_moments = {**saved[0][1], **saved[1][1]}
    assert set(after) == set(want_params) and set(moments) == set(want_moments)
    for n, p in after.items():  # one more step from the loaded state: the same as the ranks' own
        assert torch.equal(p, want_params[n]), n
    for n, s in moments.items():
        for k, v in s.items():
            assert torch.equal(v, want_moments[n][k]), (n, k)
    assert float(moments["s1.weight"]["step"]) == 3.0


def test_the_per_rank_optimizer_state_dict_does_not_load_into_another_pipeline_layout(tmp_path):
    root = str(tmp_path / "ckpt")
    run_world(_save, 2, args=(root, False))
    run_world(_load, 1, args=(root, False))


def test_object_rows_checks_its_index_and_the_optimizer_groups():
    with pytest.raises(ValueError, match="outside shape"):
        object_rows({"a": 1}, (2,), (2,))
    model = _model()
    opt = torch.optim.AdamW([{"params": [model["s0"].weight]}, {"params": list(model["s1"].parameters())}])
    state = portable_optimizer_state_dict(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="1 parameter groups, the optimizer has 2"):
        load_portable_optimizer_state_dict(model, opt, state)
    assert not dist.is_initialized()


def _save_uneven_rows(rank, world_size, root):
    # rank 1's value needs more than the minimum row width, rank 0's does not: one width for both
    value = {"rank": rank, "text": "x" * (9000 if rank == 1 else 3)}
    rows = object_rows(value, (rank,), (world_size,))
    mgr = CheckpointManager(root, async_save=False)
    mgr.save(1, {"loader": rows})
    mgr.close()
    return rows["width"]


def test_object_rows_of_different_sizes_agree_on_one_width(tmp_path):
    root = str(tmp_path / "ckpt")
    widths = run_world(_save_uneven_rows, 2, args=(root,))
    assert widths == [16384, 16384]  # 8 + 9000+ bytes, to the next power of two, on both ranks
    got = load_object_rows(f"{root}/step-00000001", "loader", [(0,), (1,)])
    assert got == [{"rank": 0, "text": "xxx"}, {"rank": 1, "text": "x" * 9000}]


def test_object_rows_width_is_a_power_of_two_and_a_bad_length_prefix_is_named(tmp_path):
    # the width (and so the saved tensor's shape and the cached save plan) does not move with the value
    assert (
        object_rows("x" * 5000, (0,), (1,))["width"] == object_rows("x" * 7000, (0,), (1,))["width"] == 8192
    )
    assert object_rows({"a": 1}, (0,), (1,))["width"] == 4096
    rows = object_rows({"a": 1}, (0,), (1,))
    rows["rows"].local.view(-1)[:8] = torch.tensor(list((4096).to_bytes(8, "little")), dtype=torch.uint8)
    mgr = CheckpointManager(str(tmp_path / "ckpt"), async_save=False)
    mgr.save(1, {"loader": rows})
    with pytest.raises(
        ValueError, match=r"loader row \(0,\): length 4096 does not fit the row of 4088 bytes"
    ):
        load_object_rows(mgr.step_url(1), "loader", [(0,)])
    mgr.close()


def test_portable_state_of_other_shapes_is_refused_naming_the_parameter():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = portable_optimizer_state_dict(model, opt)
    other = nn.ModuleDict(
        {"s0": nn.Linear(4, 3, dtype=torch.float64), "s1": nn.Linear(3, 5, dtype=torch.float64)}
    )
    with pytest.raises(
        ValueError, match=r"'s1.weight': exp_avg has shape \(2, 3\), the parameter has shape \(5, 3\)"
    ):
        load_portable_optimizer_state_dict(other, torch.optim.AdamW(other.parameters()), state)
