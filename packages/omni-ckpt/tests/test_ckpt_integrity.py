"""A checkpoint that cannot lie: every single-bit flip of a manifest and of a data file's header, a manifest
whose boxes leave a gap or overlap (re-checksummed, as a buggy writer would leave it), a truncated data file
and an old unchecksummed manifest all raise a CheckpointError before any byte of the target changes.

Reference: the target is filled with a sentinel before each load and compared bit for bit afterwards;
the intact checkpoint loads bit-exact against the tensors that were saved."""

import math
import uuid

import fsspec
import msgpack
import pytest
import torch
from safetensors import safe_open

from omni_ckpt import CheckpointError, FlatShard, load, read_manifest, save_ranks
from omni_ckpt.layout import MANIFEST, encode_manifest

W = torch.arange(6 * 7, dtype=torch.float32).reshape(6, 7) / 3
B = torch.arange(5, dtype=torch.int64) - 2


def _small_checkpoint(url):
    """2 ranks: w as ZeRO flat slices (several boxes), b replicated, a per-rank object."""
    states = [
        {"model": {"w": FlatShard(W.reshape(-1)[lo:hi].clone(), W.shape, lo), "b": B.clone()}, "step": 3}
        for lo, hi in ((0, 17), (17, 42))
    ]
    save_ranks(states, url)


def _sentinel():
    return {"model": {"w": torch.full((6, 7), -7.0), "b": torch.full((5,), 99)}, "step": -1}


def _untouched(t):
    return (
        torch.equal(t["model"]["w"], torch.full((6, 7), -7.0))
        and torch.equal(t["model"]["b"], torch.full((5,), 99))
        and t["step"] == -1
    )


def _sweep(path, lo, hi, url):
    """Flip every bit of bytes [lo, hi) of the in-memory file ``path`` in turn and load: returns the flips
    that did not raise a CheckpointError or that changed the target."""
    fs = fsspec.filesystem("memory")
    original = fs.cat_file(path)
    silent = []
    try:
        for pos in range(lo, hi):
            for bit in range(8):
                corrupt = bytearray(original)
                corrupt[pos] ^= 1 << bit
                fs.pipe_file(path, bytes(corrupt))
                target = _sentinel()
                try:
                    load(target, url)
                    silent.append((pos, bit, "loaded"))
                except CheckpointError:
                    if not _untouched(target):
                        silent.append((pos, bit, "raised after writing into the target"))
    finally:
        fs.pipe_file(path, original)
    return silent


@pytest.fixture
def memory_url():
    url = f"memory://integrity-{uuid.uuid4().hex}"
    yield url
    fsspec.filesystem("memory").rm(url.removeprefix("memory:/"), recursive=True)


def test_every_single_bit_flip_of_the_manifest_raises_before_the_target_is_touched(memory_url):
    _small_checkpoint(memory_url)
    path = f"{memory_url.removeprefix('memory:/')}/{MANIFEST}"
    n = fsspec.filesystem("memory").size(path)
    assert 300 < n < 2000, n  # small enough to sweep exhaustively
    assert _sweep(path, 0, n, memory_url) == []  # 0 silent results in 8 * n flips
    target = _sentinel()
    load(target, memory_url)
    assert torch.equal(target["model"]["w"], W) and torch.equal(target["model"]["b"], B)


def test_every_single_bit_flip_of_a_rank_file_header_raises_before_the_target_is_touched(
    memory_url, tmp_path
):
    _small_checkpoint(memory_url)
    manifest = read_manifest(memory_url)
    fs = fsspec.filesystem("memory")
    for r in range(2):
        path = f"{memory_url.removeprefix('memory:/')}/{manifest['files'][r]}"
        (tmp_path / "r.safetensors").write_bytes(fs.cat_file(path))
        with safe_open(str(tmp_path / "r.safetensors"), "pt") as st:  # intact: a valid safetensors file
            assert st.metadata()["format"] == "omni-ckpt"
        assert _sweep(path, 0, manifest["data_start"][r], memory_url) == []


def _rewrite(url_dir, edit):
    """Edit the decoded manifest and write it back with a valid checksum (a buggy writer's output)."""
    path = url_dir / MANIFEST
    manifest = read_manifest(str(url_dir))
    edit(manifest)
    path.write_bytes(encode_manifest(manifest))


