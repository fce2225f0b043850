"""Untrusted checkpoints are bounded: a manifest with valid checksums but crafted dtypes, shapes or boxes is
refused, naming the checkpoint, the tensor, the box and the fault, before anything is allocated from it,
and `omni-ckpt` prints the refusal as one line with exit status 2.

Each crafted manifest is re-encoded with the package's own `encode_manifest`, so its checksum holds and only
the content checks can stop it. The worst one is the attack reported in issue 29: many boxes of a huge
tensor all pointing at the same few bytes of a small file, which made `omni-ckpt export` allocate and write
a tensor hundreds of times the checkpoint's size; its peak RSS is measured in a subprocess against a benign
export. The coverage check is compared with a brute-force count of every element on random box sets.
"""

import itertools
import math
import random
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from omni_ckpt import CheckpointError, load, read_full, read_manifest, save_ranks
from omni_ckpt.box import Box, check_boxes
from omni_ckpt.checksum import chunk_count
from omni_ckpt.cli import main as ckpt_main
from omni_ckpt.layout import CHUNK_BYTES, MANIFEST, decode_manifest, encode_manifest

N = 1 << 18  # elements of "model.w": 1 MiB of float32, so the crafted checkpoint stays small
ALIASES = 256  # boxes of the crafted tensor, all on the same 1 MiB: a 256 MiB tensor from a 1 MiB file


def _checkpoint(path):
    url = str(path)
    w = torch.arange(N, dtype=torch.float32)
    save_ranks([{"model": {"w": w, "b": torch.arange(5, dtype=torch.int64)}, "step": 3}], url)
    return url


def _craft(url, edit):
    """Edit the manifest's decoded body and write it back with a valid checksum (as an attacker would)."""
    path = f"{url}/{MANIFEST}"
    with open(path, "rb") as f:
        manifest = decode_manifest(f.read(), path)
    edit(manifest)
    with open(path, "wb") as f:
        f.write(encode_manifest(manifest))


def _file_bytes(url):
    manifest = read_manifest_raw(url)
    return sum(_size(f"{url}/{name}") for name in manifest["files"]) + _size(f"{url}/{MANIFEST}")


def read_manifest_raw(url):
    with open(f"{url}/{MANIFEST}", "rb") as f:
        return decode_manifest(f.read(), url)


def _size(path):
    with open(path, "rb") as f:
        return f.seek(0, 2)


def _w(m):
    return m["tensors"]["model.w"]


def _aliased(m):
    """The issue's attack: ALIASES boxes tile a tensor ALIASES times "model.w", all on w's own bytes."""
    _, _, [b] = _w(m)
    _w(m)[1] = [ALIASES * N]
    _w(m)[2] = [[[i * N], [N], b[2], b[3], b[4], b[5]] for i in range(ALIASES)]


