"""On-disk layout: dtype names, the per-rank data file (safetensors layout) and the manifest schema.

A checkpoint directory holds ``rank-XXXXX.safetensors`` data files (one per writing rank) and one
``manifest.msgpack``. Each data file is a valid safetensors file: boxes of at least
:data:`SMALL_BOX_BYTES` are tensors of their own (named ``name`` for a whole tensor, ``name@o0,o1,...``
for a box at those offsets); smaller boxes are packed per dtype into 1-D ``__packed__.<dtype>`` tensors,
so 20,000 tiny tensors do not cost 20,000 header entries; per-rank plain objects are the U8 tensor
``__objects__`` (msgpack bytes) at the end. Entries are ordered by element size, largest first, so every
box starts aligned to its element size.

Manifest file: a msgpack map (no pickle) followed by a 16-byte trailer that makes it prove itself::

    <msgpack body> | CRC-32C of the body (u32 LE) | body length (u32 LE) | b"OCKPTMF2"

    body = {format: "omni-ckpt", version: 2, world_size: W, chunk_bytes: C, checksum: "crc32c",
            files: [file name per rank], data_start: [byte offset of the data section per rank],
            header_crc: [CRC-32C of bytes [0, data_start) per rank],  # the safetensors header
            tensors: {name: [dtype, shape, [[offsets, sizes, file, offset, length, [crc per chunk]], ...]]},
            objects: [[file, offset, length, crc] per rank],
            rank_fingerprints: [bytes per rank]}   # the save-plan cache key

``offset`` and ``length`` are absolute byte positions in ``files[file]``; ``crc per chunk`` is the CRC-32C
of each ``C``-byte chunk of the box (the last one shorter). Any single-bit flip anywhere in the manifest
fails its own checksum; one in a data file's header fails ``header_crc``; one in the data fails its chunk's
CRC. Version 1 manifests (no self-checksum, ``zlib.crc32`` chunks) are refused with a message saying so.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgpack
import torch

from omni_ckpt.box import Box
from omni_ckpt.checksum import crc

__all__ = [
    "CHUNK_BYTES",
    "DTYPES",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "SMALL_BOX_BYTES",
    "Write",
    "decode_manifest",
    "dtype_from_name",
    "dtype_name",
    "encode_manifest",
    "itemsize",
    "layout_rank",
    "rank_file",
    "safetensors_header",
    "unpack_map",
]

FORMAT = "omni-ckpt"
FORMAT_VERSION = 2
MANIFEST = "manifest.msgpack"
MAX_MANIFEST_BYTES = 1 << 30
_TRAILER = struct.Struct("<II8s")
_MAGIC = b"OCKPTMF2"
CHUNK_BYTES = 4 << 20
SMALL_BOX_BYTES = 4096
OBJECTS_ENTRY = "__objects__"

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


# The dense dtypes a checkpoint may hold, by name; a manifest naming any other is refused (an untrusted
# name must never reach ``getattr(torch, name)``), and saving any other raises before anything is written.
_DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType(
    {
        n: getattr(torch, n)
        for n in (
            "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
            "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
            "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        )
        if isinstance(getattr(torch, n, None), torch.dtype)
    }
)  # fmt: skip
DTYPES = frozenset(_DTYPES)
_ITEMSIZES = MappingProxyType({n: d.itemsize for n, d in _DTYPES.items()})


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``.

    Raises:
        ValueError: a dtype outside :data:`DTYPES` (quantized, bit-packed...), which no checkpoint holds.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be checkpointed (supported: {', '.join(sorted(DTYPES))})")
    return name


def itemsize(name: str) -> int:
    """Bytes per element of the dtype called ``name``.

    Raises:
        ValueError: not a name in :data:`DTYPES`.
    """
    size = _ITEMSIZES.get(name) if isinstance(name, str) else None
    if size is None:
        raise ValueError(f"unknown dtype {name!r:.80} in checkpoint")
    return size


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``.

    Raises:
        ValueError: not a name in :data:`DTYPES`.
    """
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r:.80} in checkpoint")
    return dtype


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True, slots=True)
class Write:
    """One box a rank writes: ``length`` bytes at ``rel_offset`` from the start of its data section."""

    name: str
    box: Box
    dtype: str
    rel_offset: int
    length: int


