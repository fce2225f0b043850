"""What one training step measured: one all-reduce of per-rank numbers over the world, then the row the
caller logs (a trainer's ``metrics.jsonl``: loss per modality, throughput, MFU, where each rank's time went,
encoder balance before and after the reordering, memory peaks, state bytes, skips).

Model FLOPs count 2 per multiply-add, training = 3x forward, attention per packed document
(:mod:`omni_parallel.flops`); MFU divides by the measured peak of every process.

The same all-reduce carries the step's memory peaks (:data:`MEMORY_METRICS`: saved activations per rank,
kept and offloaded (:mod:`omni_parallel.activation_memory`), and on CUDA the allocator's peak) and the
world's count of skipped items (:class:`omni_data.SkipMetrics` gathers the named report only when that
count changed): one collective per step for all of the step's numbers, since every collective after the
pipeline step is a point where every rank waits for the slowest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from omni_data import Modality, Pack, encoder_microbatch_ids, split_encoder_microbatches
from omni_data.zero_redundancy import SampleIndex
from omni_parallel import ParallelState
from omni_parallel.activation_memory import StepPeaks
from omni_parallel.flops import attention_flops, model_flops
from omni_parallel.memory import KINDS
from omni_pipeline.executor import StepResult
from omni_pipeline.microbatch import MODALITIES
from omni_pipeline.step_inputs import StepInputs

__all__ = [
    "MEMORY_METRICS",
    "PHASES",
    "EncoderShape",
    "StepMetrics",
    "StepMetricsSpec",
    "encoder_imbalance",
    "encoder_load",
    "step_phases",
]

# metrics.jsonl ``time_s_per_rank`` keys: where a rank's step wall time went (seconds, they sum to it)
PHASES = (
    "data",
    "encoder",
    "llm",
    "p2p_wait",
    "reduce_wait",
    "grad_reduce",
    "optimizer",
    "checkpoint",
    "other",
)

# metrics.jsonl keys of the memory peaks, each a list over global ranks (bytes)
MEMORY_METRICS = (
    "peak_activation_bytes_per_rank",
    "peak_offloaded_bytes_per_rank",
    "peak_allocated_bytes_per_rank",
)


def _memory_vector(peaks: StepPeaks | None, rank: int, world: int) -> torch.Tensor:
    """This rank's column of the ``3 x world`` peaks (bytes; zeros without ``peaks``), flattened."""
    vec = torch.zeros(len(MEMORY_METRICS), world, dtype=torch.float64)
    if peaks is not None:
        vec[:, rank] = torch.tensor(
            [peaks.activation_bytes, peaks.offloaded_bytes, peaks.allocated_bytes or 0], dtype=torch.float64
        )
    return vec.reshape(-1)


def _memory_numbers(v: list[float], world: int, cuda: bool) -> dict[str, list[int]]:
    """:func:`_memory_vector` summed over the world -> :data:`MEMORY_METRICS` -> ``[bytes per global
    rank]`` (float64 holds byte counts below 2**53 exactly); ``peak_allocated_bytes_per_rank`` only on
    CUDA."""
    rows = [[int(x) for x in v[i * world : (i + 1) * world]] for i in range(len(MEMORY_METRICS))]
    return {name: rows[i] for i, name in enumerate(MEMORY_METRICS) if i < 2 or cuda}


def step_phases(result: StepResult, wall: float, measured: dict[str, float]) -> dict[str, float]:
    """One rank's step wall time by :data:`PHASES`: ``data`` (loader step, decode and the step's input
    building, its collectives included), ``encoder`` / ``llm`` (seconds inside encoder / LLM actions of
    the executor's timeline), ``p2p_wait`` (blocked on receives, ``StepResult.waits``), ``reduce_wait``
    (at the gradient reduction, waiting for the slowest rank to finish its last backward:
    ``StepResult.reduce_wait_s``), ``grad_reduce`` (the rest of ``StepResult.reduce_s``: the gradient
    collectives themselves), ``optimizer`` (clipping and the AdamW step), ``checkpoint`` (the save
    after the previous step), from ``measured`` where the executor does not know them; ``other`` is
    ``wall`` minus the rest (dispatch, sends, loss broadcast, metrics), so the phases sum to ``wall``."""
    out = dict.fromkeys(PHASES, 0.0)
    for name in ("data", "optimizer", "checkpoint"):
        out[name] = float(measured.get(name, 0.0))
    for ev in result.timeline:
        out["encoder" if ev.is_encoder else "llm"] += ev.end_s - ev.start_s
    out["p2p_wait"] = sum(result.waits.values())
    out["reduce_wait"] = result.reduce_wait_s
    out["grad_reduce"] = result.reduce_s - result.reduce_wait_s
    out["other"] = wall - sum(v for k, v in out.items() if k != "other")
    return out


