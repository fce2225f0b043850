"""Multi-node launch: ``torchrun --nnodes 2 --nproc-per-node 1`` twice on loopback (two "nodes", c10d
rendezvous on 127.0.0.1 at a free port) trains 3 steps with the losses of the single-node 2-process run
(``omni-train run``, torch's elastic launcher), bit for bit; rank 0 prints where the outputs go."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config

from omni_train.launch import free_port

pytestmark = pytest.mark.slow


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "torch.distributed.run"]


def test_two_node_torchrun_on_loopback_matches_single_node(tmp_path):
    data = make_dataset(tmp_path / "data", n_image=8, n_audio=4, n_text=16)
    cfg = write_config(tmp_path / "c.toml", data, steps=3, every=0)
    cli = ["-m", "omni_train.cli", "run", "--config", str(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    # the single-node run goes side by side with the two nodes (they share nothing but the config): each
    # launcher imports torch on one core before its workers start
    log = tmp_path / "single.log"
    with open(log, "w") as f:
        single = subprocess.Popen(
            [sys.executable, *cli, "--out", str(tmp_path / "single")],
            stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip

    rdzv = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"omni-{uuid.uuid4().hex[:8]}",
        "--local-addr", "127.0.0.1",
    ]  # fmt: skip
    cmd = [*_torchrun(), *rdzv, *cli, "--out", str(tmp_path / "multi")]
    nodes = [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        for _ in range(2)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=300)[0])
        single.wait(timeout=300)
    finally:  # each launcher leads a session of its own: its workers die with it
        for p in [*nodes, single]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert single.returncode == 0, log.read_text()[-3000:]
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out[-3000:]
    # rank 0's node says where the outputs go, and only it
    told = [out for out in outputs if f"(torchrun) -> {tmp_path / 'multi'}" in out]
    assert len(told) == 1 and f"done; outputs in {tmp_path / 'multi'}" in told[0], outputs
    assert len(_losses(tmp_path / "single")) == 3
    assert _losses(tmp_path / "multi") == _losses(tmp_path / "single")
    assert (tmp_path / "multi" / "checkpoints" / "step-00000003" / "manifest.msgpack").is_file()
