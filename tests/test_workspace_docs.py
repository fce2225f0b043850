"""Documents and versions stay true: every file ARCHITECTURE.md names exists; each package's and the app's
``__version__`` equals its pyproject version, the installed (editable) distribution and the lock file's
local member, and its CHANGELOG.md has an entry for that version."""

import importlib
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MEMBERS = {
    "omni_parallel": "packages/omni-parallel",
    "omni_pipeline": "packages/omni-pipeline",
    "omni_data": "packages/omni-data",
    "omni_ckpt": "packages/omni-ckpt",
    "omni_train": "apps/omni-train",
}


def test_every_path_architecture_md_names_exists():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    paths = sorted(set(re.findall(r"\b(?:packages|apps|tests|benchmarks)/[\w./-]*[\w/]", text)))
    assert len(paths) >= 15, paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"ARCHITECTURE.md names files that do not exist: {missing}"


@pytest.mark.parametrize("module", sorted(MEMBERS))
def test_version_matches_pyproject_lock_and_changelog(module):
    member = ROOT / MEMBERS[module]
    project = tomllib.loads((member / "pyproject.toml").read_text())["project"]
    want = project["version"]
    assert importlib.import_module(module).__version__ == want
    assert version(project["name"]) == want, "run `uv sync`: the installed member is another version"
    lock = {p["name"]: p for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]}
    assert lock[project["name"]]["version"] == want, "run `uv lock`"
    assert lock[project["name"]]["source"] == {"editable": MEMBERS[module]}
    changelog = (member / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(want)}\]", changelog, re.M), f"{member}/CHANGELOG.md lacks [{want}]"
    assert re.search(r"^## \[Unreleased\]", changelog, re.M)
