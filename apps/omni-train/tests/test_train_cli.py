"""``omni-train run`` from the command line, before any worker starts: every config field overridable
(typed and validated as the TOML is: the oracle is the same value written into the TOML), the short flags
as aliases, ``--print-config``, and the run-experience checks (``--out`` naming a file, ``--resume`` with
an incompatible config or of a finished run), each a clear message and exit status 2, or the documented
behaviour. The plot of ``loss.png`` (smoothed, total on top, phase changes marked)."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config

from omni_train.binder import RESUME_MAY_CHANGE, load_config, resume_differences
from omni_train.cli import main, parse_args, resolve_run
from omni_train.data_files import bundled_data_dir
from omni_train.metrics import ema, loss_figure


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), n_image=4, n_audio=2, n_text=4)


def _resolve(*argv: str):
    return resolve_run(parse_args(["run", *argv]))


def _edited(path: Path, tmp: Path, old: str, new: str) -> Path:
    text = path.read_text()
    assert old in text, old
    out = tmp / f"edited-{len(list(tmp.glob('edited-*')))}.toml"
    out.write_text(text.replace(old, new, 1))
    return out


def test_every_field_is_overridable_and_equals_the_same_value_in_the_toml(tmp_path, data):
    p = write_config(tmp_path / "c.toml", data)
    cfg, nproc, _ = _resolve(
        "--config", str(p), "--out", str(tmp_path / "r"),
        "--parallel.pp", "1", "--parallel.dp=2", "--optim.lr", "1e-3", "--placement", "prepend_first_stage",
        "--parallel.placement", "isolated",  # a dotted override comes after the alias it overrides
        "--train.recompute", "llm,image", "--train.compile", "--reorder", "off",
        "--data.sources[2].urls", data["text"].replace("text-*", "text-000"),
        "--data.mixture[1].weights.text", "0.5", "--model.llm.vocab_size", "none",
        "--max-steps", "5", "--profile", "2",
    )  # fmt: skip
    oracle = p
    for old, new in [
        ("pp = 2", 'pp = 1\ndp = 2\nplacement = "isolated"\nreorder = false'),
        ("lr = 3e-3", "lr = 1e-3"),
        ("steps = 6", 'steps = 5\nrecompute = ["llm", "image"]\ncompile = true\nprofile_steps = 2'),
        ("text-*.tar", "text-000.tar"),
        ("image = 0.3, audio = 0.4, text = 0.3", "image = 0.3, audio = 0.4, text = 0.5"),
    ]:
        oracle = _edited(oracle, tmp_path, old, new)
    want = load_config(str(oracle))
    cfg.source = want.source = ""
    assert (cfg.name, nproc) == ("c", 2)
    assert cfg.to_dict() == {**want.to_dict(), "name": "c"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parallel.placement", "everywhere"],
         "parallel.placement: 'everywhere' is not one of ['prepend_first_stage', 'isolated', 'uniform_on_demand', 'planned']"),
        (["--parallel.ppp", "2"], "parallel.ppp: unknown field (allowed: ['async_tp', 'cp', 'cp_attention', 'dp', 'encoder_forward_share'"),
        (["--optim.lr", "fast"], "optim.lr: expected a number, got 'fast'"),
        (["--parallel.pp", "two"], "parallel.pp: expected an integer, got 'two'"),
        (["--train.compile", "maybe"], "train.compile: expected a bool (true/false, on/off), got 'maybe'"),
        (["--data.sources[7].urls", "x"], "data.sources[7]: index out of range (the config has 3 items)"),
        (["--train.dtype", "float16"], "train.dtype: 'float16' is not one of ['float32', 'float64', 'bfloat16']"),
        (["--parallel.pp", "3", "--nproc", "2"], "parallel: pp*dp*tp*cp*ulysses = 3*1*1*1*1 = 3 does not match the process count 2"),
        (["--parallel.pp", "0"], "parallel.pp: must be >= 1, got 0"),  # not '--nproc: ... got 0'
        (["--nproc", "0"], "--nproc: must be >= 1, got 0"),
        (["--optim.lr.warm", "1"], "optim.lr: is a value, it has no field 'warm'"),
        (["--data.mixture[0].weights", "{ image = 1"], "data.mixture[0].weights: expected a table as a TOML value"),
    ],
)  # fmt: skip
def test_a_bad_override_names_the_field_and_the_allowed_values(tmp_path, data, capsys, args, message):
    p = write_config(tmp_path / "c.toml", data)
    assert main(["run", "--config", str(p), "--out", str(tmp_path / "r"), *args]) == 2
    err = capsys.readouterr().err
    assert f"omni-train: configuration error: {message}" in err, err
    assert not (tmp_path / "r").exists()


def test_an_argument_that_is_no_flag_or_field_exits_2(tmp_path, data, capsys):
    p = write_config(tmp_path / "c.toml", data)
    with pytest.raises(SystemExit) as exc:
        main(["run", "--config", str(p), "stray"])
    assert exc.value.code == 2 and "unexpected argument 'stray'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--optim.lr", "1"])
    assert exc.value.code == 2 and "unrecognized arguments: --optim.lr 1" in capsys.readouterr().err


def test_print_config_shows_the_resolved_config_as_toml_that_reads_back_equal(tmp_path, data, capsys):
    p = write_config(tmp_path / "c.toml", data)
    argv = [
        "--config",
        str(p),
        "--out",
        str(tmp_path / "r"),
        "--optim.lr",
        "1e-3",
        "--model.vit.act",
        "quick_gelu",
    ]
    assert main(["run", *argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# omni-train run --print-config: ") and "lr = 0.001" in printed
    # a bundled config's relative urls resolve against the bundled data, not where the copy is saved
    assert f"# relative data.sources urls resolve against {tmp_path} (make them absolute" in printed
    capsys.readouterr()
    assert main(["run", "--out", str(tmp_path / "r"), "--print-config"]) == 0
    assert f"resolve against {bundled_data_dir()} (make them absolute" in capsys.readouterr().out
    (tmp_path / "printed.toml").write_text(printed)
    again, resolved = load_config(str(tmp_path / "printed.toml")), _resolve(*argv)[0]
    again.source = resolved.source = ""
    assert again == resolved
    assert not (tmp_path / "r").exists()


def test_out_naming_a_file_is_refused(tmp_path, data, capsys):
    p = write_config(tmp_path / "c.toml", data)
    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "f", tmp_path / "f" / "run"):
        assert main(["run", "--config", str(p), "--out", str(out)]) == 2
        assert f"--out: {tmp_path / 'f'} is a file, not a directory" in capsys.readouterr().err


def _fake_run(run: Path, cfg, steps: list[int]) -> None:
    """A run directory as the trainer leaves it: config.json and committed steps (a manifest each)."""
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    for s in steps:
        (run / "checkpoints" / f"step-{s:08d}").mkdir()
        (run / "checkpoints" / f"step-{s:08d}" / "manifest.msgpack").write_bytes(b"")


def test_resume_checks_the_runs_config_before_any_worker_starts(tmp_path, data, capsys):
    p = write_config(tmp_path / "c.toml", data)
    run = tmp_path / "run"
    _fake_run(run, load_config(str(p)), [2, 4])
    base = ["run", "--config", str(p), "--out", str(run), "--resume"]
    assert main([*base, "--model.llm.dim", "64", "--parallel.placement", "isolated"]) == 2
    err = capsys.readouterr().err
    assert "--resume: the config differs from the run's" in err
    assert "model.llm.dim: 32 -> 64" in err and "parallel.placement: 'uniform_on_demand' -> 'isolated'" in err
    # the message lists what a resume may change: RESUME_MAY_CHANGE, not a copy of it
    assert "parallel.llm_zero, parallel.encoder_zero, checkpoint.*, optim.*)" in err, err
    # what a resume may change: the length, the checkpoint cadence, the optimizer and its schedule
    cfg, _, _ = _resolve(*base[1:], "--max-steps", "9", "--checkpoint.every", "3", "--optim.lr", "1e-4")
    assert (cfg.train.steps, cfg.checkpoint.every, cfg.optim.lr) == (9, 3, 1e-4)
    # from a step-0 checkpoint (import-hf: weights only) only the model must match
    shutil.rmtree(run)
    _fake_run(run, load_config(str(p)), [0])
    _resolve(*base[1:], "--parallel.pp", "1", "--parallel.dp", "2", "--data.max_seq_len", "64")
    assert main([*base, "--model.llm.n_layers", "3"]) == 2
    err = capsys.readouterr().err
    assert (
        "model.llm.n_layers: 2 -> 3" in err and "may change anything but model.* from a weights-only" in err
    )


def test_resume_step_needs_resume_and_a_committed_step(tmp_path, data, capsys):
    p = write_config(tmp_path / "c.toml", data, steps=8)
    run = tmp_path / "run"
    _fake_run(run, load_config(str(p)), [2, 4, 6])
    base = ["run", "--config", str(p), "--out", str(run)]
    assert main([*base, "--resume-step", "4"]) == 2
    assert "--resume-step: needs --resume" in capsys.readouterr().err
    assert main([*base, "--resume", "--resume-step", "5"]) == 2
    err = capsys.readouterr().err
    assert f"--resume-step: 5 is not a committed step of {run / 'checkpoints'} (committed: 2, 4, 6)" in err
    args = parse_args(["run", *base[1:], "--resume", "--resume-step", "4"])
    assert resolve_run(args)[2] == run and args.resume_step == 4
    # the checks only read: nothing was renamed
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{s:08d}" for s in (2, 4, 6)]


def test_resume_step_is_not_checked_again_by_a_worker_that_torchrun_restarted(
    tmp_path, data, capsys, monkeypatch
):
    # torchrun restarts a worker with its command line, --resume-step N included; the restart resumes
    # from the newest step (worker.worker_main), and by then N may have been pruned (keep_last)
    p = write_config(tmp_path / "c.toml", data, steps=8)
    run = tmp_path / "run"
    _fake_run(run, load_config(str(p)), [6, 8])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    base = ["run", "--config", str(p), "--out", str(run), "--resume", "--resume-step", "4"]
    assert resolve_run(parse_args(base))[2] == run
    # ... and a run that was finished by then is finished (not "resumed from step 4")
    monkeypatch.setattr("omni_train.launch.launch", lambda *a, **k: pytest.fail("workers launched"))
    assert main(base) == 0
    assert "already finished: step 8 of train.steps = 8" in capsys.readouterr().err


def test_resume_differences_compare_every_field_outside_the_allowed_set(data, tmp_path):
    cfg = load_config(str(write_config(tmp_path / "c.toml", data)))
    assert resume_differences(cfg, cfg) == []
    assert set(RESUME_MAY_CHANGE) >= {"train.steps", "checkpoint", "optim"}
    other = load_config(str(write_config(tmp_path / "d.toml", data, extra='seed = 7\ndtype = "float64"')))
    assert resume_differences(cfg, other) == ["train.dtype: 'float32' -> 'float64'", "train.seed: 1234 -> 7"]
    assert resume_differences(cfg, other, weights_only=True) == []
    # the sizes and sharding stages a checkpoint loads across may change; the rest of the layout may not
    par = cfg.parallel
    moved = dataclasses.replace(
        par, pp=1, dp=2, tp=2, sequence_parallel=True, llm_zero=1, encoder_zero=3, cp_attention="ring"
    )
    assert resume_differences(cfg, dataclasses.replace(cfg, parallel=moved)) == []
    placed = dataclasses.replace(cfg, parallel=dataclasses.replace(par, reorder=not par.reorder))
    assert [d.split(":")[0] for d in resume_differences(cfg, placed)] == ["parallel.reorder"]


def test_resume_of_a_finished_run_says_so_and_changes_nothing(tmp_path, data, capsys):
    p = write_config(tmp_path / "c.toml", data, steps=6)
    run = tmp_path / "run"
    _fake_run(run, load_config(str(p)), [4, 6])
    (run / "summary.json").write_text('{"wall_s_this_process": 12.5}')
    before = sorted(f.name for f in run.rglob("*"))
    assert main(["run", "--config", str(p), "--out", str(run), "--resume"]) == 0
    assert "already finished: step 6 of train.steps = 6; nothing to train" in capsys.readouterr().err
    assert (run / "summary.json").read_text() == '{"wall_s_this_process": 12.5}'
    assert sorted(f.name for f in run.rglob("*")) == before


def test_loss_plot_is_smoothed_total_on_top_and_phase_changes_marked():
    rows = [
        {"step": s, "loss": 5.0 - 0.1 * s + (0.3 if s % 2 else -0.3),
         "loss_per_modality": {"text": 4.0 - 0.05 * s, **({"image": 6.0} if s % 3 == 0 else {})}}
        for s in range(12)
    ]  # fmt: skip
    fig = loss_figure(rows, phase_steps=[4, 30], smoothing=0.8)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    total = lines["loss (all)"]
    # EMA with bias correction, written out: m_t = 0.8 m_{t-1} + 0.2 x_t, shown as m_t / (1 - 0.8^(t+1))
    m, want = 0.0, []
    for t, r in enumerate(rows):
        m = 0.8 * m + 0.2 * r["loss"]
        want.append(m / (1 - 0.8 ** (t + 1)))
    assert list(total.get_ydata()) == pytest.approx(want)
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # no pull towards 0
    assert list(lines["loss (image)"].get_xdata()) == [0, 3, 6, 9]
    assert total.get_zorder() > max(line.get_zorder() for line in ax.get_lines() if line is not total)
    assert total.get_linewidth() > max(line.get_linewidth() for line in ax.get_lines() if line is not total)
    raw = [line for line in ax.get_lines() if list(line.get_ydata()) == [r["loss"] for r in rows]]
    assert len(raw) == 1 and raw[0].get_alpha() < 0.5  # the raw total, faint, under its average
    phases = [line for line in ax.get_lines() if line.get_label() == "mixture phase change"]
    assert len(phases) == 1 and list(phases[0].get_xdata()) == [4, 4]  # step 30 is past the run's end
