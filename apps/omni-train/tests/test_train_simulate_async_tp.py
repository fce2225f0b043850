"""Async TP between the step model and the trainer: ``workload_config`` writes ``parallel.async_tp`` (the
preflight accepts it, and refuses it where the trainer cannot run it: the tuner's check), and
``omni-train simulate --workload --async-tp`` prices only the exposed part of the SP rings."""

from __future__ import annotations

import dataclasses
import json

from omni_pipeline.step_model import Layout
from omni_train.cli import main
from omni_train.preflight import validate
from omni_train.simulate import layout_check, resolve_workload, workload_config


def test_workload_config_writes_async_tp_and_the_check_knows_its_limits():
    w = resolve_workload("paper-vlm")
    lay = Layout(pp=2, dp=2, tp=2, sequence_parallel=True, async_tp=True)
    cfg = workload_config(w, lay)
    assert cfg.parallel.async_tp is True and cfg.parallel.sequence_parallel is True
    validate(cfg, lay.gpus)
    assert workload_config(w, dataclasses.replace(lay, async_tp=False)).parallel.async_tp is False
    check = layout_check(w)
    assert check(lay) is None
    # with CP the trainer runs plain SP only: refused, naming the field (the tuner then searches plain SP)
    with_cp = Layout(pp=1, dp=1, tp=2, sequence_parallel=True, cp=2)
    assert check(with_cp) is None
    assert "parallel.async_tp" in check(dataclasses.replace(with_cp, async_tp=True))


def test_simulate_async_tp_flag_prices_the_exposed_rings(tmp_path, capsys):
    argv = ["simulate", "--workload", "paper-vlm", "--gpus", "16", "--pp", "2", "--tp", "2",
            "--sequence-parallel", "--microbatches", "4", "--analytic-memory"]  # fmt: skip
    tp = {}
    for flag in ((), ("--async-tp",)):
        out = tmp_path / ("async" if flag else "plain")
        assert main([*argv, *flag, "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        assert ("+SP +async TP," in printed) == bool(flag), printed
        row = json.loads((out / "simulate.json").read_text())["whole_step"]["uniform_on_demand"]
        tp[bool(flag)] = row["time_s"]["tp"]
    assert 0 <= tp[True] < tp[False]
    # without SP: a configuration error naming the flags
    no_sp = [a for a in argv if a != "--sequence-parallel"]
    assert main([*no_sp, "--async-tp", "--out", str(tmp_path / "bad")]) == 2
    assert "--async-tp" in capsys.readouterr().err
    # without --workload the recipe's layout comes from [parallel]: the whole-step layout flags are refused,
    # each named, before anything is simulated
    assert main(["simulate", "--async-tp", "--tp", "2", "--out", str(tmp_path / "recipe")]) == 2
    err = capsys.readouterr().err
    assert "--tp / --async-tp:" in err and "add --workload" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "recipe").exists()
