"""Shards on an object store: the whole loader (sources with bad data and a gzip shard -> mixture ->
packer -> loader -> zero-redundancy filter decoding payloads) reads tar shards over the S3 API from a real
S3 server on loopback (moto's, started by the root conftest's ``s3_bucket`` fixture; s3fs is fsspec's S3
backend), nothing of fsspec or s3fs replaced.

Oracle: the same shards on a local disk. Every step's packs (keys, ``cu_seqlens``), every decoded payload
(pixels, waveform and text ids, bit for bit) and the skip ledger (reasons, counts, keys with the shard URL
prefix swapped) are equal; the metadata walk seeks through each tar (``fs.open`` handles with range reads),
the payloads come in ``cat_ranges`` batches, and a resume from a state saved mid-stream over S3 continues
exactly like the uninterrupted run (its byte offsets index the S3 objects as they index the files).
"""

import gzip
import json
import shutil

import msgpack
import pytest
import torch

from omni_data import PayloadReader, ZeroRedundancyFilter, skip_report, snapshot_async
from omni_data.testing import (
    audio_samples,
    damaged_image_shards,
    packed_loader,
    text_samples,
    train_tiny_bpe,
    webdataset_sources,
    write_shards,
)

STEPS = 8


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("s3shards")
    damaged_image_shards(f"{d}/img-%03d.tar", 40, per_shard=20, bad=5)  # img-001 cut, img-002 empty
    write_shards(f"{d}/aud-%03d.tar", audio_samples(30, seconds=(0.05, 0.3), with_json=True), per_shard=15)
    (txt,) = write_shards(f"{d}/plain-%03d.tar", text_samples(30, words=(5, 80)), per_shard=30)
    with open(txt, "rb") as src, gzip.open(f"{d}/txt-000.tar.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    return d


def _pipeline(root, tok):
    kw = dict(tokenizer=tok, epochs=None, shuffle_shards=True, seed=5)
    sources = webdataset_sources(
        {
            "img": (f"{root}/img-{{000..002}}.tar", "image"),
            "aud": (f"{root}/aud-{{000..001}}.tar", "audio"),
            "txt": (f"{root}/txt-000.tar.gz", "text"),
        },
        **kw,
    )
    loader = packed_loader(sources, {"img": 0.5, "aud": 0.3, "txt": 0.2}, 192, 24, 4, max_open_packs=4)
    return ZeroRedundancyFilter(
        loader,
        consumes=[1, 2, 3, 4],
        microbatches=2,
        slices=2,
        reader=PayloadReader(tok),
        prefetch=2,
        read_text=True,
    )


def _record(step):
    packs = [(list(p.keys), p.cu_seqlens.tolist()) for p in step.packs]
    payloads = [
        (p.meta.key, p.error, *(None if t is None else t.clone() for t in (p.pixels, p.waveform, p.text_ids)))
        for e in sorted(step.payloads)
        for p in step.payloads[e]
    ]
    return step.step, packs, payloads


def _equal(a, b):
    assert len(a) == len(b)
    for (sa, pa, da), (sb, pb, db) in zip(a, b):
        assert (sa, pa) == (sb, pb)
        assert len(da) == len(db)
        for x, y in zip(da, db):
            assert x[:2] == y[:2]
            for u, v in zip(x[2:], y[2:]):
                assert (u is None and v is None) or torch.equal(u, v), x[0]


def _skips(zr, root):
    report = skip_report(zr, max_keys=50)
    return json.loads(json.dumps(report).replace(root, "ROOT"))


def test_loader_over_s3_equals_the_same_shards_on_local_disk_and_resumes_exactly(s3_bucket, local_shards):
    import fsspec

    url, _ = s3_bucket
    fsspec.filesystem("s3").put(str(local_shards), f"{url[5:]}/shards", recursive=True)
    remote = f"{url}/shards"
    tok = train_tiny_bpe()

    with _pipeline(str(local_shards), tok) as zr:
        on_disk = [_record(next(zr)) for _ in range(STEPS)]
        disk_skips = _skips(zr, str(local_shards))
    with _pipeline(remote, tok) as zr:
        head = [_record(next(zr)) for _ in range(STEPS // 2)]
        state = snapshot_async(zr).result()
        on_s3 = head + [_record(next(zr)) for _ in range(STEPS - STEPS // 2)]
        s3_skips = _skips(zr, remote)
    _equal(on_s3, on_disk)
    assert s3_skips == disk_skips
    assert {"undecodable image", "empty shard"} <= set(s3_skips["metadata"]["img"])  # the bad data was met
    assert sum(len(p[0]) for _, packs, _ in on_s3 for p in packs) >= 60
    assert any(x[2] is not None for _, _, d in on_s3 for x in d)  # images decoded
    assert any(x[3] is not None for _, _, d in on_s3 for x in d)  # and audio

    with _pipeline(remote, tok) as zr:  # a resumed job (new pipeline) from the state saved over S3
        zr.load_state_dict(msgpack.unpackb(state, strict_map_key=False))
        tail = [_record(next(zr)) for _ in range(STEPS - STEPS // 2)]
    _equal(head + tail, on_disk)
