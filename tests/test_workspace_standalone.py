"""Each package stands alone: its wheel builds and imports in a fresh venv with only its declared deps.

Slow: builds four wheels and makes five virtual environments (uv's cache makes the installs quick).
The fresh environments use the interpreter running this test (no Python download) and the workspace
lock's versions as constraints: a constraint pins a version without adding a package, so each package
still gets only what it declares, and nothing newer than the lock is downloaded.

The fifth environment holds omni-pipeline (with omni-parallel and omni-data, which it requires) on the
oldest torch the packages declare, ``torch>=2.9``: torch ``TORCH_FLOOR`` instead of the lock's, and no
matplotlib (an extra). There it runs its README example and torch's private pipelining cross-check.
PyPI's x86_64 torch 2.9.1 is a CUDA build: measured on the 2-core dev machine, about 4.1 GB of
downloads (torch 858 MiB plus the nvidia-*-cu12 wheels, ~43 s at ~100 MB/s) the first time, 6.5 GB in
uv's cache after; with that cache warm the install takes about 1 s (hard links).
"""

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package dir -> (import name, workspace wheels it needs besides its own)
PACKAGES = {
    "omni-parallel": ("omni_parallel", []),
    "omni-ckpt": ("omni_ckpt", []),
    "omni-data": ("omni_data", ["omni-parallel"]),
    "omni-pipeline": ("omni_pipeline", ["omni-parallel", "omni-data"]),
}
# the oldest torch release line the packages declare (torch>=2.9), at its last patch release
TORCH_FLOOR = "2.9.1"
# pinned by the lock for the lock's torch; dropped from the constraints of the TORCH_FLOOR venv
TORCH_STACK = re.compile(r"^(torch|triton|nvidia-[\w.-]+|cuda-[\w.-]+)==")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not on PATH; install it with `pip install uv`")
    out = tmp_path_factory.mktemp("wheels")
    for name in PACKAGES:
        subprocess.run(
            [uv, "build", "--wheel", "--out-dir", str(out), str(ROOT / "packages" / name)],
            check=True,
            capture_output=True,
            timeout=300,
        )
    subprocess.run(
        [
            uv,
            "export",
            "--frozen",
            "--no-hashes",
            "--no-emit-workspace",
            "--all-packages",
            "--all-groups",
            "--format",
            "requirements-txt",
            "-q",
            "-o",
            str(out / "constraints.txt"),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return uv, out


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_wheel_installs_and_imports_alone(name, wheels, tmp_path):
    uv, out = wheels
    module, needs = PACKAGES[name]
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    files = [str(next(out.glob(f"{n.replace('-', '_')}-*.whl"))) for n in [name, *needs]]
    r = subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(py), "-c", str(out / "constraints.txt"), *files],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [
            str(py),
            "-c",
            f"import {module}, importlib.metadata as m; print({module}.__version__, m.version('{name}'))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    want = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]["version"]
    assert r.stdout.split() == [want, want]  # the package's own version, as its pyproject says
    # nothing from the rest of the workspace came along
    others = (
        {"omni_parallel", "omni_pipeline", "omni_data", "omni_ckpt", "omni_train"}
        - {module}
        - {n.replace("-", "_") for n in needs}
    )
    r = subprocess.run(
        [
            str(py),
            "-c",
            "import importlib.util, sys; "
            f"print([m for m in {sorted(others)!r} if importlib.util.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout.strip() == "[]", r.stdout


# Run by the TORCH_FLOOR venv's python after the README example: what the test checks, as one JSON line.
FLOOR_CHECKS = """
import importlib.util, json, torch
from omni_pipeline import Action, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, plot_timeline

checked = []
for s in (Schedule1F1B(4, 8), ScheduleGPipe(2, 3), ScheduleInterleaved1F1B(2, 4, 2)):
    s.validate(torch_check=True)  # ImportError if torch's private checkers are missing here
    comms = s.with_comms()
    round_trip = all(Action.from_torch(a.to_torch()) == a for acts in comms.values() for a in acts)
    checked.append([repr(s), sum(map(len, comms.values())), round_trip])
try:
    plot_timeline({}, "timeline.png")
    plot_error = None
except ImportError as exc:
    plot_error = str(exc)
print(json.dumps({"torch": torch.__version__, "checked": checked, "plot_error": plot_error,
                  "matplotlib": importlib.util.find_spec("matplotlib") is not None}))
"""


def _readme_example() -> str:
    readme = (ROOT / "packages" / "omni-pipeline" / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", readme, re.S).group(1)


def test_pipeline_runs_its_readme_example_on_the_oldest_declared_torch(wheels, tmp_path):
    uv, out = wheels
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(
        "".join(
            line
            for line in (out / "constraints.txt").read_text().splitlines(keepends=True)
            if not TORCH_STACK.match(line)
        )
    )
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    needs = PACKAGES["omni-pipeline"][1]
    files = [str(next(out.glob(f"{n.replace('-', '_')}-*.whl"))) for n in ["omni-pipeline", *needs]]
    r = subprocess.run(
        [
            uv,
            "pip",
            "install",
            "-q",
            "--python",
            str(py),
            "-c",
            str(constraints),
            *files,
            f"torch=={TORCH_FLOOR}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    example = _readme_example()
    r = subprocess.run(
        [str(py), "-c", example + FLOOR_CHECKS],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    *printed, facts = r.stdout.splitlines()
    facts = json.loads(facts)
    assert facts["torch"].split("+")[0] == TORCH_FLOOR
    # the README example prints the same lines on TORCH_FLOOR as in this (the lock's torch) process
    expected = io.StringIO()
    with contextlib.redirect_stdout(expected):
        exec(compile(example, "README.md example", "exec"), {})
    assert printed == expected.getvalue().splitlines()
    assert [c[0] for c in facts["checked"]] == [
        "Schedule1F1B(num_ranks=4, num_microbatches=8, virtual=1)",
        "ScheduleGPipe(num_ranks=2, num_microbatches=3, virtual=1)",
        "ScheduleInterleaved1F1B(num_ranks=2, num_microbatches=4, virtual=2)",
    ]
    # compute plus one SEND and one RECV per stage boundary crossing, each way, per microbatch
    assert [c[1:] for c in facts["checked"]] == [
        [2 * 4 * 8 + 4 * 3 * 8, True],
        [2 * 2 * 3 + 4 * 1 * 3, True],
        [2 * 4 * 4 + 4 * 3 * 4, True],
    ]
    assert facts["matplotlib"] is False  # an extra: not installed by the plain package
    assert "omni-pipeline[plot]" in facts["plot_error"]
