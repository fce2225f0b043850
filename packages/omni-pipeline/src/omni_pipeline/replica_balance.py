"""Pricing a reordering group across DP replicas: the imbalance between replicas that reordering removes
against the reordering all-to-all it costs (MegaScale-Omni §5.1, Figure 20).

:func:`~omni_pipeline.step_model.predict_step` simulates one DP replica and takes every replica to be
like it, so alone it prices the reordering all-to-all of a group of ``g`` replicas
(:func:`~omni_pipeline.step_model.step_collectives`) but not what the group buys. Here:

1. ``R`` DP replicas draw their own packs: replica ``r`` takes the workload's step ``step + r`` packs
   (:meth:`~omni_pipeline.workload.Workload.step_packs`: the workload's steps stand for different
   replicas' draws of the same mixture; assumption: replicas' draws are independent). ``R`` is
   ``min(dp, max_replicas)`` (default 16): a sample of the job's ``dp`` replicas, whole groups of ``g``
   (``g`` divides ``R``).
2. Each group of ``g`` consecutive replicas reorders its encoder samples as the trainer does
   (:class:`omni_pipeline.encoder_parallel.EncoderParallel` with a reordering group,
   :class:`omni_data.GroupedReorderer`): every replica splits its packs' media into its encoder
   microbatches (:func:`omni_data.split_encoder_microbatches`, Karmarkar-Karp over encoder FLOPs, ``pp``
   slices per LLM microbatch); for each encoder microbatch ``e`` the group pools the ``g`` replicas'
   samples of ``e`` and sends each to the replica :func:`omni_data.reorder_destinations` names (the
   partition ``GroupedReorderer.plan`` computes on every rank: Karmarkar-Karp by each sample's
   ``encoder_flops``, each part to the replica already holding most of its cost), in its received order
   (:func:`deal_encoder_samples`). Samples move whole; every pack's LLM tokens stay on their replica, and
   the encoder outputs go back to it before stage 0 takes them (the restore).
3. Every replica's step is :func:`~omni_pipeline.step_model.predict_step` of its own packs with the
   encoder microbatches it was dealt (``encoder_microbatches=``) under ``layout`` with
   ``reorder_group = g`` (which adds the all-to-all over ``g`` replicas); DP is
   synchronous (the gradient reduction waits for every replica), so the step is the slowest replica's.
   Tokens/s counts each replica's own tokens: the mean over the ``R`` replicas of the tokens each
   predicts for the job, over that step.

``g = 1`` deals nothing: each replica's prediction is ``predict_step(packs=its own)``, its own split.

What it follows and what it leaves out: the trainer's deal and its unit (the samples of one encoder
microbatch of the group's replicas, at the same point of their identical schedules); the step model's
timing of each replica (its makespan reacts to where the dealt encoder work falls, not to FLOPs alone,
so equal FLOPs per replica can still leave a spread: :attr:`GroupPricing.spread`). Long-short SP inside
a replica's position is the step model's even split of its encoder work over ``tp * cp * ulysses``
ranks; the reordering all-to-all is :func:`~omni_pipeline.step_model.step_collectives`' (payloads out,
outputs back), priced on the replica's own encoder outputs.

Cost: ``R`` pipeline simulations per group size (one per replica; with the ``planned`` placement each
runs its own placement search); the packs, deals and simulations are kept in ``cache``. A ``g`` that
does not divide ``dp`` is refused (:class:`~omni_pipeline.step_model.Layout` requires it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from omni_data import Pack, SampleMeta, reorder_destinations, split_encoder_microbatches
from omni_pipeline.cost import Network
from omni_pipeline.step_model import Device, Layout, StepPrediction, predict_step
from omni_pipeline.workload import Workload

__all__ = ["GroupPricing", "deal_encoder_samples", "group_sizes", "price_group", "replica_packs"]

MAX_REPLICAS = 16


@dataclass
class GroupPricing:
    """What :func:`price_group` predicts for one reordering group size.

    Attributes:
        group: ``g``, DP replicas per reordering group.
        replicas: ``R``, DP replicas simulated (a sample of the layout's ``dp``).
        step_time_s: seconds of the step: the slowest simulated replica's (its reordering all-to-all
            included).
        tokens_per_s: LLM tokens of the whole job per second (the replicas' mean tokens x ``dp`` /
            ``step_time_s``).
        mfu: model FLOPs of the job (the replicas' mean) over ``step_time_s * gpus * peak_flops``.
        reorder_all_to_all_s: the all-to-all's seconds on the slowest replica (0 at ``g = 1``).
        replica_step_s: ``[R]`` each replica's step seconds, in replica order.
        prediction: the job's prediction for reports and configs: the slowest replica's
            :class:`~omni_pipeline.step_model.StepPrediction` (its ``layout.reorder_group = g``, time
            breakdown) with ``step_time_s``, ``tokens_per_s`` and ``mfu`` above and the memory rows of the
            replica with the largest peak (its OOM verdict).
    """

    group: int
    replicas: int
    step_time_s: float
    tokens_per_s: float
    mfu: float
    reorder_all_to_all_s: float
    replica_step_s: list[float] = field(default_factory=list)
    prediction: StepPrediction | None = field(default=None, repr=False)

    @property
    def spread(self) -> float:
        """Slowest over fastest replica step (1: balanced)."""
        return max(self.replica_step_s) / min(self.replica_step_s)


def replica_packs(workload: Workload, replicas: int, microbatches: int, *, step: int = 0) -> list[list[Pack]]:
    """``[replicas][microbatches]`` packs: replica ``r`` draws the workload's step ``step + r``.

    Raises:
        ValueError: ``replicas`` or ``microbatches`` < 1.
    """
    if replicas < 1 or microbatches < 1:
        raise ValueError(
            f"replica_packs: replicas and microbatches must be >= 1, got {replicas}, {microbatches}"
        )
    return [workload.step_packs(step + r, microbatches) for r in range(replicas)]


def deal_encoder_samples(
    packs: Sequence[Sequence[Pack]], group: int, slices: int, *, balance: bool = True
) -> list[dict[int, list[SampleMeta]]]:
    """The encoder samples each replica runs after the trainer's grouped reordering (module docstring, 2).

    Args:
        packs: ``[R][m]`` every replica's packs (the same ``m`` for all), one LLM microbatch each.
        group: ``g``, consecutive replicas per reordering group (``1``: each replica its own samples).
        slices: encoder microbatches per LLM microbatch (the pipeline size ``pp``).
        balance: each replica's split into encoder microbatches (:func:`omni_data.split_encoder_microbatches`).

    Returns:
        ``[R]`` of ``{e: [sample]}`` for every encoder microbatch ``e`` of ``m`` microbatches x ``slices``:
        the samples replica ``r`` encodes in ``e``, in the trainer's received order (by source replica,
        then that replica's order of ``e``).

    Raises:
        ValueError: ``group`` < 1 or not dividing ``R``, replicas with different pack counts, or what
            :func:`omni_data.split_encoder_microbatches` raises.
    """
    n = len(packs)
    if group < 1 or n % group:
        raise ValueError(f"deal_encoder_samples: group {group} must be >= 1 and divide the {n} replicas")
    counts = {len(p) for p in packs}
    if len(counts) != 1:
        raise ValueError(f"deal_encoder_samples: replicas hold different numbers of packs: {sorted(counts)}")
    m = counts.pop()
    own = []
    for rep in packs:
        mbs = split_encoder_microbatches(list(rep), m, slices, balance=balance)
        own.append({e: [rep[p].samples[i] for p, i in items] for e, items in mbs.items()})
    if group == 1:
        return own
    out: list[dict[int, list[SampleMeta]]] = [{} for _ in range(n)]
    for start in range(0, n, group):
        members = range(start, start + group)
        for e in own[start]:
            samples = [own[r][e] for r in members]
            dest = reorder_destinations([[s.encoder_flops for s in ss] for ss in samples])
            for d in range(group):
                out[start + d][e] = [
                    s for ss, ds in zip(samples, dest) for s, to in zip(ss, ds) if to == d
                ]  # fmt: skip
    return out


def group_sizes(dp: int, replicas: int) -> list[int]:
    """Reordering group sizes to try: 1, 2, 4, ... dividing both ``dp`` and ``replicas``."""
    out, g = [], 1
    while g <= min(dp, replicas):
        if dp % g == 0 and replicas % g == 0:
            out.append(g)
        g *= 2
    return out


def price_group(
    workload: Workload,
    layout: Layout,
    group: int,
    *,
    device: Device | None = None,
    network: Network | None = None,
    microbatches: int | None = None,
    replicas: int | None = None,
    step: int = 0,
    vocab: int = 32000,
    state: Mapping[int, Mapping[str, Mapping[str, float]]] | None = None,
    cache: dict | None = None,
    stage_layers: Sequence[int] | None = None,
) -> GroupPricing:
    """Price ``layout`` with reordering groups of ``group`` DP replicas (module docstring).

    Args:
        microbatches: packs per replica and step (default the workload's).
        replicas: DP replicas simulated (default ``min(layout.dp, MAX_REPLICAS)``); ``group`` must divide it.
        state: exact per-rank state bytes for every replica's prediction (see
            :func:`~omni_pipeline.step_model.rank_memory`).
        cache: a dict kept between calls for one workload, device, network and vocabulary: the
            replicas' packs, their deals, the pipeline simulations (shared by layouts differing
            only in ZeRO stages) and, without ``state``, each (layout, group, replica) prediction are reused.
            One cache per ``stage_layers``: its entries are not keyed by the split.
        stage_layers: layers per LLM stage (default the even split), as
            :func:`~omni_pipeline.step_model.predict_step` takes them.

    Returns:
        :class:`GroupPricing`.

    Raises:
        ValueError: ``group`` not dividing ``layout.dp`` or ``replicas``; what
            :func:`~omni_pipeline.step_model.predict_step` raises.
    """
    device = device or Device()
    network = network or Network()
    cache = {} if cache is None else cache
    m = workload.microbatches if microbatches is None else microbatches
    R = min(layout.dp, MAX_REPLICAS) if replicas is None else replicas
    if group < 1 or layout.dp % group or R % group:
        raise ValueError(
            f"price_group: reordering group {group} must divide dp {layout.dp} and the {R} simulated replicas"
        )
    L = dataclasses.replace(layout, reorder_group=group)
    own_key = ("replica_balance.packs", step, m, R)
    if own_key not in cache:
        cache[own_key] = replica_packs(workload, R, m, step=step)
    own = cache[own_key]
    dealt_key = ("replica_balance.dealt", step, m, R, layout.pp, group)
    if group > 1 and dealt_key not in cache:
        cache[dealt_key] = deal_encoder_samples(own, group, layout.pp)
    dealt = cache[dealt_key] if group > 1 else [None] * R  # g = 1: predict_step's own split
    preds = []
    for r, packs in enumerate(own):
        key = ("replica_balance.pred", L, m, r)
        if state is not None or key not in cache:  # exact states are not kept: no prediction cached
            pred = predict_step(
                workload, L, device=device, network=network, microbatches=m, step=step, vocab=vocab,
                packs=packs, state=state, cache=cache, encoder_microbatches=dealt[r], stage_layers=stage_layers,
            )  # fmt: skip
            if state is not None:
                preds.append(pred)
                continue
            cache[key] = pred
        preds.append(cache[key])
    slow = max(preds, key=lambda p: p.step_time_s)
    step_s = slow.step_time_s
    job_tokens = sum(p.tokens_per_s * p.step_time_s for p in preds) / R  # each replica's own tokens x dp
    job_mfu_s = sum(p.mfu * p.step_time_s for p in preds) / R
    worst = max(preds, key=lambda p: p.peak_memory_bytes)
    tokens_per_s = job_tokens / step_s if step_s > 0 else 0.0
    mfu = job_mfu_s / step_s if step_s > 0 else 0.0
    job = dataclasses.replace(
        slow, step_time_s=step_s, tokens_per_s=tokens_per_s, mfu=mfu, memory=worst.memory, oom=worst.oom
    )
    return GroupPricing(
        group=group,
        replicas=R,
        step_time_s=step_s,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        reorder_all_to_all_s=slow.time_s.get("reorder_all_to_all", 0.0),
        replica_step_s=[p.step_time_s for p in preds],
        prediction=job,
    )