def layout_rank(
    items: list[tuple[str, Box, str]], shapes: dict[str, tuple[int, ...]]
) -> tuple[list[Write], list[tuple[str, str, list[int], int, int]]]:
    """Byte layout of one rank's data section from its boxes ``(name, box, dtype)``.

    Deterministic and idempotent (laying out the result again, in offset order, gives the same
    offsets), which lets the save-plan cache be rebuilt from a manifest.

    Returns:
        ``(writes in offset order, safetensors entries (name, st_dtype, shape, begin, end))``.
    """
    units: list[tuple[int, int, str, list[tuple[str, Box, str]]]] = []  # (-itemsize, kind, key, boxes)
    packed: dict[str, list[tuple[str, Box, str]]] = {}
    for it in items:
        size = math.prod(it[1].sizes) * itemsize(it[2])
        if size < SMALL_BOX_BYTES:
            packed.setdefault(it[2], []).append(it)
        else:
            units.append((-itemsize(it[2]), 0, it[0], [it]))
    for dt, boxes in packed.items():
        units.append((-dtype_from_name(dt).itemsize, 1, dt, boxes))
    units.sort(key=lambda u: (u[0], u[1]))  # stable: plan order within each class
    writes: list[Write] = []
    entries: list[tuple[str, str, list[int], int, int]] = []
    pos = 0
    for _, kind, key, boxes in units:
        begin = pos
        for name, box, dt in boxes:
            length = math.prod(box.sizes) * itemsize(dt)
            writes.append(Write(name, box, dt, pos, length))
            pos += length
        dtype = dtype_from_name(boxes[0][2])
        st = _ST_DTYPES.get(dtype)
        if kind == 0:
            name, box, _ = boxes[0]
            label = name if box.sizes == shapes[name] else f"{name}@{','.join(map(str, box.offsets))}"
            entries.append((label, st or "U8", list(box.sizes) if st else [pos - begin], begin, pos))
        else:
            n = (pos - begin) // dtype.itemsize
            entries.append((f"__packed__.{key}", st or "U8", [n] if st else [pos - begin], begin, pos))
    return writes, entries


def safetensors_header(
    entries: list[tuple[str, str, list[int], int, int]], objects_len: int, rank: int
) -> bytes:
    """The 8-byte length plus JSON header of a rank's data file, padded so data starts 8-byte aligned."""
    header: dict[str, object] = {"__metadata__": {"format": FORMAT, "rank": str(rank)}}
    end = 0
    for label, st, shape, begin, stop in entries:
        header[label] = {"dtype": st, "shape": shape, "data_offsets": [begin, stop]}
        end = stop
    if objects_len:
        header[OBJECTS_ENTRY] = {
            "dtype": "U8",
            "shape": [objects_len],
            "data_offsets": [end, end + objects_len],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw


def unpack_map(data: memoryview | bytes, what: str) -> dict[str, Any]:
    """msgpack bytes that must hold a map (manifest body, a rank's plain objects).

    Raises:
        ValueError: they do not decode, or not to a map; the message starts with ``what``.
    """
    try:
        out = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"{what} do not decode ({type(exc).__name__}: {exc})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{what} is not a map")
    return out


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """The manifest file's bytes: msgpack body plus the self-checking trailer (see the module docstring)."""
    body = msgpack.packb(manifest, use_bin_type=True)
    if len(body) > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest of {len(body)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    return body + _TRAILER.pack(crc(body), len(body), _MAGIC)


def decode_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """Check a manifest file's own checksum and decode it; ``where`` names it in errors.

    Raises:
        ValueError: no trailer (not a version-2 manifest: a version-1 one is named as such), a length or
            checksum mismatch, a body that does not decode to a map, or another format or version.
    """
    n = len(raw) - _TRAILER.size
    if n < 0 or raw[-8:] != _MAGIC:
        try:
            old = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:
            old = None
        if isinstance(old, dict) and old.get("format") == FORMAT:
            raise ValueError(
                f"{where}: format version {old.get('version')} (a manifest without its own checksum, with "
                f"zlib.crc32 chunks); this reader needs version {FORMAT_VERSION}: load it with the omni-ckpt "
                "that wrote it and save it again with this one"
            )
        raise ValueError(f"{where}: not an {FORMAT} manifest (no checksum trailer)")
    want, length, _ = _TRAILER.unpack_from(raw, n)
    if length != n:
        raise ValueError(f"{where}: trailer says the body is {length} bytes, the file holds {n}")
    body = memoryview(raw)[:n]
    if crc(body) != want:
        raise ValueError(f"{where}: manifest checksum mismatch (the file is corrupt)")
    manifest = unpack_map(body, f"{where}: manifest")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{where}: not an {FORMAT} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{where}: format version {manifest.get('version')}, this reader knows {FORMAT_VERSION}"
        )
    return manifest
