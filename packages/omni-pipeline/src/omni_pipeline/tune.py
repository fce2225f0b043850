"""A parallelism tuner: every layout of ``gpus`` GPUs for a workload, predicted by
:func:`omni_pipeline.step_model.predict_step`, plans that run out of memory dropped, the rest ranked by
predicted tokens/s (the paper tunes parallelism per workload, MegaScale-Omni §5 / Figure 18).

Search space (:func:`candidate_layouts`): ``pp`` (a divisor of ``gpus`` up to the LLM's layers, with at
least ``pp`` microbatches per replica at the fixed global batch), virtual stages per rank (1, 2, 4 up to
``max_virtual``, at ``pp > 1``: interleaved 1F1B, Narayanan et al. 2021 §2.2, where ``pp * v`` stages
fit the layers and the microbatches are a multiple of its rounds ``max(1, m // pp)``), ``tp`` (1 ..
``gpus_per_node``, dividing the heads; Megatron SP on whenever ``tp > 1``: the same ring time as plain TP
and less memory; async TP with it, ``Layout.async_tp``, for a dense LLM: the step model prices only the part
of each SP ring its projection matmuls leave exposed, never more than the plain ring, and the same memory,
so at equal everything else it is never slower and is the only form tried; where ``check`` refuses it the
layout falls back to plain SP, counted in ``TuneResult.async_fallbacks``), CP (ring or all-gather) or Ulysses (1 .. 8), ``dp`` = what is left, ``ep`` (an MoE LLM
only: powers of two dividing ``dp`` and the experts, up to ``max_ep``), ``llm_zero`` 0-3,
``encoder_zero`` 0 / 2 / 3 (with encoders; their state, gradient reduction and optimizer step sharded
over every rank), recompute off / whole blocks / one residual branch (``attention`` or ``mlp``:
the trainer's ``train.recompute_modules``), activation offload of none, the encoders' blocks or every
block family (the trainer's ``train.offload``; not with whole-block recompute, which leaves nothing to offload; an
offload layout is skipped when its twin without offload fits: the same step plus the copies, or when
its copies alone, :func:`~omni_pipeline.step_model.offload_seconds`, are slower than the best plans so
far, counted in ``bounded``), and a
placement (``uniform_on_demand`` in the search;
``isolated`` and ``planned`` for the best layouts), and the reordering group across DP for the ``top``
plans (below). The global batch (packs per step, all replicas) is fixed, so each replica runs
``global_batch / dp`` microbatches. Fixed, not searched: ``llm_reshard = "auto"`` (ZeRO-3 re-gathers
every block per microbatch at ``pp = 1``, holds the gathered stage through the step at ``pp > 1``; the
step model times and sizes the policy it resolves to, and ``omni_train.simulate.workload_config`` writes
it explicitly). ZeRO all-gathers are timed at bf16 bytes and reductions at float32
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

Stage splits (``max_splits > 0``; the trainer's ``parallel.stage_layers``): the layout search runs the
even split (:func:`~omni_pipeline.step_model.even_stage_layers`); after it, every 1F1B layout with
``pp > 1`` the check accepts, whether or not its even split fit, tries uneven splits under the
``split_placements`` (``uniform_on_demand`` and ``prepend_first_stage``: encoders in stage 0's graph, the
Alpa-style case). Candidates (:func:`split_candidates`): every split while there are at most
``max_splits`` (64: exhaustive for ``pp = 2`` up to 65 layers), else the split balancing modelled busy
seconds per rank (its layers at the even split's seconds per layer, plus the encoder seconds the
reference simulation put on it; all on rank 0 under prepend: Alpa's inter-operator pass), the fastest of
those fitting modelled memory, and the one balancing memory. Memory per rank is
:func:`~omni_pipeline.step_model.rank_memory`'s analytic bound as a line in the rank's layers (exact for a
dense LLM: two bounds of the layout give it; an MoE LLM's splits are bounded one by one), plus, when
choosing the modelled candidates, the encoder activations the reference held; a layout whose
memory-balanced split does not fit the bound is dropped. The reference is the layout's even-split
1F1B prediction (simulated now when the even split was cut by its memory bound). A split is simulated
only while a lower bound of its step beats the ``max(top, refine)``-th best plan so far (ties rank the
even split first): the same actions on the same ranks whatever the split, so its makespan is at least
the busy time over ``pp``, each rank's LLM seconds plus the first microbatch's forward and the last one's
backward on the stages before it, and under prepend rank 0's encoder seconds plus its layers
(:func:`_split_span`), plus its per-step collectives on that split and the loader's decode of the step
over ``pp`` ranks. Within the candidates the search is exact: no split it prunes can beat the plans it
keeps. Virtual-stage layouts keep the even split (their splits are not searched). The plans' splits are
``TuneResult.stage_layers``; ``isolated`` and ``planned`` (the ``refine`` step) run on the plan's split.

Ranking (:func:`rank_plans`): fastest predicted tokens/s first. Plans predicting exactly the same
tokens/s (layouts differing only in ZeRO stages the step model prices the same, e.g. ZeRO-2 and ZeRO-3
gathering the stage once per step at ``pp > 1``) are listed simpler first: lower ``llm_zero``, then lower
``encoder_zero`` (fewer collectives, a simpler resume), then fewer virtual stages (a plain 1F1B
schedule), then in search order; so a search always ranks the same way.

Time: ``omni-train tune --workload paper-vlm --gpus 512`` searches 5,832 layouts in about 30-50 s on a
shared 2-core CPU (apps/omni-train/README.md, "Planning at scale"); the reordering group search adds
``R`` pipeline simulations per group size and plan shape (``TuneResult.reorder_s``); the stage-split
search about 10 s at 512 and 4,096 GPUs (``TuneResult.split_s``: some 25,000 splits, nearly all bounded
out before their memory is even looked at, about 150 more simulations).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from omni_pipeline.cost import Network
from omni_pipeline.replica_balance import MAX_REPLICAS, GroupPricing, group_sizes, price_group
from omni_pipeline.step_model import (
    Device,
    Layout,
    StepPrediction,
    even_stage_layers,
    loader_seconds,
    offload_seconds,
    predict_step,
    rank_memory,
    step_collectives,
    step_time_lower_bound,
)
from omni_pipeline.workload import Workload

__all__ = ["RECOMPUTE_CHOICES", "TuneResult", "candidate_layouts", "rank_plans", "split_candidates", "tune"]

CHEAP_PLACEMENTS = ("uniform_on_demand",)
REFINE_PLACEMENTS = ("isolated", "planned")
# placements the uneven stage_layers search tries (prepend: the encoders in stage 0's graph, which an
# uneven split balances as Alpa's inter-operator pass does)
SPLIT_PLACEMENTS = ("uniform_on_demand", "prepend_first_stage")
MAX_SPLITS = 64  # every split of the layers is a candidate while there are at most this many
# relative slack the split search takes off its makespan lower bound (_split_span) before pruning by it:
# the bound is exact for some splits, and a float tie must not prune a split that would win
SPLIT_BOUND_SLACK = 1e-9
# recompute forms searched, by name: (Layout.recompute, Layout.recompute_modules); read-only
RECOMPUTE_CHOICES = types.MappingProxyType(
    {
        "off": (False, ()),
        "block": (True, ()),
        "attention": (True, ("attention",)),
        "mlp": (True, ("mlp",)),
    }
)


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
            (:func:`~omni_pipeline.step_model.step_time_lower_bound`) could not beat the best plans; and
            offload layouts whose copies alone could not
            (:func:`~omni_pipeline.step_model.offload_seconds`).
        groups: with ``max_reorder_group > 1``, per plan (in ``plans`` order) the reordering group sizes
            priced over several DP replicas (:func:`omni_pipeline.replica_balance.price_group`), smallest
            first (those ``check`` accepts); the plan is its fastest that fits. Empty otherwise.
        reorder_s: seconds of that group search (part of ``wall_s``).
        stage_layers: per plan (in ``plans`` order) its LLM layers per stage, ``pp * virtual_stages``
            counts (the even split, :func:`~omni_pipeline.step_model.even_stage_layers`, unless the split
            search found a faster uneven one: the trainer's ``parallel.stage_layers``).
        splits: uneven splits of 1F1B layouts considered (module docstring, "Stage splits");
            split_oom: of them, out of memory (by the analytic bound, or simulated); split_bounded: not
            simulated, their step-time lower bound could not beat the best plans; split_s: seconds of
            that search (part of ``wall_s``).
        async_fallbacks: async-TP layouts ``check`` refused whose plain-SP form it accepted: searched in
            that form (module docstring).
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
    stage_layers: list[list[int]] = field(default_factory=list)
    splits: int = 0
    split_oom: int = 0
    split_bounded: int = 0
    split_s: float = 0.0
    async_fallbacks: int = 0


def _ref_key(layout: Layout) -> Layout:
    """The pipeline a layout's even-split 1F1B prediction times (ZeRO stages and placement aside: every
    colocated placement runs the same actions): the split search's reference."""
    return dataclasses.replace(layout, llm_zero=0, encoder_zero=0, placement="uniform_on_demand")


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


