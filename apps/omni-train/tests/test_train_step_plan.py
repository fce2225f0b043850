"""``placement = "planned"`` plans each step's data flow from that step's metadata (``omni_pipeline.step_plan``).

* In a 2-process run (pp=2) every step records the flow it ran (``"flow"`` records in ``actions.jsonl``);
  the encoder actions each rank ran are exactly those its step's flow placed there (the executor's own
  records, not the planner's answer), the flows change with the steps' media, and each is the plan
  ``StepPlanner`` makes again from the same step's metadata in this process (deterministic: every rank
  and every re-plan after a resume get the same flow). ``omni-train simulate --calibration`` simulates
  those per-step flows as "as run" beside the measured step time.
* The planner's memory cap reaches the search: a cap below the uncapped plan's modelled peak on rank 0
  gives a plan whose modelled peak is lower.
* Bad planner settings are named by their field.
"""

import dataclasses
import json
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config

from omni_data import encoder_microbatch_ids, split_encoder_microbatches
from omni_parallel.testing import run_world
from omni_pipeline import PlacementPolicy as Placement
from omni_pipeline import (
    Schedule1F1B,
    StepPlanner,
    modelled_step_costs,
    read_records,
    simulate,
    stage_weights,
)
from omni_train.binder import load_config
from omni_train.config import ConfigError
from omni_train.data_files import load_tokenizer
from omni_train.data_pipeline import build_step_stream
from omni_train.pipeline import config_scale, llm_shape, planner_spec, stage_split
from omni_train.preflight import validate
from omni_train.simulate import simulate_config

pytestmark = pytest.mark.slow
STEPS = 5


def _heavy(cfg):
    """Encoders wide enough that where they run matters (the fixture's are a few % of the step)."""
    m = cfg.model
    vit = dataclasses.replace(m.vit, dim=96, n_layers=3)
    audio = dataclasses.replace(m.audio, dim=96, n_layers=3)
    return dataclasses.replace(cfg, model=dataclasses.replace(m, vit=vit, audio=audio))


def _train(rank, world_size, cfg, out):
    from omni_train.trainer import Trainer

    Trainer(cfg, Path(out), resume=False).run()


def _planner_and_steps(cfg, steps):
    tok = load_tokenizer(cfg.data)
    llm = cfg.model.llm_config(tok.get_vocab_size())
    schedule = Schedule1F1B(cfg.parallel.pp, cfg.data.microbatches)
    enc = encoder_microbatch_ids(cfg.data.microbatches, cfg.parallel.pp)
    seq = cfg.data.max_seq_len
    weights = stage_weights(llm_shape(llm), stage_split(cfg.parallel, llm, seq), seq)
    planner = StepPlanner(planner_spec(cfg), schedule, enc, weights, pp_rank=0)
    stream = build_step_stream(cfg, tok, dp_rank=0, dp_size=1, dp_group=None, consumes=set(), read_text=False)
    with stream:
        stream.reset()
        got = [next(stream) for _ in range(steps)]
    return planner, schedule, got, llm


@pytest.fixture(scope="module")
def planned_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step_plan")
    data = make_dataset(tmp / "data")
    cfg = _heavy(load_config(str(write_config(tmp / "c.toml", data, steps=STEPS, every=0))))
    # a cap far below any placement's modelled peak: the plans are the least over it, and say by how much
    par = dataclasses.replace(cfg.parallel, placement=Placement.PLANNED, planner_memory_cap_mib=0.01)
    cfg = dataclasses.replace(cfg, parallel=par)
    out = tmp / "run"
    run_world(_train, 2, args=(cfg, str(out)), timeout_s=300)
    return cfg, out


def test_an_unmet_memory_cap_is_reported_per_step(planned_run):
    cfg, out = planned_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    planner, _, steps, _ = _planner_and_steps(cfg, STEPS)
    for row, fs in zip(rows, steps, strict=True):
        planner.consumes(fs.step, fs.packs, fs.microbatches)
        planner.flow(fs.step, fs.packs, fs.microbatches)
        assert row["planner_over_cap_bytes"] == planner.over_cap_bytes > 0, fs.step


