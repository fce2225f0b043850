"""The committed bundled shards: counts, metadata contract, licenses, and loading through omni_data."""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf
import webdataset as wds
from PIL import Image
from tokenizers import Tokenizer

from omni_data import ImageTokens, PayloadReader, VideoTokens, WebDatasetSource
from omni_train.data import MANIFEST_PATH, SHARDS_DIR, TOKENIZER_PATH, Modality, shard_paths
from omni_train.prepare.sources import SOURCES

DATA_SOURCES = Path(__file__).resolve().parents[1] / "DATA_SOURCES.md"
KEY = re.compile(r"^[A-Za-z0-9_-]+$")
REQUIRED = {
    "image": {"modality", "source", "license", "width", "height", "title"},
    "audio": {"modality", "source", "license", "sample_rate", "num_frames", "human", "speaker"},
    "text": {"modality", "source", "play", "license"},
    "video": {"modality", "source", "license", "fps", "frames", "width", "height", "duration_s", "origin"},
}


def _samples(modality: str) -> list[dict]:
    ds = wds.WebDataset([str(p) for p in shard_paths(modality)], shardshuffle=False, empty_check=False)
    return [dict(s) for s in ds]


@pytest.fixture(scope="module")
def samples() -> dict[str, list[dict]]:
    return {m: _samples(m) for m in ("image", "audio", "text", "video")}


def test_counts_and_size(samples):
    metas = {m: [json.loads(s["json"]) for s in v] for m, v in samples.items()}
    assert len(samples["image"]) >= 500
    assert len(samples["audio"]) >= 150
    assert sum(len(s["txt"]) for s in samples["text"]) >= 1_000_000
    assert sum(m["human"] for m in metas["audio"]) >= 10
    # generation samples read the image shards (no shards of their own)
    assert all(2 <= len(shard_paths(m)) <= 4 for m in Modality if m is not Modality.GENERATION)
    image_tokenizer = SHARDS_DIR.parent / "image-tokenizer.safetensors"
    total = (
        sum(p.stat().st_size for p in SHARDS_DIR.glob("*.tar"))
        + TOKENIZER_PATH.stat().st_size
        + image_tokenizer.stat().st_size
    )
    assert total <= 25 * 2**20, f"bundled data is {total / 2**20:.1f} MiB, over the 25 MiB budget"
    manifest = json.loads(MANIFEST_PATH.read_text())
    assert sum(manifest["counts"]["audio"].values()) == len(samples["audio"])
    assert manifest["counts"]["image"]["openclipart"] == len(samples["image"])
    assert manifest["counts"]["text"]["shakespeare passages"] == len(samples["text"])
    assert sum(manifest["counts"]["video"]["clips"].values()) == len(samples["video"]) >= 50
    video_bytes = sum(p.stat().st_size for p in shard_paths("video"))
    assert video_bytes == manifest["shard_bytes"]["video"] <= 4 * 2**20


def test_metadata_contract(samples):
    keys = [s["__key__"] for v in samples.values() for s in v]
    assert len(keys) == len(set(keys)), "sample keys repeat"
    for modality, items in samples.items():
        for s in items:
            meta = json.loads(s["json"])
            where = f"{modality} sample {s['__key__']}"
            assert KEY.match(s["__key__"]), where
            assert REQUIRED[modality] <= meta.keys(), f"{where}: missing {REQUIRED[modality] - meta.keys()}"
            assert meta["modality"] == modality, where
            text = s["txt"].decode("utf-8")
            assert text.strip() == text and text, f"{where}: empty or padded text"
            if modality == "image":
                with Image.open(io.BytesIO(s["png"])) as im:
                    assert im.mode in ("RGB", "RGBA") and im.size == (meta["width"], meta["height"]), where
                    assert max(im.size) <= 256, where
            elif modality == "audio":
                info = sf.info(io.BytesIO(s["flac"]))
                assert (info.samplerate, info.channels, info.format) == (16000, 1, "FLAC"), where
                assert info.frames == meta["num_frames"] and meta["sample_rate"] == 16000, where
                assert meta["human"] is (meta["source"] == "pocketsphinx-testdata"), where
            elif modality == "video":
                with av.open(io.BytesIO(s["mp4"])) as c:
                    st = c.streams.video[0]
                    n = sum(1 for _ in c.decode(st))
                    assert (n, float(st.average_rate)) == (meta["frames"], meta["fps"]), where
                    assert (st.codec_context.width, st.codec_context.height) == (
                        meta["width"],
                        meta["height"],
                    )
                assert max(meta["width"], meta["height"]) <= 112 and meta["duration_s"] == n / meta["fps"], (
                    where
                )
            else:
                assert meta["source"] == "shakespeare" and len(s["txt"]) <= 4096, where


