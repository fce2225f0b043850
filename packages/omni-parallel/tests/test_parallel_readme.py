"""The README's first python block runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(capsys):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None, "README has no python block"
    namespace: dict = {}
    exec(compile(block.group(1), str(README), "exec"), namespace)
    assert sorted(map(sorted, namespace["parts"])) == [[0, 5], [1, 3], [2, 4]]
    assert namespace["mine"].shape == (8, 4, 8)  # docs of 7 and 5 -> chunks of 2 -> 2 * (2 + 2)
    plan = namespace["plan"]
    assert plan.long_samples == (0, 3)
    assert "HybridCPSlot(sample=0" in capsys.readouterr().out
