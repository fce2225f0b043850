"""Loading into any layout: intersect the boxes this rank needs with the saved boxes, read only those
byte ranges (widened to checksum chunks, which are verified), copy in place. No collectives."""

from __future__ import annotations

import math
import zlib
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from omni_ckpt.box import Box
from omni_ckpt.layout import FORMAT, FORMAT_VERSION, MANIFEST, dtype_from_name, layout_rank
from omni_ckpt.plan import SavePlan
from omni_ckpt.sharding import describe, is_tensor_leaf
from omni_ckpt.state import flatten_state, gc_paused
from omni_ckpt.storage import CheckpointError, join, open_url, read_ranges

__all__ = ["LoadResult", "load", "plan_from_manifest", "read_manifest", "read_objects"]


def read_manifest(url: str) -> dict[str, Any]:
    """The manifest of the committed checkpoint at ``url``.

    Raises:
        CheckpointError: no committed manifest there, it does not decode, or it is not an omni-ckpt manifest
            of a known version.
    """
    fs, path = open_url(url)
    mpath = join(path, MANIFEST)
    if not fs.exists(mpath):
        raise CheckpointError(f"{url}: no {MANIFEST}; not a committed checkpoint")
    with fs.open(mpath, "rb") as f:
        raw = f.read()
    try:
        manifest = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CheckpointError(f"{mpath}: corrupt manifest ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: not an {FORMAT} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{mpath}: format version {manifest.get('version')}, this reader knows {FORMAT_VERSION}"
        )
    return manifest


def plan_from_manifest(manifest: dict[str, Any]) -> SavePlan | None:
    """The save plan a checkpoint was written with (for the plan cache), or None if it cannot be rebuilt."""
    world = manifest["world_size"]
    tensors = {n: (dt, tuple(shape)) for n, (dt, shape, _) in manifest["tensors"].items()}
    per_rank: list[list[tuple[int, str, Box, str]]] = [[] for _ in range(world)]
    for name, (dt, _, boxes) in manifest["tensors"].items():
        for offsets, sizes, file, offset, _, _ in boxes:
            per_rank[file].append((offset, name, Box(tuple(offsets), tuple(sizes)), dt))
    writes, entries = [], []
    shapes = {n: s for n, (_, s) in tensors.items()}
    for r, items in enumerate(per_rank):
        items.sort(key=lambda it: it[0])
        w, e = layout_rank([(n, b, d) for _, n, b, d in items], shapes)
        start = manifest["data_start"][r]
        if [x.rel_offset + start for x in w] != [it[0] for it in items]:
            return None
        writes.append(w)
        entries.append(e)
    return SavePlan(world, list(manifest["rank_fingerprints"]), tensors, writes, entries)


@dataclass
class LoadResult:
    """What a load did. ``unused``: checkpoint entries the state dict did not ask for (not loaded)."""

    tensors: int
    objects: int
    bytes_read: int
    unused: list[str]


def read_objects(
    url: str, manifest: dict[str, Any], rank: int, world_size: int
) -> tuple[dict[str, Any], set[str]]:
    """Plain objects for ``rank``: its own if the world size matches, else the ones equal on all saved ranks.

    Returns ``(objects, names that differ across saved ranks)``.
    """
    fs, path = open_url(url)
    entries = manifest["objects"]
    wanted = [rank] if world_size == manifest["world_size"] else list(range(len(entries)))
    blobs = []
    for r in wanted:
        file, offset, length, crc = entries[r]
        fname = join(path, manifest["files"][file])
        (view,) = read_ranges(fs, fname, [(offset, offset + length)])
        if zlib.crc32(view) != crc:
            raise CheckpointError(f"{fname}: checksum mismatch in the plain objects of rank {r}")
        blobs.append(msgpack.unpackb(view, raw=False, strict_map_key=False))
    if len(blobs) == 1:
        return blobs[0], set()
    merged, differ = dict(blobs[0]), set()
    for b in blobs[1:]:
        for k in set(merged) | set(b):
            if merged.get(k, _MISSING) != b.get(k, _MISSING):
                differ.add(k)
    for k in differ:
        merged.pop(k, None)
    return merged, differ


