"""A crafted checkpoint in a run directory: ``omni-train export-hf`` and ``omni-train run --resume`` refuse it
with one line, ``omni-train: error: ...``, exit status 2, before allocating anything from its manifest and
(for ``--resume``) before any worker starts; their peak RSS stays at the interpreter's baseline plus the
checkpoint's file bytes.

The crafted manifest is the attack of issue 29: a tensor 256 times the size of the checkpoint's data, its
256 boxes all pointing at the same bytes, re-encoded with omni-ckpt's own ``encode_manifest`` so its
checksum holds. Before the fix ``export-hf`` allocated the whole claimed tensor, read the same bytes into
it 256 times and died with a traceback; ``--resume`` started the workers, which failed with tracebacks.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_ckpt import save_ranks
from omni_ckpt.layout import MANIFEST, decode_manifest, encode_manifest
from omni_train.binder import load_config
from omni_train.cli import main

N = 1 << 18  # float32 elements actually stored: 1 MiB
ALIASES = 256  # boxes claimed on them: a 256 MiB tensor
FAULT = (
    r"tensor 'model\.llm\.tok_embeddings\.weight' box offsets=\(4096, 0\) sizes=\(4096, 64\).*claimed twice"
)


def _crafted_run(root: Path) -> Path:
    """A run directory of the default config whose only checkpoint (step 2) carries the aliased boxes."""
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(load_config("omni-tiny").to_dict(), indent=2))
    url = str(run / "checkpoints" / "step-00000002")
    weight = torch.arange(N, dtype=torch.float32).reshape(N // 64, 64)
    save_ranks([{"model": {"llm.tok_embeddings.weight": weight}, "step": 2}], url)
    path = Path(url) / MANIFEST
    manifest = decode_manifest(path.read_bytes(), str(path))
    entry = manifest["tensors"]["model.llm.tok_embeddings.weight"]
    (b,) = entry[2]
    entry[1] = [ALIASES * (N // 64), 64]
    entry[2] = [[[i * (N // 64), 0], b[1], *b[2:]] for i in range(ALIASES)]
    path.write_bytes(encode_manifest(manifest))
    return run


def _one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_export_hf_and_resume_refuse_a_crafted_checkpoint_in_one_line(tmp_path, capsys, monkeypatch):
    run = _crafted_run(tmp_path)
    assert main(["export-hf", str(run), str(tmp_path / "hf")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"omni-train: error: {run / 'checkpoints' / 'step-00000002'}: "), line
    assert re.search(FAULT, line), line
    assert not (tmp_path / "hf").exists()

    import omni_train.launch

    def no_workers(*args, **kwargs):
        raise AssertionError("workers were started on a checkpoint that fails its checks")

    monkeypatch.setattr(omni_train.launch, "launch", no_workers)
    assert main(["run", "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    refusal = [x for x in err.splitlines() if "error" in x or "Traceback" in x]
    assert len(refusal) == 1 and refusal[0].startswith("omni-train: error: ") and re.search(FAULT, err), err


def test_resume_refusing_the_newest_step_names_the_older_ones(tmp_path, capsys, monkeypatch):
    """The check before any worker starts offers the way out the workers' own restore offers: a good
    step 1 under the crafted step 2 is named with ``--resume-step``."""
    run = _crafted_run(tmp_path)
    weight = torch.arange(N, dtype=torch.float32).reshape(N // 64, 64)
    save_ranks(
        [{"model": {"llm.tok_embeddings.weight": weight}, "step": 1}],
        str(run / "checkpoints" / "step-00000001"),
    )
    import omni_train.launch

    def no_workers(*args, **kwargs):
        raise AssertionError("workers were started on a checkpoint that fails its checks")

    monkeypatch.setattr(omni_train.launch, "launch", no_workers)
    assert main(["run", "--out", str(run), "--resume"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert re.search(FAULT, line), line
    assert line.endswith(
        "; to resume from an older committed step (1): omni-train run --resume --resume-step N"
    ), line


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b'{"model": {}}'])
def test_export_hf_of_a_run_with_a_damaged_config_json_is_one_line(tmp_path, capsys, raw):
    """(Was a JSONDecodeError traceback, exit 1.)"""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_bytes(raw)
    assert main(["export-hf", str(run), str(tmp_path / "hf")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(
        f"omni-train: configuration error: export-hf: {run / 'config.json'} is not a run config ("
    ), line
    assert not (tmp_path / "hf").exists()


_PEAKS = """
import resource, sys
from omni_train.cli import main
for argv in (sys.argv[1:4], sys.argv[4:7], sys.argv[7:]):
    rc = main(argv)
    print("PEAK", rc, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
"""


def test_peak_rss_of_export_hf_and_resume_on_the_crafted_checkpoint_stays_at_the_baseline(tmp_path):
    run = _crafted_run(tmp_path)
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "config.json").write_text((run / "config.json").read_text())
    # 1) export-hf of a run with no committed step (refused, exit 2): the interpreter's baseline with
    #    everything export-hf imports; 2) export-hf of the crafted run; 3) run --resume into it
    argv = ["export-hf", str(empty), str(tmp_path / "hf0"), "export-hf", str(run), str(tmp_path / "hf")]
    argv += ["run", "--out", str(run), "--resume"]
    proc = subprocess.run(
        [sys.executable, "-c", _PEAKS, *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    peaks = [x.split() for x in proc.stdout.splitlines() if x.startswith("PEAK")]
    assert len(peaks) == 3, proc.stderr[-3000:]
    (_, rc0, base), (_, rc1, export_peak), (_, rc2, resume_peak) = peaks
    assert (rc0, rc1, rc2) == ("2", "2", "2"), proc.stderr[-3000:]
    files = sum(p.stat().st_size for p in (run / "checkpoints").rglob("*") if p.is_file())
    bound = int(base) * 1024 + files + (16 << 20)
    claimed = ALIASES * N * 4
    # before the fix: export-hf allocated and filled the claimed 256 MiB tensor (peak >= base + 256 MiB)
    assert int(export_peak) * 1024 < bound < int(base) * 1024 + claimed, (base, export_peak, files)
    assert int(resume_peak) * 1024 < bound, (base, resume_peak, files)
    assert proc.stderr.count("omni-train: error: ") == 2 and "Traceback" not in proc.stderr, proc.stderr
