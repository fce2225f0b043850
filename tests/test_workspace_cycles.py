"""No import cycle anywhere in the workspace, counting imports inside functions.

The graph has one node per first-party module (every ``.py`` file of the four packages and of
``omni_train``; a package's ``__init__.py`` is the package's own node) and an edge for every
``import`` / ``from ... import`` statement anywhere in the file: module level, ``if TYPE_CHECKING:``
blocks, class bodies and function bodies alike, since an import hidden inside a function still ties the
two modules together (and is one call away from a partially initialised module). ``from pkg import name``
is an edge to the submodule ``pkg.name`` when that is a module, else to ``pkg`` itself (its
``__init__``); relative imports are resolved against the importing module's package. Importing
``a.b`` is not counted as importing ``a`` (Python runs ``a/__init__`` first, but a package's
``__init__`` re-exporting its submodules would otherwise be a cycle with each of them).

A cycle is a strongly connected component of more than one module (Tarjan's algorithm), or a module that
imports itself; the test names each.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = {
    "omni_parallel": ROOT / "packages/omni-parallel/src/omni_parallel",
    "omni_ckpt": ROOT / "packages/omni-ckpt/src/omni_ckpt",
    "omni_data": ROOT / "packages/omni-data/src/omni_data",
    "omni_pipeline": ROOT / "packages/omni-pipeline/src/omni_pipeline",
    "omni_train": ROOT / "apps/omni-train/src/omni_train",
}


def module_files(src: Mapping[str, Path]) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under each package folder of ``src``."""
    out = {}
    for package, folder in src.items():
        for f in sorted(folder.rglob("*.py")):
            parts = [package, *f.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _resolve(name: str, modules: Iterable[str]) -> str | None:
    """The longest prefix of the dotted ``name`` that is a first-party module (``None``: not ours)."""
    known = set(modules)
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def imports_of(module: str, path: Path, modules: set[str]) -> set[str]:
    """The first-party modules that ``module`` (the file ``path``) imports anywhere in its text."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target is not None:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in modules else _resolve(base, modules)
                if target is not None:
                    out.add(target)
    return out


def import_graph(src: Mapping[str, Path]) -> dict[str, set[str]]:
    """``{module: the first-party modules it imports}`` over every module of ``src``."""
    files = module_files(src)
    names = set(files)
    return {m: imports_of(m, f, names) for m, f in files.items()}


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: each strongly connected component of more than one module, and
    each module that imports itself, as a sorted list of names; components sorted by their first name.

    Tarjan's algorithm (R. Tarjan, "Depth-first search and linear graph algorithms", SIAM J. Comput. 1972),
    iterative so that a deep graph does not reach Python's recursion limit.
    """
    succ = {v: sorted(set(ws)) for v, ws in graph.items()}
    for ws in list(succ.values()):
        for w in ws:
            succ.setdefault(w, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(succ[v]):
                work.append((v, i + 1))
                w = succ[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1 or v in succ[v]:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return sorted(found)


def _describe(component: list[str], graph: Mapping[str, Iterable[str]]) -> str:
    inside = set(component)
    edges = [f"{v} -> {w}" for v in component for w in sorted(set(graph.get(v, ()))) if w in inside]
    return "{" + ", ".join(component) + "}: " + "; ".join(edges)


def test_the_workspace_has_no_import_cycle():
    graph = import_graph(SRC)
    assert len(graph) > 100 and "omni_train.cli" in graph and "omni_pipeline" in graph
    found = cycles(graph)
    assert not found, "import cycles (counting imports inside functions):\n" + "\n".join(
        _describe(c, graph) for c in found
    )


def test_cycle_finder_on_a_synthetic_graph():
    graph = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d"},  # a -> b -> c -> a
        "d": {"e"},
        "e": set(),
        "f": {"f"},  # imports itself
        "g": {"h"},
        "h": {"g", "e"},  # g <-> h
        "i": {"a"},  # reaches a cycle, is not in one
    }
    assert cycles(graph) == [["a", "b", "c"], ["f"], ["g", "h"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert _describe(["g", "h"], graph) == "{g, h}: g -> h; h -> g"


def test_graph_sees_lazy_relative_and_submodule_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("A = 1\n\ndef f():\n    from pkg.sub import b  # lazy: still an edge\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom . import c\nfrom .c import C\n")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nC = 1\nif TYPE_CHECKING:\n    import pkg.sub.b\n"
    )
    graph = import_graph({"pkg": pkg})
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg.a", "pkg.sub.c"},
        "pkg.sub.c": {"pkg.sub.b"},
    }
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]  # two cycles through b: one component
