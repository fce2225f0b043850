"""``benchmarks/gpu/check.sh``: without a GPU it says so and exits 0; ``--smoke`` runs every step of the GPU
path (the CUDA tests, the MFU benchmark with its calibration file, the trainer at pp=1 in bf16) on the
CPU with tiny sizes and prints the table, so nothing but the device itself is untested there."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "benchmarks" / "gpu" / "check.sh"
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

from bench import peak_bf16  # noqa: E402


def _check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        ["bash", str(CHECK), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_peak_table_matches_the_most_specific_name():
    assert peak_bf16("NVIDIA H200") == 989.4e12
    assert peak_bf16("NVIDIA GH200 480GB") == 989.4e12
    assert peak_bf16("NVIDIA H20") == 148.0e12
    assert peak_bf16("NVIDIA H100 PCIe") == 756.0e12
    assert peak_bf16("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_bf16("NVIDIA L40S") == 362.0e12 and peak_bf16("NVIDIA L4") == 121.0e12
    assert peak_bf16("NVIDIA A100-SXM4-80GB") == 312.0e12
    assert peak_bf16("Some Future GPU") is None


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    r = _check("--out", str(tmp_path / "x"), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "needs a CUDA GPU" in r.stdout
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_smoke_runs_every_step_on_the_cpu_and_prints_one_table(tmp_path):
    out = tmp_path / "check"
    r = _check("--smoke", "--out", str(out), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    status = [line.split("\t") for line in (out / "status.tsv").read_text().splitlines()]
    assert [(name, rc) for name, rc, _ in status] == [("tests", "0"), ("bench", "0"), ("train", "0")]
    table = r.stdout.strip().splitlines()
    assert table[0] == "| check | result | detail |" and table[-1].startswith("| total | PASS |")
    assert "SKIP (no GPU)" in table[2] and "0 failed" in table[2] and " 0 skipped" not in table[2]
    assert any(row.startswith("| LLM block bf16, dim 64") for row in table)
    assert any(row.startswith("| trainer, pp=1, 1 process, bf16 | PASS | 2 steps") for row in table)
    assert (out / "table.md").read_text().strip() == r.stdout.strip()
    cal = json.loads((out / "calibration.json").read_text())
    assert cal["format"] == "omni-train-layer-times/1" and set(cal["layers"]) == {"llm_block", "vit_block"}
    for layer in cal["layers"].values():
        for rec in layer["records"]:
            assert rec["tokens"] == sum(rec["docs"]) and rec["tokens_sq"] == sum(n * n for n in rec["docs"])
            assert rec["forward_s"] > 0 and rec["backward_s"] >= 0
    bench = json.loads((out / "bench.json").read_text())
    llm = bench["models"]["llm_block"]
    assert llm["mfu"] is None and llm["mfu_measured"] > 0 and llm["fused_varlen"] is False
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["checkpoints"] == [2]
    assert json.loads((out / "train" / "config.json").read_text())["train"]["dtype"] == "bfloat16"
