"""The whole training step of one layout: the pipeline simulated action by action, plus every collective of
the step over a two-tier network, the optimizer, and per-rank memory with an OOM verdict.

A :class:`Layout` (pp, dp, tp with Megatron SP, CP ring / all-gather, Ulysses, LLM and encoder ZeRO,
recompute, placement, reordering group) of a :class:`~omni_pipeline.workload.Workload` on a
:class:`Device` and a :class:`~omni_pipeline.cost.Network` is predicted by :func:`predict_step`:

* **Compute**: modelled FLOPs (:func:`omni_pipeline.modelled_step_costs`) at ``peak_flops * efficiency``
  per GPU; a pipeline position's ``tp * cp * ulysses`` ranks split its LLM and encoder work evenly
  (assumption: the encoders' share is split over the same ranks, as ``encoder_sp`` / the CP delivery
  spread samples). Recompute adds one forward to each backward (Chen et al. 2016; Korthikanti et al. 2022).
* **Collectives inside each LLM forward / backward** (added to the action's seconds: they sit on its
  critical path; per layer of the stage, bf16 activations of ``T' = T / (cp * ulysses)`` tokens):

  - TP (group ``tp``, stride 1): 2 all-reduces of ``T' d`` elements per layer in forward and 2 in
    backward (Shoeybi et al., "Megatron-LM", 2019, §3, the ``f`` / ``g`` operators); with Megatron SP each
    becomes an all-gather + a reduce-scatter of the same volume (Korthikanti et al. 2022, §4.2.2), the
    same ring time.
  - CP (group ``cp``, stride ``tp``): ``allgather``: K and V (``2 T'' kv`` elements, ``T'' = T / ulysses``)
    all-gathered in forward, their gradients reduce-scattered in backward (Llama 3, Dubey et al. 2024,
    §3.3.2); ``ring``: ``cp - 1`` P2P steps passing the local K and V (``2 T' kv``) in forward, K, V and
    their gradients in backward (Liu et al., "Ring Attention", 2023), not overlapped with compute
    (an upper bound).
  - Ulysses (group ``ulysses``, stride ``tp * cp``): 4 all-to-alls per layer in forward (Q, K, V in,
    the attention output back) and 4 in backward (Jacobs et al., "DeepSpeed Ulysses", 2023, §3).

  Recompute repeats the forward's collectives in backward.
* **Once per step** (after the pipeline: the step-scoped ZeRO schedule of :mod:`omni_parallel.llm_zero`
  gathers when the step starts and reduces after the last backward, so nothing overlaps them here):
  LLM gradients over the stage's data group (``dp * cp * ulysses`` ranks, stride ``tp``, float32):
  ZeRO-0 all-reduce; ZeRO-1 all-gather + all-reduce; ZeRO-2/3 all-gather + reduce-scatter. The encoders
  over every rank (``encoder_zero``, :mod:`omni_parallel.encoder_zero`) the same way. The reordering
  all-to-all (paper §4.2, Figure 20) over ``reorder_group`` DP replicas: each rank sends
  ``(g - 1) / g`` of its share of the step's encoder outputs. The AdamW step: memory-bound, 28 bytes per
  local parameter element (read parameter, gradient, two moments; write parameter, two moments; float32)
  over the device's HBM bandwidth.
* **Memory** per pipeline rank (:func:`rank_memory`): parameters, gradients and AdamW state per ZeRO stage
  from :func:`omni_parallel.memory.analytic_state_bytes` (or the exact bytes of a build, ``state=``, e.g.
  ``omni-train memory``'s), plus the peak over the simulated timeline of stored activations: per LLM
  stage and microbatch :func:`omni_parallel.memory.block_activation_bytes` (bf16, after the CP / Ulysses
  split, TP / SP / recompute honoured) times its layers, and on the last stage the loss's float32
  log-softmax over the vocabulary (what ``omni-train memory`` counts); encoder activations and outputs as
  the simulator holds them. OOM when a rank's peak exceeds ``Device.memory_bytes``.

Not modelled: data loading, expert parallelism, offload, virtual stages, compute-communication overlap
inside an action, link contention between groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from omni_data import encoder_microbatch_ids, split_encoder_microbatches
from omni_parallel.flops import TransformerShape, attention_flops, model_flops
from omni_parallel.memory import analytic_state_bytes, block_activation_bytes
from omni_pipeline.actions import Action, ActionKind
from omni_pipeline.cost import (
    CostModel,
    Network,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    reduce_scatter_s,
)
from omni_pipeline.schedules import Schedule1F1B
from omni_pipeline.simulator import SimulationResult, simulate
from omni_pipeline.step_costs import encoder_forward_flops, modelled_step_costs
from omni_pipeline.workload import Workload

__all__ = [
    "PLACEMENTS",
    "Device",
    "Layout",
    "StepPrediction",
    "even_stage_layers",
    "llm_stage_params",
    "predict_step",
    "rank_memory",
    "step_collectives",
]

# placements predict_step runs (omni_pipeline.place policies and the Optimus baseline)
PLACEMENTS = ("prepend_first_stage", "optimus_static", "isolated", "uniform_on_demand", "planned")
ADAMW_BYTES_PER_ELEMENT = 28  # read p, g, m, v; write p, m, v; float32 (4 bytes each)
MASTER_BYTES = 4  # float32 masters, gradients and AdamW moments (omni_parallel.parallelize mixed precision)
ACT_BYTES = 2  # bf16 activations under autocast


@dataclass(frozen=True)
class Device:
    """One accelerator: ``memory_bytes`` of HBM, ``peak_flops`` dense FLOP/s at ``efficiency`` (the share
    sustained by the model's kernels), ``hbm_Bps`` memory bandwidth (the optimizer step). Defaults: H100
    SXM (80 GB, 989 TFLOP/s bf16 dense, 3.35 TB/s; NVIDIA datasheet) at the paper's 0.4 (issue 31).

    Raises:
        ValueError: a value not > 0, or ``efficiency`` above 1 (named).
    """

    memory_bytes: float = 80e9
    peak_flops: float = 989e12
    efficiency: float = 0.4
    hbm_Bps: float = 3.35e12

    def __post_init__(self) -> None:
        bad = [k for k in ("memory_bytes", "peak_flops", "efficiency", "hbm_Bps") if not getattr(self, k) > 0]
        if bad or self.efficiency > 1:
            raise ValueError(f"Device: {bad or ['efficiency']} must be > 0 (efficiency <= 1): {self!r}")


@dataclass(frozen=True)
class Layout:
    """A parallel layout of ``pp * dp * tp * cp * ulysses`` GPUs (names and ranges as ``[parallel]`` of
    the trainer's config; rank order tp-cp-dp-pp, tp fastest, as ``omni_parallel.state.ParallelState``).

    Attributes:
        cp_attention: ``"allgather"`` or ``"ring"``.
        llm_zero: 0-3 over each stage's data group. encoder_zero: 0, 2 or 3 over every rank.
        recompute: every block (LLM and encoders) recomputes its activations in backward.
        placement: one of :data:`PLACEMENTS`.
        reorder_group: DP replicas the reordering all-to-all spans (1: reorder within the replica only).

    Raises:
        ValueError: a size < 1, ``sequence_parallel`` without ``tp > 1``, an unknown ``cp_attention``,
            ``placement`` or ZeRO stage, or ``reorder_group`` not dividing ``dp`` (named).
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    cp_attention: str = "allgather"
    ulysses: int = 1
    llm_zero: int = 0
    encoder_zero: int = 0
    recompute: bool = False
    placement: str = "uniform_on_demand"
    reorder_group: int = 1

    def __post_init__(self) -> None:
        errors = [f"{k} must be an int >= 1, got {getattr(self, k)!r}" for k in
                  ("pp", "dp", "tp", "cp", "ulysses", "reorder_group")
                  if not (isinstance(getattr(self, k), int) and getattr(self, k) >= 1)]  # fmt: skip
        if self.sequence_parallel and self.tp < 2:
            errors.append("sequence_parallel needs tp > 1")
        if self.cp_attention not in ("allgather", "ring"):
            errors.append(f"cp_attention must be 'allgather' or 'ring', got {self.cp_attention!r}")
        if self.llm_zero not in (0, 1, 2, 3):
            errors.append(f"llm_zero must be 0-3, got {self.llm_zero!r}")
        if self.encoder_zero not in (0, 2, 3):
            errors.append(f"encoder_zero must be 0, 2 or 3, got {self.encoder_zero!r}")
        if self.placement not in PLACEMENTS:
            errors.append(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if (
            isinstance(self.reorder_group, int)
            and isinstance(self.dp, int)
            and self.dp % max(self.reorder_group, 1)
        ):
            errors.append(f"reorder_group {self.reorder_group} must divide dp {self.dp}")
        if errors:
            raise ValueError("Layout: " + "; ".join(errors))

    @property
    def model_parallel(self) -> int:
        """Ranks one pipeline position's work is split over: ``tp * cp * ulysses``."""
        return self.tp * self.cp * self.ulysses

    @property
    def gpus(self) -> int:
        """``pp * dp * tp * cp * ulysses``."""
        return self.pp * self.dp * self.model_parallel

    @property
    def data_group(self) -> int:
        """Ranks of a stage's data group (its gradients are summed over it): ``dp * cp * ulysses``."""
        return self.dp * self.cp * self.ulysses


def even_stage_layers(n_layers: int, stages: int) -> list[int]:
    """Layers per stage shared out evenly, the first ``n_layers % stages`` stages taking one more (the
    trainer's default split, ``omni_train.pipeline.stage_split`` without ``stage_layers``).

    Raises:
        ValueError: fewer layers than stages.
    """
    if stages < 1 or n_layers < stages:
        raise ValueError(f"even_stage_layers: {n_layers} layers cannot fill {stages} stages")
    q, r = divmod(n_layers, stages)
    return [q + (1 if s < r else 0) for s in range(stages)]


def llm_stage_params(
    shape: TransformerShape, vocab: int, layers: int, *, first: bool, last: bool, tp: int = 1
) -> tuple[float, int]:
    """``(parameters, tensors)`` one TP rank holds of an LLM stage of ``layers`` LLaMA blocks: each block's
    matmul weights over ``tp`` (``llama_tp_plan``: Q/K/V/gate/up column-, O/down row-parallel) and its two
    RMSNorm weights whole; the first stage's token embedding and the last stage's final norm and LM head
    (``vocab x dim``, untied), whole (not TP-sharded). No biases.
    """
    per_block = shape.layer_matmul_params / tp + 2 * shape.dim
    tensors_per_block = (7 if shape.gated_mlp else 6) + 2
    params = (
        layers * per_block + (vocab * shape.dim if first else 0) + ((vocab + 1) * shape.dim if last else 0)
    )
    tensors = layers * tensors_per_block + (1 if first else 0) + (2 if last else 0)
    return params, tensors


def _encoder_params(shapes: Mapping[str, TransformerShape]) -> tuple[float, int]:
    """``(parameters, tensors)`` of the encoder towers: blocks' matmul weights and two LayerNorms (weight
    and bias) per block (patch / frame embeddings left out: under 1%)."""
    p = t = 0
    for name, s in shapes.items():
        if name == "llm":
            continue
        p += s.n_layers * (s.layer_matmul_params + 4 * s.dim)
        t += s.n_layers * ((7 if s.gated_mlp else 6) + 4)
    return p, t


def _stage_activation_bytes(
    shape: TransformerShape, vocab: int, layers: int, tokens: int, layout: Layout, *, last: bool
) -> int:
    """Bytes one LLM stage stores per microbatch (``omni-train memory``'s formula: block activations of
    the rank's ``tokens // (cp * ulysses)`` tokens times ``layers``, plus the float32 log-softmax over the
    vocabulary on the last stage)."""
    t = tokens // (layout.cp * layout.ulysses)
    block = block_activation_bytes(
        t,
        shape.dim,
        shape.kv_dim,
        int(shape.mlp_dim),
        heads=shape.n_heads,
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        bytes_per=ACT_BYTES,
        master_bytes=MASTER_BYTES,
        recompute=layout.recompute,
        kernel="flash",  # bf16 on CUDA: the fused varlen kernel (omni_parallel.varlen)
    )
    return block * layers + (t * vocab * 4 if last else 0)


def rank_memory(
    workload: Workload,
    layout: Layout,
    *,
    vocab: int = 32000,
    stage_layers: Sequence[int] | None = None,
    activations: Mapping[int, float] | None = None,
    state: Mapping[int, Mapping[str, float]] | None = None,
) -> dict[int, dict[str, float]]:
    """Bytes per pipeline rank: LLM and encoder state by kind (``llm_parameters`` ... ``enc_optimizer``,
    kinds of :data:`omni_parallel.memory.KINDS`), ``activations`` (the simulated peak, or the schedule's
    in-flight LLM activations when ``activations`` is not given) and ``total``.

    Args:
        workload: gives the shapes (``workload.shapes``) and the pack length.
        vocab: the LLM's vocabulary (LLaMA-2: 32000).
        stage_layers: layers per stage (default :func:`even_stage_layers`).
        activations: ``{pp rank: peak activation bytes}`` from a simulation; default: 1F1B's in-flight
            LLM activations (stage ``s`` holds ``min(pp - s, microbatches)`` microbatches).
        state: ``{pp rank: {"llm": {kind: bytes}, "encoders": {kind: bytes}}}`` measured from a build
            (``omni-train memory``); default: :func:`omni_parallel.memory.analytic_state_bytes` per stage.

    Raises:
        ValueError: the workload has no LLM shape, or the layers do not fill the stages.
    """
    if "llm" not in workload.shapes:
        raise ValueError(f"rank_memory: workload {workload.name!r} has no LLM shape")
    llm = workload.shapes["llm"]
    layers = list(stage_layers) if stage_layers is not None else even_stage_layers(llm.n_layers, layout.pp)
    enc_p, enc_t = _encoder_params(workload.shapes)
    out: dict[int, dict[str, float]] = {}
    for r in range(layout.pp):
        if state is not None:
            llm_state, enc_state = state[r]["llm"], state[r]["encoders"]
        else:
            p, t = llm_stage_params(
                llm, vocab, layers[r], first=r == 0, last=r == layout.pp - 1, tp=layout.tp
            )
            llm_state = analytic_state_bytes(
                p, bytes_per=MASTER_BYTES, zero=layout.llm_zero, shards=layout.data_group, tensors=t
            )
            if layout.llm_zero == 1 and layout.data_group > 1:  # ZeRO-1 all-reduces whole gradients
                llm_state = dict(llm_state, gradients=p * MASTER_BYTES)
            enc_state = analytic_state_bytes(
                enc_p, bytes_per=MASTER_BYTES, zero=layout.encoder_zero, shards=layout.gpus, tensors=enc_t
            )
        if activations is not None:
            act = float(activations[r])
        else:
            act = float(
                min(layout.pp - r, workload.microbatches)
                * _stage_activation_bytes(
                    llm, vocab, layers[r], workload.max_seq_len, layout, last=r == layout.pp - 1
                )
            )
        row = {f"llm_{k}": float(v) for k, v in llm_state.items()}
        row |= {f"enc_{k}": float(v) for k, v in enc_state.items()}
        row["activations"] = act
        row["total"] = sum(row.values())
        out[r] = row
    return out


def step_collectives(
    workload: Workload,
    layout: Layout,
    network: Network,
    device: Device,
    *,
    tokens: float,
    encoder_output_bytes: float = 0.0,
    vocab: int = 32000,
    stage_layers: Sequence[int] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of the step's collectives and optimizer (module docstring).

    Args:
        tokens: LLM tokens of one microbatch (``T``, before the CP / Ulysses split).
        encoder_output_bytes: bytes of encoder output of one pipeline replica's step (the reordering
            all-to-all's payload, spread over the replica's ranks).

    Returns:
        ``(per_action, per_step)``: ``per_action``: ``{"tp" | "cp" | "ulysses": (forward seconds, backward
        seconds) of one layer}`` flattened as ``{"tp_fwd": s, "tp_bwd": s, ...}`` per LLM layer and
        microbatch; ``per_step``: ``{"llm_all_reduce" | "llm_all_gather" | "llm_reduce_scatter" |
        "encoder_all_reduce" | "encoder_all_gather" | "encoder_reduce_scatter" | "reorder_all_to_all" |
        "optimizer": seconds}`` of the busiest pipeline rank (the largest stage).
    """
    llm = workload.shapes["llm"]
    L = layout
    t_rank = tokens / (L.cp * L.ulysses)  # tokens per rank after CP / Ulysses
    per: dict[str, float] = dict.fromkeys(
        ("tp_fwd", "tp_bwd", "cp_fwd", "cp_bwd", "ulysses_fwd", "ulysses_bwd"), 0.0
    )
    redo = 1.0 if L.recompute else 0.0  # recompute repeats the forward's collectives in backward
    if L.tp > 1:
        bw, lat = network.link(L.tp, 1)
        one = all_reduce_s(ACT_BYTES * t_rank * llm.dim, L.tp, bw, lat)  # = AG + RS of the same buffer (SP)
        per["tp_fwd"], per["tp_bwd"] = 2 * one, (2 + 2 * redo) * one
    if L.cp > 1:
        bw, lat = network.link(L.cp, L.tp)
        kv = ACT_BYTES * 2 * llm.kv_dim
        if L.cp_attention == "allgather":
            fwd = all_gather_s(kv * tokens / L.ulysses, L.cp, bw, lat)
            bwd = reduce_scatter_s(kv * tokens / L.ulysses, L.cp, bw, lat)
        else:  # ring: cp - 1 P2P steps of the local K, V; backward passes K, V and dK, dV
            step = lat + kv * t_rank / bw
            fwd, bwd = (L.cp - 1) * step, 2 * (L.cp - 1) * step
        per["cp_fwd"], per["cp_bwd"] = fwd, bwd + redo * fwd
    if L.ulysses > 1:
        bw, lat = network.link(L.ulysses, L.tp * L.cp)
        widths = (llm.dim, llm.kv_dim, llm.kv_dim, llm.dim)  # Q, K, V in; attention output back
        fwd = sum(all_to_all_s(ACT_BYTES * t_rank * w / L.tp, L.ulysses, bw, lat) for w in widths)
        per["ulysses_fwd"], per["ulysses_bwd"] = fwd, fwd + redo * fwd
    layers = list(stage_layers) if stage_layers is not None else even_stage_layers(llm.n_layers, L.pp)
    big = max(
        (
            llm_stage_params(llm, vocab, layers[r], first=r == 0, last=r == L.pp - 1, tp=L.tp)[0]
            for r in range(L.pp)
        ),
    )
    step: dict[str, float] = {}
    nbytes = MASTER_BYTES * big
    bw, lat = network.link(L.data_group, L.tp)
    if L.llm_zero == 0:
        step["llm_all_reduce"] = all_reduce_s(nbytes, L.data_group, bw, lat)
    elif L.llm_zero == 1:
        step["llm_all_gather"] = all_gather_s(nbytes, L.data_group, bw, lat)
        step["llm_all_reduce"] = all_reduce_s(nbytes, L.data_group, bw, lat)
    else:
        step["llm_all_gather"] = all_gather_s(nbytes, L.data_group, bw, lat)
        step["llm_reduce_scatter"] = reduce_scatter_s(nbytes, L.data_group, bw, lat)
    enc_p, _ = _encoder_params(workload.shapes)
    if enc_p:
        ebw, elat = network.link(L.gpus, 1)
        enc_bytes = MASTER_BYTES * enc_p
        if L.encoder_zero == 0:
            step["encoder_all_reduce"] = all_reduce_s(enc_bytes, L.gpus, ebw, elat)
        else:
            step["encoder_all_gather"] = all_gather_s(enc_bytes, L.gpus, ebw, elat)
            step["encoder_reduce_scatter"] = reduce_scatter_s(enc_bytes, L.gpus, ebw, elat)
    if L.reorder_group > 1:
        rbw, rlat = network.link(L.reorder_group, L.model_parallel)  # DP replicas are tp*cp*ulysses apart
        share = encoder_output_bytes / (L.pp * L.model_parallel)
        step["reorder_all_to_all"] = all_to_all_s(share, L.reorder_group, rbw, rlat)
    local = big / (L.data_group if L.llm_zero >= 1 else 1) + enc_p / (L.gpus if L.encoder_zero >= 2 else 1)
    step["optimizer"] = ADAMW_BYTES_PER_ELEMENT * local / device.hbm_Bps
    return per, step


@dataclass
class StepPrediction:
    """What :func:`predict_step` predicts for one layout and step.

    Attributes:
        layout: the layout. step_time_s: seconds of the whole step.
        tokens_per_s: LLM tokens of the whole job per second (every replica).
        mfu: model FLOPs (no recompute) over ``step_time_s * gpus * peak_flops``.
        time_s: where the time goes on the pipeline's busiest rank, seconds: ``llm_compute``,
            ``encoder_compute``, ``tp`` / ``cp`` / ``ulysses`` (inside its actions), ``pipeline_idle``
            (bubbles and P2P waits), then the per-step items of :func:`step_collectives`; they sum to
            ``step_time_s``.
        memory: :func:`rank_memory`'s rows. oom: ranks whose ``total`` exceeds the device memory.
        simulation: the pipeline's :class:`~omni_pipeline.simulator.SimulationResult`.
    """

    layout: Layout
    step_time_s: float
    tokens_per_s: float
    mfu: float
    time_s: dict[str, float]
    memory: dict[int, dict[str, float]]
    oom: list[int]
    simulation: SimulationResult | None = field(default=None, repr=False)

    @property
    def peak_memory_bytes(self) -> float:
        """The largest rank's ``total``."""
        return max(m["total"] for m in self.memory.values())


def _flow(placement: str, schedule, encoder_inputs, costs: CostModel):
    from omni_pipeline.placement import optimus_static
    from omni_pipeline.policy import place

    if placement == "optimus_static":
        return optimus_static(schedule, encoder_inputs, costs)
    return place(placement, schedule, encoder_inputs, costs)


def predict_step(
    workload: Workload,
    layout: Layout,
    *,
    device: Device | None = None,
    network: Network | None = None,
    microbatches: int | None = None,
    step: int = 0,
    vocab: int = 32000,
    stage_layers: Sequence[int] | None = None,
    state: Mapping[int, Mapping[str, float]] | None = None,
    cache: dict | None = None,
) -> StepPrediction:
    """Predict one step of ``workload`` (its step ``step``'s packs, ``microbatches`` per replica, default
    the workload's) under ``layout`` (module docstring).

    Args:
        state: exact per-rank state bytes (see :func:`rank_memory`); default analytic.
        cache: a dict kept between calls of one search (same workload, device, network, vocab and
            stage layers): packs and pipeline simulations are reused across layouts that differ only in
            ``llm_zero`` / ``encoder_zero`` (which change neither).

    Raises:
        ValueError: fewer microbatches than stages, a workload without an LLM shape.
        Deadlock: the placement's programs cannot run.
    """
    device = device or Device()
    network = network or Network()
    cache = {} if cache is None else cache
    L = layout
    m = workload.microbatches if microbatches is None else microbatches
    if m < L.pp:
        raise ValueError(f"predict_step: {m} microbatches cannot fill {L.pp} stages")
    llm = workload.shapes["llm"]
    layers = list(stage_layers) if stage_layers is not None else even_stage_layers(llm.n_layers, L.pp)
    key = ("pipe", dataclasses.replace(L, llm_zero=0, encoder_zero=0), m, step)
    if key not in cache:
        cache[key] = _pipeline(workload, L, device, network, m, step, vocab, layers, cache)
    sim, tokens, enc_out, per, fwd_flops = cache[key]
    _, per_step = step_collectives(
        workload,
        L,
        network,
        device,
        tokens=tokens,
        encoder_output_bytes=enc_out,
        vocab=vocab,
        stage_layers=layers,
    )
    step_s = sim.makespan_s + sum(per_step.values())
    # where the time goes on the busiest rank (1F1B: pipeline rank r runs stage r)
    busiest = max(sim.timelines, key=lambda r: sum(ev.end_s - ev.start_s for ev in sim.timelines[r]))
    llm_c = enc_c = n_f = n_b = 0.0
    for ev in sim.timelines[busiest]:
        d = ev.end_s - ev.start_s
        if ev.is_encoder:
            enc_c += d
        else:
            llm_c += d
            n_f += ev.kind == ActionKind.FORWARD.value
            n_b += ev.kind == ActionKind.BACKWARD.value
    time_s = {"llm_compute": 0.0, "encoder_compute": enc_c}
    for k in ("tp", "cp", "ulysses"):
        time_s[k] = layers[busiest] * (n_f * per[f"{k}_fwd"] + n_b * per[f"{k}_bwd"])
    time_s["llm_compute"] = llm_c - time_s["tp"] - time_s["cp"] - time_s["ulysses"]
    time_s["pipeline_idle"] = sim.makespan_s - llm_c - enc_c
    time_s |= per_step
    job_flops = 3 * fwd_flops * L.dp  # model FLOPs (no recompute): backward = 2x forward
    mfu = job_flops / (step_s * L.gpus * device.peak_flops) if step_s > 0 else 0.0
    tokens_per_s = tokens * m * L.dp / step_s if step_s > 0 else 0.0
    memory = rank_memory(
        workload, L, vocab=vocab, stage_layers=layers, activations=sim.peak_activation_bytes, state=state
    )
    oom = [r for r, row in memory.items() if row["total"] > device.memory_bytes]
    return StepPrediction(L, step_s, tokens_per_s, mfu, time_s, memory, oom, sim)


def _pipeline(
    workload: Workload,
    L: Layout,
    device: Device,
    network: Network,
    m: int,
    step: int,
    vocab: int,
    layers: list[int],
    cache: dict,
) -> tuple[SimulationResult, float, float, dict[str, float], float]:
    """The simulated pipeline of one layout (collectives inside the actions), with the microbatch's
    tokens, the replica's encoder output bytes, the per-layer collective seconds and the forward FLOPs."""
    llm = workload.shapes["llm"]
    pk = ("packs", step, m, L.pp)
    if pk not in cache:
        packs = workload.step_packs(step, m)
        mbs = split_encoder_microbatches(packs, m, L.pp, balance=True)
        fwd = sum(
            model_flops(workload.model.llm_params, p.num_tokens,
                        attention_flops(p.seqlens, workload.model.llm_dim, workload.model.llm_layers, causal=True),
                        training=False)
            + sum(encoder_forward_flops(workload.model, s.modality, s.media_tokens) for s in p.samples)
            for p in packs
        )  # fmt: skip
        cache[pk] = (packs, mbs, fwd)
    packs, mbs, fwd_flops = cache[pk]
    rate = device.peak_flops * device.efficiency
    mp = L.model_parallel
    weights = [n * L.pp / llm.n_layers for n in layers]
    costs = modelled_step_costs(workload.model, packs, mbs, L.pp, rate * mp, L.dp, stage_weights=weights)
    tokens = costs.tokens_per_microbatch
    enc_out = sum(costs.encoder_output_bytes.values())
    per, _ = step_collectives(
        workload,
        L,
        network,
        device,
        tokens=tokens,
        encoder_output_bytes=enc_out,
        vocab=vocab,
        stage_layers=layers,
    )
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    comm_f = sum(per[f"{k}_fwd"] for k in ("tp", "cp", "ulysses"))
    comm_b = sum(per[f"{k}_bwd"] for k in ("tp", "cp", "ulysses"))
    llm_s: dict[Action, float] = {}
    for k in range(m):
        for s in range(L.pp):
            f = costs.duration(Action(F, k, s))
            llm_s[Action(F, k, s)] = f + layers[s] * comm_f
            llm_s[Action(B, k, s)] = 2 * f + (f if L.recompute else 0.0) + layers[s] * comm_b
    enc_b = {e: (3.0 if L.recompute else 2.0) * v for e, v in costs.encoder_forward_s.items()}
    act = [
        _stage_activation_bytes(llm, vocab, layers[s], workload.max_seq_len, L, last=s == L.pp - 1)
        for s in range(L.pp)
    ]
    enc_scale = (1.0 / 17.0 if L.recompute else 1.0) / mp  # recompute keeps each block's input only
    costs = dataclasses.replace(
        costs,
        llm_action_s=llm_s,
        encoder_backward_s=enc_b,
        llm_stored_bytes=act,
        encoder_stored_bytes={e: v * enc_scale for e, v in costs.encoder_stored_bytes.items()},
        encoder_output_bytes={e: v / mp for e, v in costs.encoder_output_bytes.items()},
        # a boundary activation per rank: its CP / Ulysses tokens, and 1/tp of them under SP
        llm_activation_bytes=costs.llm_activation_bytes
        / (L.cp * L.ulysses * (L.tp if L.sequence_parallel else 1)),
    )
    schedule = Schedule1F1B(L.pp, m)
    encoder_inputs = encoder_microbatch_ids(m, L.pp)
    sim = simulate(schedule, _flow(L.placement, schedule, encoder_inputs, costs), costs)
    return sim, tokens, enc_out, per, fwd_flops