def test_saved_boxes_with_a_gap_or_an_overlap_raise_naming_tensor_and_region(tmp_path):
    url = str(tmp_path / "c")
    _small_checkpoint(url)
    boxes = read_manifest(url)["tensors"]["model.w"][2]
    assert len(boxes) >= 3  # the flat cut at 17 of (6, 7): head row, body rows, tail row per rank
    raw = (tmp_path / "c" / MANIFEST).read_bytes()

    # Removing a box without fixing the checksum: the manifest's own checksum catches it.
    manifest = msgpack.unpackb(raw[:-16], strict_map_key=False)
    manifest["tensors"]["model.w"][2].pop()
    (tmp_path / "c" / MANIFEST).write_bytes(msgpack.packb(manifest) + raw[-16:])
    target = _sentinel()
    with pytest.raises(CheckpointError, match="manifest"):
        load(target, url)
    assert _untouched(target)

    # Re-checksummed (what a buggy writer would leave): coverage catches it, naming tensor and region.
    (tmp_path / "c" / MANIFEST).write_bytes(raw)
    last = boxes[-1]
    _rewrite(tmp_path / "c", lambda m: m["tensors"]["model.w"][2].pop())
    region = rf"missing offsets=\({last[0][0]}, {last[0][1]}\) sizes=\({last[1][0]}, {last[1][1]}\)"
    with pytest.raises(CheckpointError, match=rf"do not cover.*tensor 'model\.w'.*{region}"):
        load(target, url)
    assert _untouched(target)

    # An overlap: the first box grows by one row into the next one.
    (tmp_path / "c" / MANIFEST).write_bytes(raw)
    first = boxes[0]

    def grow(m):
        b = m["tensors"]["model.w"][2][0]
        b[1][0] += 1
        b[4] = math.prod(b[1]) * 4
        b[5] = [0]

    _rewrite(tmp_path / "c", grow)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.w'.*(overlap|outside)"):
        load(target, url)
    assert _untouched(target) and first[1][0] >= 1

    # A length that does not match the box's sizes is a malformed entry.
    (tmp_path / "c" / MANIFEST).write_bytes(raw)
    _rewrite(tmp_path / "c", lambda m: m["tensors"]["model.b"][2][0].__setitem__(4, 8))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.b': malformed box entry"):
        load(target, url)
    assert _untouched(target)


def test_truncated_data_file_and_old_manifest_raise_before_the_target_is_touched(tmp_path):
    url = str(tmp_path / "c")
    _small_checkpoint(url)
    rank1 = tmp_path / "c" / "rank-00001.safetensors"
    data = rank1.read_bytes()
    rank1.write_bytes(data[:-3])
    target = _sentinel()
    with pytest.raises(CheckpointError, match=r"rank-00001\.safetensors: truncated"):
        load(target, url)
    assert _untouched(target)
    rank1.write_bytes(data)
    # A version-1 manifest (no checksum of its own) is refused by name, not half trusted.
    (tmp_path / "c" / MANIFEST).write_bytes(
        msgpack.packb({"format": "omni-ckpt", "version": 1, "tensors": {}})
    )
    with pytest.raises(CheckpointError, match=r"format version 1 .*without its own checksum"):
        load(target, url)
    assert _untouched(target)


def _crc32c_bitwise(data: bytes) -> int:
    """CRC-32C by its definition (RFC 3720 §B.4: reflected polynomial 0x82F63B78, init and final xor
    0xFFFFFFFF), one bit at a time: the oracle for the SIMD implementation."""
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    c = 0xFFFFFFFF
    for byte in data:
        c = (c >> 8) ^ table[(c ^ byte) & 0xFF]
    return c ^ 0xFFFFFFFF


def test_checksum_is_crc32c_by_definition_across_lengths_continuations_and_chunks():
    from omni_ckpt.checksum import chunk_count, crc, crc_into

    assert crc(b"123456789") == 0xE3069283  # RFC 3720 / the CRC catalogue's check value
    assert crc(bytes(32)) == 0x8A9136AA  # RFC 3720 §B.4, 32 bytes of zeros
    g = torch.Generator().manual_seed(0)
    # lengths around the vector widths and the 32 KiB size from which the GIL is released
    for n in (0, 1, 15, 16, 63, 64, 65, 255, 4097, (32 << 10) - 1, 32 << 10, (32 << 10) + 1, 100_003):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
        want = _crc32c_bitwise(data)
        assert crc(data) == want, n
        assert crc(memoryview(data)[n // 3 :], crc(memoryview(data)[: n // 3])) == want, n
        chunk = 4099  # per-chunk CRCs folded from windows that straddle chunk ends
        crcs = [0] * chunk_count(n, chunk)
        for lo in range(0, n, 1000):
            crc_into(crcs, memoryview(data)[lo : lo + 1000], lo, chunk)
        assert crcs == [_crc32c_bitwise(data[a : a + chunk]) for a in range(0, max(n, 1), chunk)], n


def test_an_object_length_past_the_file_end_raises_before_anything_is_allocated(tmp_path):
    url = str(tmp_path / "c")
    _small_checkpoint(url)
    _rewrite(tmp_path / "c", lambda m: m["objects"][1].__setitem__(2, 1 << 40))  # 1 TiB of "objects"
    target = _sentinel()
    with pytest.raises(
        CheckpointError,
        match=r"rank-00001\.safetensors: truncated, \d+ bytes but the plain objects of rank 1",
    ):
        load(target, url)
    assert _untouched(target)


def test_an_unknown_url_scheme_names_the_url(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint URL 'nosuchfs://run/step-1'"):
        load(_sentinel(), "nosuchfs://run/step-1")


def test_a_scheme_whose_filesystem_package_is_missing_names_the_url():
    """A scheme fsspec knows but whose package is not installed (registered here by class path, so the
    case exists whatever this machine has installed)."""
    from fsspec.registry import known_implementations, register_implementation

    name = "omnimissingfs"
    register_implementation(name, "omni_no_such_package.FileSystem", errtxt="install omni-no-such-package")
    try:
        with pytest.raises(ImportError, match=rf"checkpoint URL '{name}://run/step-1'.*omni-no-such-package"):
            load(_sentinel(), f"{name}://run/step-1")
    finally:
        known_implementations.pop(name, None)
