"""Bad data through the whole trainer: a damaged PAX header, a key that is not UTF-8, an ``OSError`` in the
middle of a read, a truncated member, an undecodable image body and an over-long audio clip are each
skipped, counted per source and reason with their key in ``metrics.jsonl`` and ``summary.json``, and the
run goes on; a run resumed from its step-2 checkpoint logs the same losses and the same skips as the
uninterrupted one.

Reference: the damage is placed by hand (each kind once, at a known key), so the expected reasons and
keys are known; counts per step must add up to the summary's totals, and the summary must agree with
omni-data's own ledgers summed over the ranks as ``omni_data.skips`` prescribes (metadata once per DP
rank, payloads from every reading rank).
"""

import io
import json
import math
import shutil
import tarfile
from pathlib import Path

import numpy as np
import soundfile
from PIL import Image
from train_fixtures import make_dataset, write_config

from omni_data import skip_report
from omni_data.testing import FlakyFileSystem, flaky_url, write_tar
from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.preflight import validate

CUT = "shard cut off (the samples after the cut are lost)"
OSERROR = "read error, rest of shard skipped (OSError after 3 retries)"


def _png(h, w):
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 90, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _image_shards(d: Path) -> tuple[str, dict[str, str]]:
    """Six image shards of 3 samples ``k{shard}{i}``, one kind of damage each; returns the glob (through
    ``flaky://``, which reads normally except where a ``.faults`` sidecar says) and key -> damage."""
    long_key = "k01" + "x" * 120  # > 100 bytes: tarfile writes a PAX 'path' record for it
    keys = {s: [f"k{s}{i}" for i in range(3)] for s in range(6)}
    keys[0][1] = long_key
    for s in range(6):
        members = [m for k in keys[s] for m in ((f"{k}.png", _png(20, 24)), (f"{k}.txt", b"a red cat"))]
        if s == 1:
            members[2] = ("k1\udcff1.png", members[2][1])  # raw byte 0xff in the key
            members[3] = ("k1\udcff1.txt", members[3][1])
        if s == 4:
            members[2] = ("k41.png", _png(20, 24)[:60] + bytes(200))  # the header parses, the body does not
        write_tar(d / f"s{s}.tar", members, fmt=tarfile.GNU_FORMAT if s == 1 else tarfile.PAX_FORMAT)
    with tarfile.open(d / "s0.tar") as tf:
        pax_at = next(m.offset for m in tf.getmembers() if m.name.startswith(long_key))
    with open(d / "s0.tar", "r+b") as f:
        f.seek(pax_at + 512)
        f.write(b"9x")  # the PAX record's length field no longer parses
    with tarfile.open(d / "s3.tar") as tf:
        cut = next(m for m in tf.getmembers() if m.name == "k31.png")
    with open(d / "s3.tar", "r+b") as f:
        f.truncate(cut.offset_data + cut.size // 2)
    with tarfile.open(d / "s2.tar") as tf:
        at = next(m.offset for m in tf.getmembers() if m.name == "k22.png")
    flaky_url(str(d / "s2.tar"), at=at + 3, failures=10**6)  # every read of k22's header fails
    return f"flaky://{d.resolve()}/s*.tar", {
        "damaged tar header": long_key,
        "key is not UTF-8": "k1\\xff1",
        OSERROR: f"shard:flaky://{d.resolve()}/s2.tar@",
        "truncated member": "k31",
        "undecodable image payload": "image/k41",
    }


def _long_audio(path: Path) -> None:
    """A shard with one short clip and one 6 s clip (150 audio tokens > max_seq_len 96)."""
    members = []
    for key, seconds in (("aud_ok", 0.3), ("aud_long", 6.0)):
        buf = io.BytesIO()
        t = np.arange(int(16000 * seconds)) / 16000
        soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), 16000, format="FLAC")
        members += [(f"{key}.flac", buf.getvalue()), (f"{key}.txt", b"a long sound")]
    write_tar(path, members)


