"""Your own data: a folder of 22.05 and 44.1 kHz OGG words (mono and stereo) and RGBA/P/L/CMYK images with
.txt captions becomes shards with ``python -m omni_data.write`` (its ``main``), and reads through
WebDatasetSource + PayloadReader as 16 kHz mono and RGB, with token counts that match the decoded payload.
Oracles: the waveform against the analytic sines at 16 kHz, the pixels against alpha compositing over white
computed here in float64, the metadata against the written json and ``soundfile.info``."""

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image

from omni_data import AudioTokens, ImageTokens, PayloadReader, WebDatasetSource, resampled_length
from omni_data.testing import train_tiny_bpe
from omni_data.write import main, write_dataset

WORDS = {  # key: (rate, seconds, left Hz, right Hz or None)
    "hello": (22050, 0.5, 440.0, None),
    "world": (44100, 0.4, 300.0, 700.0),
    "again": (22050, 0.3, 523.0, 659.0),
}


def _sine(f, n, rate):
    return 0.4 * np.sin(2 * np.pi * f * np.arange(n) / rate)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("mine")
    (d / "words").mkdir()
    for key, (rate, sec, fl, fr) in WORDS.items():
        n = int(rate * sec)
        chans = [_sine(fl, n, rate)] + ([_sine(fr, n, rate)] if fr else [])
        soundfile.write(d / "words" / f"{key}.ogg", np.stack(chans, 1), rate, format="OGG", subtype="VORBIS")
        (d / "words" / f"{key}.txt").write_text(f"the {key} sound")
    rgba = np.zeros((56, 84, 4), np.uint8)
    rgba[..., 0], rgba[..., 1], rgba[..., 2] = 200, 40, 10
    rgba[:, :42, 3], rgba[:, 42:, 3] = 255, 64  # left opaque, right mostly transparent
    Image.fromarray(rgba, "RGBA").save(d / "pic.rgba.png")  # a dot in the name: the key must not keep it
    Image.fromarray(rgba[..., :3]).convert("P").save(d / "pal.png")
    Image.fromarray(rgba[..., 0]).save(d / "grey.png")
    Image.fromarray(rgba[..., :3]).convert("CMYK").save(d / "ink.jpg")
    for name in ("pic.rgba", "pal", "grey", "ink"):
        (d / f"{name}.txt").write_text(f"a {name} picture")
    (d / "orphan.txt").write_text("no media of this name")
    (d / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    return d


def _copy(folder, tmp_path):
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def test_folder_to_shards_to_16k_mono_rgb(folder, tmp_path, capsys):
    out = tmp_path / "shards"
    assert main([str(folder), str(out), "--per-shard", "2"]) == 0
    printed = capsys.readouterr().out
    assert "audio: 3 samples in 2 shards" in printed and "image: 4 samples in 2 shards" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == {"audio": 3, "image": 4}
    assert manifest["skipped"] == {
        "text without a media file of the same name": ["orphan.txt"],
        "undecodable image (UnidentifiedImageError)": ["broken.png"],
    }
    with tarfile.open(out / "audio-000000.tar") as tf:
        names = sorted(tf.getnames())
        info = json.loads(tf.extractfile("words__again.json").read())
    assert names == sorted(f"words__{k}.{e}" for k in ("again", "hello") for e in ("json", "ogg", "txt"))
    assert info == {"path": "words/again.ogg", "num_frames": 6615, "sample_rate": 22050, "channels": 2}

    tok = train_tiny_bpe()
    reader = PayloadReader(tok)
    audio = list(
        WebDatasetSource(
            f"{out}/audio-{{000000..000001}}.tar", modality="audio", tokenizer=tok, sample_rate=16000
        )
    )
    assert sorted(m.key for m in audio) == [f"words__{k}" for k in sorted(WORDS)]
    for m in audio:
        rate, _, fl, fr = WORDS[m.key.removeprefix("words__")]
        n_in = soundfile.info(str(folder / "words" / f"{m.key[7:]}.ogg")).frames
        n = resampled_length(n_in, rate, 16000)
        assert m.sample_rate == 16000 and m.shape == (n,)
        assert m.media_tokens == AudioTokens().tokens(n, 16000)  # counted after resampling
        p = reader.read(m)
        assert p.sample_rate == 16000 and p.waveform.shape == (n,) and p.waveform.dtype.is_floating_point
        want = _sine(fl, n, 16000) if fr is None else (_sine(fl, n, 16000) + _sine(fr, n, 16000)) / 2
        inner = slice(400, n - 400)  # away from the codec's and the resampler's edge transients
        assert np.abs(p.waveform.numpy()[inner] - want[inner]).max() < 0.03, m.key
        assert p.text_ids.tolist() == tok.encode(f"the {m.key[7:]} sound").ids

    images = {m.key: m for m in WebDatasetSource(f"{out}/image-{{000000..000001}}.tar", modality="image")}
    assert sorted(images) == ["grey", "ink", "pal", "pic_rgba"]
    checked = 0
    for key, m in images.items():
        assert m.shape == (3, 56, 84) and m.media_tokens == ImageTokens().tokens(56, 84)
        x = PayloadReader().read(m).pixels
        assert x.shape == (3, 56, 84)
        a = np.where(np.arange(84) < 42, 255, 64)[None, :] / 255.0
        red = {"pic_rgba": 200 * a + 255 * (1 - a), "grey": np.full((1, 84), 200.0)}.get(key)
        if red is not None:  # composited over white (RGBA), or grey replicated (L)
            got = x[0].numpy().astype(np.float64) * 255
            assert np.abs(got - red).max() <= 1.0, key
            checked += 1
        else:  # palette and CMYK JPEG: converted, close to the source colour
            assert abs(float(x[0].mean()) * 255 - 200) < 12 and abs(float(x[2].mean()) * 255 - 10) < 12, key
    assert checked == 2


def test_manifest_jsonl_and_errors(folder, tmp_path):
    rows = [
        {"path": "words/hello.ogg", "transcript": "hello there", "key": "h1"},
        {"path": "pic.rgba.png", "caption": "a picture"},
        {"text": "just some text"},
        {"path": "missing.png", "text": "x"},
    ]
    man = _copy(folder, tmp_path) / "list.jsonl"  # a copy: the fixture folder stays as the others expect
    man.write_text("\n".join(json.dumps(r) for r in rows))
    report = write_dataset(None, str(tmp_path / "m"), manifest=man)
    assert dict(report.samples) == {"audio": 1, "image": 1, "text": 1}
    assert report.skipped == {"file not found": ["missing.png"]}
    tok = train_tiny_bpe()
    (t,) = list(WebDatasetSource(report.shards["text"], modality="text", tokenizer=tok))
    assert PayloadReader(tok).read(t).text_ids.tolist() == tok.encode("just some text").ids
    with pytest.raises(ValueError, match="not a folder"):
        write_dataset(tmp_path / "nope", str(tmp_path / "x"))
    assert main([str(tmp_path / "empty"), str(tmp_path / "y")]) == 2


def test_a_modality_whose_every_file_is_skipped_gets_no_shard(folder, tmp_path):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "hello.ogg").write_bytes((folder / "words" / "hello.ogg").read_bytes())
    (d / "sub" / "hello.txt").write_text("hello")
    (d / "broken.png").write_bytes((folder / "broken.png").read_bytes())
    (d / "sub" / "bad.png").write_bytes((folder / "pal.png").read_bytes())
    (d / "sub" / "bad.txt").write_bytes(b"caption \xff not utf-8")
    report = write_dataset(d, str(tmp_path / "out"))
    # no empty image shard for a config to point a source at: only the audio was written
    assert dict(report.samples) == {"audio": 1} and set(report.shards) == {"audio"}
    assert sorted(p.name for p in (tmp_path / "out").glob("*.tar")) == ["audio-000000.tar"]
    # every skipped file is named relative to the input folder, whatever the reason
    assert report.skipped == {
        "undecodable image (UnidentifiedImageError)": ["broken.png"],
        "text is not UTF-8": ["sub/bad.txt"],
    }


