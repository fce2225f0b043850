"""ZeroRedundancyFilter on gloo: PP=2 x TP=2 over one DP rank. Each pipeline rank decodes only its encoder
microbatches, only TP rank 0 reads, TP rank 1 receives identical payloads, the union over pipeline ranks
covers every media sample once, and resume re-filters the saved pre-filtered buffer into the same split.
An image and an audio clip whose headers are fine but whose bodies are damaged get zero placeholders with
``Payload.error`` (on both TP ranks), are counted on the reading rank, and the run goes on.
Also (same world): PackedLoader with a DP group of 4 stops every rank at the same step.
``balance=False``: the in-order split against a brute force over all contiguous cuts, and the filter on
real shards reads exactly that split."""

import itertools

import msgpack
import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_data import (
    HybridPacker,
    MixtureSchedule,
    MixtureStream,
    Modality,
    Pack,
    PackedLoader,
    Payload,
    PayloadError,
    PayloadReader,
    SampleMeta,
    UndecodablePayloadError,
    WebDatasetSource,
    ZeroRedundancyFilter,
    split_encoder_microbatches,
)
from omni_data.testing import audio_samples, image_samples, text_samples, train_tiny_bpe, write_shards
from omni_parallel.testing import run_world

MICRO, SLICES = 2, 2


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("zr")
    imgs, auds = list(image_samples(40, sizes=(16, 60))), list(audio_samples(40, seconds=(0.05, 0.3)))
    imgs[1]["png"], auds[2]["flac"] = _damage_body(imgs[1]["png"], 80), _damage_body(auds[2]["flac"], 200)
    write_shards(f"{d}/img-%03d.tar", imgs, per_shard=20)
    write_shards(f"{d}/aud-%03d.tar", auds, per_shard=20)
    write_shards(f"{d}/txt-%03d.tar", text_samples(40, words=(5, 60)), per_shard=20)
    return str(d)


def _damage_body(data, keep):
    """Flip the bits after the first ``keep`` bytes: the header (PNG IHDR, FLAC STREAMINFO) still parses."""
    return data[:keep] + bytes(b ^ 0x5A for b in data[keep:])


def _loader(d, tok, rank=0, world_size=1, epochs=None, packs_per_step=4):
    kw = dict(tokenizer=tok, epochs=epochs, rank=rank, world_size=world_size)
    sources = {
        "img": WebDatasetSource(f"{d}/img-{{000..001}}.tar", modality="image", name="img", **kw),
        "aud": WebDatasetSource(f"{d}/aud-{{000..001}}.tar", modality="audio", name="aud", **kw),
        "txt": WebDatasetSource(f"{d}/txt-{{000..001}}.tar", modality="text", name="txt", **kw),
    }
    mix = MixtureStream(sources, MixtureSchedule.constant({"img": 0.4, "aud": 0.4, "txt": 0.2}))
    return PackedLoader(
        HybridPacker(mix, max_seq_len=192, buffer_size=24, max_open_packs=2), packs_per_step, mixture=mix
    )


def _raw(x):
    return tuple(x.shape), x.numpy().tobytes()


def _summary(step):
    out = {}
    for e, payloads in step.payloads.items():
        out[e] = [
            (
                p.meta.uid,
                _raw(p.pixels if p.pixels is not None else p.waveform),
                p.sample_rate,
                None if p.text_ids is None else p.text_ids.tolist(),
                p.error is not None,
            )
            for p in payloads
        ]
    text = [[None if t is None else t.tolist() for t in row] for row in step.text_ids]
    return step.step, [p.to_dict() for p in step.packs], out, text


def _zr_world(rank, world_size, d):
    tok = train_tiny_bpe()
    pp = rank // 2  # ranks (0, 1) = PP 0, TP 0/1; (2, 3) = PP 1
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    consumes = [e for e in range(1, MICRO * SLICES + 1) if (e - 1) % SLICES == pp]
    reader = PayloadReader(tok)

    def make():
        return ZeroRedundancyFilter(
            _loader(d, tok),
            consumes,
            microbatches=MICRO,
            slices=SLICES,
            reader=reader,
            tp_group=groups[pp],
            prefetch=1,
            read_text=pp == 0,
        )

    zr = make()
    steps = [_summary(next(zr)) for _ in range(2)]
    state = msgpack.packb(zr.state_dict())
    pending = len(zr.state_dict()["pending"])
    steps += [_summary(next(zr)) for _ in range(2)]
    resumed = make()
    resumed.load_state_dict(msgpack.unpackb(state, strict_map_key=False))
    after = [_summary(next(resumed)) for _ in range(2)]
    # a DP group of 4 with finite sources: every rank stops at the same step (no rank left in a collective)
    loader = _loader(d, tok, rank=rank, world_size=world_size, epochs=1, packs_per_step=1)
    loader.dp_group = dist.group.WORLD
    dp_steps = [b.step for b in loader]
    return {
        "steps": steps,
        "after": after,
        "bytes": reader.bytes_read,
        "pending": pending,
        "dp_steps": dp_steps,
        "skipped": zr.skipped,
        "skipped_keys": zr.skipped_keys,
    }