def _train(rank, world_size, cfg, root):
    """The uninterrupted run, then a copy of it resumed from its step-2 checkpoint."""
    import fsspec
    import torch.distributed as dist

    from omni_train.trainer import Trainer

    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    root = Path(root)
    full = Trainer(cfg, root / "full", resume=False)
    full.run()
    mine = skip_report(full.stream, max_keys=20)
    if rank == 0:
        shutil.copytree(root / "full" / "checkpoints", root / "resumed" / "checkpoints")
        shutil.rmtree(root / "resumed" / "checkpoints" / "step-00000004")
        (root / "resumed" / "checkpoints" / "latest").write_text("step-00000002")
    dist.barrier()
    Trainer(cfg, root / "resumed", resume=True).run()
    return full.ps.local_rank("pp"), mine


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_kind_of_damage_is_skipped_counted_named_and_resumes_exactly(tmp_path):
    data = make_dataset(tmp_path / "data", n_image=0, n_audio=4, n_text=12)
    (tmp_path / "img").mkdir()
    data["image"], where = _image_shards(tmp_path / "img")
    _long_audio(tmp_path / "data" / "audio-999.tar")
    cfg = load_config(str(write_config(tmp_path / "c.toml", data, steps=4, every=2)))
    validate(cfg, 2)
    res = run_world(_train, 2, args=(cfg, str(tmp_path / "runs")), timeout_s=400)

    full, resumed = tmp_path / "runs" / "full", tmp_path / "runs" / "resumed"
    rows, summary = _rows(full), json.loads((full / "summary.json").read_text())
    assert len(rows) == 4 and all(math.isfinite(r["loss"]) for r in rows)  # the run went on
    skipped = summary["skipped"]
    # the summary is the ranks' ledgers reduced: metadata from pipeline rank 0, payloads from both
    meta = next(rep for pp, rep in res if pp == 0)["metadata"]
    payload: dict = {}
    for _, rep in res:
        for src, by_reason in rep["payload"].items():
            for reason, n in by_reason.items():
                payload.setdefault(src, {})[reason] = payload.setdefault(src, {}).get(reason, 0) + n
    assert skipped["metadata"] == meta and skipped["payload"] == payload
    assert skipped["total"] == sum(n for scope in (meta, payload) for r in scope.values() for n in r.values())
    # each kind of damage is counted under its reason, with its key
    img = {**skipped["metadata"]["image"], **skipped["payload"]["image"]}
    for reason in ("damaged tar header", "key is not UTF-8", OSERROR, "truncated member", CUT):
        assert img.get(reason, 0) >= 1, (reason, img)
    assert img["undecodable image payload"] >= 1
    overlong = [r for r in skipped["metadata"]["audio"] if r.startswith("over-long audio (")]
    assert overlong and skipped["metadata"]["audio"][overlong[0]] >= 1
    keys = {(k, r) for src in ("image", "audio") for k, r in skipped["keys"][src]}
    for reason, key in where.items():
        assert any(k.startswith(key) and r == reason for k, r in keys), (reason, key, keys)
    assert ("audio/aud_long", overlong[0]) in keys
    # per step: the counts add up to the totals, and every key is named in the step that first skipped it
    per_step: dict[str, int] = {}
    for r in rows:
        for name, n in r["skipped"].items():
            per_step[name] = per_step.get(name, 0) + n
    flat: dict[str, int] = {}
    for scope in ("metadata", "payload"):
        for src, by_reason in skipped[scope].items():
            for reason, n in by_reason.items():
                flat[f"{src}/{reason}"] = flat.get(f"{src}/{reason}", 0) + n
    assert per_step == flat
    named = {(k, reason) for r in rows for keys_ in r["skipped_keys"].values() for k, reason in keys_}
    assert named == {tuple(x) for src in skipped["keys"].values() for x in src}
    assert sum(r["skipped_payloads"] for r in rows) == sum(payload["image"].values())
    # resume from step 2: the same losses, the same skips per step, the same totals
    again = _rows(resumed)
    assert [r["step"] for r in again] == [2, 3]
    for a, b in zip(rows[2:], again):
        assert (
            a["loss"] == b["loss"] and a["skipped"] == b["skipped"] and a["skipped_keys"] == b["skipped_keys"]
        )
    assert json.loads((resumed / "summary.json").read_text())["skipped"] == skipped
