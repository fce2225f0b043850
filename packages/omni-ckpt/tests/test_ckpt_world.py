"""gloo worlds of 2 and 3 processes: DTensor / FlatShard / replicated / per-rank state, async saves,
resharding loads, the plan cache across a restart (collectives counted), failures on one rank, and DCP
as an oracle. Reference values are the global tensors built identically on every rank."""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from omni_ckpt import (
    CheckpointError,
    CheckpointManager,
    FlatShard,
    import_dcp,
    load,
    read_full,
    read_manifest,
    save,
)
from omni_ckpt.sharding import dtensor_box
from omni_parallel.testing import run_world

# Every public torch.distributed collective and point-to-point call (the ones this torch has). omni_ckpt
# calls them as `dist.<name>`, so wrapping the module attributes sees every call it makes; the calls they
# make inside torch (gather_object's size exchange) are not counted: they are part of the named call.
COUNTED = [
    name
    for name in (
        "all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_into_tensor",
        "all_gather_coalesced", "all_gather_object", "gather", "gather_object", "scatter",
        "scatter_object_list", "broadcast", "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor",
        "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
        "batch_isend_irecv", "send_object_list", "recv_object_list",
    )
    if hasattr(dist, name)
]  # fmt: skip
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list")


@contextlib.contextmanager
def count_collectives():
    """Counts per collective name; ``counts["all_reduce_bytes"]`` sums the all-reduced tensor bytes."""
    counts = dict.fromkeys(COUNTED, 0)
    counts["all_reduce_bytes"] = 0
    originals = {name: getattr(dist, name) for name in COUNTED}

    def wrap(name):
        def counted(*args, **kwargs):
            counts[name] += 1
            if name == "all_reduce":
                t = args[0] if args else kwargs["tensor"]
                counts["all_reduce_bytes"] += t.numel() * t.element_size()
            return originals[name](*args, **kwargs)

        return counted

    for name in COUNTED:
        setattr(dist, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def W_FULL():
    return torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)


def B_FULL():
    return torch.arange(12, dtype=torch.float64).reshape(3, 4) / 7


def dtensor_of(full, mesh, placements):
    box = dtensor_box(full.shape, mesh.shape, mesh.get_coordinate(), placements)
    return DTensor.from_local(
        full[box.slices()].clone(), mesh, placements, shape=full.shape, stride=full.stride()
    )


def train_state(rank, world, mesh, *, cuts, rep_dtype=torch.float32):
    lo, hi = cuts[rank], cuts[rank + 1]
    return {
        "model": {
            "w": dtensor_of(W_FULL(), mesh, [Shard(0)]),
            "b": FlatShard(B_FULL().reshape(-1)[lo:hi].clone(), (3, 4), lo),
            "rep": torch.ones(4, dtype=rep_dtype),
        },
        "rng": {f"rank{rank}": torch.tensor([rank, 42])},
        "loader": {"pos": 10 + rank, "keys": [f"k{rank}"], "buf": bytes([rank])},
        "step": 5,
    }


