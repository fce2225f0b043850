"""Exact resume of the whole pipeline (sources with bad data -> mixture across a phase boundary -> packer ->
loader -> zero-redundancy filter with a prefetched buffer): >= 2,000 sample keys after each resume equal
the uninterrupted run's, at several save points and after a previous resume."""

import msgpack
import pytest

from omni_data import MixtureSchedule, PayloadReader, ZeroRedundancyFilter, snapshot_async
from omni_data.testing import (
    audio_samples,
    damaged_image_shards,
    packed_loader,
    text_samples,
    train_tiny_bpe,
    webdataset_sources,
    write_shards,
)

STEPS = 95
PHASE_STEP = 20


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    damaged_image_shards(f"{d}/img-%03d.tar", 90, per_shard=30, bad=7)  # img-002 cut, img-003 empty
    write_shards(f"{d}/aud-%03d.tar", audio_samples(60, seconds=(0.05, 0.3), with_json=True), per_shard=20)
    write_shards(f"{d}/txt-%03d.tar", text_samples(60, words=(5, 120)), per_shard=20)
    return d, train_tiny_bpe()


def _pipeline(data):
    d, tok = data
    kw = dict(tokenizer=tok, epochs=None, shuffle_shards=True, seed=3)
    sources = webdataset_sources(
        {
            "img": (f"{d}/img-{{000..003}}.tar", "image"),
            "aud": (f"{d}/aud-{{000..002}}.tar", "audio"),
            "txt": (f"{d}/txt-{{000..002}}.tar", "text"),
        },
        **kw,
    )
    sched = MixtureSchedule(
        [(0, {"img": 0.6, "aud": 0.3, "txt": 0.1}), (PHASE_STEP, {"img": 0.2, "aud": 0.5, "txt": 0.3})]
    )
    loader = packed_loader(sources, sched, 256, 48, 4, max_open_packs=4)
    return ZeroRedundancyFilter(
        loader, consumes=[2, 3], microbatches=2, slices=2, reader=PayloadReader(tok), prefetch=2
    )


def _record(step):
    """Sample keys of the step, and which payloads (by key and pixel/audio size) this rank decoded."""
    keys = [k for p in step.packs for k in p.keys]
    decoded = [
        (
            p.meta.uid,
            None if p.pixels is None else tuple(p.pixels.shape),
            None if p.waveform is None else p.waveform.shape[0],
        )
        for e in sorted(step.payloads)
        for p in step.payloads[e]
    ]
    return step.step, keys, decoded


def _run(zr, steps):
    return [_record(next(zr)) for _ in range(steps)]


def _resume(data, state_bytes):
    zr = _pipeline(data)
    zr.load_state_dict(msgpack.unpackb(state_bytes, strict_map_key=False))
    return zr


@pytest.mark.slow
def test_resume_exact_at_save_points(data):
    full = _run(_pipeline(data), STEPS)
    assert full[-1][0] == STEPS - 1
    for save in (3, PHASE_STEP - 1, PHASE_STEP, 11):  # mid-stream, right before and at the phase boundary
        zr = _pipeline(data)
        head = _run(zr, save)
        assert zr.state_dict()["pending"]  # the pre-filtered buffer is non-empty
        assert zr.state_dict()["loader"]["packer"]["open"]  # and so are the open packs
        blob = snapshot_async(zr).result()
        tail = _run(_resume(data, blob), STEPS - save)
        assert head + tail == full, f"save at step {save}"
        assert sum(len(k) for _, k, _ in tail) >= 2000
    # after a previous resume: save at 5, resume, save again at 12, resume again
    zr = _pipeline(data)
    _run(zr, 5)
    zr2 = _resume(data, snapshot_async(zr).result())
    mid = _run(zr2, 7)
    zr3 = _resume(data, snapshot_async(zr2).result())
    assert mid + _run(zr3, STEPS - 12) == full[5:]


def test_resume_keeps_skip_counts(data):
    zr = _pipeline(data)
    _run(zr, 30)
    img = zr.loader.packer.source.sources[0]
    assert img.skipped.get("undecodable image", 0) >= 1 and img.skipped.get("empty shard", 0) >= 1
    assert img.skipped.get("truncated member", 0) >= 1
    zr2 = _resume(data, msgpack.packb(zr.state_dict()))
    assert zr2.loader.packer.source.sources[0].skipped == img.skipped
    assert len(msgpack.packb(zr.state_dict())) < 200_000  # small: metadata and counters, no payloads
