"""The README's example runs as written."""

import pathlib
import re


def test_readme_example(tmp_path, monkeypatch):
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    step, state = scope["step"], scope["state"]
    assert step.step == 0 and len(step.packs) == 4 and set(step.payloads) == {1, 3}
    assert state["pending"] and "loader" in state