def test_zero_redundancy_pp2_tp2(shards):
    res = run_world(_zr_world, 4, args=(shards,), timeout_s=180)
    tok = train_tiny_bpe()
    reader = PayloadReader(tok)
    assert res[1]["bytes"] == 0 and res[3]["bytes"] == 0  # TP rank 1 never reads
    assert res[0]["bytes"] > 0 and res[2]["bytes"] > 0
    assert res[0]["pending"] == 1
    bad = set()
    for s in range(4):
        _, packs_d, _, _ = res[0]["steps"][s]
        assert all(res[r]["steps"][s][1] == packs_d for r in range(4))  # same metadata on every rank
        packs = [Pack.from_dict(p) for p in packs_d]
        mbs = split_encoder_microbatches(packs, MICRO, SLICES)
        media = sorted(x.uid for p in packs for x in p.samples if x.modality is not Modality.TEXT)
        decoded = sorted(
            u for r in (0, 2) for e in res[r]["steps"][s][2] for u, *_ in res[r]["steps"][s][2][e]
        )
        assert decoded == media  # every media sample decoded by exactly one pipeline rank
        for r in range(4):
            got = res[r]["steps"][s][2]
            assert set(got) == {e for e in mbs if (e - 1) % SLICES == r // 2}
            for e, items in got.items():
                for (p, i), (uid, x, rate, ids, placeholder) in zip(mbs[e], items):
                    meta = packs[p].samples[i]
                    try:
                        ref = reader.read(meta)
                    except UndecodablePayloadError as err:
                        ref = Payload.placeholder(meta, str(err))
                        ref.text_ids = reader.read_text_ids(meta)
                        bad.add((r, s, uid))
                    assert placeholder == (ref.error is not None) and uid == ref.meta.uid
                    assert x == _raw(ref.pixels if ref.pixels is not None else ref.waveform)
                    assert rate == ref.sample_rate and ids == ref.text_ids.tolist()
        for r in (0, 1):  # the first stage also got every sample's token ids
            text = res[r]["steps"][s][3]
            assert text == [
                [None if t is None else t.tolist() for t in (reader.read_text_ids(x) for x in p.samples)]
                for p in packs
            ]
        assert res[2]["steps"][s][3] == []
    for r in range(4):
        assert res[r]["after"] == res[r]["steps"][2:]  # resume re-filters into exactly the same split
    assert len({tuple(res[r]["dp_steps"]) for r in range(4)}) == 1 and res[0]["dp_steps"]
    alone = [
        len(list(_loader(shards, tok, rank=r, world_size=4, epochs=1, packs_per_step=1))) for r in range(4)
    ]
    assert len(res[0]["dp_steps"]) == min(alone) < max(alone)  # the shortest reader decides, for everyone
    # both damaged bodies came up, on both TP ranks, and only the reading rank counted them
    assert {u for _, _, u in bad} == {"img/img000001", "aud/aud000002"}
    for tp0 in (0, 2):
        mine = sorted(u for r, _, u in bad if r == tp0)
        assert sorted(k for k, _ in res[tp0]["skipped_keys"]) == mine
        assert sum(res[tp0]["skipped"].values()) == len(mine)
        assert sorted(u for r, _, u in bad if r == tp0 + 1) == mine  # TP rank 1 got the same placeholders
    assert res[1]["skipped"] == {} and res[3]["skipped"] == {}


def test_zero_redundancy_argument_errors(shards):
    tok = train_tiny_bpe()
    loader = _loader(shards, tok)
    with pytest.raises(ValueError, match=r"consumes \[0, 5\] outside the encoder microbatches 1..4"):
        ZeroRedundancyFilter(loader, [0, 1, 5], microbatches=2, slices=2, reader=PayloadReader(tok))
    with pytest.raises(ValueError, match="microbatches"):
        ZeroRedundancyFilter(loader, [], microbatches=0, slices=2, reader=PayloadReader(tok))
    with pytest.raises(ValueError, match="tokenizer"):
        ZeroRedundancyFilter(loader, [1], microbatches=1, slices=1, reader=PayloadReader(), read_text=True)
    # a reader with another tokenizer than the metadata's: a setup error, raised, never a placeholder
    other = train_tiny_bpe(["zz yy xx"] * 3, vocab_size=40)
    zr = ZeroRedundancyFilter(
        loader, [1, 2, 3, 4], microbatches=2, slices=2, reader=PayloadReader(other), read_text=True
    )
    with pytest.raises(PayloadError, match="metadata says"):
        next(zr)


def _in_order_brute_force(packs, microbatches, slices):
    """Over every way to cut each LLM microbatch's media (pack order) into ``slices`` contiguous runs,
    the one whose run sizes differ by at most one and do not increase (the longer runs first)."""
    per = len(packs) // microbatches
    out = {}
    for k in range(microbatches):
        media = [
            (p, i)
            for p in range(k * per, (k + 1) * per)
            for i, s in enumerate(packs[p].samples)
            if s.modality is not Modality.TEXT
        ]
        n = len(media)
        fits = []
        for cuts in itertools.combinations_with_replacement(range(n + 1), slices - 1):
            bounds = [0, *cuts, n]
            sizes = [b - a for a, b in itertools.pairwise(bounds)]
            if max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True):
                fits.append([media[a:b] for a, b in itertools.pairwise(bounds)])
        assert len(fits) == 1
        for j, run in enumerate(fits[0]):
            out[k * slices + j + 1] = run
    return out


