"""fsspec helpers: open a checkpoint URL, write durably, rename atomically, read byte ranges."""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

__all__ = ["CheckpointError", "atomic_write", "fsync_file", "join", "open_url", "read_ranges"]


class CheckpointError(RuntimeError):
    """A save or load failed: the message names the rank, file or tensor concerned."""


def open_url(url: str) -> tuple[AbstractFileSystem, str]:
    """``(filesystem, path)`` for any fsspec URL (``file://``, ``memory://``, ``s3://``, plain paths)."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/") or path


def join(path: str, name: str) -> str:
    return f"{path}/{name}"


def fsync_file(f: Any) -> None:
    """Flush ``f`` to stable storage where the filesystem has a file descriptor (local disks)."""
    f.flush()
    with contextlib.suppress(AttributeError, OSError, io.UnsupportedOperation, ValueError):
        os.fsync(f.fileno())


def _fsync_dir(fs: AbstractFileSystem, path: str) -> None:
    if "file" not in fs.protocol and "local" not in fs.protocol:
        return
    with contextlib.suppress(OSError):
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path.tmp``, make it durable, then rename it to ``path``.

    On object stores the rename is a copy of one object, which appears whole or not at all.
    """
    tmp = path + ".tmp"
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(tmp, "wb") as f:
        f.write(data)
        fsync_file(f)
    fs.mv(tmp, path)
    _fsync_dir(fs, path)


def read_ranges(
    fs: AbstractFileSystem,
    path: str,
    ranges: list[tuple[int, int]],
    gap: int = 1 << 20,
    max_read: int = 64 << 20,
) -> list[memoryview]:
    """Read byte ranges ``[start, end)`` of one file, coalescing ranges closer than ``gap`` bytes into
    reads of at most ``max_read`` bytes (a single longer range is read alone).

    Returns one memoryview per requested range, in the order given.

    Raises:
        CheckpointError: the file is shorter than a range (truncated data file).
    """
    order = sorted(range(len(ranges)), key=lambda i: ranges[i])
    out: list[memoryview | None] = [None] * len(ranges)
    with fs.open(path, "rb") as f:
        i = 0
        while i < len(order):
            lo, hi = ranges[order[i]]
            j = i + 1
            while j < len(order) and ranges[order[j]][0] <= hi + gap and ranges[order[j]][1] - lo <= max_read:
                hi = max(hi, ranges[order[j]][1])
                j += 1
            f.seek(lo)
            buf = bytearray(hi - lo)
            got = f.readinto(buf) if hasattr(f, "readinto") else None
            if got is None:
                data = f.read(hi - lo)
                got = len(data)
                buf[:got] = data
            if got != hi - lo:
                raise CheckpointError(
                    f"{path}: truncated, wanted bytes [{lo}, {hi}) but the file ends at {lo + got}"
                )
            view = memoryview(buf)
            for k in order[i:j]:
                a, b = ranges[k]
                out[k] = view[a - lo : b - lo]
            i = j
    return out  # type: ignore[return-value]