def test_each_step_runs_its_own_planned_flow(planned_run):
    cfg, out = planned_run
    records = read_records(out)
    assert not (out / "dataflow.json").exists()  # no one flow for the run: each step's is recorded
    planner, schedule, steps, _ = _planner_and_steps(cfg, STEPS)
    spec = planner_spec(cfg)
    ranks = [StepPlanner(spec, schedule, planner.encoder_inputs, planner.weights, pp_rank=r) for r in (0, 1)]
    flows = []
    for fs in steps:
        flow = records.flow(fs.step)
        assert flow is not None, fs.step
        # what each rank's loader reads is only what the step's flow runs there: each payload read once
        reads = [p.consumes(fs.step, fs.packs, fs.microbatches) for p in ranks]
        assert reads == [set(flow.encoders_on(r)) for r in (0, 1)], fs.step
        assert reads[0].isdisjoint(reads[1]) and reads[0] | reads[1] == set(fs.microbatches), fs.step
        ran = {
            (r.microbatch, r.rank) for r in records.actions if r.step == fs.step and r.kind in ("EF", "EB")
        }
        assert ran == {(e, flow.encoder_rank(e)) for e in flow.encoder_consumer}, fs.step
        assert flow == planner.plan(fs.packs, fs.microbatches), fs.step
        flows.append(flow)
    assert len({f.to_json() for f in flows}) >= 2  # the plan follows the steps' media
    assert any(len(f.encoders_on(1)) for f in flows) and any(len(f.encoders_on(0)) for f in flows)


def test_simulate_calibration_uses_the_per_step_flows(planned_run, tmp_path):
    cfg, out = planned_run
    simulate_config(cfg, out_dir=tmp_path, calibration=out, steps=STEPS - 1, first_step=1, plots=False)
    as_run = json.loads((tmp_path / "simulate.json").read_text())["results"]["as run"]
    assert as_run["step_time_s"] > 0 and as_run["measured_step_time_s"] > 0


def test_the_memory_cap_reaches_the_plan(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = load_config(str(write_config(tmp_path / "c.toml", data, steps=2, every=0)))
    planner, schedule, steps, _ = _planner_and_steps(cfg, 3)
    lowered = 0
    for fs in steps:
        mbs = split_encoder_microbatches(fs.packs, cfg.data.microbatches, cfg.parallel.pp)
        costs = modelled_step_costs(
            config_scale(cfg), fs.packs, mbs, cfg.parallel.pp, 1e12, 1, planner.weights
        )
        free = simulate(schedule, planner.plan(fs.packs, mbs), costs).peak_activation_bytes[0]
        capped = StepPlanner(
            planner_spec(
                dataclasses.replace(
                    cfg, parallel=dataclasses.replace(cfg.parallel, planner_memory_cap_mib=0.5 * free / 2**20)
                )
            ),
            schedule,
            planner.encoder_inputs,
            planner.weights,
            pp_rank=0,
        )
        peak = simulate(schedule, capped.plan(fs.packs, mbs), costs).peak_activation_bytes[0]
        assert peak <= free
        lowered += peak < free
    assert lowered >= 1


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("planner_evaluations", 0, "parallel.planner_evaluations: must be >= 1"),
        ("planner_memory_cap_mib", -1.0, "parallel.planner_memory_cap_mib: must be a number of MiB > 0"),
        ("planner_memory_cap_mib", float("nan"), "parallel.planner_memory_cap_mib"),
    ],
)
def test_bad_planner_settings_are_named(tmp_path, field, value, match):
    data = make_dataset(tmp_path / "data")
    path = write_config(tmp_path / "c.toml", data, steps=2, every=0, parallel=f"{field} = {value!r}")
    with pytest.raises(ConfigError, match=match):
        validate(load_config(str(path)), 2)


@pytest.mark.parametrize("calibration", ["none", "file", "pp1"])
def test_a_bad_calibration_is_a_config_error_before_training(tmp_path, planned_run, calibration):
    _, run = planned_run  # recorded with pp=2
    data = make_dataset(tmp_path / "data")
    cfg = load_config(str(write_config(tmp_path / "c.toml", data, steps=2, every=0)))
    path = {"none": tmp_path / "none", "file": run / "config.json", "pp1": run}[calibration]
    par = dataclasses.replace(cfg.parallel, placement=Placement.PLANNED, planner_calibration=str(path))
    if calibration == "pp1":
        par = dataclasses.replace(par, pp=1, dp=2)
    cfg = dataclasses.replace(cfg, parallel=par)
    match = "recorded 2 pipeline stages" if calibration == "pp1" else str(path)
    with pytest.raises(ConfigError, match=rf"parallel.planner_calibration: .*{match}"):
        validate(cfg, 2)


def test_a_missing_calibration_is_named(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = load_config(str(write_config(tmp_path / "c.toml", data, steps=2, every=0)))
    cfg = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, planner_calibration=str(tmp_path / "none"))
    )
    with pytest.raises(ConfigError, match=r"parallel.planner_calibration: .*none"):
        StepPlanner(planner_spec(cfg), None, {}, [1.0, 1.0], pp_rank=0)
