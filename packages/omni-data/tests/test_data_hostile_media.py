"""Hostile media and hostile tars are refused, named and counted, before anything expensive runs.

- Tar members named ``../../x`` or ``/abs/x``, symbolic and hard links: never samples, each named in the
  skip report with its reason, nothing written anywhere. Oracle for the names: ``tarfile.data_filter``
  (PEP 706), which refuses the names leaving the destination and rewrites absolute ones.
- Images: a PNG declaring 50,000 x 50,000 pixels (a decompression bomb), a 0-byte file and a 0 x 0 PNG are
  skipped in the metadata pass from their header; an image over the reader's pixel limit is refused at
  payload time before decoding (its body does not decode: had it been decoded first, the reason would be
  "undecodable"), and replaced by the zero placeholder.
- Audio: NaN, +Inf, -Inf (one sample among finite ones) and absurdly loud float WAVs and a WAV with no
  frames are refused right after the PCM is decoded, before soxr resamples it (counted by wrapping
  ``soxr.resample``): the filter hands out finite zero placeholders, flagged, and counts them.
- ``write_dataset`` (``python -m omni_data.write``, ``omni-train make-shards``) skips the same files and
  names each with its reason in its report and ``manifest.json``; the shards hold only the good ones.
"""

import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

import omni_data.payload as payload_module
import omni_data.tar_index as tar_index
from omni_data import (
    PayloadReader,
    WebDatasetSource,
    ZeroRedundancyFilter,
    skip_report,
)
from omni_data.testing import (
    declared_png,
    float_wav,
    hostile_media_folder,
    hostile_waves,
    packed_loader,
    solid_png,
    train_tiny_bpe,
    webdataset_sources,
    write_tar,
)
from omni_data.write import write_dataset


def _filter(urls, tok, modality, *, reader_pixels=None, max_seq_len=128):
    src = webdataset_sources({modality: (urls, modality)}, tokenizer=tok, sample_rate=16000)
    loader = packed_loader(src, {modality: 1.0}, max_seq_len, 4, 1)
    reader = (
        PayloadReader(tok) if reader_pixels is None else PayloadReader(tok, max_image_pixels=reader_pixels)
    )
    return ZeroRedundancyFilter(loader, [1], microbatches=1, slices=1, reader=reader, prefetch=1)


def _drain(zr):
    return [p for fs in zr for e in sorted(fs.payloads) for p in fs.payloads[e]]


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_traversal_names_and_links_are_named_never_loaded_and_nothing_is_written(tmp_path, monkeypatch):
    work = tmp_path / "a" / "b" / "run"  # '../../x' from here would be tmp_path/a/x
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    shard = tmp_path / "a" / "b" / "s.tar"
    good = solid_png(20, 24)
    write_tar(
        shard,
        [
            ("ok0.png", good),
            ("ok0.txt", b"a red cat"),
            ("../../x.png", good),
            ("../../x.txt", b"outside"),
            ("/abs/x.png", good),
            ("d/../../y.png", good),
            ("ok1.png", good),
            ("ok1.txt", b"a blue dog"),
            ("lnk.png", tarfile.SYMTYPE, "/etc/passwd"),
            ("hard.png", tarfile.LNKTYPE, "ok0.png"),
        ],
    )
    before = _files(tmp_path)
    want = {
        "../../x.png": "'..' in member name",
        "../../x.txt": "'..' in member name",
        "/abs/x.png": "absolute member name",
        "d/../../y.png": "'..' in member name",
        "lnk.png": "symbolic link member",
        "hard.png": "hard link member",
    }
    # the loader: only the good samples; each refused member named (shard, byte, name) with its reason
    tok = train_tiny_bpe()
    with _filter([str(shard)], tok, "image") as zr:
        payloads = _drain(zr)
        report = skip_report(zr, max_keys=20)
    assert sorted(p.meta.key for p in payloads) == ["ok0", "ok1"]
    assert all(p.error is None for p in payloads)
    assert report["metadata"]["image"] == {
        "'..' in member name": 3,
        "absolute member name": 1,
        "symbolic link member": 1,
        "hard link member": 1,
    }
    named = {(k.rsplit(":", 1)[-1], r) for k, r in report["keys"]["image"]}
    assert named == set(want.items())
    assert all(k.startswith(f"shard:{shard}@") for k, _ in report["keys"]["image"])
    # resumed after the first sample: the same counts, nothing counted twice
    src = WebDatasetSource([str(shard)], modality="image", name="image", tokenizer=tok)
    src.reset()
    first = next(src)
    again = WebDatasetSource([str(shard)], modality="image", name="image", tokenizer=tok)
    again.reset(src.state_dict())
    assert [first.key, *(m.key for m in again)] == ["ok0", "ok1"]
    assert again.skipped == report["metadata"]["image"]

    # the header walk: every member the oracle refuses (and every link) is a TarRefused, never a TarMember
    with open(shard, "rb") as f:
        walked = list(tar_index.iter_members(f, 0, shard.stat().st_size))
    refused = {m.name: m.reason for m in walked if isinstance(m, tar_index.TarRefused)}
    with tarfile.open(shard) as tf:
        for m in tf.getmembers():
            if m.isreg():  # the filter refuses a name leaving the destination and strips a leading '/'
                try:
                    unsafe = tarfile.data_filter(m, str(work)).name != m.name
                except (tarfile.AbsolutePathError, tarfile.OutsideDestinationError):
                    unsafe = True
                assert (m.name in refused) == unsafe, m.name
    assert refused == want
    members = [m.name for m in walked if isinstance(m, tar_index.TarMember)]
    assert members == ["ok0.png", "ok0.txt", "ok1.png", "ok1.txt"]
    # nothing written outside (or inside) the run
    assert _files(tmp_path) == before and not Path("/abs/x.png").exists()
    assert not (tmp_path / "a" / "x.png").exists() and not os.listdir(work)