_STATE_PARTS = KINDS  # the fields of {llm,encoder}_state_bytes[_per_rank]
_STATE_OWNERS = ("encoder", "llm")


@dataclass(frozen=True)
class EncoderShape:
    """An encoder tower's shape, for its FLOPs.

    Attributes:
        dim: hidden size.
        n_layers: transformer layers.
        tokens_per_media_token: the tower's sequence per media token of a sample (``merge**2`` patches per
            merged image token; 1 for audio frames).
        temporal_patch: frames per patch of a video on this tower (its attention runs per temporal slice,
            :func:`omni_pipeline.step_costs.encoder_documents`).
    """

    dim: int
    n_layers: int
    tokens_per_media_token: int = 1
    temporal_patch: int = 2


@dataclass(frozen=True)
class StepMetricsSpec:
    """What :class:`StepMetrics` needs of a run.

    Attributes:
        microbatches: LLM microbatches (packs) per step of one DP replica.
        max_seq_len: tokens per pack (a rank's; under hybrid DP/CP a pack spans ``dp_cp`` ranks).
        hybrid_cp: hybrid DP/CP (every rank of a stage holds the same packs, one data replica in all).
        llm_dim, llm_layers: the LLM's hidden size and layers (its attention FLOPs).
        encoders: ``{modality: EncoderShape}`` of each encoder tower (``"image"``, ``"audio"``).

    Raises:
        ValueError: ``microbatches`` or ``max_seq_len`` < 1.
    """

    microbatches: int
    max_seq_len: int
    llm_dim: int
    llm_layers: int
    hybrid_cp: bool = False
    encoders: Mapping[str, EncoderShape] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.microbatches < 1 or self.max_seq_len < 1:
            raise ValueError(
                f"StepMetricsSpec: microbatches ({self.microbatches}) and max_seq_len ({self.max_seq_len}) "
                "must be >= 1"
            )


