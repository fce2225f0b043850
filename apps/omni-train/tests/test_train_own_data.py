"""The README's "Train on your own data" steps, as written: a folder of spoken-word OGG files at 22.05 and
44.1 kHz (mono and stereo) and RGBA PNGs, each with a ``.txt`` transcript or caption, becomes shards and a
config with one ``make-shards`` command, and the README's first ``run`` command trains the default model
on it (finite losses, image and audio targets, a summary written). The commands are read from the README,
so a README that drifts from the CLI fails here."""

import json
import math
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image

from omni_train.cli import main

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"
WORDS = ["cat", "dog", "sun", "moon", "tree", "bird"]


def _commands() -> list[list[str]]:
    text = README.read_text()
    section = text[text.index("## Train on your own data") : text.index("## Configs")]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines() if line.strip()]
    assert all(line.startswith("uv run omni-train ") for line in lines), lines
    return [shlex.split(line)[3:] for line in lines]


def _my_data(root: Path) -> None:
    """Step 1 of the README: media with same-named .txt files in ``my_data``."""
    root.mkdir()
    for i, word in enumerate(WORDS):
        rate = (22050, 44100)[i % 2]
        t = np.arange(int(rate * (0.3 + 0.1 * i))) / rate
        wave = 0.3 * np.sin(2 * np.pi * (180 + 40 * i) * t) * np.hanning(t.size)
        if i % 3 == 0:
            wave = np.stack([wave, 0.5 * wave], axis=1)  # stereo
        soundfile.write(root / f"{word}.ogg", wave.astype(np.float32), rate, format="OGG", subtype="VORBIS")
        (root / f"{word}.txt").write_text(word)
        rgba = np.zeros((40 + 9 * i, 64 - 4 * i, 4), np.uint8)
        rgba[..., i % 3], rgba[..., 3] = 200, np.linspace(0, 255, rgba.shape[1], dtype=np.uint8)
        Image.fromarray(rgba, "RGBA").save(root / f"picture_of_a_{word}.png")
        (root / f"picture_of_a_{word}.txt").write_text(f"a drawing of a {word}")


def test_readme_own_data_steps(tmp_path, monkeypatch, capsys):
    make, first_run, full_run = _commands()
    assert make[0] == "make-shards" and first_run[0] == full_run[0] == "run"
    assert "--max-steps" in first_run and "--max-steps" not in full_run  # then the config's own steps
    monkeypatch.chdir(tmp_path)
    _my_data(tmp_path / "my_data")

    assert main(make) == 0
    toml = capsys.readouterr().out
    assert toml.count("[[data.sources]]") == 2 and "[[data.mixture]]" in toml
    cfg_path = Path(make[make.index("--write-config") + 1])
    cfg = tomllib.loads(cfg_path.read_text())
    assert {s["name"]: s["urls"] for s in cfg["data"]["sources"]} == {
        "audio": "shards/audio-*.tar",  # relative to run.toml's folder
        "image": "shards/image-*.tar",
    }
    manifest = json.loads((tmp_path / "my_data/shards/manifest.json").read_text())
    assert manifest["samples"] == {"audio": 6, "image": 6} and manifest["skipped"] == {}

    exe = [sys.executable, "-m", "omni_train.cli", *first_run]
    done = subprocess.run(exe, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (tmp_path / "runs").glob("run-*")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = int(first_run[first_run.index("--max-steps") + 1])
    assert [r["step"] for r in rows] == list(range(steps)) and all(math.isfinite(r["loss"]) for r in rows)
    assert sum(r["targets_per_modality"]["audio"] for r in rows) > 0
    assert sum(r["targets_per_modality"]["image"] for r in rows) > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["skipped"]["total"] == 0 and summary["skipped_payloads"] == 0
