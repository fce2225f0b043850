"""How a rank's value of a state-dict entry maps onto the global tensor: lists of (box, local view).

Three descriptions cover the layouts a trainer has:

- a plain ``torch.Tensor`` is *replicated*: every rank that holds it holds the whole tensor; the save plan
  picks one writer, so it is written once;
- :class:`BoxShard` is one N-D block (a TP row or column shard, a CP chunk, a DTensor's local shard);
- :class:`FlatShard` is a ZeRO/FSDP flat slice: ``numel`` consecutive elements of the flattened tensor,
  turned into at most ``2 * ndim - 1`` boxes by :func:`~omni_ckpt.box.flat_range_to_boxes`;
- a ``DTensor`` is described from its mesh coordinate and placements by :func:`dtensor_box`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from omni_ckpt.box import Box, flat_range_to_boxes

__all__ = ["BoxShard", "FlatShard", "Piece", "describe", "dtensor_box", "is_tensor_leaf"]


@dataclass(frozen=True)
class FlatShard:
    """A ZeRO/FSDP flat slice: ``local`` holds flat elements ``[flat_offset, flat_offset + local.numel())``.

    Attributes:
        local: 1-D tensor ``[n]`` (any dtype); loading writes into it in place.
        global_shape: shape of the whole (unflattened) tensor.
        flat_offset: index of ``local[0]`` in the row-major flattening of the whole tensor (elements).

    Raises:
        ValueError: ``local`` is not 1-D, or the slice runs past the tensor.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    flat_offset: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        if self.local.dim() != 1:
            raise ValueError(f"FlatShard: local must be 1-D, got shape {tuple(self.local.shape)}")
        if self.flat_offset < 0 or self.flat_offset + self.local.numel() > math.prod(self.global_shape):
            raise ValueError(
                f"FlatShard: elements [{self.flat_offset}, {self.flat_offset + self.local.numel()}) outside "
                f"a tensor of shape {self.global_shape}"
            )


@dataclass(frozen=True)
class BoxShard:
    """One N-D block of a tensor: ``local`` is ``whole[offsets[0]:offsets[0]+local.shape[0], ...]``.

    Attributes:
        local: tensor of the block's shape ``(s0, ..., sn-1)``; loading writes into it in place.
        global_shape: shape of the whole tensor.
        offsets: the block's start per dimension (elements).

    Raises:
        ValueError: ranks differ or the block is out of bounds.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        box = Box(self.offsets, tuple(self.local.shape))
        if not box.within(self.global_shape):
            raise ValueError(
                f"BoxShard: block offsets={self.offsets} sizes={tuple(self.local.shape)} outside {self.global_shape}"
            )


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of a tensor and the local tensor view ``[*box.sizes]`` holding its elements."""

    box: Box
    view: torch.Tensor


