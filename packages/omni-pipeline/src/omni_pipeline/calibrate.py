"""Fit a :class:`~omni_pipeline.cost.CostModel` from measured records of real steps.

Per action kind and stage (``F0``, ``B1``, ``EF``, ``EB``, ...), the seconds of an action are modelled as
a sum over the modules it ran of ``base + per_token * tokens + per_token_sq * tokens_sq``
(:class:`~omni_pipeline.cost.TokenCost`), fitted by non-negative least squares over every record of that
kind and stage (``torch.linalg.lstsq`` in float64 on max-scaled columns; a column whose coefficient comes
out negative is dropped and the rest refitted, until none is: Lawson & Hanson's active-set idea in its
simplest form). So that a fit extrapolates to other runs: each rank's first action of each kind, stage and
module is left out (one-time costs, :func:`fit_cost_model`), and a term the records cannot tell apart is
left out (fewer than 3 distinct sizes: no quadratic term; fewer than 2, or sizes spanning less than
:data:`BASE_SPREAD`: no fixed cost). P2P: ``transfer_s = latency + bytes / bandwidth`` over the messages whose receiver blocked
(the only ones whose arrival was observed). Dispatch: the mean gap between consecutive actions of a rank
not spent waiting on a receive. Step overhead: the mean over steps of the slowest rank's step wall time
minus the latest end of a pipeline action.

Also from the records: :func:`fit_run` (a run directory's fit, its warm-up step dropped),
:func:`fitted_cost_model` (that fit checked against the pipeline it will time) and
:func:`calibrated_layer_costs` (per-layer and LM head + loss seconds for the ``"auto"`` layer split,
:func:`omni_pipeline.split.split_layers`).

Out of sample, on another pipeline layout (:func:`fit_layer_model`, :func:`restage_cost_model`): the LLM
records of every stage are fitted jointly to one stage-independent model, a decoder block's
:class:`~omni_pipeline.cost.TokenCost` times the stage's layers plus the final norm + LM head + loss on the
last stage (and the embedding, a given share of a block, on the first), then re-staged onto another layer
split; encoder, P2P and dispatch terms carry over (same machine, same models); the time outside the
pipeline is scaled by the largest parameter count a rank holds (the optimizer's and the gradient
clipping's work, :func:`restage_cost_model`). :func:`host_step_s` simulates a step again with the ranks
sharing a host's cores (more processes than cores on one host, e.g. CPU ranks), with each process's CPU
work outside its recorded actions (:func:`fit_process_cpu`, from the step records' ``cpu_s`` and
``pipeline_cpu_s``) competing for them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from omni_pipeline.actions import Action
from omni_pipeline.cost import CostModel, TokenCost, cost_key
from omni_pipeline.dataflow import DataFlow
from omni_pipeline.graph import execution_order, llm_encoder_deps
from omni_pipeline.records import ActionRecord, RunRecords, read_records
from omni_pipeline.schedules import Schedule
from omni_pipeline.split import LLMShape, layer_costs
from omni_pipeline.stage_balance import fit_layer_costs

__all__ = [
    "BASE_SPREAD",
    "LayerCostModel",
    "ProcessCpu",
    "calibrated_layer_costs",
    "fit_cost_model",
    "fit_layer_model",
    "fit_process_cpu",
    "fit_run",
    "fitted_cost_model",
    "host_step_s",
    "nonnegative_lstsq",
    "restage_cost_model",
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


BASE_SPREAD = 2.0
"""A module's fixed cost per action (``TokenCost.base_s``) is fitted only when its records' token counts
span at least this factor (largest / smallest); below it the per-token terms carry the whole cost, so
that a fit on nearly equal sizes (e.g. packs filled to one length) extrapolates with the tokens instead of
staying flat."""


def _first_calls(actions: Sequence[ActionRecord]) -> set[tuple[int, int, str, int | None, int]]:
    """``(step, rank, kind, stage, microbatch)`` of each rank's first action of each kind, stage and module in
    ``actions``: one-time costs (lazy initialisation, the allocator's first growth) land there, whatever
    the step (a tower first run after the warm-up steps, e.g. a rare modality)."""
    seen: set[tuple[int, str, int | None, str]] = set()
    first: set[tuple[int, int, str, int | None, int]] = set()
    for a in sorted(actions, key=lambda a: (a.step, a.start_s)):
        for m, n in a.tokens.items():
            key = (a.rank, a.kind, a.stage, m)
            if n > 0 and key not in seen:
                seen.add(key)
                first.add((a.step, a.rank, a.kind, a.stage, a.microbatch))
    return first


def _fit_actions(
    actions: Sequence[ActionRecord], first_calls: set[tuple[int, int, str, int | None, int]] | None = None
) -> dict[str, TokenCost]:
    groups: dict[tuple[str, int | None], list[ActionRecord]] = defaultdict(list)
    dropped: dict[tuple[str, int | None], list[ActionRecord]] = defaultdict(list)
    for r in actions:
        first = first_calls and (r.step, r.rank, r.kind, r.stage, r.microbatch) in first_calls
        (dropped if first else groups)[(r.kind, r.stage)].append(r)
    for key, recs in dropped.items():  # a module seen only in first calls: fit those rather than nothing
        kept = {m for r in groups.get(key, []) for m, n in r.tokens.items() if n > 0}
        groups[key] += [r for r in recs if any(n > 0 and m not in kept for m, n in r.tokens.items())]
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
        for j, m in enumerate(modules):  # terms the records cannot tell apart are left out (set to 0)
            distinct = {(r.tokens.get(m, 0), r.tokens_sq.get(m, 0)) for r in recs if r.tokens.get(m, 0) > 0}
            if len(distinct) < 3:  # two sizes fix a line, not its curvature
                for row in rows:
                    row[3 * j + 2] = 0.0
            sizes = [n for n, _ in distinct]
            if len(distinct) < 2 or max(sizes) < BASE_SPREAD * min(sizes):  # one size fixes a proportion;
                for row in rows:  # sizes this close fit a fixed cost and a per-token cost alike
                    row[3 * j] = 0.0
        x = nonnegative_lstsq(rows, [r.seconds for r in recs])
        for i, m in enumerate(modules):
            out[cost_key(kind, stage, m)] = TokenCost(*x[3 * i : 3 * i + 3])
    return out


def fit_cost_model(records: RunRecords, *, skip_steps: int = 0, drop_first_calls: bool = True) -> CostModel:
    """A :class:`CostModel` fitted from a run's records.

    Args:
        records: from :func:`omni_pipeline.records.read_records`.
        skip_steps: ignore the first ``skip_steps`` recorded steps (warm-up: allocator, caches).
        drop_first_calls: also leave out each rank's first action of each kind, stage and module in the
            whole run (one-time costs of a tower first run late, e.g. the rare modality of a mixture; one
            that fell in the skipped steps is gone already), unless a module has no other record left.

    Returns:
        a model with ``coefficients`` (use :meth:`CostModel.for_step` for a step's durations),
        ``p2p_latency_s`` / ``p2p_bandwidth_Bps``, ``dispatch_s``, ``step_overhead_s``,
        ``llm_activation_bytes`` (mean activation message), and ``llm_forward_s`` / ``llm_backward_s`` per
        stage set to the measured means (so the model alone times an average step).

    Raises:
        ValueError: no action records (after skipping), or LLM records of some stage missing.
    """
    ids = records.step_ids
    first_calls = _first_calls(records.actions) if drop_first_calls else None
    if skip_steps:
        records = records.from_step(ids[skip_steps] if skip_steps < len(ids) else math.inf)
    if not records.actions:
        raise ValueError(
            f"fit_cost_model: no action records to fit (steps recorded: {len(ids)}, skipped {skip_steps})"
        )
    coefficients = _fit_actions(records.actions, first_calls)
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


def fit_run(run: str | Path, *, skip_steps: int | None = None) -> tuple[RunRecords, CostModel, int]:
    """A run's records, the cost model fitted from them (:func:`fit_cost_model`, the first
    ``skip_steps`` recorded steps dropped as warm-up; default: the first when there are more) and the
    number of pipeline stages it fitted.

    Raises:
        OSError: no records file in ``run``. ValueError: malformed records (``RecordError``) or too few
            to fit.
    """
    records = read_records(run)
    if skip_steps is None:
        skip_steps = 1 if len(records.step_ids) > 1 else 0
    fitted = fit_cost_model(records, skip_steps=skip_steps)
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


@dataclass(frozen=True)
class LayerCostModel:
    """LLM action costs independent of the stage split: what a stage of any split costs.

    A stage holding ``n`` decoder blocks, first and/or last, costs per action of kind ``k`` (``"F"``,
    ``"B"``) ``(n + [first] * embedding_share) * block[k] + [last] * head[k]`` in base and per-token
    seconds, and ``n * block[k]`` in the quadratic (attention) term (the embedding and the head attend to
    nothing): :meth:`stage_cost`.

    Attributes:
        block: ``{kind: TokenCost}`` of one decoder block (identical blocks assumed).
        head: ``{kind: TokenCost}`` of the final norm + LM head + loss (``per_token_sq_s`` 0).
        embedding_share: the token embedding's cost as a share of one block's (a row gather that one
            split cannot tell apart from the layers; given, e.g. modelled FLOPs
            :func:`~omni_pipeline.split.layer_costs`; 0 ignores it).
        mean_tokens, mean_tokens_sq: the fitted records' mean LLM tokens and quadratic-term tokens per
            action (:meth:`stage_mean_s` times an average microbatch with them).
    """

    block: Mapping[str, TokenCost]
    head: Mapping[str, TokenCost]
    embedding_share: float = 0.0
    mean_tokens: float = 0.0
    mean_tokens_sq: float = 0.0

    def stage_cost(self, kind: str, layers: int, *, first: bool, last: bool) -> TokenCost:
        """The :class:`TokenCost` of an LLM action of ``kind`` on a stage of ``layers`` blocks."""
        b, h = self.block[kind], self.head[kind]
        n = layers + (self.embedding_share if first else 0.0)
        return TokenCost(
            n * b.base_s + (h.base_s if last else 0.0),
            n * b.per_token_s + (h.per_token_s if last else 0.0),
            layers * b.per_token_sq_s,
        )

    def coefficients(self, split: Sequence[range | int]) -> dict[str, TokenCost]:
        """``{cost_key(kind, stage, "llm"): TokenCost}`` for every stage of ``split`` (layers or counts)."""
        counts = [c if isinstance(c, int) else len(c) for c in split]
        return {
            cost_key(kind, s, "llm"): self.stage_cost(kind, n, first=s == 0, last=s == len(counts) - 1)
            for kind in ("F", "B")
            for s, n in enumerate(counts)
        }

    def stage_mean_s(self, kind: str, split: Sequence[range | int]) -> list[float]:
        """Per stage of ``split``, the seconds of an action of ``kind`` at the fitted mean token counts."""
        counts = [c if isinstance(c, int) else len(c) for c in split]
        return [
            self.stage_cost(kind, n, first=s == 0, last=s == len(counts) - 1).seconds(
                self.mean_tokens, self.mean_tokens_sq
            )
            for s, n in enumerate(counts)
        ]


def fit_layer_model(
    records: RunRecords,
    split: Sequence[range | int],
    *,
    skip_steps: int = 0,
    embedding_share: float = 0.0,
) -> LayerCostModel:
    """A :class:`LayerCostModel` fitted jointly from the LLM action records of every stage of a run whose
    layers were split as ``split``.

    Per kind (``F``, ``B``), one non-negative least squares (:func:`nonnegative_lstsq`) over every LLM
    record ``r`` on stage ``s`` of ``n_s`` blocks: ``seconds = nf * (b0 + b1 * T) + l * (h0 + h1 * T) +
    n_s * b2 * T2`` with ``nf = n_s + [s == 0] * embedding_share``, ``l = [s == last]``, ``T`` / ``T2``
    the record's LLM tokens / quadratic-term tokens. The block's terms ``(b0, b1, b2)`` and the head's
    ``(h0, h1)`` are told apart by the stages' different layer counts and head: with one stage they are
    not (the least-norm solution is returned; re-staging it onto another split is then meaningless,
    :func:`restage_cost_model` refuses).

    Args:
        records: the run's (:func:`~omni_pipeline.records.read_records`).
        split: the layers (or layer counts) of each of the run's LLM stages.
        skip_steps: the first recorded steps left out (warm-up).
        embedding_share: see :class:`LayerCostModel`.

    Raises:
        ValueError: a recorded LLM stage outside ``split``, a stage of ``split`` or a kind without
            records, a stage of no layers, or a negative ``embedding_share``.
    """
    counts = [c if isinstance(c, int) else len(c) for c in split]
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"fit_layer_model: every stage needs >= 1 layer, split {counts}")
    if not embedding_share >= 0:
        raise ValueError(f"fit_layer_model: embedding_share must be >= 0, got {embedding_share!r}")
    ids = records.step_ids
    first = ids[skip_steps] if skip_steps < len(ids) else math.inf
    llm = [r for r in records.actions if r.stage is not None and r.step >= first]
    bad = sorted({r.stage for r in llm if not 0 <= r.stage < len(counts)})
    if bad:
        raise ValueError(
            f"fit_layer_model: records of LLM stages {bad}, the split has {len(counts)} stages {counts}; "
            "are the records another layout's?"
        )
    missing = sorted(set(range(len(counts))) - {r.stage for r in llm})
    if missing:
        raise ValueError(f"fit_layer_model: no LLM records of stages {missing} (split {counts})")
    block: dict[str, TokenCost] = {}
    head: dict[str, TokenCost] = {}
    last = len(counts) - 1
    for kind in ("F", "B"):
        recs = [r for r in llm if r.kind == kind]
        if not recs:
            raise ValueError(f"fit_layer_model: no LLM {kind} records to fit")
        rows = []
        for r in recs:
            n = counts[r.stage]
            nf = n + (embedding_share if r.stage == 0 else 0.0)
            lst = 1.0 if r.stage == last else 0.0
            t, t2 = float(r.tokens.get("llm", 0)), float(r.tokens_sq.get("llm", 0))
            rows.append([nf, lst, nf * t, lst * t, n * t2])
        x = nonnegative_lstsq(rows, [r.seconds for r in recs])
        block[kind] = TokenCost(x[0], x[2], x[4])
        head[kind] = TokenCost(x[1], x[3], 0.0)
    return LayerCostModel(
        block,
        head,
        embedding_share,
        mean_tokens=sum(r.tokens.get("llm", 0) for r in llm) / len(llm),
        mean_tokens_sq=sum(r.tokens_sq.get("llm", 0) for r in llm) / len(llm),
    )


def restage_cost_model(
    fitted: CostModel,
    layers: LayerCostModel,
    from_split: Sequence[range | int],
    to_split: Sequence[range | int],
    *,
    from_rank_params: float = 1.0,
    to_rank_params: float = 1.0,
) -> CostModel:
    """``fitted`` (:func:`fit_cost_model` of a run split as ``from_split``) for a pipeline split as
    ``to_split`` (other stage count or layers per stage), same models on the same machine.

    * LLM F/B: ``layers.coefficients(to_split)`` (the joint per-block fit, :func:`fit_layer_model`)
      replaces the per-stage coefficients; ``llm_forward_s`` / ``llm_backward_s`` become its per-stage
      seconds at the fitted mean tokens.
    * Encoder coefficients, P2P latency and bandwidth, dispatch gap, activation size: carried over (the
      towers, the transport and the per-action Python work do not depend on the split).
    * Step overhead (time outside the pipeline: gradient reduction and clipping, optimizer, data not
      overlapped): scaled by ``to_rank_params / from_rank_params``, the largest parameter count one rank
      holds in each layout (the optimizer's elementwise work and the gradient norm grow with it, and the
      slowest rank gates the step).

    Raises:
        ValueError: ``from_split`` of one stage (the block and the head were not told apart), a split
            with a stage of no layers, or a parameter count <= 0.
    """
    src = [c if isinstance(c, int) else len(c) for c in from_split]
    dst = [c if isinstance(c, int) else len(c) for c in to_split]
    if len(src) < 2 and src != dst:
        raise ValueError(
            f"restage_cost_model: fitted on {len(src)} LLM stage, whose block and head costs cannot be told "
            f"apart; fit on a run of >= 2 stages to time the split {dst}"
        )
    if any(c < 1 for c in src + dst):
        raise ValueError(f"restage_cost_model: every stage needs >= 1 layer, got {src} -> {dst}")
    if not (from_rank_params > 0 and to_rank_params > 0):
        raise ValueError(
            f"restage_cost_model: rank parameter counts must be > 0, got {from_rank_params!r} -> {to_rank_params!r}"
        )
    others = {k: c for k, c in fitted.coefficients.items() if not k.endswith(":llm")}
    return dataclasses.replace(
        fitted,
        coefficients={**others, **layers.coefficients(dst)},
        llm_forward_s=layers.stage_mean_s("F", dst),
        llm_backward_s=layers.stage_mean_s("B", dst),
        step_overhead_s=fitted.step_overhead_s * to_rank_params / from_rank_params,
    )


@dataclass(frozen=True)
class ProcessCpu:
    """CPU seconds per step that each process spends outside its recorded actions (:func:`fit_process_cpu`).

    Measured per process and carried to another layout as it is (per process, not per parameter or
    message): on ``omni-heavy`` with 4 LLM layers on 2 cores shared with other work, a process's CPU
    beside its actions was 0.052 and 0.046 s per step at pp=2 on ranks of 3 and 1 layers (``cpu_s``
    less the recorded actions), and its CPU outside the executor's step 0.021-0.029 s per rank at pp=2
    and 0.019-0.030 s at pp=4 (1 layer each, 32-64 messages per rank), rank 0 the highest (it gathers
    every rank's records).

    Attributes:
        background_s: inside the executor's step, beside the recorded actions and their dispatch gaps (the
            gradient reduction, the transport's and the loader's threads), seconds >= 0.
        outside_s: outside the executor's step (data, clipping, optimizer, metrics, records), seconds >= 0.
        skipped_steps: steps past the warm-up left out of the fit because a checkpoint save was in
            flight during them (:attr:`omni_pipeline.records.StepRecord.checkpoint_save`), >= 0.

    Raises:
        ValueError: a negative or non-finite value.
    """

    background_s: float = 0.0
    outside_s: float = 0.0
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        both = (self.background_s, self.outside_s)
        if not all(math.isfinite(x) and x >= 0 for x in both):
            raise ValueError(f"ProcessCpu: seconds must be finite and >= 0, got {both}")
        if (
            isinstance(self.skipped_steps, bool)
            or not isinstance(self.skipped_steps, int)
            or self.skipped_steps < 0
        ):
            raise ValueError(f"ProcessCpu: skipped_steps must be an int >= 0, got {self.skipped_steps!r}")


def fit_process_cpu(records: RunRecords, *, skip_steps: int = 0) -> ProcessCpu | None:
    """Each process's CPU seconds per step outside its recorded actions, from a run's step records.

    Per recorded (step, rank) past the first ``skip_steps`` steps: ``background = pipeline_cpu_s - sum of
    the rank's action seconds - its dispatch gaps`` (the gaps between consecutive actions not spent
    waiting on a receive, as :func:`fit_cost_model`'s ``dispatch_s``) and ``outside = cpu_s -
    pipeline_cpu_s``; each the mean over them, clamped at 0. The actions' wall seconds stand for their CPU
    seconds, which holds when the fitted run had a core per process: fit on such a run (on a host shared
    with other work the actions' wall seconds exceed their CPU and ``background_s`` comes out low or 0).

    Checkpoint steps are skipped: a checkpoint save (the trainer's synchronous one, or an async save's
    staging and writing on its own thread, which ``time.process_time`` counts) lands in the ``cpu_s`` of
    the steps its run overlaps, and in their ``pipeline_cpu_s`` while it overlaps the executor's step, so
    both means would come out high. Every step with a record marked
    :attr:`~omni_pipeline.records.StepRecord.checkpoint_save` is left out on every rank (the save is
    collective: one rank's staging holds the others in its collectives); how many:
    :attr:`ProcessCpu.skipped_steps`. Records written before the mark (``checkpoint_save`` ``None``) count
    as unmarked: for such a run fit on steps without checkpoints (``skip_steps``, or a run whose
    ``checkpoint.every`` is past its fitted steps).

    Returns:
        the fit, or ``None`` when no unmarked step record past the skipped steps carries both ``cpu_s`` and
        ``pipeline_cpu_s`` (records written before they were recorded, or every such step saving).
    """
    ids = records.step_ids
    first = ids[skip_steps] if skip_steps < len(ids) else math.inf
    saving = {r.step for r in records.steps if r.step >= first and r.checkpoint_save}
    steps = [
        r
        for r in records.steps
        if r.step >= first and r.step not in saving and r.cpu_s is not None and r.pipeline_cpu_s is not None
    ]
    if not steps:
        return None
    by_rank: dict[tuple[int, int], list[ActionRecord]] = defaultdict(list)
    for a in records.actions:
        if a.step >= first:
            by_rank[(a.step, a.rank)].append(a)
    background, outside = [], []
    for st in steps:
        recs = sorted(by_rank.get((st.step, st.rank), []), key=lambda a: a.start_s)
        gaps = sum(max(0.0, b.start_s - a.end_s - b.wait_s) for a, b in itertools.pairwise(recs))
        background.append(st.pipeline_cpu_s - sum(a.seconds for a in recs) - gaps)
        outside.append(st.cpu_s - st.pipeline_cpu_s)
    return ProcessCpu(
        max(0.0, sum(background) / len(background)),
        max(0.0, sum(outside) / len(outside)),
        skipped_steps=len(saving),
    )


def host_step_s(
    schedule: Schedule,
    flow: DataFlow | None,
    costs: CostModel,
    *,
    processes: int,
    cores: float,
    process_cpu: ProcessCpu | None = None,
) -> float:
    """A step's wall seconds when ``processes`` ranks share ``cores`` cores of one host (CPU runs).

    The simulator (:func:`~omni_pipeline.simulator.simulate`) gives every rank a processor of its own.
    Here the step is simulated again under processor sharing (the kernel's fair scheduler in its
    simplest form): an action is CPU work of ``costs.duration``; after each action but a rank's last, the
    rank does ``costs.dispatch_s`` of CPU work (Python work posting the next action) while it may still wait
    for the next action's inputs, as the simulator overlaps the gap with the wait; while ``n`` of the
    pipeline's ranks compute (an action or a dispatch gap), each progresses at
    ``min(1, c / n)`` seconds of work per second, ``c = cores * ranks / processes`` (the other DP
    replicas' and CP ranks' processes on the host take their share of the cores); transfers take wall
    time and no core. The time outside the pipeline (``costs.step_overhead_s``: optimizer, gradient
    collectives, metrics) runs on every process at once, so it is stretched by ``max(1, processes /
    cores)``. With as many cores as processes (and no ``process_cpu``) this is the simulator's own step.

    With ``process_cpu`` (:func:`fit_process_cpu`), each process's CPU work outside its recorded actions
    competes too: ``process_cpu.background_s`` of every pipeline rank is one more runnable job of that
    rank from the step's start until done (the scheduler's fair share: it slows the actions while it
    runs, and the pipeline's end waits for it); of the time outside the pipeline only its CPU,
    ``process_cpu.outside_s``, is stretched, the rest (waits in collectives) is not:
    ``max(0, step_overhead_s - outside_s) + outside_s * max(1, processes / cores)``.

    Args:
        schedule, flow: as for :func:`~omni_pipeline.simulator.simulate`.
        costs: the step's cost model (e.g. :func:`~omni_pipeline.step_costs.calibrated_step_costs`).
        processes: ranks on the host (the run's world size on one host); cores: cores they share (a
            machine parameter, e.g. ``os.cpu_count()``; never fitted).
        process_cpu: each process's CPU seconds per step outside its actions (see above); ``None``: none
            beyond the time outside the pipeline, all of which is then CPU.

    Returns:
        the step's wall seconds.

    Raises:
        ValueError: ``processes`` smaller than the pipeline's ranks, or ``cores <= 0``.
        Deadlock: the programs cannot run.
    """
    programs = flow.programs(schedule) if flow is not None else schedule.programs()
    if processes < len(programs) or not cores > 0:
        raise ValueError(
            f"host_step_s: need processes >= the pipeline's {len(programs)} ranks and cores > 0, got "
            f"{processes} and {cores}"
        )
    share = cores * len(programs) / processes  # cores this replica's pipeline ranks get
    consumer = flow.encoder_consumer if flow is not None else {}
    deps = llm_encoder_deps(schedule.num_stages, consumer)
    execution_order(programs, deps)  # a Deadlock names the blocked ranks before the loop below starts
    rank_of = {a: r for r, prog in programs.items() for a in prog}
    pos = dict.fromkeys(programs, 0)
    free = dict.fromkeys(programs, 0.0)  # when the rank may start its next action (its dispatch done)
    end: dict[Action, float] = {}
    running: dict[int, list] = {}  # rank -> [action, or None for a dispatch gap; CPU seconds left]
    # rank -> CPU seconds left of its process's work beside the actions (runnable from the step's start)
    bg_s = process_cpu.background_s if process_cpu is not None else 0.0
    background = dict.fromkeys(programs, bg_s) if bg_s > 0 else {}
    total, t = sum(len(p) for p in programs.values()), 0.0
    while len(end) < total or background:
        next_ready = math.inf
        for r, prog in programs.items():
            if r in running or pos[r] >= len(prog):
                continue
            a, ready = prog[pos[r]], free[r]
            ds = deps(a)
            if any(d not in end for d in ds):
                continue
            for d in ds:
                arrive = end[d]
                if rank_of[d] != r:
                    arrive += costs.transfer_s(costs.message_bytes(d, a))
                ready = max(ready, arrive)
            if ready <= t:
                running[r] = [a, costs.duration(a)]
            else:
                next_ready = min(next_ready, ready)
        if not running and not background:
            t = next_ready
            continue
        rate = min(1.0, share / (len(running) + len(background)))
        lefts = [left for _, left in running.values()] + list(background.values())
        dt = min(min(lefts) / rate, next_ready - t)
        t += dt
        for r in list(background):
            background[r] -= dt * rate
            if background[r] <= 1e-12:
                del background[r]
        for r in list(running):
            running[r][1] -= dt * rate
            if running[r][1] > 1e-12:
                continue
            a = running.pop(r)[0]
            free[r] = t
            if a is None:  # the dispatch gap done: the rank may start its next action
                continue
            end[a] = t
            pos[r] += 1
            if pos[r] < len(programs[r]) and costs.dispatch_s > 0:
                running[r] = [None, costs.dispatch_s]
    stretch = max(1.0, processes / cores)
    if process_cpu is None:
        return t + costs.step_overhead_s * stretch
    return t + max(0.0, costs.step_overhead_s - process_cpu.outside_s) + process_cpu.outside_s * stretch
