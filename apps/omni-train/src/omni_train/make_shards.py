"""``omni-train make-shards``: your own media -> omni-data shards -> the config lines that train on them.

:func:`omni_data.write.write_dataset` turns a folder of images, videos or audio with same-named ``.txt``
captions or transcripts (or a CSV/JSONL manifest) into ``OUT/{image,audio,text,video}-NNNNNN.tar`` with
metadata; this
module adds what the trainer needs: the ``[[data.sources]]`` and ``[[data.mixture]]`` TOML lines for
those shards (weights proportional to the sample counts, so each sample is drawn about equally often), and
optionally a whole run config, the default recipe's model and training settings with those lines as its
data (:func:`write_run_config`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from omni_data.write import WriteReport
from omni_train.binder import config_path

__all__ = ["data_toml", "write_run_config"]


def data_toml(report: WriteReport, out: str, *, config_dir: Path | None = None) -> str:
    """``[[data.sources]]`` (one per modality written, named after it) and one ``[[data.mixture]]`` phase.

    Args:
        report: what ``write_dataset`` wrote.
        out: the shard folder (or fsspec URL) given to it.
        config_dir: the folder of the config the lines go into: local ``urls`` are written relative to it
            (the trainer resolves them against the config file's folder); ``None``: absolute.
    """
    lines, weights = [], []
    total = sum(report.samples.values())
    for modality in sorted(report.shards):
        if "://" in out:
            folder = out.rstrip("/")
        elif config_dir is not None:
            folder = os.path.relpath(Path(out).resolve(), config_dir.resolve())
        else:
            folder = str(Path(out).resolve())
        folder = Path(folder).as_posix() if "://" not in folder else folder
        lines += [
            "[[data.sources]]",
            f"name = {_toml_string(modality)}",
            f"modality = {_toml_string(modality)}",
            f"urls = {_toml_string(f'{folder}/{modality}-*.tar')}",
            "",
        ]
        # 4 significant digits, not decimals: a small modality (1 of 3,000) keeps a non-zero weight
        weights.append(f"{modality} = {float(f'{report.samples[modality] / total:.4g}')!r}")
    lines += ["[[data.mixture]]", f"weights = {{ {', '.join(weights)} }}", ""]
    return "\n".join(lines)


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string: quote, backslash and control characters escaped (TOML 1.0)."""
    short = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
    out = (short.get(c) or (f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in text)
    return '"' + "".join(out) + '"'


def write_run_config(path: Path, data: str, *, base: str = "omni-tiny") -> Path:
    """Write a run config at ``path``: the bundled config ``base`` (model, parallel, optim, checkpoint,
    train) with its ``[[data.sources]]`` and ``[[data.mixture]]`` tables replaced by ``data``. When ``data``
    has a video source and the base's ``[model.vit]`` sets no ``temporal_patch``, it gets
    ``temporal_patch = 2``: videos in 2-frame patches, the ViT's Qwen2-VL video path (images unchanged in
    meaning: a still image is its frame twice).

    Raises:
        ConfigError: ``base`` is not a bundled config or an existing TOML file.
    """
    text = config_path(base).read_text()
    video = re.search(r'^modality = "video"$', data, re.MULTILINE) is not None
    video &= re.search(r"^\s*temporal_patch\s*=", text, re.MULTILINE) is None
    kept, skipping = [], False
    for line in text.splitlines():
        header = re.match(r"\s*\[", line)
        if header:
            skipping = line.strip() in ("[[data.sources]]", "[[data.mixture]]")
        if not skipping:
            kept.append(line)
        if video and line.strip() == "[model.vit]":
            kept.append(
                "temporal_patch = 2  # videos in 2-frame patches (Qwen2-VL); an image is its frame twice"
            )
    body = "\n".join(kept).lstrip("\n")
    while body.startswith("#"):  # the base's comments describe its own data
        body = body.split("\n", 1)[1] if "\n" in body else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# written by omni-train make-shards: the {base} model and training settings, your data\n\n"
        f"{body.strip()}\n\n{data}"
    )
    return path
