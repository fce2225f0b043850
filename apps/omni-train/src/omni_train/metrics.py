"""Run outputs: ``metrics.jsonl`` (one JSON object per step), TensorBoard events, the rank-0 progress bar,
and at the end of the run ``loss.png`` (smoothed, mixture phase changes marked), the last step's timeline (PNG and Chrome trace) and
``summary.json``.

Only rank 0 writes. On ``--resume`` the JSONL file is cut back to the steps before the resumed step, so the
file always holds exactly one line per step of one consistent history.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from omni_pipeline import TimelineEvent, plot_timeline, write_chrome_trace

__all__ = ["MetricsLogger", "ema", "finish_run", "loss_figure", "plot_loss", "read_metrics", "tokens_per_s"]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Parse a ``metrics.jsonl`` file into a list of per-step dicts (in file order)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def tokens_per_s(rows: Sequence[dict[str, Any]]) -> float | None:
    """Throughput of the steps ``rows`` (``metrics.jsonl`` rows): their total ``tokens`` over their total
    wall time (``step_time_s``), in tokens per second; ``None`` for no rows or no time.

    Not the mean of the per-step ``tokens_per_s``: a mean of rates weights a fast step like a slow one
    and overstates the throughput of uneven steps (by 3-11% on the bundled recipes).
    """
    seconds = sum(float(m["step_time_s"]) for m in rows)
    return sum(float(m["tokens"]) for m in rows) / seconds if rows and seconds > 0 else None


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


def ema(values: list[float], smoothing: float) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard's scalar smoothing; Adam's debiasing):
    ``m_t = smoothing * m_{t-1} + (1 - smoothing) * x_t``, reported as ``m_t / (1 - smoothing**(t+1))``,
    so the first points are not pulled towards 0.

    Raises:
        ValueError: ``smoothing`` outside ``[0, 1)``.
    """
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    out, m = [], 0.0
    for t, x in enumerate(values):
        m = smoothing * m + (1 - smoothing) * x
        out.append(m / (1 - smoothing ** (t + 1)))
    return out


def loss_figure(metrics: list[dict[str, Any]], *, phase_steps: Sequence[int] = (), smoothing: float = 0.9):
    """The ``loss.png`` figure: per series the raw values (thin, faint) under their :func:`ema`; the total
    loss drawn last and thickest (on top of the per-modality lines); a dashed vertical line at each
    mixture phase change (``phase_steps``: the steps where a new phase starts, ``until_step`` values).

    Returns:
        the matplotlib ``Figure`` (one axes).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    mods = sorted({k for m in metrics for k in m.get("loss_per_modality", {})})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, mod in enumerate(mods):
        pts = [
            (m["step"], m["loss_per_modality"][mod]) for m in metrics if mod in m.get("loss_per_modality", {})
        ]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        c = colours[i % len(colours)]
        ax.plot(xs, ys, color=c, lw=0.6, alpha=0.25, zorder=1)
        ax.plot(xs, ema(ys, smoothing), label=f"loss ({mod})", color=c, lw=1.0, zorder=2)
    steps, losses = [m["step"] for m in metrics], [m["loss"] for m in metrics]
    ax.plot(steps, losses, color="black", lw=0.6, alpha=0.25, zorder=3)
    ax.plot(steps, ema(losses, smoothing), label="loss (all)", color="black", lw=2.2, zorder=4)
    lo, hi = (min(steps), max(steps)) if steps else (0, 0)
    shown = [s for s in sorted(phase_steps) if lo < s <= hi]
    for k, s in enumerate(shown):
        ax.axvline(s, color="grey", ls="--", lw=0.8, zorder=0, label=None if k else "mixture phase change")
    ax.set_xlabel("step")
    ax.set_ylabel(f"cross-entropy (nats / token), EMA {smoothing}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_loss(
    metrics: list[dict[str, Any]],
    path: str | Path,
    *,
    phase_steps: Sequence[int] = (),
    smoothing: float = 0.9,
) -> None:
    """Write :func:`loss_figure` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = loss_figure(metrics, phase_steps=phase_steps, smoothing=smoothing)
    fig.savefig(path)
    plt.close(fig)


