"""Deterministic WebDataset shard writing: fixed member order, owner and mtime, no timestamps."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import webdataset as wds

__all__ = ["SHARD_MTIME", "encode_json", "per_shard", "write_shards"]

# 2000-01-01T00:00:00Z: every member of every tar gets this mtime, so rebuilding gives identical
# tar headers (webdataset stamps the current time otherwise). An int: tarfile writes a float mtime
# as an extra 1 KB PAX header per member.
SHARD_MTIME = 946_684_800
# WebDataset splits a member name at its first dot into key and extension, so a key with a dot (or a
# slash) would come back as another key: keys are restricted to these characters.
_KEY = re.compile(r"[A-Za-z0-9_-]+")


def encode_json(meta: Mapping[str, Any]) -> bytes:
    """Metadata as UTF-8 JSON with sorted keys (byte-stable across rebuilds)."""
    return json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")


def write_shards(out_dir: Path, prefix: str, samples: Iterable[dict[str, Any]], per_shard: int) -> list[Path]:
    """Write samples into tar shards `<prefix>-000000.tar`, ... of `per_shard` samples each under `out_dir`.

    Older `<prefix>-*.tar` files in `out_dir` are removed first, so no stale shard survives a smaller
    rebuild. Samples keep their order and are streamed (never all in memory); each is a dict of
    `__key__` (letters, digits, `_`, `-`) and extension -> bytes.

    Args:
        out_dir: folder for the shards (created if missing).
        prefix: modality name, e.g. "image".
        samples: the samples.
        per_shard: samples per shard (the last shard may hold fewer).

    Returns:
        The shard paths written, in order (none when `samples` is empty).

    Raises:
        ValueError: when a sample has no `__key__`, a key repeats or holds other characters than
            letters, digits, `_` and `-`, or `per_shard` < 1.
    """
    if per_shard < 1:
        raise ValueError(f"{prefix}: per_shard must be >= 1, got {per_shard}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(f"{prefix}-*.tar"):
        stale.unlink()
    seen: set[str] = set()
    with wds.ShardWriter(
        str(out_dir / f"{prefix}-%06d.tar"),
        maxcount=per_shard,
        verbose=0,
        mtime=SHARD_MTIME,
        user="omni",
        group="omni",
        mode=0o444,
        encoder=False,
    ) as sink:
        for i, sample in enumerate(samples):
            key = sample.get("__key__")
            if not isinstance(key, str) or not _KEY.fullmatch(key):
                raise ValueError(
                    f"{prefix} sample {i}: __key__ {key!r} must be a non-empty string of letters, "
                    "digits, '_' and '-' (WebDataset cuts keys at the first '.')"
                )
            if key in seen:
                raise ValueError(f"duplicate sample key {key!r} in {prefix} shards")
            seen.add(key)
            sink.write(sample)
    paths = sorted(out_dir.glob(f"{prefix}-*.tar"))
    if not seen:  # ShardWriter opens its first tar before any write: drop that empty file
        for path in paths:
            path.unlink()
        return []
    return paths


def per_shard(count: int, num_shards: int) -> int:
    """Samples per shard that spread `count` samples over `num_shards` shards (at least 1).

    Raises:
        ValueError: when `num_shards` < 1.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return max(1, math.ceil(count / num_shards))
