"""CRC-32C (Castagnoli) checksums of checkpoint bytes, per fixed-size chunk of each box.

CRC-32C (RFC 3720 §B.4) through the ``crc32c`` package, which uses the SSE4.2 / ARMv8 CRC instructions
(about 13 GB/s per core here, against 2.4 GB/s for ``zlib.crc32``) and releases the GIL on large buffers,
so the writer and reader threads checksum in parallel. Like any CRC-32 it detects every error burst of at
most 32 bits, so every single-bit flip.
"""

from __future__ import annotations

import crc32c as _crc32c

__all__ = ["ALGORITHM", "chunk_count", "crc", "crc_into"]

ALGORITHM = "crc32c"
_RELEASE_GIL_BYTES = 64 << 10


def crc(data: memoryview | bytes, value: int = 0) -> int:
    """CRC-32C of the buffer ``data``, continuing from ``value`` (the CRC of the bytes before it).

    The GIL is released for buffers of 64 KiB and more (threads checksum in parallel) and kept for
    smaller ones, so a box of 64 bytes costs no thread hand-off behind a busy caller.
    """
    return _crc32c.crc32c(data, value, gil_release_mode=int(len(data) >= _RELEASE_GIL_BYTES))


def chunk_count(length: int, chunk: int) -> int:
    """Checksum chunks of a box of ``length`` bytes (an empty box has one, the CRC of no bytes)."""
    return max(1, -(-length // chunk))


def crc_into(crcs: list[int], view: memoryview, lo: int, chunk: int) -> None:
    """Fold bytes ``[lo, lo + len(view))`` of a box into its running per-chunk CRCs ``crcs``.

    A chunk split over several calls must get them in byte order (the CRC continues from the last).
    """
    hi = lo + len(view)
    if hi <= chunk:  # all in the first chunk (every small box): one call
        crcs[0] = crc(view, crcs[0])
        return
    a, c = lo, lo // chunk
    while a < hi:  # nothing to fold for no bytes: the CRC of nothing is the initial 0
        b = min(hi, (c + 1) * chunk)
        crcs[c] = crc(view[a - lo : b - lo], crcs[c])
        a, c = b, c + 1
