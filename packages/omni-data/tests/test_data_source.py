"""WebDatasetSource: metadata vs decoded payloads, bad data skipped and counted, splitting ledger, resume."""

import io
import json
import os
import tarfile

import msgpack
import pytest
from PIL import Image

from omni_data import ImageTokens, LayoutMismatchError, PayloadReader, RoundRobinWorkers, WebDatasetSource
from omni_data.testing import audio_samples, image_samples, text_samples, train_tiny_bpe, write_shards


@pytest.fixture(scope="module")
def tok():
    return train_tiny_bpe()


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    """5 image shards of 8: shard 1 holds a corrupt PNG, shard 2 is cut mid-member, shard 3 is empty (0 bytes)."""
    d = tmp_path_factory.mktemp("bad")
    samples = list(image_samples(40, sizes=(16, 40)))
    samples[11]["png"] = b"\x89PNG\r\n\x1a\n" + b"garbage" * 20
    urls = write_shards(f"{d}/s-%03d.tar", samples, per_shard=8)
    with tarfile.open(urls[2]) as tf:
        member = next(m for m in tf.getmembers() if m.name.startswith("img000021.png"))
    with open(urls[2], "r+b") as f:
        f.truncate(member.offset_data + member.size // 2)
    open(urls[3], "wb").close()
    return d, urls


def test_metadata_matches_decoded_payload(tmp_path, tok):
    write_shards(f"{tmp_path}/i-%03d.tar", image_samples(6, with_json=False), per_shard=3)
    write_shards(f"{tmp_path}/a-%03d.tar", audio_samples(4, fmt="wav"), per_shard=4)
    write_shards(f"{tmp_path}/t-%03d.tar", text_samples(4), per_shard=4)
    reader = PayloadReader(tok)
    it = ImageTokens()
    images = list(WebDatasetSource(f"{tmp_path}/i-{{000..001}}.tar", modality="image", tokenizer=tok))
    audio = list(WebDatasetSource(f"{tmp_path}/a-000.tar", modality="audio", tokenizer=tok))
    assert len(images) == 6 and len(audio) == 4  # the loops below check every sample, none vacuously
    for m in images:
        p = reader.read(m)
        with tarfile.open(m.members["png"].url) as tf:
            raw = tf.extractfile(f"{m.key}.png").read()
            caption = tf.extractfile(f"{m.key}.txt").read().decode()
        h, w = Image.open(io.BytesIO(raw)).size[::-1]
        assert m.media_tokens == it.tokens(h, w) and p.pixels.shape == (3, *it.resize(h, w))
        assert p.text_ids.tolist() == tok.encode(caption).ids and m.text_tokens == len(p.text_ids)
    for m in audio:
        p = reader.read(m)
        assert p.waveform.shape == m.shape and p.sample_rate == 8000 and m.media_tokens >= 1
    texts = list(WebDatasetSource(f"{tmp_path}/t-000.tar", modality="text", tokenizer=tok))
    assert len(texts) == 4
    assert [len(reader.read(m).text_ids) for m in texts] == [m.text_tokens for m in texts]


def test_bad_data_skipped_and_counted(bad_dir):
    d, urls = bad_dir
    src = WebDatasetSource(f"{d}/s-{{000..004}}.tar", modality="image")
    keys = [m.key for m in src]
    # shard 2: samples 16..20 intact, 21 cut (and everything after it in the shard is gone)
    expected = [f"img{i:06d}" for i in [*range(0, 11), *range(12, 21), *range(32, 40)]]
    assert keys == expected
    cut = "shard cut off (the samples after the cut are lost)"
    assert src.skipped == {"undecodable image": 1, "truncated member": 1, "empty shard": 1, cut: 1}
    assert ("img000011", "undecodable image") in src.skipped_keys
    assert ("img000021", "truncated member") in src.skipped_keys
    assert (f"shard:{urls[3]}", "empty shard") in src.skipped_keys


def _drain(src, n=None):
    out = []
    for m in src:
        out.append(m.key)
        if n is not None and len(out) == n:
            break
    return out


@pytest.mark.parametrize("cut", [0, 5, 11, 19, 20, 27, 28, 29])  # 28 = end of epoch 0
def test_resume_exact_through_bad_data(bad_dir, cut):
    d, _ = bad_dir
    url = f"{d}/s-{{000..004}}.tar"
    full = _drain(WebDatasetSource(url, modality="image", epochs=2))
    a = WebDatasetSource(url, modality="image", epochs=2)
    head = _drain(a, cut)
    state = msgpack.unpackb(msgpack.packb(a.state_dict()), strict_map_key=False)
    b = WebDatasetSource(url, modality="image", epochs=2)
    b.load_state_dict(state)
    assert head + _drain(b) == full
    cut = "shard cut off (the samples after the cut are lost)"
    assert b.skipped == {"undecodable image": 2, "truncated member": 2, "empty shard": 2, cut: 2}


@pytest.mark.parametrize("num_shards", [8, 3])  # shard split / sample split (fewer shards than readers)
def test_ledger_two_ranks_two_workers(tmp_path, bad_dir, num_shards):
    write_shards(f"{tmp_path}/l-%03d.tar", text_samples(num_shards * 9), per_shard=9)
    tok = train_tiny_bpe()
    urls = [f"{tmp_path}/l-{i:03d}.tar" for i in range(num_shards)]
    everything = [f"txt{i:06d}" for i in range(num_shards * 9)]
    for seed in (0, 1):
        seen: dict[int, list[str]] = {0: [], 1: []}
        for rank in range(2):
            for worker in range(2):
                src = WebDatasetSource(
                    urls,
                    modality="text",
                    tokenizer=tok,
                    rank=rank,
                    world_size=2,
                    worker=worker,
                    num_workers=2,
                    shuffle_shards=True,
                    seed=seed,
                    epochs=2,
                )
                for m in src:
                    seen[m.epoch].append(m.key)
        for epoch in (0, 1):  # exactly once per epoch: no dups, no gaps (shard order reshuffled per epoch)
            assert sorted(seen[epoch]) == everything, (seed, epoch)
    # with bad data in the mix, kept + skipped still cover every key once
    d, _ = bad_dir
    kept, skipped = [], []
    for r in range(4):
        s = WebDatasetSource(
            f"{d}/s-{{000..004}}.tar",
            modality="image",
            rank=r // 2,
            world_size=2,
            worker=r % 2,
            num_workers=2,
        )
        kept += _drain(s)
        skipped += [k for k, _ in s.skipped_keys if not k.startswith("shard:")]
    assert sorted(kept + skipped) == sorted({*kept, *skipped}) and len(kept) + len(skipped) == 30
    # fewer shards (3, one empty) than readers (4): samples are split, the empty shard counted once
    empties = 0
    for r in range(4):
        s = WebDatasetSource(
            f"{d}/s-{{002..004}}.tar",
            modality="image",
            rank=r // 2,
            world_size=2,
            worker=r % 2,
            num_workers=2,
        )
        _drain(s)
        empties += s.skipped.get("empty shard", 0)
    assert empties == 1


def test_layout_mismatch(tmp_path, tok):
    write_shards(f"{tmp_path}/m-%03d.tar", text_samples(20), per_shard=5)
    url = f"{tmp_path}/m-{{000..003}}.tar"
    a = WebDatasetSource(url, modality="text", tokenizer=tok, rank=0, world_size=2, epochs=None)
    _drain(a, 3)
    state = a.state_dict()
    with pytest.raises(LayoutMismatchError, match=r"2 ranks x 1 workers over 4 shards.*load_resplit"):
        WebDatasetSource(url, modality="text", tokenizer=tok, rank=0, world_size=4).load_state_dict(state)
    fewer = WebDatasetSource(
        f"{tmp_path}/m-{{000..002}}.tar", modality="text", tokenizer=tok, rank=0, world_size=2
    )
    with pytest.raises(LayoutMismatchError, match="over 3 shards"):
        fewer.load_state_dict(state)  # the shard list changed under the run


def test_bad_json_and_missing_member(tmp_path):
    s = list(image_samples(3))
    s[0]["json"] = b"{not json"
    del s[1]["png"]
    s[2]["json"] = json.dumps({"width": 1, "height": 1}).encode()  # disagrees with the PNG header
    write_shards(f"{tmp_path}/j-%03d.tar", s, per_shard=5)
    src = WebDatasetSource(f"{tmp_path}/j-000.tar", modality="image")
    assert _drain(src) == []
    assert src.skipped == {"bad json": 1, "missing image member": 1, "image size disagrees with json": 1}
    assert os.path.exists(f"{tmp_path}/j-000.tar")


def test_round_robin_workers_ledger_and_resume(tmp_path, tok):
    write_shards(f"{tmp_path}/w-%03d.tar", text_samples(50), per_shard=10)
    url = f"{tmp_path}/w-{{000..004}}.tar"

    def rank_stream(rank):
        return RoundRobinWorkers(
            [
                WebDatasetSource(
                    url, modality="text", tokenizer=tok, rank=rank, world_size=2, worker=w, num_workers=2
                )
                for w in range(2)
            ]
        )

    per_rank = [_drain(rank_stream(r)) for r in range(2)]
    assert sorted(per_rank[0] + per_rank[1]) == [f"txt{i:06d}" for i in range(50)]
    a = rank_stream(0)
    head = _drain(a, 13)
    b = rank_stream(0)
    b.load_state_dict(msgpack.unpackb(msgpack.packb(a.state_dict()), strict_map_key=False))
    assert head + _drain(b) == per_rank[0]
