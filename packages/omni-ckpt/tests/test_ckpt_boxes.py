"""Box arithmetic against brute force: flat ranges, DTensor boxes (torch.chunk as reference), coverage."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from omni_ckpt import Box, flat_range_to_boxes
from omni_ckpt.box import box_difference, check_boxes
from omni_ckpt.sharding import dtensor_box

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


def _mark(shape, boxes):
    m = torch.zeros(shape, dtype=torch.int64)
    for b in boxes:
        m[b.slices()] += 1
    return m.reshape(-1)


@settings(max_examples=300, deadline=None)
@given(shape=shapes, data=st.data())
def test_flat_range_boxes_cover_exactly_the_range_in_order(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    length = data.draw(st.integers(0, n - start))
    boxes = flat_range_to_boxes(shape, start, length)
    expect = torch.zeros(n, dtype=torch.int64)
    expect[start : start + length] = 1
    assert torch.equal(_mark(shape, boxes), expect)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    # In flat order and each box contiguous in flat order: consecutive slices of the local 1-D shard.
    flat_ids = torch.arange(n).reshape(shape)
    got = (
        torch.cat([flat_ids[b.slices()].reshape(-1) for b in boxes])
        if boxes
        else torch.zeros(0, dtype=torch.int64)
    )
    assert torch.equal(got, torch.arange(start, start + length))
    # Fewest: no two consecutive boxes could merge into one box.
    for a, b in itertools.pairwise(boxes):
        lo, hi = tuple(map(min, a.offsets, b.offsets)), tuple(map(max, a.ends, b.ends))
        assert a.numel + b.numel != math.prod(h - x for x, h in zip(lo, hi)), (a, b)


def test_flat_range_2d_is_head_body_tail():
    assert flat_range_to_boxes((4, 5), 3, 13) == [
        Box((0, 3), (1, 2)),
        Box((1, 0), (2, 5)),
        Box((3, 0), (1, 1)),
    ]
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        flat_range_to_boxes((4, 5), 15, 6)


def _chunk_reference(shape, mesh_shape, coord, placements):
    """The DTensor local shard by applying torch.chunk to an index tensor, mesh dim by mesh dim."""
    t = torch.arange(math.prod(shape)).reshape(shape)
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            chunks = list(torch.chunk(t, mesh_shape[m], dim=p.dim))
            t = chunks[coord[m]] if coord[m] < len(chunks) else t.narrow(p.dim, t.shape[p.dim], 0)
    return t


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple),
    mesh_shape=st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple),
    data=st.data(),
)
def test_dtensor_box_matches_torch_chunk(shape, mesh_shape, data):
    placements = [
        data.draw(st.one_of(st.just(Replicate()), st.integers(0, len(shape) - 1).map(Shard)))
        for _ in mesh_shape
    ]
    coord = [data.draw(st.integers(0, m - 1)) for m in mesh_shape]
    box = dtensor_box(shape, mesh_shape, coord, placements)
    ref = _chunk_reference(shape, mesh_shape, coord, placements)
    assert box.sizes == tuple(ref.shape)
    if ref.numel():
        full = torch.arange(math.prod(shape)).reshape(shape)
        assert torch.equal(full[box.slices()], ref)


def test_dtensor_box_refuses_partial_and_bad_meshes():
    with pytest.raises(ValueError, match="Partial"):
        dtensor_box((4,), (2,), (0,), [Partial()])
    with pytest.raises(ValueError, match="one entry per mesh dim"):
        dtensor_box((4,), (2, 2), (0,), [Shard(0)])
    with pytest.raises(ValueError, match="coordinate 2 outside mesh dim 0 of size 2"):
        dtensor_box((4,), (2,), (2,), [Shard(0)])
    with pytest.raises(ValueError, match=r"S\(1\) on a tensor of shape \(4,\)"):
        dtensor_box((4,), (2,), (0,), [Shard(1)])
    with pytest.raises(TypeError):
        flat_range_to_boxes((4,), 0.5, 2)


def test_check_boxes_names_tensor_and_missing_region():
    check_boxes("w", (4, 6), [Box((0, 0), (4, 3)), Box((0, 3), (4, 3))])
    with pytest.raises(ValueError, match=r"tensor 'w'.*missing offsets=\(2, 3\) sizes=\(2, 3\)"):
        check_boxes("w", (4, 6), [Box((0, 0), (4, 3)), Box((0, 3), (2, 3))])
    with pytest.raises(ValueError, match=r"tensor 'w': boxes overlap at offsets=\(1, 2\)"):
        check_boxes("w", (4, 6), [Box((0, 0), (4, 3)), Box((1, 2), (3, 4)), Box((0, 3), (1, 3))])
    with pytest.raises(ValueError, match="outside shape"):
        check_boxes("w", (4, 6), [Box((0, 0), (5, 6))])


@settings(max_examples=100, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), data=st.data())
def test_box_difference_is_exact(shape, data):
    def rand_box():
        lo = [data.draw(st.integers(0, s - 1)) for s in shape]
        return Box(tuple(lo), tuple(data.draw(st.integers(1, s - o)) for o, s in zip(lo, shape)))

    a, b = rand_box(), rand_box()
    parts = box_difference(a, b)
    expect = _mark(shape, [a]) - _mark(shape, [a]) * _mark(shape, [b])
    assert torch.equal(_mark(shape, parts), expect)
