"""State that loads into any parallel layout, pipeline parallelism included: name-keyed optimizer state
without per-rank membership lists, and per-replica plain state (data-loader positions) as tensor rows.

Why :func:`~omni_ckpt.optimizer_state_dict` alone is not enough under pipeline parallelism: it lists, in
each of its ``param_groups``, the names of the parameters *this rank* holds, and it lists this rank's
parameters without state under ``no_state``. Plain objects are saved per rank and load under another
world size only when every saved rank holds the same value (:func:`omni_ckpt.load`); pipeline ranks hold
different parameters, so those lists differ and a checkpoint saved at pp=2 does not load into one process.
:func:`portable_optimizer_state_dict` leaves both lists out: the state tensors stay keyed by parameter name
(each saved once, by a rank that holds it), the groups keep their hyperparameters only, and
:func:`load_portable_optimizer_state_dict` takes group membership from the loading optimizer itself (which
its own layout decided). A parameter whose state the checkpoint lacks resumes with none, as with
:func:`~omni_ckpt.load_optimizer_state_dict` (its placeholder is removed by the load).

Per-replica plain state (each DP replica's loader position, a msgpack-serialisable value) differs across
ranks too; :func:`object_rows` stores it as row ``index`` of a ``uint8`` tensor of rows (msgpack bytes with
an 8-byte little-endian length prefix, zero padded to a common power-of-two width), which any rank of any
later layout reads with :func:`load_object_rows` (every row is checksummed like any tensor). Its two
halves are public for callers that serialise ahead or lay rows out themselves: :func:`byte_rows` takes
bytes already msgpack-encoded (a loader snapshot made on the loader's thread) and :func:`decode_row` reads
one loaded row (omni-train's checkpoint keeps ``[dp, positions, width]`` rows and reads ranges of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from omni_ckpt.load import load
from omni_ckpt.optim import load_optimizer_state_dict, optimizer_state_dict
from omni_ckpt.sharding import BoxShard

__all__ = [
    "byte_rows",
    "decode_row",
    "load_object_rows",
    "load_portable_optimizer_state_dict",
    "object_rows",
    "portable_optimizer_state_dict",
]

_MIN_WIDTH = 4096
# per-parameter moments of torch's optimizers, each the shape of its parameter
_MOMENTS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"})


def portable_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """:func:`~omni_ckpt.optimizer_state_dict` without its per-rank lists (see the module docstring):
    ``{"state": {name: {...} or Placeholder}, "param_groups": [hyperparameters]}``. Save it, or load into it.

    Raises:
        ValueError: a parameter of the optimizer is not in ``model``.
    """
    sd = optimizer_state_dict(model, optimizer)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return {"state": sd["state"], "param_groups": groups}


def load_portable_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Give ``optimizer`` the loaded ``state`` (a :func:`portable_optimizer_state_dict`, filled by a load):
    the moments by name, the hyperparameters by group position, group membership its own.

    Raises:
        ValueError: the state has another number of parameter groups than ``optimizer``, names a
            parameter the optimizer does not hold, or holds a moment of torch's optimizers (``exp_avg``,
            ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``) whose shape is not its parameter's.
    """
    params = dict(model.named_parameters())
    for name, entry in state["state"].items():
        if not isinstance(entry, dict) or name not in params:
            continue  # a placeholder the load did not fill; an unknown name is refused below
        for key in sorted(_MOMENTS & set(entry)):  # sorted: the same moment is named on every run
            value = entry[key]
            if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"optimizer state {name!r}: {key} has shape {tuple(value.shape)}, the parameter has "
                    f"shape {tuple(params[name].shape)}"
                )
    members = [g["params"] for g in optimizer_state_dict(model, optimizer)["param_groups"]]
    groups = state["param_groups"]
    if len(groups) != len(members):
        raise ValueError(
            f"optimizer state has {len(groups)} parameter groups, the optimizer has {len(members)}"
        )
    load_optimizer_state_dict(
        model,
        optimizer,
        {"state": state["state"], "param_groups": [dict(g, params=m) for g, m in zip(groups, members)]},
    )


