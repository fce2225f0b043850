"""Compressed WebDataset shards: gzip read as a seekable tar stream, other compressions refused by name.

A shard is recognised by its first bytes, not its name (a ``.tar`` that is gzip is read as gzip, a
``.tgz`` that is plain tar as tar): gzip (``1f 8b``) is supported; zstd (``28 b5 2f fd``), bzip2
(``BZh``) and xz (``fd 37 7a 58 5a 00``) raise :class:`UnsupportedCompressionError`, a configuration
error that names the file, never counted as damaged data.

:class:`GzipShard` makes the decompressed stream look like a seekable binary file, so the tar header walk
(:func:`omni_data.tar_index.iter_members`), the resume positions and every :class:`~omni_data.sample.
MemberRef` speak offsets in the *decompressed* tar, exactly as for a plain shard. Deflate has no random
access: reaching byte ``x`` means inflating everything before it. The handle therefore keeps
checkpoints of the inflater (``zlib.Decompress.copy()``: the 32 KiB window and the bit position) every
``span`` decompressed bytes as it reads forward; a seek backwards restarts from the nearest checkpoint
at or before the target (at most ``span`` bytes re-inflated), a seek forwards inflates and discards.
The checkpoints live in the handle (about 40 KiB each, in memory), not on disk and not shared between
handles: the metadata pass reads a shard once front to back, and a payload reader's handle builds its
own as it goes (README "Compressed shards" compares the other designs).
"""

from __future__ import annotations

import io
import zlib
from typing import Any, BinaryIO

from fsspec.implementations.local import LocalFileSystem

__all__ = ["GzipShard", "UnsupportedCompressionError", "compression_of", "shard_head", "wrap_compressed"]

GZIP_MAGIC = b"\x1f\x8b"
# other compressions seen on WebDataset corpora, refused by name
_REFUSED = (
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"BZh", "bzip2"),
    (b"\xfd\x37\x7a\x58\x5a\x00", "xz"),
)
_CHUNK = 1 << 16  # compressed bytes read at a time
_PIECE = 1 << 20  # most decompressed bytes produced by one inflate call (bounds memory on zero runs)


class UnsupportedCompressionError(RuntimeError):
    """A shard compressed with something omni-data does not read (zstd, bzip2, xz). A configuration
    error, not damage: raised, never skipped. ``url`` and ``compression`` name the file and the format."""

    def __init__(self, url: str, compression: str) -> None:
        super().__init__(
            f"{url}: {compression}-compressed shard: not supported; store shards as plain .tar or "
            f"gzip (.tar.gz / .tgz), e.g. `{_recompress(compression)}`"
        )
        self.url = url
        self.compression = compression


def _recompress(compression: str) -> str:
    tool = {"zstd": "zstd -dc", "bzip2": "bzip2 -dc", "xz": "xz -dc"}[compression]
    return f"{tool} SHARD > SHARD.tar"


def compression_of(head: bytes) -> str | None:
    """The compression a shard's first bytes (at least 6) announce: ``"gzip"``, ``"zstd"``, ``"bzip2"``,
    ``"xz"``, or ``None`` (anything else, read as a plain tar)."""
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    for magic, name in _REFUSED:
        if head.startswith(magic):
            return name
    return None


def shard_head(f: Any) -> bytes:
    """The first 6 bytes of the open file ``f``, leaving it at byte 0. For a remote fsspec file, one
    6-byte range request (``fs.cat_file``), not a read through the file, which would fetch a whole
    read-ahead block (5 MiB by default) from the start of the shard."""
    fs, path = getattr(f, "fs", None), getattr(f, "path", None)
    if fs is not None and isinstance(path, str) and not isinstance(fs, LocalFileSystem):
        # S3 refuses a range that starts past an object's end (HTTP 416, an OSError): an empty shard
        # would read as a failing one instead of an empty one
        size = getattr(f, "size", None)
        if isinstance(size, int) and size < 6:
            return bytes(fs.cat_file(path, start=0, end=size)) if size > 0 else b""
        return bytes(fs.cat_file(path, start=0, end=6))
    head = f.read(6)
    f.seek(0)
    return head


def wrap_compressed(f: Any, url: str, *, span: int = 4 << 20) -> Any:
    """``f`` (a seekable binary handle at byte 0) as a handle on the tar it holds: ``f`` itself for a
    plain file, a :class:`GzipShard` over it for gzip.

    Raises:
        UnsupportedCompressionError: the file is zstd, bzip2 or xz (``f`` is closed).
    """
    kind = compression_of(shard_head(f))
    if kind is None:
        return f
    if kind == "gzip":
        return GzipShard(f, url, span=span)
    f.close()
    raise UnsupportedCompressionError(url, kind)


