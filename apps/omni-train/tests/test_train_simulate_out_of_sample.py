"""``omni-train simulate --calibration RUN_A --measured RUN_B`` refuses runs a fit cannot carry to, naming
what is wrong (no trainer run: the refusals come before any fit)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from omni_train.binder import load_config
from omni_train.cli import main
from omni_train.config import ConfigError
from omni_train.simulate import simulate_config


def _run_dir(path, cfg, steps=4):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg.to_dict()))
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "step_time_s": 1.0}) + "\n" for s in range(steps))
    )
    return path


def test_out_of_sample_refusals(tmp_path, capsys):
    cfg = load_config("omni-heavy")
    deeper = dataclasses.replace(cfg.model, llm=dataclasses.replace(cfg.model.llm, n_layers=4))
    fit = _run_dir(tmp_path / "fit", dataclasses.replace(cfg, model=deeper))
    cp = _run_dir(tmp_path / "cp", dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=2)))
    run = _run_dir(tmp_path / "run", cfg)
    out = tmp_path / "out"
    with pytest.raises(
        ConfigError, match=r"differ in model\.llm\.n_layers; a fit predicts runs of the same models"
    ):
        simulate_config(cfg, out_dir=out, calibration=fit, measured=run)
    with pytest.raises(ConfigError, match=r"differ in parallel\.cp;"):
        simulate_config(cfg, out_dir=out, calibration=cp, measured=run)
    with pytest.raises(ConfigError, match="--measured: needs --calibration"):
        simulate_config(cfg, out_dir=out, measured=run)
    with pytest.raises(ConfigError, match="is the calibration run itself"):
        simulate_config(cfg, out_dir=out, calibration=run, measured=run)
    with pytest.raises(ConfigError, match="holds no step after the 4 warm-up steps"):
        simulate_config(cfg, out_dir=out, calibration=fit, measured=run, skip_steps=4)
    # the CLI takes the config from the measured run and says what is wrong in one line
    argv = ["simulate", "--calibration", str(fit), "--measured", str(run), "--out", str(out)]
    assert main([*argv, "--pp", "4"]) == 2
    assert "--measured: the measured run gives --pp" in capsys.readouterr().err
    assert main([*argv, "--config", "omni-heavy"]) == 2
    assert "drop --config" in capsys.readouterr().err
    assert main(argv) == 2
    assert "differ in model.llm.n_layers" in capsys.readouterr().err
