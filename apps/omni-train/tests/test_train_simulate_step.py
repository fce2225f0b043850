"""The simulator's whole step against ``omni-train memory``: per-rank state bytes equal what the memory
plan builds for the same layout (exactly), activations by the same formula; the analytic state the tuner
searches with is close to it; ``simulate --workload`` prints where the time goes and the OOM verdict;
``omni-train tune`` writes a config the trainer loads and preflight accepts."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest

from omni_parallel.memory import KINDS
from omni_pipeline.step_model import Device, Layout, predict_step, rank_memory
from omni_train.binder import load_config
from omni_train.cli import main
from omni_train.memory_plan import memory_plan
from omni_train.preflight import validate
from omni_train.simulate import exact_state, resolve_workload, workload_config

LAYOUTS = [
    Layout(pp=2, dp=4, llm_zero=1),
    Layout(pp=4, dp=2, ulysses=2, llm_zero=3, recompute=True),
    Layout(pp=2, dp=2, tp=2, sequence_parallel=True, recompute=True),
]


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda lay: f"pp{lay.pp}-tp{lay.tp}-u{lay.ulysses}-z{lay.llm_zero}"
)
def test_predicted_state_and_activations_equal_omni_train_memory(layout):
    w = resolve_workload("paper-vlm")
    m = 8
    plan = memory_plan(workload_config(w, layout, m), layout.gpus, vocab=32000)
    p = predict_step(w, layout, microbatches=m, state=exact_state(w, layout, m))
    analytic = rank_memory(dataclasses.replace(w, microbatches=m), layout)
    for r in plan["ranks"]:
        if r["rank"] % (layout.gpus // layout.pp):  # the stage's first rank: the largest shards
            continue
        for pp_rank in r["same_pp_ranks"]:
            row = p.memory[pp_rank]
            for k in KINDS:
                assert row[f"llm_{k}"] == r["llm"][k], (pp_rank, k)
                assert row[f"enc_{k}"] == r["encoders"][k], (pp_rank, k)
            # the tuner's analytic state (omni_parallel.memory.analytic_state_bytes): within 0.5% of the
            # build for the LLM's parameters, gradients and AdamW state (FSDP2 padding aside)
            for k in ("parameters", "gradients", "optimizer"):
                assert math.isclose(analytic[pp_rank][f"llm_{k}"], r["llm"][k], rel_tol=5e-3), (pp_rank, k)
        # the same activation formula: 1F1B's in-flight microbatches of the rank's stage
        assert analytic[r["pp_rank"]]["activations"] == r["llm_activations_estimate"]
    # the simulated peak holds at least the LLM's in-flight activations (encoders add to it)
    assert all(p.memory[q]["activations"] >= analytic[q]["activations"] for q in range(layout.pp))


def test_simulate_workload_prints_where_the_time_goes_and_the_oom_verdict(tmp_path, capsys):
    out = tmp_path / "sim"
    argv = ["simulate", "--workload", "paper-vlm", "--gpus", "32", "--pp", "4", "--tp", "2",
            "--sequence-parallel", "--microbatches", "8", "--out", str(out)]  # fmt: skip
    t0 = time.perf_counter()
    assert main([*argv, "--device-memory-gb", "1000"]) == 0
    print(f"simulate whole step: {time.perf_counter() - t0:.2f} s")
    printed = capsys.readouterr().out
    assert "where the time goes" in printed and "tp " in printed and "fits" in printed
    res = json.loads((out / "simulate.json").read_text())
    row = res["whole_step"]["uniform_on_demand"]
    assert row["time_s"]["tp"] > 0 and row["time_s"]["llm_all_reduce"] > 0 and res["exact_memory"]
    assert math.isclose(sum(row["time_s"].values()), row["step_time_s"], rel_tol=1e-9)
    assert main([*argv, "--device-memory-gb", "10"]) == 0
    assert "OOM" in capsys.readouterr().out
    # a layout the trainer refuses is a configuration error naming the field
    assert main([*argv[:-2], "--llm-zero", "3", "--out", str(out)]) == 2
    assert "llm_zero" in capsys.readouterr().err


def test_tune_writes_a_config_the_trainer_accepts(tmp_path, capsys):
    cfg_path = tmp_path / "best.toml"
    argv = ["tune", "--workload", "paper-vlm", "--gpus", "16", "--global-batch", "32", "--top", "3",
            "--out", str(tmp_path / "tune"), "--write-config", str(cfg_path)]  # fmt: skip
    t0 = time.perf_counter()
    assert main(argv) == 0
    print(f"tune at 16 GPUs: {time.perf_counter() - t0:.2f} s")
    printed = capsys.readouterr().out
    assert "best plan" in printed and "where the time goes" in printed
    res = json.loads((tmp_path / "tune" / "tune.json").read_text())
    plans = res["plans"]
    assert 1 <= len(plans) <= 3 and res["simulated"] > 0
    assert [p["tokens_per_s"] for p in plans] == sorted((p["tokens_per_s"] for p in plans), reverse=True)
    assert all(max(r["total"] for r in p["memory_bytes"].values()) <= Device().memory_bytes for p in plans)
    best = plans[0]["layout"]
    cfg = load_config(str(cfg_path))
    validate(cfg, 16)
    par = cfg.parallel
    assert (par.pp, par.dp, par.tp, par.cp, par.ulysses, par.llm_zero) == (
        best["pp"],
        best["dp"],
        best["tp"],
        best["cp"],
        best["ulysses"],
        best["llm_zero"],
    )
    assert par.world_size == 16 and cfg.data.max_seq_len == 16384 and cfg.model.llm.dim == 5120
    assert ("llm" in cfg.train.recompute) == best["recompute"]
    assert cfg.data.microbatches * par.dp == 32
