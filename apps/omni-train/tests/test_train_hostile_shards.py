"""Hostile media through ``make-shards`` and through a whole training run.

- ``omni-train make-shards`` on a folder with NaN, Inf and absurdly loud float WAVs, a WAV of no frames, a
  PNG declaring 50,000 x 50,000 pixels, a 0-byte and a 0 x 0 PNG and a truncated PNG: each is skipped and
  named with its reason in the command's output and ``manifest.json``; the shards hold only the good files.
- A 2-process run (pp=2) on shards that hold all of these plus tar members named ``../../x.png`` and
  ``/abs/x.png``, a symbolic and a hard link: every loss is finite (before: NaN from the first step that
  drew a NaN clip, the audio loss first), each hostile item is counted per reason in ``metrics.jsonl``
  and ``summary.json`` and named there (shard and member, or sample key), and nothing is written outside
  the run.

Reference: the damage is placed by hand at known names, so the expected reasons and keys are known; the
per-step counts must add up to the summary's totals.
"""

import json
import math
import tarfile
from pathlib import Path

import numpy as np
from train_fixtures import make_dataset, write_config

from omni_data.testing import (
    declared_png,
    float_wav,
    hostile_media_folder,
    hostile_waves,
    solid_png,
    write_tar,
)
from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.cli import main


def _waves() -> dict[str, np.ndarray]:
    """0.25 s at 22.05 kHz (resampled to the encoder's 16 kHz): the poisons, then good clips."""
    waves = hostile_waves(inf_at=100)
    ok = waves.pop("ok")
    return {**waves, "ok0": ok, "ok1": ok[::-1].copy()}


def test_make_shards_names_hostile_media(tmp_path, capsys):
    src = tmp_path / "in"
    hostile_media_folder(src, _waves(), caption="a caption of")
    assert main(["make-shards", str(src), str(tmp_path / "shards")]) == 0
    err = capsys.readouterr().err
    want = {
        "non-finite audio samples": ["a_inf.wav", "a_nan.wav", "a_one_ninf.wav"],
        "audio amplitude over 65536": ["a_loud.wav"],
        "image over the pixel limit": ["bomb.png"],
        "empty file": ["empty.png"],
        "empty image": ["zero.png"],
    }
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["skipped"] == want and manifest["samples"] == {"audio": 2, "image": 1}
    for reason, names in want.items():
        assert f"omni-train: skipped {len(names)} ({reason}): {', '.join(names)}" in err, err
    assert main(["make-shards", str(src), str(tmp_path / "x"), "--max-image-pixels", "100"]) == 0
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert manifest["skipped"]["image over the pixel limit"] == ["bomb.png", "ok.png"]


def _hostile_shards(d: Path) -> None:
    """``image-900.tar``: traversal names, links and image bombs first, then good images;
    ``audio-900.tar``: an empty WAV and the poisoned clips first, then good ones."""
    good = solid_png(30, 40)
    images = [
        ("../../x.png", good),
        ("../../x.txt", b"red cat"),
        ("/abs/x.png", good),
        ("lnk.png", tarfile.SYMTYPE, "/etc/passwd"),
        ("hard.png", tarfile.LNKTYPE, "../../x.png"),
    ]
    for key, data in (("bomb", declared_png(50_000, 50_000)), ("empty", b""), ("zero", declared_png(0, 0))):
        images += [(f"{key}.png", data), (f"{key}.txt", b"red cat")]
    for i in range(8):
        images += [(f"img{i}.png", solid_png(20 + 4 * i, 40)), (f"img{i}.txt", b"a red square")]
    write_tar(d / "image-900.tar", images)
    clips = {"silent": np.zeros(0), **_waves()}
    for i in range(4):
        clips[f"ok{i + 2}"] = _waves()["ok0"]
    write_tar(
        d / "audio-900.tar",
        [
            m
            for key, w in clips.items()
            for m in ((f"{key}.wav", float_wav(w, 22050)), (f"{key}.txt", b"blue dog"))
        ],
    )


def _train(rank, world_size, cfg, out):
    from omni_train.trainer import Trainer

    Trainer(cfg, Path(out), resume=False).run()


def test_run_on_hostile_shards_has_finite_losses_and_names_every_skip(tmp_path):
    data = make_dataset(tmp_path / "data", n_image=0, n_audio=0, n_text=16)
    _hostile_shards(tmp_path / "data")
    data["image"], data["audio"] = str(tmp_path / "data/image-900.tar"), str(tmp_path / "data/audio-900.tar")
    cfg = load_config(str(write_config(tmp_path / "c.toml", data, steps=3, every=0)))
    before = {p for p in tmp_path.parent.parent.rglob("x.png")}
    run_world(_train, 2, args=(cfg, str(tmp_path / "run")), timeout_s=300)

    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert math.isfinite(r["loss"]) and all(math.isfinite(v) for v in r["loss_per_modality"].values()), r
    assert any("audio" in r["loss_per_modality"] for r in rows)
    skipped = json.loads((tmp_path / "run/summary.json").read_text())["skipped"]
    shard = str(tmp_path / "data/image-900.tar")
    # once per walk of the shard (the source cycles: each epoch meets them again)
    walks = skipped["metadata"]["image"]["absolute member name"]
    assert walks >= 1 and skipped["metadata"]["image"] == {
        "'..' in member name": 2 * walks,
        "absolute member name": walks,
        "symbolic link member": walks,
        "hard link member": walks,
        "image over the pixel limit": walks,
        "empty file": walks,
        "empty image": walks,
    }
    keys = {tuple(k) for src in skipped["keys"].values() for k in src}
    for name, reason in (
        ("../../x.png", "'..' in member name"),
        ("../../x.txt", "'..' in member name"),
        ("/abs/x.png", "absolute member name"),
        ("lnk.png", "symbolic link member"),
        ("hard.png", "hard link member"),
    ):
        assert any(
            k.startswith(f"shard:{shard}@") and k.endswith(f":{name}") and r == reason for k, r in keys
        )
    assert {("bomb", "image over the pixel limit"), ("empty", "empty file"), ("zero", "empty image")} <= keys
    assert set(skipped["metadata"]["audio"]) == {"empty audio"} and ("silent", "empty audio") in keys
    # the poisoned clips the run drew (it draws them first) were refused at payload time, each named
    payload = skipped["payload"]["audio"]
    assert payload.get("non-finite audio samples", 0) >= 1, payload
    assert set(payload) <= {"non-finite audio samples", "audio amplitude over 65536"}
    assert ("audio/nan", "non-finite audio samples") in keys
    assert sum(r["skipped_payloads"] for r in rows) == sum(payload.values())
    # per step: the counts add up to the totals
    per_step: dict[str, int] = {}
    for r in rows:
        for name, n in r["skipped"].items():
            per_step[name] = per_step.get(name, 0) + n
    flat = {
        f"{src}/{reason}": n
        for scope in ("metadata", "payload")
        for src, by_reason in skipped[scope].items()
        for reason, n in by_reason.items()
    }
    assert per_step == flat
    # nothing written outside the run (the loader never extracts: no x.png appeared anywhere near)
    assert {p for p in tmp_path.parent.parent.rglob("x.png")} == before and not Path("/abs").exists()