_MISSING = object()


def load(
    state_dict: MutableMapping[Any, Any],
    url: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
) -> LoadResult:
    """Fill ``state_dict`` in place from the checkpoint at ``url``, whatever its layout now.

    Tensor leaves (plain, DTensor, FlatShard, BoxShard) are copied into in place, cast to their dtype if it
    differs from the saved one; plain object leaves are replaced by the saved values (msgpack gives lists
    for tuples). Objects saved by several ranks: with the same world size each rank gets its own value;
    with another world size only values equal on every saved rank load. Every byte read is checked
    against its chunk's CRC32.

    Args:
        state_dict: nested dicts, as for :func:`~omni_ckpt.save`.
        url: a committed checkpoint directory.
        process_group: only its rank and size are used (for per-rank objects); no collectives.
        strict: raise when a requested entry is missing from the checkpoint.

    Raises:
        CheckpointError: not committed; a requested entry is missing (named); a saved object differs across
            ranks and the world size changed (named); a checksum mismatch (file and tensor named).
        ValueError: a tensor's global shape differs from the saved one (named).
    """
    if process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    rank = dist.get_rank(process_group) if process_group is not None else 0
    world = dist.get_world_size(process_group) if process_group is not None else 1
    with gc_paused():
        return _load(state_dict, url, rank, world, strict)


