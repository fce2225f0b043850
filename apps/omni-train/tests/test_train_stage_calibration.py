"""``parallel.stage_layers = "auto"`` with ``parallel.stage_calibration = RUN_DIR``: the layer split is
balanced on the per-layer and LM head + loss seconds fitted from a run's measured per-stage times.

Oracle: a brute force over every split, each stage timed with the true layer and head seconds (the
ones the synthetic records were made from, or, for a real run's records, solved by hand from its
per-stage means), against which the trainer's split must be the fastest; the modelled split is shown to
be another one first, so the calibration is what decides. Bad calibration runs are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from train_fixtures import make_dataset, write_config

from omni_parallel.testing import run_world
from omni_pipeline import layer_costs
from omni_train.binder import load_config, resume_differences
from omni_train.config import ConfigError
from omni_train.data_files import tokenizer_path
from omni_train.pipeline import llm_shape, measured_layer_costs, stage_split
from omni_train.preflight import validate

LAYERS = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("stagecal"))


def _cfg(data, tmp: Path, **par):
    cfg = load_config(str(write_config(tmp / "c.toml", data, steps=3, every=0)))
    llm = dataclasses.replace(cfg.model.llm, n_layers=LAYERS)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, llm=llm), parallel=dataclasses.replace(cfg.parallel, **par)
    )


def _llm(cfg):
    return cfg.model.llm_config(Tokenizer.from_file(str(tokenizer_path(cfg.data))).get_vocab_size())


def _best(layer_s: float, first_s: float, head_s: float, stages: int = 2) -> list[int]:
    """Brute force: the layer counts whose slowest stage is fastest (first such in lexicographic order)."""
    best = None
    for k in range(1, LAYERS):  # two stages
        counts = [k, LAYERS - k]
        t = max(counts[0] * layer_s + first_s, counts[1] * layer_s + head_s)
        if best is None or t < best[0] - 1e-15:
            best = (t, counts)
    return best[1]


def _write_run(run: Path, cfg, stage_seconds: list[float], steps: int = 4, microbatches: int = 2) -> None:
    """A run directory: ``cfg`` as config.json, and records whose F + B per microbatch on stage ``s``
    take ``stage_seconds[s]`` (one third forward, two thirds backward)."""
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    lines = []
    for step in range(steps):
        for s, sec in enumerate(stage_seconds):
            t = 0.0
            for mb in range(microbatches):
                for kind, part in (("F", 1 / 3), ("B", 2 / 3)):
                    rec = dict(type="action", kind=kind, stage=s, microbatch=mb, rank=s, step=step)
                    rec.update(start_s=t, end_s=t + sec * part, tokens={"llm": 96}, tokens_sq={}, wait_s=0.0)
                    lines.append(json.dumps(rec))
                    t += sec * part
    (run / "actions.jsonl").write_text("\n".join(lines) + "\n")


def test_split_follows_the_measured_layer_and_head_costs(data, tmp_path):
    cfg = _cfg(data, tmp_path, stage_layers="auto")
    llm = _llm(cfg)
    seq = cfg.data.max_seq_len
    modelled = [len(r) for r in stage_split(cfg.parallel, llm, seq)]
    layer, head = 0.010, 0.030  # the head + loss as heavy as three layers on this "machine"
    assert _best(layer, 0.0, head) == [3, 1] != modelled == [2, 2]  # the models disagree
    recorded = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, stage_layers=[2, 2]))
    _write_run(tmp_path / "run", recorded, [2 * layer, 2 * layer + head])
    got_layer, got_first, got_head = measured_layer_costs(tmp_path / "run", llm, seq)
    assert got_layer == pytest.approx(layer, rel=1e-3) and got_head == pytest.approx(head, rel=1e-3)
    block, first, _ = layer_costs(llm_shape(llm), seq)
    assert got_first == pytest.approx(got_layer * first / block)  # the embedding: its modelled share
    calibrated = dataclasses.replace(cfg.parallel, stage_calibration=str(tmp_path / "run"))
    assert [len(r) for r in stage_split(calibrated, llm, seq)] == [3, 1]
    validate(dataclasses.replace(cfg, parallel=calibrated), 2)  # reads the run up front, and it is fine

    # a calibration run of the modelled "auto" split (its own LM head weighed with its vocabulary)
    _write_run(tmp_path / "auto", cfg, [2 * layer, 2 * layer + head])
    assert [len(r) for r in stage_split(cfg.parallel, llm, seq)] == [2, 2]
    modelled_run = dataclasses.replace(cfg.parallel, stage_calibration=str(tmp_path / "auto"))
    validate(dataclasses.replace(cfg, parallel=modelled_run), 2)
    assert [len(r) for r in stage_split(modelled_run, llm, seq)] == [3, 1]
    other = dataclasses.replace(llm, vocab_size=llm.vocab_size + 1)
    with pytest.raises(ConfigError, match=rf"auto: recorded with a vocabulary of {llm.vocab_size}"):
        stage_split(modelled_run, other, seq)

    # a calibration run whose own split was calibrated: its split is followed there first
    chained = dataclasses.replace(cfg, parallel=calibrated)  # auto + calibration from "run" = [3, 1]
    _write_run(tmp_path / "run2", chained, [3 * layer, layer + head])
    again = dataclasses.replace(cfg.parallel, stage_calibration=str(tmp_path / "run2"))
    assert measured_layer_costs(tmp_path / "run2", llm, seq)[::2] == pytest.approx((layer, head), rel=1e-3)
    assert [len(r) for r in stage_split(again, llm, seq)] == [3, 1]


def test_bad_calibration_runs_are_refused_by_name(data, tmp_path):
    cfg = _cfg(data, tmp_path, stage_layers="auto")
    llm, seq = _llm(cfg), cfg.data.max_seq_len

    def split(run, **par):
        p = dataclasses.replace(cfg.parallel, stage_calibration=str(run), **par)
        return stage_split(p, llm, seq)

    with pytest.raises(ConfigError, match=r"parallel.stage_calibration: .*nowhere: no readable run config"):
        split(tmp_path / "nowhere")
    wider = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, llm=dataclasses.replace(llm, dim=64))
    )
    _write_run(tmp_path / "wider", wider, [0.02, 0.05])
    with pytest.raises(ConfigError, match=r"another model shape \(dim differ\)"):
        split(tmp_path / "wider")
    _write_run(tmp_path / "one", cfg, [0.02])  # records of stage 0 only
    with pytest.raises(ConfigError, match=r"no LLM actions recorded for stages \[1\] of its 2"):
        split(tmp_path / "one")
    _write_run(tmp_path / "three", cfg, [0.02, 0.03, 0.05])  # records of 3 stages, config.json of 2
    with pytest.raises(ConfigError, match=r"three: actions.jsonl records LLM stage 2 .*over 2 stages"):
        split(tmp_path / "three")
    single = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=1, stage_layers=None))
    _write_run(tmp_path / "single", single, [0.05])
    with pytest.raises(ConfigError, match=r"single: recorded with 1 LLM stage .*>= 2 stages"):
        split(tmp_path / "single")
    _write_run(tmp_path / "untimed", cfg, [0.0, 0.0])
    with pytest.raises(ConfigError, match=r"untimed: .*fit no positive seconds per layer"):
        split(tmp_path / "untimed")
    with pytest.raises(ConfigError, match=r"parallel.stage_calibration: an empty path"):
        validate(
            dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, stage_calibration="")), 2
        )
    a, b = tmp_path / "a", tmp_path / "b"
    _write_run(
        a,
        dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, stage_calibration=str(b))),
        [1, 1],
    )
    _write_run(
        b,
        dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, stage_calibration=str(a))),
        [1, 1],
    )
    with pytest.raises(ConfigError, match="in a cycle"):
        split(a)
    bad = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, stage_layers=[2, 2], stage_calibration=str(a))
    )
    with pytest.raises(ConfigError, match=r"parallel.stage_calibration: calibrates the 'auto' split"):
        validate(bad, 2)


def _train(rank, world_size, cfg, out):
    import torch

    from omni_train.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(cfg, Path(out), resume=False)
    split = [len(r) for r in trainer.split]
    trainer.run()
    return split


def test_trainer_splits_by_a_real_runs_measured_stage_times(data, tmp_path):
    measured_run = tmp_path / "measured"
    cfg = _cfg(data, tmp_path, stage_layers=[2, 2])
    assert run_world(_train, 2, args=(cfg, str(measured_run)), timeout_s=300) == [[2, 2], [2, 2]]
    # the oracle, by hand from the raw records: per-stage mean F + B per microbatch after the first step
    rows = [json.loads(x) for x in (measured_run / "actions.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["type"] == "action" and r["stage"] is not None and r["step"] >= 1]
    per_mb = []
    for s in (0, 1):
        mine = [r for r in rows if r["stage"] == s]
        per_mb.append(
            sum(r["end_s"] - r["start_s"] for r in mine) / len({(r["step"], r["microbatch"]) for r in mine})
        )
    llm, seq = _llm(cfg), cfg.data.max_seq_len
    block, first, _ = layer_costs(llm_shape(llm), seq)
    layer = per_mb[0] / (2 + first / block)  # stage 0: 2 layers + the embedding's modelled share
    head = per_mb[1] - 2 * layer
    want = _best(layer, layer * first / block, max(0.0, head))

    calibrated = _cfg(data, tmp_path, stage_layers="auto", stage_calibration=str(measured_run))
    validate(calibrated, 2)
    got = run_world(_train, 2, args=(calibrated, str(tmp_path / "calibrated")), timeout_s=300)
    assert got == [want, want]


def test_command_line_and_resume(data, tmp_path, monkeypatch):
    """``--parallel.stage_calibration`` sets the field and is validated like the TOML (a bad directory
    named); a resume under another calibration run is refused, naming the field."""
    cfg = _cfg(data, tmp_path, stage_layers="auto")
    _write_run(tmp_path / "run", cfg, [0.02, 0.05])
    path = write_config(tmp_path / "cli.toml", data, steps=3, every=0)
    got = load_config(str(path), [("parallel.stage_calibration", str(tmp_path / "run"))])
    assert got.parallel.stage_calibration == str(tmp_path / "run")
    assert load_config(str(path), [("parallel.stage_calibration", "none")]).parallel.stage_calibration is None
    # a relative directory is made absolute (from the working directory), so a run calibrated from this
    # one later finds the same directory through the saved config.json wherever it starts
    with monkeypatch.context() as m:
        m.chdir(tmp_path)
        rel = load_config(str(path), [("parallel.stage_calibration", "run")]).parallel.stage_calibration
    assert rel == str((tmp_path / "run").resolve())
    bad = load_config(
        str(path), [("parallel.stage_layers", "auto"), ("parallel.stage_calibration", str(tmp_path / "x"))]
    )
    with pytest.raises(ConfigError, match=r"parallel.stage_calibration: .*x: no readable run config"):
        validate(bad, 2)
    moved = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, stage_calibration="other"))
    assert [d.split(":")[0] for d in resume_differences(cfg, moved)] == ["parallel.stage_calibration"]
