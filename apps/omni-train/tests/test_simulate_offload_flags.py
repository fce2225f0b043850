"""``omni-train simulate --workload``'s ``--offload`` (``Layout.offload``, the config's ``train.offload``)
and ``--host-gbps`` (``Device.host_Bps``), against hand counts of the step model's rule
(``omni_pipeline.step_model``'s module docstring): at pp = 1 the actions run in sequence, so offloading the
LLM's blocks lengthens the step by exactly ``2 * microbatches * layers * copied / host_Bps`` (each block's
saved bytes copied out in its forward and back in its backward), and the rank's peak drops by the one
in-flight microbatch's offloaded bytes, ``layers * copied``. Bad values are refused in one line naming
the flag."""

from __future__ import annotations

import json

import pytest

from omni_parallel.memory import block_activation_bytes
from omni_train.cli import main

DIM, LAYERS, HEADS, KV_HEADS, FFN, SEQ, MICROBATCHES = 128, 4, 4, 2, 256, 1024, 4
WORKLOAD = f"""
name = "offload-flags"
max_seq_len = {SEQ}
microbatches = {MICROBATCHES}
[model]
llm = {{ dim = {DIM}, n_layers = {LAYERS}, n_heads = {HEADS}, n_kv_heads = {KV_HEADS}, ffn_dim = {FFN}, gated_mlp = true }}
[[sources]]
name = "t"
modality = "text"
length = {{ fixed = {SEQ} }}
[[phases]]
weights = {{ t = 1 }}
"""
# one LLM block's saved bytes per microbatch at the pack length (bf16 under float32 masters, flash
# attention): omni-parallel's count, all of it offloaded without recompute
COPIED = block_activation_bytes(
    SEQ, DIM, KV_HEADS * DIM // HEADS, FFN, heads=HEADS, bytes_per=2, master_bytes=4, kernel="flash"
)
DEFAULT_HOST_BPS = 25e9  # Device.host_Bps's default


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("offload") / "w.toml"
    path.write_text(WORKLOAD)
    return path


def _simulate(workload, out, *flags) -> dict:
    """The whole step of ``uniform_on_demand`` at pp = 1 on one GPU (``simulate.json``)."""
    argv = ["simulate", "--workload", str(workload), "--gpus", "1", "--pp", "1", "--out", str(out), *flags]
    assert main(argv) == 0
    return json.loads((out / "simulate.json").read_text())["whole_step"]["uniform_on_demand"]


def test_offload_adds_the_hand_counted_copies_and_frees_the_offloaded_bytes(workload, tmp_path, capsys):
    base = _simulate(workload, tmp_path / "base")
    off = _simulate(workload, tmp_path / "off", "--offload", "llm")
    assert "offload llm over a 25 GB/s host link" in capsys.readouterr().out
    copies = 2 * MICROBATCHES * LAYERS * COPIED / DEFAULT_HOST_BPS  # out in forward, back in backward
    assert off["layout"]["offload"] == ["llm"] and base["layout"]["offload"] == []
    assert off["step_time_s"] - base["step_time_s"] == pytest.approx(copies, rel=1e-9)
    assert off["time_s"]["offload"] == pytest.approx(copies, rel=1e-9) and base["time_s"]["offload"] == 0
    # pp = 1: one microbatch in flight, its blocks' saved bytes on the host instead
    saved = base["memory_bytes"]["0"]["total"] - off["memory_bytes"]["0"]["total"]
    assert saved == pytest.approx(LAYERS * COPIED, rel=1e-12)
    # the host link: half the rate, twice the copies; twice the rate, half
    for gbps, scale in (("12.5", 2.0), ("50", 0.5)):
        got = _simulate(workload, tmp_path / gbps, "--offload", "llm", "--host-gbps", gbps)
        assert got["step_time_s"] - base["step_time_s"] == pytest.approx(scale * copies, rel=1e-9)
        assert got["memory_bytes"] == off["memory_bytes"]
    # without --offload the host link changes nothing
    assert _simulate(workload, tmp_path / "link", "--host-gbps", "12.5") == base


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (("--offload", "vision"), "--offload: name distinct block families of llm, image, audio"),
        (("--offload", "llm,llm"), "--offload: name distinct block families"),
        (("--offload", ","), "--offload: name distinct block families"),
        (("--offload", "llm", "--recompute"), "--offload: with --recompute"),
        (("--offload", "image"), "--offload: workload offload-flags has no image blocks"),
        (("--host-gbps", "0"), "--host-gbps: must be a finite number of GB/s > 0, got 0"),
        (("--host-gbps", "-3"), "--host-gbps: must be a finite number of GB/s > 0, got -3"),
        (("--host-gbps", "nan"), "--host-gbps: must be a finite number of GB/s > 0, got nan"),
    ],
)
def test_bad_offload_flags_are_refused_naming_the_flag(workload, tmp_path, capsys, flags, error):
    argv = ["simulate", "--workload", str(workload), "--gpus", "1", "--pp", "1", "--out", str(tmp_path)]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert error in err and len(err.strip().splitlines()) == 1, err


def test_offload_flags_need_a_workload(tmp_path, capsys):
    for flags in (("--offload", "llm"), ("--host-gbps", "10")):
        assert main(["simulate", "--out", str(tmp_path), *flags]) == 2
        assert (
            "--offload / --host-gbps: they set the whole-step model of --workload" in capsys.readouterr().err
        )
