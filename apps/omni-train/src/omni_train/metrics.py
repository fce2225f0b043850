"""Run outputs: ``metrics.jsonl`` (one JSON object per step), TensorBoard events, the rank-0 progress bar,
and at the end of the run ``loss.png``, the last step's timeline (PNG and Chrome trace) and
``summary.json``.

Only rank 0 writes. On ``--resume`` the JSONL file is cut back to the steps before the resumed step, so the
file always holds exactly one line per step of one consistent history.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tqdm import tqdm

from omni_pipeline import TimelineEvent, plot_timeline, write_chrome_trace

__all__ = ["MetricsLogger", "finish_run", "plot_loss", "read_metrics"]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Parse a ``metrics.jsonl`` file into a list of per-step dicts (in file order)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Writes per-step metrics to JSONL and TensorBoard and drives a tqdm bar (loss, tokens/s, ETA).

    Args:
        out_dir: the run directory.
        total_steps: steps of the whole run (the bar's total).
        start_step: first step this process will run (0, or the resumed step).
        enabled: False on ranks other than 0 (then every method is a no-op).
    """

    def __init__(self, out_dir: str | Path, total_steps: int, start_step: int, *, enabled: bool) -> None:
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter  # rank 0 only: the import costs seconds

        kept = [m for m in read_metrics(self.path) if m["step"] < start_step]
        self.path.write_text("".join(json.dumps(m) + "\n" for m in kept))
        self._file = self.path.open("a")
        self._tb = SummaryWriter(str(Path(out_dir) / "tensorboard"), purge_step=start_step)
        self._bar = tqdm(
            total=total_steps, initial=start_step, desc="omni-train", unit="step", dynamic_ncols=True
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record ``metrics`` (numbers, or dicts of numbers flattened as ``key/sub``) for ``step``."""
        if not self.enabled:
            return
        row = {"step": step, **metrics}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for k, v in metrics.items():
            items = v.items() if isinstance(v, dict) else [(None, v)]
            for sub, x in items:
                if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x):
                    self._tb.add_scalar(k if sub is None else f"{k}/{sub}", x, step)
        self._bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics.get('tokens_per_s', 0):.0f}")
        self._bar.update(1)

    def close(self) -> None:
        if not self.enabled:
            return
        self._bar.close()
        self._tb.close()
        self._file.close()


def plot_loss(metrics: list[dict[str, Any]], path: str | Path) -> None:
    """Plot total loss and loss per modality against step into a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = [m["step"] for m in metrics]
    ax.plot(steps, [m["loss"] for m in metrics], label="loss", color="black", lw=1.5)
    mods = sorted({k for m in metrics for k in m.get("loss_per_modality", {})})
    for mod in mods:
        pts = [
            (m["step"], m["loss_per_modality"][mod]) for m in metrics if mod in m.get("loss_per_modality", {})
        ]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"loss ({mod})", lw=0.8, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def finish_run(
    out_dir: Path,
    name: str,
    timelines: dict[int, list[TimelineEvent]] | None,
    title: str,
    elapsed_s: float,
    start_step: int,
    *,
    checkpoints: list[int],
) -> dict[str, Any]:
    """Rank 0 at the end of a run: plot the loss and the last step's timeline, write ``summary.json``
    (first/last mean loss over a window of up to 20 steps, mean tokens/s, skipped payloads, and each
    ``*_per_rank`` peak of the steps as its per-rank maximum over the steps) and return it.
    """
    metrics = read_metrics(out_dir / "metrics.jsonl")
    if metrics:
        plot_loss(metrics, out_dir / "loss.png")
    if timelines is not None:
        plot_timeline(timelines, out_dir / "timeline.png", title=title)
        write_chrome_trace(timelines, out_dir / "timeline.json")
    losses = [m["loss"] for m in metrics]
    n = min(20, len(losses) // 2) or 1
    summary = {
        "config": name,
        "steps": len(losses),
        "resumed_from": start_step,
        "wall_s_this_process": elapsed_s,
        "first_mean_loss": sum(losses[:n]) / n if losses else None,
        "last_mean_loss": sum(losses[-n:]) / n if losses else None,
        "window": n,
        "mean_tokens_per_s": sum(m["tokens_per_s"] for m in metrics) / len(metrics) if metrics else None,
        "skipped_payloads": sum(m.get("skipped_payloads", 0) for m in metrics),
        "checkpoints": checkpoints,
        **_peaks_per_rank(metrics),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _peaks_per_rank(metrics: list[dict[str, Any]]) -> dict[str, list[int]]:
    """``{key: per-rank maximum over the steps}`` for every ``peak_*_per_rank`` list in the steps."""
    out: dict[str, list[int]] = {}
    for m in metrics:
        for k, v in m.items():
            if k.startswith("peak_") and k.endswith("_per_rank") and isinstance(v, list):
                out[k] = [max(a, b) for a, b in zip(out.get(k, v), v, strict=True)]
    return out