def _two_ranks_save_and_reshard(rank, world, root):
    mesh = init_device_mesh("cpu", (world,))
    state = train_state(rank, world, mesh, cuts=[0, 5, 12])
    mgr = CheckpointManager(root, keep_last=2, async_save=True, host_budget_bytes=64)
    with count_collectives() as first:
        h = mgr.save(1, state)
        h.staged.result(timeout=60)
        state["model"]["w"].to_local().add_(1000)  # after staging: must not reach step 1
        mgr.wait()
    assert first["all_gather_object"] == 1 and first["all_reduce"] == 1, first
    assert first["gather_object"] == 1 and first["broadcast_object_list"] == 1, first
    assert sum(first[k] for k in P2P if k in first) == 0  # no point-to-point traffic
    with count_collectives() as second:
        mgr.save(2, state)
        mgr.wait()
    assert second["all_gather_object"] == 0 and second["all_reduce"] == 1, second
    assert mgr.plan_cache.hits == 1 and mgr.plan_cache.misses == 1

    # Reshard step 1 into another layout: w by columns (uneven 3+2), b replicated, rep per-rank.
    target = {
        "model": {"w": dtensor_of(torch.zeros(7, 5), mesh, [Shard(1)]), "b": torch.zeros(3, 4, dtype=torch.float64),
                  "rep": torch.zeros(4)},
        "rng": {f"rank{rank}": torch.zeros(2, dtype=torch.int64)},
        "loader": {"pos": 0, "keys": [], "buf": b""},
        "step": 0,
    }  # fmt: skip
    mgr.load(1, target)
    box = dtensor_box((7, 5), mesh.shape, mesh.get_coordinate(), [Shard(1)])
    assert torch.equal(target["model"]["w"].to_local(), W_FULL()[box.slices()])
    assert torch.equal(target["model"]["b"], B_FULL())
    assert torch.equal(target["rng"][f"rank{rank}"], torch.tensor([rank, 42]))
    assert target["loader"] == {"pos": 10 + rank, "keys": [f"k{rank}"], "buf": bytes([rank])}
    assert target["step"] == 5
    assert mgr.load_latest(target) == 2
    assert torch.equal(target["model"]["w"].to_local(), W_FULL()[box.slices()] + 1000)

    # A background failure on rank 1 only: nothing committed, the error names rank 1 at the next call.
    if rank == 1:
        os.makedirs(f"{root}/step-00000003/rank-00001.safetensors")
    dist.barrier()
    mgr.save(3, state)
    with pytest.raises(CheckpointError, match=r"step 3 failed.*rank 1: IsADirectoryError"):
        mgr.wait()
    assert mgr.latest() == 2 and mgr.steps() == [1, 2]
    # A planning failure on rank 1 (an object msgpack cannot hold) raises on every rank, naming it.
    bad = dict(state, extra={1, 2} if rank == 1 else 0)
    with pytest.raises(CheckpointError, match=r"rank 1 could not plan.*'extra'"):
        mgr.save(4, bad)
    mgr.save(5, state)
    mgr.close()
    dist.barrier()
    assert mgr.steps() == [2, 5] and mgr.latest() == 5  # pruned to keep_last=2, leftover 3 removed
    assert not os.path.exists(f"{root}/step-00000003")


def _two_ranks_restart(rank, world, root, dcp_dir):
    mesh = init_device_mesh("cpu", (world,))
    state = train_state(rank, world, mesh, cuts=[0, 5, 12])
    mgr = CheckpointManager(root, keep_last=3, async_save=False)
    with count_collectives() as restart:
        mgr.save(6, state)
    # What this proves: the first save after a restart (new processes, same layout, plan read back from the
    # latest manifest) plans with exactly one all-reduce of 24 bytes (three int64: hit flag, plan key,
    # -key) and no plan exchange (no all_gather_object of local plans). The only other collectives are the
    # two of the atomic commit, which every save needs whatever its plan: gather_object of each rank's
    # outcome and CRCs (rank 0 may write the manifest only once it knows every rank's data is durable, and
    # the CRCs go into the manifest), and broadcast_object_list of rank 0's verdict (so every rank returns
    # only once the step is committed, or raises with the failing rank named). 3 collectives, no P2P.
    assert restart["all_reduce"] == 1 and restart["all_reduce_bytes"] == 24, restart
    assert restart["all_gather_object"] == 0, restart
    assert restart["gather_object"] == 1 and restart["broadcast_object_list"] == 1, restart
    assert sum(v for k, v in restart.items() if k in COUNTED) == 3, restart
    assert mgr.plan_cache.hits == 1 and mgr.plan_cache.misses == 0
    # A dtype-only change is not a hit.
    changed = train_state(rank, world, mesh, cuts=[0, 5, 12], rep_dtype=torch.float64)
    with count_collectives() as miss:
        mgr.save(7, changed)
    assert miss["all_gather_object"] == 1 and mgr.plan_cache.misses == 1, miss

    # DCP as the oracle: saved by DCP with rows sharded, imported, loaded with columns sharded.
    sd = {"model": {"w": dtensor_of(W_FULL() * 3, mesh, [Shard(0)])}, "extra": torch.arange(5.0)}
    dcp.save(sd, checkpoint_id=dcp_dir)
    url = f"{root}-imported"
    if rank == 0:
        assert import_dcp(dcp_dir, url) == 2
    dist.barrier()
    ours = {"model": {"w": dtensor_of(torch.zeros(7, 5), mesh, [Shard(1)])}, "extra": torch.zeros(5)}
    theirs = {"model": {"w": dtensor_of(torch.zeros(7, 5), mesh, [Shard(1)])}, "extra": torch.zeros(5)}
    load(ours, url)
    dcp.load(theirs, checkpoint_id=dcp_dir)
    assert torch.equal(ours["model"]["w"].to_local(), theirs["model"]["w"].to_local())
    assert torch.equal(ours["extra"], theirs["extra"])
    assert ours["model"]["w"].to_local().abs().sum() > 0


