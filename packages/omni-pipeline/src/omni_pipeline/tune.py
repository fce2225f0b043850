"""A parallelism tuner: every layout of ``gpus`` GPUs for a workload, predicted by
:func:`omni_pipeline.step_model.predict_step`, plans that run out of memory dropped, the rest ranked by
predicted tokens/s (the paper tunes parallelism per workload, MegaScale-Omni §5 / Figure 18).

Search space (:func:`candidate_layouts`): ``pp`` (a divisor of ``gpus`` up to the LLM's layers, with at
least ``pp`` microbatches per replica at the fixed global batch), virtual stages per rank (1, 2, 4 up to
``max_virtual``, at ``pp > 1``: interleaved 1F1B, Narayanan et al. 2021 §2.2, where ``pp * v`` stages
fit the layers and the microbatches are a multiple of its rounds ``max(1, m // pp)``), ``tp`` (1 ..
``gpus_per_node``, dividing the heads; Megatron SP on whenever ``tp > 1``: the same ring time as plain TP
and less memory), CP (ring or all-gather) or Ulysses (1 .. 8), ``dp`` = what is left, ``ep`` (an MoE LLM
only: powers of two dividing ``dp`` and the experts, up to ``max_ep``), ``llm_zero`` 0-3,
``encoder_zero`` 0 / 2 / 3 (with encoders; their state, gradient reduction and optimizer step sharded
over every rank), recompute off / whole blocks / one residual branch (``attention`` or ``mlp``:
the trainer's ``train.recompute_modules``), and a placement (``uniform_on_demand`` in the search;
``isolated`` and ``planned`` for the best layouts), and the reordering group across DP for the ``top``
plans (below). The global batch (packs per step, all replicas) is fixed, so each replica runs
``global_batch / dp`` microbatches. Fixed, not searched: ``llm_reshard = "auto"`` (ZeRO-3 re-gathers
every block per microbatch at ``pp = 1``, holds the gathered stage through the step at ``pp > 1``; the
step model times and sizes the policy it resolves to, and ``omni_train.simulate.workload_config`` writes
it explicitly), offload. ZeRO all-gathers are timed at bf16 bytes and reductions at float32
(:mod:`omni_pipeline.step_model`).

Reordering group (``max_reorder_group > 1``; ``omni-train tune`` searches up to 16): the layout search
predicts one DP replica and takes every replica to be like it (:func:`~omni_pipeline.step_model.predict_step`),
which prices the reordering all-to-all but not the imbalance between replicas that reordering across DP
removes, so there a larger group could only lose. After it, each of the ``top`` plans is priced over
``min(dp, max_replicas)`` replicas drawing their own packs, for groups of 1, 2, 4, ... up to
``max_reorder_group`` dividing ``dp`` (and accepted by ``check``): each group reorders its replicas'
encoder samples per encoder microbatch as the trainer does (its own partition function; LLM tokens stay
home), the step is the slowest replica's plus the all-to-all (:mod:`omni_pipeline.replica_balance`, which says what it assumes). Each plan becomes its
fastest group (its ``tokens_per_s``, ``mfu`` and ``step_time_s`` from that pricing, ``layout.reorder_group``
set; ``TuneResult.groups`` holds the whole curve; the memory verdict is the replica with the largest
peak's, and a layout that runs out of memory at every group gives way to the next) and the plans are
ranked again. Those figures are below
the one-replica prediction even at ``g = 1`` (the slowest of several replicas, not the first one's step),
so only the ``top`` plans are compared on them; a layout ranked below ``top`` by the one-replica
prediction is not priced. A bias of that ranking, not corrected: a plan with ``dp < max_replicas`` is
priced over fewer replicas' draws, the slowest of fewer draws, which favours it when the plans are ranked
again against those priced over ``max_replicas`` draws (the cap is the bias: a plan with
``dp > max_replicas`` really waits for the slowest of all its ``dp`` replicas, which ``max_replicas``
draws understate). With ``max_reorder_group = 1`` (the default of :func:`tune`) the group stays 1 and the
plans one-replica predictions.

Memory: a plan fits when every pipeline rank's step peak (:func:`~omni_pipeline.step_model.rank_memory`'s
``total``: state + ZeRO-2/3's in-step whole gradients and ZeRO-3's gathered parameters + activations) is
within ``Device.memory_bytes``.

Cost: pipeline simulations are shared by layouts differing only in their ZeRO stages
(``predict_step(cache=...)``); a layout's memory is first bounded without simulating (state plus the
schedule's in-flight LLM activations, a lower bound of the simulated peak), and OOM layouts are never
simulated. Virtual-stage layouts are simulated after every 1F1B one, best bound first, and only while
their step-time lower bound (:func:`~omni_pipeline.step_model.step_time_lower_bound`: the 1F1B sibling's
busy time over ``pp`` ranks plus their per-step collectives) beats the ``max(top, refine)``-th best plan
so far; one whose 1F1B sibling runs out of memory is dropped (interleaving holds more activations, never
fewer). The ``planned`` placement (a search of its own) is run only for the ``refine`` best layouts of
the cheap placements. ``check`` (e.g. the trainer's preflight) refuses layouts the trainer cannot run
(asked once per shape; a shape's 1F1B, encoder-ZeRO-0 form first: when that is refused, so are its
variants), and ``exact_state`` (e.g. ``omni-train memory``'s build) replaces the analytic state of the
best plans, which are then dropped if that makes them OOM.

Ranking (:func:`rank_plans`): fastest predicted tokens/s first. Plans predicting exactly the same
tokens/s (layouts differing only in ZeRO stages the step model prices the same, e.g. ZeRO-2 and ZeRO-3
gathering the stage once per step at ``pp > 1``) are listed simpler first: lower ``llm_zero``, then lower
``encoder_zero`` (fewer collectives, a simpler resume), then fewer virtual stages (a plain 1F1B
schedule), then in search order; so a search always ranks the same way.

Time: ``omni-train tune --workload paper-vlm --gpus 512`` searches 5,832 layouts in about 30-50 s on a
shared 2-core CPU (apps/omni-train/README.md, "Planning at scale"); the reordering group search adds
``R`` pipeline simulations per group size and plan shape (``TuneResult.reorder_s``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from omni_pipeline.cost import Network
from omni_pipeline.replica_balance import MAX_REPLICAS, GroupPricing, group_sizes, price_group
from omni_pipeline.step_model import (
    Device,
    Layout,
    StepPrediction,
    predict_step,
    rank_memory,
    step_time_lower_bound,
)
from omni_pipeline.workload import Workload

__all__ = ["TuneResult", "candidate_layouts", "rank_plans", "tune"]

CHEAP_PLACEMENTS = ("uniform_on_demand",)
REFINE_PLACEMENTS = ("isolated", "planned")


@dataclass
class TuneResult:
    """Outcome of :func:`tune`.

    Attributes:
        plans: the best feasible plans, fastest first (ties simpler first: :func:`rank_plans`), one per
            layout (its fastest placement; ``StepPrediction``, exact state where given).
        considered: layouts enumerated (before any filter). refused: layouts ``check`` refused (a
            virtual-stage or encoder-ZeRO variant of an accepted shape is checked after its memory
            bound, so one out of memory counts there).
        oom: layouts dropped for memory. simulated: pipeline simulations run. wall_s: seconds taken.
        global_batch: packs per step over all replicas.
        bounded: virtual-stage layouts not simulated: their step-time lower bound
            (:func:`~omni_pipeline.step_model.step_time_lower_bound`) could not beat the best plans.
        groups: with ``max_reorder_group > 1``, per plan (in ``plans`` order) the reordering group sizes
            priced over several DP replicas (:func:`omni_pipeline.replica_balance.price_group`), smallest
            first (those ``check`` accepts); the plan is its fastest that fits. Empty otherwise.
        reorder_s: seconds of that group search (part of ``wall_s``).
    """

    plans: list[StepPrediction]
    considered: int = 0
    refused: int = 0
    oom: int = 0
    simulated: int = 0
    wall_s: float = 0.0
    global_batch: int = 0
    bounded: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    groups: list[list[GroupPricing]] = field(default_factory=list)
    reorder_s: float = 0.0


def _sibling_key(layout: Layout) -> Layout:
    """A layout's 1F1B sibling shape: what :func:`~omni_pipeline.step_model.step_time_lower_bound` may
    bound from (virtual stages and ZeRO stages aside)."""
    return dataclasses.replace(layout, virtual_stages=1, llm_zero=0, encoder_zero=0)


def rank_plans(plans: Iterable[StepPrediction]) -> list[StepPrediction]:
    """``plans`` fastest first (predicted tokens/s); exactly equal predictions simpler first: lower
    ``layout.llm_zero``, then lower ``layout.encoder_zero``, then fewer ``layout.virtual_stages``, then a
    smaller ``layout.reorder_group``; plans
    equal in all of these keep their order in ``plans`` (a stable sort). :func:`tune` ranks with it.
    """
    return sorted(
        plans,
        key=lambda p: (
            -p.tokens_per_s, p.layout.llm_zero, p.layout.encoder_zero, p.layout.virtual_stages,
            p.layout.reorder_group,
        ),
    )  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    workload: Workload,
    gpus: int,
    global_batch: int,
    *,
    gpus_per_node: int = 8,
    max_sp: int = 8,
    max_microbatches: int = 128,
    placements: Sequence[str] = CHEAP_PLACEMENTS,
    max_ep: int = 64,
    max_virtual: int = 4,
) -> Iterator[tuple[Layout, int]]:
    """Every ``(layout, microbatches per replica)`` of the search space (module docstring).

    Args:
        max_virtual: the most virtual stages per pipeline rank tried (powers of two; 1 turns them off).

    Raises:
        ValueError: ``gpus`` or ``global_batch`` < 1, or a workload without an LLM shape.
    """
    if gpus < 1 or global_batch < 1:
        raise ValueError(f"candidate_layouts: gpus and global_batch must be >= 1, got {gpus}, {global_batch}")
    llm = workload.shapes["llm"]
    heads, kv = llm.n_heads, llm.n_kv_heads or llm.n_heads
    tps = [t for t in (1, 2, 4, 8, 16) if t <= gpus_per_node and heads % t == 0 and kv % t == 0]
    seqs = [("cp", c, a) for c in (2, 4, 8) if c <= max_sp for a in ("allgather", "ring")]
    seqs += [("ulysses", u, "allgather") for u in (2, 4, 8) if u <= max_sp and heads % u == 0 and kv % u == 0]
    seqs = [("none", 1, "allgather"), *seqs]
    # encoder ZeRO only matters with encoders (their state sharded over every rank)
    enc_zeros = (0, 2, 3) if any(k != "llm" for k in workload.shapes) else (0,)
    for pp in (d for d in _divisors(gpus) if d <= llm.n_layers):
        for tp in tps:
            for kind, n, attn in seqs:
                mp = tp * n
                if gpus % (pp * mp):
                    continue
                dp = gpus // (pp * mp)
                if global_batch % dp or not pp <= global_batch // dp <= max_microbatches:
                    continue
                experts = workload.moe.experts if workload.moe is not None else 1
                eps = [
                    e
                    for e in (1, 2, 4, 8, 16, 32, 64, 128)
                    if e <= max_ep and dp % e == 0 and experts % e == 0
                ]
                m = global_batch // dp
                # interleaved 1F1B: pp * v stages of >= 1 layer, m a multiple of its rounds max(1, m // pp)
                virtuals = [v for v in (1, 2, 4, 8) if v == 1 or (
                    v <= max_virtual and pp > 1 and pp * v <= llm.n_layers and m % max(1, m // pp) == 0)]  # fmt: skip
                for ep, zero, v, ez in ((e, z, v, ez) for e in eps for z in (0, 1, 2, 3) for v in virtuals
                                        for ez in enc_zeros):  # fmt: skip
                    # recompute: off, whole blocks, or one residual branch (train.recompute_modules)
                    for recompute, mods in ((False, ()), (True, ()), (True, ("attention",)), (True, ("mlp",))):  # fmt: skip
                        for placement in placements:
                            yield (
                                Layout(
                                    pp=pp, dp=dp, tp=tp, sequence_parallel=tp > 1,
                                    cp=n if kind == "cp" else 1, cp_attention=attn,
                                    ulysses=n if kind == "ulysses" else 1, llm_zero=zero,
                                    recompute=recompute, recompute_modules=mods, placement=placement, ep=ep,
                                    virtual_stages=v, encoder_zero=ez,
                                ),
                                m,
                            )  # fmt: skip


def tune(
    workload: Workload,
    gpus: int,
    *,
    device: Device | None = None,
    network: Network | None = None,
    global_batch: int | None = None,
    top: int = 5,
    refine: int = 8,
    check: Callable[[Layout], str | None] | None = None,
    exact_state: Callable[[Layout, int], Mapping[int, Mapping[str, Mapping[str, float]]]] | None = None,
    vocab: int = 32000,
    max_sp: int = 8,
    max_microbatches: int = 128,
    max_virtual: int = 4,
    max_reorder_group: int = 1,
    max_replicas: int = MAX_REPLICAS,
) -> TuneResult:
    """The ``top`` fastest layouts of ``gpus`` GPUs for ``workload`` that fit in memory.

    Args:
        global_batch: packs per step, all replicas (default ``workload.microbatches * gpus // 8``: the
            workload's microbatches per replica at ``pp = 8`` without model parallelism).
        refine: how many of the best layouts (placed ``uniform_on_demand``) are also tried with the
            other placements (:data:`REFINE_PLACEMENTS`: ``isolated``, ``planned``).
        max_microbatches: layouts whose replicas would run more microbatches per step are skipped
            (their simulation grows with ``pp * microbatches``; their 1F1B bubble is already below
            ``(pp - 1) / max_microbatches``).
        max_virtual: the most virtual stages per pipeline rank searched (1, 2, 4, ...; 1: 1F1B only).
        check: ``layout -> None`` (accepted) or a one-line reason (refused); called once per layout
            shape (placement and recompute aside).
        exact_state: ``(layout, microbatches) -> {pp rank: {"llm": {kind: bytes}, "encoders": ...}}``
            for the best plans (see :func:`omni_pipeline.step_model.rank_memory`).
        max_reorder_group: the largest reordering group searched for the ``top`` plans (1, 2, 4, ...
            dividing ``dp`` and the simulated replicas; each also asked of ``check``); 1: not searched,
            the plans stay one-replica predictions with ``reorder_group = 1`` (module docstring).
        max_replicas: DP replicas simulated by that search (``min(dp, max_replicas)``).

    Returns:
        :class:`TuneResult`.

    Raises:
        ValueError: no layout fits (names how many were refused and how many ran out of memory).
    """
    t0 = time.perf_counter()
    device = device or Device()
    network = network or Network()
    gb = global_batch if global_batch is not None else max(1, workload.microbatches * gpus // 8)
    res = TuneResult([], global_batch=gb)
    cache: dict = {}
    verdicts: dict[Layout, str | None] = {}
    scored: list[StepPrediction] = []
    micro: dict[Layout, int] = {}

    def _refused(shape: Layout) -> bool:
        """Whether ``check`` refuses ``shape`` (asked once per shape); counts the refusal."""
        if shape not in verdicts:
            verdicts[shape] = check(shape) if check is not None else None
        if verdicts[shape] is None:
            return False
        res.refused += 1
        reason = verdicts[shape].split(":")[0]
        res.refusals[reason] = res.refusals.get(reason, 0) + 1
        return True

    def _predict(layout: Layout, m: int) -> StepPrediction | None:
        """Simulate ``layout`` (sharing pipelines through ``cache``); keep it when it fits."""
        before = len(cache)
        p = predict_step(
            workload, layout, device=device, network=network, microbatches=m, vocab=vocab, cache=cache
        )
        res.simulated += sum(1 for key in list(cache)[before:] if key[0] == "pipe")
        if p.oom:
            res.oom += 1
            return None
        micro[layout] = m
        scored.append(p)
        return p

    layouts = candidate_layouts(
        workload,
        gpus,
        gb,
        gpus_per_node=network.gpus_per_node,
        max_sp=max_sp,
        max_microbatches=max_microbatches,
        max_virtual=max_virtual,
    )
    bounds: dict = {}  # interleaved schedules and in-flight peaks, shared by the memory bounds
    deferred: list[tuple[Layout, int]] = []  # virtual-stage layouts: after every 1F1B one is scored
    siblings: dict[Layout, StepPrediction] = {}  # 1F1B prediction per layout shape (zero stages aside)
    for layout, m in layouts:
        res.considered += 1
        shape = dataclasses.replace(layout, recompute=False, placement="uniform_on_demand")
        # its 1F1B, encoder-ZeRO-0 shape first: refused, so is every variant (the trainer's virtual
        # stages and encoder ZeRO only add conditions); a variant itself once it fits in memory
        base = dataclasses.replace(shape, virtual_stages=1, encoder_zero=0)
        if _refused(base):
            continue
        bound = rank_memory(dataclasses.replace(workload, microbatches=m), layout, vocab=vocab, cache=bounds)
        if max(r["total"] for r in bound.values()) > device.memory_bytes:
            res.oom += 1
            continue
        if shape != base and _refused(shape):
            continue
        if layout.virtual_stages > 1:
            deferred.append((layout, m))
            continue
        p = _predict(layout, m)
        if p is not None:
            siblings.setdefault(_sibling_key(layout), p)
    # virtual stages: simulated only when their step-time lower bound (the 1F1B sibling's busy time over
    # pp ranks + their per-step collectives) can beat the k-th best plan so far
    k = max(top, refine)
    hopeful = []
    for layout, m in deferred:
        sib = siblings.get(_sibling_key(layout))
        if sib is None:  # the 1F1B sibling did not fit: interleaving holds more activations, not fewer
            res.oom += 1
            continue
        lb = step_time_lower_bound(
            workload, layout, sib, device=device, network=network, microbatches=m, vocab=vocab
        )
        hopeful.append((sib.tokens_per_s * sib.step_time_s / lb, layout, m))
    hopeful.sort(key=lambda x: -x[0])
    for i, (ub, layout, m) in enumerate(hopeful):
        best = sorted((p.tokens_per_s for p in scored), reverse=True)
        if len(best) >= k and ub < best[k - 1]:  # a tie could still rank above (simpler first)
            res.bounded += len(hopeful) - i
            break
        _predict(layout, m)
    scored[:] = rank_plans(scored)
    # the other placements for the best layouts
    for p in scored[:refine]:
        for placement in REFINE_PLACEMENTS:
            other = dataclasses.replace(p.layout, placement=placement)
            q = predict_step(
                workload, other, device=device, network=network, microbatches=micro[p.layout], vocab=vocab,
                cache=cache,
            )  # fmt: skip
            res.simulated += 1
            if not q.oom:
                micro[other] = micro[p.layout]
                scored.append(q)
    scored[:] = rank_plans(scored)
    listed: set[Layout] = set()  # one plan per layout: its fastest placement
    t_groups = 0.0
    rcache: dict = {}  # the group search's replicas, deals and pipelines, shared by the plans
    for p in scored:
        if len(res.plans) >= top:
            break
        shape = dataclasses.replace(p.layout, placement="uniform_on_demand")
        if shape in listed:
            continue
        m = micro[p.layout]
        state = exact_state(p.layout, m) if exact_state is not None else None
        if state is not None:
            p = predict_step(
                workload, p.layout, device=device, network=network, microbatches=m, vocab=vocab,
                state=state, cache=cache,
            )  # fmt: skip
            if p.oom:
                res.oom += 1
                continue
        if max_reorder_group > 1:
            t1 = time.perf_counter()
            curve = _group_curve(
                workload, p.layout, m, device, network, state, check, vocab, max_reorder_group, max_replicas,
                rcache,
            )  # fmt: skip
            t_groups += time.perf_counter() - t1
            fits = [c for c in curve if not c.prediction.oom]
            if not fits:  # a replica's draw runs out of memory at every group size
                res.oom += 1
                continue
            p = max(fits, key=lambda c: (c.tokens_per_s, -c.group)).prediction
            res.groups.append(curve)
        listed.add(shape)
        res.plans.append(p)
    if res.groups:  # ranked again on the multi-replica pricing, each plan's curve kept beside it
        order = rank_plans(res.plans)
        at = {id(q): i for i, q in enumerate(res.plans)}
        res.groups = [res.groups[at[id(q)]] for q in order]
        res.plans = order
    res.reorder_s = t_groups
    res.wall_s = time.perf_counter() - t0
    if not res.plans:
        raise ValueError(
            f"tune: no layout of {gpus} GPUs fits: {res.considered} considered, {res.refused} refused "
            f"({res.refusals}), {res.oom} out of {device.memory_bytes / 1e9:g} GB"
        )
    return res


def _group_curve(
    workload: Workload,
    layout: Layout,
    microbatches: int,
    device: Device,
    network: Network,
    state: Mapping | None,
    check: Callable[[Layout], str | None] | None,
    vocab: int,
    max_group: int,
    max_replicas: int,
    cache: dict,
) -> list[GroupPricing]:
    """``layout`` priced with reordering groups of 1, 2, 4, ... up to ``max_group`` dividing ``dp`` and
    ``min(dp, max_replicas)`` simulated replicas (:func:`omni_pipeline.replica_balance.price_group`), a
    group ``check`` refuses left out (e.g. the trainer's preflight: no reordering across DP with CP)."""
    L = dataclasses.replace(layout, reorder_group=1)
    R = min(L.dp, max_replicas)
    curve = []
    for g in (g for g in group_sizes(L.dp, R) if g <= max_group):
        if g > 1 and check is not None and check(dataclasses.replace(L, reorder_group=g)) is not None:
            continue
        curve.append(
            price_group(
                workload, L, g, device=device, network=network, microbatches=microbatches, replicas=R,
                vocab=vocab, state=state, cache=cache,
            )
        )  # fmt: skip
    return curve