def _chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    # torch.chunk semantics (what DTensor's Shard uses): ceil-sized chunks, trailing ones short or empty.
    size = -(-n // parts) if parts else 0
    start = min(index * size, n)
    return start, min(start + size, n) - start


def dtensor_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> Box:
    """The box a rank at mesh ``coordinate`` holds of a DTensor with ``placements``.

    ``Shard(d)`` on mesh dim ``m`` splits the current extent of tensor dim ``d`` as ``torch.chunk`` does
    (chunks of ``ceil(n / mesh_shape[m])``, trailing chunks short or empty); several mesh dims sharding the
    same tensor dim nest left to right, as DTensor does. ``Replicate`` leaves the extent alone.

    Raises:
        ValueError: a ``Partial`` placement (reduce it before saving) or a strided shard that is not a
            box (FSDP2 + TP's ``_StridedShard(d, split_factor)`` before ``Shard(d)`` over mesh dims of
            ``split_factor`` ranks in all is one: :func:`_split_order`); the message names the
            placement. ``mesh_shape``, ``coordinate`` and ``placements`` differ in length, a coordinate
            is outside the mesh, or a ``Shard`` dim is not a dim of the tensor.
    """
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise ValueError(
            f"dtensor_box: mesh_shape {tuple(mesh_shape)}, coordinate {tuple(coordinate)} and placements "
            f"{tuple(placements)} must have one entry per mesh dim"
        )
    for m, (c, n) in enumerate(zip(coordinate, mesh_shape)):
        if not 0 <= int(c) < int(n):
            raise ValueError(f"dtensor_box: coordinate {c} outside mesh dim {m} of size {n}")
    offsets = [0] * len(global_shape)
    sizes = [int(s) for s in global_shape]
    for m, p in _split_order(mesh_shape, placements):
        if isinstance(p, Shard):
            d = p.dim if p.dim >= 0 else p.dim + len(global_shape)
            if not 0 <= d < len(global_shape):
                raise ValueError(f"dtensor_box: {p} on a tensor of shape {tuple(global_shape)}")
            start, size = _chunk(sizes[d], int(mesh_shape[m]), int(coordinate[m]))
            offsets[d] += start
            sizes[d] = size
        elif not isinstance(p, Replicate):
            raise ValueError(f"dtensor_box: placement {p} cannot be saved; reduce Partial tensors first")
    return Box(tuple(offsets), tuple(sizes))


def _split_order(mesh_shape: Sequence[int], placements: Sequence[Placement]) -> list[tuple[int, Placement]]:
    """``(mesh dim, placement)`` in the order the splits nest, a strided shard as the plain ``Shard`` it
    is once moved after the later mesh dims sharding its tensor dim.

    FSDP2 over a TP DTensor (``fully_shard`` on a data mesh, the parameter ``Shard(d)`` over TP) holds
    chunk ``i`` (data rank) of chunk ``j`` (TP rank) of dim ``d``, as ``torch.chunk`` splits, and writes
    it as ``(_StridedShard(d, split_factor=tp), Shard(d))``: a box, split by TP first. A strided shard
    whose ``split_factor`` is not the product of the later ``Shard(d)`` mesh sizes is not one.

    Raises:
        ValueError: such a strided shard (the message names it).
    """
    order: list[tuple[int, Placement]] = []
    deferred: dict[int, tuple[int, int, int]] = {}  # tensor dim -> (mesh dim, split factor, sizes left)
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            if p.dim in deferred:
                raise ValueError(f"dtensor_box: two strided placements of dim {p.dim} are not a box")
            deferred[p.dim] = (m, p.split_factor, p.split_factor)
            continue
        order.append((m, p))
        if isinstance(p, Shard) and p.dim in deferred:
            first, factor, left = deferred[p.dim]
            if left % int(mesh_shape[m]):
                raise ValueError(
                    f"dtensor_box: strided placement {placements[first]} is not a box: mesh dim {m} of "
                    f"{mesh_shape[m]} ranks does not divide its split factor"
                )
            left //= int(mesh_shape[m])
            deferred[p.dim] = (first, factor, left)
            if left == 1:
                order.append((first, Shard(p.dim)))
                del deferred[p.dim]
    for dim, (first, _, _) in deferred.items():
        raise ValueError(
            f"dtensor_box: strided placement {placements[first]} (split factor not the later Shard({dim}) "
            "mesh sizes) is not a box; redistribute to Shard first"
        )
    return order


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


def is_tensor_leaf(value: object) -> bool:
    return isinstance(value, torch.Tensor | FlatShard | BoxShard)


def describe(
    value: torch.Tensor | FlatShard | BoxShard, full: dict[tuple[int, ...], Box] | None = None
) -> tuple[tuple[int, ...], torch.dtype, list[Piece]]:
    """``(global_shape, dtype, pieces)`` of one state-dict leaf on this rank; empty boxes are dropped.
    ``full`` memoises whole-tensor boxes by shape.

    Raises:
        ValueError: a DTensor whose placements are not boxes (see :func:`dtensor_box`).
    """
    if type(value) is torch.Tensor:  # the common case first: a plain replicated tensor
        shape = tuple(value.shape)
        box = full.get(shape) if full is not None else None
        if box is None:
            box = Box.full(shape)
            if full is not None:
                full[shape] = box
        return shape, value.dtype, [Piece(box, _plain(value))] if value.numel() else []
    if isinstance(value, FlatShard):
        local = _plain(value.local)
        pieces, pos = [], 0
        for box in flat_range_to_boxes(value.global_shape, value.flat_offset, local.numel()):
            pieces.append(Piece(box, local[pos : pos + box.numel].view(box.sizes)))
            pos += box.numel
        return value.global_shape, local.dtype, pieces
    if isinstance(value, BoxShard):
        box = Box(value.offsets, tuple(value.local.shape))
        return value.global_shape, value.local.dtype, [Piece(box, _plain(value.local))] if box.numel else []
    if isinstance(value, DTensor):
        shape = tuple(value.shape)
        coord = value.device_mesh.get_coordinate()
        if coord is None:
            return shape, value.dtype, []
        box = dtensor_box(shape, value.device_mesh.shape, coord, value.placements)
        local = _plain(value.to_local())
        if tuple(local.shape) != box.sizes:
            raise ValueError(f"DTensor local shape {tuple(local.shape)} differs from its box {box.sizes}")
        return shape, value.dtype, [Piece(box, local)] if box.numel else []
    shape = tuple(value.shape)
    box = Box.full(shape)
    return shape, value.dtype, [Piece(box, _plain(value))] if value.numel() else []
