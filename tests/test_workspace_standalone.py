"""Each package stands alone: its wheel builds and imports in a fresh venv with only its declared deps.

Slow: builds four wheels and makes four virtual environments (uv's cache makes the installs quick).
The fresh environments use the interpreter running this test (no Python download) and the workspace
lock's versions as constraints: a constraint pins a version without adding a package, so each package
still gets only what it declares, and nothing newer than the lock is downloaded.
"""

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
    "omni-pipeline": ("omni_pipeline", ["omni-parallel"]),
}

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