def test_image_bombs_and_empty_images_refused_from_the_header(tmp_path):
    garbage_body = declared_png(200, 200)  # IHDR says 200 x 200; its empty IDAT does not decode
    truncated = solid_png(64, 64)
    truncated = truncated[: len(truncated) // 2]
    members = [
        ("ok.png", solid_png(20, 24)),
        ("bomb.png", declared_png(50_000, 50_000)),
        ("empty.png", b""),
        ("zero.png", declared_png(0, 0)),
        ("big.png", garbage_body),
        ("cut.png", truncated),
    ]
    write_tar(tmp_path / "img.tar", [m for n, d in members for m in ((n, d), (n[:-4] + ".txt", b"a cat"))])
    tok = train_tiny_bpe()
    # the metadata pass refuses the bomb, the 0-byte file and the 0 x 0 image from their headers
    with _filter([str(tmp_path / "img.tar")], tok, "image") as zr:
        payloads = {p.meta.key: p for p in _drain(zr)}
        report = skip_report(zr, max_keys=20)
    assert sorted(payloads) == ["big", "cut", "ok"]
    assert report["metadata"]["image"] == {
        "image over the pixel limit": 1,
        "empty file": 1,
        "empty image": 1,
    }
    assert report["payload"]["image"] == {"undecodable image payload": 2}
    assert {tuple(x) for x in report["keys"]["image"]} == {
        ("bomb", "image over the pixel limit"),
        ("empty", "empty file"),
        ("zero", "empty image"),
        ("image/big", "undecodable image payload"),
        ("image/cut", "undecodable image payload"),
    }
    assert payloads["ok"].error is None and payloads["ok"].pixels.abs().sum() > 0
    # a reader limit (10,000 pixels) below the source's: big.png is refused at payload time, before its
    # body is decoded (decoded, it would be "undecodable"), and replaced by zeros
    with _filter([str(tmp_path / "img.tar")], tok, "image", reader_pixels=10_000) as zr:
        payloads = {p.meta.key: p for p in _drain(zr)}
        report = skip_report(zr, max_keys=20)
    assert report["payload"]["image"] == {"image over the pixel limit": 1, "undecodable image payload": 1}
    assert ["image/big", "image over the pixel limit"] in report["keys"]["image"]
    big = payloads["big"]
    assert big.error.startswith("image over the pixel limit: ")
    assert "200 x 200 = 40000 pixels > 10000" in big.error
    assert big.pixels.shape == big.meta.shape and not big.pixels.any()


def test_non_finite_loud_and_empty_audio_refused_before_resampling(tmp_path, monkeypatch):
    waves = hostile_waves()
    members = []
    for name, w in waves.items():
        members += [(f"{name}.wav", float_wav(w, 22050)), (f"{name}.txt", b"a sound")]
    # no frames at all: found in the metadata pass; a json claiming frames the file lacks: at payload time
    members += [("silent.wav", float_wav(np.zeros(0))), ("silent.txt", b"nothing")]
    members += [
        ("liar.wav", float_wav(np.zeros(0))),
        ("liar.json", json.dumps({"num_frames": 4000, "sample_rate": 16000}).encode()),
        ("liar.txt", b"nothing"),
    ]
    write_tar(tmp_path / "aud.tar", members)
    calls = []
    resample = payload_module.soxr.resample

    def counted(x, *args, **kw):
        calls.append(float(np.max(np.abs(x))))
        return resample(x, *args, **kw)

    monkeypatch.setattr(payload_module.soxr, "resample", counted)
    tok = train_tiny_bpe()
    with _filter([str(tmp_path / "aud.tar")], tok, "audio") as zr:
        payloads = {p.meta.key: p for p in _drain(zr)}
        report = skip_report(zr, max_keys=20)
    assert sorted(payloads) == ["inf", "liar", "loud", "nan", "ok", "one_ninf"]
    assert report["metadata"]["audio"] == {"empty audio": 1}
    assert report["payload"]["audio"] == {
        "non-finite audio samples": 3,
        "audio amplitude over 65536": 1,
        "empty audio": 1,
    }
    assert {tuple(x) for x in report["keys"]["audio"]} == {
        ("silent", "empty audio"),
        ("audio/nan", "non-finite audio samples"),
        ("audio/inf", "non-finite audio samples"),
        ("audio/one_ninf", "non-finite audio samples"),
        ("audio/loud", "audio amplitude over 65536"),
        ("audio/liar", "empty audio"),
    }
    assert "1 of 5512 samples NaN or Inf" in payloads["one_ninf"].error
    # only the good clip was resampled; every waveform handed out is finite, the refused ones zeros
    assert len(calls) == 1 and 0.29 < calls[0] < 0.31
    for key, p in payloads.items():
        assert (
            p.sample_rate == 16000 and p.waveform.shape == p.meta.shape and torch.isfinite(p.waveform).all()
        )
        assert (p.error is None) == (key == "ok"), key
        if key != "ok":
            assert not p.waveform.any()


def test_write_dataset_skips_and_names_hostile_media(tmp_path, capsys):
    src = tmp_path / "in"
    cut = solid_png(64, 64)
    hostile_media_folder(
        src, hostile_waves(), extra={"cut.png": cut[: len(cut) // 2], "a_silent.wav": float_wav(np.zeros(0))}
    )
    from omni_data.write import main

    out = tmp_path / "shards"
    assert main([str(src), str(out), "--per-shard", "10"]) == 0
    printed = capsys.readouterr().out
    want = {
        "image over the pixel limit": ["bomb.png"],
        "empty file": ["empty.png"],
        "empty image": ["zero.png"],
        "undecodable image (OSError)": ["cut.png"],
        "non-finite audio samples": ["a_inf.wav", "a_nan.wav", "a_one_ninf.wav"],
        "audio amplitude over 65536": ["a_loud.wav"],
        "empty audio": ["a_silent.wav"],
    }
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped"] == want and manifest["samples"] == {"image": 1, "audio": 1}
    for reason, names in want.items():
        assert f"skipped {len(names)} ({reason}): {', '.join(names)}" in printed
    # the shards hold only the good files
    keys = []
    for modality in ("image", "audio"):
        with tarfile.open(out / f"{modality}-000000.tar") as tf:
            keys += sorted({m.name.split(".")[0] for m in tf.getmembers()})
    assert keys == ["ok", "a_ok"]
    # a lower limit refuses images from their header, before decoding: the truncated one too
    report = write_dataset(src, str(tmp_path / "small"), max_image_pixels=100)
    assert report.skipped["image over the pixel limit"] == ["bomb.png", "cut.png", "ok.png"]
    assert "undecodable image (OSError)" not in report.skipped
    with pytest.raises(ValueError, match="max_image_pixels must be >= 1"):
        write_dataset(src, str(tmp_path / "none"), max_image_pixels=0)
