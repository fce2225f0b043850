"""Property: save under one layout, load under another, bit-exact (virtual ranks in one process).

Layouts: replicated, TP row / column (1-D mesh Shard), 2-D DTensor meshes with uneven and empty shards
(boxes from omni_ckpt's DTensor describer), ZeRO flat slices at DP 2/3/4 with uneven cut points.
Reference: the global tensor indexed directly.
"""

import math
import uuid

import fsspec
import fsspec.implementations.memory
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from omni_ckpt import BoxShard, FlatShard, load, save_ranks
from omni_ckpt.sharding import dtensor_box

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float64, torch.uint8]


@st.composite
def layouts(draw, shape):
    kind = draw(st.sampled_from(["replicated", "tp", "dtensor2d", "zero"]))
    ndim = len(shape)
    if kind == "replicated":
        return kind, draw(st.integers(1, 3)), None
    if kind == "tp" and ndim:
        w = draw(st.integers(2, 4))
        return kind, w, ((w,), [Shard(draw(st.integers(0, ndim - 1)))])
    if kind == "dtensor2d" and ndim:
        mesh = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
        pl = [draw(st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard))) for _ in mesh]
        return kind, mesh[0] * mesh[1], (mesh, pl)
    w = draw(st.integers(2, 4))
    n = math.prod(shape)
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=w - 1, max_size=w - 1)))
    return "zero", w, [0, *cuts, n]


def local_state(layout, full, rank, *, empty):
    kind, _, spec = layout
    make = torch.zeros_like if empty else (lambda t: t.clone())
    if kind == "replicated" or (kind in ("tp", "dtensor2d") and spec is None):
        return make(full)
    if kind in ("tp", "dtensor2d"):
        mesh, pl = spec
        coord = [rank // mesh[1], rank % mesh[1]] if len(mesh) == 2 else [rank]
        box = dtensor_box(full.shape, mesh, coord, pl)
        return BoxShard(make(full[box.slices()]).contiguous(), full.shape, box.offsets)
    lo, hi = spec[rank], spec[rank + 1]
    return FlatShard(make(full.reshape(-1)[lo:hi]), full.shape, lo)


def expected(value, full):
    if isinstance(value, FlatShard):
        return full.reshape(-1)[value.flat_offset : value.flat_offset + value.local.numel()], value.local
    if isinstance(value, BoxShard):
        sl = tuple(slice(o, o + s) for o, s in zip(value.offsets, value.local.shape))
        return full[sl], value.local
    return full, value


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_save_one_layout_load_another_bit_exact(shape, dtype, data):
    src = data.draw(layouts(shape))
    dst = data.draw(layouts(shape))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    full = raw.view(dtype).reshape(shape) if dtype.itemsize > 1 else raw.reshape(shape)
    other = torch.randn(3, 5, generator=g)
    url = f"memory://prop-{uuid.uuid4().hex}"
    states = [
        {"t": local_state(src, full, r, empty=False), "o": other.clone(), "step": 7} for r in range(src[1])
    ]
    save_ranks(states, url)
    try:
        for r in range(dst[1]):
            target = {"t": local_state(dst, full, r, empty=True), "o": torch.zeros(3, 5), "step": 0}
            load(target, url)
            want, got = expected(target["t"], full)
            assert torch.equal(_bits(got), _bits(want)), (src, dst, r)
            assert torch.equal(target["o"], other) and target["step"] == 7
    finally:
        fsspec.filesystem("memory").rm(url.removeprefix("memory:/"), recursive=True)


def test_remote_store_reads_all_spans_of_a_file_in_one_cat_ranges_call(monkeypatch):
    url = f"memory://cat-{uuid.uuid4().hex}"
    full = {f"t{i}": torch.randn(300 + i) for i in range(6)}
    save_ranks([full], url)
    calls = []
    real = fsspec.implementations.memory.MemoryFileSystem.cat_ranges

    def counted(self, paths, starts, ends, **kw):
        calls.append(len(paths))
        return real(self, paths, starts, ends, **kw)

    monkeypatch.setattr(fsspec.implementations.memory.MemoryFileSystem, "cat_ranges", counted)
    # A layout that reads part of every saved box: each tensor split over two targets.
    target = {k: BoxShard(torch.zeros(100), v.shape, (50,)) for k, v in full.items()}
    try:
        load(target, url)
    finally:
        fsspec.filesystem("memory").rm(url.removeprefix("memory:/"), recursive=True)
    assert all(torch.equal(target[k].local, v[50:150]) for k, v in full.items())
    assert calls and len(calls) <= 3, calls  # header, objects, and one call for all the data spans
