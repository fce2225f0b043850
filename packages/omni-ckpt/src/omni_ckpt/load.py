"""Loading into any layout: intersect the boxes this rank needs with the saved boxes, read only those
byte ranges (widened to checksum chunks, which are verified), copy in place. No collectives.

Nothing is written into the target before the checkpoint has proven itself: the manifest's own checksum,
its schema, exact coverage of every requested tensor by its saved boxes, the CRC of each data file's
header, the data files' sizes and the plain objects are all checked first. Data chunks are then read by a
thread pool (``pread`` straight into contiguous targets on a local disk, ``cat_ranges`` on remote stores)
and each chunk is verified by the thread that read it.
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from omni_ckpt.box import Box, check_boxes
from omni_ckpt.checksum import ALGORITHM, chunk_count, crc
from omni_ckpt.layout import (
    DTYPES,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    decode_manifest,
    dtype_from_name,
    itemsize,
    layout_rank,
    unpack_map,
)
from omni_ckpt.plan import SavePlan
from omni_ckpt.sharding import describe, is_tensor_leaf
from omni_ckpt.state import PlaceholderRef, flatten_state, gc_paused
from omni_ckpt.storage import (
    CheckpointError,
    coalesce,
    is_local,
    join,
    local_path,
    open_url,
    pread_into,
    read_spans,
)
from omni_ckpt.transfer import WINDOW_BYTES, host_bytes

__all__ = [
    "DEFAULT_IO_THREADS",
    "MAX_NDIM",
    "LoadResult",
    "load",
    "plan_from_manifest",
    "read_manifest",
    "read_objects",
]

DEFAULT_IO_THREADS = 4
MAX_NDIM = 64  # torch's own limit on tensor dimensions
_MAX_TENSOR_BYTES = 1 << 62  # torch counts bytes in int64; a shape past this is absurd, not just large
_DIRECT_BYTES = 256 << 10  # whole boxes at least this big are read straight into their target
_JOB_BYTES = 32 << 20  # bytes per read job (a multiple of the checksum chunk)


def read_manifest(url: str) -> dict[str, Any]:
    """The manifest of the committed checkpoint at ``url``, proven before anything trusts it: its own
    checksum, its schema, every tensor's dtype, shape and boxes (see :func:`_verify_manifest`), and every
    data file's size against the byte ranges the manifest places in it (one ``size`` call per file).
    After it returns, allocating every tensor it lists costs at most the data files' bytes.

    Raises:
        CheckpointError: no committed manifest there, it is larger than the limit, its checksum fails, it
            does not decode, it is not an omni-ckpt manifest of this version, a field is malformed, a
            tensor's entry is refused, or a data file is missing or shorter than its byte ranges (the
            checkpoint, tensor, box and fault named).
    """
    verified = _verify_manifest(url)
    fs, path = open_url(url)
    for file, (end, owner) in enumerate(verified.file_end):
        fname = join(path, verified.manifest["files"][file])
        try:
            size = fs.size(fname)
        except FileNotFoundError:
            raise CheckpointError(f"{fname}: data file missing") from None
        if size < end:
            raise CheckpointError(f"{fname}: truncated, {size} bytes but the manifest places {owner} in it")
    return verified.manifest


def _read_checked_manifest(url: str) -> dict[str, Any]:
    """The manifest at ``url`` with its own checksum and top-level schema checked (nothing per tensor)."""
    fs, path = open_url(url)
    mpath = join(path, MANIFEST)
    if not fs.exists(mpath):
        raise CheckpointError(f"{url}: no {MANIFEST}; not a committed checkpoint")
    with fs.open(mpath, "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 64)
    if len(raw) > MAX_MANIFEST_BYTES + 16:
        raise CheckpointError(f"{mpath}: larger than the {MAX_MANIFEST_BYTES}-byte manifest limit")
    try:
        manifest = decode_manifest(raw, mpath)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    _check_schema(manifest, mpath)
    return manifest


@dataclass(frozen=True, slots=True)
class _Verified:
    """A manifest whose every tensor entry was checked: ``tensors[name] = (dtype, shape, [(Box, entry)])``;
    ``file_end[f] = (end, what)``: the end of the last byte range placed in file ``f``, and what placed it."""

    manifest: dict[str, Any]
    tensors: dict[str, tuple[str, tuple[int, ...], list[tuple[Box, list[Any]]]]]
    file_end: list[tuple[int, str]]
    full: dict[tuple[int, ...], Box]  # whole-tensor boxes by shape, shared with ``describe``


def _verify_manifest(url: str) -> _Verified:
    """Read the manifest at ``url`` and check every tensor entry before anything is allocated from it.

    Per tensor: a dtype from :data:`~omni_ckpt.layout.DTYPES`; a shape of at most :data:`MAX_NDIM` ints
    ``>= 0`` under 2**62 bytes; well-formed boxes whose byte length is their element count times the
    dtype's size; boxes inside the tensor that tile it exactly (:func:`~omni_ckpt.box.check_boxes`,
    no per-element work). Per data file: the byte ranges of all boxes and plain objects are disjoint
    (sorted by start), so no byte is read into two places and the tensors together hold at most the
    files' bytes (a manifest pointing many boxes at the same bytes would otherwise inflate a small
    checkpoint into a huge allocation). ``O(B log B)`` for ``B`` boxes.

    Raises:
        CheckpointError: as :func:`read_manifest`, without the file sizes (the caller checks those).
    """
    m = _read_checked_manifest(url)
    full: dict[tuple[int, ...], Box] = {}
    tensors = {}
    spans: list[list[tuple[int, int, str, Any]]] = [[] for _ in range(m["world_size"])]
    for name, entry in m["tensors"].items():
        checked = tensors[name] = _checked_boxes(name, entry, m, url, full)
        for _, b in checked[2]:
            if b[4]:
                spans[b[2]].append((b[3], b[3] + b[4], name, b))
    for r, (file, offset, length, _) in enumerate(m["objects"]):
        if length:
            spans[file].append((offset, offset + length, "", r))
    file_end = []
    for file, todo in enumerate(spans):
        todo.sort(key=lambda s: s[0])
        end, owner = m["data_start"][file], "the header"
        for span in todo:
            if span[0] < end:
                raise CheckpointError(
                    f"{url}: {_span_name(span)} overlaps {owner} in {m['files'][file]} (bytes "
                    f"[{span[0]}, {min(end, span[1])}) are claimed twice; a checkpoint stores each byte once)"
                )
            end, owner = span[1], _span_name(span)
        file_end.append((end, owner))
    return _Verified(m, tensors, file_end, full)


def _span_name(span: tuple[int, int, str, Any]) -> str:
    lo, hi, name, b = span
    if not name:
        return f"the plain objects of rank {b} (bytes [{lo}, {hi}))"
    return f"tensor {name!r} box offsets={tuple(b[0])} sizes={tuple(b[1])} (bytes [{lo}, {hi}))"


def _is_int(x: Any, lo: int = 0) -> bool:
    return type(x) is int and x >= lo


def _check_schema(m: dict[str, Any], where: str) -> None:
    """The manifest's top-level fields (the per-box entries are checked when a tensor is requested)."""

    def bad(field: str, why: str) -> CheckpointError:
        return CheckpointError(f"{where}: malformed manifest field {field!r}: {why}")

    world = m.get("world_size")
    if not _is_int(world, 1):
        raise bad("world_size", f"{world!r} is not an int >= 1")
    if m.get("checksum") != ALGORITHM:
        raise bad("checksum", f"{m.get('checksum')!r}, this reader checks {ALGORITHM!r}")
    if not _is_int(m.get("chunk_bytes"), 1):
        raise bad("chunk_bytes", f"{m.get('chunk_bytes')!r} is not an int >= 1")
    for field, kind in (("files", str), ("data_start", int), ("header_crc", int), ("objects", list)):
        v = m.get(field)
        if not isinstance(v, list) or len(v) != world or not all(type(x) is kind for x in v):
            raise bad(field, f"expected a list of {world} {kind.__name__}")
    for r, name in enumerate(m["files"]):
        if "/" in name or name in ("", ".", ".."):
            raise bad("files", f"rank {r} file name {name!r} is not a plain file name")
    for r, o in enumerate(m["objects"]):
        if len(o) != 4 or not all(_is_int(x) for x in o) or o[0] >= world or o[1] < m["data_start"][o[0]]:
            raise bad("objects", f"rank {r} entry {o!r} is not [file, offset >= data start, length, crc]")
    if not isinstance(m.get("tensors"), dict):
        raise bad("tensors", "not a map")
    fps = m.get("rank_fingerprints")
    if not isinstance(fps, list) or len(fps) != world:
        raise bad("rank_fingerprints", f"expected a list of {world}")


