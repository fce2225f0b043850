"""Loader-state snapshots prepared ahead (``ZeroRedundancyFilter(snapshots=...)``, paper §7.4): the
prepared bytes equal the synchronous path's (``snapshot_async``: ``state_dict()``, deep copy, msgpack) at
every step, in every preparation mode; a resume from them is exact (the oracle: the uninterrupted run's
steps); and taking one does not wait for a preparation in flight."""

import msgpack
import pytest

from omni_data import MixtureSchedule, PayloadReader, ZeroRedundancyFilter, snapshot_async
from omni_data.testing import (
    GatedLoader,
    audio_samples,
    image_samples,
    packed_loader,
    text_samples,
    train_tiny_bpe,
    webdataset_sources,
    write_shards,
)

STEPS = 14
# (background, prepare_on_request, prefetch): the foreground filter, and the trainer's background one
MODES = [(False, False, 1), (False, False, 2), (True, True, 1), (True, False, 2)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("snap")
    imgs, auds = list(image_samples(40, sizes=(16, 48))), list(audio_samples(40, seconds=(0.05, 0.2)))
    # headers parse, bodies do not: payload placeholders, so the filter's own skip ledger changes too
    imgs[1]["png"] = imgs[1]["png"][:80] + bytes(b ^ 0x5A for b in imgs[1]["png"][80:])
    auds[2]["flac"] = auds[2]["flac"][:200] + bytes(b ^ 0x5A for b in auds[2]["flac"][200:])
    write_shards(f"{d}/img-%03d.tar", imgs, per_shard=20)
    write_shards(f"{d}/aud-%03d.tar", auds, per_shard=20)
    write_shards(f"{d}/txt-%03d.tar", text_samples(40, words=(5, 60)), per_shard=20)
    return str(d), train_tiny_bpe()


def _filter(data, background=False, on_request=False, prefetch=1, snapshots=True):
    d, tok = data
    kw = dict(tokenizer=tok, epochs=None, shuffle_shards=True, seed=5)
    sources = webdataset_sources(
        {
            n: (f"{d}/{n}-{{000..001}}.tar", m)
            for n, m in (("img", "image"), ("aud", "audio"), ("txt", "text"))
        },
        **kw,
    )
    sched = MixtureSchedule(
        [(0, {"img": 0.6, "aud": 0.2, "txt": 0.2}), (6, {"img": 0.1, "aud": 0.8, "txt": 0.1})]
    )
    loader = packed_loader(sources, sched, 192, 24, 4, max_open_packs=2, loader=GatedLoader)
    zr = ZeroRedundancyFilter(
        loader,
        consumes=[1, 2],
        microbatches=2,
        slices=2,
        reader=PayloadReader(tok),
        prefetch=prefetch,
        background=background,
        prepare_on_request=on_request,
        snapshots=snapshots,
    )
    zr.reset()
    return zr


def _record(fs):
    payloads = [(p.meta.uid, p.error is None) for e in sorted(fs.payloads) for p in fs.payloads[e]]
    return fs.step, [k for p in fs.packs for k in p.keys], payloads


def _sync(zr) -> bytes:
    return snapshot_async(zr).result()


def _without_walking(zr):
    """``zr.snapshot()`` with the loader's ``state_dict`` disabled: a prepared snapshot never walks it."""

    def walked():
        raise AssertionError("snapshot() walked the loader's state at save time")

    zr.loader.state_dict = walked
    try:
        return zr.snapshot()
    finally:
        del zr.loader.state_dict


@pytest.mark.parametrize("background,on_request,prefetch", MODES)
def test_prepared_snapshot_is_the_synchronous_state_byte_for_byte(data, background, on_request, prefetch):
    def due(next_step):
        return next_step % 3 != 1

    zr = _filter(data, background, on_request, prefetch, snapshots=due)
    with zr:
        for step in range(STEPS):
            assert next(zr).step == step
            take = _without_walking if due(step + 1) else type(zr).snapshot
            if on_request:  # the state right after next(), before the preparation starts
                snap = take(zr)
                assert (snap.step, snap.blob) == (step + 1, _sync(zr))
                zr.prepare()
            zr.wait_prepared()
            snap = take(zr)  # the trainer's save: after the next step was prepared
            assert snap.blob == _sync(zr) == zr.snapshot(prepared=False).blob, f"step {step}"
            assert snap.step == step + 1 and snap.state() == msgpack.unpackb(_sync(zr), strict_map_key=False)
        assert sum(zr.skipped.values()) >= 1  # the filter's ledger took part in the snapshots


def test_resume_from_prepared_snapshots_is_exact(data):
    with _filter(data) as zr:
        full = [_record(next(zr)) for _ in range(STEPS)]
    for save in (2, 5, 9):
        zr = _filter(data, background=True, on_request=True)
        with zr:
            head = [_record(next(zr)) for _ in range(save - 1)]
            head.append(_record(next(zr)))
            right_after_next = zr.snapshot()  # what a save takes while the next step is being prepared
            zr.prepare()
            zr.wait_prepared()
            prepared = zr.snapshot()
        assert right_after_next.step == prepared.step == save
        for snap in (right_after_next, prepared):
            with _filter(data, background=True, on_request=True) as resumed:
                resumed.load_state_dict(snap.state())
                tail = [_record(next(resumed)) for _ in range(STEPS - save)]
            assert head + tail == full, f"resume at step {save}"


def test_snapshot_does_not_wait_for_a_slow_preparation(data):
    """The next step's preparation is held inside the loader (its thread blocked): the snapshot of the
    step just handed out is there at once, and it resumes exactly; the synchronous path would wait."""
    with _filter(data) as ref:
        full = [_record(next(ref)) for _ in range(8)]
    zr = _filter(data, background=True, on_request=True)
    with zr:
        head = [_record(next(zr)) for _ in range(4)]
        snap, held = zr.loader.while_held(zr, zr.snapshot)
    assert held, "the snapshot waited for the loader's preparation"
    assert snap.step == 4
    with _filter(data) as resumed:
        resumed.load_state_dict(snap.state())
        assert head + [_record(next(resumed)) for _ in range(4)] == full
