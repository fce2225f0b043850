"""The trainer on gzip-compressed shards (``.tar.gz`` / ``.tgz``, as ``gzip shard.tar`` leaves them): a
2-process run trains the same losses as on the plain shards (the oracle: the same data uncompressed), and
a run SIGKILLed mid-training and resumed with ``--resume`` repeats the uninterrupted run's losses exactly;
a zstd shard stops the run with a message naming the file and the compression."""

import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_fixtures import make_dataset, side_by_side, write_config

from omni_parallel.testing import WorldError, run_world

pytestmark = pytest.mark.slow


def _losses(out: Path) -> list[float]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


def _gzip_dataset(data: dict, root: Path) -> dict:
    """The shards of ``data`` gzip-compressed under ``root``: images as ``.tgz``, the rest ``.tar.gz``."""
    root.mkdir(parents=True)
    out = dict(data, root=root)
    for kind, suffix in (("image", "tgz"), ("audio", "tar.gz"), ("text", "tar.gz")):
        for tar in sorted(Path(data["root"]).glob(f"{kind}-*.tar")):
            dst = root / f"{tar.stem}.{suffix}"
            with open(tar, "rb") as src, gzip.GzipFile(dst, "wb", mtime=0) as f:
                shutil.copyfileobj(src, f)
        out[kind] = str(root / f"{kind}-*.{suffix}")
    return out


def _train(rank, world_size, cfg_paths, outs):
    from omni_train.binder import load_config
    from omni_train.trainer import Trainer

    for path, out in zip(cfg_paths, outs):
        Trainer(load_config(path), Path(out), resume=False).run()


def _cli(*args: str, **kw) -> subprocess.Popen:
    exe = [sys.executable, "-m", "omni_train.cli", *args]
    return subprocess.Popen(exe, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_gzip_shards_train_like_plain_ones_and_resume_exactly(tmp_path):
    plain = make_dataset(tmp_path / "data")
    gz = _gzip_dataset(plain, tmp_path / "gz")
    assert next(Path(gz["root"]).glob("image-*.tgz")).read_bytes()[:2] == b"\x1f\x8b"
    steps = 10
    cfg_plain = write_config(tmp_path / "plain.toml", plain, steps=steps, every=2)
    cfg_gz = write_config(tmp_path / "gz.toml", gz, steps=steps, every=2)
    a, ref = tmp_path / "a", tmp_path / "plain"
    b = tmp_path / "b"

    def killed_and_resumed() -> None:
        p = _cli("run", "--config", str(cfg_gz), "--out", str(b), start_new_session=True)
        try:
            latest = b / "checkpoints" / "latest"
            deadline = time.monotonic() + 300
            while not (latest.exists() and len(_losses(b)) >= 3):
                assert p.poll() is None, p.communicate()[0]
                assert time.monotonic() < deadline, "timed out waiting for step 3"
                time.sleep(0.02)
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=60)
            done = len(_losses(b))
            assert done < steps, f"the run finished ({done} steps) before it could be killed"
            p = _cli("run", "--config", str(cfg_gz), "--out", str(b), "--resume", start_new_session=True)
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, out
        finally:  # a failed wait leaves no run going: each CLI run leads a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)

    # The 2-process world training on the plain and the gzip shards runs side by side with the CLI run
    # that is killed and resumed (other run folders): a launcher imports torch on one core, and two
    # pipeline ranks leave a core half idle.
    side_by_side(
        killed_and_resumed,
        lambda: run_world(_train, 2, timeout_s=600, args=([str(cfg_plain), str(cfg_gz)], [str(ref), str(a)])),
    )
    assert len(_losses(a)) == steps and _losses(a) == _losses(ref)  # the same samples, bit for bit
    assert _losses(b) == _losses(a)  # step for step, bit for bit


def test_zstd_shard_stops_the_run_naming_the_file(tmp_path):
    data = make_dataset(tmp_path / "data", n_image=4, n_audio=2, n_text=4)
    bad = Path(data["root"]) / "text-000.tar"
    # zstd's magic in front, as a .tar.zst starts
    bad.write_bytes(b"\x28\xb5\x2f\xfd" + bad.read_bytes())
    cfg = write_config(tmp_path / "c.toml", data, steps=2, pp=1)
    with pytest.raises(WorldError, match=re.escape(f"{bad}: zstd-compressed shard: not supported")):
        run_world(_train, 1, timeout_s=300, args=([str(cfg)], [str(tmp_path / "out")]))