def _box_fault(b: Any, ndim: int, item: int, m: dict[str, Any]) -> str | None:
    """What is wrong with one box entry ``[offsets, sizes, file, offset, length, crcs]``, or None."""
    if not (isinstance(b, list) and len(b) == 6):
        return "not [offsets, sizes, file, offset, length, chunk crcs]"
    offsets, sizes, file, offset, length, crcs = b
    for field, v in (("offsets", offsets), ("sizes", sizes)):
        if not (isinstance(v, list) and len(v) == ndim and all(_is_int(x) for x in v)):
            return f"{field} are not {ndim} ints >= 0"
    if not (_is_int(file) and file < m["world_size"]):
        return f"file {file!r:.40} is not a rank file index below {m['world_size']}"
    if not _is_int(offset, m["data_start"][file]):
        return (
            f"byte offset {offset!r:.40} is not an int >= the data start {m['data_start'][file]} of its file"
        )
    if length != math.prod(sizes) * item:
        return f"length {length!r:.40} is not {math.prod(sizes)} elements x {item} bytes"
    if not (isinstance(crcs, list) and len(crcs) == chunk_count(length, m["chunk_bytes"])):
        return f"expected {chunk_count(length, m['chunk_bytes'])} chunk checksums"
    return None


def _checked_boxes(
    name: str, entry: Any, m: dict[str, Any], where: str, full: dict[tuple[int, ...], Box]
) -> tuple[str, tuple[int, ...], list[tuple[Box, list[Any]]]]:
    """One tensor's manifest entry, checked: a known dtype, a sane shape, well-formed boxes whose byte
    lengths match their sizes, in files of this checkpoint, covering the tensor exactly (no gap, no
    overlap). ``full`` memoises whole-tensor boxes by shape (20,000 tiny tensors share a few).

    Raises:
        CheckpointError: naming the checkpoint, the tensor, the box and what is wrong (for coverage, the
            missing or doubly covered region).
    """

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: tensor {name!r}: {why}")

    if not (isinstance(entry, list) and len(entry) == 3):
        raise bad(f"malformed manifest entry {entry!r:.200} (not [dtype, shape, boxes])")
    dt, shape, boxes = entry
    if not (isinstance(dt, str) and dt in DTYPES):
        raise bad(f"unknown dtype {dt!r:.80} (a checkpoint holds only {', '.join(sorted(DTYPES))})")
    item = itemsize(dt)
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM):
        raise bad(f"malformed shape {shape!r:.200} (not a list of at most {MAX_NDIM} sizes)")
    for d, size in enumerate(shape):
        if not _is_int(size):
            raise bad(f"malformed shape {shape!r:.200}: size {size!r:.40} of dim {d} is not an int >= 0")
    shape = tuple(shape)
    if math.prod(shape) * item >= _MAX_TENSOR_BYTES:
        raise bad(f"shape {shape} of {dt} would need {math.prod(shape) * item} bytes")
    if not isinstance(boxes, list):
        raise bad(f"malformed manifest entry: boxes {boxes!r:.80} is not a list")
    ndim = len(shape)
    for b in boxes:
        fault = _box_fault(b, ndim, item, m)
        if fault is not None:
            raise bad(f"malformed box entry {b!r:.200}: {fault}")
    if len(boxes) == 1 and tuple(boxes[0][1]) == shape and not any(boxes[0][0]):
        box = full.get(shape)
        if box is None:
            box = full[shape] = Box.full(shape)
        return dt, shape, [(box, boxes[0])]
    out = [(Box(tuple(b[0]), tuple(b[1])), b) for b in boxes]
    try:
        check_boxes(name, shape, [bx for bx, _ in out])
    except ValueError as exc:
        raise CheckpointError(f"{where}: saved boxes do not cover the tensor exactly: {exc}") from None
    return dt, shape, out


