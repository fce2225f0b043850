"""Rows of bytes serialised ahead (``byte_rows``) and one loaded row read back (``decode_row``): the two
halves of ``object_rows`` / ``load_object_rows`` on a 2-D layout of rows (omni-train's ``[dp, positions]``),
saved and read back through a manager, against the values themselves and ``object_rows``'s own row."""

import msgpack
import pytest
import torch

from omni_ckpt import BoxShard, CheckpointManager, byte_rows, decode_row, load, object_rows


def test_byte_rows_lay_out_a_2d_grid_of_rows_that_decode_to_their_values(tmp_path):
    values = {
        (d, p): {"dp": d, "position": p, "pad": "y" * (100 * d + p)} for d in range(2) for p in range(3)
    }
    rows = {k: byte_rows(msgpack.packb(v), k, (2, 3)) for k, v in values.items()}
    for (d, p), r in rows.items():
        assert r.global_shape == (2, 3, 4096) and r.offsets == (d, p, 0)
        assert torch.equal(r.local.view(-1), object_rows(values[d, p], (d, p), (2, 3))["rows"].local.view(-1))
    # one process saves the grid the six ranks' boxes make up
    whole = torch.zeros(2, 3, 4096, dtype=torch.uint8)
    for (d, p), r in rows.items():
        whole[d, p] = r.local.view(-1)
    mgr = CheckpointManager(str(tmp_path / "ckpt"), async_save=False)
    mgr.save(1, {"loader": BoxShard(whole, (2, 3, 4096), (0, 0, 0))})
    # read a 2 x 2 block of rows back at once, as a resume under another layout does
    got = torch.zeros(2, 2, 4096, dtype=torch.uint8)
    load({"loader": BoxShard(got, (2, 3, 4096), (0, 1, 0))}, mgr.step_url(1))
    assert [decode_row(got[d, p - 1], f"row ({d}, {p})") for d in range(2) for p in (1, 2)] == [
        values[d, p] for d in range(2) for p in (1, 2)
    ]
    with pytest.raises(ValueError, match="byte_rows: index"):
        byte_rows(b"\x80", (2, 0), (2, 3))
    with pytest.raises(ValueError, match=r"row \(0, 0\): length 0 does not fit the row of 4088 bytes"):
        decode_row(torch.zeros(4096, dtype=torch.uint8), "row (0, 0)")
    mgr.close()