def _greedy_split(
    n_layers: int, pp: int, cost: Callable[[int, int], float], fits: Callable[[int, int], bool] | None = None
) -> tuple[int, ...]:
    """Layers per rank (each >= 1) minimising the largest ``cost(rank, layers)`` (nondecreasing in
    ``layers``): every further layer goes to the rank whose cost after it is smallest, among the ranks
    where ``fits(rank, layers + 1)`` (all ranks when none does); ties to the earlier rank. Exact for the
    min-max of nondecreasing costs under such per-rank caps (the largest cost it reaches is the smallest
    level ``t`` with ``sum_r max{n: cost(r, n) <= t} >= n_layers``)."""
    n = [1] * pp
    for _ in range(n_layers - pp):
        ok = [r for r in range(pp) if fits is None or fits(r, n[r] + 1)] or list(range(pp))
        r = min(ok, key=lambda r: (cost(r, n[r] + 1), r))
        n[r] += 1
    return tuple(n)


def split_candidates(
    n_layers: int,
    memory: Sequence[tuple[float, float]],
    capacity: float,
    seconds: Sequence[tuple[float, float]],
    *,
    max_splits: int = MAX_SPLITS,
) -> list[tuple[int, ...]]:
    """Candidate layer splits of an LLM over ``pp = len(memory)`` pipeline ranks under 1F1B (one stage per
    rank, each >= 1 layer, summing to ``n_layers``), the even split first (:func:`even_stage_layers`).

    Every split (``C(n_layers - 1, pp - 1)`` of them) when there are at most ``max_splits``: then a search
    over them is exhaustive (``pp = 2`` up to 65 layers at the default). Otherwise at most three more:
    the split balancing the modelled seconds (the busiest rank's ``e_r + l_r n_r`` smallest: Alpa's
    inter-operator pass, Zheng et al. OSDI 2022 §5, and DistMM-style balancing of the ranks holding
    encoder work); the one balancing them among the splits whose modelled bytes fit (``c_r + d_r n_r <=
    capacity`` on every rank: layers leave the ranks that hold more microbatches in flight or encoder
    activations); and the one balancing the modelled bytes (the fullest rank's smallest). Each is exact
    for its model (:func:`_greedy_split`); the models are linear, so a split is only a candidate: the
    caller bounds and simulates it.

    Args:
        memory: per rank ``(c_r, d_r)``: its peak bytes modelled as ``c_r + d_r * layers``.
        capacity: device bytes. seconds: per rank ``(e_r, l_r)``: busy seconds per step modelled as
            ``e_r + l_r * layers`` (``e_r``: its encoder work).
        max_splits: the most splits enumerated exhaustively.

    Raises:
        ValueError: fewer layers than ranks, or ``seconds`` not one pair per rank.
    """
    pp = len(memory)
    if pp < 1 or n_layers < pp or len(seconds) != pp:
        raise ValueError(
            f"split_candidates: {n_layers} layers over {pp} ranks ({len(seconds)} seconds pairs): need "
            ">= 1 layer and one (c, d) and (e, l) pair per rank"
        )
    even = tuple(even_stage_layers(n_layers, pp))
    if math.comb(n_layers - 1, pp - 1) <= max_splits:
        splits = [
            tuple(b - a for a, b in zip((0, *cuts), (*cuts, n_layers), strict=True))
            for cuts in itertools.combinations(range(1, n_layers), pp - 1)
        ]
        return [even, *(x for x in splits if x != even)]

    def mem(r: int, n: int) -> float:
        return memory[r][0] + memory[r][1] * n

    def sec(r: int, n: int) -> float:
        return seconds[r][0] + seconds[r][1] * n

    out = [even]
    for x in (
        _greedy_split(n_layers, pp, sec),
        _greedy_split(n_layers, pp, sec, lambda r, n: mem(r, n) <= capacity),
        _greedy_split(n_layers, pp, mem),
    ):
        if x not in out:
            out.append(x)
    return out


