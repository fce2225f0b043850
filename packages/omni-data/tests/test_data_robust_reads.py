"""Reads that survive bad bytes: a damaged PAX header, a key that is not UTF-8, an OSError in the middle of
a read (transient: retried; persistent: the rest of the shard skipped), a truncated member, an undecodable
body and over-long media are each skipped, counted with their key in ``skip_report`` (what the trainer
puts into metrics), and the run goes on; resume stays exact through all of them."""

import tarfile

import msgpack
import numpy as np
import pytest
from torchdata.nodes import IterableWrapper

from omni_data import (
    HybridPacker,
    PackedLoader,
    PayloadReader,
    WebDatasetSource,
    ZeroRedundancyFilter,
    skip_report,
)
from omni_data.testing import (
    flaky_url,
    image_samples,
    packed_loader,
    solid_png,
    train_tiny_bpe,
    webdataset_sources,
    write_shards,
    write_tar,
)

CUT = "shard cut off (the samples after the cut are lost)"


def _members(key, caption="a red cat", size=(20, 24)):
    return [(f"{key}.png", solid_png(*size)), (f"{key}.txt", caption.encode())]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Six image shards of 4 samples (k{shard}{i}); shard by shard: a damaged PAX record (in front of
    sample 1's long name), a key with a byte that is not UTF-8, a persistent read error at sample 2, a
    member cut by truncation, a body that does not decode, an image too large for a pack."""
    d = tmp_path_factory.mktemp("robust")
    keys = {s: [f"k{s}{i}" for i in range(4)] for s in range(6)}
    long_key = "k01" + "x" * 120  # > 100 bytes: tarfile writes a PAX 'path' record for it
    keys[0][1] = long_key
    for s in range(6):
        members = [m for k in keys[s] for m in _members(k)]
        if s == 1:
            members[2:4] = _members("k1\udcff1")  # sample 1: raw byte 0xff in its name
        if s == 4:
            members[2] = ("k41.png", solid_png(20, 24)[:60] + bytes(200))  # header parses, body does not
        if s == 5:
            members[4] = ("k52.png", solid_png(600, 600))  # 21x21 merged patches = 441 tokens > 256
        write_tar(f"{d}/s{s}.tar", members, fmt=tarfile.GNU_FORMAT if s == 1 else tarfile.PAX_FORMAT)
    with tarfile.open(f"{d}/s0.tar") as tf:
        pax_at = next(m.offset for m in tf.getmembers() if m.name.startswith(long_key))
    with open(f"{d}/s0.tar", "r+b") as f:
        f.seek(pax_at + 512)
        f.write(b"9x")  # the PAX record's length field no longer parses
    with tarfile.open(f"{d}/s3.tar") as tf:
        cut = next(m for m in tf.getmembers() if m.name == "k32.png")
    with open(f"{d}/s3.tar", "r+b") as f:
        f.truncate(cut.offset_data + cut.size // 2)
    with tarfile.open(f"{d}/s2.tar") as tf:
        at = next(m.offset for m in tf.getmembers() if m.name == "k22.png")
    urls = [f"{d}/s{s}.tar" for s in range(6)]
    urls[2] = flaky_url(urls[2], at=at + 3, failures=10**6)
    return urls, at


def _pipeline(urls, tok):
    src = webdataset_sources({"img": (urls, "image")}, tokenizer=tok, backoff_s=0.0)  # one epoch
    loader = packed_loader(src, {"img": 1.0}, 24, 4, 1, max_open_packs=1)
    return ZeroRedundancyFilter(loader, [1], microbatches=1, slices=1, reader=PayloadReader(tok), prefetch=1)


def _record(fs):
    return [(p.meta.uid, p.error is not None) for e in sorted(fs.payloads) for p in fs.payloads[e]]


def test_every_kind_of_damage_skipped_counted_and_resumable(shards):
    urls, _ = shards
    tok = train_tiny_bpe()
    with _pipeline(urls, tok) as zr:
        steps = [_record(fs) for fs in zr]
        report = skip_report(zr, max_keys=20)
    assert len(steps) >= 4 and all(steps)
    meta, payload = report["metadata"]["img"], report["payload"]["img"]
    assert meta["damaged tar header"] == 3  # the shard-level entry and the samples on both sides
    assert meta["key is not UTF-8"] == 1
    assert meta["read error, rest of shard skipped (OSError after 3 retries)"] == 1
    assert meta["truncated member"] == 1 and meta[CUT] == 1
    assert meta[next(r for r in meta if r.startswith("over-long image (44"))] == 1
    assert payload == {"undecodable image payload": 1}
    keys = {k for k, _ in report["keys"]["img"]}
    # each named: the samples on both sides of the damaged PAX record, the bad key, the cut, the big one
    assert {"k00", "k01" + "x" * 120, "k1\\xff1", "k32", "img/k52"} <= keys, keys
    trained = {u for st in steps for u, _ in st}
    # the run goes on: every sample not named above is trained
    assert {"img/k02", "img/k03", "img/k10", "img/k13", "img/k20", "img/k31", "img/k53"} <= trained
    # the read error hits k22's header, which ends sample k21: the walk gave up from k21's header on
    assert f"shard:{urls[2]}@2048" in keys and not {"img/k21", "img/k22", "img/k23"} & trained
    assert ("img/k41", True) in {x for st in steps for x in st}  # a zero placeholder, flagged
    # resume from the middle: the same steps, the same counts
    for cut in (1, 3):
        zr = _pipeline(urls, tok)
        head = [_record(next(zr)) for _ in range(cut)]
        state = msgpack.unpackb(msgpack.packb(zr.state_dict()), strict_map_key=False)
        zr.close()
        with _pipeline(urls, tok) as again:
            again.load_state_dict(state)
            assert head + [_record(fs) for fs in again] == steps
            assert skip_report(again, max_keys=20) == report


def test_transient_read_errors_are_retried(tmp_path):
    tok = train_tiny_bpe()
    write_shards(f"{tmp_path}/t-%03d.tar", image_samples(6, sizes=(16, 40)), per_shard=6)
    local = f"{tmp_path}/t-000.tar"
    with tarfile.open(local) as tf:
        hdr = next(m.offset for m in tf.getmembers() if m.name.startswith("img000003"))
    flaky = flaky_url(local, at=hdr + 10, failures=2)  # 2 failures < 3 retries
    src = WebDatasetSource(flaky, modality="image", tokenizer=tok, backoff_s=0.0)
    metas = list(src)
    assert [m.key for m in metas] == [f"img{i:06d}" for i in range(6)] and src.skipped == {}
    # payload-time errors: transient ones are retried...
    clean = [PayloadReader(tok).read(m) for m in WebDatasetSource(local, modality="image", tokenizer=tok)]
    png = metas[4].members["png"]
    flaky_url(local, at=png.offset + 5, failures=2)
    reader = PayloadReader(tok, backoff_s=0.0)
    got = reader.read(metas[4])
    assert got.pixels.shape == clean[4].pixels.shape and bool((got.pixels == clean[4].pixels).all())
    assert reader.stats["retries"] == 2
    # ...persistent ones give a placeholder counted as unreadable, and the run goes on
    flaky_url(local, at=png.offset + 5, failures=10**6)
    loader = PackedLoader(HybridPacker(IterableWrapper(metas), 4096, 8), 1)
    with ZeroRedundancyFilter(
        loader, [1], microbatches=1, slices=1, reader=PayloadReader(tok, backoff_s=0.0)
    ) as zr:
        payloads = [p for fs in zr for e in fs.payloads for p in fs.payloads[e]]
        report = skip_report(zr)
    assert len(payloads) == 6 and [p.meta.key for p in payloads if p.error] == ["img000004"]
    assert report["payload"] == {src.name: {"unreadable image payload": 1}}
    assert report["keys"][src.name] == [[f"{src.name}/img000004", "unreadable image payload"]]


def test_random_bytes_shard_counted_once(tmp_path):
    """A shard of random bytes is one damaged shard: one skip (damaged header), not also an empty one."""
    write_tar(f"{tmp_path}/good.tar", _members("g0") + _members("g1"))
    junk = f"{tmp_path}/junk.tar"
    with open(junk, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    src = WebDatasetSource(
        [junk, f"{tmp_path}/good.tar"], modality="image", name="img", tokenizer=train_tiny_bpe()
    )
    src.reset()
    assert [m.key for m in src] == ["g0", "g1"]  # the run goes on past it
    counts, keys = src.ledger.of("img")
    assert counts == {"damaged tar header": 1} and keys == [(f"shard:{junk}@0", "damaged tar header")], keys
