"""Balanced LLM pipeline stages: contiguous layer splits that account for the embedding, LM head and loss.

An even split of the layers leaves the last stage with the LM head and the loss on top of its layers
(and the first with the embedding), so it is the pipeline's bottleneck whenever the vocabulary is large
against the width: every other stage waits on it. Megatron-LM accounts for them in the split
(``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``, which count
each as one layer); here each is given its own measured or modelled cost and the split minimises the
slowest stage exactly.

* :func:`balance_stages` - the split minimising the slowest stage's cost (min-max contiguous
  partition, dynamic programming), then, among those, the most even one (least sum of squared stage
  costs), so the answer is unique and the same on every rank.
* :func:`explicit_stages` - an explicit list of layers per stage, checked.
* :func:`stage_costs` - the cost of each stage of a split.
* :func:`fit_layer_costs` - per-layer and LM-head + loss cost from measured per-stage times of a known
  split (least squares), to feed :func:`balance_stages` from a calibrated run.

Costs are in any one unit per token (seconds, FLOPs): only their ratios matter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["balance_stages", "explicit_stages", "fit_layer_costs", "stage_costs"]


def _check_costs(layer_costs: Sequence[float], num_stages: int, first: float, last: float) -> list[float]:
    costs = [float(c) for c in layer_costs]
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"balance_stages: num_stages must be an int >= 1, got {num_stages!r}")
    if len(costs) < num_stages:
        raise ValueError(
            f"balance_stages: {len(costs)} layers cannot fill {num_stages} stages (every stage needs a layer)"
        )
    bad = {i: c for i, c in enumerate(costs) if not (c >= 0 and math.isfinite(c))}
    if bad:
        raise ValueError(f"balance_stages: layer costs must be finite and >= 0, got {bad}")
    for name, v in (("first_stage_extra", first), ("last_stage_extra", last)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"balance_stages: {name} must be finite and >= 0, got {v!r}")
    return costs


def stage_costs(
    stages: Sequence[range],
    layer_costs: Sequence[float],
    *,
    first_stage_extra: float = 0.0,
    last_stage_extra: float = 0.0,
) -> list[float]:
    """Cost of each stage: its layers' costs, plus ``first_stage_extra`` (embedding) on stage 0 and
    ``last_stage_extra`` (final norm, LM head, loss) on the last stage (both on it when there is one)."""
    out = [sum(float(layer_costs[i]) for i in r) for r in stages]
    if out:
        out[0] += float(first_stage_extra)
        out[-1] += float(last_stage_extra)
    return out


def balance_stages(
    layer_costs: Sequence[float],
    num_stages: int,
    *,
    first_stage_extra: float = 0.0,
    last_stage_extra: float = 0.0,
) -> list[range]:
    """The contiguous split of layers over ``num_stages`` stages whose slowest stage is fastest.

    Among splits with the same slowest stage (to a relative 1e-12), the one with the least sum of
    squared stage costs; remaining ties go to the split whose earlier stages hold more layers. Exact:
    O(stages * layers^2) dynamic programming (layers are few).

    Args:
        layer_costs: cost of each LLM layer, in layer order (e.g. seconds or FLOPs per token).
        num_stages: pipeline stages (each gets at least one layer).
        first_stage_extra: cost only stage 0 has (token embedding, encoder-output scatter).
        last_stage_extra: cost only the last stage has (final norm, LM head, loss).

    Returns:
        ``[range(lo, hi), ...]`` per stage, covering ``0 .. len(layer_costs)`` in order.

    Raises:
        ValueError: fewer layers than stages, ``num_stages < 1``, or a negative / non-finite cost.

    Source: Megatron-LM's account-for-embedding/loss pipeline split (Narayanan et al., 2021, and
    ``megatron/core/transformer/transformer_config.py``), with costs instead of "one layer each".
    """
    costs = _check_costs(layer_costs, num_stages, first_stage_extra, last_stage_extra)
    n, s_count = len(costs), num_stages
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, lo: int, hi: int) -> float:
        c = prefix[hi] - prefix[lo]
        if s == 0:
            c += first_stage_extra
        if s == s_count - 1:
            c += last_stage_extra
        return c

    inf = math.inf
    # best[s][j]: the least possible slowest stage when stages 0..s-1 hold layers [0, j)
    best = [[inf] * (n + 1) for _ in range(s_count + 1)]
    best[0][0] = 0.0
    for s in range(1, s_count + 1):
        for j in range(s, n - (s_count - s) + 1):
            best[s][j] = min(
                max(best[s - 1][i], cost(s - 1, i, j)) for i in range(s - 1, j) if best[s - 1][i] < inf
            )
    bound = best[s_count][n]
    limit = bound + 1e-12 * max(1.0, abs(bound))
    # second pass: least sum of squares under that bound; sq[s][j] as best[s][j]
    sq = [[inf] * (n + 1) for _ in range(s_count + 1)]
    choice = [[-1] * (n + 1) for _ in range(s_count + 1)]
    sq[0][0] = 0.0
    for s in range(1, s_count + 1):
        for j in range(s, n - (s_count - s) + 1):
            # scan i from high to low: on equal sums the earlier stages keep more layers
            for i in range(j - 1, s - 2, -1):
                c = cost(s - 1, i, j)
                if sq[s - 1][i] == inf or c > limit:
                    continue
                v = sq[s - 1][i] + c * c
                if v < sq[s][j] * (1 - 1e-12) or sq[s][j] == inf:
                    sq[s][j], choice[s][j] = v, i
    bounds = [n]
    for s in range(s_count, 0, -1):
        bounds.append(choice[s][bounds[-1]])
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(s_count)]


def explicit_stages(layers_per_stage: Sequence[int], num_layers: int | None = None) -> list[range]:
    """Layer ranges from an explicit list of layer counts per stage (``parallel.stage_layers``).

    Raises:
        ValueError: an empty list, a count < 1 or not an int, or counts not summing to ``num_layers``
            (when given); the message names the list.
    """
    counts = list(layers_per_stage)
    if not counts or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        raise ValueError(f"stage layers {counts}: need one int >= 1 per stage")
    if num_layers is not None and sum(counts) != num_layers:
        raise ValueError(f"stage layers {counts} sum to {sum(counts)}, the LLM has {num_layers} layers")
    out, lo = [], 0
    for c in counts:
        out.append(range(lo, lo + c))
        lo += c
    return out


def fit_layer_costs(
    stage_seconds: Sequence[float],
    layers_per_stage: Sequence[int],
    *,
    first_stage_extra: float = 0.0,
) -> tuple[float, float]:
    """Per-layer cost and LM head + loss cost from measured per-stage times of a known split.

    Model: ``stage_seconds[s] = n_s * layer + [s == last] * head + [s == 0] * first_stage_extra``
    (identical layers), solved by least squares (``torch.linalg.lstsq``, float64); the embedding's
    ``first_stage_extra`` is given (it cannot be told apart from the layers with one split).

    Returns:
        ``(layer, head)``, both clipped at 0.

    Raises:
        ValueError: lengths differ, fewer than 2 stages, or a count < 1.
    """
    t = [float(x) for x in stage_seconds]
    n = list(layers_per_stage)
    if len(t) != len(n) or len(t) < 2 or any(c < 1 for c in n):
        raise ValueError(
            f"fit_layer_costs: need per-stage times and layer counts (>= 1) for >= 2 stages, got {t} and {n}"
        )
    a = torch.tensor([[float(c), float(s == len(n) - 1)] for s, c in enumerate(n)], dtype=torch.float64)
    y = torch.tensor(t, dtype=torch.float64)
    y[0] -= first_stage_extra
    sol = torch.linalg.lstsq(a, y.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    return max(0.0, float(sol[0])), max(0.0, float(sol[1]))
