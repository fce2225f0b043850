"""N-D boxes: the unit every tensor shard is described by, and the arithmetic on them.

A box is a dense row-major block ``[offsets, offsets + sizes)`` of a tensor with a known global shape.
Flat ZeRO/FSDP shards become at most ``2 * ndim - 1`` boxes (:func:`flat_range_to_boxes`), so a flat
slice can be saved by the rank that holds it, with no point-to-point exchange (MegaScale-Omni §7,
"non-P2P operations ... through offset and length-based indexing").
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CORNER_WORK", "Box", "box_difference", "check_boxes", "flat_range_to_boxes"]


@dataclass(frozen=True, slots=True)
class Box:
    """A dense block of an N-D tensor: element ``[o0 + i0, ..., on + in]`` for ``0 <= ik < sizes[k]``.

    Attributes:
        offsets: start index per dimension (elements).
        sizes: extent per dimension (elements); a zero size makes the box empty.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"Box: offsets {self.offsets} and sizes {self.sizes} differ in rank")
        if self.sizes and min(*self.offsets, *self.sizes) < 0:
            raise ValueError(f"Box: negative offsets or sizes: offsets={self.offsets}, sizes={self.sizes}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(shape) if type(shape) is tuple else tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def slices(self, origin: Sequence[int] | None = None) -> tuple[slice, ...]:
        """Index slices of this box, relative to ``origin`` (default: the tensor's origin)."""
        origin = origin if origin is not None else (0,) * self.ndim
        return tuple(slice(o - b, o - b + s) for o, s, b in zip(self.offsets, self.sizes, origin))

    def intersect(self, other: Box) -> Box | None:
        """The common block of two boxes, or None when they do not overlap (or one is empty)."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if self.numel == 0 or other.numel == 0 or any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(e <= s for e, s in zip(self.ends, shape))


def flat_range_to_boxes(global_shape: Sequence[int], start: int, length: int) -> list[Box]:
    """The fewest boxes that exactly cover the flat (row-major) element range ``[start, start+length)``.

    Each box is itself contiguous in flat order and the boxes come in flat order, so a flat shard's
    local 1-D tensor splits into them by consecutive slices. For 2-D: head partial row, block of full
    rows, tail partial row; for N-D at most ``2 * ndim - 1`` boxes (a suffix of the first row, recursively,
    one block of full rows, a prefix of the last row, recursively).

    Args:
        global_shape: shape of the whole tensor ``(d0, ..., dn-1)``.
        start: first flat element index.
        length: number of elements (>= 0).

    Raises:
        TypeError: ``start`` or ``length`` is not an integer.
        ValueError: the range is negative or runs past the tensor's ``numel``.
    """
    shape = tuple(int(s) for s in global_shape)
    numel = math.prod(shape)
    start, length = operator.index(start), operator.index(length)
    if start < 0 or length < 0 or start + length > numel:
        raise ValueError(
            f"flat range [{start}, {start + length}) outside a tensor of shape {shape} ({numel} elements)"
        )
    out: list[Box] = []
    _flat_boxes(shape, start, start + length, (), out)
    return out


def _flat_boxes(shape: tuple[int, ...], lo: int, hi: int, prefix: tuple[int, ...], out: list[Box]) -> None:
    if hi <= lo:
        return
    if not shape:
        out.append(Box(prefix, (1,) * len(prefix)))
        return
    inner = math.prod(shape[1:])
    pre_sizes = (1,) * len(prefix)
    r0, r1 = lo // inner, (hi - 1) // inner
    if r0 == r1 and not (lo % inner == 0 and hi % inner == 0):
        _flat_boxes(shape[1:], lo - r0 * inner, hi - r0 * inner, (*prefix, r0), out)
        return
    body_lo = r0
    if lo % inner:
        _flat_boxes(shape[1:], lo % inner, inner, (*prefix, r0), out)
        body_lo = r0 + 1
    body_hi = r1 + 1 if hi % inner == 0 else r1
    if body_hi > body_lo:
        out.append(
            Box((*prefix, body_lo, *(0,) * (len(shape) - 1)), (*pre_sizes, body_hi - body_lo, *shape[1:]))
        )
    if hi % inner:
        _flat_boxes(shape[1:], 0, hi % inner, (*prefix, r1), out)


def box_difference(a: Box, b: Box) -> list[Box]:
    """``a`` minus ``b`` as at most ``2 * ndim`` disjoint boxes (slab decomposition, dim by dim)."""
    inter = a.intersect(b)
    if inter is None:
        return [a] if a.numel else []
    out: list[Box] = []
    offs, sizes = list(a.offsets), list(a.sizes)
    for d in range(a.ndim):
        if inter.offsets[d] > offs[d]:
            s = list(sizes)
            s[d] = inter.offsets[d] - offs[d]
            out.append(Box(tuple(offs), tuple(s)))
        if inter.ends[d] < offs[d] + sizes[d]:
            o = list(offs)
            s = list(sizes)
            o[d] = inter.ends[d]
            s[d] = offs[d] + sizes[d] - inter.ends[d]
            out.append(Box(tuple(o), tuple(s)))
        offs[d], sizes[d] = inter.offsets[d], inter.sizes[d]
    return out


def check_boxes(name: str, shape: Sequence[int], boxes: Sequence[Box]) -> None:
    """Check that ``boxes`` are in bounds, pairwise disjoint and together cover ``shape`` exactly.

    Exactness is decided without per-element work: the boxes tile the tensor exactly when the sum of
    their indicator functions equals the tensor's, which holds exactly when their signed corner counts
    (the mixed finite difference of that sum: +-1 at each of a box's ``2**ndim`` corners) equal the
    tensor's. The corners are summed one dimension at a time, sorted by coordinate, and equal
    cross-sections that end and start at the same coordinate cancel before the next dimension (a row,
    column or flat-range sharding cancels almost entirely), so a tiling costs ``O(n log n)`` for ``n``
    boxes in practice and at most :data:`CORNER_WORK` corner entries per box and dimension (Klee-style
    sweep; the same identity underlies inclusion-exclusion over box corners).

    Raises:
        ValueError: naming the tensor and the offending box, overlapping region, missing region, or that
            the boxes are too fragmented to verify within the corner budget.
    """
    shape = tuple(shape)
    for b in boxes:
        if not b.within(shape):
            raise ValueError(
                f"tensor {name!r}: box offsets={b.offsets} sizes={b.sizes} outside shape {shape}"
            )
    if len(boxes) == 1 and boxes[0].offsets == (0,) * len(shape) and boxes[0].sizes == shape:
        return
    total = math.prod(shape)
    full = [b for b in boxes if b.numel]
    covered = sum(b.numel for b in full)
    point = _first_defect(name, shape, full) if total else None
    if covered == total and point is None:
        return
    if point is None:  # an empty tensor with non-empty boxes cannot pass the bounds check above
        raise ValueError(f"tensor {name!r} of shape {shape}: boxes cover {covered} of {total} elements")
    holders = [b for b in full if all(o <= p < e for o, p, e in zip(b.offsets, point, b.ends))]
    if len(holders) >= 2:
        inter = holders[0].intersect(holders[1])
        assert inter is not None
        raise ValueError(
            f"tensor {name!r}: boxes overlap at offsets={inter.offsets} sizes={inter.sizes} (box "
            f"offsets={holders[0].offsets} sizes={holders[0].sizes} and box offsets={holders[1].offsets} "
            f"sizes={holders[1].sizes}; element {point} is covered {len(holders)} times)"
        )
    raise ValueError(
        f"tensor {name!r} of shape {shape}: boxes cover {covered} of {total} elements; "
        f"missing {_missing_region(shape, full, point)}"
    )


CORNER_WORK = 64
"""Corner entries allowed per box and dimension in :func:`check_boxes` (plus a fixed 2**20): a tiling
from flat ranges or DTensor placements needs a few; past the budget the boxes are refused as too
fragmented, so a crafted manifest cannot make the check run for long."""


def _first_defect(name: str, shape: tuple[int, ...], boxes: list[Box]) -> tuple[int, ...] | None:
    """The row-major first element covered other than exactly once by ``boxes`` (all inside ``shape``),
    or None when they tile it.

    The signed corner counts of the boxes minus those of the tensor are summed dimension by dimension.
    Their lexicographically first non-zero corner ``p`` is such an element: the coverage excess at ``p``
    is the sum of the counts at corners ``q <= p`` (componentwise), and every such ``q != p`` comes
    earlier in row-major order, so it equals the (non-zero) count at ``p`` itself.
    """
    budget = CORNER_WORK * (len(boxes) + 1) * max(len(shape), 1) + (1 << 20)
    cur: dict[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], int] = {
        ((), (0,) * len(shape), shape): -1
    }
    for b in boxes:
        key = ((), b.offsets, b.sizes)
        cur[key] = cur.get(key, 0) + 1
    work = 0
    for _ in shape:
        work += len(cur)
        if work > budget:
            raise ValueError(
                f"tensor {name!r} of shape {shape}: {len(boxes)} boxes too fragmented to verify "
                f"(over {budget} corner entries)"
            )
        nxt: dict[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], int] = {}
        for (prefix, offs, sizes), c in cur.items():
            if c:
                rest_o, rest_s = offs[1:], sizes[1:]
                lo = (*prefix, offs[0]), rest_o, rest_s
                hi = (*prefix, offs[0] + sizes[0]), rest_o, rest_s
                nxt[lo] = nxt.get(lo, 0) + c
                nxt[hi] = nxt.get(hi, 0) - c
        cur = nxt
    left = [key[0] for key, c in cur.items() if c]
    return min(left) if left else None


def _missing_region(shape: tuple[int, ...], boxes: list[Box], point: tuple[int, ...]) -> str:
    """The uncovered region as boxes (the first four), or the first uncovered element when subtracting
    every box would split the region into too many pieces to list cheaply."""
    if len(boxes) > 1024:
        return f"element {point}"
    missing = [Box.full(shape)]
    for b in boxes:
        missing = [m for piece in missing for m in box_difference(piece, b)]
        if not missing or len(missing) > 4096:
            break
    if not missing or len(missing) > 4096:
        return f"element {point}"
    region = ", ".join(f"offsets={m.offsets} sizes={m.sizes}" for m in missing[:4])
    return region + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else "")