def plan_from_manifest(manifest: dict[str, Any]) -> SavePlan | None:
    """The save plan a checkpoint was written with (for the plan cache), or None if it cannot be rebuilt."""
    try:
        return _plan_from_manifest(manifest)
    except (TypeError, ValueError, IndexError, KeyError):
        return None


def _plan_from_manifest(manifest: dict[str, Any]) -> SavePlan | None:
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
    """What a load did. ``unused``: checkpoint entries the state dict did not ask for (not loaded).
    ``absent``: placeholder subtrees the checkpoint holds nothing for, removed from the state dict."""

    tensors: int
    objects: int
    bytes_read: int
    unused: list[str]
    absent: list[str] | None = None


def _object_blobs(fs: Any, path: str, m: dict[str, Any], ranks: list[int]) -> list[dict[str, Any]]:
    """The checked plain objects of ``ranks``; a blob is read only once the file is known to hold it (a
    manifest's length is untrusted: nothing is allocated for bytes the file does not have)."""
    out, sizes = [], {}
    for r in ranks:
        file, offset, length, want = m["objects"][r]
        fname = join(path, m["files"][file])
        if file not in sizes:
            try:
                sizes[file] = fs.size(fname)
            except FileNotFoundError:
                raise CheckpointError(f"{fname}: data file missing") from None
        if offset + length > sizes[file]:
            raise CheckpointError(
                f"{fname}: truncated, {sizes[file]} bytes but the plain objects of rank {r} need "
                f"[{offset}, {offset + length})"
            )
        (view,) = read_spans(fs, fname, [(offset, offset + length)])
        if crc(view) != want:
            raise CheckpointError(f"{fname}: checksum mismatch in the plain objects of rank {r}")
        try:
            out.append(unpack_map(view, f"{fname}: plain objects of rank {r}"))
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
    return out


