"""Durability that reports failure: fsync and close are really called on the data file, its directory and the
manifest (in commit order), and when one of them fails with EIO the save fails, commits nothing, raises
(at the next call for an async save), and the previous step still loads bit-exact.

The failing filesystem is the real local disk with ``os.fsync`` / ``os.close`` wrapped to raise EIO (after
doing the real call) for one target; which file a descriptor belongs to is read from /proc/self/fd."""

import ctypes
import errno
import os

import pytest
import torch

from omni_ckpt import CheckpointError, CheckpointManager, read_manifest, storage


def make_state(step):
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(300, 70, generator=g), "b": torch.randn(7, generator=g)}, "step": step}


def blank():
    return {"model": {"w": torch.zeros(300, 70), "b": torch.zeros(7)}, "step": -1}


def _fd_path(fd):
    return os.readlink(f"/proc/self/fd/{fd}")


def _kind(path, root):
    rel = os.path.relpath(path, root)
    if rel.endswith(".safetensors"):
        return "data"
    if rel.endswith("manifest.msgpack.tmp"):
        return "manifest"
    if rel.endswith("latest.tmp"):
        return "latest"
    return "dir:" + rel


def test_fsync_is_called_on_data_directory_and_manifest_in_commit_order(tmp_path, monkeypatch):
    mgr = CheckpointManager(str(tmp_path), keep_last=2, async_save=False)
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", _kind(_fd_path(fd), tmp_path)))
        return real_fsync(fd)

    def rename(src, dst, *a, **k):
        events.append(("rename", os.path.basename(str(dst))))
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    mgr.save(1, make_state(1))
    monkeypatch.undo()
    step = "dir:step-00000001"
    first = {e: i for i, e in reversed(list(enumerate(events)))}
    # The data file, then the directory holding it and the one holding the step, all before the manifest
    # is written; the manifest, then its rename, then the directory again (the rename is durable); then
    # the latest pointer the same way.
    order = [
        ("fsync", "data"), ("fsync", step), ("fsync", "dir:."), ("fsync", "manifest"),
        ("rename", "manifest.msgpack"), ("fsync", "latest"), ("rename", "latest"),
    ]  # fmt: skip
    assert all(e in first for e in order), events
    assert [first[e] for e in order] == sorted(first[e] for e in order), events
    assert events.index(("rename", "manifest.msgpack")) < len(events) - 1 - events[::-1].index(
        ("fsync", step)
    )


def _failing(monkeypatch, root, kind, call):
    """Make ``call`` (``fsync`` or ``close``) fail with EIO for the file or directory of ``kind``."""
    real = getattr(os, call)

    def failing(fd):
        try:
            target = _kind(_fd_path(fd), root)
        except OSError:
            target = None
        out = real(fd)
        if target == kind or (kind == "dir" and target is not None and target.startswith("dir:step")):
            raise OSError(errno.EIO, f"injected {call} failure", _fd_path(fd) if call == "fsync" else None)
        return out

    monkeypatch.setattr(os, call, failing)


CASES = [("fsync", "data"), ("fsync", "dir"), ("fsync", "manifest"), ("close", "data"), ("close", "manifest")]


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize(("call", "kind"), CASES)
def test_an_eio_from_fsync_or_close_fails_the_save_and_commits_nothing(
    tmp_path, monkeypatch, call, kind, async_save
):
    mgr = CheckpointManager(str(tmp_path), keep_last=3, async_save=async_save)
    mgr.save(1, make_state(1))
    mgr.wait()
    _failing(monkeypatch, tmp_path, kind, call)
    if async_save:
        mgr.save(2, make_state(2))
        with pytest.raises(
            CheckpointError, match=r"background save of step 2 failed.*Input/output error|injected"
        ):
            mgr.save(3, make_state(3))  # the error surfaces at the next call
    else:
        with pytest.raises(CheckpointError, match=r"save failed, nothing committed|could not commit") as err:
            mgr.save(2, make_state(2))
        assert "injected" in str(err.value) or "Input/output error" in str(err.value)
    monkeypatch.undo()
    assert mgr.steps() == [1] and mgr.latest() == 1
    assert not (tmp_path / "step-00000002" / "manifest.msgpack").exists()
    target = blank()
    assert mgr.load_latest(target) == 1
    want = make_state(1)
    assert torch.equal(target["model"]["w"], want["model"]["w"]) and target["step"] == 1
    mgr.save(4, make_state(4))  # and saving works again once the disk does
    mgr.close()
    assert mgr.latest() == 4


@pytest.mark.skipif(storage._START_WRITEBACK is None, reason="sync_file_range is Linux-only")
def test_writeback_is_started_for_big_segments_and_its_failure_fails_the_save(tmp_path, monkeypatch):
    real = storage._START_WRITEBACK
    calls = []

    def recording(fd, offset, length, flags):
        calls.append((_fd_path(fd), offset, length, flags))
        return real(fd, offset, length, flags)

    big = {"w": torch.randn(1024, 1024)}  # 4 MiB: one segment above the write-back threshold
    monkeypatch.setattr(storage, "_START_WRITEBACK", recording)
    mgr = CheckpointManager(str(tmp_path), keep_last=3, async_save=False)
    mgr.save(1, big)
    (path, offset, length, flags), *_ = calls
    assert path.endswith("rank-00000.safetensors") and length == 4 << 20 and flags == 2
    data_start = read_manifest(str(tmp_path / "step-00000001"))["data_start"][0]
    assert offset == data_start  # the range written, in the data section of the file

    def failing(fd, offset, length, flags):
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(storage, "_START_WRITEBACK", failing)
    with pytest.raises(CheckpointError, match=r"nothing committed.*sync_file_range: Input/output error"):
        mgr.save(2, big)
    monkeypatch.undo()
    assert mgr.steps() == [1] and mgr.latest() == 1
    assert not (tmp_path / "step-00000002" / "manifest.msgpack").exists()
    mgr.close()
