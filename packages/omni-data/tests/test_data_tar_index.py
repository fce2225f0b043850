"""tar_index.iter_members against Python's tarfile (the peer oracle) on PAX, GNU and USTAR archives."""

import io
import tarfile

import pytest

from omni_data.tar_index import TarHeaderError, iter_members


def _archive(fmt):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for i, (name, size) in enumerate(
            [("a.txt", 0), ("b.png", 513), ("dir/" + "x" * 90 + "/long.name.json", 700), ("ü-unicode.txt", 5)]
        ):
            info = tarfile.TarInfo(name if fmt != tarfile.USTAR_FORMAT or len(name) < 100 else f"k{i}.bin")
            info.size = size
            tf.addfile(info, io.BytesIO(bytes(range(256)) * 3))
        d = tarfile.TarInfo("somedir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_matches_tarfile(fmt):
    data = _archive(fmt)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        want = [(m.name, m.offset, m.offset_data, m.size) for m in tf.getmembers() if m.isreg()]
    got = [(m.name, m.header, m.offset, m.size) for m in iter_members(io.BytesIO(data), 0, len(data))]
    assert got == want
    # resuming from any member's header gives the rest
    for k in range(len(got)):
        rest = [(m.name, m.header) for m in iter_members(io.BytesIO(data), got[k][1], len(data))]
        assert rest == [(n, h) for n, h, _, _ in got[k:]]


def test_damage():
    data = bytearray(_archive(tarfile.PAX_FORMAT))
    members = list(iter_members(io.BytesIO(bytes(data)), 0, len(data)))
    second = members[1].header
    bad = bytes(data[:second]) + b"\x01" + bytes(data[second + 1 :])
    with pytest.raises(TarHeaderError, match=f"checksum mismatch at byte {second}"):
        list(iter_members(io.BytesIO(bad), 0, len(bad)))
    cut = bytes(data[: second + 100])
    with pytest.raises(TarHeaderError, match="cut off"):
        list(iter_members(io.BytesIO(cut), 0, len(cut)))
