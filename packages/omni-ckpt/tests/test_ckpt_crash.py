"""Crash injection and corruption: a save killed (SIGKILL) before each file open, write, rename or delete
leaves load_latest on the previous or the new complete step, and the resumed job can save again; a flipped
byte in any data file is caught.

Single process: with W ranks the protocol only adds that rank 0 renames the manifest after a gather of
every rank's outcome (a rank that dies or fails before it means no commit: test_ckpt_world covers a rank
that fails), so every write/rename point of the commit path is exercised here."""

import multiprocessing as mp
import os
import shutil
import signal

import fsspec.implementations.local as local
import pytest
import torch

from omni_ckpt import CheckpointError, CheckpointManager, load, read_manifest

POINTS = ("open", "write", "mv", "rm")


def make_state(step):
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(64, 80, generator=g),
            "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "big": torch.randn(512, 520, generator=g),  # > 1 MiB: read straight into the target
        },
        "loader": {"step": step, "keys": [f"k{step}"]},
    }


def blank():
    return {
        "model": {
            "w": torch.zeros(64, 80),
            "b": torch.zeros(5, dtype=torch.bfloat16),
            "big": torch.zeros(512, 520),
        },
        "loader": {"step": -1, "keys": []},
    }


def _crashing_save(root, kill_at):
    """Child: save step 2, SIGKILLed just before the kill_at-th filesystem event (a file opened for
    writing, a write, a rename or a delete; through fsspec or straight through os on the local disk)."""
    events = [0]

    def tick():
        events[0] += 1
        if events[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def hook(name, fn):
        def wrapped(*args, **kwargs):
            if name == "os.open":
                if args[1] & (os.O_WRONLY | os.O_RDWR):
                    tick()
            elif name != "open" or any(
                m in str(args[2] if len(args) > 2 else kwargs.get("mode", "rb")) for m in "wa"
            ):
                tick()
            return fn(*args, **kwargs)

        return wrapped

    local.LocalFileSystem._open = hook("open", local.LocalFileSystem._open)
    local.LocalFileSystem.mv = hook("mv", local.LocalFileSystem.mv)
    local.LocalFileSystem.rm = hook("rm", local.LocalFileSystem.rm)
    local.LocalFileOpener.write = hook("write", local.LocalFileOpener.write)
    os.open = hook("os.open", os.open)
    os.pwritev = hook("pwritev", os.pwritev)
    CheckpointManager(root, keep_last=1, async_save=False).save(2, make_state(2))
    os._exit(0)


def test_kill_at_every_write_and_rename_point(tmp_path):
    pristine = tmp_path / "pristine"
    CheckpointManager(str(pristine), keep_last=1, async_save=False).save(1, make_state(1))
    ctx = mp.get_context("fork")
    seen = set()
    for kill_at in range(1, 200):
        root = tmp_path / f"run{kill_at}"
        shutil.copytree(pristine, root)
        p = ctx.Process(target=_crashing_save, args=(str(root), kill_at))
        p.start()
        p.join(120)
        assert p.exitcode in (0, -signal.SIGKILL), p.exitcode
        target = blank()
        mgr = CheckpointManager(str(root), keep_last=1, async_save=False)
        step = mgr.load_latest(target)
        assert step in (1, 2), step
        want = make_state(step)
        assert torch.equal(target["model"]["w"], want["model"]["w"])
        assert torch.equal(target["model"]["b"], want["model"]["b"])
        assert torch.equal(target["model"]["big"], want["model"]["big"])
        assert target["loader"] == want["loader"]
        # The job resumed from `step` must be able to save its next step: a crash between step 2's
        # manifest rename and the pointer move must not leave a committed step 2 that a job resumed from
        # step 1 then fails to overwrite ("already committed") on every restart.
        mgr.save(step + 1, make_state(step + 1))
        assert mgr.latest() == step + 1
        seen.add(step)
        shutil.rmtree(root)
        if p.exitcode == 0:
            break
    else:
        pytest.fail("the save never completed")
    assert seen == {1, 2} and kill_at > 8  # crashes hit before and after the commit point


def test_flipped_byte_in_any_data_file_is_detected(tmp_path):
    mgr = CheckpointManager(str(tmp_path), async_save=False)
    mgr.save(1, make_state(1))
    step_dir = tmp_path / "step-00000001"
    manifest = read_manifest(str(step_dir))
    spots = [(name, boxes[0][3] + boxes[0][4] // 2) for name, (_, _, boxes) in manifest["tensors"].items()]
    spots.append(("objects", manifest["objects"][0][1] + 1))
    for name, pos in spots:
        path = step_dir / manifest["files"][0]
        original = path.read_bytes()
        corrupt = bytearray(original)
        corrupt[pos] ^= 0x10
        path.write_bytes(bytes(corrupt))
        with pytest.raises(CheckpointError, match=r"rank-00000\.safetensors: checksum mismatch") as err:
            load(blank(), str(step_dir))
        assert name in str(err.value)
        path.write_bytes(original)
    load(blank(), str(step_dir))