def _load(state_dict: MutableMapping[Any, Any], url: str, rank: int, world: int, strict: bool) -> LoadResult:
    manifest = read_manifest(url)
    fs, path = open_url(url)
    saved = manifest["tensors"]
    chunk = manifest["chunk_bytes"]
    requested: set[str] = set()
    objects_wanted: list[tuple[str, MutableMapping[Any, Any], Any]] = []
    # file index -> [(lo, hi) bytes within the saved box, name, box entry, saved box, wanted block, target view, dtype]
    reads: dict[int, list[tuple[int, int, str, list[Any], Box, Box, torch.Tensor, torch.dtype]]] = {}
    n_tensors = 0
    for name, container, key, value in flatten_state(state_dict):
        requested.add(name)
        if not is_tensor_leaf(value):
            objects_wanted.append((name, container, key))
            continue
        entry = saved.get(name)
        if entry is None:
            if strict:
                raise CheckpointError(f"{url}: tensor {name!r} is not in the checkpoint")
            continue
        dt, shape, boxes = entry
        gshape, _, pieces = describe(value)
        if tuple(shape) != tuple(gshape):
            raise ValueError(
                f"tensor {name!r}: checkpoint shape {tuple(shape)}, state dict shape {tuple(gshape)}"
            )
        n_tensors += 1
        saved_dtype = dtype_from_name(dt)
        item = saved_dtype.itemsize
        for piece in pieces:
            for b in boxes:
                sbox = Box(tuple(b[0]), tuple(b[1]))
                inter = sbox if sbox == piece.box else piece.box.intersect(sbox)
                if inter is None:
                    continue
                strides = _strides(sbox.sizes)
                first = sum((o - so) * s for o, so, s in zip(inter.offsets, sbox.offsets, strides))
                last = sum((e - 1 - so) * s for e, so, s in zip(inter.ends, sbox.offsets, strides))
                lo = (first * item) // chunk * chunk
                hi = min(-(-((last + 1) * item) // chunk) * chunk, b[4])
                dest = piece.view if inter == piece.box else piece.view[inter.slices(piece.box.offsets)]
                reads.setdefault(b[2], []).append((lo, hi, name, b, sbox, inter, dest, saved_dtype))
    bytes_read = 0
    for file, todo in reads.items():
        fname = join(path, manifest["files"][file])
        # Whole big boxes landing whole in a contiguous CPU tensor of the same dtype are read straight
        # into it (one copy less); the rest is read in coalesced ranges.
        direct = [t for t in todo if _direct(t)]
        rest = [t for t in todo if not _direct(t)]
        if direct:
            with fs.open(fname, "rb") as f:
                for lo, hi, name, b, *_, dest, _ in direct:
                    buf = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
                    f.seek(b[3])
                    if f.readinto(buf) != hi - lo:
                        raise CheckpointError(
                            f"{fname}: truncated in tensor {name!r} box offsets={tuple(b[0])}"
                        )
                    _verify(buf, 0, hi - lo, b, chunk, fname, name)
                    bytes_read += hi - lo
        views = read_ranges(fs, fname, [(b[3] + lo, b[3] + hi) for lo, hi, _, b, *_ in rest])
        for (lo, hi, name, b, sbox, inter, dest, sdtype), view in zip(rest, views):
            bytes_read += hi - lo
            _verify(view, lo, hi, b, chunk, fname, name)
            dest.copy_(_box_view(view, lo, sbox, inter, sdtype))
    n_objects = 0
    objects, differ = read_objects(url, manifest, rank, world) if manifest["objects"] else ({}, set())
    if objects_wanted:
        for name, container, key in objects_wanted:
            if name in objects:
                container[key] = objects[name]
                n_objects += 1
            elif name in differ:
                raise CheckpointError(
                    f"{url}: object {name!r} differs across the {manifest['world_size']} saved ranks and the "
                    f"world size is now {world}; save it under per-rank names to reshard it"
                )
            elif strict:
                raise CheckpointError(f"{url}: object {name!r} is not in the checkpoint")
    unused = sorted((set(saved) | set(objects) | differ) - requested)
    return LoadResult(n_tensors, n_objects, bytes_read, unused)


def _direct(t: tuple[Any, ...]) -> bool:
    lo, hi, _, b, sbox, inter, dest, sdtype = t
    return (
        hi - lo >= 1 << 20
        and lo == 0
        and hi == b[4]
        and inter == sbox
        and dest.dtype == sdtype
        and dest.device.type == "cpu"
        and dest.is_contiguous()
        and tuple(dest.shape) == sbox.sizes
    )


def _verify(view: memoryview, lo: int, hi: int, b: list[Any], chunk: int, fname: str, name: str) -> None:
    """Check bytes ``[lo, hi)`` of saved box ``b`` (``view`` holds exactly them) against its chunk CRCs."""
    crcs = b[5]
    for c in range(lo // chunk, -(-hi // chunk)):
        a = c * chunk - lo
        if zlib.crc32(view[a : min(a + chunk, hi - lo)]) != crcs[c]:
            raise CheckpointError(
                f"{fname}: checksum mismatch in tensor {name!r} box offsets={tuple(b[0])} "
                f"(bytes [{b[3] + c * chunk}, {b[3] + min((c + 1) * chunk, b[4])}))"
            )


def _strides(sizes: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= s
    return out[::-1]


def _box_view(view: memoryview, lo: int, sbox: Box, inter: Box, dtype: torch.dtype) -> torch.Tensor:
    """The ``inter`` block out of bytes ``[lo, ...)`` of saved box ``sbox`` (row-major)."""
    item = dtype.itemsize
    raw = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
    if inter == sbox and lo == 0 and len(view) == sbox.numel * item and raw.data_ptr() % item == 0:
        return raw.view(dtype).view(sbox.sizes)
    if lo % item or raw.data_ptr() % item:
        raw = raw.clone()
    flat = raw.view(dtype)
    strides = _strides(sbox.sizes)
    first = sum((o - so) * s for o, so, s in zip(inter.offsets, sbox.offsets, strides))
    if math.prod(inter.sizes) == 0:
        return flat[:0].reshape(inter.sizes)
    return flat.as_strided(inter.sizes, strides, first - lo // item)
