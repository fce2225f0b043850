"""The workspace's import rules: packages stay adoptable one at a time.

Allowed (DESIGN.md, layout): omni-parallel -> torch only; omni-ckpt -> torch, numpy, fsspec, msgpack,
safetensors, crc32c_rs; omni-data -> omni-parallel; omni-pipeline -> omni-parallel; apps -> everything.
Checked statically over every import statement of every source file (ast), so a lazy import inside a
function is caught too. Besides the rules, every third-party module a package imports must come from a
distribution its own pyproject.toml declares: a transitive or dev-only dependency would break the package
when it is installed alone.
"""

import ast
import re
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"omni_parallel", "omni_pipeline", "omni_data", "omni_ckpt", "omni_train"}
STDLIB = set(sys.stdlib_module_names)

# package -> (allowed first-party packages, allowed third-party top-level modules or None for "any declared")
# Third-party imports must in every case also be declared (test_package_imports_are_declared).
RULES = {
    "omni_parallel": (set(), {"torch"}),
    "omni_ckpt": (set(), {"torch", "numpy", "fsspec", "msgpack", "safetensors", "crc32c_rs"}),
    "omni_data": ({"omni_parallel"}, None),
    "omni_pipeline": ({"omni_parallel"}, None),
}
PYPROJECT = {
    "omni_parallel": ROOT / "packages/omni-parallel/pyproject.toml",
    "omni_ckpt": ROOT / "packages/omni-ckpt/pyproject.toml",
    "omni_data": ROOT / "packages/omni-data/pyproject.toml",
    "omni_pipeline": ROOT / "packages/omni-pipeline/pyproject.toml",
}
SRC = {
    "omni_parallel": ROOT / "packages/omni-parallel/src/omni_parallel",
    "omni_ckpt": ROOT / "packages/omni-ckpt/src/omni_ckpt",
    "omni_data": ROOT / "packages/omni-data/src/omni_data",
    "omni_pipeline": ROOT / "packages/omni-pipeline/src/omni_pipeline",
    "omni_train": ROOT / "apps/omni-train/src/omni_train",
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    mods: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module.split(".")[0])
    return mods


def _normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


@cache
def declared_modules(pyproject: Path) -> frozenset[str]:
    """Top-level modules provided by the distributions that ``pyproject`` declares (e.g. pillow -> PIL),
    as installed in the environment running the tests."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    names = {_normalize(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in deps}
    return frozenset(
        mod for mod, dists in packages_distributions().items() if names & {_normalize(d) for d in dists}
    )


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_follow_the_rules(package):
    allowed_first, allowed_third = RULES[package]
    bad = []
    for f in sorted(SRC[package].rglob("*.py")):
        for mod in imported_modules(f):
            if mod in STDLIB or mod == package or mod == "__future__":
                continue
            if mod in FIRST_PARTY:
                if mod not in allowed_first:
                    bad.append(f"{f.relative_to(ROOT)} imports {mod}")
            elif allowed_third is not None and mod not in allowed_third:
                bad.append(f"{f.relative_to(ROOT)} imports third-party {mod}")
    assert not bad, "import rule violations:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_are_declared(package):
    declared = declared_modules(PYPROJECT[package])
    bad = [
        f"{f.relative_to(ROOT)} imports {mod}, which {PYPROJECT[package].relative_to(ROOT)} does not declare"
        for f in sorted(SRC[package].rglob("*.py"))
        for mod in sorted(imported_modules(f))
        if mod not in STDLIB | FIRST_PARTY | {"__future__"} and mod not in declared
    ]
    assert not bad, "undeclared dependencies:\n" + "\n".join(bad)


def test_declared_modules_map_distributions_to_modules():
    data = declared_modules(PYPROJECT["omni_data"])
    assert {"PIL", "soundfile", "webdataset", "torch"} <= data  # pillow provides PIL
    assert "tqdm" not in data and "safetensors" not in data  # installed here, not declared by omni-data
    assert declared_modules(PYPROJECT["omni_parallel"]) & {"numpy", "PIL", "fsspec"} == set()


def test_rule_checker_sees_lazy_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    import omni_pipeline.x\n    from omni_data import y\n")
    assert imported_modules(f) == {"omni_pipeline", "omni_data"}


def test_no_package_imports_the_app():
    for package in RULES:
        for f in SRC[package].rglob("*.py"):
            assert "omni_train" not in imported_modules(f), f"{f} imports the app"
