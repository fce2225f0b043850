"""Gzip-compressed shards against webdataset's own reader (the peer oracle), and the guarantees of plain
shards on them: same samples as the plain tar, exact resume and re-split, damage skipped and named;
zstd / bzip2 / xz refused by name, never counted as damage."""

import bz2
import gzip
import io
import lzma
import random
import re
import shutil
import tarfile
from pathlib import Path

import fsspec
import msgpack
import pytest
import webdataset as wds
from webdataset import tariterators

from omni_data import (
    HybridPacker,
    MixtureSchedule,
    MixtureStream,
    PackedLoader,
    PayloadError,
    PayloadReader,
    WebDatasetSource,
    ZeroRedundancyFilter,
)
from omni_data.compressed import GzipShard, UnsupportedCompressionError
from omni_data.source import open_shard
from omni_data.tar_index import TarMember, iter_members
from omni_data.testing import image_samples, train_tiny_bpe, write_shards


def _gzip_tar(path, samples, *, fmt=tarfile.PAX_FORMAT, folder=False):
    """A shard made the way webdataset's testdata ``.tgz`` files are: ``tarfile`` in ``w:gz`` mode
    (``folder``: a directory entry first, as ``tar czf x.tgz dir/`` writes; readers skip it)."""
    with tarfile.open(path, "w:gz", format=fmt) as tf:
        if folder:
            info = tarfile.TarInfo("dir0")
            info.type = tarfile.DIRTYPE
            tf.addfile(info)
        for s in samples:
            for ext, data in s.items():
                if ext == "__key__":
                    continue
                data = data.encode() if isinstance(data, str) else data
                info = tarfile.TarInfo(f"{s['__key__']}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return str(path)


def _mixed_samples(n, seed):
    """Members of many sizes (some larger than a gzip piece, incompressible), dotted and nested keys."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        big = rng.randbytes(rng.choice([10, 700, 5000, 70_000, 1_300_000]))
        deep = "deep/" * 24 if i == 5 else ""  # a 130-character name: PAX path, GNU long name, ustar prefix
        out.append(
            {
                "__key__": f"dir{i % 3}/{deep}s{i:04d}",
                "bin": big,
                "txt": ("word " * rng.randint(0, 300)).encode(),
                "seg.cls": str(i).encode(),
            }
        )
    return out


def _ours(url):
    with open_shard(url) as f:
        out = []
        for m in iter_members(f, 0, 1 << 62):
            assert isinstance(m, TarMember)
            with open_shard(url) as g:
                g.seek(m.offset)
                out.append((m.name, g.read(m.size)))
        return out


def _peer(url):
    stream = tariterators.tar_file_expander(tariterators.url_opener([{"url": url}]))
    return [(s["fname"], s["data"]) for s in stream if s]  # {} marks the end of each shard


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_gzip_members_match_webdataset(tmp_path, fmt):
    samples = _mixed_samples(24, seed=fmt)
    url = _gzip_tar(tmp_path / "mixed.tgz", samples, fmt=fmt, folder=True)
    peer, ours = _peer(url), _ours(url)
    assert any(len(n) > 100 for n, _ in peer)
    assert len(peer) == 24 * 3
    assert [n for n, _ in ours] == [n for n, _ in peer]
    assert [d for _, d in ours] == [d for _, d in peer]
    # samples grouped by webdataset's key convention: the same keys and member bytes
    ds = list(wds.WebDataset(url, shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in ds] == [s["__key__"] for s in samples]
    assert [s["bin"] for s in ds] == [s["bin"] for s in samples]


def test_tgz_source_gives_the_plain_tar_samples(tmp_path):
    tok = train_tiny_bpe()
    samples = list(image_samples(40, sizes=(16, 60)))
    plain = write_shards(f"{tmp_path}/img-%03d.tar", samples, per_shard=20)
    gz = []
    for i, p in enumerate(plain):
        # one by name (.tgz), one gzip under a plain .tar name: detected by content
        dst = f"{tmp_path}/gz-{i:03d}." + ("tgz" if i == 0 else "tar")
        with open(p, "rb") as src, gzip.open(dst, "wb") as out:
            shutil.copyfileobj(src, out)
        gz.append(dst)
    peer = [s["__key__"] for u in gz for s in wds.WebDataset(u, shardshuffle=False, empty_check=False)]

    def run(urls):
        src = WebDatasetSource(urls, modality="image", tokenizer=tok, name="img", epochs=1)
        src.reset()
        metas = list(src)
        reader = PayloadReader(tok)
        payloads = [reader.read(m) for m in metas]
        raw = [reader.read_bytes(m.members["png"]) for m in metas]
        reader.close()
        return src, metas, payloads, raw

    s0, m0, p0, r0 = run(plain)
    s1, m1, p1, r1 = run(gz)
    assert [m.key for m in m1] == [m.key for m in m0] == peer
    assert len(m1) == 40 and s1.skipped == {} and s0.skipped == {}
    for a, b in zip(m0, m1):
        assert (a.media_tokens, a.text_tokens, a.shape, a.encoder_flops) == (
            b.media_tokens,
            b.text_tokens,
            b.shape,
            b.encoder_flops,
        )
        assert {e: (r.offset, r.size) for e, r in a.members.items()} == {
            e: (r.offset, r.size) for e, r in b.members.items()
        }
    assert r1 == r0 == [s["png"] for s in samples]
    assert all((a.pixels == b.pixels).all() and a.text_ids.equal(b.text_ids) for a, b in zip(p0, p1))


def test_gzip_shard_seeks_match_gzip_module(tmp_path):
    rng = random.Random(1)
    # two concatenated gzip members (as `cat a.gz b.gz` gives), incompressible and compressible parts
    parts = [rng.randbytes(900_000) + b"\0" * 3_000_000, rng.randbytes(1_500_000) + b"ab" * 400_000]
    path = tmp_path / "two.gz"
    path.write_bytes(b"".join(gzip.compress(p) for p in parts))
    whole = b"".join(parts)
    with GzipShard(open(path, "rb"), str(path), span=1 << 16) as g:
        assert g.read(10) == whole[:10]
        assert g.seek(0, 2) == len(whole) and g.size == len(whole)
        assert len(g._points) > 10  # checkpoints were taken: backward seeks re-inflate at most a span
        for _ in range(300):
            a, n = rng.randrange(len(whole) + 5), rng.randrange(200_000)
            g.seek(a)
            assert g.read(n) == whole[a : a + n], (a, n)
        assert g.damage is None


def test_resume_and_resplit_on_gzip_shards(tmp_path):
    tok = train_tiny_bpe()
    urls = []
    for i in range(4):
        urls.append(_gzip_tar(tmp_path / f"s-{i}.tar.gz", list(image_samples(15, seed=i, prefix=f"i{i}_"))))

    def source(**kw):
        return WebDatasetSource(urls, modality="image", tokenizer=tok, name="img", epochs=2, seed=5, **kw)

    full = source(shuffle_shards=True)
    full.reset()
    want = [m.key for m in full]
    assert len(want) == 120
    for cut in (7, 15, 16, 61):  # mid-shard, at a shard's end, just after, second epoch
        a = source(shuffle_shards=True)
        a.reset()
        got = [next(a).key for _ in range(cut)]
        state = msgpack.unpackb(msgpack.packb(a.state_dict()))
        b = source(shuffle_shards=True)
        b.reset(state)
        assert got + [m.key for m in b] == want, cut
    # two readers -> one, mid-epoch: every sample of the rest exactly once
    olds, seen = [], []
    for r in range(2):
        s = source(rank=r, world_size=2)
        s.reset()
        seen += [next(s).key for _ in range(9)]
        olds.append(msgpack.unpackb(msgpack.packb(s.state_dict())))
    new = source()
    new.load_resplit(olds, 0, 1)
    rest = [m.key for m in new]
    assert sorted(seen + rest) == sorted(want)


def test_damaged_gzip_shards_skip_and_name(tmp_path):
    tok = train_tiny_bpe()
    samples = list(image_samples(30, sizes=(40, 60)))
    cut = _gzip_tar(tmp_path / "cut.tgz", samples)
    data = Path(cut).read_bytes()
    Path(cut).write_bytes(data[: len(data) // 2])  # the compressed stream cut in the middle
    bad = tmp_path / "bad.tgz"
    raw = bytearray(gzip.decompress(data))
    # a damaged tar header inside the gzip stream: the member header of sample 10's png
    at = raw.index(b"img000010.png") & ~511
    raw[at + 148 : at + 156] = b"garbage!"
    bad.write_bytes(gzip.compress(bytes(raw)))
    src = WebDatasetSource([cut, str(bad)], modality="image", tokenizer=tok, name="img", epochs=1)
    src.reset()
    keys = [m.key for m in src]
    n_cut = keys.index("img000000", 1)  # the first sample of the second shard
    # the cut shard: a prefix of its samples, then its loss named with the shard and the byte
    assert 3 < n_cut < 30 and keys[:n_cut] == [s["__key__"] for s in samples[:n_cut]]
    assert src.skipped.get("damaged gzip stream (rest of shard lost)") == 1
    named = dict((r, k) for k, r in src.skipped_keys)
    assert named["damaged gzip stream (rest of shard lost)"].startswith(f"shard:{cut}@")
    # the damaged header: skipped and counted as on a plain tar, the rest of the shard read
    assert src.skipped.get("damaged tar header", 0) >= 1
    assert "img000010" not in keys[n_cut:] and "img000011" in keys[n_cut:]
    # the sample being read when the header broke and the one it belonged to: both lost, as in a plain tar
    lost = ("img000009", "img000010")
    assert keys[n_cut:] == [s["__key__"] for s in samples if s["__key__"] not in lost]
    assert sorted(
        k for k, r in src.skipped_keys if r == "damaged tar header" and not k.startswith("shard:")
    ) == [*lost]


@pytest.mark.parametrize(
    ("name", "compress"),
    [
        ("zstd", lambda b: b"\x28\xb5\x2f\xfd" + b"\0" * 64),
        ("bzip2", bz2.compress),
        ("xz", lambda b: lzma.compress(b, format=lzma.FORMAT_XZ)),
    ],
)
def test_other_compressions_refused_by_name(tmp_path, name, compress):
    tok = train_tiny_bpe()
    plain = write_shards(f"{tmp_path}/p-%03d.tar", image_samples(4), per_shard=4)[0]
    path = tmp_path / "s.tar.x"
    path.write_bytes(compress(Path(plain).read_bytes()))
    src = WebDatasetSource([str(path)], modality="image", tokenizer=tok, name="img", epochs=None)
    src.reset()
    with pytest.raises(
        UnsupportedCompressionError, match=re.escape(f"{path}: {name}-compressed shard: not supported")
    ):
        next(src)
    assert src.skipped == {}
    with pytest.raises(UnsupportedCompressionError):
        open_shard(str(path))


def test_batched_reads_never_take_a_compressed_shard(tmp_path):
    """``cat_ranges`` reads byte ranges of the file; a gzip shard's member ranges are in its decompressed
    stream, so a reader set to batch always still reads it through a handle."""
    plain = write_shards(f"{tmp_path}/p-%03d.tar", image_samples(3), per_shard=3)[0]
    gz = _gzip_tar(tmp_path / "p.tar", image_samples(3))  # gzip under a plain name
    gz_named = _gzip_tar(tmp_path / "q.tar.gz", image_samples(3))
    reader = PayloadReader(batched="always")
    assert reader.uses_batches(plain)
    assert not reader.uses_batches(gz) and not reader.uses_batches(gz_named)
    # a remote store (fsspec memory://): "auto" batches plain shards only, and a gzip shard reads right
    fs = fsspec.filesystem("memory")
    fs.pipe("/gzip-test/a.tar", Path(plain).read_bytes())
    fs.pipe("/gzip-test/a.tgz", Path(gz).read_bytes())
    auto = PayloadReader(train_tiny_bpe())
    assert auto.uses_batches("memory://gzip-test/a.tar") and not auto.uses_batches("memory://gzip-test/a.tgz")
    src = WebDatasetSource(["memory://gzip-test/a.tgz"], modality="image", name="img", epochs=1)
    src.reset()
    metas = list(src)
    assert [m.key for m in metas] == [s["__key__"] for s in image_samples(3)]
    assert [auto.read_bytes(m.members["png"]) for m in metas] == [s["png"] for s in image_samples(3)]
    with pytest.raises(
        PayloadError, match=re.escape("memory://gzip-test/a.tgz: compressed or unreadable shard")
    ):
        auto.fetch([metas[0].members["png"]])
    fs.rm("/gzip-test", recursive=True)


def test_zero_redundancy_filter_reads_the_same_payloads_from_gzip(tmp_path):
    """A rank consuming encoder microbatches 1 and 3 of 4 gets the same payloads, and only those, from
    gzip shards as from the plain ones, with 2 decode threads sharing the reader."""
    tok = train_tiny_bpe()
    plain = write_shards(f"{tmp_path}/img-%03d.tar", image_samples(48, sizes=(16, 60)), per_shard=16)
    gz = []
    for u in plain:
        Path(f"{u}.gz").write_bytes(gzip.compress(Path(u).read_bytes()))
        gz.append(f"{u}.gz")

    def steps(urls):
        src = WebDatasetSource(urls, modality="image", tokenizer=tok, name="img", epochs=None)
        mix = MixtureStream({"img": src}, MixtureSchedule.constant({"img": 1.0}))
        loader = PackedLoader(HybridPacker(mix, 256, 16), 2, mixture=mix)
        reader = PayloadReader(tok)
        out = []
        with ZeroRedundancyFilter(
            loader, [1, 3], microbatches=2, slices=2, reader=reader, decode_workers=2, read_text=True
        ) as zr:
            zr.reset()
            for _ in range(6):
                st = next(zr)
                out.append(
                    {
                        e: [(p.meta.key, p.pixels.sum().item(), p.text_ids.tolist()) for p in ps]
                        for e, ps in st.payloads.items()
                    }
                )
        return out

    want = steps(plain)
    got = steps(gz)
    assert got == want and sum(len(ps) for st in got for ps in st.values()) > 10
    assert all(set(st) <= {1, 3} for st in got)  # payloads of the consumed encoder microbatches only
