"""Checkpoints on an object store: ``CheckpointManager`` saves, commits, prunes, rolls back and loads over
the S3 API against a real S3 server on loopback (moto's, started by the root conftest's ``s3_bucket``
fixture; s3fs is fsspec's S3 backend), with nothing of fsspec or s3fs replaced.

Oracles: the same operations on a local disk (every object's bytes equal to the local file of the same
name, the same committed steps, the same loaded values) and the states each step saved (bit for bit).
A job on an object store is often watched by other processes (a resumed job, an evaluator, the CLI): a
manager that listed the root once must still see the steps other processes commit and prune later.
"""

import pytest
import torch

from omni_ckpt import CheckpointError, CheckpointManager, FlatShard
from omni_parallel.testing import run_world


def make_state(step, rank=0, world=1):
    g = torch.Generator().manual_seed(step)
    w = torch.randn(300, 7, generator=g)  # ZeRO-style: each rank holds a flat slice of w
    n = w.numel() // world
    lo, hi = rank * n, (rank + 1) * n if rank < world - 1 else w.numel()
    return {
        "model": {
            "w": FlatShard(w.flatten()[lo:hi].clone(), tuple(w.shape), lo),
            "b": torch.randn(9, generator=g),
        },
        "loader": {"epoch": step, "keys": [f"k{step}"], "buf": bytes([step, 7])},
    }


def blank():
    return {
        "model": {"w": torch.zeros(300, 7), "b": torch.zeros(9)},
        "loader": {"epoch": -1, "keys": [], "buf": b""},
    }


def _full(step):
    st = make_state(step)
    return st["model"]["w"].local.reshape(300, 7), st["model"]["b"], st["loader"]


def _tree(fs, root):
    """``{relative name: bytes}`` of every file under ``root``."""
    root = root.rstrip("/")
    return {p[len(root) + 1 :]: fs.cat_file(p) for p in fs.find(root)}


def _operations(url):
    """Sync and async saves with pruning, a roll back, saves after it, loads: what each call returned."""
    seen = []
    m = CheckpointManager(url, keep_last=2, async_save=False)
    for step in (1, 2, 3):
        m.save(step, make_state(step))
        seen.append(("steps", m.steps(), m.latest()))
    with pytest.raises(CheckpointError, match="a committed checkpoint is already there"):
        m.save(3, make_state(3))
    seen.append(("roll_back", m.roll_back(2), m.steps(), m.latest()))
    a = CheckpointManager(url, keep_last=2, async_save=True)
    for step in (3, 4, 5):
        a.save(step, make_state(10 + step))
        a.wait()
        seen.append(("async", a.steps(), a.latest()))
    for step in a.steps():
        got = blank()
        a.load(step, got)
        want = _full(10 + step)
        assert torch.equal(got["model"]["w"], want[0]) and torch.equal(got["model"]["b"], want[1])
        assert got["loader"] == want[2]
    return seen


def test_manager_over_s3_equals_the_local_disk_byte_for_byte(s3_bucket, tmp_path):
    import fsspec

    url, _ = s3_bucket
    on_s3 = _operations(f"{url}/run/checkpoints")
    on_disk = _operations(str(tmp_path / "checkpoints"))
    assert on_s3 == on_disk
    assert on_s3[3] == ("roll_back", ["step-00000003.rolled-back-to-2"], [2], 2)
    assert on_s3[-1] == ("async", [4, 5], 5)
    s3 = _tree(fsspec.filesystem("s3"), f"{url[5:]}/run/checkpoints")
    disk = _tree(fsspec.filesystem("file"), str(tmp_path / "checkpoints"))
    assert sorted(s3) == sorted(disk)  # nothing left behind (no .tmp object), nothing missing
    assert "step-00000003.rolled-back-to-2/manifest.msgpack" in s3 and s3["latest"] == b"step-00000005"
    assert s3 == disk


def _save_world(rank, world, url, env, steps, keep_last):
    import os

    os.environ.update(env)  # the forkserver that starts the ranks may predate the fixture's environment
    m = CheckpointManager(url, keep_last=keep_last, async_save=True)
    seen = []
    for step in steps:
        m.save(step, make_state(step, rank, world))
        m.wait()
        seen.append(m.steps())
    got = blank()
    assert m.load_latest(got) == steps[-1]
    want = _full(steps[-1])
    assert torch.equal(got["model"]["w"], want[0]) and torch.equal(got["model"]["b"], want[1])
    assert got["loader"]["epoch"] == steps[-1]
    return seen


def test_a_two_process_job_on_s3_and_a_watcher_that_listed_before_see_every_commit_and_prune(s3_bucket):
    url, env = s3_bucket
    root = f"{url}/job/checkpoints"
    watcher = CheckpointManager(root, keep_last=2, async_save=False)
    watcher.save(1, make_state(1))
    assert watcher.steps() == [1]  # the watcher's listing of the root is now in its cache
    # a job (other processes) goes on from step 1: saves 2 and 3, pruning 1
    assert run_world(_save_world, 2, timeout_s=120, args=(root, env, [2, 3], 2)) == [[[1, 2], [2, 3]]] * 2
    assert watcher.steps() == [2, 3] and watcher.latest() == 3
    got = blank()
    assert watcher.load_latest(got) == 3 and torch.equal(got["model"]["w"], _full(3)[0])
    assert watcher.roll_back(2) == ["step-00000003.rolled-back-to-2"] and watcher.steps() == [2]
