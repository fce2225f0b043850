"""Mixture phases counted in tokens (``[[data.mixture]] until_tokens``): the paper's recipe shape, image:text
1:1 for the first N tokens, then image:audio:text 13:74:13, trained by 2 processes; ``metrics.jsonl`` shows
the switch at N tokens within one step, and a run resumed from a step before the switch repeats the
uninterrupted run's metrics exactly (the oracle: the same config trained once without interruption)."""

import dataclasses
import json
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config

from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.config import ConfigError, MixturePhase
from omni_train.data_pipeline import mixture_schedule
from omni_train.preflight import validate

pytestmark = pytest.mark.slow

SWITCH = 700  # tokens: about the fourth step of the tiny config (2 packs of at most 96 tokens a step)

PHASES = f"""[[data.mixture]]
until_tokens = {SWITCH}
weights = {{ image = 1, text = 1 }}

[[data.mixture]]
weights = {{ image = 13, audio = 74, text = 13 }}
"""


def _token_config(path: Path, data: dict, **kw) -> Path:
    write_config(path, data, **kw)
    text = path.read_text()
    start = text.index("[[data.mixture]]")
    end = text.index("[parallel]")
    text = text[:start] + PHASES + "\n" + text[end:]
    path.write_text(text.replace("keep_last = 2", "keep_last = 10"))  # step 2 kept to resume from
    return path


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train(rank, world_size, cfg, runs):
    from omni_train.trainer import Trainer

    for out, resume, step in runs:
        Trainer(cfg, Path(out), resume=resume, resume_step=step).run()


def _switch(rows: list[dict]) -> tuple[int, int, int]:
    """(first step training audio, tokens trained before it, tokens trained through it)."""
    audio = [r["targets_per_modality"].get("audio", 0) > 0 for r in rows]
    first = audio.index(True)
    before = sum(r["tokens"] for r in rows[:first])
    return first, before, before + rows[first]["tokens"]


def test_token_phases_switch_at_n_tokens_also_after_a_resume(tmp_path):
    data = make_dataset(tmp_path / "data")
    cfg = load_config(str(_token_config(tmp_path / "c.toml", data, steps=8, every=2)))
    validate(cfg, 2)
    schedule = mixture_schedule(cfg.data)
    assert (schedule.unit, schedule.positions) == ("token", [0, SWITCH])
    a, b = tmp_path / "a", tmp_path / "b"
    run_world(_train, 2, timeout_s=600, args=(cfg, [(str(a), False, None), (str(b), False, None)]))
    rows = _rows(a)
    assert len(rows) == 8
    first, before, through = _switch(rows)
    # every step before the switch trains image and text only; the switch lies in step `first`
    assert 2 <= first <= 6, first
    assert all(r["targets_per_modality"].get("audio", 0) == 0 for r in rows[:first])
    assert all(r["targets_per_modality"]["image"] > 0 for r in rows[:first])
    assert before < SWITCH + rows[first]["tokens"] and through >= SWITCH, (before, through)
    # after it audio dominates (74% of the draws)
    late = rows[first + 1 :]
    assert all(r["targets_per_modality"]["audio"] > 0 for r in late)

    assert json.loads((a / "summary.json").read_text())["steps"] == 8
    # resume from step 2 (before the switch): the rest of the run, switch included, repeats exactly
    run_world(_train, 2, timeout_s=600, args=(cfg, [(str(b), True, 2)]))
    again = _rows(b)
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]
    assert [(r["tokens"], r["targets_per_modality"]) for r in again] == [
        (r["tokens"], r["targets_per_modality"]) for r in rows
    ]
    assert _switch(again) == (first, before, through)


def test_token_phases_config_errors(tmp_path):
    data = make_dataset(tmp_path / "data", n_image=4, n_audio=2, n_text=4)
    cfg = load_config(str(_token_config(tmp_path / "c.toml", data)))
    mix = cfg.data.mixture

    def bad(phases):
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, mixture=phases))

    mixed = [dataclasses.replace(mix[0]), MixturePhase({"image": 1.0}, until_step=9), mix[1]]
    with pytest.raises(ConfigError, match=r"data.mixture\[1\]: phases end at until_step or at until_tokens"):
        validate(bad(mixed), 2)
    down = [mix[0], MixturePhase({"image": 1.0}, until_tokens=SWITCH), mix[1]]
    with pytest.raises(ConfigError, match=r"data.mixture\[1\].until_tokens: phases need increasing"):
        validate(bad(down), 2)
    last = [mix[0], dataclasses.replace(mix[1], until_tokens=SWITCH * 2)]
    with pytest.raises(ConfigError, match=r"data.mixture\[1\].until_tokens: the last phase runs to the end"):
        validate(bad(last), 2)
    smooth = mixture_schedule(dataclasses.replace(cfg.data, mixture_interpolate=True))
    assert smooth.unit == "token" and smooth.weights(SWITCH // 2)["audio"] == pytest.approx(0.74 / 2)
