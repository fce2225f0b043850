"""Fit a :class:`~omni_pipeline.cost.CostModel` from measured records of real steps.

Per action kind and stage (``F0``, ``B1``, ``EF``, ``EB``, ...), the seconds of an action are modelled as
a sum over the modules it ran of ``base + per_token * tokens + per_token_sq * tokens_sq``
(:class:`~omni_pipeline.cost.TokenCost`), fitted by non-negative least squares over every record of that
kind and stage (``torch.linalg.lstsq`` in float64 on max-scaled columns; a column whose coefficient comes
out negative is dropped and the rest refitted, until none is: Lawson & Hanson's active-set idea in its
simplest form). P2P: ``transfer_s = latency + bytes / bandwidth`` over the messages whose receiver blocked
(the only ones whose arrival was observed). Dispatch: the mean gap between consecutive actions of a rank
not spent waiting on a receive. Step overhead: the mean over steps of the slowest rank's step wall time
minus the latest end of a pipeline action.

Also from the records: :func:`fit_run` (a run directory's fit, its warm-up step dropped),
:func:`fitted_cost_model` (that fit checked against the pipeline it will time) and
:func:`calibrated_layer_costs` (per-layer and LM head + loss seconds for the ``"auto"`` layer split,
:func:`omni_pipeline.split.split_layers`).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

from omni_pipeline.cost import CostModel, TokenCost, cost_key
from omni_pipeline.records import ActionRecord, RunRecords, read_records
from omni_pipeline.split import LLMShape, layer_costs
from omni_pipeline.stage_balance import fit_layer_costs

__all__ = [
    "calibrated_layer_costs",
    "fit_cost_model",
    "fit_run",
    "fitted_cost_model",
    "nonnegative_lstsq",
]


def nonnegative_lstsq(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """``x >= 0`` minimising ``|A x - y|`` (active set: drop the most negative coefficient, refit).

    Columns are scaled by their largest magnitude first (token counts and their squares differ by orders
    of magnitude); all-zero columns get 0.

    Raises:
        ValueError: no rows, or rows of different lengths.
    """
    if not rows or any(len(r) != len(rows[0]) for r in rows) or len(rows) != len(y):
        raise ValueError("nonnegative_lstsq: need equally long rows, one per target")
    a = torch.tensor([list(map(float, r)) for r in rows], dtype=torch.float64)
    b = torch.tensor(list(map(float, y)), dtype=torch.float64).unsqueeze(1)
    scale = a.abs().amax(dim=0)
    active = [j for j in range(a.shape[1]) if scale[j] > 0]
    x = [0.0] * a.shape[1]
    while active:
        cols = a[:, active] / scale[active]
        sol = torch.linalg.lstsq(cols, b, driver="gelsd").solution.squeeze(1) / scale[active]
        worst = min(range(len(active)), key=lambda i: (float(sol[i]), i))
        if float(sol[worst]) >= 0:
            for i, j in enumerate(active):
                x[j] = float(sol[i])
            break
        del active[worst]
    return x


def _fit_actions(actions: Sequence[ActionRecord]) -> dict[str, TokenCost]:
    groups: dict[tuple[str, int | None], list[ActionRecord]] = defaultdict(list)
    for r in actions:
        groups[(r.kind, r.stage)].append(r)
    out: dict[str, TokenCost] = {}
    for (kind, stage), recs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        modules = sorted({m for r in recs for m, n in r.tokens.items() if n > 0})
        if not modules:
            continue
        rows = []
        for r in recs:
            row: list[float] = []
            for m in modules:
                n = r.tokens.get(m, 0)
                row += [1.0 if n > 0 else 0.0, float(n), float(r.tokens_sq.get(m, 0)) if n > 0 else 0.0]
            rows.append(row)
        x = nonnegative_lstsq(rows, [r.seconds for r in recs])
        for i, m in enumerate(modules):
            out[cost_key(kind, stage, m)] = TokenCost(*x[3 * i : 3 * i + 3])
    return out


def fit_cost_model(records: RunRecords, *, skip_steps: int = 0) -> CostModel:
    """A :class:`CostModel` fitted from a run's records.

    Args:
        records: from :func:`omni_pipeline.records.read_records`.
        skip_steps: ignore the first ``skip_steps`` recorded steps (warm-up: allocator, caches).

    Returns:
        a model with ``coefficients`` (use :meth:`CostModel.for_step` for a step's durations),
        ``p2p_latency_s`` / ``p2p_bandwidth_Bps``, ``dispatch_s``, ``step_overhead_s``,
        ``llm_activation_bytes`` (mean activation message), and ``llm_forward_s`` / ``llm_backward_s`` per
        stage set to the measured means (so the model alone times an average step).

    Raises:
        ValueError: no action records (after skipping), or LLM records of some stage missing.
    """
    ids = records.step_ids
    if skip_steps:
        records = records.from_step(ids[skip_steps] if skip_steps < len(ids) else math.inf)
    if not records.actions:
        raise ValueError(
            f"fit_cost_model: no action records to fit (steps recorded: {len(ids)}, skipped {skip_steps})"
        )
    coefficients = _fit_actions(records.actions)
    llm = [r for r in records.actions if r.stage is not None]
    stages = sorted({r.stage for r in llm})
    if stages != list(range(len(stages))):
        raise ValueError(f"fit_cost_model: LLM records cover stages {stages}, not 0..{len(stages) - 1}")

    def mean_s(kind: str, s: int) -> float:
        xs = [r.seconds for r in llm if r.kind == kind and r.stage == s]
        return sum(xs) / len(xs) if xs else 0.0

    observed = [r for r in records.p2p if r.transfer_s is not None and r.wait_s > 0]
    latency, bandwidth = 0.0, math.inf
    if len({r.bytes for r in observed}) >= 2:
        lat, per_byte = nonnegative_lstsq(
            [[1.0, float(r.bytes)] for r in observed], [r.transfer_s for r in observed]
        )
        latency, bandwidth = lat, (1.0 / per_byte if per_byte > 0 else math.inf)
    elif observed:
        latency = sum(r.transfer_s for r in observed) / len(observed)
    act = [r.bytes for r in records.p2p if r.what == "activation"]

    by_rank: dict[tuple[int, int], list[ActionRecord]] = defaultdict(list)
    for r in records.actions:
        by_rank[(r.step, r.rank)].append(r)
    gaps = []
    for recs in by_rank.values():
        recs.sort(key=lambda r: r.start_s)
        gaps += [max(0.0, b.start_s - a.end_s - b.wait_s) for a, b in itertools.pairwise(recs)]
    per_step: dict[int, list] = defaultdict(list)
    for r in records.steps:
        per_step[r.step].append(r)
    overheads = [
        max(0.0, max(r.step_s for r in rs) - max(r.actions_end_s for r in rs)) for rs in per_step.values()
    ]
    return CostModel(
        llm_forward_s=[mean_s("F", s) for s in stages] or 0.0,
        llm_backward_s=[mean_s("B", s) for s in stages] or 0.0,
        p2p_latency_s=latency,
        p2p_bandwidth_Bps=bandwidth,
        llm_activation_bytes=sum(act) / len(act) if act else 0.0,
        dispatch_s=sum(gaps) / len(gaps) if gaps else 0.0,
        step_overhead_s=sum(overheads) / len(overheads) if overheads else 0.0,
        coefficients=coefficients,
    )


def fit_run(run: str | Path) -> tuple[RunRecords, CostModel, int]:
    """A run's records, the cost model fitted from them (:func:`fit_cost_model`, the first recorded
    step dropped as warm-up when there are more) and the number of pipeline stages it fitted.

    Raises:
        OSError: no records file in ``run``. ValueError: malformed records (``RecordError``) or too few
            to fit.
    """
    records = read_records(run)
    fitted = fit_cost_model(records, skip_steps=1 if len(records.step_ids) > 1 else 0)
    stages = len(fitted.llm_forward_s) if isinstance(fitted.llm_forward_s, list) else 0
    return records, fitted, stages


def fitted_cost_model(run: str | Path, num_stages: int) -> CostModel:
    """The cost model fitted from ``run``'s records (:func:`fit_run`), for a pipeline of ``num_stages``
    stages.

    Raises:
        OSError: no records file in ``run``.
        ValueError: malformed or too few records, or records of another number of pipeline stages
            (the fit times each stage by its own measured coefficients).
    """
    _, fitted, stages = fit_run(run)
    if stages != num_stages:
        raise ValueError(
            f"recorded {stages} pipeline stages, the pipeline to time has {num_stages}; calibrate with a run of "
            "this layout"
        )
    return fitted


def calibrated_layer_costs(
    records: RunRecords, split: Sequence[range], shape: LLMShape, max_seq_len: int
) -> tuple[float, float, float]:
    """``(one block, the embedding, the final norm + LM head + loss)`` in measured seconds per LLM
    microbatch (forward + backward), from the records of a run of the same model split as ``split``.

    Each stage's mean F + B seconds per microbatch (the first recorded step dropped as warm-up) feeds
    :func:`~omni_pipeline.stage_balance.fit_layer_costs`, which solves ``stage s = layers_s * block +
    [s last] * head`` (least squares over the stages; exact with 2). The embedding, a row gather that
    one split cannot tell apart from the layers, is its modelled share of a block
    (:func:`~omni_pipeline.split.layer_costs`) of the fitted block.

    Args:
        records: the run's (:func:`~omni_pipeline.records.read_records`).
        split: the layers of each of the run's stages.
        shape: the model (its ``vocab_size`` is not needed).
        max_seq_len: tokens per pack of the run.

    Raises:
        ValueError: fewer than 2 stages in ``split``, a recorded stage outside it, a stage without LLM
            actions, or stage times that fit no positive seconds per layer.
    """
    if len(split) < 2:  # one stage holds the head and every layer: their costs cannot be told apart
        raise ValueError(f"recorded with {len(split)} LLM stage; calibrate with a run of >= 2 stages")
    steps = sorted({r.step for r in records.actions})
    first = steps[1] if len(steps) > 1 else (steps[0] if steps else 0)
    busy = [0.0] * len(split)
    seen: list[set[tuple[int, int]]] = [set() for _ in split]
    for r in records.actions:
        if r.stage is not None and not 0 <= r.stage < len(split):
            raise ValueError(
                f"actions.jsonl records LLM stage {r.stage} (step {r.step}), the run's split puts the "
                f"layers over {len(split)} stages; are the records another run's?"
            )
        if r.stage is not None and r.step >= first:
            busy[r.stage] += r.end_s - r.start_s
            seen[r.stage].add((r.step, r.microbatch))
    missing = [s for s, mbs in enumerate(seen) if not mbs]
    if missing:
        raise ValueError(f"no LLM actions recorded for stages {missing} of its {len(split)}")
    per_mb = [b / len(mbs) for b, mbs in zip(busy, seen, strict=True)]
    counts = [len(r) for r in split]
    headless = LLMShape(shape.dim, shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.ffn_dim, 1)
    block_flops, first_flops, _ = layer_costs(headless, max_seq_len)
    block, _ = fit_layer_costs(per_mb, counts)
    embedding = block * first_flops / block_flops
    block, head = fit_layer_costs(per_mb, counts, first_stage_extra=embedding)  # without it in the layers
    if block <= 0.0:  # balance_stages over zero-cost layers would return an arbitrary split
        raise ValueError(
            f"the recorded stage times {per_mb} s per microbatch fit no positive seconds per layer"
        )
    return block, block * first_flops / block_flops, head
