"""Where a run config's files are: the bundled data, the folder relative paths resolve against, the
tokenizer and the shards a source pattern names."""

from __future__ import annotations

import glob
import os
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer

from omni_train.config import DataConfig, RunConfig

__all__ = [
    "bundled_data_dir",
    "data_root",
    "expand_urls",
    "load_tokenizer",
    "tokenizer_candidates",
    "tokenizer_path",
]


def bundled_data_dir() -> Path:
    """The directory holding the bundled tokenizer and shards (``omni_train/data``)."""
    return Path(str(resources.files("omni_train") / "data"))


def tokenizer_path(data: DataConfig) -> Path:
    """The tokenizer file ``data.tokenizer`` names (relative paths are inside the bundled data directory;
    :func:`omni_train.binder.load_config` has already made a path relative to the config file's folder absolute)."""
    p = Path(data.tokenizer)
    return p if p.is_absolute() else bundled_data_dir() / p


def load_tokenizer(data: DataConfig) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` at :func:`tokenizer_path`.

    Raises:
        Exception: ``tokenizers``' own, for a missing or unreadable file.
    """
    return Tokenizer.from_file(str(tokenizer_path(data)))


def tokenizer_candidates(cfg: RunConfig) -> list[Path]:
    """Where ``data.tokenizer`` is looked for, in order: itself if absolute; else the config file's
    folder (as relative ``urls`` are; not for a bundled config), then the bundled data directory (the
    bundled tokenizer names)."""
    p = Path(cfg.data.tokenizer)
    if p.is_absolute():
        return [p]
    root = data_root(cfg)
    return [root / p] + ([bundled_data_dir() / p] if root != bundled_data_dir() else [])


def data_root(cfg: RunConfig) -> Path:
    """The folder relative ``data.sources[*].urls`` resolve against: the config file's folder, or the
    bundled data directory for a bundled config (and for a config with no file)."""
    if not cfg.source:
        return bundled_data_dir()
    path = Path(cfg.source).resolve()
    bundled = Path(str(resources.files("omni_train") / "configs")).resolve()
    return bundled_data_dir() if path.parent == bundled else path.parent


def expand_urls(pattern: str, root: str | os.PathLike[str] | None = None) -> list[str]:
    """Concrete shard URLs for a source pattern.

    Args:
        pattern: a glob, a brace pattern (``image-{000..003}.tar``), or an fsspec URL of either.
        root: the folder a relative local pattern is relative to (:func:`data_root`; default the bundled
            data directory).

    Brace patterns are passed through (absolute) for omni-data to expand; local globs and fsspec globs
    are listed here, sorted.
    """
    if "://" in pattern and not pattern.startswith("file://"):
        import fsspec

        fs, _, paths = fsspec.get_fs_token_paths(pattern)
        return sorted(fs.unstrip_protocol(p) for p in paths)
    local = pattern.removeprefix("file://")
    if not os.path.isabs(local):
        local = str(Path(root if root is not None else bundled_data_dir()) / local)
    if "{" in local:
        return [local]
    return sorted(p for p in glob.glob(local) if os.path.isfile(p))  # a folder is not a shard
