"""The design document is the repository's own and code cites it truthfully: every ``DESIGN.md`` citation in
the source is ``DESIGN.md §<section>`` naming a ``##`` heading of DESIGN.md (its first word); and no
document speaks of the sessions that wrote it (a README result names its commit and date instead)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def _sections() -> set[str]:
    return {m.group(1) for m in re.finditer(r"^## (\S+)", (ROOT / "DESIGN.md").read_text(), re.M)}


def test_every_design_md_citation_names_a_section_that_exists():
    sections = _sections()
    assert {"Layout", "Glossary", "omni-parallel", "omni-pipeline", "omni-data", "omni-ckpt"} <= sections
    bad, cited = [], 0
    for path in _tracked("*.py"):
        if path == Path(__file__).resolve():
            continue  # this file names the form itself
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in re.finditer(r"DESIGN\.md(?: §([\w-]+))?", line):
                cited += 1
                if m.group(1) not in sections:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert cited >= 10, cited
    assert not bad, (
        f"DESIGN.md citations without a §<section> that exists ({sorted(sections)}):\n" + "\n".join(bad)
    )


def test_no_document_speaks_of_sessions():
    hits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in _tracked("*.md")
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if re.search(r"\bsessions?\b", line, re.I)
    ]
    assert not hits, f"documents speak of sessions: {hits}"
