"""Throughput is total tokens over total wall time of the counted steps (not a mean of per-step rates)."""

from __future__ import annotations

import json

import pytest

from omni_train.metrics import finish_run, tokens_per_s


def test_summary_tokens_per_s_is_total_tokens_over_total_time(tmp_path):
    # uneven steps: a fast small step and a slow big one (the mean of rates overstates throughput)
    steps = [(1000, 0.1), (4000, 0.9), (2500, 0.4), (3000, 0.6)]
    rows = [
        {"step": i, "loss": 5.0 - i, "tokens": n, "step_time_s": t, "tokens_per_s": n / t}
        for i, (n, t) in enumerate(steps)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = finish_run(tmp_path, "x", None, "x", 2.5, 0, checkpoints=[])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    brute = 0.0
    for r in lines:
        brute += r["tokens"]
    brute /= sum(r["step_time_s"] for r in lines)
    assert summary["tokens_per_s"] == pytest.approx(brute, rel=1e-12)
    assert json.loads((tmp_path / "summary.json").read_text())["tokens_per_s"] == summary["tokens_per_s"]
    mean_of_rates = sum(r["tokens_per_s"] for r in lines) / len(lines)
    assert mean_of_rates > 1.03 * brute  # the old definition, measurably off on these steps
    assert tokens_per_s([]) is None