_pack_st = st.lists(st.sampled_from(["image", "audio", "text"]), max_size=5)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 2), st.data())
def test_split_in_order_brute_force(microbatches, slices, per, data):
    raw = data.draw(st.lists(_pack_st, min_size=microbatches * per, max_size=microbatches * per))
    flops = iter(data.draw(st.lists(st.floats(1.0, 1e6), min_size=25, max_size=25)))
    packs = [
        Pack([SampleMeta(f"p{p}s{i}", "s", Modality(m), 4, 2, next(flops), (6,)) for i, m in enumerate(ms)])
        for p, ms in enumerate(raw)
    ]
    got = split_encoder_microbatches(packs, microbatches, slices, balance=False)
    assert got == _in_order_brute_force(packs, microbatches, slices)
    assert sorted(got) == list(range(1, microbatches * slices + 1))
    # the balanced split covers the same samples (only the grouping differs)
    kk = split_encoder_microbatches(packs, microbatches, slices)
    for k in range(microbatches):
        es = range(k * slices + 1, (k + 1) * slices + 1)
        assert sorted(x for e in es for x in kk[e]) == [x for e in es for x in got[e]]
    with pytest.raises(ValueError, match="cannot form"):
        split_encoder_microbatches(packs, microbatches, 0, balance=False)


def test_zero_redundancy_in_order_filter(shards):
    tok = train_tiny_bpe()
    reader = PayloadReader(tok)
    everything = range(1, MICRO * SLICES + 1)

    def run(**kw):
        with ZeroRedundancyFilter(
            _loader(shards, tok), everything, microbatches=MICRO, slices=SLICES, reader=reader, **kw
        ) as zr:
            return [next(zr) for _ in range(3)]

    differs, checked = False, 0
    for step, kk in zip(run(balance=False), run()):
        assert [p.to_dict() for p in step.packs] == [p.to_dict() for p in kk.packs]
        assert step.microbatches == _in_order_brute_force(step.packs, MICRO, SLICES)
        assert kk.microbatches == split_encoder_microbatches(kk.packs, MICRO, SLICES)
        differs |= step.microbatches != kk.microbatches
        for e, items in step.microbatches.items():  # the payloads read are those of the in-order split
            assert [p.meta.uid for p in step.payloads[e]] == [step.packs[p].samples[i].uid for p, i in items]
            checked += len(items)
    assert (
        differs and checked >= 12
    )  # the payload check above ran on real samples  # the flag reached the split: on these shards the two splits are not the same
