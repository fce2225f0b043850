"""The bundled dataset: WebDataset shards, the tokenizer and the build manifest, shipped in the package.

Built by `omni-train prepare-data` (see `omni_train.prepare`); origins and licenses in DATA_SOURCES.md.
Layout: `shards/{image,audio,text,video}-NNNNNN.tar`, `tokenizer.json`, `manifest.json` (counts per source).
"""

from __future__ import annotations

from pathlib import Path

# shard name prefixes are omni_data's modality names, equal to each sample's `modality` field
from omni_data import Modality

__all__ = ["DATA_DIR", "MANIFEST_PATH", "SHARDS_DIR", "TOKENIZER_PATH", "Modality", "shard_paths"]

DATA_DIR = Path(__file__).resolve().parent
SHARDS_DIR = DATA_DIR / "shards"
TOKENIZER_PATH = DATA_DIR / "tokenizer.json"
MANIFEST_PATH = DATA_DIR / "manifest.json"


def shard_paths(modality: Modality | str, root: Path = SHARDS_DIR) -> list[Path]:
    """The shards of one modality under `root`, in order, e.g. [.../image-000000.tar, ...].

    Args:
        modality: image, audio, text or video (`omni_data.Modality`).
        root: the shard folder (default: the bundled shards).

    Raises:
        ValueError: when `modality` is not one of image, audio, text, video.
        FileNotFoundError: when `root` holds no shard of that modality.
    """
    modality = Modality(modality)
    paths = sorted(root.glob(f"{modality}-[0-9][0-9][0-9][0-9][0-9][0-9].tar"))
    if not paths:
        raise FileNotFoundError(f"no {modality}-NNNNNN.tar shards under {root}; run `omni-train prepare-data`")
    return paths
