"""The whole training step of one layout: the pipeline simulated action by action, plus every collective of
the step over a two-tier network, the optimizer, and per-rank memory with an OOM verdict.

A :class:`Layout` (pp with virtual stages, dp, tp with Megatron SP, CP ring / all-gather, Ulysses, EP, LLM
and encoder ZeRO, recompute, placement, reordering group) of a :class:`~omni_pipeline.workload.Workload` on a
:class:`Device` and a :class:`~omni_pipeline.cost.Network` is predicted by :func:`predict_step`:

* **Compute**: modelled FLOPs (:func:`omni_pipeline.modelled_step_costs`) at ``peak_flops * efficiency``
  per GPU; a pipeline position's ``tp * cp * ulysses`` ranks split its LLM and encoder work evenly
  (assumption: the encoders' share is split over the same ranks, as ``encoder_sp`` / the CP delivery
  spread samples). Recompute adds one forward to each backward (Chen et al. 2016; Korthikanti et al. 2022);
  selective recompute (``Layout.recompute_modules``, the trainer's ``train.recompute_modules``) adds the
  recomputed residual branches' share of it (:func:`recompute_fraction`, :func:`branch_forward_flops`:
  attention = Q/K/V/O matmuls + scores and values, MLP = the rest; per encoder microbatch likewise from
  its samples' towers) and repeats only those branches' collectives (TP: one of the two per layer per
  branch; CP and Ulysses: attention; EP: MLP).
* **Collectives inside each LLM forward / backward** (added to the action's seconds: they sit on its
  critical path; per layer of the stage, bf16 activations of ``T' = T / (cp * ulysses)`` tokens):

  - TP (group ``tp``, stride 1): 2 all-reduces of ``T' d`` elements per layer in forward and 2 in
    backward (Shoeybi et al., "Megatron-LM", 2019, §3, the ``f`` / ``g`` operators); with Megatron SP each
    becomes an all-gather + a reduce-scatter of the same volume (Korthikanti et al. 2022, §4.2.2), the
    same ring time. With async TP (``Layout.async_tp``, the trainer's ``parallel.async_tp``:
    :mod:`omni_parallel.async_tp`) each of them is a ring of ``tp`` P2P steps overlapped with the
    projection matmuls of its region (the attention's Q/K/V and output projection, the MLP's gate/up and
    down; in backward the adjoint rings with the input-gradient matmuls), and only the part of each ring
    the matmuls do not cover is priced: ``(tp - 1) * max(0, step - chunk matmul)`` per ring (Wang et al.,
    ASPLOS 2023; :func:`async_tp_exposed_s`, :func:`async_tp_layer_s`), the matmul seconds the layer's
    share of the action's own FLOPs at ``peak_flops * efficiency``; never more than the plain
    collective. Its activations are counted as ``omni-train memory`` counts them: each region keeps its
    gathered input once, in bf16, where plain SP's projections each keep a bf16 copy of it
    (:func:`omni_parallel.memory.block_activation_bytes` with ``async_tp``).
  - CP (group ``cp``, stride ``tp``): ``allgather``: K and V (``2 T'' kv`` elements, ``T'' = T / ulysses``)
    all-gathered in forward, their gradients reduce-scattered in backward (Llama 3, Dubey et al. 2024,
    §3.3.2); ``ring``: ``cp - 1`` P2P steps passing the local K and V (``2 T' kv``) in forward, K, V and
    their gradients in backward (Liu et al., "Ring Attention", 2023), not overlapped with compute
    (an upper bound).
  - Ulysses (group ``ulysses``, stride ``tp * cp``): 4 all-to-alls per layer in forward (Q, K, V in,
    the attention output back) and 4 in backward (Jacobs et al., "DeepSpeed Ulysses", 2023, §3).
  - EP (group ``ep``, stride ``tp * cp * ulysses``: carved out of DP, order tp-cp-ep-dp-pp as
    ``omni_parallel.topology``), per MoE layer (:class:`~omni_pipeline.workload.MoEShape`): the dispatch
    and the combine all-to-all in forward and their two adjoints in backward, each of the rank's
    ``T' * top_k`` (token, expert) rows of ``dim`` bf16 features, ``(ep - 1) / ep`` of them leaving the
    rank (Lepikhin et al., "GShard", 2020, §2.2; :mod:`omni_parallel.expert_parallel`: dropless, no
    capacity). Assumption: routing balanced (the aux loss's aim), so every rank of the EP group computes
    ``T' * top_k`` rows whatever ``ep`` is, and the all-to-all is timed at its mean volume.

  Recompute repeats the forward's collectives in backward.
* **Once per step** (after the pipeline: the step-scoped ZeRO schedule of :mod:`omni_parallel.llm_zero`
  gathers when the step starts, so nothing overlaps the gather here):
  LLM gradients over the stage's data group (``dp * cp * ulysses`` ranks, stride ``tp``): ZeRO-0
  all-reduce; ZeRO-1 all-gather + all-reduce; ZeRO-2/3 all-gather + reduce-scatter. At ZeRO 1-3 (not
  under :meth:`Layout.reshards`) the trainer issues each block's reduction during its stage's last
  backward (:meth:`omni_parallel.llm_zero.LLMGradientSync.arm`; PyTorch FSDP2's post-backward
  reduce-scatter, Megatron-LM's ``overlap_grad_reduce``), so on the busiest rank the reductions run one
  after another on a communication stream: block ``k``'s (per block, its own collective's alpha-beta
  time) starts when its share of that stage's simulated last backward is done (the action's seconds
  spread evenly over its blocks, last block first) or when the previous one ends, whichever is later;
  the root units' (embedding, final norm, LM head) start after the rank's last backward; only what ends
  after that backward is added to the step and shown in ``time_s`` (:func:`exposed_reduction_s`).
  Assumption: the overlapped collectives do not slow the backward they overlap (no SM or memory
  contention). ZeRO-0 (the trainer's :func:`omni_parallel.parallelize.apply_dp`) stays after the
  pipeline. Reductions move
  float32 gradients (``reduce_dtype``); all-gathers move bf16 copies (``MixedPrecisionPolicy.param_dtype``:
  the trainer's ``train.dtype = "bfloat16"``, the paper's; assumption: a float32 run gathers twice the
  bytes). ZeRO-3 under :meth:`Layout.reshards` (``llm_reshard = "always"``, or ``"auto"`` at ``pp = 1`` or
  one microbatch: :func:`omni_parallel.llm_zero.reshard_after_forward`) gathers the root units (embedding,
  final norm, LM head) once and every block in each microbatch's forward and again in its backward
  (``2 * microbatches`` gathers of a block's bytes); they are added to the step here, not to the
  actions (assumption: exact at ``pp = 1``, where the step is the one stage's actions in sequence). With EP, the
  routed experts (outside FSDP2, :mod:`omni_parallel.llm_zero`) have their gradients all-reduced over the
  expert-data-parallel group (``data_group / ep`` ranks, ``omni_parallel.topology.expert_groups``) at
  ZeRO-0; at ZeRO 1-3 each EP shard is further sharded over that group: one all-gather per step, then
  the gradient all-reduced (ZeRO-1) or reduce-scattered (ZeRO-2/3); the rest as above over the data group. The encoders
  over every rank (``encoder_zero``, :mod:`omni_parallel.encoder_zero`) the same way, once per step at
  float32 (no mixed-precision policy on the encoder units): the all-gather when the step starts; the
  reduction (ZeRO-0 all-reduce, ZeRO-2/3 reduce-scatter) issued on each rank, tower by tower, once the
  rank's last encoder backward using the tower has run (at the step's start on a rank without one:
  :meth:`omni_parallel.parallelize.EncoderGradientSync.ready`), so it overlaps the backward actions after
  it. Priced as one collective over every rank that starts when the last rank has issued it (the
  latest end of a rank's last encoder backward in the simulated timeline; assumption: every tower
  issued then, an upper bound where a tower's last backward comes earlier) and of which only what ends
  after the step's last backward is added (``max(0, start + collective - last backward's end)``,
  :func:`exposed_reduction_s`); without a timeline (the tuner's bounds) 0, the least any step leaves.
  Assumption: the overlapped reduction does not slow the backward actions nor the LLM's reduction it
  overlaps (its own communicator; link sharing not modelled). The reordering
  all-to-all (paper §4.2, Figure 20) over ``reorder_group`` DP replicas: each rank sends
  ``(g - 1) / g`` of its share of the step's encoder outputs; the balance it buys needs several replicas
  (``predict_step(encoder_microbatches=...)``: the encoder samples a replica was dealt,
  :mod:`omni_pipeline.replica_balance`). The AdamW step: memory-bound, 28 bytes per
  local parameter element (read parameter, gradient, two moments; write parameter, two moments; float32)
  over the device's HBM bandwidth.
* **Memory** per pipeline rank (:func:`rank_memory`): parameters, gradients and AdamW state per ZeRO stage
  from :func:`omni_parallel.memory.analytic_state_bytes` (or the exact bytes of a build, ``state=``, e.g.
  ``omni-train memory``'s; routed experts ``1 / ep`` per rank, and ``1 / (ep * edp)`` of
  them at ZeRO 1-3 with the EP shard's gathered copy kept at ZeRO-1/2, as :mod:`omni_parallel.memory` counts
  them), plus what ZeRO-2/3 hold only inside a step (the whole
  float32 gradients until the sync, ZeRO-3's gathered parameters: :func:`rank_memory`), plus the peak over the simulated timeline of stored activations: per LLM
  stage and microbatch :func:`omni_parallel.memory.block_activation_bytes` (bf16, after the CP / Ulysses
  split, TP / SP / recompute, whole-block or selective, honoured) times its layers (an MoE layer
  counted as a SwiGLU of
  ``top_k * expert_ffn_dim + shared`` features: the rows its experts compute per token; the router's
  and the all-to-alls' buffers left out), and on the last stage the loss's float32
  log-softmax over the vocabulary (what ``omni-train memory`` counts); encoder activations and outputs as
  the simulator holds them (whole-block recompute: each block's input, 1/17 of them; selective: the
  share :func:`omni_parallel.memory.block_activation_bytes` keeps of the tower's block, an assumption
  for the ViT's LayerNorm / GELU block, which ``omni-train memory`` does not count). OOM when a rank's
  peak (``total``: state + in-step + activations) exceeds
  ``Device.memory_bytes``.

* **Uneven stage splits** (``stage_layers``, the trainer's ``parallel.stage_layers``): each stage's
  actions take its layers' share. :func:`encoder_aware_stage_layers` is the split an Alpa-style planner
  finds for a prepended encoder (``benchmarks/paper_scale.py``'s AutoParallel baseline).

* **Virtual stages** (``Layout.virtual_stages = v > 1``): the layers split over ``pp * v`` stages
  (:func:`even_stage_layers`), rank ``r`` holding stages ``r, r + pp, ...``, run by the trainer's
  interleaved 1F1B (:class:`~omni_pipeline.schedules.ScheduleInterleaved1F1B`, Narayanan et al. 2021
  §2.2): each stage's actions take its layers' share of the microbatch's seconds (and of the per-layer
  collectives), every one of the ``pp * v - 1`` stage boundaries is a P2P of the boundary activation
  between neighbouring ranks (the last stage of a round wrapping from rank ``pp - 1`` to rank 0), so a
  microbatch crosses ``v`` times as many boundaries as under 1F1B; the smaller bubble and the extra
  transfers both come out of the simulation. Memory per rank sums its stages' state (the embedding on
  stage 0, the LM head on the last) and holds the activations its program keeps in flight (rank 0 warms
  up with ``(v - 1) * m' + 2 * (pp - 1)`` forwards of one-``v``-th stages, ``m'`` microbatches per
  round, against 1F1B's ``pp - 1`` whole ones). The encoder
  microbatches stay one slice per pipeline rank. ``megatron_dist`` runs under 1F1B only. Per-step ZeRO
  gathers and reductions are timed as one collective per rank over its stages' bytes (one per stage in
  the trainer: ``v - 1`` more latencies, left out).

* **Activation offload** (``Layout.offload``, the trainer's ``train.offload``): an offloaded block keeps
  what it saves for backward in pinned host memory (:meth:`omni_parallel.activation_memory.ActivationMemory.offload`,
  around each block's forward: :func:`omni_parallel.parallelize.apply_offload`), so its stored bytes leave
  the device except, under selective recompute, each recomputed branch's float32 input (the checkpoint
  holds it by reference on the device); outside the blocks the last stage's log-softmax stays.
  ``omni-train memory`` does not count offload (it plans the whole count), so the step model follows what
  the trainer measures (``peak_activation_bytes_per_rank`` drops, ``peak_offloaded_bytes_per_rank`` holds
  the rest). Encoders likewise per tower (a video sample: the image tower's). Time: the copy out is a
  synchronous ``copy_`` inside the forward and the copy back a ``to(non_blocking=True)`` on the compute
  stream inside the backward, so each offloaded LLM stage's forward and backward grow by its copied bytes
  (:func:`omni_parallel.memory.block_activation_bytes` less what stays, at the pack length) over
  ``Device.host_Bps``, each encoder microbatch's by its stored bytes' offloaded share; reported as
  ``time_s["offload"]`` (taken out of ``llm_compute`` / ``encoder_compute``). Assumption: a tensor two
  ops save is copied once (the trainer's hooks copy it per op: a lower bound then).
* **Data loading**: each rank decodes the payloads of the encoder microbatches it runs (the
  zero-redundancy loader, :mod:`omni_data.zero_redundancy`; TP rank 0 decodes for its group), one loader
  worker's time per sample its source's ``decode_s`` (:func:`loader_seconds`); with
  ``workload.loader_workers = w > 0`` workers running ahead of the step (the trainer's background
  preparation and decode pool) the step is ``max(compute step, max_r load_r / w)``, with ``w = 0`` (decode
  inline) ``compute step + max_r load_r``; ``time_s["data_loading"]`` is what the step waits for,
  :attr:`StepPrediction.loader_s` the slowest rank's whole decode.

Not modelled: expert load imbalance, imbalance between DP replicas (every replica runs the simulated
one's step), compute-communication overlap inside an action other than async TP's rings, offload copies overlapped with compute (the
trainer does not), host memory for offloaded activations, text tokenization in the loader, link
contention between groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from omni_data import Pack, SampleMeta, encoder_microbatch_ids, split_encoder_microbatches
from omni_parallel.flops import TransformerShape, attention_flops, model_flops
from omni_parallel.memory import BRANCHES, analytic_state_bytes, block_activation_bytes
from omni_pipeline.actions import Action, ActionKind, ScheduleError
from omni_pipeline.cost import (
    CostModel,
    Network,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    reduce_scatter_s,
)
from omni_pipeline.placement import encoder_ranks_for, simulate_disaggregated
from omni_pipeline.schedules import Schedule, Schedule1F1B, ScheduleInterleaved1F1B
from omni_pipeline.simulator import SimulationResult, simulate
from omni_pipeline.step_costs import (
    encoder_documents,
    encoder_tower,
    modelled_step_costs,
    sample_encoder_flops,
    sample_frames,
)
from omni_pipeline.workload import MoEShape, Workload

__all__ = [
    "OFFLOAD_FAMILIES",
    "PLACEMENTS",
    "Device",
    "Layout",
    "StepPrediction",
    "async_tp_exposed_s",
    "async_tp_layer_s",
    "branch_forward_flops",
    "encoder_aware_stage_layers",
    "even_stage_layers",
    "llm_stage_params",
    "loader_seconds",
    "offload_seconds",
    "predict_step",
    "rank_memory",
    "recompute_fraction",
    "stage_expert_params",
    "step_collectives",
    "step_time_lower_bound",
]

# placements predict_step runs (omni_pipeline.place policies, the Megatron-Dist / DistTrain and Optimus baselines)
PLACEMENTS = (
    "prepend_first_stage",
    "megatron_dist",
    "optimus_static",
    "isolated",
    "uniform_on_demand",
    "planned",
)
ADAMW_BYTES_PER_ELEMENT = 28  # read p, g, m, v; write p, m, v; float32 (4 bytes each)
MASTER_BYTES = 4  # float32 masters, gradients and AdamW moments (omni_parallel.parallelize mixed precision)
GATHER_BYTES = 2  # LLM ZeRO all-gathers bf16 copies (MixedPrecisionPolicy(param_dtype=bfloat16), llm_zero)
ENCODER_GATHER_BYTES = 4  # encoder ZeRO has no MixedPrecisionPolicy: it gathers the float32 shards
RESHARD_POLICIES = ("auto", "always", "never")
ACT_BYTES = 2  # bf16 activations under autocast
# block families Layout.offload names (omni_train.config.OFFLOAD: the LLM's, the ViT's, the audio encoder's)
OFFLOAD_FAMILIES = ("llm", "image", "audio")


@dataclass(frozen=True)
class Device:
    """One accelerator: ``memory_bytes`` of HBM, ``peak_flops`` dense FLOP/s at ``efficiency`` (the share
    sustained by the model's kernels), ``hbm_Bps`` memory bandwidth (the optimizer step), ``host_Bps`` its
    link to host memory per direction (activation offload's copies, ``Layout.offload``). Defaults: H100
    SXM (80 GB, 989 TFLOP/s bf16 dense, 3.35 TB/s; NVIDIA datasheet) at the paper's 0.4 (issue 31);
    ``host_Bps`` 25 GB/s, an assumption: what a pinned ``cudaMemcpy`` sustains over PCIe Gen4 x16 (32 GB/s
    nominal; Gen5, 64 GB/s nominal, about doubles it when the GPU's switch port is not shared with a NIC).

    Raises:
        ValueError: a value not > 0, or ``efficiency`` above 1 (named).
    """

    memory_bytes: float = 80e9
    peak_flops: float = 989e12
    efficiency: float = 0.4
    hbm_Bps: float = 3.35e12
    host_Bps: float = 25e9

    def __post_init__(self) -> None:
        bad = [k for k in ("memory_bytes", "peak_flops", "efficiency", "hbm_Bps", "host_Bps")
               if not getattr(self, k) > 0]  # fmt: skip
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
        recompute_modules: with ``recompute``, only these residual branches of each block recompute
            (selective recompute, the trainer's ``train.recompute_modules``:
            :func:`omni_parallel.parallelize.apply_ac`): ``"attention"`` (pre-norm, Q/K/V, attention,
            output projection) and / or ``"mlp"``; empty: the whole block. A branch's recompute costs
            its forward again in backward (:func:`recompute_fraction`) and keeps only its input
            (:func:`omni_parallel.memory.block_activation_bytes`). Without ``recompute`` it changes
            nothing (as in the trainer: no block is recomputed).
        offload: block families (:data:`OFFLOAD_FAMILIES`: ``"llm"``, ``"image"``, ``"audio"``; the
            trainer's ``train.offload``, :func:`omni_parallel.parallelize.apply_offload`) whose blocks keep
            what they save for backward in host memory: each block's saved tensors are copied to pinned
            host memory during its forward and back during its backward (module docstring). Not with
            whole-block ``recompute`` (such a block keeps nothing to offload: the trainer's preflight
            refuses it); with selective recompute the recomputed branches' inputs stay on the device.
        placement: one of :data:`PLACEMENTS`.
        reorder_group: DP replicas the reordering all-to-all spans (1: reorder within the replica only).
        ep: expert-parallel size, carved out of ``dp`` (``parallel.ep``): the MoE layers' routed experts
            sharded over ``ep`` ranks that exchange tokens by all-to-all; 1: every expert on every rank.
        llm_reshard: ``parallel.llm_reshard_after_forward`` (ZeRO-3): ``"auto"`` (``always`` unless
            ``pp > 1`` and more than one microbatch, :func:`omni_parallel.llm_zero.reshard_after_forward`),
            ``"always"`` (each block gathered per microbatch in forward and again in backward) or
            ``"never"`` (the stage gathered once per step and held through it).
        async_tp: async tensor parallelism (the trainer's ``parallel.async_tp``,
            :mod:`omni_parallel.async_tp`; needs ``sequence_parallel``, hence ``tp > 1``): each region's SP
            all-gather and reduce-scatter decomposed into a ring of ``tp`` P2P steps overlapped with its
            projection matmuls; only the exposed part of each ring is priced (:func:`async_tp_exposed_s`,
            module docstring); activations as :func:`omni_parallel.memory.block_activation_bytes`
            counts them under async TP (one gathered bf16 input per region).
        virtual_stages: LLM stages per pipeline rank (``parallel.virtual_stages``): 1 runs 1F1B
            (:class:`~omni_pipeline.schedules.Schedule1F1B`); ``v > 1`` splits the layers over
            ``pp * v`` stages, rank ``r`` holding stages ``r, r + pp, ...``, under interleaved 1F1B
            (:class:`~omni_pipeline.schedules.ScheduleInterleaved1F1B`, the trainer's
            ``parallel.schedule = "interleaved"``; Narayanan et al. 2021 §2.2).

    Raises:
        ValueError: a size < 1, ``sequence_parallel`` without ``tp > 1``, ``async_tp`` without
            ``sequence_parallel``, an unknown ``cp_attention``,
            ``placement`` or ZeRO stage, ``recompute_modules`` not distinct names of
            :data:`omni_parallel.memory.BRANCHES`, ``offload`` not distinct names of
            :data:`OFFLOAD_FAMILIES` or given with whole-block ``recompute``, or ``reorder_group`` /
            ``ep`` not dividing ``dp`` (named).
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    async_tp: bool = False
    cp: int = 1
    cp_attention: str = "allgather"
    ulysses: int = 1
    llm_zero: int = 0
    encoder_zero: int = 0
    recompute: bool = False
    recompute_modules: tuple[str, ...] = ()
    placement: str = "uniform_on_demand"
    reorder_group: int = 1
    ep: int = 1
    llm_reshard: str = "auto"
    virtual_stages: int = 1
    offload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        errors = [f"{k} must be an int >= 1, got {getattr(self, k)!r}" for k in
                  ("pp", "dp", "tp", "cp", "ulysses", "reorder_group", "ep", "virtual_stages")
                  if not (isinstance(getattr(self, k), int) and getattr(self, k) >= 1)]  # fmt: skip
        if self.sequence_parallel and self.tp < 2:
            errors.append("sequence_parallel needs tp > 1")
        if not isinstance(self.async_tp, bool):
            errors.append(f"async_tp must be True or False, got {self.async_tp!r}")
        elif self.async_tp and not (self.sequence_parallel and self.tp > 1):
            errors.append(
                f"async_tp needs sequence_parallel and tp > 1, got sequence_parallel={self.sequence_parallel}, "
                f"tp={self.tp}"
            )
        if self.cp_attention not in ("allgather", "ring"):
            errors.append(f"cp_attention must be 'allgather' or 'ring', got {self.cp_attention!r}")
        if not isinstance(self.recompute_modules, tuple):
            errors.append(f"recompute_modules must be a tuple, got {self.recompute_modules!r}")
        elif set(self.recompute_modules) - set(BRANCHES) or len(set(self.recompute_modules)) != len(
            self.recompute_modules
        ):
            errors.append(
                f"recompute_modules must be distinct names of {BRANCHES}, got {self.recompute_modules!r}"
            )
        if (
            not isinstance(self.offload, tuple)
            or set(self.offload) - set(OFFLOAD_FAMILIES)
            or len(set(self.offload)) != len(self.offload)
        ):
            errors.append(
                f"offload must be a tuple of distinct names of {OFFLOAD_FAMILIES}, got {self.offload!r}"
            )
        elif self.offload and self.recompute and not self.recompute_modules:
            errors.append(
                f"offload {self.offload!r} with whole-block recompute: such a block keeps nothing to offload "
                "(the trainer's train.offload / train.recompute rule); give recompute_modules or no offload"
            )
        if self.llm_reshard not in RESHARD_POLICIES:
            errors.append(f"llm_reshard must be one of {RESHARD_POLICIES}, got {self.llm_reshard!r}")
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
        if isinstance(self.ep, int) and isinstance(self.dp, int) and self.dp % max(self.ep, 1):
            errors.append(f"ep {self.ep} must divide dp {self.dp} (EP is carved out of DP)")
        if errors:
            raise ValueError("Layout: " + "; ".join(errors))

    @property
    def stages(self) -> int:
        """LLM stages of the pipeline: ``pp * virtual_stages``."""
        return self.pp * self.virtual_stages

    def rank_stages(self, rank: int) -> list[int]:
        """The LLM stages pipeline rank ``rank`` holds: ``rank, rank + pp, ...`` (round-robin, as
        :meth:`omni_pipeline.schedules.Schedule.rank_stages`)."""
        return [rank + v * self.pp for v in range(self.virtual_stages)]

    def stage_to_rank(self, stage: int) -> int:
        """The pipeline rank holding LLM stage ``stage``: ``stage % pp``."""
        return stage % self.pp

    def schedule(self, microbatches: int) -> Schedule:
        """The LLM schedule the trainer runs for this layout: 1F1B, or interleaved 1F1B over
        ``virtual_stages`` stages per rank.

        Raises:
            ValueError: interleaved 1F1B with ``microbatches`` not a multiple of its rounds
                (``max(1, microbatches // pp)``, the trainer's preflight rule), or ``microbatches`` < 1.
        """
        try:
            if self.virtual_stages == 1:
                return Schedule1F1B(self.pp, microbatches)
            return ScheduleInterleaved1F1B(self.pp, microbatches, self.virtual_stages)
        except ScheduleError as exc:
            raise ValueError(f"Layout.virtual_stages: {exc}") from None

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

    def reshards(self, microbatches: int) -> bool:
        """Whether ZeRO-3 re-gathers each block per microbatch (forward and backward): ``llm_zero == 3``
        over more than one rank and ``llm_reshard`` resolving to ``always`` (``auto``: unless ``pp > 1``
        and ``microbatches > 1``; :func:`omni_parallel.llm_zero.reshard_after_forward`)."""
        if self.llm_zero != 3 or self.data_group == 1:
            return False
        if self.llm_reshard == "auto":
            return not (self.pp > 1 and microbatches > 1)
        return self.llm_reshard == "always"

    @property
    def expert_data_group(self) -> int:
        """Ranks holding the same expert shard (routed-expert gradients are summed over them):
        ``data_group / ep``."""
        return self.data_group // self.ep


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


def encoder_aware_stage_layers(n_layers: int, stages: int, encoder_s: float, layer_s: float) -> list[int]:
    """Layers per stage when stage 0 also runs ``encoder_s`` seconds of encoder work per step (the
    encoders prepended to the first stage's graph) and every LLM layer costs ``layer_s`` seconds per
    step: the split minimising the busiest stage's seconds, ``max(encoder_s + n_0 layer_s, n_s
    layer_s)``, the rest shared out evenly (:func:`even_stage_layers`); of equally busy splits the one
    with the most layers on stage 0. This is the inter-operator pass of an Alpa-style automatic planner
    (Zheng et al., "Alpa", OSDI 2022, §5: stages balanced by their profiled costs) that does not know
    the modalities apart: it balances the encoder's seconds, it does not move them off stage 0. With
    ``stages`` fixed, Alpa's pipeline objective ``sum_s t_s + (B - 1) max_s t_s`` has a constant sum, so
    minimising the busiest stage is its optimum. Exact: for each ``n_0`` the even split of the rest
    minimises the other stages' maximum.

    Raises:
        ValueError: ``stages`` < 1, fewer layers than stages, or a negative or non-finite ``encoder_s`` /
            ``layer_s``.
    """
    if stages < 1 or n_layers < stages:
        raise ValueError(f"encoder_aware_stage_layers: {n_layers} layers cannot fill {stages} stages")
    if not (0 <= encoder_s < float("inf") and 0 <= layer_s < float("inf")):
        raise ValueError(
            f"encoder_aware_stage_layers: encoder_s {encoder_s!r} and layer_s {layer_s!r} must be finite and >= 0"
        )
    if stages == 1:
        return [n_layers]
    best: tuple[float, int] | None = None
    for n0 in range(1, n_layers - stages + 2):
        rest = even_stage_layers(n_layers - n0, stages - 1)
        busiest = max(encoder_s + n0 * layer_s, rest[0] * layer_s)
        if best is None or busiest <= best[0]:
            best = (busiest, n0)
    n0 = best[1]
    return [n0, *even_stage_layers(n_layers - n0, stages - 1)]


def llm_stage_params(
    shape: TransformerShape,
    vocab: int,
    layers: int,
    *,
    first: bool,
    last: bool,
    tp: int = 1,
    moe: MoEShape | None = None,
    first_layer: int = 0,
) -> tuple[float, int]:
    """``(parameters, tensors)`` one TP rank holds of an LLM stage of ``layers`` LLaMA blocks (LLM layers
    ``first_layer ..``), routed experts left out (:func:`stage_expert_params`): each block's matmul
    weights over ``tp`` (``llama_tp_plan``: Q/K/V/gate/up column-, O/down row-parallel) and its two
    RMSNorm weights whole; in an MoE layer of ``moe`` the router (``experts x dim``) and the shared SwiGLU
    (3 tensors) instead of the dense SwiGLU; the first stage's token embedding and the last stage's final
    norm and LM head (``vocab x dim``, untied), whole (not TP-sharded). No biases.
    """
    per_block = shape.layer_matmul_params / tp + 2 * shape.dim
    tensors_per_block = (7 if shape.gated_mlp else 6) + 2
    params = (
        layers * per_block + (vocab * shape.dim if first else 0) + ((vocab + 1) * shape.dim if last else 0)
    )
    tensors = layers * tensors_per_block + (1 if first else 0) + (2 if last else 0)
    if moe is not None:
        n = moe.moe_layers(first_layer, layers)
        params += n * moe.layer_params_delta(shape.dim, shape.mlp_dim) / tp
        tensors += n * (1 + (3 if moe.shared_width else 0) - 3)  # router + shared SwiGLU - dense SwiGLU
    return params, tensors


def stage_expert_params(
    shape: TransformerShape, moe: MoEShape | None, layers: int, *, first_layer: int = 0, ep: int = 1
) -> tuple[float, int]:
    """``(parameters, tensors)`` of the routed experts one rank holds of an LLM stage (layers
    ``first_layer .. first_layer + layers - 1``): ``experts / ep`` SwiGLU experts per MoE layer, stored as
    two tensors (``gate_up_proj``, ``down_proj``: :class:`omni_parallel.moe.GroupedExperts`). ``(0, 0)``
    for a dense LLM."""
    if moe is None:
        return 0.0, 0
    n = moe.moe_layers(first_layer, layers)
    return n * moe.expert_params(shape.dim) / ep, 2 * n


def _layer_offsets(layers: Sequence[int]) -> list[int]:
    return [sum(layers[:s]) for s in range(len(layers))]


def _stage_layers(shape: TransformerShape, layout: Layout, stage_layers: Sequence[int] | None) -> list[int]:
    """Layers of each of the layout's ``pp * virtual_stages`` stages (default :func:`even_stage_layers`).

    Raises:
        ValueError: fewer layers than stages, or ``stage_layers`` not one count per stage.
    """
    if stage_layers is None:
        return even_stage_layers(shape.n_layers, layout.stages)
    layers = list(stage_layers)
    if len(layers) != layout.stages:
        raise ValueError(
            f"stage_layers: {len(layers)} counts {layers}, need one per stage: pp * virtual_stages = "
            f"{layout.pp} * {layout.virtual_stages} = {layout.stages}"
        )
    return layers


def _rank_llm_params(
    shape: TransformerShape,
    vocab: int,
    layers: Sequence[int],
    layout: Layout,
    moe: MoEShape | None,
    rank: int,
) -> tuple[float, int, float, int, list[float]]:
    """What pipeline rank ``rank`` holds of the LLM, summed over its stages (:meth:`Layout.rank_stages`;
    the embedding on stage 0, the final norm and LM head on the last stage): ``(parameters, tensors,
    expert parameters, expert tensors, [each block's non-expert parameters] (ZeRO 1-3 only, else
    empty; in stage order))`` per TP rank (:func:`llm_stage_params`, :func:`stage_expert_params`)."""
    offsets = _layer_offsets(layers)
    last = len(layers) - 1
    p = xp = 0.0
    t = xt = 0
    blocks: list[float] = []
    for s in layout.rank_stages(rank):
        sp, st = llm_stage_params(
            shape, vocab, layers[s], first=s == 0, last=s == last, tp=layout.tp, moe=moe,
            first_layer=offsets[s],
        )  # fmt: skip
        ep_, et = stage_expert_params(shape, moe, layers[s], first_layer=offsets[s], ep=layout.ep)
        p, t, xp, xt = p + sp, t + st, xp + ep_, xt + et
        if layout.llm_zero >= 1:  # ZeRO-3's per-block gathers and the per-block reductions need them
            blocks += [
                llm_stage_params(shape, vocab, 1, first=False, last=False, tp=layout.tp, moe=moe,
                                 first_layer=offsets[s] + i)[0]
                for i in range(layers[s])
            ]  # fmt: skip
    return p, t, xp, xt, blocks


def _in_flight_activations(schedule: Schedule, rank: int, stage_bytes: Sequence[float]) -> float:
    """Peak over ``rank``'s program of the LLM activations it holds: each microbatch forwarded and not
    yet backwarded holds its stage's ``stage_bytes`` (``omni_train.memory_plan``'s count)."""
    live = peak = 0.0
    for a in schedule.program_view[rank]:
        if a.kind == ActionKind.FORWARD:
            live += stage_bytes[a.stage]
        elif a.kind == ActionKind.BACKWARD:
            live -= stage_bytes[a.stage]
        peak = max(peak, live)
    return peak


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
    shape: TransformerShape,
    vocab: int,
    layers: int,
    tokens: int,
    layout: Layout,
    *,
    last: bool,
    moe: MoEShape | None = None,
    first_layer: int = 0,
    host: bool = False,
) -> int:
    """Bytes one LLM stage stores per microbatch on the device (``omni-train memory``'s formula: block
    activations of the rank's ``tokens // (cp * ulysses)`` tokens times ``layers``, plus the float32
    log-softmax over the vocabulary on the last stage; an MoE layer as a SwiGLU of ``top_k *
    expert_ffn_dim + shared`` features, the module docstring's assumption).

    With ``"llm"`` in ``layout.offload`` each block's saved tensors go to host memory
    (:meth:`omni_parallel.activation_memory.ActivationMemory.offload`) except, under selective recompute,
    each recomputed branch's input (``tokens * dim`` float32 per branch, ``/ tp`` under SP), which the
    checkpoint holds by reference on the device; the log-softmax, outside the blocks, stays.
    ``host=True``: the bytes that go to host memory instead (0 without offload): what each microbatch
    copies out in its forward and back in its backward."""
    t = tokens // (layout.cp * layout.ulysses)
    offload = "llm" in layout.offload
    if host and not offload:
        return 0
    s = layout.tp if layout.sequence_parallel else 1
    kept = len(layout.recompute_modules) * (t * shape.dim * MASTER_BYTES // s) if layout.recompute else 0

    def block(ffn: int) -> int:
        full = _block(ffn)
        if not offload:
            return full
        return full - kept if host else kept

    def _block(ffn: int) -> int:
        return block_activation_bytes(
            t,
            shape.dim,
            shape.kv_dim,
            ffn,
            heads=shape.n_heads,
            tp=layout.tp,
            sequence_parallel=layout.sequence_parallel,
            async_tp=layout.async_tp,
            bytes_per=ACT_BYTES,
            master_bytes=MASTER_BYTES,
            recompute=layout.recompute,
            recompute_branches=layout.recompute_modules,
            kernel="flash",  # bf16 on CUDA: the fused varlen kernel (omni_parallel.varlen)
        )

    n_moe = moe.moe_layers(first_layer, layers) if moe is not None else 0
    total = block(int(shape.mlp_dim)) * (layers - n_moe)
    if n_moe:
        total += block(moe.top_k * moe.expert_ffn_dim + moe.shared_width) * n_moe
    return total + (t * vocab * 4 if last and not host else 0)


def rank_memory(
    workload: Workload,
    layout: Layout,
    *,
    vocab: int = 32000,
    stage_layers: Sequence[int] | None = None,
    activations: Mapping[int, float] | None = None,
    state: Mapping[int, Mapping[str, float]] | None = None,
    microbatches: int | None = None,
    cache: dict | None = None,
) -> dict[int, dict[str, float]]:
    """Bytes per pipeline rank: LLM and encoder state by kind held between steps (``llm_parameters`` ...
    ``enc_optimizer``, kinds of :data:`omni_parallel.memory.KINDS`), the bytes held only inside a step
    (``llm_in_step_gradients``, ``llm_in_step_gathered``, ``enc_in_step_gradients``,
    ``enc_in_step_gathered``), ``activations`` (the simulated peak, or the schedule's in-flight LLM
    activations when ``activations`` is not given), ``between_steps`` (the state) and ``total``: the
    step's peak, state + in-step + activations (what the OOM verdict compares with the device).

    In-step terms (the step-scoped ZeRO of :mod:`omni_parallel.llm_zero` / :mod:`omni_parallel.encoder_zero`;
    ``omni_train.memory_plan.in_step_bytes`` counts the same from a build): ZeRO-2/3 over more than one
    rank accumulates every microbatch's gradients UNSHARDED (float32) until the one reduce-scatter after
    the last backward: the stage's whole ``P x 4`` bytes, beside the shards written at the sync. ZeRO-3
    also holds gathered parameters (LLM: bf16, ``MixedPrecisionPolicy``; encoders: float32): the whole
    stage under ``llm_reshard`` ``never`` (and for the encoders always), or, when
    :meth:`Layout.reshards`, the root units (embedding, final norm, LM head) plus the two largest blocks
    (the one running and the one FSDP2 prefetches: an assumption). Routed experts hold their gradients
    between steps (counted there). The activations' peak and the sync are at different moments, so
    ``total`` is an upper bound by at most the smaller of the two.

    Args:
        workload: gives the shapes (``workload.shapes``) and the pack length.
        vocab: the LLM's vocabulary (LLaMA-2: 32000).
        stage_layers: layers per stage, ``pp * virtual_stages`` counts (default :func:`even_stage_layers`).
        activations: ``{pp rank: peak activation bytes}`` from a simulation; default: the schedule's
            in-flight LLM activations (1F1B: stage ``s`` holds ``min(pp - s, microbatches)`` microbatches;
            interleaved 1F1B: the peak over the rank's program of its stages' stored bytes, as
            ``omni-train memory`` counts them).
        state: ``{pp rank: {"llm": {kind: bytes}, "encoders": {kind: bytes}, "in_step": {"llm" |
            "encoders": {"gradients", "gathered"}}}}`` measured from a build (``omni-train memory``;
            ``in_step`` optional: analytic when absent); default:
            :func:`omni_parallel.memory.analytic_state_bytes` per stage.
        microbatches: per replica and step (default the workload's): decides ``llm_reshard = "auto"``.
        cache: a dict kept between calls of one search: interleaved 1F1B's schedules and in-flight
            peaks (read from its programs) are reused across layouts of the same ``pp``, virtual stages,
            microbatches and stage bytes.

    Raises:
        ValueError: the workload has no LLM shape, or the layers do not fill the stages.
    """
    if "llm" not in workload.shapes:
        raise ValueError(f"rank_memory: workload {workload.name!r} has no LLM shape")
    llm = workload.shapes["llm"]
    moe = workload.moe
    _check_ep(workload, layout)
    layers = _stage_layers(llm, layout, stage_layers)
    offsets = _layer_offsets(layers)
    enc_p, enc_t = _encoder_params(workload.shapes)
    m = workload.microbatches if microbatches is None else microbatches
    cache = {} if cache is None else cache
    sk = ("schedule", layout.pp, m, layout.virtual_stages)
    if activations is None and layout.virtual_stages > 1 and sk not in cache:
        cache[sk] = layout.schedule(m)
    out: dict[int, dict[str, float]] = {}
    for r in range(layout.pp):
        p, t, xp, xt, blocks = _rank_llm_params(llm, vocab, layers, layout, moe, r)
        in_step = (state[r].get("in_step") if state is not None else None) or {
            "llm": _llm_in_step(layout, p, blocks, m),
            "encoders": _encoder_in_step(enc_p, layout),
        }
        if state is not None:
            llm_state, enc_state = state[r]["llm"], state[r]["encoders"]
        else:
            llm_state = analytic_state_bytes(
                p, bytes_per=MASTER_BYTES, zero=layout.llm_zero, shards=layout.data_group, tensors=t,
                gathered_bytes_per=GATHER_BYTES,  # ZeRO-1/2's kept copy: bf16 (MixedPrecisionPolicy)
            )  # fmt: skip
            if layout.llm_zero == 1 and layout.data_group > 1:  # ZeRO-1 all-reduces whole gradients
                llm_state = dict(llm_state, gradients=p * MASTER_BYTES)
            if xp:  # routed experts: 1/ep per rank, further sharded over edp at ZeRO 1-3 (llm_zero)
                xs = analytic_state_bytes(
                    0, bytes_per=MASTER_BYTES, zero=layout.llm_zero, shards=layout.data_group, tensors=xt,
                    experts=xp * layout.ep, ep=layout.ep, expert_shards=layout.expert_data_group,
                )  # fmt: skip
                llm_state = {k: llm_state[k] + xs[k] for k in llm_state}
            enc_state = analytic_state_bytes(
                enc_p, bytes_per=MASTER_BYTES, zero=layout.encoder_zero, shards=layout.gpus, tensors=enc_t
            )
        if activations is not None:
            act = float(activations[r])
        else:
            stage_bytes = [
                _stage_activation_bytes(llm, vocab, layers[s], workload.max_seq_len, layout,
                                        last=s == layout.stages - 1, moe=moe, first_layer=offsets[s])
                if layout.stage_to_rank(s) == r else 0
                for s in range(layout.stages)
            ]  # fmt: skip
            if layout.virtual_stages == 1:  # 1F1B: stage r holds min(pp - r, microbatches) microbatches
                act = float(min(layout.pp - r, m) * stage_bytes[r])
            else:
                key = (*sk, r, tuple(stage_bytes))
                if key not in cache:
                    cache[key] = float(_in_flight_activations(cache[sk], r, stage_bytes))
                act = cache[key]
        row = {f"llm_{k}": float(v) for k, v in llm_state.items()}
        row |= {f"enc_{k}": float(v) for k, v in enc_state.items()}
        row["between_steps"] = sum(row.values())
        for part, pre in (("llm", "llm"), ("encoders", "enc")):
            for k in ("gradients", "gathered"):
                row[f"{pre}_in_step_{k}"] = float(in_step[part][k])
        row["activations"] = act
        row["total"] = (
            row["between_steps"]
            + act
            + sum(row[f"{pre}_in_step_{k}"] for pre in ("llm", "enc") for k in ("gradients", "gathered"))
        )
        out[r] = row
    return out


def _llm_in_step(
    layout: Layout, params: float, blocks: Sequence[float], microbatches: int
) -> dict[str, float]:
    """A pipeline rank's LLM in-step bytes (:func:`rank_memory`): ``params`` = its non-expert parameters
    per TP rank over its stages, ``blocks`` each of its blocks' (:func:`_rank_llm_params`)."""
    if layout.llm_zero < 2 or layout.data_group == 1:
        return {"gradients": 0.0, "gathered": 0.0}
    grads = params * MASTER_BYTES
    if layout.llm_zero == 2:
        return {"gradients": grads, "gathered": 0.0}
    if not layout.reshards(microbatches):
        return {"gradients": grads, "gathered": params * GATHER_BYTES}
    roots = params - sum(blocks)  # each stage's root unit: embedding / final norm / LM head
    return {"gradients": grads, "gathered": (roots + sum(sorted(blocks)[-2:])) * GATHER_BYTES}


def _encoder_in_step(enc_p: float, layout: Layout) -> dict[str, float]:
    """The encoders' in-step bytes (:func:`rank_memory`): ZeRO-2/3 whole float32 gradients, ZeRO-3 the
    gathered float32 towers (gathered when the step starts, :mod:`omni_parallel.encoder_zero`)."""
    if layout.encoder_zero < 2 or layout.gpus == 1 or not enc_p:
        return {"gradients": 0.0, "gathered": 0.0}
    gathered = enc_p * ENCODER_GATHER_BYTES if layout.encoder_zero == 3 else 0.0
    return {"gradients": enc_p * MASTER_BYTES, "gathered": gathered}


def _check_ep(workload: Workload, layout: Layout) -> None:
    if layout.ep == 1:
        return
    if workload.moe is None:
        raise ValueError(
            f"Layout.ep: {layout.ep} needs an MoE LLM (workload {workload.name!r} has no [model] moe)"
        )
    if workload.moe.experts % layout.ep:
        raise ValueError(
            f"Layout.ep: {layout.ep} does not divide the {workload.moe.experts} experts ([model] moe)"
        )


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
    microbatches: int = 1,
    last_backward: Mapping[int, tuple[float, float]] | None = None,
    encoder_last_backward: Mapping[int, tuple[float, float]] | None = None,
    pipeline_end_s: float | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of the step's collectives and optimizer (module docstring).

    Args:
        tokens: LLM tokens of one microbatch (``T``, before the CP / Ulysses split).
        microbatches: per replica and step: ZeRO-3 under :meth:`Layout.reshards` gathers each block
            ``2 * microbatches`` times.
        last_backward: ``{stage: (start_s, end_s)}`` of each LLM stage's last backward in the simulated
            timeline: at LLM ZeRO 1-3 (not under :meth:`Layout.reshards`) the LLM gradient reduction
            (``llm_all_reduce`` / ``llm_reduce_scatter``) is then only its part that ends after the
            busiest rank's last backward (:func:`exposed_reduction_s`); ``None`` (no timeline: the
            tuner's step-time bounds): the least that any backward can leave exposed, the shortest block
            collective plus the root units' (or the whole reduction in one, if shorter).
        encoder_last_backward: ``{rank: (start_s, end_s)}`` of each rank's last encoder backward in the
            simulated timeline (:func:`last_backward_windows` with ``encoder=True``; empty: no encoder
            backward in the step): the encoders' gradient reduction (``encoder_all_reduce`` /
            ``encoder_reduce_scatter``, over every rank) is then only its part that ends after the step's
            last backward (module docstring); ``None`` (no timeline): the least any step can leave, 0.
        pipeline_end_s: when the simulated pipeline's last action ends (its makespan), what the
            encoders' reduction is exposed after; default the latest end in ``last_backward`` and
            ``encoder_last_backward``.
        encoder_output_bytes: bytes of encoder output of one pipeline replica's step (the reordering
            all-to-all's payload, spread over the replica's ranks).

    Returns:
        ``(per_action, per_step)``: ``per_action``: ``{"tp" | "cp" | "ulysses": (forward seconds, backward
        seconds) of one layer}`` flattened as ``{"tp_fwd": s, "tp_bwd": s, ...}`` per LLM layer and
        microbatch, and ``"ep_fwd"`` / ``"ep_bwd"`` per MoE layer and microbatch; ``per_step``:
        ``{"llm_all_reduce" | "llm_all_gather" | "llm_reduce_scatter" | "expert_all_reduce" |
        "expert_all_gather" | "expert_reduce_scatter" | "encoder_all_reduce" | "encoder_all_gather" |
        "encoder_reduce_scatter" | "reorder_all_to_all" | "optimizer": seconds}`` of the busiest pipeline
        rank (the stage with the most local parameters).

    Raises:
        ValueError: ``layout.ep > 1`` without MoE, or ``ep`` not dividing the experts.
    """
    llm = workload.shapes["llm"]
    moe = workload.moe
    L = layout
    _check_ep(workload, L)
    if L.async_tp and moe is not None:
        raise ValueError(
            f"Layout.async_tp: priced for a dense LLM only (workload {workload.name!r} has [model] moe; the "
            "trainer runs no tensor parallelism with MoE)"
        )
    t_rank = tokens / (L.cp * L.ulysses)  # tokens per rank after CP / Ulysses
    per: dict[str, float] = dict.fromkeys(
        ("tp_fwd", "tp_bwd", "cp_fwd", "cp_bwd", "ulysses_fwd", "ulysses_bwd", "ep_fwd", "ep_bwd"), 0.0
    )
    # recompute repeats the forward's collectives of the recomputed branches in backward: TP's two
    # all-reduces (SP: all-gather + reduce-scatter) per layer are one per branch; CP's and Ulysses'
    # exchanges sit in the attention branch, EP's all-to-alls in the (MoE) MLP branch
    mods = (L.recompute_modules or BRANCHES) if L.recompute else ()
    redo = len(mods) / len(BRANCHES)
    redo_attn = 1.0 if "attention" in mods else 0.0
    redo_mlp = 1.0 if "mlp" in mods else 0.0
    if L.tp > 1:
        bw, lat = network.link(L.tp, 1)
        if L.async_tp:  # each ring overlapped with its region's projection matmuls: the exposed part only
            fwd_b, bwd_b = async_tp_layer_s(llm, t_rank, L.tp, bw, lat, device.peak_flops * device.efficiency)
            per["tp_fwd"] = sum(fwd_b.values())
            per["tp_bwd"] = sum(bwd_b.values()) + sum(fwd_b[b] for b in mods)
        else:
            # an all-reduce = an all-gather + a reduce-scatter of the same buffer (SP)
            one = all_reduce_s(ACT_BYTES * t_rank * llm.dim, L.tp, bw, lat)
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
        per["cp_fwd"], per["cp_bwd"] = fwd, bwd + redo_attn * fwd
    if L.ulysses > 1:
        bw, lat = network.link(L.ulysses, L.tp * L.cp)
        widths = (llm.dim, llm.kv_dim, llm.kv_dim, llm.dim)  # Q, K, V in; attention output back
        fwd = sum(all_to_all_s(ACT_BYTES * t_rank * w / L.tp, L.ulysses, bw, lat) for w in widths)
        per["ulysses_fwd"], per["ulysses_bwd"] = fwd, fwd + redo_attn * fwd
    if L.ep > 1:  # dispatch + combine in forward, their adjoints in backward (module docstring)
        bw, lat = network.link(L.ep, L.model_parallel)
        one = all_to_all_s(ACT_BYTES * t_rank * moe.top_k * llm.dim, L.ep, bw, lat)
        per["ep_fwd"], per["ep_bwd"] = 2 * one, (2 + 2 * redo_mlp) * one
    layers = _stage_layers(llm, L, stage_layers)
    ranks = [_rank_llm_params(llm, vocab, layers, L, moe, r) for r in range(L.pp)]  # over virtual stages
    zero_shards = L.data_group if L.llm_zero >= 1 else 1
    busy = max(range(L.pp), key=lambda r: ranks[r][0] / zero_shards + ranks[r][2])
    big, _, experts, _, blocks = ranks[busy]
    step: dict[str, float] = {}
    nbytes = MASTER_BYTES * big  # float32 gradient reductions (reduce_dtype)
    gbytes = GATHER_BYTES * big  # bf16 gathers (MixedPrecisionPolicy.param_dtype)
    bw, lat = network.link(L.data_group, L.tp)
    # LLM ZeRO 1-3: each block's reduction runs during its stage's last backward (llm_zero's Schedule)
    exposed: float | None = None  # the reduction's seconds after the last backward (ZeRO 1-3, overlapped)
    if L.llm_zero >= 1 and L.data_group > 1 and not L.reshards(microbatches):
        reduce = all_reduce_s if L.llm_zero == 1 else reduce_scatter_s
        whole = reduce(nbytes, L.data_group, bw, lat)
        rest = nbytes - MASTER_BYTES * sum(blocks)  # the root units (embedding, final norm, LM head)
        rest_s = reduce(rest, L.data_group, bw, lat) if rest > 0 else 0.0
        least = min((reduce(MASTER_BYTES * b, L.data_group, bw, lat) for b in blocks), default=0.0)
        # no timeline: the least any backward could leave exposed (a block's collective starts no earlier
        # than its share of the backward is done, the last block's at its end; the roots' after it)
        windows: list[tuple[float, float, list[float]]] | None = None if last_backward is None else []
        at = 0
        for s in L.rank_stages(busy):
            mine, at = blocks[at : at + layers[s]], at + layers[s]
            if windows is None or last_backward is None or s not in last_backward:
                windows = None
                continue
            cs = [reduce(MASTER_BYTES * b, L.data_group, bw, lat) for b in reversed(mine)]
            windows.append((*last_backward[s], cs))
        if windows is not None:
            exposed = exposed_reduction_s(windows, rest_s)
        elif last_backward is None:
            exposed = min(whole, least + rest_s)
        else:  # a stage without a simulated backward: all of it after the pipeline
            exposed = whole
    if L.llm_zero == 0:
        step["llm_all_reduce"] = all_reduce_s(nbytes, L.data_group, bw, lat)
    elif L.llm_zero == 1:
        step["llm_all_gather"] = all_gather_s(gbytes, L.data_group, bw, lat)
        step["llm_all_reduce"] = (
            exposed if exposed is not None else all_reduce_s(nbytes, L.data_group, bw, lat)
        )
    else:
        if L.reshards(microbatches):  # roots once per step; every block per microbatch, forward and backward
            roots = big - sum(blocks)
            step["llm_all_gather"] = all_gather_s(
                GATHER_BYTES * roots, L.data_group, bw, lat
            ) + 2 * microbatches * sum(all_gather_s(GATHER_BYTES * b, L.data_group, bw, lat) for b in blocks)
        else:
            step["llm_all_gather"] = all_gather_s(gbytes, L.data_group, bw, lat)
        step["llm_reduce_scatter"] = (
            exposed if exposed is not None else reduce_scatter_s(nbytes, L.data_group, bw, lat)
        )
    if experts:  # routed experts over the expert-data-parallel group (omni_parallel.topology.expert_groups)
        edp = L.expert_data_group
        xbytes = MASTER_BYTES * experts
        # its ranks span the stage's data group (stride tp) unless dp / ep is 1 (then cp * ulysses only)
        xbw, xlat = network.link(L.data_group if L.dp > L.ep else edp, L.tp)
        if L.llm_zero >= 1 and edp > 1:  # edp-sharded experts (llm_zero): one gather at attach, then
            step["expert_all_gather"] = all_gather_s(xbytes, edp, xbw, xlat)  # the whole gradient's
            if L.llm_zero == 1:  # all-reduce (ZeRO-1) or its reduce-scatter into the shard (ZeRO-2/3)
                step["expert_all_reduce"] = all_reduce_s(xbytes, edp, xbw, xlat)
            else:
                step["expert_reduce_scatter"] = reduce_scatter_s(xbytes, edp, xbw, xlat)
        else:
            step["expert_all_reduce"] = all_reduce_s(xbytes, edp, xbw, xlat)
    enc_p, _ = _encoder_params(workload.shapes)
    if enc_p:
        ebw, elat = network.link(L.gpus, 1)
        enc_bytes = MASTER_BYTES * enc_p
        if L.encoder_zero == 0:
            whole = all_reduce_s(enc_bytes, L.gpus, ebw, elat)
        else:
            step["encoder_all_gather"] = all_gather_s(enc_bytes, L.gpus, ebw, elat)
            whole = reduce_scatter_s(enc_bytes, L.gpus, ebw, elat)
        # issued per tower once a rank's last encoder backward using it has run (at the step's start on a
        # rank with none), over every rank: it runs once the last rank has issued it, and only what ends
        # after the step's last backward is exposed; no timeline: the least any step leaves, nothing
        if encoder_last_backward is None:
            exposed_enc = 0.0
        else:
            issue = max((end for _, end in encoder_last_backward.values()), default=0.0)
            ends = [end for _, end in (*encoder_last_backward.values(), *(last_backward or {}).values())]
            done = max(ends, default=issue) if pipeline_end_s is None else pipeline_end_s
            exposed_enc = exposed_reduction_s([(issue, issue, [whole]), (done, done, [])])
        step["encoder_all_reduce" if L.encoder_zero == 0 else "encoder_reduce_scatter"] = exposed_enc
    if L.reorder_group > 1:
        rbw, rlat = network.link(L.reorder_group, L.model_parallel)  # DP replicas are tp*cp*ulysses apart
        share = encoder_output_bytes / (L.pp * L.model_parallel)
        step["reorder_all_to_all"] = all_to_all_s(share, L.reorder_group, rbw, rlat)
    local = big / zero_shards + experts + enc_p / (L.gpus if L.encoder_zero >= 2 else 1)
    step["optimizer"] = ADAMW_BYTES_PER_ELEMENT * local / device.hbm_Bps
    return per, step


def async_tp_exposed_s(tp: int, comm_s: float, matmul_s: float) -> float:
    """Seconds of one decomposed collective-matmul ring over ``tp`` ranks that its matmuls do not cover,
    ``(tp - 1) * max(0, comm_s - matmul_s)`` (Wang et al., "Overlap Communication with Dependent
    Computation via Decomposition in Large Deep Learning Models", ASPLOS 2023, §4), for the rings of
    :mod:`omni_parallel.async_tp`: ``comm_s`` one P2P step (a chunk of ``1 / tp`` of the collective's
    bytes to the ring neighbour, its latency included), ``matmul_s`` one chunk's matmul.

    * all-gather-matmul (``_ag_ring``): at each of the first ``tp - 1`` steps the next chunk's transfer
      is posted, the chunk in hand multiplied, then the transfer waited for, ``max(comm_s, matmul_s)``;
      the last step multiplies the last chunk: ``(tp - 1) max(comm_s, matmul_s) + matmul_s``;
    * matmul-reduce-scatter (``_rs_ring``): the first chunk's partial product, then ``tp - 1`` steps each
      sending the accumulated sum while the next partial product is computed, waiting, adding:
      ``matmul_s + (tp - 1) max(comm_s, matmul_s)``.

    Both are ``tp * matmul_s`` of matmuls plus this; the plain collective is ``(tp - 1) * comm_s``
    (:func:`omni_pipeline.cost.all_gather_s`: the same ring), so this is never more. Assumptions: the P2P
    transfers do not slow the matmuls they overlap (no SM or memory contention), a chunk's matmul runs at
    the whole matmul's rate, the accumulator's addition is free.

    Raises:
        ValueError: ``tp < 1`` or a negative seconds value.
    """
    if tp < 1 or min(comm_s, matmul_s) < 0:
        raise ValueError(
            f"async_tp_exposed_s: need tp >= 1 and seconds >= 0, got tp={tp}, comm_s={comm_s}, matmul_s={matmul_s}"
        )
    return (tp - 1) * max(0.0, comm_s - matmul_s)


def async_tp_layer_s(
    shape: TransformerShape,
    tokens: float,
    tp: int,
    bandwidth_Bps: float,
    latency_s: float,
    flops_per_s: float,
) -> tuple[dict[str, float], dict[str, float]]:
    """Exposed seconds of one LLM layer's async-TP rings (:attr:`Layout.async_tp`) per residual branch of
    :data:`omni_parallel.memory.BRANCHES`: ``({"attention": s, "mlp": s}`` forward, the same backward``)``,
    for ``tokens`` tokens of one microbatch on the rank after CP / Ulysses (``T'``; ``T' / tp`` of them
    held under SP).

    Every ring moves bf16 activations of ``T' x dim`` (:mod:`omni_parallel.async_tp` casts to the
    autocast dtype before the ring): a P2P step is ``latency_s + 2 T' dim / tp / bandwidth_Bps`` (``tp -
    1`` such steps are the plain SP collective's ring time). A chunk's matmul is ``T' / tp`` rows against
    the rank's ``1 / tp`` of the projection's weights ``w``, ``2 (T' / tp) w / tp`` FLOPs at
    ``flops_per_s`` (the device's ``peak_flops * efficiency``: the rate every LLM action is timed at,
    :func:`omni_pipeline.step_costs.modelled_step_costs`). The four projections' ``w`` sum to
    :attr:`~omni_parallel.flops.TransformerShape.layer_matmul_params`, so the chunks over ``tp`` ranks and
    ``tp`` steps are exactly the layer's matmul FLOPs the action already counts: ``w = dim (dim + 2 kv)``
    for Q/K/V, ``dim^2`` for the output projection, ``(2 if gated else 1) dim ffn`` for gate/up, ``dim
    ffn`` for down. Per branch, :func:`async_tp_exposed_s` of each ring:

    * forward: the input's all-gather with the input projections, the output projection's
      matmul-reduce-scatter;
    * backward: the output gradient's all-gather with the output projection's input-gradient matmul
      (the same FLOPs as its forward), and the input gradient's reduce-scatter with the input
      projections' input-gradient matmuls (likewise); the weight gradients run after each ring (they need
      its gathered operand, or follow it in :mod:`omni_parallel.async_tp`'s backward) and hide nothing.

    Recompute repeats a branch's forward rings in backward (:func:`step_collectives`)."""
    d = float(shape.dim)
    step = latency_s + ACT_BYTES * tokens * d / tp / bandwidth_Bps

    def chunk(weights: float) -> float:  # one chunk's matmul: T'/tp rows against the rank's 1/tp of them
        return 2.0 * (tokens / tp) * weights / tp / flops_per_s

    inputs = {
        "attention": d * (d + 2.0 * shape.kv_dim),
        "mlp": (2.0 if shape.gated_mlp else 1.0) * d * shape.mlp_dim,
    }
    outputs = {"attention": d * d, "mlp": d * shape.mlp_dim}
    # forward and backward pair each ring with matmuls of the same FLOPs (module docstring's note above)
    one = {
        b: async_tp_exposed_s(tp, step, chunk(inputs[b])) + async_tp_exposed_s(tp, step, chunk(outputs[b]))
        for b in BRANCHES
    }
    return one, dict(one)


def exposed_reduction_s(
    windows: Sequence[tuple[float, float, Sequence[float]]], rest_s: float = 0.0
) -> float:
    """Seconds of a pipeline rank's LLM gradient reduction that end after its last backward, the
    reductions running one after another on a communication stream (:mod:`omni_parallel.llm_zero`'s
    Schedule: FSDP2's post-backward reduce-scatter, Megatron-LM's ``overlap_grad_reduce``).

    Args:
        windows: per stage of the rank, ``(start_s, end_s, [seconds of each block's collective, last block
            first])`` of the stage's last backward: the action's time is spread evenly over its blocks,
            last block first, and block ``j``'s collective starts when its share is done
            (``start_s + (j + 1) * (end_s - start_s) / n``) or when the collective before it ends,
            whichever is later.
        rest_s: seconds of what is reduced after the last backward (the root units: embedding, final
            norm, LM head), after the last block's collective.

    Returns:
        ``max(0, end of the last collective - end of the last window)``; with no window, ``rest_s``.

    Raises:
        ValueError: a window that ends before it starts, or a negative seconds value.
    """
    if rest_s < 0 or any(end < start or any(c < 0 for c in cs) for start, end, cs in windows):
        raise ValueError(f"exposed_reduction_s: bad windows {list(windows)} or rest_s {rest_s}")
    if not windows:
        return rest_s
    last = max(end for _, end, _ in windows)
    t = float("-inf")  # when the communication stream is free
    for start, end, cs in sorted(windows, key=lambda w: w[0]):
        share = (end - start) / len(cs) if cs else 0.0
        for j, c in enumerate(cs):
            t = max(t, start + (j + 1) * share) + c
    t = max(t, last) + rest_s
    return max(0.0, t - last)


def last_backward_windows(
    timelines: Mapping[int, Sequence], *, encoder: bool = False
) -> dict[int, tuple[float, float]]:
    """``{stage: (start_s, end_s)}`` of each LLM stage's last backward in a simulated timeline
    (``{rank: [TimelineEvent]}``, :class:`~omni_pipeline.trace.TimelineEvent` s, actions
    ``"<stage>B<mb>"``); ``encoder=True``: ``{rank: (start_s, end_s)}`` of each rank's last encoder
    backward (``"EB<mb>"``) that runs a sample (one of no seconds runs no tower: an encoder microbatch
    without media), ranks without one left out."""
    out: dict[int, tuple[float, float]] = {}
    for rank, evs in timelines.items():
        for ev in evs:
            if ev.kind == ("EB" if encoder else "B") and (not encoder or ev.end_s > ev.start_s):
                key = rank if encoder else Action.parse(ev.action).stage
                if key not in out or ev.end_s > out[key][1]:
                    out[key] = (ev.start_s, ev.end_s)
    return out


@dataclass
class StepPrediction:
    """What :func:`predict_step` predicts for one layout and step.

    Attributes:
        layout: the layout. step_time_s: seconds of the whole step.
        tokens_per_s: LLM tokens of the whole job per second (every replica).
        mfu: model FLOPs (no recompute) over ``step_time_s * gpus * peak_flops``.
        time_s: where the time goes on the pipeline's busiest rank, seconds: ``llm_compute``,
            ``encoder_compute``, ``tp`` / ``cp`` / ``ulysses`` / ``ep`` / ``offload`` (inside its actions),
            ``pipeline_idle`` (bubbles and P2P waits), then the per-step items of
            :func:`step_collectives` (the LLM ZeRO 1-3 gradient reduction and the encoders' reduction:
            only their seconds after the last backward, module docstring), then ``data_loading`` (the decode the step waits for); they sum to
            ``step_time_s``.
        memory: :func:`rank_memory`'s rows. oom: ranks whose ``total`` exceeds the device memory.
        simulation: the pipeline's :class:`~omni_pipeline.simulator.SimulationResult`.
        encoder_ranks: ``megatron_dist``: encoder ranks per pipeline replica (0 otherwise); the same GPUs
            then hold ``dp * pp / (pp + encoder_ranks)`` replicas, which ``tokens_per_s`` and ``mfu`` count.
        loader_s: seconds of payload decode of the step on the rank that decodes the most (one worker's
            time; ``time_s["data_loading"]`` is the part of it the step waits for: module docstring).
    """

    layout: Layout
    step_time_s: float
    tokens_per_s: float
    mfu: float
    time_s: dict[str, float]
    memory: dict[int, dict[str, float]]
    oom: list[int]
    simulation: SimulationResult | None = field(default=None, repr=False)
    encoder_ranks: int = 0
    loader_s: float = 0.0

    @property
    def peak_memory_bytes(self) -> float:
        """The largest rank's ``total``."""
        return max(m["total"] for m in self.memory.values())


def branch_forward_flops(
    shape: TransformerShape, doc_lengths: Sequence[int], *, causal: bool
) -> dict[str, float]:
    """Forward FLOPs of each residual branch of ``shape``'s blocks over documents of ``doc_lengths``
    tokens (:mod:`omni_parallel.flops`' count: every matmul weight twice per token, plus
    :func:`~omni_parallel.flops.attention_flops`): ``{"attention": n_layers * (2 T (2 d^2 + 2 d kv) +
    scores and values), "mlp": n_layers * 2 T * (the block's MLP weights)}``; they sum to
    :func:`omni_parallel.flops.forward_flops`. The branches are the trainer's
    (``omni_train.models.llm.Block.attention_branch`` / ``mlp_branch``, :data:`omni_parallel.memory.BRANCHES`;
    norms and RoPE left out, as the FLOP count leaves them out)."""
    n = float(sum(doc_lengths))
    d = float(shape.dim)
    attn_w = 2.0 * d * d + 2.0 * d * shape.kv_dim
    return {
        "attention": shape.n_layers * 2.0 * n * attn_w
        + attention_flops(doc_lengths, shape.dim, shape.n_layers, causal=causal),
        "mlp": shape.n_layers * 2.0 * n * (shape.layer_matmul_params - attn_w),
    }


def recompute_fraction(workload: Workload, layout: Layout, packs: Sequence[Pack]) -> float:
    """The share of the LLM's forward FLOPs over ``packs`` that ``layout``'s recompute runs again in
    backward: 1 for whole blocks (``recompute_modules`` empty), the recomputed branches' share
    (:func:`branch_forward_flops`) under selective recompute, 0 without recompute. The MLP branch's
    FLOPs are the forward's (``workload.model.llm_params``: an MoE's active experts) less the attention
    branch's. Every LLM action's backward adds this share of its forward (the step model times actions
    from the step's mean pack, so one share for the step)."""
    if not layout.recompute:
        return 0.0
    if not layout.recompute_modules:
        return 1.0
    llm = workload.shapes["llm"]
    total = attn = 0.0
    for p in packs:
        core = attention_flops(p.seqlens, llm.dim, llm.n_layers, causal=True)
        total += model_flops(workload.model.llm_params, p.num_tokens, core, training=False)
        attn += branch_forward_flops(llm, p.seqlens, causal=True)["attention"]
    if total <= 0:
        return 0.0
    share = {"attention": attn / total, "mlp": (total - attn) / total}
    return sum(share[b] for b in layout.recompute_modules)


def _encoder_recompute(
    workload: Workload, layout: Layout, packs: Sequence[Pack], mbs: Mapping[int, Sequence]
) -> tuple[dict[int, float], dict[int, float]]:
    """Per encoder microbatch: the share of its forward FLOPs that recompute runs again (1 for whole
    blocks, the recomputed branches' under selective recompute, 0 without) and, under selective
    recompute, the share of its stored activations kept (each sample's tower:
    :func:`omni_parallel.memory.block_activation_bytes` with and without the branches recomputed, at
    the sample's encoder sequence, bf16 over float32 masters; assumption: the ViT / audio block's
    LayerNorm and GELU MLP saved like the LLM block's RMSNorm and SwiGLU; weighted by ``_sizes``'
    stored bytes, layers x sequence x width)."""
    if not layout.recompute:
        return {}, {}
    if not layout.recompute_modules:
        return dict.fromkeys(mbs, 1.0), {}
    redo: dict[int, float] = {}
    kept: dict[int, float] = {}
    for e, items in mbs.items():
        done = total = st_all = st_kept = 0.0
        for tower, docs in _encoder_docs(workload, packs, items):
            shape = workload.shapes[tower]
            fl = branch_forward_flops(shape, docs, causal=False)
            total += sum(fl.values())
            done += sum(fl[b] for b in layout.recompute_modules)
            seq = sum(docs)
            kw = dict(heads=shape.n_heads, bytes_per=ACT_BYTES, master_bytes=MASTER_BYTES, kernel="flash")
            full = block_activation_bytes(seq, shape.dim, shape.kv_dim, int(shape.mlp_dim), **kw)
            sel = block_activation_bytes(seq, shape.dim, shape.kv_dim, int(shape.mlp_dim), recompute=True,
                                         recompute_branches=layout.recompute_modules, **kw)  # fmt: skip
            weight = shape.n_layers * seq * shape.dim
            st_all += weight
            st_kept += weight * sel / full
        redo[e] = done / total if total else 0.0
        kept[e] = st_kept / st_all if st_all else 1.0
    return redo, kept


def _encoder_docs(
    workload: Workload, packs: Sequence[Pack], items: Sequence
) -> Iterator[tuple[str, list[int]]]:
    """``(tower, documents)`` of each media sample among ``items`` (``(pack, sample)`` indices): the
    encoder tower that runs it and its attention documents' lengths in encoder tokens
    (:func:`omni_pipeline.step_costs.encoder_documents`); text samples are skipped."""
    ms = workload.model
    for pi, i in items:
        smp = packs[pi].samples[i]
        docs = encoder_documents(smp.modality, smp.media_tokens, ms.image_merge,
                                 frames=sample_frames(smp), temporal_patch=ms.temporal_patch)  # fmt: skip
        if docs:
            yield encoder_tower(smp.modality), docs


def _encoder_offload(
    workload: Workload, layout: Layout, packs: Sequence[Pack], mbs: Mapping[int, Sequence]
) -> dict[int, tuple[float, float]]:
    """Per encoder microbatch, with an encoder family in ``layout.offload``: ``(device, host)`` shares of
    its stored activations (``_sizes``' ``17 x`` count, weighted by layers x sequence x width as
    :func:`_encoder_recompute`) that stay on the device and that are copied to host memory. A sample of
    an offloaded tower (video: the image tower) keeps on the device only its recomputed branches' inputs
    under selective recompute (:func:`omni_parallel.memory.block_activation_bytes`' ``kept`` over its
    whole count; 0 without recompute); what recompute would keep of it goes to the host. A sample of a
    tower not offloaded keeps what recompute keeps (1, 1/17 for whole blocks, or the selective share).
    Empty without encoder offload."""
    if not set(layout.offload) - {"llm"}:
        return {}
    out: dict[int, tuple[float, float]] = {}
    for e, items in mbs.items():
        w_all = dev = host = 0.0
        for tower, docs in _encoder_docs(workload, packs, items):
            shape = workload.shapes[tower]
            seq = sum(docs)
            kw = dict(heads=shape.n_heads, bytes_per=ACT_BYTES, master_bytes=MASTER_BYTES, kernel="flash")
            full = block_activation_bytes(seq, shape.dim, shape.kv_dim, int(shape.mlp_dim), **kw)
            if not layout.recompute:
                kept = 1.0
            elif not layout.recompute_modules:
                kept = 1.0 / 17.0
            else:
                kept = block_activation_bytes(seq, shape.dim, shape.kv_dim, int(shape.mlp_dim), recompute=True,
                                              recompute_branches=layout.recompute_modules, **kw) / full  # fmt: skip
            on_device = kept
            if tower in layout.offload:  # (whole-block recompute with offload: refused by Layout)
                on_device = (len(layout.recompute_modules) * seq * shape.dim * MASTER_BYTES / full
                             if layout.recompute else 0.0)  # fmt: skip
            weight = shape.n_layers * seq * shape.dim
            w_all += weight
            dev += weight * on_device
            host += weight * (kept - on_device)
        out[e] = (dev / w_all, host / w_all) if w_all else (1.0, 0.0)
    return out


def loader_seconds(workload: Workload, samples: Sequence[SampleMeta]) -> float:
    """Seconds a loader worker spends reading and decoding ``samples``' payloads: each sample its
    source's ``decode_s`` (:class:`~omni_pipeline.workload.WorkloadSource`, the workload's per-source
    ``decode_ms``); a sample of a source the workload does not name, its modality's default
    (:data:`omni_pipeline.workload.DEFAULT_DECODE_MS`). Text samples cost nothing (their tokens come with
    the step's metadata)."""
    from omni_pipeline.workload import DEFAULT_DECODE_MS

    by_name = {src.name: src.decode_s for src in workload.sources}
    total = 0.0
    for smp in samples:
        if smp.source in by_name:
            total += by_name[smp.source]
        else:  # a video: its frames times the image's
            total += DEFAULT_DECODE_MS.get(str(smp.modality), 0.0) * 1e-3 * (sample_frames(smp) or 1)
    return total


def _moe_layers(workload: Workload, layers: Sequence[int]) -> list[int]:
    """MoE layers per stage (0 for a dense LLM)."""
    if workload.moe is None:
        return [0] * len(layers)
    return [workload.moe.moe_layers(o, n) for o, n in zip(_layer_offsets(layers), layers, strict=True)]


def _flow(placement: str, schedule, encoder_inputs, costs: CostModel):
    from omni_pipeline.placement import optimus_static
    from omni_pipeline.policy import place

    if placement == "optimus_static":
        return optimus_static(schedule, encoder_inputs, costs)
    if placement == "megatron_dist":
        return None
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
    packs: Sequence[Pack] | None = None,
    balance: bool = True,
    encoder_sp: bool = True,
    encoder_ranks: int | None = None,
    encoder_microbatches: Mapping[int, Sequence[SampleMeta]] | None = None,
) -> StepPrediction:
    """Predict one step of ``workload`` (its step ``step``'s packs, ``microbatches`` per replica, default
    the workload's) under ``layout`` (module docstring).

    Placement ``megatron_dist`` (Megatron-Dist / DistTrain, paper §6 baseline 2) runs the encoders on
    ``encoder_ranks`` ranks of their own per replica (default :func:`omni_pipeline.encoder_ranks_for` of
    this step, :func:`omni_pipeline.simulate_disaggregated`), out of the same GPUs.

    Args:
        state: exact per-rank state bytes (see :func:`rank_memory`); default analytic.
        packs: this replica's packs (``microbatches`` of them) instead of the workload's step ``step``.
        balance: split each microbatch's media into encoder microbatches by Karmarkar-Karp over encoder
            FLOPs (the paper's workload balancing); ``False``: in sample order (the ablation).
        encoder_sp: a pipeline position's ``tp * cp * ulysses`` ranks split its encoder work (long-short
            sequence parallelism for the encoders, paper §4); ``False`` (the ablation): one rank of the
            group runs each encoder microbatch whole while the others wait (assumption: the penalty's
            upper bound, encoder seconds times ``tp * cp * ulysses``).
        cache: a dict kept between calls of one search (same workload, device, network, vocab and
            stage layers): packs and pipeline simulations are reused across layouts that differ only in
            ``llm_zero`` / ``encoder_zero`` (which change neither). ``packs`` and
            ``encoder_microbatches`` are keyed by identity and kept alive by the cache.
        encoder_microbatches: ``{e: [sample]}`` the samples this replica's encoder microbatch ``e`` runs
            (for every ``e`` of :func:`omni_data.encoder_microbatch_ids` of ``microbatches`` and ``pp``),
            instead of its own split (:func:`omni_data.split_encoder_microbatches` of its packs): what
            the trainer's reordering across DP gives it (samples of any replica of its group,
            :func:`omni_pipeline.replica_balance.deal_encoder_samples`). Only encoder work follows them
            (forward and backward seconds, recompute, stored activations, ``megatron_dist``'s encoder
            ranks); the LLM's tokens and the encoder outputs sent to stage 0 stay this replica's packs'
            (the reordering's restore returns every row to its pack's replica before the P2P, paper §5.1).

    Raises:
        ValueError: fewer microbatches than stages, a workload without an LLM shape,
            ``encoder_microbatches`` not keyed by exactly the step's encoder microbatch ids.
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
    layers = _stage_layers(llm, L, stage_layers)
    if packs is not None:
        m = len(packs)
    if m < L.pp:
        raise ValueError(f"predict_step: {m} microbatches cannot fill {L.pp} stages")
    L.schedule(m)  # interleaved 1F1B: m a multiple of its rounds (raises ValueError)
    if L.virtual_stages > 1 and L.placement == "megatron_dist":
        raise ValueError(
            "predict_step: placement 'megatron_dist' is modelled under 1F1B only (its encoder ranks run "
            f"1F1B as the first of pp + 1 stages), not with virtual_stages = {L.virtual_stages}"
        )
    if encoder_microbatches is not None:
        want = {e for es in encoder_microbatch_ids(m, L.pp).values() for e in es}
        if set(encoder_microbatches) != want:
            raise ValueError(
                f"predict_step: encoder_microbatches must be keyed by the encoder microbatch ids 1..{len(want)} "
                f"of {m} microbatches x {L.pp} slices, got {sorted(encoder_microbatches)}"
            )
    opts = (
        None if packs is None else id(packs),
        balance,
        encoder_sp,
        encoder_ranks,
        None if encoder_microbatches is None else id(encoder_microbatches),
    )
    key = ("pipe", dataclasses.replace(L, llm_zero=0, encoder_zero=0), m, step, opts)
    if key not in cache:
        cache[key] = _pipeline(
            workload, L, device, network, m, step, vocab, layers, cache, packs, opts, encoder_microbatches
        )  # fmt: skip
    sim, tokens, enc_out, per, fwd_flops, er = cache[key][:6]
    (off_s, enc_off_s), load = cache[key][8:10]
    _, per_step = step_collectives(
        workload,
        L,
        network,
        device,
        tokens=tokens,
        encoder_output_bytes=enc_out,
        vocab=vocab,
        stage_layers=layers,
        microbatches=m,
        last_backward=last_backward_windows(sim.timelines),
        encoder_last_backward=last_backward_windows(sim.timelines, encoder=True),
        pipeline_end_s=sim.makespan_s,
    )
    step_s = sim.makespan_s + sum(per_step.values())
    # where the time goes on the busiest rank (it runs F and B of each of its stages for every microbatch)
    busiest = max(range(L.pp), key=lambda r: sum(ev.end_s - ev.start_s for ev in sim.timelines[r]))
    llm_c = enc_c = 0.0
    for ev in sim.timelines[busiest]:
        d = ev.end_s - ev.start_s
        if ev.is_encoder:
            enc_c += d
        else:
            llm_c += d
    own = L.rank_stages(busiest)
    n_layers = sum(layers[s] for s in own)
    time_s = {"llm_compute": 0.0, "encoder_compute": enc_c}
    for k in ("tp", "cp", "ulysses"):
        time_s[k] = m * n_layers * (per[f"{k}_fwd"] + per[f"{k}_bwd"])
    n_moe = sum(_moe_layers(workload, layers)[s] for s in own)
    time_s["ep"] = m * n_moe * (per["ep_fwd"] + per["ep_bwd"])
    # offload copies inside the busiest rank's actions: out in each forward, back in each backward
    llm_off = m * sum(2 * off_s[s] for s in own)
    enc_off = sum(
        enc_off_s.get(_action_microbatch(ev), 0.0) for ev in sim.timelines[busiest] if ev.is_encoder
    )
    time_s["offload"] = llm_off + enc_off
    time_s["encoder_compute"] = enc_c - enc_off
    time_s["llm_compute"] = llm_c - time_s["tp"] - time_s["cp"] - time_s["ulysses"] - time_s["ep"] - llm_off
    time_s["pipeline_idle"] = sim.makespan_s - llm_c - enc_c
    time_s |= per_step
    # data loading: the slowest rank's payload decode, ahead of the step in its loader's workers (the
    # step is the longer of the two), or inline before it without workers (it adds)
    loader_s = max(load.values(), default=0.0)
    workers = workload.loader_workers
    exposed = loader_s if workers == 0 else max(0.0, loader_s / workers - step_s)
    time_s["data_loading"] = exposed
    step_s += exposed
    replicas = L.dp * L.pp / (L.pp + er)  # megatron_dist: encoder ranks out of the same GPUs
    job_flops = 3 * fwd_flops * replicas  # model FLOPs (no recompute): backward = 2x forward
    mfu = job_flops / (step_s * L.gpus * device.peak_flops) if step_s > 0 else 0.0
    tokens_per_s = tokens * m * replicas / step_s if step_s > 0 else 0.0
    memory = rank_memory(
        workload, L, vocab=vocab, stage_layers=layers, activations=sim.peak_activation_bytes, state=state,
        microbatches=m,
    )  # fmt: skip
    oom = [r for r, row in memory.items() if row["total"] > device.memory_bytes]
    return StepPrediction(L, step_s, tokens_per_s, mfu, time_s, memory, oom, sim, er, loader_s)


def offload_seconds(
    workload: Workload,
    layout: Layout,
    *,
    device: Device | None = None,
    microbatches: int | None = None,
    vocab: int = 32000,
    stage_layers: Sequence[int] | None = None,
) -> float:
    """Seconds per step the busiest pipeline rank spends copying its offloaded LLM activations (out in
    each forward, back in each backward: ``2 * microbatches`` copies of each of its stages' offloaded
    bytes at the pack length over ``Device.host_Bps``; module docstring), 0 without LLM offload. They lie
    inside the rank's actions, which run one after another, so this is a lower bound of
    ``predict_step(...).step_time_s`` (``tune`` drops an offload layout whose copies alone are slower than
    its best plans)."""
    device = device or Device()
    if "llm" not in layout.offload:
        return 0.0
    llm = workload.shapes["llm"]
    m = workload.microbatches if microbatches is None else microbatches
    layers = _stage_layers(llm, layout, stage_layers)
    offsets = _layer_offsets(layers)
    host = [
        _stage_activation_bytes(llm, vocab, layers[s], workload.max_seq_len, layout, last=s == layout.stages - 1,
                                moe=workload.moe, first_layer=offsets[s], host=True)
        for s in range(layout.stages)
    ]  # fmt: skip
    return (
        max(2 * m * sum(host[s] for s in layout.rank_stages(r)) for r in range(layout.pp)) / device.host_Bps
    )


def step_time_lower_bound(
    workload: Workload,
    layout: Layout,
    sibling: StepPrediction,
    *,
    device: Device | None = None,
    network: Network | None = None,
    microbatches: int | None = None,
    vocab: int = 32000,
) -> float:
    """A lower bound of ``predict_step(workload, layout, ...).step_time_s`` (same step, microbatches and
    vocabulary, default stage split) from ``sibling``, the prediction of a layout that differs from
    ``layout`` only in ``virtual_stages``, ``llm_zero``, ``encoder_zero`` or the placement (not
    ``megatron_dist``), without simulating ``layout``'s pipeline.

    Every split of the layers over ``pp * virtual_stages`` stages and every colocated placement runs the
    same LLM and encoder work on the replica's ``pp`` ranks (each stage's seconds are proportional to its
    layers; the per-layer collectives and recompute likewise; the encoder microbatches are the same), so
    the pipeline's makespan is at least that total busy time over ``pp`` (a rank can do no better than the
    mean); the step adds the per-step collectives and optimizer of ``layout``
    (:func:`step_collectives`), the reordering all-to-all taken from ``sibling``.

    Raises:
        ValueError: ``sibling`` has no simulation, is a ``megatron_dist`` prediction, or differs from
            ``layout`` in anything else.
    """
    keep = {"virtual_stages": 1, "llm_zero": 0, "encoder_zero": 0, "placement": "uniform_on_demand"}
    if (
        sibling.simulation is None
        or sibling.layout.placement == "megatron_dist"
        or layout.placement == "megatron_dist"
        or dataclasses.replace(sibling.layout, **keep) != dataclasses.replace(layout, **keep)
    ):
        raise ValueError(
            f"step_time_lower_bound: {sibling.layout} is not a simulated colocated sibling of {layout}"
        )
    device = device or Device()
    network = network or Network()
    m = workload.microbatches if microbatches is None else microbatches
    sim = sibling.simulation
    busy = sum(ev.end_s - ev.start_s for r in range(layout.pp) for ev in sim.timelines[r])
    _, per_step = step_collectives(
        workload, layout, network, device, tokens=1.0, vocab=vocab, microbatches=m
    )  # fmt: skip
    per_step.pop("reorder_all_to_all", None)  # needs the encoder output bytes: the sibling's (the same)
    return busy / layout.pp + sum(per_step.values()) + sibling.time_s.get("reorder_all_to_all", 0.0)


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
    given: Sequence[Pack] | None = None,
    opts: tuple = (None, True, True, None, None),
    given_mbs: Mapping[int, Sequence[SampleMeta]] | None = None,
) -> tuple:
    """The simulated pipeline of one layout (collectives inside the actions), with the microbatch's
    tokens, the replica's encoder output bytes, the per-layer collective seconds, the forward FLOPs, the
    encoder ranks (``megatron_dist``; else 0) and the packs. The cache keys ``given`` and ``given_mbs``
    by id, so its entries hold them (an id is unique only while its object lives)."""
    llm = workload.shapes["llm"]
    _, balance, encoder_sp, encoder_ranks, _ = opts
    pk = ("packs", step, m, L.pp, opts[0], balance)
    if pk not in cache:
        packs = list(given) if given is not None else workload.step_packs(step, m)
        mbs = split_encoder_microbatches(packs, m, L.pp, balance=balance)
        fwd = sum(
            model_flops(workload.model.llm_params, p.num_tokens,
                        attention_flops(p.seqlens, workload.model.llm_dim, workload.model.llm_layers, causal=True),
                        training=False)
            + sum(sample_encoder_flops(workload.model, s) for s in p.samples)
            for p in packs
        )  # fmt: skip
        cache[pk] = (packs, mbs, fwd, given)
    packs, mbs, fwd_flops = cache[pk][:3]
    rate = device.peak_flops * device.efficiency
    mp = L.model_parallel
    S = L.stages  # pp * virtual_stages LLM stages; encoder slices stay one per pipeline rank
    weights = [n * S / llm.n_layers for n in layers]
    costs = modelled_step_costs(workload.model, packs, mbs, S, rate * mp, L.dp, stage_weights=weights)
    enc_packs, enc_mbs = packs, mbs  # the samples the encoders run: this replica's own, or given_mbs
    if given_mbs is not None:
        es = sorted(given_mbs)
        enc_packs = [Pack(samples=list(given_mbs[e]), max_seq_len=workload.max_seq_len) for e in es]
        enc_mbs = {e: [(j, i) for i in range(len(given_mbs[e]))] for j, e in enumerate(es)}
        enc = modelled_step_costs(workload.model, enc_packs, enc_mbs, S, rate * mp, L.dp)
        costs = dataclasses.replace(
            costs, encoder_forward_s=enc.encoder_forward_s, encoder_stored_bytes=enc.encoder_stored_bytes
        )
    if not encoder_sp:  # one rank of the position runs each encoder microbatch whole
        costs = dataclasses.replace(
            costs, encoder_forward_s={e: v * mp for e, v in costs.encoder_forward_s.items()}
        )
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
    redo = recompute_fraction(workload, L, packs) if L.recompute else 0.0
    enc_redo, enc_kept = _encoder_recompute(workload, L, enc_packs, enc_mbs)
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    comm_f = sum(per[f"{k}_fwd"] for k in ("tp", "cp", "ulysses"))
    comm_b = sum(per[f"{k}_bwd"] for k in ("tp", "cp", "ulysses"))
    n_moe = _moe_layers(workload, layers)
    offsets = _layer_offsets(layers)
    # offload (Layout.offload): each stage's saved block tensors copied to the host in its forward and
    # back in its backward, on the compute stream (apply_offload's copies are synchronous: they add)
    off_s = [
        _stage_activation_bytes(llm, vocab, layers[s], workload.max_seq_len, L, last=s == S - 1,
                                moe=workload.moe, first_layer=offsets[s], host=True) / device.host_Bps
        for s in range(S)
    ]  # fmt: skip
    llm_s: dict[Action, float] = {}
    for k in range(m):
        for s in range(S):
            f = costs.duration(Action(F, k, s))
            llm_s[Action(F, k, s)] = f + layers[s] * comm_f + n_moe[s] * per["ep_fwd"] + off_s[s]
            llm_s[Action(B, k, s)] = (
                2 * f + redo * f + layers[s] * comm_b + n_moe[s] * per["ep_bwd"] + off_s[s]
            )
    act = [
        _stage_activation_bytes(llm, vocab, layers[s], workload.max_seq_len, L, last=s == S - 1,
                                moe=workload.moe, first_layer=offsets[s])
        for s in range(S)
    ]  # fmt: skip
    # whole-block recompute keeps each block's input only (1/17 of _sizes' 17 x input); selective keeps
    # what block_activation_bytes keeps of the tower's block (enc_kept, per encoder microbatch)
    enc_scale = {e: (1.0 / 17.0 if L.recompute and not L.recompute_modules else enc_kept.get(e, 1.0)) / mp
                 for e in costs.encoder_stored_bytes}  # fmt: skip
    # encoder offload: what stays on the device, and the copies (out in forward, back in backward)
    enc_off = _encoder_offload(workload, L, enc_packs, enc_mbs)
    enc_off_s: dict[int, float] = {}
    for e, (dev, host) in enc_off.items():
        stored = costs.encoder_stored_bytes.get(e, 0.0) / mp
        enc_scale[e] = dev / mp
        enc_off_s[e] = stored * host / device.host_Bps
    enc_f = {e: v + enc_off_s.get(e, 0.0) for e, v in costs.encoder_forward_s.items()}
    enc_b = {
        e: (2.0 + enc_redo.get(e, 0.0)) * v + enc_off_s.get(e, 0.0)
        for e, v in costs.encoder_forward_s.items()
    }
    costs = dataclasses.replace(
        costs,
        llm_action_s=llm_s,
        encoder_forward_s=enc_f,
        encoder_backward_s=enc_b,
        llm_stored_bytes=act,
        encoder_stored_bytes={e: v * enc_scale[e] for e, v in costs.encoder_stored_bytes.items()},
        encoder_output_bytes={e: v / mp for e, v in costs.encoder_output_bytes.items()},
        # a boundary activation per rank: its CP / Ulysses tokens, and 1/tp of them under SP
        llm_activation_bytes=costs.llm_activation_bytes
        / (L.cp * L.ulysses * (L.tp if L.sequence_parallel else 1)),
    )
    schedule = L.schedule(m)  # 1F1B, or interleaved 1F1B: every stage boundary a P2P (stage s -> s + 1
    encoder_inputs = encoder_microbatch_ids(m, L.pp)  # on the next rank, the last of a round wrapping to 0)
    er = 0
    if L.placement == "megatron_dist":
        er = encoder_ranks if encoder_ranks is not None else encoder_ranks_for(costs, schedule)
        sim = simulate_disaggregated(schedule, encoder_inputs, costs, er)
    else:
        sim = simulate(schedule, _flow(L.placement, schedule, encoder_inputs, costs), costs)
    # offload seconds per encoder microbatch (the breakdown), and each rank's loader seconds: the
    # payloads of the encoder microbatches it runs (the zero-redundancy loader reads what a rank encodes)
    samples = {e: [enc_packs[pi].samples[i] for pi, i in items] for e, items in enc_mbs.items()}
    load = {
        r: sum(loader_seconds(workload, samples.get(_action_microbatch(ev), ())) for ev in evs if ev.kind == "EF")
        for r, evs in sim.timelines.items()
    }  # fmt: skip
    return sim, tokens, enc_out, per, fwd_flops, er, packs, given_mbs, (off_s, enc_off_s), load


def _action_microbatch(ev) -> int:
    """The microbatch of a timeline event (``"EF3"`` -> 3, ``"0F1"`` -> 1)."""
    return int(ev.action[ev.action.index(ev.kind) + len(ev.kind) :])