def _memory_lines(
    workload: Workload,
    layout: Layout,
    m: int,
    vocab: int,
    rows: Mapping[int, Mapping[str, float]],
    cache: dict,
) -> list[tuple[float, float]] | None:
    """Per pipeline rank ``(c_r, d_r)``: its :func:`~omni_pipeline.step_model.rank_memory` ``total`` (the
    analytic lower bound: state, in-step terms and the schedule's in-flight LLM activations) as
    ``c_r + d_r * layers`` under 1F1B, from ``rows`` (the even split's) and one more split moving a
    layer between neighbouring ranks (a third for the last rank of an odd ``pp``). Exact for a dense LLM;
    an MoE LLM's layers differ (the caller bounds each split exactly). ``None`` when a rank holds a
    single layer (nothing to move)."""
    n_layers = workload.shapes["llm"].n_layers
    even = even_stage_layers(n_layers, layout.pp)
    if min(even) < 2:
        return None
    wm = dataclasses.replace(workload, microbatches=m)
    slope: dict[int, float] = {}
    moves = [[(-1 if r % 2 == 0 else 1) if r < layout.pp - layout.pp % 2 else 0 for r in range(layout.pp)]]
    if layout.pp % 2:
        moves.append([0] * (layout.pp - 2) + [1, -1])
    for delta in moves:
        split = [n + d for n, d in zip(even, delta, strict=True)]
        other = rank_memory(wm, layout, vocab=vocab, stage_layers=split, cache=cache)
        for r, d in enumerate(delta):
            if d and r not in slope:
                slope[r] = (other[r]["total"] - rows[r]["total"]) / d
    return [(rows[r]["total"] - slope[r] * even[r], slope[r]) for r in range(layout.pp)]