def _overlap(m):
    """Two boxes on disjoint halves of w's bytes that overlap in the tensor (and leave its end uncovered)."""
    _, _, [b] = _w(m)
    half = N // 2 * 4
    _w(m)[2] = [
        [[0], [N // 2], b[2], b[3], half, [0]],
        [[N // 4], [N // 2], b[2], b[3] + half, half, [0]],
    ]


def _set_shape(shape):
    def edit(m):
        _w(m)[1] = shape

    return edit


def _huge_box(m):
    """Shape and box [2**34] with a matching byte length: its bytes run over the plain objects' (and past
    the end of the file)."""
    _, _, [b] = _w(m)
    _w(m)[1] = [1 << 34]
    _w(m)[2] = [[[0], [1 << 34], b[2], b[3], 4 << 34, [0] * chunk_count(4 << 34, CHUNK_BYTES)]]


def _box_edit(index, value):
    def edit(m):
        _w(m)[2][0][index] = value

    return edit


def _past_end(m):
    b = _w(m)[2][0]
    b[3] += 64 << 20  # past the end of the file, past every other byte range too


def _dtype(name):
    def edit(m):
        _w(m)[0] = name

    return edit


CASES = {
    "aliased": (_aliased, r"box offsets=\(262144,\) sizes=\(262144,\) \(bytes \[\d+, \d+\)\) overlaps tensor "
                r"'model\.w' box offsets=\(0,\) sizes=\(262144,\).*claimed twice"),
    "overlap": (_overlap, r"boxes overlap at offsets=\(65536,\) sizes=\(65536,\)"),
    "gap": (_set_shape([N + 8]), r"boxes cover 262144 of 262152 elements; missing offsets=\(262144,\) sizes=\(8,\)"),
    "outside": (_box_edit(0, [8]), r"box offsets=\(8,\) sizes=\(262144,\) outside shape \(262144,\)"),
    "past_end": (_past_end, r"box offsets=\(0,\) sizes=\(262144,\) \(bytes \[67109176, 68157752\)\) in it"),
    "shape_2**34": (_set_shape([1 << 34]), r"boxes cover 262144 of 17179869184 elements"),
    "box_2**34": (_huge_box, r"box offsets=\(0,\) sizes=\(17179869184,\) \(bytes \[\d+, 68719477\d+\)\).*claimed twice"),
    "shape_-5": (_set_shape([-5]), r"size -5 of dim 0 is not an int >= 0"),
    "shape_x": (_set_shape(["x"]), r"size 'x' of dim 0 is not an int >= 0"),
    "dtype_qint8": (_dtype("qint8"), r"unknown dtype 'qint8'"),
    "dtype_getattr": (_dtype("__class__"), r"unknown dtype '__class__'"),
    "length": (_box_edit(4, 4 * N - 4), r"malformed box entry .*length 1048572 is not 262144 elements x 4 bytes"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_crafted_manifest_is_refused_before_any_allocation_naming_checkpoint_tensor_and_fault(
    tmp_path, capsys, case
):
    edit, fault = CASES[case]
    url = _checkpoint(tmp_path / "c")
    _craft(url, edit)
    named = rf"^{re.escape(url)}.*tensor 'model\.w'.*{fault}"
    if case == "past_end":
        named = rf"^{re.escape(url)}/rank-00000\.safetensors: truncated, 1048895 bytes but .*{fault}"
    with pytest.raises(CheckpointError, match=named):
        read_manifest(url)  # what export, export-hf and every caller allocating from a manifest go through
    with pytest.raises(CheckpointError, match=named):
        read_full(url)
    target = {"model": {"b": torch.full((5,), 9)}}  # even a load that does not ask for the tensor
    with pytest.raises(CheckpointError, match=named):
        load(target, url, strict=False)
    assert torch.equal(target["model"]["b"], torch.full((5,), 9))

    out = tmp_path / "out.safetensors"
    assert ckpt_main(["export", "--format", "safetensors", url, str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(rf"omni-ckpt: error: {named[1:]}", err), err
    assert "Traceback" not in err and not out.exists()


def test_the_intact_checkpoint_still_exports_and_loads(tmp_path, capsys):
    url = _checkpoint(tmp_path / "c")
    out = tmp_path / "out.safetensors"
    assert ckpt_main(["export", "--format", "safetensors", url, str(out)]) == 0
    tensors, objects = read_full(url)
    assert torch.equal(tensors["model.w"], torch.arange(N, dtype=torch.float32)) and objects == {"step": 3}
    assert "exported 2 tensors" in capsys.readouterr().out


_PEAKS = """
import resource, sys
from omni_ckpt.cli import main
args = sys.argv[1:]
for ckpt, out in zip(args[::2], args[1::2]):
    rc = main(["export", "--format", "safetensors", ckpt, out])
    print("PEAK", rc, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
"""


def _export_peaks(*pairs):
    """``omni-ckpt export`` of each ``(checkpoint, out)`` in turn in one fresh interpreter: the exit status
    and the peak RSS so far (bytes) after each, and stderr. A peak is a high-water mark, so the peak after
    the second export bounds that export's own."""
    proc = subprocess.run(
        [sys.executable, "-c", _PEAKS, *(str(x) for pair in pairs for x in pair)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [x.split() for x in proc.stdout.splitlines() if x.startswith("PEAK")]
    assert len(lines) == len(pairs), proc.stderr[-2000:]
    return [(int(rc), int(kib) * 1024) for _, rc, kib in lines], proc.stderr


def test_export_of_the_aliased_box_attack_stays_within_file_bytes_plus_target_plus_baseline(tmp_path):
    benign = _checkpoint(tmp_path / "benign")
    crafted = _checkpoint(tmp_path / "crafted")
    _craft(crafted, _aliased)
    claimed = ALIASES * N * 4  # what the crafted manifest claims: 256 MiB
    out = tmp_path / "crafted.safetensors"
    # the benign export first: the interpreter, torch and one real export of the same size give the baseline
    [(rc0, baseline), (rc, peak)], err = _export_peaks(
        (benign, tmp_path / "benign.safetensors"), (crafted, out)
    )
    assert rc0 == 0, err
    target = _size(out) if out.exists() else 0
    bound = baseline + _file_bytes(crafted) + target
    # before the fix: rc 0, a 256 MiB tensor written, peak about baseline + 2 x 256 MiB
    assert peak < bound + (16 << 20) < baseline + claimed, (peak, bound, baseline)
    assert rc == 2 and target == 0, (rc, target, err)
    # the benign export notes its skipped plain object; the crafted one adds exactly one line
    assert err.split("\n")[1:] == [err.split("\n")[1], ""], err
    assert err.split("\n")[1].startswith("omni-ckpt: error: "), err


def _brute(shape, boxes):
    count = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        count[b.slices()] += 1
    bad = np.argwhere(count != 1)
    return None if len(bad) == 0 else (tuple(int(i) for i in bad[0]), int(count[tuple(bad[0])]))


def _tiling(rng, shape):
    """A random exact tiling of ``shape``: a grid of random cuts, its cells merged at random along dim 0."""
    cuts = [sorted({0, s, *rng.sample(range(1, s), min(s - 1, rng.randint(0, 3)))}) for s in shape]
    cells = [[(a, b) for a, b in itertools.pairwise(c)] for c in cuts]
    boxes = []
    for rest in np.ndindex(*[len(c) for c in cells[1:]]):
        i = 0
        while i < len(cells[0]):
            j = rng.randint(i + 1, len(cells[0]))
            lo, hi = cells[0][i][0], cells[0][j - 1][1]
            offs = (lo, *(cells[d + 1][k][0] for d, k in enumerate(rest)))
            sizes = (hi - lo, *(cells[d + 1][k][1] - cells[d + 1][k][0] for d, k in enumerate(rest)))
            boxes.append(Box(offs, sizes))
            i = j
    return boxes


def test_coverage_check_agrees_with_a_brute_force_count_on_random_box_sets():
    rng = random.Random(29)
    verdicts = {"tiles": 0, "overlap": 0, "missing": 0}
    for _ in range(600):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        boxes = _tiling(rng, shape)
        kind = rng.randrange(4)
        if kind == 1 and len(boxes) > 1:
            boxes.pop(rng.randrange(len(boxes)))  # a gap
        elif kind == 2:
            boxes.append(boxes[rng.randrange(len(boxes))])  # a duplicate
        elif kind == 3:  # move one box by one element along a dimension, if it still fits
            i, d = rng.randrange(len(boxes)), rng.randrange(len(shape))
            b = boxes[i]
            offs = list(b.offsets)
            offs[d] += rng.choice((-1, 1))
            if offs[d] >= 0 and offs[d] + b.sizes[d] <= shape[d]:
                boxes[i] = Box(tuple(offs), b.sizes)
        rng.shuffle(boxes)
        want = _brute(shape, boxes)
        if want is None:
            check_boxes("t", shape, boxes)
            verdicts["tiles"] += 1
            continue
        with pytest.raises(ValueError) as info:
            check_boxes("t", shape, boxes)
        point, count = want
        if count > 1:
            verdicts["overlap"] += 1
            # the intersection named starts at the first doubly covered element
            assert f"overlap at offsets={point}" in str(info.value), (shape, boxes, want)
        else:
            verdicts["missing"] += 1
            assert "missing offsets=" in str(info.value), (shape, boxes, want)
    assert min(verdicts.values()) > 50, verdicts


def test_coverage_check_of_many_boxes_sharing_one_row_range_is_not_quadratic():
    # 4000 column boxes of a [2, 4000] tensor: a dim-0 sweep tests every pair (8 million intersections)
    n = 4000
    columns = [Box((0, i), (2, 1)) for i in range(n)]
    t0 = time.perf_counter()
    check_boxes("t", (2, n), columns)
    with pytest.raises(ValueError, match=r"overlap at offsets=\(0, 17\)"):
        check_boxes("t", (2, n), [*columns, Box((0, 17), (1, 1))])
    assert time.perf_counter() - t0 < 1.0


def test_flat_shards_of_every_layout_tile_and_validation_cost_is_per_box(tmp_path):
    # 64 ranks' ZeRO slices of a [96, 40, 3] tensor, loaded whole: the checks must not refuse a real layout
    shape = (96, 40, 3)
    full = torch.randn(shape)
    flat = full.reshape(-1)
    cuts = sorted(random.Random(7).sample(range(1, flat.numel()), 63))
    from omni_ckpt import FlatShard

    states = [
        {"w": FlatShard(flat[lo:hi].clone(), shape, lo)} for lo, hi in zip([0, *cuts], [*cuts, flat.numel()])
    ]
    url = str(tmp_path / "z")
    save_ranks(states, url)
    assert len(read_manifest(url)["tensors"]["w"][2]) > 64
    target = {"w": torch.zeros(shape)}
    load(target, url)
    assert torch.equal(target["w"], full)
    assert math.prod(shape) == flat.numel()
