"""``omni-train simulate --calibration RUN_DIR``: the fitted cost model times the recipe's steps, and the
run's own flow is predicted beside its measured step time."""

from __future__ import annotations

import json

import pytest
from train_fixtures import make_dataset, write_config

from omni_data import Modality, split_encoder_microbatches
from omni_pipeline import (
    Action,
    ActionKind,
    ActionRecord,
    CostModel,
    DataFlow,
    RecordWriter,
    Schedule1F1B,
    StepRecord,
    simulate,
    uniform_on_demand,
)
from omni_train.binder import load_config
from omni_train.cli import main
from omni_train.data_files import load_tokenizer
from omni_train.data_pipeline import build_step_stream

PER_TOKEN = {"F0": 2e-5, "B0": 4e-5, "F1": 3e-5, "B1": 6e-5, "EF:image": 1e-5, "EF:audio": 5e-6}
SQ = {"F0": 1e-9, "B0": 2e-9, "F1": 1e-9, "B1": 2e-9, "EF:image": 2e-9, "EF:audio": 1e-9}
OVERHEAD = 0.01


def seconds(key: str, n: int, sq: int | None = None) -> float:
    if key.startswith("EB"):
        return 2 * seconds("EF" + key[2:], n, sq)
    return PER_TOKEN[key] * n + SQ[key] * (n * n if sq is None else sq)


def write_run(run, steps: int = 4, cpu: tuple[float, float] | None = None) -> None:
    """A run directory as the trainer writes it: per-action records with exactly known per-token costs
    (token counts varied so the fit is determined), step records, the flow it ran, metrics. ``cpu``:
    each process's CPU seconds per step beside its actions (in the pipeline, outside it) in the step
    records' ``pipeline_cpu_s`` / ``cpu_s``."""
    recs = []
    for step in range(steps):
        for rank in (0, 1):
            t = 0.0
            for i, n in enumerate((40 + 7 * step, 90 - 5 * step, 65)):
                for kind in ("F", "B"):
                    s = seconds(f"{kind}{rank}", n)
                    recs.append(ActionRecord(step, rank, kind, rank, i, {"llm": n}, {"llm": n * n}, t, t + s))
                    t += s
                for kind in ("EF", "EB"):
                    for j, mod in enumerate(("image", "audio")):
                        m = n + 11 * j + step
                        s = seconds(f"{kind}:{mod}", m)
                        e = 2 * i + j + 1
                        recs.append(ActionRecord(step, rank, kind, None, e, {mod: m}, {mod: m * m}, t, t + s))
                        t += s
            cpus = (t + cpu[0] + cpu[1], t + cpu[0]) if cpu is not None else (None, None)
            recs.append(StepRecord(step, rank, t + OVERHEAD, t, *cpus))
    with RecordWriter(run / "actions.jsonl") as w:
        w.write(recs)


def hand_costs(cfg, packs, mbs) -> CostModel:
    """The true per-action seconds of one step from its packs (the documented token convention:
    LLM pack tokens and per-document squares, ViT patches before the 2x2 merge, audio frames), built
    without the fit."""
    llm = {}
    for k, p in enumerate(packs):
        n, sq = p.num_tokens, sum(d * d for d in p.seqlens)  # attention per packed document
        for s in (0, 1):
            llm[Action(ActionKind.FORWARD, k, s)] = seconds(f"F{s}", n, sq)
            llm[Action(ActionKind.BACKWARD, k, s)] = seconds(f"B{s}", n, sq)
    ef = {}
    for e, items in mbs.items():
        ef[e] = 0.0
        for p, i in items:
            sample = packs[p].samples[i]
            if sample.modality is Modality.IMAGE:
                ef[e] += seconds("EF:image", sample.media_tokens * cfg.model.vit.merge**2)
            else:
                ef[e] += seconds("EF:audio", sample.media_tokens)
    return CostModel(llm_action_s=llm, encoder_forward_s=ef, step_overhead_s=OVERHEAD)


def hand_step_costs(cfg, steps: int) -> list[CostModel]:
    """:func:`hand_costs` of the config's own steps 1 .. ``steps - 1`` (the data stream is deterministic;
    step 0 is the warm-up the simulate commands skip)."""
    stream = build_step_stream(
        cfg, load_tokenizer(cfg.data), dp_rank=0, dp_size=1, dp_group=None, consumes=set(), read_text=False
    )
    out = []
    with stream:
        stream.reset()
        for _ in range(steps):
            fs = next(stream)
            if fs.step >= 1:
                out.append(
                    hand_costs(cfg, fs.packs, split_encoder_microbatches(fs.packs, cfg.data.microbatches, 2))
                )
    return out


