"""Exact re-split: resuming under another DP size or worker count trains every sample exactly once per
epoch (ledger tests: DP 4 -> 2 and 4 -> 8 through the whole pipeline with buffers in flight, workers
2 -> 4 through RoundRobinWorkers), or is refused before any sample is read with the old and new layout
named. The oracle for "every sample" is an uninterrupted run of the old layout over a whole epoch."""

from collections import Counter

import msgpack
import pytest

from omni_data import (
    HybridPacker,
    LayoutMismatchError,
    MixtureSchedule,
    MixtureStream,
    PackedLoader,
    PayloadReader,
    RoundRobinWorkers,
    WebDatasetSource,
    ZeroRedundancyFilter,
)
from omni_data.testing import image_samples, text_samples, train_tiny_bpe, write_shards


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("resplit")
    write_shards(f"{d}/img-%03d.tar", image_samples(40, sizes=(16, 48)), per_shard=5)  # 8 shards
    write_shards(f"{d}/txt-%03d.tar", text_samples(36, words=(5, 60)), per_shard=12)  # 3 shards
    return str(d), train_tiny_bpe()


def _filter(data, rank, world):
    d, tok = data
    kw = dict(tokenizer=tok, epochs=None, rank=rank, world_size=world, shuffle_shards=True, seed=5)
    sources = {
        "img": WebDatasetSource(f"{d}/img-{{000..007}}.tar", modality="image", name="img", **kw),
        "txt": WebDatasetSource(f"{d}/txt-{{000..002}}.tar", modality="text", name="txt", **kw),
    }
    mix = MixtureStream(sources, MixtureSchedule.constant({"img": 0.5, "txt": 0.5}))
    packer = HybridPacker(mix, max_seq_len=96, buffer_size=6, max_open_packs=2, max_pack_age=3)
    loader = PackedLoader(packer, 1, mixture=mix)
    return ZeroRedundancyFilter(loader, [], microbatches=1, slices=1, reader=PayloadReader(tok), prefetch=2)


def _step_uids(fs):
    return [(s.uid, s.epoch) for p in fs.packs for s in p.samples]


def _epoch0(data, world):
    """Every epoch-0 sample piece, from an uninterrupted run of ``world`` ranks."""
    out = Counter()
    for r in range(world):
        with _filter(data, r, world) as zr:
            for _ in range(200):
                uids = _step_uids(next(zr))
                out.update(u for u, e in uids if e == 0)
                if uids and all(e >= 2 for _, e in uids):
                    break
    return out


def _roundtrip(state):
    return msgpack.unpackb(msgpack.packb(state), strict_map_key=False)


def _resplit(data, states, new, trained, steps):
    """``new`` ranks resumed from ``states``, each run ``steps`` steps into ``trained``; their states."""
    out = []
    for r in range(new):
        with _filter(data, r, new) as zr:
            zr.load_resplit(states, r, new)
            for _ in range(steps):
                trained.update(_step_uids(next(zr)))
            out.append(_roundtrip(zr.state_dict()))
    return out


@pytest.mark.parametrize(
    ("layouts", "steps"),
    [((4, 2), 3), ((4, 8), 2), ((2, 4), 5), ((4, 2, 8), 2)],
    ids=lambda v: "->".join(map(str, v)) if isinstance(v, tuple) else f"steps{v}",
)
def test_dp_resplit_trains_every_sample_once(data, layouts, steps):
    old, *middle, new = layouts
    want = _epoch0(data, old)
    assert want and max(want.values()) == 1
    assert len({u.split("@")[0] for u in want}) == 76  # every sample of both sources (text in pieces)
    trained = Counter()
    states = []
    for r in range(old):
        with _filter(data, r, old) as zr:
            for _ in range(steps):
                trained.update(_step_uids(next(zr)))
            st = zr.state_dict()
            assert st["pending"] and st["loader"]["packer"]["buffer"] + st["loader"]["packer"]["open"]
            states.append(_roundtrip(st))
    for world in middle:  # a re-split of a re-split: carried work items are dealt out again
        states = _resplit(data, states, world, trained, steps)
        assert any(st["loader"]["packer"]["source"]["sources"]["img"]["carry"] for st in states)
    new_filters = [_filter(data, r, new) for r in range(new)]
    for r, zr in enumerate(new_filters):
        zr.load_resplit(states, r, new)
    rounds = 0
    while sum(n for (u, e), n in trained.items() if e == 0) < sum(want.values()) and rounds < 400:
        for zr in new_filters:
            trained.update(_step_uids(next(zr)))
        rounds += 1
    for zr in new_filters:
        zr.close()
    got0 = Counter({u: n for (u, e), n in trained.items() if e == 0})
    assert got0 == want, (set(want) - set(got0), {u for u, n in got0.items() if n > 1})
    assert max(n for (u, e), n in trained.items() if e == 1) == 1  # no duplicates in later epochs either


def test_resplit_refused_before_reading(data):
    states = []
    for r in range(4):
        with _filter(data, r, 4) as zr:
            for _ in range(2 + (r == 3)):  # rank 3 one step ahead: the old ranks do not agree
                next(zr)
            states.append(zr.state_dict())
    new = _filter(data, 0, 2)
    with pytest.raises(
        LayoutMismatchError,
        match=r"4 old DP ranks -> rank 0 of 2: the old ranks. states are at different steps \[4, 5\]",
    ):
        new.load_resplit(states, 0, 2)
    with pytest.raises(LayoutMismatchError, match=r"4 ranks x 1 workers.*loaded into reader 0 of 2 ranks"):
        _filter(data, 0, 2).load_state_dict(states[0])  # a plain load of another layout
    src = _filter(data, 0, 2).loader.packer.source.sources[0]
    img_states = [st["loader"]["packer"]["source"]["sources"]["img"] for st in states[:3]]
    with pytest.raises(
        LayoutMismatchError, match=r"old layout 4 ranks x 1 workers, new 2 ranks.*readers \[0, 1, 2\]"
    ):
        src.load_resplit(img_states)
    new.close()


def _rank_stream(d, tok, rank, workers, shard_split):
    urls = (
        [f"{d}/img-{i:03d}.tar" for i in range(8)]
        if shard_split
        else [f"{d}/txt-{i:03d}.tar" for i in range(3)]
    )
    return RoundRobinWorkers(
        [
            WebDatasetSource(
                urls,
                modality="image" if shard_split else "text",
                tokenizer=tok,
                rank=rank,
                world_size=2,
                worker=w,
                num_workers=workers,
                epochs=1,
            )
            for w in range(workers)
        ]
    )


@pytest.mark.parametrize("shard_split", [True, False])  # 8 shards >= readers / 3 shards < readers
def test_workers_two_to_four(data, shard_split):
    d, tok = data
    everything = sorted(m.key for r in range(2) for m in _rank_stream(d, tok, r, 2, shard_split))
    assert len(everything) == (40 if shard_split else 36) and len(set(everything)) == len(everything)
    seen, states = [], []
    for r in range(2):
        stream = _rank_stream(d, tok, r, 2, shard_split)
        seen += [next(stream).key for _ in range(7)]
        states.append(_roundtrip(stream.state_dict()))
    with pytest.raises(LayoutMismatchError, match="saved with 2 workers, loaded into 4"):
        _rank_stream(d, tok, 0, 4, shard_split).load_state_dict(states[0])
    for r in range(2):
        stream = _rank_stream(d, tok, r, 4, shard_split)
        stream.load_resplit(states, r, 2)
        seen += [m.key for m in stream]
    assert sorted(seen) == everything