def _phase_steps(out_dir: Path) -> list[int]:
    """Mixture phase changes from the run's ``config.json`` (empty if it has none or is unreadable)."""
    try:
        mixture = json.loads((out_dir / "config.json").read_text())["data"]["mixture"]
        return [int(ph["until_step"]) for ph in mixture if ph.get("until_step") is not None]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def finish_run(
    out_dir: Path,
    name: str,
    timelines: dict[int, list[TimelineEvent]] | None,
    title: str,
    elapsed_s: float,
    start_step: int,
    *,
    checkpoints: list[int],
    skipped: dict[str, Any] | None = None,
    numerics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Rank 0 at the end of a run: plot the loss and the last step's timeline, write ``summary.json``
    (first/last mean loss over a window of up to 20 steps, ``tokens_per_s``: the run's tokens over the
    summed wall time of its steps (:func:`tokens_per_s`), each modality's first/last mean loss
    (``first_mean_loss_per_modality``, ``last_mean_loss_per_modality``: the generation loss apart from
    the others), skipped payloads, ``samples_per_modality``
    (the packs' samples by modality over the run) and ``video_frames`` (their videos' sampled frames),
    ``image_code_encodes`` / ``image_code_encodes_per_rank`` (generation samples' images the loaders
    turned into code tokens, summed over the run's steps), each
    ``*_per_rank`` peak of the steps as its per-rank maximum over the steps, the last step's
    ``llm_state_bytes_per_rank`` / ``encoder_state_bytes_per_rank``, and ``skipped``: every skip
    of the run by scope, source and reason with the first keys, from
    :class:`omni_data.SkipMetrics`; ``numerics``: the steps the numerics guard found bad,
    :meth:`omni_parallel.numerics.NumericsGuard.summary`) and return it.
    """
    metrics = read_metrics(out_dir / "metrics.jsonl")
    if metrics:
        plot_loss(metrics, out_dir / "loss.png", phase_steps=_phase_steps(out_dir))
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
        # each modality's loss (the generation loss apart from the understanding ones) over its first and
        # last up to 20 steps that trained it
        **_modality_windows(metrics),
        "tokens_per_s": tokens_per_s(metrics),
        "skipped_payloads": sum(m.get("skipped_payloads", 0) for m in metrics),
        # samples of the run's packs by modality (all DP replicas) and the sampled frames of its videos
        "samples_per_modality": _summed(metrics, "samples_per_modality"),
        "video_frames": sum(m.get("video_frames", 0) for m in metrics),
        # generation samples' images turned into codes by the loaders, all ranks and per rank (first and
        # last stage each encode the samples whose ids they read)
        "image_code_encodes": sum(m.get("image_code_encodes", 0) for m in metrics),
        "image_code_encodes_per_rank": _summed_per_rank(metrics, "image_code_encodes_per_rank"),
        "checkpoints": checkpoints,
        **_peaks_per_rank(metrics),
        # bytes held between steps (omni_parallel.memory.state_bytes), at the last step's layout
        **{
            k: metrics[-1][k]
            for k in ("llm_state_bytes_per_rank", "encoder_state_bytes_per_rank")
            if metrics and k in metrics[-1]
        },
    }
    if skipped is not None:
        summary["skipped"] = skipped
    if numerics is not None:
        summary["numerics"] = numerics
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _modality_windows(metrics: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``first_mean_loss_per_modality`` / ``last_mean_loss_per_modality``: per modality the mean of its
    ``loss_per_modality`` over the first and the last ``min(20, steps // 2)`` (at least 1) of the steps
    that had targets of it (nats per target token)."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    mods = sorted({k for m in metrics for k in m.get("loss_per_modality", {})})
    for mod in mods:
        xs = [m["loss_per_modality"][mod] for m in metrics if mod in m.get("loss_per_modality", {})]
        n = min(20, len(xs) // 2) or 1
        first[mod], last[mod] = sum(xs[:n]) / n, sum(xs[-n:]) / n
    return {"first_mean_loss_per_modality": first, "last_mean_loss_per_modality": last}


def _summed(metrics: list[dict[str, Any]], key: str) -> dict[str, int]:
    """``{name: sum over the steps}`` of the steps' ``key`` dicts (a step without it adds nothing)."""
    out: dict[str, int] = {}
    for m in metrics:
        for k, v in m.get(key, {}).items():
            out[k] = out.get(k, 0) + v
    return out


def _summed_per_rank(metrics: list[dict[str, Any]], key: str) -> list[int]:
    """``key``'s per-rank lists summed over the steps that have the last step's number of ranks (a run
    resumed under another world size: the layout it finished in); ``[]`` when no step has it."""
    lists = [m[key] for m in metrics if isinstance(m.get(key), list)]
    if not lists:
        return []
    n = len(lists[-1])
    return [sum(v[r] for v in lists if len(v) == n) for r in range(n)]


def _peaks_per_rank(metrics: list[dict[str, Any]]) -> dict[str, list[int]]:
    """``{key: per-rank maximum over the steps}`` for every ``peak_*_per_rank`` list in the steps.

    A run resumed under another world size has lists of another length before the resume: the maximum
    is over the steps with the last step's number of ranks (the layout the run finished in)."""
    out: dict[str, list[int]] = {}
    for m in reversed(metrics):
        for k, v in m.items():
            if not (k.startswith("peak_") and k.endswith("_per_rank") and isinstance(v, list)):
                continue
            if k not in out:
                out[k] = list(v)
            elif len(v) == len(out[k]):
                out[k] = [max(a, b) for a, b in zip(out[k], v)]
    return out
