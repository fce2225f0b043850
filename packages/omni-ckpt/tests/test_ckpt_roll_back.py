"""``CheckpointManager.roll_back``: resuming from an older committed step when a newer one is damaged.

The oracle for values is the state each step saved (bit-exact ``torch.equal``); for the directory layout,
a listing of the root taken before and after; the damaged step is made by flipping one byte of its data
file, which ``load`` must refuse (its checksum)."""

import time
import uuid
from pathlib import Path

import pytest
import torch

from omni_ckpt import CheckpointError, CheckpointManager
from omni_parallel.testing import run_world


def make_state(step):
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(5, generator=g)}, "step": step}


def blank():
    return {"model": {"w": torch.zeros(64, 33), "b": torch.zeros(5)}, "step": -1}


def _equal(a, b):
    return a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def _flip_a_data_byte(step_dir: Path) -> None:
    data = next(step_dir.glob("rank-*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0x01  # inside the tensor bytes, past the header
    data.write_bytes(bytes(raw))


def test_roll_back_sets_newer_steps_aside_and_training_goes_on_from_the_older_one(tmp_path):
    root = tmp_path / "ckpt"
    m = CheckpointManager(str(root), keep_last=2, async_save=False)
    for step in (1, 2, 3, 4):
        m.save(step, make_state(step))
    assert m.steps() == [3, 4]
    _flip_a_data_byte(root / "step-00000004")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        m.load_latest(blank())
    damaged = sorted(p.name for p in (root / "step-00000004").iterdir())

    assert m.roll_back(3) == ["step-00000004.rolled-back-to-3"]
    assert (m.latest(), m.steps()) == (3, [3])
    assert (root / "latest").read_text() == "step-00000003"
    aside = root / "step-00000004.rolled-back-to-3"
    assert sorted(p.name for p in aside.iterdir()) == damaged  # kept whole, for whoever wants to look
    got = blank()
    assert m.load_latest(got) == 3 and _equal(got, make_state(3))

    # training goes on: step 4 is saved again, then pruning runs and never touches what was set aside
    for step in (4, 5, 6):
        m.save(step, make_state(10 * step))
    assert m.steps() == [5, 6] and aside.is_dir()
    got = blank()
    assert m.load_latest(got) == 6 and _equal(got, make_state(60))

    # a second roll back over the same step numbers does not overwrite the first one's directory
    assert m.roll_back(5) == ["step-00000006.rolled-back-to-5"]
    m.save(6, make_state(61))
    assert m.roll_back(5) == ["step-00000006.rolled-back-to-5.2"]
    assert (root / "step-00000006.rolled-back-to-5").is_dir()
    got = blank()
    assert m.load_latest(got) == 5 and _equal(got, make_state(50))


def test_roll_back_to_a_step_that_is_not_committed_names_the_committed_ones_and_moves_nothing(tmp_path):
    root = tmp_path / "ckpt"
    m = CheckpointManager(str(root), keep_last=None, async_save=False)
    for step in (2, 4):
        m.save(step, make_state(step))
    (root / "step-00000006").mkdir()  # an uncommitted leftover (no manifest)
    before = sorted(p.name for p in root.iterdir())
    for bad in (3, 6, 8):
        with pytest.raises(
            CheckpointError, match=rf"step {bad} is not a committed checkpoint \(committed: \[2, 4\]\)"
        ):
            m.roll_back(bad)
    assert sorted(p.name for p in root.iterdir()) == before
    with pytest.raises(ValueError, match="int >= 0"):
        m.roll_back(-1)
    # an uncommitted newer directory is set aside too: a later save of step 6 must not land in it
    assert m.roll_back(2) == ["step-00000004.rolled-back-to-2", "step-00000006.rolled-back-to-2"]
    assert m.steps() == [2]


def test_roll_back_after_an_async_save_waits_for_it_first(tmp_path):
    root = tmp_path / "ckpt"
    m = CheckpointManager(str(root), keep_last=None, async_save=True)
    m.save(1, make_state(1)).staged.result()
    publish = m._publish

    def late_publish(step):  # the commit's last part lands well after roll_back is called
        time.sleep(0.5)
        publish(step)

    m._publish = late_publish
    m.save(2, make_state(2)).staged.result()  # in flight when roll_back is called
    assert m.roll_back(1) == ["step-00000002.rolled-back-to-1"]
    m.wait()
    assert m.steps() == [1] and (root / "latest").read_text() == "step-00000001"
    assert (root / "step-00000002.rolled-back-to-1" / "manifest.msgpack").is_file()


def _two_ranks(rank, world, root):
    m = CheckpointManager(root, keep_last=None, async_save=False)
    for step in (1, 2, 3):
        m.save(step, {f"x{rank}": torch.full((4,), float(10 * step + rank))})  # per-rank names
    moved = m.roll_back(2)
    try:
        m.roll_back(7)
    except CheckpointError as exc:
        error = str(exc)
    got = {f"x{rank}": torch.zeros(4)}
    return moved, m.latest(), error, m.load_latest(got), got[f"x{rank}"].tolist()


def test_roll_back_is_collective_every_rank_gets_the_outcome_and_the_error(tmp_path):
    root = str(tmp_path / "ckpt")
    out = run_world(_two_ranks, 2, timeout_s=120, args=(root,))
    for rank in (0, 1):
        moved, latest, error, loaded, x = out[rank]
        assert moved == ["step-00000003.rolled-back-to-2"] and latest == 2 and loaded == 2
        assert "roll back to step 7 failed" in error and "committed: [1, 2]" in error
        assert x == [20.0 + rank] * 4


def test_roll_back_on_an_object_store_copies_then_uncommits_then_deletes(monkeypatch):
    # memory:// moves as object stores do (copy, then delete); the copy must be whole before the
    # original loses its manifest, and the original must be uncommitted before the rest goes
    url = f"memory://roll-back-{uuid.uuid4().hex}"
    m = CheckpointManager(url, keep_last=None, async_save=False)
    for step in (1, 2):
        m.save(step, make_state(step))
    fs = m.fs
    calls = []
    copy, rm = fs.copy, fs.rm
    monkeypatch.setattr(fs, "copy", lambda *a, **k: (calls.append(("copy", a[0])), copy(*a, **k))[1])
    monkeypatch.setattr(fs, "rm", lambda *a, **k: (calls.append(("rm", a[0])), rm(*a, **k))[1])
    assert m.roll_back(1) == ["step-00000002.rolled-back-to-1"]
    src = m.step_url(2).split("://", 1)[1].strip("/")
    ours = [(op, p.split("://", 1)[-1].strip("/")) for op, p in calls]
    ours = [(op, p) for op, p in ours if p.startswith(src)]  # not the `latest` pointer's tmp + rename
    assert ours == [("copy", src), ("rm", f"{src}/manifest.msgpack"), ("rm", src)]
    got = blank()
    assert m.steps() == [1] and m.load_latest(got) == 1 and _equal(got, make_state(1))
    # the set-aside copy is whole: it loads as step 2 did
    from omni_ckpt import load

    got = blank()
    load(got, f"{url}/step-00000002.rolled-back-to-1")
    assert _equal(got, make_state(2))
