"""`prepare-data --source tuxpaint` on a small slice (GPL data: built into tmp, never committed)."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest
import soundfile as sf
import webdataset as wds

from omni_train.data import shard_paths
from omni_train.prepare import main
from omni_train.prepare.tuxpaint import DEFAULT_STAMPS_ROOT

LIMIT = 4


def test_tuxpaint_slice(tmp_path):
    if not DEFAULT_STAMPS_ROOT.is_dir():
        pytest.skip("needs Debian tuxpaint-stamps-default (apt-get install -y tuxpaint-stamps-default)")
    if importlib.util.find_spec("soxr") is None:
        pytest.skip("needs the soxr resampler (pip install soxr)")
    assert main(["--source", "tuxpaint", "--limit", str(LIMIT), "--out", str(tmp_path)]) == 0
    images = list(
        wds.WebDataset([str(p) for p in shard_paths("image", tmp_path / "shards")], shardshuffle=False)
    )
    audio = list(
        wds.WebDataset([str(p) for p in shard_paths("audio", tmp_path / "shards")], shardshuffle=False)
    )
    assert len(images) == LIMIT and len(audio) == LIMIT
    image_keys = {s["__key__"] for s in images}
    for s in audio:
        meta = json.loads(s["json"])
        assert (
            meta["human"] is True
            and meta["license"] == "GPL-2.0-or-later"
            and meta["image_key"] in image_keys
        )
        # reference: the stamp's own description file, read line by line
        stem = _stamp_txt(meta["image_key"])
        lines = stem.read_text("utf-8").splitlines()
        lang = meta["language"]
        expected = (
            lines[0].strip()
            if lang == "en"
            else next(line.split("=", 1)[1].strip() for line in lines if line.startswith(f"{lang}.utf8="))
        )
        assert s["txt"].decode() == expected, s["__key__"]
        info = sf.info(io.BytesIO(s["flac"]))
        assert (info.samplerate, info.channels, info.frames) == (16000, 1, meta["num_frames"])
        original = sf.info(stem.with_name(f"{stem.stem}_desc{'' if lang == 'en' else '_' + lang}.ogg"))
        assert abs(info.frames - original.frames * 16000 / original.samplerate) <= 2
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["counts"]["image"] == LIMIT and manifest["license"] == "GPL-2.0-or-later"


def _stamp_txt(image_key: str) -> Path:
    # keys are `tuxpaint-<folders>-<name>`; names may contain '-', so match against the files
    for txt in sorted(DEFAULT_STAMPS_ROOT.rglob("*.txt")):
        if "tuxpaint-" + "-".join(txt.relative_to(DEFAULT_STAMPS_ROOT).with_suffix("").parts) == image_key:
            return txt
    raise AssertionError(f"no stamp description for {image_key}")
