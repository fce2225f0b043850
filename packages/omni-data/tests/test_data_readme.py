"""The README's example runs as written."""

import pathlib
import re
import threading


def test_readme_example(tmp_path, monkeypatch):
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    step, state = scope["step"], scope["state"]
    assert step.step == 0 and len(step.packs) == 4 and set(step.payloads) == {1, 3}
    assert state["pending"] and "loader" in state
    skips = scope["skips"]  # clean shards: nothing skipped, and the report says so per scope
    assert skips["total"] == 0 and skips["metadata"] == {} and skips["payload"] == {}
    assert not any(t.name.startswith("omni-data-decode") for t in threading.enumerate())  # closed by `with`
