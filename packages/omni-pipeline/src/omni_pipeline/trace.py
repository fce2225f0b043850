"""Timelines of pipeline actions: Chrome trace JSON (opens in Perfetto) and a PNG (matplotlib).

matplotlib is an optional dependency (``pip install 'omni-pipeline[plot]'``): only :func:`plot_timeline`
imports it, when called, so the scheduler, simulator and executor install and run without it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TimelineEvent", "plot_timeline", "write_chrome_trace"]


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One action on one rank: ``action`` in pipelining notation (``"0F1"``, ``"EF3"``), seconds from
    the step's start. ``kind`` is the action kind (``"F"``, ``"B"``, ``"EF"``, ``"EB"``)."""

    rank: int
    action: str
    kind: str
    start_s: float
    end_s: float

    @property
    def is_encoder(self) -> bool:
        return self.kind in ("EF", "EB")


_COLORS = {"F": "#4C72B0", "B": "#8FB0DE", "EF": "#DD5A3A", "EB": "#F2A68F"}
_LEGEND = {"F": "LLM forward", "B": "LLM backward", "EF": "encoder forward", "EB": "encoder backward"}


def write_chrome_trace(timelines: Mapping[int, Sequence[TimelineEvent]], path: str | Path) -> Path:
    """Write a Chrome trace (``{"traceEvents": [...]}``, microseconds, one thread per rank).

    Returns:
        the path written.
    """
    events = []
    for rank in sorted(timelines):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
        )
        for ev in timelines[rank]:
            events.append(
                {
                    "name": ev.action,
                    "cat": "encoder" if ev.is_encoder else "llm",
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": ev.start_s * 1e6,
                    "dur": max(ev.end_s - ev.start_s, 0.0) * 1e6,
                }
            )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def plot_timeline(
    timelines: Mapping[int, Sequence[TimelineEvent]],
    path: str | Path,
    *,
    title: str = "",
    labels: bool = True,
) -> Path:
    """Draw a PNG timeline: one row per rank, LLM forward/backward in blues, encoder work in reds.

    Args:
        timelines: ``{rank: [TimelineEvent, ...]}`` (seconds).
        path: output PNG.
        title: figure title.
        labels: write the action name inside boxes wide enough to hold it.

    Returns:
        the path written.

    Raises:
        ImportError: matplotlib is not installed (it is the ``plot`` extra: ``omni-pipeline[plot]``).
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "omni_pipeline.plot_timeline draws with matplotlib, which is not installed: it is an optional "
            "dependency, installed by `pip install 'omni-pipeline[plot]'` (or `pip install 'matplotlib>=3.8'`)",
            name="matplotlib",
        ) from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted(timelines)
    end = max((ev.end_s for r in ranks for ev in timelines[r]), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(14, 0.55 * len(ranks) + 1.5))
    for row, rank in enumerate(ranks):
        for ev in timelines[rank]:
            width = ev.end_s - ev.start_s
            ax.broken_barh(
                [(ev.start_s, width)],
                (row - 0.4, 0.8),
                facecolors=_COLORS.get(ev.kind, "grey"),
                edgecolors="white",
                linewidth=0.5,
            )
            if labels and width > end / 60:
                ax.text(ev.start_s + width / 2, row, ev.action, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_xlim(0, end)
    # outside the axes, right of the rows: inside it would hide the last actions of rank 0
    ax.legend(
        handles=[Patch(color=c, label=f"{_LEGEND[k]} ({k})") for k, c in _COLORS.items()],
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=7,
        frameon=False,
    )
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