def read_objects(
    url: str, manifest: dict[str, Any], rank: int | None, world_size: int
) -> tuple[dict[str, Any], set[str]]:
    """Plain objects for ``rank``: its own if the world size matches, else the ones equal on all saved ranks.

    ``rank=None`` merges every saved rank. Returns ``(objects, names that differ across saved ranks)``.

    Raises:
        CheckpointError: a checksum mismatch or an undecodable blob (file and rank named).
    """
    fs, path = open_url(url)
    n = manifest["world_size"]
    wanted = [rank] if rank is not None and world_size == n else list(range(n))
    blobs = _object_blobs(fs, path, manifest, wanted)
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


def per_rank_objects(url: str, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every saved rank's plain objects, checked (for export)."""
    fs, path = open_url(url)
    return _object_blobs(fs, path, manifest, list(range(manifest["world_size"])))


_MISSING = object()


def load(
    state_dict: MutableMapping[Any, Any],
    url: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
    io_threads: int = DEFAULT_IO_THREADS,
) -> LoadResult:
    """Fill ``state_dict`` in place from the checkpoint at ``url``, whatever its layout now.

    Tensor leaves (plain, DTensor, FlatShard, BoxShard) are copied into in place, cast to their dtype if it
    differs from the saved one; plain object leaves are replaced by the saved values (msgpack gives lists
    for tuples). Objects saved by several ranks: with the same world size each rank gets its own value;
    with another world size only values equal on every saved rank load. :class:`~omni_ckpt.Placeholder`
    subtrees are filled when the checkpoint has them and removed when it has none of their entries.
    Every byte read is checked against its chunk's CRC-32C; nothing is written into ``state_dict`` before
    the manifest, coverage, data file headers and sizes, and plain objects have been checked.

    Args:
        state_dict: nested dicts, as for :func:`~omni_ckpt.save`.
        url: a committed checkpoint directory.
        process_group: only its rank and size are used (for per-rank objects); no collectives.
        strict: raise when a requested entry is missing from the checkpoint.
        io_threads: reader threads (byte ranges of all files in parallel).

    Raises:
        CheckpointError: not committed; a manifest, header, object or data checksum mismatch, a malformed
            manifest, saved boxes with a gap or overlap (tensor and region named), a truncated data file; a
            requested entry is missing (named); a saved object differs across ranks and the world size
            changed (named).
        ValueError: a tensor's global shape differs from the saved one (named).
    """
    if process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    rank = dist.get_rank(process_group) if process_group is not None else 0
    world = dist.get_world_size(process_group) if process_group is not None else 1
    with gc_paused():
        return _load(state_dict, url, rank, world, strict, io_threads)


@dataclass(slots=True)
class _Read:
    """Bytes ``[lo, hi)`` of saved box ``b`` (manifest entry) holding block ``inter`` of it, for ``dest``."""

    lo: int
    hi: int
    name: str
    b: list[Any]
    sbox: Box
    inter: Box
    dest: torch.Tensor
    dtype: torch.dtype


def _load(
    state_dict: MutableMapping[Any, Any], url: str, rank: int, world: int, strict: bool, threads: int
) -> LoadResult:
    verified = _verify_manifest(url)
    manifest = verified.manifest
    fs, path = open_url(url)
    saved = manifest["tensors"]
    chunk = manifest["chunk_bytes"]
    requested: set[str] = set()
    missing: list[str] = []
    objects_wanted: list[tuple[str, MutableMapping[Any, Any], Any]] = []
    placeholders: list[PlaceholderRef] = []
    reads: dict[int, list[_Read]] = {}
    full = verified.full
    n_tensors = 0
    for name, container, key, value in flatten_state(state_dict, placeholders):
        requested.add(name)
        if not is_tensor_leaf(value):
            objects_wanted.append((name, container, key))
            continue
        entry = saved.get(name)
        if entry is None:
            missing.append(name)
            continue
        dt, shape, boxes = verified.tensors[name]
        gshape, _, pieces = describe(value, full)
        if shape != tuple(gshape):
            raise ValueError(f"tensor {name!r}: checkpoint shape {shape}, state dict shape {tuple(gshape)}")
        n_tensors += 1
        saved_dtype = dtype_from_name(dt)
        item = saved_dtype.itemsize
        for piece in pieces:
            for sbox, b in boxes:
                inter = sbox if sbox is piece.box or sbox == piece.box else piece.box.intersect(sbox)
                if inter is None:
                    continue
                if inter == sbox:
                    lo, hi = 0, b[4]
                else:
                    strides = _strides(sbox.sizes)
                    first = sum((o - so) * s for o, so, s in zip(inter.offsets, sbox.offsets, strides))
                    last = sum((e - 1 - so) * s for e, so, s in zip(inter.ends, sbox.offsets, strides))
                    lo = (first * item) // chunk * chunk
                    hi = min(-(-((last + 1) * item) // chunk) * chunk, b[4])
                whole = inter is piece.box or inter == piece.box
                dest = piece.view if whole else piece.view[inter.slices(piece.box.offsets)]
                reads.setdefault(b[2], []).append(_Read(lo, hi, name, b, sbox, inter, dest, saved_dtype))
    # Plain objects are read and checked before any tensor byte lands in the target.
    objects, differ = {}, set()
    if objects_wanted or placeholders:
        objects, differ = read_objects(url, manifest, rank, world)
    absent, complete = _resolve_placeholders(placeholders, saved, objects, strict, url)
    skip = {n for ph in absent for n in ph[3]}
    if strict:
        lost = [n for n in missing if n not in skip]
        if lost:
            raise CheckpointError(f"{url}: tensor {lost[0]!r} is not in the checkpoint")
    assign = []
    for name, container, key in objects_wanted:
        if name in objects:
            assign.append((container, key, objects[name]))
        elif name in skip:
            continue
        elif name in differ:
            raise CheckpointError(
                f"{url}: object {name!r} differs across the {manifest['world_size']} saved ranks and the "
                f"world size is now {world}; save it under per-rank names to reshard it"
            )
        elif strict:
            raise CheckpointError(f"{url}: object {name!r} is not in the checkpoint")
    bytes_read = _read_tensors(fs, path, verified, reads, chunk, threads)
    for container, key, value in assign:
        container[key] = value
    for _, parent, key, _ in complete:
        parent[key] = dict(parent[key])
    for _, parent, key, _ in absent:
        del parent[key]
    unused = sorted((set(saved) | set(objects) | differ) - requested)
    return LoadResult(n_tensors, len(assign), bytes_read, unused, sorted(ph[0] for ph in absent))


def _resolve_placeholders(
    placeholders: list[PlaceholderRef], saved: dict[str, Any], objects: dict[str, Any], strict: bool, url: str
) -> tuple[list[PlaceholderRef], list[PlaceholderRef]]:
    """Split placeholders into those the checkpoint holds nothing of and those it holds whole.

    Raises:
        CheckpointError: (strict) a placeholder only partly in the checkpoint, naming what is missing.
    """
    absent, complete = [], []
    for ph in placeholders:
        have = [n for n in ph[3] if n in saved or n in objects]
        if not have and ph[3]:
            absent.append(ph)
        elif len(have) == len(ph[3]):
            complete.append(ph)
        elif strict:
            lost = sorted(set(ph[3]) - set(have))
            raise CheckpointError(f"{url}: {ph[0]!r} is only partly in the checkpoint: {lost[:4]} missing")
    return absent, complete


def _read_tensors(
    fs: Any, path: str, v: _Verified, reads: dict[int, list[_Read]], chunk: int, threads: int
) -> int:
    """Check every data file's header and size, then read and verify all ``reads`` with ``threads``
    threads (the header and size checks come first, so a bad file raises before the target changes)."""
    m = v.manifest
    local = is_local(fs)
    fds: dict[int, int] = {}
    try:
        for file in reads:
            fname = join(path, m["files"][file])
            end, owner = v.file_end[file]
            if local:
                try:
                    fds[file] = fd = os.open(local_path(fs, fname), os.O_RDONLY)
                except FileNotFoundError:
                    raise CheckpointError(f"{fname}: data file missing") from None
                size = os.fstat(fd).st_size
            else:
                size = fs.size(fname)
            if size < end:
                raise CheckpointError(
                    f"{fname}: truncated, {size} bytes but the manifest places {owner} in it"
                )
            start = m["data_start"][file]
            (head,) = read_spans(fs, fname, [(0, start)], fd=fds.get(file))
            if crc(head) != m["header_crc"][file]:
                raise CheckpointError(f"{fname}: header checksum mismatch (bytes [0, {start}))")
        jobs = []
        step = max(chunk, _JOB_BYTES // chunk * chunk)  # chunk-aligned, so each job verifies whole chunks
        for file, todo in reads.items():
            fname = join(path, m["files"][file])
            fd = fds.get(file)
            rest = []
            for r in todo:
                if fd is not None and _direct(r):
                    for lo in range(0, r.hi, step):
                        jobs.append((_read_direct, (fd, fname, r, lo, min(lo + step, r.hi), chunk)))
                else:
                    rest.append(r)
            groups = coalesce([(r.b[3] + r.lo, r.b[3] + r.hi) for r in rest], 1 << 20, 64 << 20)
            if fd is None:  # remote: one cat_ranges call for the whole file, verify and copy in threads
                views = read_spans(fs, fname, [(lo, hi) for lo, hi, _ in groups])
                for (lo, _, members), view in zip(groups, views):
                    jobs.append((_copy_group, (fname, view, lo, [rest[k] for k in members], chunk)))
            else:
                for lo, hi, members in groups:
                    jobs.append((_read_group, (fd, fname, lo, hi, [rest[k] for k in members], chunk)))
        if threads <= 1 or len(jobs) <= 1:
            return sum(fn(*args) for fn, args in jobs)
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="omni-ckpt-read") as ex:
            return sum(f.result() for f in [ex.submit(fn, *args) for fn, args in jobs])
    finally:
        for fd in fds.values():
            os.close(fd)


def _read_direct(fd: int, fname: str, r: _Read, lo: int, hi: int, chunk: int) -> int:
    """Read bytes ``[lo, hi)`` (``lo`` chunk-aligned) of a whole saved box straight into its contiguous
    target, checksumming each window right after reading it, while it is still in cache."""
    buf = memoryview(r.dest.reshape(-1).view(torch.uint8).numpy())
    for c0 in range(lo, hi, chunk):
        c1 = min(c0 + chunk, hi)
        value = 0
        for a in range(c0, c1, WINDOW_BYTES):
            sub = buf[a : min(a + WINDOW_BYTES, c1)]
            pread_into(fd, sub, r.b[3] + a, fname)
            value = crc(sub, value)
        if value != r.b[5][c0 // chunk]:
            _verify(buf[c0:c1], c0, c1, r.b, chunk, fname, r.name)  # raises, naming the chunk
    return hi - lo


def _read_group(fd: int, fname: str, lo: int, hi: int, members: list[_Read], chunk: int) -> int:
    buf = memoryview(bytearray(hi - lo))
    pread_into(fd, buf, lo, fname)
    return _copy_group(fname, buf, lo, members, chunk)


def _copy_group(fname: str, view: memoryview, lo: int, members: list[_Read], chunk: int) -> int:
    """Verify and copy every read inside one coalesced span ``view`` (file bytes from ``lo``)."""
    n = 0
    for r in members:
        a = r.b[3] + r.lo - lo
        part = view[a : a + r.hi - r.lo]
        _verify(part, r.lo, r.hi, r.b, chunk, fname, r.name)
        host = host_bytes(r.dest) if r.inter is r.sbox and r.dest.dtype == r.dtype else None
        if host is not None and r.lo == 0 and tuple(r.dest.shape) == r.sbox.sizes:
            memoryview(host)[:] = part  # a whole box into a contiguous host tensor: one memcpy
        else:
            r.dest.copy_(_box_view(part, r.lo, r.sbox, r.inter, r.dtype))
        n += r.hi - r.lo
    return n


def _direct(r: _Read) -> bool:
    return (
        r.hi >= _DIRECT_BYTES
        and r.lo == 0
        and r.hi == r.b[4]
        and r.inter == r.sbox
        and r.dest.dtype == r.dtype
        and r.dest.device.type == "cpu"
        and r.dest.is_contiguous()
        and tuple(r.dest.shape) == r.sbox.sizes
    )


def _verify(view: memoryview, lo: int, hi: int, b: list[Any], chunk: int, fname: str, name: str) -> None:
    """Check bytes ``[lo, hi)`` of saved box ``b`` (``view`` holds exactly them) against its chunk CRCs;
    ``lo`` is chunk-aligned and ``hi`` is a chunk end or the box end."""
    crcs = b[5]
    if len(crcs) == 1:
        if crc(view) != crcs[0]:
            raise CheckpointError(
                f"{fname}: checksum mismatch in tensor {name!r} box offsets={tuple(b[0])} (bytes [{b[3]}, {b[3] + b[4]}))"
            )
        return
    for c in range(lo // chunk, chunk_count(hi, chunk) if hi else 1):
        a = c * chunk - lo
        if crc(view[a : min(a + chunk, hi - lo)]) != crcs[c]:
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
