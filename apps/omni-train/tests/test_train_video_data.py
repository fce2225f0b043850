"""Video data in the app: `prepare-data --source video` rebuilds the committed video shards byte for byte,
and `make-shards` turns a folder of videos into video shards and a run config whose video source reads
them."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import webdataset as wds

from omni_data import ImageTokens, VideoTokens, WebDatasetSource
from omni_data.testing import image_samples, video_samples
from omni_train.cli import main
from omni_train.data import shard_paths
from omni_train.prepare import main as prepare_main
from omni_train.prepare.bundled import missing_video_inputs


def _by_key(paths: list[Path]) -> dict[str, dict]:
    ds = wds.WebDataset([str(p) for p in paths], shardshuffle=False, empty_check=False)
    return {s["__key__"]: dict(s) for s in ds}


def test_video_slice_rebuild_equals_committed_clips(tmp_path):
    missing = missing_video_inputs()
    if missing:
        pytest.skip("video rebuild needs its inputs: " + "; ".join(str(e) for e in missing))
    assert prepare_main(["--source", "video", "--limit", "1", "--out", str(tmp_path)]) == 0
    committed = _by_key(shard_paths("video"))
    rebuilt = _by_key(shard_paths("video", tmp_path / "shards"))
    assert sorted(rebuilt) == ["bigbuckbunny-000", "megamind-000", "tree-000", "vtest-000"]
    for key, sample in rebuilt.items():
        # the same bytes: PyAV/FFmpeg decode, PIL resize and the bit-exact single-thread mpeg4 encode
        assert {k: sample[k] for k in ("mp4", "txt", "json")} == {
            k: committed[key][k] for k in ("mp4", "txt", "json")
        }, key


def test_make_shards_turns_a_folder_of_videos_into_a_video_source(tmp_path, capsys):
    folder = tmp_path / "media"
    folder.mkdir()
    for i, s in enumerate(video_samples(2, seed=7, frames=(4, 8))):
        (folder / f"clip{i}.mp4").write_bytes(s["mp4"])
        (folder / f"clip{i}.txt").write_text(s["txt"])
    for i, s in enumerate(image_samples(2, seed=7)):
        (folder / f"pic{i}.png").write_bytes(s["png"])
        (folder / f"pic{i}.txt").write_text(s["txt"])
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom" + bytes(range(256)))
    out, run = tmp_path / "shards", tmp_path / "run.toml"
    assert main(["make-shards", str(folder), str(out), "--write-config", str(run)]) == 0
    err = capsys.readouterr().err
    assert "video: 2 samples in 1 shards" in err and "broken.mp4" in err  # the damaged clip named
    data = tomllib.loads(run.read_text())["data"]
    assert [(s["name"], s["modality"]) for s in data["sources"]] == [("image", "image"), ("video", "video")]
    assert data["mixture"][0]["weights"] == {"image": 0.5, "video": 0.5}
    vt = VideoTokens(
        fps=2.0, min_frames=2, max_frames=4, frame=ImageTokens(min_pixels=28 * 28, max_pixels=56 * 56)
    )
    metas = list(WebDatasetSource(str(out / "video-000000.tar"), modality="video", video_tokens=vt))
    # frames counted by decoding each clip whole when the shard was written
    assert [(m.key, m.frames) for m in metas] == [
        (f"clip{i}", json.loads(s["json"])["frames"])
        for i, s in enumerate(video_samples(2, seed=7, frames=(4, 8)))
    ]