class GzipShard(io.RawIOBase):
    """A read-only, seekable view of the decompressed bytes of a gzip file (one or more members,
    RFC 1952), over a seekable compressed handle ``raw`` that it owns and closes.

    Args:
        raw: the compressed file, seekable, positioned anywhere.
        url: for messages.
        span: decompressed bytes between inflater checkpoints (>= 64 KiB): a backward seek re-inflates at
            most this much; memory is about 40 KiB per checkpoint.

    Attributes:
        size: decompressed length in bytes once the end of the stream has been reached, else ``None``.
        damage: ``None``, or what ended the stream early (cut off before the gzip trailer, or a deflate
            error) together with the decompressed byte where it ended; the bytes before it read normally
            and reads past it return nothing, so the tar walk sees a cut-off shard.

    Raises:
        ValueError: ``span`` below 64 KiB.
    """

    def __init__(self, raw: BinaryIO, url: str, *, span: int = 4 << 20) -> None:
        super().__init__()
        if span < 1 << 16:
            raise ValueError(f"GzipShard: span must be >= 65536 bytes, got {span}")
        self.raw, self.url, self.span = raw, url, span
        self.size: int | None = None
        self.damage: str | None = None
        self._pos = 0  # the reader's position (decompressed)
        # checkpoints: (decompressed offset, compressed offset, inflater state there)
        self._points: list[tuple[int, int, Any]] = [(0, 0, zlib.decompressobj(31))]
        self._restart(0)

    # --- the inflater ----------------------------------------------------------------------------
    def _restart(self, k: int) -> None:
        out, cin, d = self._points[k]
        self._d = d.copy()
        self._out = out  # decompressed bytes produced so far (end of _buf)
        self._in = cin  # compressed bytes handed to the inflater (or kept in _pending)
        self._pending = b""  # compressed bytes read but not yet given to the inflater
        self._buf = b""  # the last decompressed piece, ending at _out
        self._ended = False
        self.raw.seek(cin)

    def _input(self) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        data = self.raw.read(_CHUNK)
        self._in += len(data)
        return data

    def _end(self, damage: str | None) -> bytes:
        self._ended = True
        self.size = self._out
        if damage is not None and self.damage is None:
            self.damage = f"{damage} (decompressed byte {self._out})"
        return b""

    def _piece(self) -> bytes:
        """The next decompressed bytes after ``_out`` (non-empty), or ``b""`` at the end of the stream."""
        while not self._ended:
            d = self._d
            if d.eof:  # end of a gzip member: another may follow (concatenated gzip)
                rest = d.unused_data
                while len(rest) < 2:
                    more = self._input()
                    if not more:
                        break
                    rest += more
                if not rest.startswith(GZIP_MAGIC):
                    return self._end(None)  # the stream ends here (trailing padding is ignored)
                self._d, self._pending = zlib.decompressobj(31), rest
                continue
            data = d.unconsumed_tail or self._input()
            try:
                out = d.decompress(data, _PIECE) if data else d.flush()
            except zlib.error as e:
                return self._end(f"damaged gzip stream ({e})")
            if not data and not out and not d.eof:
                return self._end("gzip stream cut off before its end")
            if out:
                self._out += len(out)
                settled = not d.unconsumed_tail and not d.eof and not self._pending
                if settled and self._out - self._points[-1][0] >= self.span:
                    self._points.append((self._out, self._in, d.copy()))
                return out
        return b""

    # --- file API --------------------------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move to ``offset`` (decompressed bytes); ``SEEK_END`` inflates the whole stream first."""
        if whence == io.SEEK_CUR:
            offset += self._pos
        elif whence == io.SEEK_END:
            while self.size is None:
                self._goto(self._out + (1 << 30))
            offset += self.size
        elif whence != io.SEEK_SET:
            raise ValueError(f"GzipShard.seek: bad whence {whence}")
        if offset < 0:
            raise ValueError(f"{self.url}: negative seek position {offset}")
        self._pos = offset
        return offset

    def _goto(self, pos: int) -> bool:
        """Make the current piece hold ``pos``; ``False`` when the stream ends before it."""
        start = self._out - len(self._buf)
        if pos < start:
            k = max(i for i, p in enumerate(self._points) if p[0] <= pos)
            self._restart(k)
        while self._out <= pos:
            piece = self._piece()
            if not piece:
                self._buf = b""
                return False
            self._buf = piece
        return True

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` decompressed bytes from the position (all the rest for ``n < 0``); fewer only at
        the end of the stream."""
        want = (1 << 62) if n is None or n < 0 else n
        parts: list[bytes] = []
        while want > 0 and self._goto(self._pos):
            start = self._out - len(self._buf)
            chunk = self._buf[self._pos - start : self._pos - start + want]
            parts.append(chunk)
            self._pos += len(chunk)
            want -= len(chunk)
        return b"".join(parts)

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()