class StepMetrics:
    """Per-step metrics of one rank's run.

    Args:
        spec: the run's shapes (:class:`StepMetricsSpec`).
        ps: the parallel state (ranks and sizes).
        llm_matmul: matmul parameters of the whole LLM (all stages, before TP).
        encoder_matmul: ``{modality: matmul parameters}`` of each encoder tower.
        peak_flops: measured peak FLOP/s of one process.
        encoder_bytes: ``() -> {"parameters", "gathered", "gradients", "optimizer": bytes}`` this rank
            holds for the encoders (``omni_parallel.memory.state_bytes``); ``None``: not reported.
        llm_bytes: the same for this rank's LLM stages.
    """

    def __init__(
        self,
        spec: StepMetricsSpec,
        ps: ParallelState,
        *,
        llm_matmul: float,
        encoder_matmul: dict[str, int],
        peak_flops: float,
        encoder_bytes: Callable[[], dict[str, int]] | None = None,
        llm_bytes: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.spec, self.peak_flops = spec, peak_flops
        self.state_bytes = {"encoder": encoder_bytes, "llm": llm_bytes}
        self.llm_matmul, self.encoder_matmul = llm_matmul, encoder_matmul
        self.rank, self.world = ps.rank, ps.world_size
        self.pp, self.pp_rank = ps.size("pp"), ps.local_rank("pp")
        self.dp, self.tp_rank, self.sp_rank = ps.size("dp"), ps.local_rank("tp"), ps.local_rank("ulysses")
        # CP ranks hold the same packs: one counts them. Hybrid DP/CP: every rank of a stage holds the
        # same (dp * cp times larger) packs, one data replica in all.
        hybrid = spec.hybrid_cp
        self.counts_packs = ps.local_rank("dp_cp" if hybrid else "cp") == 0
        self.replicas = 1 if hybrid else self.dp
        self.pack_tokens = spec.max_seq_len * (ps.size("dp_cp") if hybrid else 1)
        self._encodes_seen = 0  # this rank's image-code encodes counted by earlier steps (reduce)

    def reduce(
        self,
        inputs: StepInputs,
        result: StepResult,
        wall: float,
        phases: dict[str, float] | None = None,
        *,
        peaks: StepPeaks | None = None,
        skip_total: int = 0,
        image_code_encodes: int | None = None,
    ) -> dict[str, Any]:
        """One all-reduce over the world (collective): per-rank wall/busy seconds and the step's time per
        :data:`PHASES` (``phases`` gives ``data``, ``optimizer``, ``checkpoint``; the rest comes from the
        executor's result; ``other`` is the wall time left), and (from pipeline rank 0 of each DP
        replica, which holds the broadcast losses) loss and per-modality sums, tokens, samples, skipped
        payloads, and in the same all-reduce the encoder numbers of :meth:`_encoder_vector`, this rank's
        memory ``peaks`` (``"memory"``: :data:`MEMORY_METRICS` -> bytes per global rank), its count of
        skipped items ``skip_total`` (``"skip_total"``: the sum over the world) and its loader's image-code
        encodes so far, ``image_code_encodes`` (``omni_data.ZeroRedundancyFilter.image_code_encodes``, a
        running count: the step's share is its growth since the last call; ``"image_code_encodes"``:
        per global rank)."""
        n, packs = self.world, inputs.packs
        times = step_phases(result, wall, phases or {})
        vec = torch.zeros(2 * n + 1 + 2 * len(MODALITIES) + 3 + len(PHASES) * n, dtype=torch.float64)
        vec[self.rank] = wall
        vec[n + self.rank] = sum(ev.end_s - ev.start_s for ev in result.timeline)
        at = 2 * n + 1 + 2 * len(MODALITIES) + 3
        for i, name in enumerate(PHASES):
            vec[at + i * n + self.rank] = times[name]
        # TP ranks hold the same losses: count one. SP ranks hold the sums over their chunks: add them.
        if self.pp_rank == 0 and self.tp_rank == 0:
            vec[2 * n] = result.loss
            for i, mod in enumerate(MODALITIES):
                vec[2 * n + 1 + i] = sum(m[f"ce_{mod}"] for m in result.metrics.values())
                vec[2 * n + 1 + len(MODALITIES) + i] = sum(m[f"n_{mod}"] for m in result.metrics.values())
        if self.pp_rank == 0 and self.tp_rank == 0 and self.sp_rank == 0 and self.counts_packs:
            vec[at - 3] = sum(p.num_tokens for p in packs)
            vec[at - 2] = sum(len(p.samples) for p in packs)
            vec[at - 1] = len(inputs.masked)
        own = vec.numel()
        enc = self._encoder_vector(inputs, result)
        mem = _memory_vector(peaks, self.rank, n)
        skips = torch.tensor([float(skip_total)], dtype=torch.float64)
        encodes = torch.zeros(n, dtype=torch.float64)
        if image_code_encodes is not None:
            encodes[self.rank] = image_code_encodes - self._encodes_seen
            self._encodes_seen = image_code_encodes
        counts = self._sample_counts(packs, inputs.masked)
        vec = torch.cat([vec, enc, mem, counts, encodes, skips])
        if dist.is_initialized() and n > 1:
            dist.all_reduce(vec)
        v = vec.tolist()
        at_mem = own + enc.numel()
        at_counts = at_mem + mem.numel()
        cuda = peaks is not None and peaks.allocated_bytes is not None
        return self._encoder_numbers(v[own:at_mem]) | {
            "memory": _memory_numbers(v[at_mem:at_counts], n, cuda),
            "samples_per_modality": [int(x) for x in v[at_counts : at_counts + len(MODALITIES)]],
            "video_frames": int(v[at_counts + len(MODALITIES)]),
            "image_code_encodes": [int(x) for x in v[at_counts + len(MODALITIES) + 1 : -1]],
            "skip_total": int(v[-1]),
            "wall": v[:n],
            "busy": v[n : 2 * n],
            "loss": v[2 * n],
            "ce": v[2 * n + 1 : 2 * n + 1 + len(MODALITIES)],
            "count": v[2 * n + 1 + len(MODALITIES) : 2 * n + 1 + 2 * len(MODALITIES)],
            "tokens": v[at - 3],
            "samples": v[at - 2],
            "skipped_payloads": int(v[at - 1]),
            "phases": {name: v[at + i * n : at + (i + 1) * n] for i, name in enumerate(PHASES)},
        }

    def _sample_counts(self, packs: list[Pack], masked: frozenset[tuple[int, int]]) -> torch.Tensor:
        """``[len(MODALITIES) + 1]``: this replica's trained samples per modality in the step's packs
        (pieces of a split text each count) and the sampled frames of its trained videos
        (``SampleMeta.shape[0]``); samples whose payload did not decode (``masked``: they keep their place
        on placeholder frames, their targets masked) are left out: they are ``skipped_payloads``. From the
        one rank per replica that counts packs (zeros elsewhere), summed over the world in :meth:`reduce`."""
        out = torch.zeros(len(MODALITIES) + 1, dtype=torch.float64)
        if self.pp_rank == 0 and self.tp_rank == 0 and self.sp_rank == 0 and self.counts_packs:
            for k, pack in enumerate(packs):
                for i, s in enumerate(pack.samples):
                    if (k, i) in masked:
                        continue
                    out[MODALITIES.index(s.modality)] += 1
                    if s.modality is Modality.VIDEO:
                        out[-1] += s.shape[0]
        return out

    def _encoder_vector(self, inputs: StepInputs, result: StepResult) -> torch.Tensor:
        """This rank's share of encoder parallelism's per-rank numbers, summed over the world in
        :meth:`reduce`'s one all-reduce: measured seconds in encoder forwards and backwards (the
        collectives of SP and reordering included), modelled encoder FLOPs without and with the
        reordering across DP, payload bytes the reordering moved, and the state bytes of the encoders and
        of the LLM stages (:data:`_STATE_OWNERS` x :data:`_STATE_PARTS` x ranks)."""
        n = self.world
        vec = torch.zeros(3 * n + 1 + len(_STATE_OWNERS) * len(_STATE_PARTS) * n, dtype=torch.float64)
        vec[self.rank] = sum(ev.end_s - ev.start_s for ev in result.timeline if ev.kind in ("EF", "EB"))
        works = inputs.encoder_work.values()
        vec[n + self.rank] = sum(w.flops_before for w in works)
        vec[2 * n + self.rank] = sum(w.flops_after for w in works)
        vec[3 * n] = sum(w.bytes_sent for w in works)
        for j, owner in enumerate(_STATE_OWNERS):
            measure = self.state_bytes[owner]
            held = measure() if measure is not None else {}
            for i, part in enumerate(_STATE_PARTS):
                vec[3 * n + 1 + (j * len(_STATE_PARTS) + i) * n + self.rank] = held.get(part, 0)
        return vec

    def _encoder_numbers(self, v: list[float]) -> dict[str, Any]:
        """:meth:`_encoder_vector`'s layout, summed over the world, as named numbers."""
        n, k = self.world, len(_STATE_PARTS)
        at = 3 * n + 1
        return {
            "encoder_s": v[:n],
            "encoder_flops_before": v[n : 2 * n],
            "encoder_flops_after": v[2 * n : 3 * n],
            "reorder_bytes": int(v[3 * n]),
            **{
                f"{owner}_bytes": {
                    p: [int(x) for x in v[at + (j * k + i) * n : at + (j * k + i + 1) * n]]
                    for i, p in enumerate(_STATE_PARTS)
                }
                for j, owner in enumerate(_STATE_OWNERS)
            },
        }

    def row(self, inputs: StepInputs, row: dict[str, Any], lr: float, grad_norm: float) -> dict[str, Any]:
        """The logged metrics of a step from :meth:`reduce`'s result."""
        packs, m, pp = inputs.packs, self.spec.microbatches, self.pp
        step_s = max(row["wall"])
        flow = inputs.plan.flow  # the step's own (per-step "planned") or the run's
        owner = {e: flow.encoder_rank(e) for e in flow.encoder_consumer}
        before = encoder_imbalance(
            encoder_load(packs, split_encoder_microbatches(packs, m, pp, balance=False), owner, pp)
        )
        after = encoder_imbalance(encoder_load(packs, split_encoder_microbatches(packs, m, pp), owner, pp))
        flops = self.step_flops(inputs)
        return {
            "loss": row["loss"],
            "loss_per_modality": {
                str(mod): row["ce"][i] / row["count"][i]
                for i, mod in enumerate(MODALITIES)
                if row["count"][i] > 0
            },
            "targets_per_modality": {str(mod): int(row["count"][i]) for i, mod in enumerate(MODALITIES)},
            # samples in the step's packs (all DP replicas) and the sampled frames of the videos among them
            "samples_per_modality": {
                str(mod): row["samples_per_modality"][i] for i, mod in enumerate(MODALITIES)
            },
            "video_frames": row["video_frames"],
            # generation samples' images the loaders turned into codes in the step (first and last stage
            # each encode the samples whose ids they read, as both tokenize text), all ranks / per rank
            "image_code_encodes": sum(row["image_code_encodes"]),
            "image_code_encodes_per_rank": row["image_code_encodes"],
            "tokens": row["tokens"],
            "tokens_per_s": row["tokens"] / step_s,
            "samples_per_s": row["samples"] / step_s,
            "skipped_payloads": row["skipped_payloads"],
            "packing_fill": sum(p.num_tokens for p in packs) / (len(packs) * self.pack_tokens),
            "encoder_imbalance_before_reorder": before,
            "encoder_imbalance_after_reorder": after,
            "mfu": flops / step_s / (self.peak_flops * self.world),
            "step_time_s": step_s,
            "idle_s_per_rank": [w - b for w, b in zip(row["wall"], row["busy"])],
            "time_s_per_rank": row["phases"],
            "lr": lr,
            "grad_norm": grad_norm,
            "encoder_s_per_rank": row["encoder_s"],
            "encoder_time_imbalance": _max_over_mean(row["encoder_s"]),
            "encoder_flops_imbalance_before_dp_reorder": _max_over_mean(row["encoder_flops_before"]),
            "encoder_flops_imbalance_after_dp_reorder": _max_over_mean(row["encoder_flops_after"]),
            "reorder_bytes": row["reorder_bytes"],
            "encoder_state_bytes": {p: max(v) for p, v in row["encoder_bytes"].items()},
            "llm_state_bytes": {p: max(v) for p, v in row["llm_bytes"].items()},
            "encoder_state_bytes_per_rank": row["encoder_bytes"],
            "llm_state_bytes_per_rank": row["llm_bytes"],
        }

    def step_flops(self, inputs: StepInputs) -> float:
        """Model FLOPs of the step on every DP replica (all stages, encoders included), training (3x
        forward), estimated from this replica's packs."""
        spec = self.spec
        total = 0.0
        for p in inputs.packs:
            total += model_flops(0, 0, attention_flops(p.seqlens, spec.llm_dim, spec.llm_layers, causal=True))
            for s in p.samples:
                tower = "image" if s.modality is Modality.VIDEO else s.modality.value  # Qwen2-VL's one ViT
                if s.modality is Modality.TEXT or tower not in self.encoder_matmul or s.media_tokens <= 0:
                    continue
                ec = spec.encoders[tower]
                seq = s.media_tokens * ec.tokens_per_media_token
                docs = [seq]
                if s.modality is Modality.VIDEO and len(s.shape) == 4:  # attention per temporal slice
                    t = -(-s.shape[0] // ec.temporal_patch)
                    docs = [seq // t] * t if seq % t == 0 else [seq]
                total += model_flops(
                    self.encoder_matmul[tower],
                    seq,
                    attention_flops(docs, ec.dim, ec.n_layers, causal=False),
                )
        total += model_flops(self.llm_matmul, sum(p.num_tokens for p in inputs.packs), 0.0)
        return total * self.replicas  # every DP replica runs as much work as this one (estimated from it)


def _max_over_mean(values: list[float]) -> float | None:
    """``max / mean`` (1.0: balanced); ``None`` when everything is 0 (no encoder work)."""
    total = sum(values)
    return max(values) * len(values) / total if total > 0 else None


def encoder_load(
    packs: list[Pack], mbs: dict[int, list[SampleIndex]], owner: dict[int, int], num_ranks: int
) -> dict[int, list[float]]:
    """Encoder forward FLOPs per pipeline rank for each LLM microbatch ``k`` (from 1) of one step.

    ``mbs``: encoder microbatch -> samples, numbered by ``omni_data.encoder_microbatch_ids``; ``owner``:
    encoder microbatch -> pipeline rank. Returns ``{k: [FLOPs on rank 0, rank 1, ...]}``.
    """
    slices = max(1, len(mbs) // max(1, len(packs)))
    ids = encoder_microbatch_ids(-(-max(mbs, default=0) // slices), slices)
    consumer = {e: k for k, es in ids.items() for e in es}
    out: dict[int, list[float]] = {}
    for e, items in sorted(mbs.items()):
        load = out.setdefault(consumer[e], [0.0] * num_ranks)
        load[owner[e]] += sum(packs[p].samples[i].encoder_flops for p, i in items)
    return out


def encoder_imbalance(load: dict[int, list[float]]) -> float | None:
    """Mean over LLM microbatches with encoder work of ``max / mean`` encoder FLOPs over ranks (1.0 is
    perfect balance, ``num_ranks`` all on one rank): how long stage 0 waits for the slowest slice of each
    microbatch's encoder work. ``None`` when no microbatch has encoder work (a text-only step), so that
    such steps do not pass for balanced ones in averages."""
    ratios = [max(v) * len(v) / sum(v) for v in load.values() if sum(v) > 0]
    return sum(ratios) / len(ratios) if ratios else None