def test_human_transcripts_match_upstream(samples):
    # Reference transcripts as shipped in pocketsphinx-testdata's `transcription` files.
    by_key = {s["__key__"]: s["txt"].decode() for s in samples["audio"]}
    assert by_key["pocketsphinx-librivox-sense_and_sensibility_01_austen_64kb-0880"] == (
        "he was not an ill disposed young man"
    )
    assert by_key["pocketsphinx-cards-001"] == "ten of clubs"
    assert by_key["pocketsphinx-goforward"] == "go forward ten meters"
    flite = [json.loads(s["json"]) for s in samples["audio"] if s["__key__"].startswith("flite-")]
    assert {m["speaker"] for m in flite} == {"flite-slt", "flite-awb", "flite-rms", "flite-kal16"}
    assert not any(m["human"] for m in flite)


def test_caption_audio_points_at_its_image(samples):
    captions = {s["__key__"]: s["txt"].decode() for s in samples["image"]}
    for s in samples["audio"]:
        meta = json.loads(s["json"])
        if meta.get("reads") == "caption":
            spoken = s["txt"].decode()
            # the spoken caption is the image caption's title sentence (and keywords, in order)
            assert captions[meta["image_key"]].startswith(spoken.split(" Keywords: ")[0]), s["__key__"]


def _listed_licenses() -> dict[str, str]:
    # DATA_SOURCES.md gives one section per source: "### <source> (<what>): `<license>`"
    heading = re.compile(r"^### (\S+) \(.*\): `([^`]+)`$", re.MULTILINE)
    return dict(heading.findall(DATA_SOURCES.read_text()))


def test_every_license_is_listed_in_data_sources(samples):
    listed = _listed_licenses()
    # the reference: the license strings the build writes, one per upstream source
    assert listed == {str(name): spec.license for name, spec in SOURCES.items()}
    seen = Counter()
    for items in samples.values():
        for s in items:
            meta = json.loads(s["json"])
            seen[(meta["source"], meta["license"])] += 1
            if "gloss_license" in meta:
                seen[(meta["gloss_source"], meta["gloss_license"])] += 1
    for (source, license_), n in seen.items():
        assert source in listed, f"source {source!r} ({n} samples) has no section in DATA_SOURCES.md"
        assert listed[source] == license_, (
            f"{n} {source!r} samples say license {license_!r}, DATA_SOURCES.md says {listed[source]!r}"
        )
    assert {source for source, _ in seen} == set(listed) - {"tuxpaint-stamps-default"}


def test_loads_through_omni_data_webdataset_source(samples):
    tokenizer = Tokenizer.from_file(str(TOKENIZER_PATH))
    reader = PayloadReader(tokenizer)
    try:
        # video: small frames so the check stays cheap (the bundled clips are 112 px on the long side)
        vt = VideoTokens(frame=ImageTokens(min_pixels=28 * 28, max_pixels=112 * 112))
        for modality in ("image", "audio", "text", "video"):
            source = WebDatasetSource(
                [str(p) for p in shard_paths(modality)],
                modality=modality,
                tokenizer=tokenizer,
                video_tokens=vt,
            )
            metas = list(source)
            # every sample of the shards (read with webdataset itself) comes through, none skipped
            assert [m.key for m in metas] == [s["__key__"] for s in samples[modality]], modality
            assert not source.skipped, (modality, source.skipped)
            assert all(m.text_tokens > 0 for m in metas), modality
            for meta in (metas[0], metas[-1]):  # first and last shard
                payload = reader.read(meta)
                if modality == "image":
                    assert payload.pixels is not None and payload.pixels.shape == meta.shape
                elif modality == "audio":
                    ref = _pcm_of(meta)  # soundfile on the member bytes, scaled to [-1, 1]
                    assert payload.sample_rate == 16000 and payload.waveform.shape == ref.shape
                    assert np.allclose(payload.waveform.numpy(), ref, atol=1e-6), meta.key
                    assert np.abs(ref).max() > 0.01  # real signal, not silence
                elif modality == "video":
                    assert payload.frames is not None and payload.frames.shape == meta.shape
                    assert float(payload.frames.std()) > 0.01  # real footage, not a blank frame
                assert tokenizer.decode(payload.text_ids.tolist()) == _text_of(meta), meta.key
    finally:
        reader.close()


def _pcm_of(meta) -> np.ndarray:
    ref = meta.members["flac"]
    with open(ref.url, "rb") as f:
        f.seek(ref.offset)
        return sf.read(io.BytesIO(f.read(ref.size)), dtype="float32")[0]


def _text_of(meta) -> str:
    ref = meta.members["txt"]
    with open(ref.url, "rb") as f:
        f.seek(ref.offset)
        return f.read(ref.size).decode("utf-8")