def test_calibrated_simulate_predicts_the_run_flow_from_the_fit(tmp_path, capsys):
    data = make_dataset(tmp_path / "data", n_image=6, n_audio=4, n_text=6)
    cfg_path = write_config(tmp_path / "c.toml", data, extra="")
    cfg = load_config(str(cfg_path))
    run = tmp_path / "run"
    write_run(run)
    schedule = Schedule1F1B(2, cfg.data.microbatches)
    enc_inputs = {k: [2 * k - 1, 2 * k] for k in range(1, cfg.data.microbatches + 1)}
    flow = uniform_on_demand(schedule, enc_inputs, fixed_ranks=True)  # what the trainer runs today
    (run / "dataflow.json").write_text(flow.to_json())

    want = [
        simulate(schedule, DataFlow.from_json(flow.to_json()), costs) for costs in hand_step_costs(cfg, 3)
    ]
    measured = {1: 0.5, 2: 0.7}
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "step_time_s": t}) + "\n" for s, t in measured.items())
    )
    out = tmp_path / "sim"
    argv = ["simulate", "--config", str(cfg_path), "--calibration", str(run), "--steps", "2"]
    assert main([*argv, "--first-step", "1", "--out", str(out)]) == 0
    res = json.loads((out / "simulate.json").read_text())
    assert res["steps"] == [1, 2] and res["pp"] == 2 and res["gpus"] == 2
    assert set(res["results"]) == {
        "prepend_first_stage",
        "isolated",
        "uniform_on_demand",
        "planned",
        "as run",
    }
    as_run = res["results"]["as run"]
    assert as_run["step_time_s"] == pytest.approx(sum(r.step_time_s for r in want) / 2, rel=1e-6)
    assert as_run["measured_step_time_s"] == pytest.approx(0.6)
    printed = capsys.readouterr().out
    assert "as run: predicted" in printed and "measured 0.6 s" in printed
    for r in res["results"].values():
        assert r["step_time_s"] > OVERHEAD
    assert res["results"]["planned"]["step_time_s"] <= min(
        res["results"][p]["step_time_s"] for p in ("prepend_first_stage", "isolated", "uniform_on_demand")
    ) * (1 + 1e-9)


def test_calibration_errors_are_configuration_errors(tmp_path, capsys):
    data = make_dataset(tmp_path / "data", n_image=6, n_audio=4, n_text=6)
    cfg_path = write_config(tmp_path / "c.toml", data)
    argv = ["simulate", "--config", str(cfg_path), "--out", str(tmp_path / "sim"), "--calibration"]
    assert main([*argv, str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    one_stage = tmp_path / "one"
    with RecordWriter(one_stage / "actions.jsonl") as w:
        w.write([ActionRecord(0, 0, "F", 0, 0, {"llm": 10}, {"llm": 100}, 0.0, 1.0)])
    assert main([*argv, str(one_stage)]) == 2
    assert "the run recorded 1 stages, the config has parallel.pp = 2" in capsys.readouterr().err
    assert main([*argv, str(one_stage), "--scale", "paper"]) == 2
    assert "a calibration times the config's own models" in capsys.readouterr().err


def test_out_of_sample_simulate_predicts_another_run(tmp_path, capsys):
    """``omni-train simulate --calibration A --measured B --host-cores 2``: B's steps (its config's stream,
    its flow, its measured times) predicted from A's fit, against the step computed from the true costs
    without the fit (the hand costs; ``host_step_s`` with A's per-process CPU beside the actions, 20 ms in
    the pipeline and 4 ms outside it, written into A's step records)."""
    from omni_pipeline.calibrate import ProcessCpu, host_step_s

    data = make_dataset(tmp_path / "data", n_image=6, n_audio=4, n_text=6)
    cfg = load_config(str(write_config(tmp_path / "c.toml", data, extra="")))
    fit, run = tmp_path / "fit", tmp_path / "run"
    write_run(fit, cpu=(0.02, 0.004))
    run.mkdir()
    for d in (fit, run):
        (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    schedule = Schedule1F1B(2, cfg.data.microbatches)
    enc_inputs = {k: [2 * k - 1, 2 * k] for k in range(1, cfg.data.microbatches + 1)}
    flow = uniform_on_demand(schedule, enc_inputs, fixed_ranks=True)
    (run / "dataflow.json").write_text(flow.to_json())
    measured = {0: 9.0, 1: 0.5, 2: 0.7, 3: 0.6}  # step 0: warm-up, neither fitted nor predicted
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "step_time_s": t}) + "\n" for s, t in measured.items())
    )
    cpu = ProcessCpu(0.02, 0.004)
    want = [
        host_step_s(schedule, flow, costs, processes=2, cores=2, process_cpu=cpu)
        for costs in hand_step_costs(cfg, 4)
    ]
    out = tmp_path / "sim"
    argv = ["simulate", "--calibration", str(fit), "--measured", str(run), "--host-cores", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    res = json.loads((out / "simulate.json").read_text())
    assert res["steps"] == [1, 2, 3] and res["restaged"] is False and res["host_cores"] == 2
    assert res["process_cpu"] == pytest.approx({"background_s": 0.02, "outside_s": 0.004, "skipped_steps": 0})
    as_run = res["results"]["as run"]
    assert as_run["step_time_s"] == pytest.approx(sum(want) / 3, rel=1e-6)
    assert as_run["measured_step_time_s"] == pytest.approx(0.6)
    printed = capsys.readouterr().out
    error = 100 * (sum(want) / 3 / 0.6 - 1)
    assert f"measured 0.6 s ({error:+.1f} %)" in printed and "2 processes on 2 cores" in printed
