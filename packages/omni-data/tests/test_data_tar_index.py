"""tar_index.iter_members against Python's tarfile (the peer oracle) on PAX, GNU and USTAR archives."""

import io
import tarfile

import pytest

from omni_data.tar_index import TarDamage, TarMember, iter_members


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


def _walk(data):
    return list(iter_members(io.BytesIO(data), 0, len(data)))


def test_damage_reported_and_walk_resynchronised():
    data = bytearray(_archive(tarfile.PAX_FORMAT))
    members = _walk(bytes(data))
    assert len(members) == 4 and all(isinstance(m, TarMember) for m in members)
    second, third = members[1].header, members[2].header
    # a flipped byte in the second header: reported, and the walk goes on at the third member
    bad = bytes(data[:second]) + b"\x01" + bytes(data[second + 1 :])
    got = _walk(bad)
    assert isinstance(got[1], TarDamage) and "checksum mismatch" in got[1].message
    assert got[1].offset == second and got[1].resumed == third
    assert [m.name for m in got if isinstance(m, TarMember)] == [
        members[0].name,
        *(m.name for m in members[2:]),
    ]
    # a header cut off by the end of the file: reported, and the walk ends
    cut = bytes(data[: second + 100])
    got = _walk(cut)
    assert [type(m) for m in got] == [TarMember, TarDamage] and "cut off" in got[1].message


def test_damaged_pax_record_skips_its_member():
    data = _archive(tarfile.PAX_FORMAT)
    members = _walk(data)
    third = members[2]  # the long name: a PAX 'path' record precedes it
    pax_at = third.header
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        assert any(m.offset == pax_at for m in tf.getmembers())  # the chain starts at the PAX header
    record = pax_at + 512  # the PAX data block: "NN path=...\n"
    bad = data[:record] + b"9x" + data[record + 2 :]  # length field no longer a number
    got = _walk(bad)
    damage = [m for m in got if isinstance(m, TarDamage)]
    assert len(damage) == 1 and "PAX" in damage[0].message and damage[0].offset == pax_at
    assert [m.name for m in got if isinstance(m, TarMember)] == [
        members[0].name,
        members[1].name,
        members[3].name,
    ]
