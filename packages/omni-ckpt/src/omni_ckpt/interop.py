"""Interop: export a checkpoint to one safetensors or ``torch.save`` file; import a DCP checkpoint safely.

A DCP checkpoint is untrusted input, and DCP reads its ``.metadata`` with ``pickle.load`` and its
non-tensor entries with ``torch.load(weights_only=False)``, either of which runs whatever code the file
names. :func:`import_dcp` reads ``.metadata`` with an unpickler that resolves only DCP's own metadata
classes and a few inert torch and stdlib names (anything else raises before it is called), and every data
entry with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import safetensors.torch
import torch

from omni_ckpt.box import Box, check_boxes
from omni_ckpt.layout import dtype_from_name
from omni_ckpt.load import load, per_rank_objects, read_manifest
from omni_ckpt.save import save_ranks
from omni_ckpt.storage import CheckpointError, join, open_url, read_spans

__all__ = ["ExportFormat", "ExportResult", "export", "import_dcp", "read_full"]


class ExportFormat(StrEnum):
    """``safetensors``: one flat safetensors file of full tensors; ``torch``: one ``torch.save`` file."""

    SAFETENSORS = "safetensors"
    TORCH = "torch"


@dataclass
class ExportResult:
    """What an export wrote: tensor count, bytes of tensor data, and plain objects it could not hold."""

    tensors: int
    tensor_bytes: int
    skipped_objects: list[str]


def _all_objects(url: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Plain objects of every saved rank: a value equal on all ranks under its name, else
    ``name@rank<r>`` per rank."""
    per_rank = per_rank_objects(url, manifest)
    out: dict[str, Any] = {}
    for name in sorted({k for d in per_rank for k in d}):
        values = [d.get(name) for d in per_rank]
        if all(name in d for d in per_rank) and all(v == values[0] for v in values):
            out[name] = values[0]
        else:
            out.update({f"{name}@rank{r}": d[name] for r, d in enumerate(per_rank) if name in d})
    return out


def read_full(url: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of a checkpoint assembled whole, with its saved dtype, plus its plain objects.

    Needs host memory for the whole checkpoint. Raises: as :func:`omni_ckpt.load`.
    """
    manifest = read_manifest(url)
    tensors = {
        name: torch.empty(tuple(shape), dtype=dtype_from_name(dt))
        for name, (dt, shape, _) in manifest["tensors"].items()
    }
    load(tensors, url, process_group=None)
    return tensors, _all_objects(url, manifest)


def export(url: str, out: str, fmt: ExportFormat | str) -> ExportResult:
    """Write the whole checkpoint ``url`` to one file ``out`` (local path or fsspec URL).

    ``safetensors``: a flat ``{name: tensor}`` file; plain objects do not fit it and are listed in
    ``skipped_objects``. ``torch``: ``torch.save`` of ``{"tensors": {...}, "objects": {...}}``, loadable
    with ``torch.load(..., weights_only=True)``.

    Raises:
        ValueError: unknown format.
    """
    fmt = ExportFormat(fmt)
    tensors, objects = read_full(url)
    fs, path = open_url(out)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if fmt is ExportFormat.SAFETENSORS:
        data = safetensors.torch.save(tensors, metadata={"format": "pt", "source": url})
        with fs.open(path, "wb") as f:
            f.write(data)
        return ExportResult(len(tensors), nbytes, sorted(objects))
    with fs.open(path, "wb") as f:
        torch.save({"tensors": tensors, "objects": objects}, f)
    return ExportResult(len(tensors), nbytes, [])


MAX_DCP_METADATA_BYTES = 1 << 30

_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_GLOBALS = frozenset(
    {
        *(
            (_DCP_MD, n)
            for n in (
                "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        *(("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
        *(("builtins", n) for n in ("set", "frozenset", "tuple", "list", "dict", "slice", "complex")),
    }
)  # fmt: skip


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata classes, torch dtypes and :data:`_DCP_GLOBALS`; every other global
    (``os.system``, ``builtins.exec``, ``subprocess.Popen`` ...) raises before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"global {module}.{name} is not a DCP metadata type; refusing to load it"
        )


def read_dcp_metadata(dcp_dir: str) -> Any:
    """The ``Metadata`` of a DCP checkpoint, read with the restricted unpickler (no code runs).

    Raises:
        CheckpointError: no ``.metadata``, larger than :data:`MAX_DCP_METADATA_BYTES`, a global outside the
            allowed DCP types (named), or not a DCP ``Metadata``.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    fs, path = open_url(dcp_dir)
    mpath = join(path, ".metadata")
    if not fs.exists(mpath):
        raise CheckpointError(f"{dcp_dir}: no .metadata; not a DCP checkpoint")
    with fs.open(mpath, "rb") as f:
        raw = f.read(MAX_DCP_METADATA_BYTES + 1)
    if len(raw) > MAX_DCP_METADATA_BYTES:
        raise CheckpointError(f"{mpath}: larger than the {MAX_DCP_METADATA_BYTES}-byte limit")
    try:
        md = _DCPMetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:
        raise CheckpointError(f"{mpath}: refused ({type(exc).__name__}: {exc})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{mpath}: holds a {type(md).__name__}, not a DCP Metadata")
    return md


def _torch_load_safe(blob: memoryview, what: str) -> Any:
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{what}: not loadable with weights_only=True ({type(exc).__name__}: {exc})"
        ) from None


