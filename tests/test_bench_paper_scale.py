"""``benchmarks/paper_scale.py``'s command line: ``--show`` prints the tables of results already written
without computing or writing anything; bad paths and files that are not its results are one-line errors
(exit 2) naming the file, ``--json``'s target checked before minutes of simulation."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "paper_scale.json"
sys.path.insert(0, str(ROOT / "benchmarks"))

import paper_scale  # noqa: E402


@pytest.fixture
def no_simulation(monkeypatch):
    """Any simulation or tuning paper_scale starts fails the test at once (what may run is reading)."""

    def refuse(*args, **kw):
        raise AssertionError("paper_scale simulated")

    for name in ("predict_step", "tune", "price_group", "rank_memory"):
        monkeypatch.setattr(paper_scale, name, refuse)


def test_show_prints_the_committed_tables_and_writes_nothing(no_simulation, capsys):
    before = RESULTS.read_bytes()
    paper_scale.main(["--show"])
    out = capsys.readouterr().out
    res = json.loads(before)
    # the rows of the committed file, as the table prints them (Figure 13 at 512 GPUs, 9:1, planned)
    planned = res["fig13_throughput"]["512"]["9:1"]["planned"]
    assert "Figure 13, 512 GPUs: tokens/s (M)" in out
    assert f"   planned {planned['tokens_per_s'] / 1e6:6.2f} [{planned['bound']:.2f}]" in out
    assert f"one 512-GPU planned config {res['timing']['one_512_gpu_planned_config_s']:.2f} s" in out
    assert RESULTS.read_bytes() == before


def test_show_of_another_file_prints_its_tables(no_simulation, tmp_path, capsys):
    res = json.loads(RESULTS.read_text())
    res["fig18_tuning"]["tuned_over_hand"] = 9.875  # a value no committed result holds
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    paper_scale.main(["--show", str(path)])
    assert "x9.875" in capsys.readouterr().out


def _error(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        paper_scale.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage:") and len(err) == 2, err
    return err[-1]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--show", "{tmp}/missing.json"], "--show: {tmp}/missing.json: No such file or directory"),
        (["--show", "{tmp}/not.json"], "--show: {tmp}/not.json: not JSON (Expecting value"),
        (["--show", "{tmp}/list.json"], "list.json: not paper_scale results (a JSON list, not an object)"),
        (["--show", "{tmp}/other.json"], "other.json: not paper_scale results (none of its keys"),
        (["--show", "{tmp}/older.json"], "older.json: written by an older paper_scale.py, no fig17_tuned"),
        (["--show", "{tmp}/shape.json"], "shape.json: malformed results (AttributeError"),
        (["--show", "{tmp}/x.json", "--json", "{tmp}/y.json"], "--json: not allowed with argument --show"),
        (["--json", "{tmp}/no/such/folder/out.json"], "--json: {tmp}/no/such/folder is not a directory"),
        (["--json", "{tmp}"], "--json: {tmp} is a directory, not a file"),
    ],
)
def test_bad_paths_and_files_are_one_line_errors(args, words, no_simulation, tmp_path, capsys):
    committed = json.loads(RESULTS.read_text())
    (tmp_path / "not.json").write_text("figure 13")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "other.json").write_text(json.dumps({"summary": []}))
    (tmp_path / "older.json").write_text(
        json.dumps({k: v for k, v in committed.items() if k != "fig17_tuned"})
    )
    (tmp_path / "shape.json").write_text(json.dumps({**committed, "fig13_throughput": [1]}))
    err = _error([a.format(tmp=tmp_path) for a in args], capsys)
    assert words.format(tmp=tmp_path) in err, err


def test_a_results_file_over_the_size_bound_is_refused_unread(monkeypatch, capsys):
    monkeypatch.setattr(paper_scale, "MAX_RESULTS_BYTES", 1000)

    def unread(self, *args, **kw):
        raise AssertionError(f"{self} was read")

    monkeypatch.setattr(Path, "read_text", unread)
    err = _error(["--show", str(RESULTS)], capsys)
    assert f"{RESULTS}: {RESULTS.stat().st_size} bytes, more than the 1000" in err, err