def object_rows(
    value: Any,
    index: Sequence[int],
    shape: Sequence[int],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``value`` as row ``index`` of a ``uint8 [*shape, width]`` tensor of rows, to put in a saved state.

    Collective over ``process_group`` (default: the world, when initialised): one all-reduce agrees on the
    width. Ranks passing the same ``index`` must pass the same value (replicas of one state); one of them
    is written. Every index of ``shape`` must be passed by some rank.

    Args:
        value: msgpack-serialisable plain data (e.g. an omni-data loader's ``state_dict()``).
        index: this value's row, e.g. ``(dp_rank,)`` or ``(dp_rank, pp_rank)``.
        shape: rows per dimension, e.g. ``(dp,)``.

    Returns:
        ``{"shape": [...], "width": int, "rows": BoxShard}``.

    Raises:
        ValueError: ``index`` outside ``shape``.
    """
    rows = byte_rows(msgpack.packb(value), index, shape, process_group=process_group, what="object_rows")
    return {"shape": [int(s) for s in shape], "width": rows.global_shape[-1], "rows": rows}


def byte_rows(
    blob: bytes,
    index: Sequence[int],
    shape: Sequence[int],
    *,
    process_group: dist.ProcessGroup | None = None,
    what: str = "byte_rows",
) -> BoxShard:
    """Already-serialised msgpack ``blob`` (e.g. a loader snapshot's bytes, made ahead on another thread)
    as row ``index`` of a ``uint8 [*shape, width]`` tensor: an 8-byte little-endian length, the bytes, zero
    padding to ``width``, the ranks' common power of two (at least 4096), which keeps the tensor's shape,
    and so the manager's cached save plan, stable over saves. Collective as :func:`object_rows` (one
    all-reduce over ``process_group`` agrees on the width: ``global_shape[-1]`` of the result); read a row
    back with :func:`decode_row`.

    Raises:
        ValueError: ``index`` outside ``shape`` (named with ``what``).
    """
    index, shape = tuple(int(i) for i in index), tuple(int(s) for s in shape)
    if len(index) != len(shape) or not all(0 <= i < s for i, s in zip(index, shape)):
        raise ValueError(f"{what}: index {index} is outside shape {shape}")
    need = torch.tensor([8 + len(blob)], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=process_group)
    width = max(_MIN_WIDTH, 1 << (int(need) - 1).bit_length())
    row = torch.zeros(width, dtype=torch.uint8)
    row[:8] = torch.frombuffer(bytearray(len(blob).to_bytes(8, "little")), dtype=torch.uint8)
    row[8 : 8 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    local = row.reshape(*([1] * len(shape)), width)
    return BoxShard(local, (*shape, width), (*index, 0))


def decode_row(row: torch.Tensor, what: str) -> Any:
    """The value one row of :func:`byte_rows` / :func:`object_rows` holds (``row``: ``uint8 [width]``,
    loaded; checksums were checked by the load).

    Raises:
        ValueError: the length prefix does not fit the row (``"<what>: length N does not fit the row of M
            bytes"``).
    """
    raw = row.reshape(-1).numpy().tobytes()
    n = int.from_bytes(raw[:8], "little")
    if not 0 < n <= len(raw) - 8:
        raise ValueError(f"{what}: length {n} does not fit the row of {len(raw) - 8} bytes")
    return msgpack.unpackb(raw[8 : 8 + n], strict_map_key=False)


def load_object_rows(url: str, key: str, indices: Sequence[Sequence[int]]) -> list[Any]:
    """The values :func:`object_rows` saved under ``state[key]`` at each of ``indices`` (no collectives).

    Args:
        url: the checkpoint step (``CheckpointManager.step_url(step)``).
        key: the top-level key the rows were saved under.
        indices: rows to read, e.g. ``[(dp_rank,)]``, or every old replica's to re-split a loader.

    Raises:
        ValueError: an index outside the saved shape, or a row whose length prefix exceeds it (named).
        omni_ckpt.CheckpointError: as :func:`omni_ckpt.load` (the key missing, a checksum mismatch).
    """
    head: dict[str, Any] = {key: {"shape": None, "width": None}}
    load(head, url)
    shape, width = tuple(int(s) for s in head[key]["shape"]), int(head[key]["width"])
    out = []
    for idx in indices:
        idx = tuple(int(i) for i in idx)
        if len(idx) != len(shape) or not all(0 <= i < s for i, s in zip(idx, shape)):
            raise ValueError(f"{url}: {key} row {idx} is outside the saved rows {shape}")
        local = torch.zeros(*([1] * len(shape)), width, dtype=torch.uint8)
        load({key: {"rows": BoxShard(local, (*shape, width), (*idx, 0))}}, url)
        out.append(decode_row(local, f"{url}: {key} row {idx}"))
    return out