def _split_span(
    llm_s: Sequence[float],
    encoder_s: Sequence[float],
    even: Sequence[int],
    split: Sequence[int],
    placement: str,
    microbatches: int,
) -> float:
    """A lower bound of the 1F1B makespan of a colocated placement on ``split`` from the even split's
    per-rank busy seconds (``llm_s`` LLM actions, ``encoder_s`` encoder actions, on ``even``'s layers).
    Whatever the split and placement the ranks run the same actions, each LLM action's seconds
    proportional to its stage's layers and alike for every microbatch (the step model times a stage's
    actions from the step's mean pack), at ``u`` seconds per layer and microbatch (forward and backward;
    the smallest of the ranks'). So the makespan is at least their busy time over ``pp``, and, for each
    rank ``r``, the forward of the first microbatch on the stages before it, its own LLM work and the
    backward of the last microbatch on those stages: ``u (m n_r + sum_{s<r} n_s)`` (P2P left out); with
    ``prepend_first_stage`` rank 0 also runs every encoder action."""
    m = microbatches
    u = min(t / (m * n) for t, n in zip(llm_s, even, strict=True))
    span = (sum(llm_s) + sum(encoder_s)) / len(split)
    for r, n in enumerate(split):
        span = max(span, u * (m * n + sum(split[:r])))
    if placement == "prepend_first_stage":
        span = max(span, sum(encoder_s) + u * m * split[0])
    return span


def _with_loader(step_s: float, loader_s: float, workers: int) -> float:
    """A step of ``step_s`` seconds with ``loader_s`` seconds of payload decode on its busiest rank, as
    :func:`~omni_pipeline.step_model.predict_step` adds them: inline (``workers = 0``) before the step,
    else run ahead by ``workers`` workers, the step the longer of the two."""
    return step_s + loader_s if workers == 0 else max(step_s, loader_s / workers)


