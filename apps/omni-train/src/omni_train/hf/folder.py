"""Reading and writing Hugging Face model folders: ``config.json`` and safetensors weights.

A folder holds ``config.json`` and either one ``model.safetensors`` or shards ``model-0000i-of-0000n.safetensors``
indexed by ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name:
file}}``), the layout ``PreTrainedModel.save_pretrained`` writes and ``from_pretrained`` reads.

Folders are untrusted input: JSON files are size-bounded and must be objects, shard names in an index must
be plain file names inside the folder, tensors are read with ``safetensors`` (no pickle; it checks header
and byte ranges) and every tensor the index names must be in the file it names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

__all__ = ["HFFolderError", "read_config", "read_weights", "write_folder"]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_JSON_BYTES = 16 << 20
DEFAULT_SHARD_BYTES = 5 << 30  # save_pretrained's default max_shard_size ("5GB")


class HFFolderError(ValueError):
    """A Hugging Face folder is missing a file or holds a malformed one (the message names it)."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HFFolderError(f"{path}: no such file")
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise HFFolderError(f"{path}: {size} bytes, more than the {MAX_JSON_BYTES} a JSON file may hold")
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFFolderError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise HFFolderError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_config(folder: str | Path) -> dict[str, Any]:
    """The folder's ``config.json`` as a dict.

    Raises:
        HFFolderError: missing, too large, not JSON, or not an object.
    """
    return _read_json(Path(folder) / CONFIG)


def _shard_files(folder: Path) -> dict[str, list[str]]:
    """``{file: [tensor names]}`` from the index, or ``{model.safetensors: []}`` (names from the file)."""
    index = folder / INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFFolderError(f"{index}: 'weight_map' must be a non-empty object of name -> file")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                raise HFFolderError(f"{index}: tensor {name!r} maps to {file!r}, not a file in the folder")
            files.setdefault(file, []).append(name)
        return files
    if (folder / SINGLE).is_file():
        return {SINGLE: []}
    raise HFFolderError(f"{folder}: neither {SINGLE} nor {INDEX}")


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors weights (single file or sharded index), on the CPU.

    Raises:
        HFFolderError: no weights, an index naming a file outside the folder or a tensor its file lacks, a
            tensor in two shards, or a file safetensors cannot parse.
    """
    folder = Path(folder)
    out: dict[str, torch.Tensor] = {}
    for file, names in _shard_files(folder).items():
        path = folder / file
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                missing = sorted(set(names) - keys)
                if missing:
                    raise HFFolderError(f"{path}: the index puts {missing[:3]} here, the file lacks them")
                for name in sorted(keys):
                    if name in out:
                        raise HFFolderError(f"{path}: tensor {name!r} is also in another shard")
                    out[name] = f.get_tensor(name)
        except (OSError, safetensors.SafetensorError) as exc:
            raise HFFolderError(f"{path}: cannot read safetensors ({exc})") from None
    return out


def write_folder(
    folder: str | Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[str]:
    """Write ``config.json`` and the weights: one ``model.safetensors`` if they fit in ``max_shard_bytes``,
    else shards in name order, each at most ``max_shard_bytes`` (or one tensor), with their index.

    Returns:
        the weight files written, in order.

    Raises:
        ValueError: ``max_shard_bytes < 1``.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        # A copy: slices of one tensor (Q/K/V of a fused projection) share storage, which safetensors refuses.
        t = tensors[name].detach().cpu().clone(memory_format=torch.contiguous_format)
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for stale in [folder / SINGLE, folder / INDEX, *folder.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    meta = {"format": "pt"}
    if len(shards) == 1:
        safetensors.torch.save_file(shards[0], str(folder / SINGLE), metadata=meta)
        return [SINGLE]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(files, shards):
        safetensors.torch.save_file(shard, str(folder / file), metadata=meta)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": {name: file for file, shard in zip(files, shards) for name in shard},
    }
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files