def _three_ranks(rank, world, root, url3):
    mesh = init_device_mesh("cpu", (world,))
    mgr = CheckpointManager(root, async_save=False)
    cuts = [0, 1, 9, 12]
    step = mgr.latest()
    target = {
        "model": {"w": FlatShard(torch.zeros(12), (7, 5), 12 * rank - (rank == 2)),
                  "b": dtensor_of(torch.zeros(3, 4, dtype=torch.float64), mesh, [Shard(1)]),
                  "rep": torch.zeros(4, dtype=torch.float64)},
        "step": 0,
    }  # fmt: skip
    load(target, mgr.step_url(step), process_group=mesh.get_group())
    w = target["model"]["w"]
    assert torch.equal(w.local, W_FULL().reshape(-1)[w.flat_offset : w.flat_offset + 12])
    box = dtensor_box((3, 4), mesh.shape, mesh.get_coordinate(), [Shard(1)])
    assert torch.equal(target["model"]["b"].to_local(), B_FULL()[box.slices()])
    assert target["step"] == 5
    # Per-rank objects saved by 2 ranks cannot go to 3 ranks: the error names the key.
    with pytest.raises(CheckpointError, match=r"object 'loader.pos' differs across the 2 saved ranks"):
        mgr.load(step, {"loader": {"pos": 0}})
    # Save at 3 ranks with uneven flat cuts; checked whole by the caller.
    save(train_state(rank, world, mesh, cuts=cuts), url3)


def test_two_and_three_process_worlds(tmp_path):
    root = str(tmp_path / "ckpt")
    run_world(_two_ranks_save_and_reshard, 2, timeout_s=300, args=(root,))
    run_world(_two_ranks_restart, 2, timeout_s=300, args=(root, str(tmp_path / "dcp")))
    boxes = {name: len(entry[2]) for name, entry in read_manifest(f"{root}/step-00000006")["tensors"].items()}
    # Replicated: written once; DTensor rows: one box per rank; flat cuts [0,5) [5,12) of (3, 4): 2 + 2.
    assert boxes["model.rep"] == 1 and boxes["model.w"] == 2 and boxes["model.b"] == 4, boxes
    url3 = str(tmp_path / "three")
    run_world(_three_ranks, 3, timeout_s=300, args=(root, url3))
    tensors, objects = read_full(url3)
    assert torch.equal(tensors["model.w"], W_FULL()) and torch.equal(tensors["model.b"], B_FULL())
    assert objects["step"] == 5 and objects["loader.pos@rank2"] == 12
    assert sorted(k for k in tensors if k.startswith("rng.")) == ["rng.rank0", "rng.rank1", "rng.rank2"]


def _collective_devices(rank, world):
    from omni_ckpt.save import _device

    # No GPU here: what matters is which device type the answer names; a CUDA index is asked of
    # torch.cuda.current_device, which needs a GPU, so this process answers 0 in its place.
    torch.cuda.current_device = lambda: 0
    return {
        backend: str(_device(dist.new_group([0], backend=backend)))
        for backend in ("gloo", "cpu:gloo,cuda:gloo", "cuda:gloo")
    }


def test_save_collectives_pick_their_device_from_the_backend_config():
    # A group that serves only CUDA tensors ("cuda:gloo" here, "cuda:nccl" = NCCL on a GPU machine) needs
    # CUDA tensors: dist.get_backend returns such configs whole, never equal to "nccl".
    assert run_world(_collective_devices, 1, timeout_s=120)[0] == {
        "gloo": "cpu",
        "cpu:gloo,cuda:gloo": "cpu",
        "cuda:gloo": "cuda:0",
    }