def _split_per_step(
    workload: Workload,
    layout: Layout,
    split: Sequence[int],
    reference: StepPrediction,
    *,
    device: Device,
    network: Network,
    microbatches: int,
    vocab: int,
) -> float:
    """Seconds of ``layout``'s per-step collectives and optimizer on ``split``
    (:func:`~omni_pipeline.step_model.step_collectives`), the reordering all-to-all ``reference``'s."""
    _, per_step = step_collectives(
        workload, layout, network, device, tokens=1.0, vocab=vocab, stage_layers=list(split),
        microbatches=microbatches,
    )  # fmt: skip
    per_step.pop("reorder_all_to_all", None)  # needs the encoder output bytes: the reference's (the same)
    return sum(per_step.values()) + reference.time_s.get("reorder_all_to_all", 0.0)


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
    recompute: Sequence[str] = tuple(RECOMPUTE_CHOICES),
    async_tp: bool = True,
) -> Iterator[tuple[Layout, int]]:
    """Every ``(layout, microbatches per replica)`` of the search space (module docstring).

    Args:
        async_tp: ``tp > 1`` layouts of a dense LLM run async TP (``Layout.async_tp``, which dominates
            plain SP in the step model); ``False``: plain Megatron SP.
        max_virtual: the most virtual stages per pipeline rank tried (powers of two; 1 turns them off).
        recompute: the recompute forms tried, names of :data:`RECOMPUTE_CHOICES` (``off``, ``block``:
            whole blocks, ``attention`` / ``mlp``: that residual branch).

    Raises:
        ValueError: ``gpus`` or ``global_batch`` < 1, a workload without an LLM shape, or ``recompute``
            empty or naming an unknown form.
    """
    if gpus < 1 or global_batch < 1:
        raise ValueError(f"candidate_layouts: gpus and global_batch must be >= 1, got {gpus}, {global_batch}")
    if not recompute or set(recompute) - set(RECOMPUTE_CHOICES):
        raise ValueError(
            f"candidate_layouts: recompute must name some of {tuple(RECOMPUTE_CHOICES)}, got {tuple(recompute)!r}"
        )
    forms = [RECOMPUTE_CHOICES[name] for name in dict.fromkeys(recompute)]
    llm = workload.shapes["llm"]
    use_async = async_tp and workload.moe is None  # the step model prices async TP for a dense LLM only
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
                    for rc, mods in forms:
                        # offload (train.offload) of the encoders' blocks, then of every block family,
                        # unless whole blocks recompute
                        fams = tuple(f for f in ("llm", "image", "audio") if f in workload.shapes)
                        offs = (
                            ((), *dict.fromkeys(x for x in (fams[1:], fams) if x))
                            if mods or not rc
                            else ((),)
                        )
                        for off, placement in itertools.product(offs, placements):
                            yield (
                                Layout(
                                    pp=pp, dp=dp, tp=tp, sequence_parallel=tp > 1, async_tp=use_async and tp > 1,
                                    cp=n if kind == "cp" else 1, cp_attention=attn,
                                    ulysses=n if kind == "ulysses" else 1, llm_zero=zero,
                                    recompute=rc, recompute_modules=mods, placement=placement, ep=ep,
                                    virtual_stages=v, encoder_zero=ez, offload=off,
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
    max_splits: int = MAX_SPLITS,
    split_placements: Sequence[str] = SPLIT_PLACEMENTS,
    recompute: Sequence[str] = tuple(RECOMPUTE_CHOICES),
    async_tp: bool = True,
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
        exact_state: ``(layout, microbatches, stage_layers) -> {pp rank: {"llm": {kind: bytes},
            "encoders": ...}}`` for the best plans (see :func:`omni_pipeline.step_model.rank_memory`;
            ``stage_layers``: the plan's layers per stage, ``None`` for the even split).
        max_reorder_group: the largest reordering group searched for the ``top`` plans (1, 2, 4, ...
            dividing ``dp`` and the simulated replicas; each also asked of ``check``); 1: not searched,
            the plans stay one-replica predictions with ``reorder_group = 1`` (module docstring).
        max_replicas: DP replicas simulated by that search (``min(dp, max_replicas)``).
        max_splits: uneven ``stage_layers`` (module docstring, "Stage splits"): every split of a layout is
            a candidate while there are at most this many (:func:`split_candidates`), else at most three
            modelled ones; 0: the even split only.
        recompute: the recompute forms searched (:func:`candidate_layouts`; default all four).
        async_tp: ``tp > 1`` layouts of a dense LLM run async TP where ``check`` accepts it, else plain SP
            (:func:`candidate_layouts`); ``False``: plain SP only.
        split_placements: the placements the split search tries (default ``uniform_on_demand`` and
            ``prepend_first_stage``); the ``refine`` best plans then also try :data:`REFINE_PLACEMENTS`
            on their split.

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
    split_of: dict[int, tuple[int, ...] | None] = {}  # id(prediction) -> its uneven split (None: even)
    split_caches: dict[tuple[int, ...], dict] = {}  # predict_step's cache is keyed without the split
    timed: dict[tuple[Layout, int], StepPrediction] = {}  # even-split 1F1B predictions, fit or not
    pool: list[tuple[Layout, int, dict]] = []  # 1F1B layouts with pp > 1 for the split search

    def _cache(split: tuple[int, ...] | None) -> dict:
        """``predict_step``'s cache for ``split`` (one per split; the packs shared with the main one)."""
        if split is None:
            return cache
        c = split_caches.setdefault(split, {})
        for key, v in cache.items():
            if key[0] == "packs" and key not in c:
                c[key] = v
        return c

    def _split_search(pool: list[tuple[Layout, int, dict]], k: int) -> None:
        """Uneven splits of the 1F1B layouts in ``pool`` (module docstring, "Stage splits")."""
        n_layers = workload.shapes["llm"].n_layers
        best = heapq.nlargest(k, (p.tokens_per_s for p in scored))  # the k best so far (a min-heap)
        heapq.heapify(best)
        floor = best[0] if len(best) >= k else 0.0  # the k-th best only rises from here
        hopeful = []
        loads: dict[int, float] = {}
        for layout, m, rows in pool:
            lines = _memory_lines(workload, layout, m, vocab, rows, bounds)
            if lines is None:
                continue
            even = tuple(even_stage_layers(n_layers, layout.pp))
            wm = dataclasses.replace(workload, microbatches=m)
            fit: dict[tuple[int, ...], bool] = {}

            def fits(split: tuple[int, ...], layout=layout, wm=wm, fit=fit, lines=lines) -> bool:
                # the analytic bound (state, in-step terms, in-flight LLM activations) with split's layers
                if split not in fit:
                    if workload.moe is None:  # the lines are rank_memory's rows for a dense LLM
                        fit[split] = all(c + d * n <= device.memory_bytes for (c, d), n in zip(lines, split))
                    else:
                        b = rank_memory(wm, layout, vocab=vocab, stage_layers=list(split), cache=bounds)
                        fit[split] = max(r["total"] for r in b.values()) <= device.memory_bytes
                return fit[split]

            # the split balancing the bound (exact for a dense LLM): when it does not fit, none does
            if not fits(
                _greedy_split(n_layers, layout.pp, lambda r, n, lines=lines: lines[r][0] + lines[r][1] * n)
            ):
                continue
            ref = timed.get((_ref_key(layout), m))
            if ref is None:  # the even split ran out of memory before it was simulated: simulate it now
                c = _cache(None)
                before = len(c)
                ref = predict_step(
                    workload, _ref_key(layout), device=device, network=network, microbatches=m, vocab=vocab,
                    cache=c,
                )  # fmt: skip
                res.simulated += sum(1 for key in list(c)[before:] if key[0] == "pipe")
                timed[(_ref_key(layout), m)] = ref
            tl = ref.simulation.timelines
            llm_r = [
                sum(ev.end_s - ev.start_s for ev in tl[r] if not ev.is_encoder) for r in range(layout.pp)
            ]
            enc_r = [sum(ev.end_s - ev.start_s for ev in tl[r] if ev.is_encoder) for r in range(layout.pp)]
            extra = [
                max(0.0, ref.memory[r]["activations"] - rows[r]["activations"]) for r in range(layout.pp)
            ]
            job_tokens = ref.tokens_per_s * ref.step_time_s
            if m not in loads:  # the replica's payload decode: ranks share it however encoders are placed
                loads[m] = loader_seconds(
                    workload, [x for pk in workload.step_packs(0, m) for x in pk.samples]
                )
            load = loads[m] / layout.pp  # the most-loaded rank's decode is at least the mean
            collectives: dict[tuple[int, ...], float] = {}
            for placement in split_placements:
                L = dataclasses.replace(layout, placement=placement)
                if placement == "prepend_first_stage":  # every encoder action (and its activations) on rank 0
                    enc = [sum(enc_r)] + [0.0] * (layout.pp - 1)
                    ext = [sum(extra)] + [0.0] * (layout.pp - 1)
                else:
                    enc, ext = enc_r, extra
                cands = split_candidates(
                    n_layers,
                    [(c + x, d) for (c, d), x in zip(lines, ext, strict=True)],
                    device.memory_bytes,
                    [(e, t / n) for e, t, n in zip(enc, llm_r, even, strict=True)],
                    max_splits=max_splits,
                )
                for split in cands[1:]:  # the even split: the layout search's
                    res.splits += 1
                    # cheap first: the makespan part of the bound against the k-th best so far
                    span = _split_span(llm_r, enc_r, even, split, placement, m) / (1 + SPLIT_BOUND_SLACK)
                    if job_tokens / _with_loader(span, load, workload.loader_workers) <= floor:
                        res.split_bounded += 1
                        continue
                    if not fits(split):
                        res.split_oom += 1
                        continue
                    if split not in collectives:  # the same for every placement
                        collectives[split] = _split_per_step(
                            workload, layout, split, ref, device=device, network=network, microbatches=m,
                            vocab=vocab,
                        )  # fmt: skip
                    lb = _with_loader(span + collectives[split], load, workload.loader_workers)
                    hopeful.append((job_tokens / lb, L, m, split))
        hopeful.sort(key=lambda x: -x[0])
        for i, (ub, L, m, split) in enumerate(hopeful):
            # <=: a split whose bound only ties the k-th best could at best tie a plan found before it
            if len(best) >= k and ub <= best[0]:
                res.split_bounded += len(hopeful) - i
                break
            p = _predict(L, m, split)
            if p is not None:
                heapq.heappush(best, p.tokens_per_s)
                if len(best) > k:
                    heapq.heappop(best)

    def _verdict(shape: Layout) -> str | None:
        if shape not in verdicts:
            verdicts[shape] = check(shape) if check is not None else None
        return verdicts[shape]

    def _refused(shape: Layout) -> bool:
        """Whether ``check`` refuses ``shape`` (asked once per shape); counts the refusal."""
        if _verdict(shape) is None:
            return False
        res.refused += 1
        reason = verdicts[shape].split(":")[0]
        res.refusals[reason] = res.refusals.get(reason, 0) + 1
        return True

    def _plain_if_refused(layout: Layout, shape: Layout) -> tuple[Layout, Layout]:
        """``(layout, shape)``, or their plain-SP forms when ``check`` refuses ``shape`` with async TP and
        accepts it without (async TP changes no memory: the bounds stay valid)."""
        if layout.async_tp and _verdict(shape) is not None:
            plain = dataclasses.replace(shape, async_tp=False)
            if _verdict(plain) is None:
                res.async_fallbacks += 1
                return dataclasses.replace(layout, async_tp=False), plain
        return layout, shape

    def _predict(layout: Layout, m: int, split: tuple[int, ...] | None = None) -> StepPrediction | None:
        """Simulate ``layout`` on ``split`` (sharing pipelines through the split's cache); keep it when
        it fits. An even-split 1F1B prediction is kept in ``timed`` either way (the split search's
        reference)."""
        c = _cache(split)
        before = len(c)
        p = predict_step(
            workload, layout, device=device, network=network, microbatches=m, vocab=vocab, cache=c,
            stage_layers=split,
        )  # fmt: skip
        res.simulated += sum(1 for key in list(c)[before:] if key[0] == "pipe")
        if split is None and layout.virtual_stages == 1:
            timed.setdefault((_ref_key(layout), m), p)
        if p.oom:
            if split is None:
                res.oom += 1
            else:
                res.split_oom += 1
            return None
        micro[layout] = m
        split_of[id(p)] = split
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
        recompute=recompute,
        async_tp=async_tp,
    )
    bounds: dict = {}  # interleaved schedules and in-flight peaks, shared by the memory bounds
    deferred: list[tuple[Layout, int]] = []  # virtual-stage layouts: after every 1F1B one is scored
    siblings: dict[Layout, StepPrediction] = {}  # 1F1B prediction per layout shape (zero stages aside)
    for layout, m in layouts:
        res.considered += 1
        if layout.offload and dataclasses.replace(layout, offload=()) in micro:
            continue  # its twin without offload fits: the same step without the copies (dominated)
        shape = dataclasses.replace(layout, recompute=False, placement="uniform_on_demand")
        # its 1F1B, encoder-ZeRO-0 shape first: refused, so is every variant (the trainer's virtual
        # stages and encoder ZeRO only add conditions); a variant itself once it fits in memory
        base = dataclasses.replace(shape, virtual_stages=1, encoder_zero=0)
        layout, base = _plain_if_refused(layout, base)
        shape = dataclasses.replace(shape, async_tp=layout.async_tp)
        if _refused(base):
            continue
        bound = rank_memory(dataclasses.replace(workload, microbatches=m), layout, vocab=vocab, cache=bounds)
        # (offload layouts stay out of the split search: an uneven split that fits without the copies is
        # searched from their twin without offload)
        if layout.pp > 1 and layout.virtual_stages == 1 and max_splits > 0 and not layout.offload:
            layout, shape = _plain_if_refused(layout, shape)
            if _verdict(shape) is None:
                pool.append((layout, m, bound))
        if max(r["total"] for r in bound.values()) > device.memory_bytes:
            res.oom += 1
            continue
        layout, shape = _plain_if_refused(layout, shape) if shape != base else (layout, shape)
        if shape != base and _refused(shape):
            continue
        if layout.offload and scored:  # its copies alone (a lower bound of its step) against the k-th best
            kth = heapq.nlargest(max(top, refine), (q.tokens_per_s for q in scored))
            copies = offload_seconds(workload, layout, device=device, microbatches=m, vocab=vocab)
            if (
                len(kth) >= max(top, refine)
                and copies > 0
                and workload.max_seq_len * m * layout.dp / copies < kth[-1]
            ):
                res.bounded += 1
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
        if sib is None and layout.tp > 1:  # check took async TP for one of the two and not the other
            sib = siblings.get(_sibling_key(dataclasses.replace(layout, async_tp=not layout.async_tp)))
        if (
            sib is None
            and layout.offload
            and _sibling_key(dataclasses.replace(layout, offload=())) in siblings
        ):
            continue  # its 1F1B sibling was dominated by its twin without offload (above)
        if sib is None:  # the 1F1B sibling did not fit: interleaving holds more activations, not fewer
            res.oom += 1
            continue
        if sib.layout.async_tp and not layout.async_tp:  # the async form's bound is below the plain one's
            lb = step_time_lower_bound(
                workload, dataclasses.replace(layout, async_tp=True), sib, device=device, network=network,
                microbatches=m, vocab=vocab,
            )  # fmt: skip
        elif sib.layout.async_tp == layout.async_tp:
            lb = step_time_lower_bound(
                workload, layout, sib, device=device, network=network, microbatches=m, vocab=vocab
            )
        else:  # a plain sibling bounds no async layout: simulate it
            lb = 0.0
        hopeful.append((sib.tokens_per_s * sib.step_time_s / lb if lb > 0 else math.inf, layout, m))
    hopeful.sort(key=lambda x: -x[0])
    for i, (ub, layout, m) in enumerate(hopeful):
        best = sorted((p.tokens_per_s for p in scored), reverse=True)
        if len(best) >= k and ub < best[k - 1]:  # a tie could still rank above (simpler first)
            res.bounded += len(hopeful) - i
            break
        if not (layout.offload and dataclasses.replace(layout, offload=()) in micro):  # else dominated
            _predict(layout, m)
    if pool:
        t1 = time.perf_counter()
        _split_search(pool, k)
        res.split_s = time.perf_counter() - t1
    scored[:] = rank_plans(scored)
    # the other placements for the best layouts (on their split)
    for p in scored[:refine]:
        split = split_of[id(p)]
        for placement in REFINE_PLACEMENTS:
            other = dataclasses.replace(p.layout, placement=placement)
            q = predict_step(
                workload, other, device=device, network=network, microbatches=micro[p.layout], vocab=vocab,
                cache=_cache(split), stage_layers=split,
            )  # fmt: skip
            res.simulated += 1
            if not q.oom:
                micro[other] = micro[p.layout]
                split_of[id(q)] = split
                scored.append(q)
    scored[:] = rank_plans(scored)
    listed: set[Layout] = set()  # one plan per layout: its fastest placement and split
    t_groups = 0.0
    rcaches: dict = {}  # per split: the group search's replicas, deals and pipelines, shared by the plans
    splits: list[tuple[int, ...] | None] = []
    for p in scored:
        if len(res.plans) >= top:
            break
        shape = dataclasses.replace(p.layout, placement="uniform_on_demand")
        if shape in listed:
            continue
        m = micro[p.layout]
        split = split_of[id(p)]
        state = exact_state(p.layout, m, split) if exact_state is not None else None
        if state is not None:
            p = predict_step(
                workload, p.layout, device=device, network=network, microbatches=m, vocab=vocab,
                state=state, cache=_cache(split), stage_layers=split,
            )  # fmt: skip
            if p.oom:
                res.oom += 1
                continue
        if max_reorder_group > 1:
            t1 = time.perf_counter()
            rcache = rcaches.setdefault(split, {})
            if split is not None:  # the replicas' packs and deals do not depend on the split
                for key, v in rcaches.setdefault(None, {}).items():
                    if key[0] in ("replica_balance.packs", "replica_balance.dealt", "packs"):
                        rcache.setdefault(key, v)
            curve = _group_curve(
                workload, p.layout, m, device, network, state, check, vocab, max_reorder_group, max_replicas,
                rcache, split,
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
        splits.append(split)
    if res.groups:  # ranked again on the multi-replica pricing, each plan's curve kept beside it
        order = rank_plans(res.plans)
        at = {id(q): i for i, q in enumerate(res.plans)}
        res.groups = [res.groups[at[id(q)]] for q in order]
        splits = [splits[at[id(q)]] for q in order]
        res.plans = order
    n_layers = workload.shapes["llm"].n_layers
    res.stage_layers = [
        list(x) if x is not None else even_stage_layers(n_layers, q.layout.stages)
        for x, q in zip(splits, res.plans, strict=True)
    ]
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
    split: tuple[int, ...] | None = None,
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
                vocab=vocab, state=state, cache=cache, stage_layers=split,
            )
        )  # fmt: skip
    return curve
