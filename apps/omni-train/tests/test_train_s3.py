"""A training run on an object store: 2 processes read their shards from, and write their checkpoints to,
a real S3 server on loopback (moto's, started by the root conftest's ``s3_bucket`` fixture; s3fs is
fsspec's S3 backend; ``checkpoint.url = "s3://..."``), are killed with SIGKILL mid-run (between two
commits, an upload possibly in flight), and resumed with ``resume=True`` from the step committed on S3.

Oracle: the same config trained once, uninterrupted, on the same shards on a local disk with local
checkpoints; the resumed run's losses (one line per step in ``metrics.jsonl``) equal it bit for bit.
"""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config

from omni_ckpt import CheckpointManager
from omni_parallel.testing import WorldError, run_world
from omni_train.binder import load_config

pytestmark = pytest.mark.slow

STEPS = 8


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train(rank, world_size, cfg, out, resume, env, pids):
    from omni_train.trainer import Trainer

    os.environ.update(env)  # the forkserver that starts the ranks may predate the fixture's environment
    if pids is not None:
        Path(pids, f"rank-{rank}").write_text(str(os.getpid()))
    Trainer(cfg, Path(out), resume=resume).run()


def test_a_run_on_s3_shards_and_checkpoints_killed_and_resumed_equals_the_uninterrupted_run(
    s3_bucket, tmp_path
):
    import fsspec

    url, env = s3_bucket
    data = make_dataset(tmp_path / "data", n_image=12, n_audio=8, n_text=16)
    local = write_config(tmp_path / "local.toml", data, steps=STEPS, every=2)
    fsspec.filesystem("s3").put(str(tmp_path / "data"), f"{url[5:]}/data", recursive=True)
    remote = {k: f"{url}/data/{Path(v).name}" for k, v in data.items() if k in ("image", "audio", "text")}
    on_s3 = write_config(tmp_path / "s3.toml", {**data, **remote}, steps=STEPS, every=2)
    ckpt = f"{url}/run/checkpoints"
    cfg = load_config(str(on_s3), [("checkpoint.url", ckpt)])
    assert cfg.data.sources[0].urls.startswith("s3://")

    oracle = tmp_path / "oracle"
    run_world(_train, 2, timeout_s=600, args=(load_config(str(local)), str(oracle), False, env, None))
    assert len(_losses(oracle)) == STEPS

    # the run on S3, killed (SIGKILL, every rank) once step 4 is committed there
    out, pids = tmp_path / "s3run", tmp_path / "pids"
    pids.mkdir()
    failed: list[BaseException] = []

    def run():
        try:
            run_world(_train, 2, timeout_s=600, args=(cfg, str(out), False, env, str(pids)))
        except WorldError as exc:
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    watcher = CheckpointManager(ckpt, keep_last=None, async_save=False)
    deadline = time.monotonic() + 600
    while 4 not in watcher.steps() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    for f in pids.iterdir():
        os.kill(int(f.read_text()), signal.SIGKILL)
    thread.join()
    assert failed, "the run ended before it could be killed"
    killed_at = watcher.latest()
    assert killed_at is not None and 4 <= killed_at < STEPS
    assert not (tmp_path / "s3run" / "checkpoints").exists()  # nothing went to the local disk

    run_world(_train, 2, timeout_s=600, args=(cfg, str(out), True, env, None))
    assert _losses(out) == _losses(oracle)  # steps after the kill trained again, bit for bit
    assert watcher.steps() == [STEPS - 2, STEPS] and watcher.latest() == STEPS  # keep_last 2, on S3
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == killed_at


@pytest.mark.parametrize("url", ["nosuch://bucket/ckpt"])
def test_a_checkpoint_url_fsspec_cannot_open_is_one_line_naming_the_field(tmp_path, url):
    from omni_train.config import ConfigError
    from omni_train.preflight import validate

    data = make_dataset(tmp_path / "data", n_image=2, n_audio=2, n_text=2)
    cfg = load_config(str(write_config(tmp_path / "c.toml", data)), [("checkpoint.url", url)])
    with pytest.raises(ConfigError, match=r"^checkpoint\.url: "):
        validate(cfg, 2)