def test_a_csv_manifest_with_a_byte_order_mark_keeps_its_path_column(folder, tmp_path):
    # A spreadsheet's "CSV UTF-8" starts with a BOM: read as part of the first column's name, it hid the
    # `path` column, and every image row silently became a text sample of its caption.
    man = _copy(folder, tmp_path) / "sheet.csv"
    man.write_bytes(b"\xef\xbb\xbfpath,caption\r\npal.png,a palette picture\r\n")
    report = write_dataset(None, str(tmp_path / "m"), manifest=man)
    assert dict(report.samples) == {"image": 1} and report.skipped == {}
    (m,) = list(WebDatasetSource(report.shards["image"], modality="image"))
    assert m.key == "pal" and m.shape == (3, 56, 84)


def test_unknown_files_are_named_and_an_output_folder_inside_the_input_is_not_read(folder, tmp_path):
    d = _copy(folder, tmp_path)
    (d / "words" / "hello.doc").write_bytes(b"\0" * 64)  # not a format the loader reads
    (d / "notes.pdf").write_bytes(b"%PDF-1.4")
    first = write_dataset(d, str(d / "shards"))
    assert first.skipped["not an image, video, audio, .txt or .json file"] == ["notes.pdf", "words/hello.doc"]
    # the README's layout: the shards inside the input folder; a second run does not read them back
    again = write_dataset(d, str(d / "shards"))
    assert again.to_dict() == first.to_dict()


def test_media_without_a_caption_is_reported(tmp_path, capsys):
    """A media file with no ``.txt`` is written (it has no target text) and named in the summary."""
    d = tmp_path / "in"
    d.mkdir()
    for name in ("a", "b", "c"):
        Image.fromarray(np.full((8, 8, 3), 50, np.uint8)).save(d / f"{name}.png")
    (d / "a.txt").write_text("a caption")
    out = tmp_path / "shards"
    assert main([str(d), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "image: 3 samples" in printed
    assert "written without a caption or transcript 2 (no .txt of the same name): b.png, c.png" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["uncaptioned"] == ["b.png", "c.png"] and manifest["skipped"] == {}
