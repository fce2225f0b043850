"""The README's example runs as written; ``omni-train simulate`` writes its table and timelines."""

import json
import re
from pathlib import Path

from tokenizers import Tokenizer
from train_fixtures import make_dataset, write_config

from omni_train.binder import load_config
from omni_train.cli import main
from omni_train.data_files import bundled_data_dir

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, str(README), "exec"), {})
    out = capsys.readouterr().out
    for policy in ("prepend_first_stage", "isolated", "uniform_on_demand", "planned"):
        assert policy in out
        assert (tmp_path / "runs/example-sim" / f"timeline-{policy}.png").stat().st_size > 0


def test_readme_quickstart_is_the_default_command():
    text = README.read_text()
    assert "uv run omni-train run " in text
    # the stated vocabulary is the bundled tokenizer's, and the default model is built over it
    assert "vocabulary size 4096" in text
    cfg = load_config("omni-tiny")
    tok = Tokenizer.from_file(str(bundled_data_dir() / cfg.data.tokenizer))
    assert tok.get_vocab_size() == 4096 == cfg.model.llm_config(tok.get_vocab_size()).vocab_size
    for special in ("<|pad|>", "<|bos|>", "<|eos|>", "<|image|>", "<|audio|>"):
        assert tok.token_to_id(special) is not None and special in text


def test_cli_simulate(tmp_path, capsys):
    data = make_dataset(tmp_path / "data", n_image=6, n_audio=4, n_text=6)
    cfg = write_config(tmp_path / "c.toml", data)
    out = tmp_path / "sim"
    rc = main(
        [
            "simulate",
            "--config",
            str(cfg),
            "--gpus",
            "16",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads((out / "simulate.json").read_text())
    assert set(res["results"]) == {"prepend_first_stage", "isolated", "uniform_on_demand", "planned"}
    for r in res["results"].values():
        assert r["makespan_s"] > 0 and 0 <= r["mean_bubble_fraction"] < 1
    assert "uniform_on_demand" in capsys.readouterr().out
    assert main(["simulate", "--config", str(cfg), "--gpus", "15", "--pp", "2", "--out", str(out)]) == 2
