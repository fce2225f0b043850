"""Interop: export a checkpoint to one safetensors or ``torch.save`` file; import a DCP checkpoint."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack
import safetensors.torch
import torch

from omni_ckpt.layout import dtype_from_name
from omni_ckpt.load import load, read_manifest
from omni_ckpt.save import save_ranks
from omni_ckpt.storage import CheckpointError, join, open_url, read_ranges

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
    fs, path = open_url(url)
    per_rank = []
    for r, (file, offset, length, crc) in enumerate(manifest["objects"]):
        fname = join(path, manifest["files"][file])
        (view,) = read_ranges(fs, fname, [(offset, offset + length)])
        if zlib.crc32(view) != crc:
            raise CheckpointError(f"{fname}: checksum mismatch in the plain objects of rank {r}")
        per_rank.append(msgpack.unpackb(view, raw=False, strict_map_key=False))
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


def import_dcp(dcp_dir: str, url: str) -> int:
    """Convert the ``torch.distributed.checkpoint`` directory ``dcp_dir`` into an omni-ckpt checkpoint at
    ``url`` (single process, whole tensors; needs host memory for the checkpoint).

    DCP's own ``FileSystemReader`` reads its metadata and ``dcp.load(no_dist=True)`` its data; names are
    DCP's flattened keys (``"model.layer.weight"``). Non-tensor entries become plain objects.

    Returns:
        the number of tensors imported.

    Raises:
        TypeError: a non-tensor DCP entry is not msgpack-serialisable (named).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(dcp_dir)
    metadata = reader.read_metadata()
    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            state[fqn] = None
    dcp.load(state, storage_reader=reader, no_dist=True)
    save_ranks([state], url)  # this process alone: no collectives even inside a distributed job
    return sum(isinstance(v, torch.Tensor) for v in state.values())
