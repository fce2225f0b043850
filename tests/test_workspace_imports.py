"""The workspace's import rules: packages stay adoptable one at a time.

Allowed (DESIGN.md §Layout): omni-parallel -> torch only; omni-ckpt -> torch, numpy, fsspec, msgpack,
safetensors, crc32c_rs; omni-data -> omni-parallel; omni-pipeline -> omni-data, omni-parallel (its
step-input bridge reads the loader's packs and payloads); apps -> everything.
Checked statically over every import statement of every source file (ast), so a lazy import inside a
function is caught too. Besides the rules, every third-party module a package imports must come from a
distribution its own pyproject.toml declares: a transitive or dev-only dependency would break the package
when it is installed alone. A distribution of an optional extra (``[project.optional-dependencies]``)
counts as declared only where it is imported inside a function, never at a module's import time: the
package must still import without the extra.
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
    "omni_pipeline": ({"omni_parallel", "omni_data"}, None),
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


def eager_imports(path: Path) -> set[str]:
    """Top-level modules imported when the file itself is imported: every import statement outside a
    function body (module level, ``try`` / ``if`` blocks, class bodies)."""
    mods: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text(), filename=str(path))]
    while todo:
        for node in ast.iter_child_nodes(todo.pop()):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.Import):
                mods.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module.split(".")[0])
            todo.append(node)
    return mods


def _modules_of(requirements) -> frozenset[str]:
    """Top-level modules provided by the distributions named in ``requirements`` (e.g. pillow -> PIL),
    as installed in the environment running the tests."""
    names = {_normalize(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in requirements}
    return frozenset(
        mod for mod, dists in packages_distributions().items() if names & {_normalize(d) for d in dists}
    )


@cache
def declared_modules(pyproject: Path) -> frozenset[str]:
    """Top-level modules provided by the distributions that ``pyproject`` requires (e.g. pillow -> PIL)."""
    return _modules_of(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


@cache
def extra_modules(pyproject: Path) -> frozenset[str]:
    """Top-level modules provided by the distributions of ``pyproject``'s optional extras."""
    extras = tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {})
    return _modules_of([d for deps in extras.values() for d in deps])


def undeclared_imports(files, pyproject: Path) -> list[str]:
    """``"<file> imports <module>"`` for each third-party module that ``pyproject`` does not declare: not
    required, and not an extra imported only inside functions."""
    declared, extras = declared_modules(pyproject), extra_modules(pyproject)
    bad = []
    for f in files:
        eager = eager_imports(f)
        for mod in sorted(imported_modules(f) - STDLIB - FIRST_PARTY - {"__future__"} - declared):
            if mod in extras and mod not in eager:
                continue
            how = "at import time, but it is only an extra" if mod in extras else "undeclared"
            bad.append(f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f} imports {mod} ({how})")
    return bad


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
    bad = undeclared_imports(sorted(SRC[package].rglob("*.py")), PYPROJECT[package])
    assert not bad, f"undeclared dependencies ({PYPROJECT[package].relative_to(ROOT)}):\n" + "\n".join(bad)


def test_an_extra_counts_as_declared_only_when_imported_lazily(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "p"\ndependencies = ["torch>=2.9"]\n'
        '[project.optional-dependencies]\nplot = ["matplotlib>=3.8"]\n'
    )
    lazy = tmp_path / "lazy.py"
    lazy.write_text("import torch\n\ndef plot():\n    import matplotlib.pyplot\n")
    eager = tmp_path / "eager.py"
    eager.write_text("try:\n    import matplotlib\nexcept ImportError:\n    matplotlib = None\n")
    in_class = tmp_path / "in_class.py"
    in_class.write_text("class C:\n    from matplotlib import pyplot\n")
    other = tmp_path / "other.py"
    other.write_text("def load():\n    import PIL\n")  # installed here, declared by neither
    assert eager_imports(lazy) == {"torch"} and eager_imports(in_class) == {"matplotlib"}
    assert undeclared_imports([lazy, eager, in_class, other], pyproject) == [
        f"{eager} imports matplotlib (at import time, but it is only an extra)",
        f"{in_class} imports matplotlib (at import time, but it is only an extra)",
        f"{other} imports PIL (undeclared)",
    ]


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