def import_dcp(dcp_dir: str, url: str) -> int:
    """Convert the ``torch.distributed.checkpoint`` directory ``dcp_dir`` into an omni-ckpt checkpoint at
    ``url`` (single process, whole tensors; needs host memory for the checkpoint).

    Reads DCP's default ``FileSystemWriter`` layout (``torch.save`` items in ``.distcp`` files) without
    pickle: see the module docstring. Names are DCP's flattened keys (``"model.layer.weight"``); non-tensor
    entries become plain objects. Every tensor's chunks must cover it exactly.

    Returns:
        the number of tensors imported.

    Raises:
        CheckpointError: a refused ``.metadata`` or data entry (named), a storage path outside ``dcp_dir``,
            DCP storage transforms (compression), a chunk of the wrong shape or dtype, chunks that leave a
            gap or overlap, or a tensor larger than the bytes stored for it.
        TypeError: a non-tensor DCP entry is not msgpack-serialisable (named).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md = read_dcp_metadata(dcp_dir)
    fs, path = open_url(dcp_dir)
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    stored: dict[str, int] = {}
    for index, info in md.storage_data.items():
        rel = info.relative_path
        if not isinstance(rel, str) or "/" in rel or "\\" in rel or rel in ("", ".", ".."):
            raise CheckpointError(f"{dcp_dir}: entry {index.fqn!r} points outside the checkpoint ({rel!r})")
        if info.transform_descriptors:
            raise CheckpointError(
                f"{dcp_dir}: entry {index.fqn!r} uses DCP storage transforms {info.transform_descriptors}; "
                "only untransformed checkpoints can be imported"
            )
        by_file.setdefault(rel, []).append((index, info))
        stored[index.fqn] = stored.get(index.fqn, 0) + int(info.length)
    state: dict[str, Any] = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if isinstance(tmd, TensorStorageMetadata):
            dtype, size = tmd.properties.dtype, tuple(int(s) for s in tmd.size)
            nbytes = dtype.itemsize * int(torch.Size(size).numel())
            if nbytes > stored.get(fqn, 0) and nbytes:
                raise CheckpointError(
                    f"{dcp_dir}: tensor {fqn!r} of shape {size} needs {nbytes} bytes, its entries hold {stored.get(fqn, 0)}"
                )
            try:
                check_boxes(fqn, size, [Box(tuple(c.offsets), tuple(c.sizes)) for c in tmd.chunks])
            except ValueError as exc:
                raise CheckpointError(
                    f"{dcp_dir}: DCP chunks do not cover the tensor exactly: {exc}"
                ) from None
            state[fqn] = torch.empty(size, dtype=dtype)
        elif not isinstance(tmd, BytesStorageMetadata):
            raise CheckpointError(f"{dcp_dir}: entry {fqn!r} has metadata of type {type(tmd).__name__}")
    filled: set[tuple[str, tuple[int, ...]]] = set()
    for rel, items in by_file.items():
        fname = join(path, rel)
        views = read_spans(fs, fname, [(int(i.offset), int(i.offset) + int(i.length)) for _, i in items])
        for (index, _), view in zip(items, views):
            what = f"{fname}: entry {index.fqn!r}"
            tmd = md.state_dict_metadata.get(index.fqn)
            if tmd is None:
                raise CheckpointError(f"{what} is not in the metadata")
            value = _torch_load_safe(view, what)
            if isinstance(tmd, BytesStorageMetadata):
                state[index.fqn] = value
                continue
            target = state[index.fqn]
            offsets = tuple(int(o) for o in index.offset)
            chunk = next((c for c in tmd.chunks if tuple(c.offsets) == offsets), None)
            if chunk is None or not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{what} at offsets {offsets} is not one of its chunks")
            box = Box(offsets, tuple(int(s) for s in chunk.sizes))
            if tuple(value.shape) != box.sizes or value.dtype != target.dtype:
                raise CheckpointError(
                    f"{what}: chunk of shape {tuple(value.shape)} {value.dtype}, metadata says {box.sizes} {target.dtype}"
                )
            target[box.slices()] = value
            filled.add((index.fqn, offsets))
    missing = [
        f"{fqn}@{tuple(c.offsets)}" if isinstance(tmd, TensorStorageMetadata) else fqn
        for fqn, tmd in md.state_dict_metadata.items()
        for c in (tmd.chunks if isinstance(tmd, TensorStorageMetadata) else [None])
        if (fqn not in state if c is None else (fqn, tuple(int(o) for o in c.offsets)) not in filled)
    ]
    if missing:
        raise CheckpointError(f"{dcp_dir}: entries {missing[:4]} have no stored data")
    save_ranks([state], url)  # this process alone: no collectives even inside a distributed job
    return sum(isinstance(v, torch.Tensor) for v in state.values())
