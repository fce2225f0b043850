"""``benchmarks/paper_scale.py``'s command line: ``--show`` prints the tables of results already written
without computing or writing anything; bad paths and files that are not its results are one-line errors
(exit 2) naming the file, ``--json``'s folder checked before minutes of simulation."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "paper_scale.json"
sys.path.insert(0, str(ROOT / "benchmarks"))

import paper_scale  # noqa: E402


def test_show_prints_the_committed_tables_and_writes_nothing(capsys):
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


def test_show_of_another_file_prints_its_tables(tmp_path, capsys):
    res = json.loads(RESULTS.read_text())
    res["fig18_tuning"]["tuned_over_hand"] = 9.875  # a value no committed result holds
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    paper_scale.main(["--show", str(path)])
    assert "x9.875" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--show", "{tmp}/missing.json"], "missing.json: [Errno 2]"),
        (["--show", "{tmp}/not.json"], "not.json: Expecting value"),
        (["--show", "{tmp}/other.json"], "other.json: not paper_scale results, no fig13_throughput"),
        (["--json", "{tmp}/no/such/folder/out.json"], "--json: {tmp}/no/such/folder is not a directory"),
    ],
)
def test_bad_paths_and_files_are_one_line_errors(args, words, tmp_path, capsys):
    (tmp_path / "not.json").write_text("figure 13")
    (tmp_path / "other.json").write_text(json.dumps({"summary": []}))
    with pytest.raises(SystemExit) as exc:
        paper_scale.main([a.format(tmp=tmp_path) for a in args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert words.format(tmp=tmp_path) in err, err


def test_a_results_file_over_the_size_bound_is_refused_unread(monkeypatch, capsys):
    monkeypatch.setattr(paper_scale, "MAX_RESULTS_BYTES", 1000)
    with pytest.raises(SystemExit) as exc:
        paper_scale.main(["--show", str(RESULTS)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{RESULTS}: {RESULTS.stat().st_size} bytes, more than the 1000" in err, err
