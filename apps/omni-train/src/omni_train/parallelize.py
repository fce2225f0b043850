"""How the trainer parallelises its model, in torchtitan's style: small ``apply_*`` steps, each driven by
the config, called by the trainer in this order:

1. :func:`apply_tp` (``parallel.tp``): Megatron-style tensor parallelism of every LLM block;
2. :func:`apply_ac` (``train.recompute``, ``train.recompute_modules``): activation checkpointing per
   block, or of chosen residual branches of each block (selective recompute);
3. :func:`apply_compile` (``train.compile``): ``torch.compile`` per block;
4. :func:`apply_offload` (``train.offload``): saved activations of chosen blocks kept in host memory;
5. :func:`apply_mixed_precision` (``train.dtype = "bfloat16"``): autocast forwards over float32 master
   parameters;
6. :func:`apply_dp` and :func:`apply_encoder_zero`: the gradient synchronisation of the LLM and of the
   encoders, returned as hooks the pipeline executor calls once per step after the last backward.

:func:`pipeline_groups` gives the executor its process groups.

Objective and gradient reduction, defined here once. The step's loss is the mean cross-entropy over every
target token of the step on every DP replica: each rank's loss is its own cross-entropy sum divided by the
step's global target count (:mod:`omni_train.loss`), so the objective is the plain *sum* of what the ranks
compute and every reduction is a plain sum of the parts the ranks hold (no averaging, no compensating
scale):

* LLM gradients are summed over the stage's data group: its DP replicas times its Ulysses ranks (each SP
  rank saw one chunk of every pack), i.e. ``ParallelState`` group ``dp_cp``;
* encoder gradients are summed over every rank (each runs a slice of the encoder work: encoder data
  parallelism spans the pipeline ranks); the TP ranks of a stage run the same encoder work on the same
  data, so the sum is divided by ``tp`` to count that work once. Under encoder ZeRO-2/3 the same sum is
  a reduce-scatter into sharded gradients (:func:`apply_encoder_zero`), never FSDP2's mean over its mesh.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed._composable import checkpoint

from omni_parallel import EncoderLayout, ParallelState, rank_groups
from omni_parallel.data_parallel import FlatGradients, all_reduce_gradients
from omni_parallel.encoder_zero import reduce_scatter_gradients
from omni_parallel.tensor_parallel import apply_tensor_parallel, llama_tp_plan
from omni_pipeline import PipelineGroups
from omni_train.activation_memory import ActivationMemory
from omni_train.config import RECOMPUTE, DType
from omni_train.encoders import Encoders
from omni_train.models import LLMStage
from omni_train.pipeline import RankStages

__all__ = [
    "EncoderGradientSync",
    "apply_ac",
    "apply_compile",
    "apply_dp",
    "apply_encoder_zero",
    "apply_mixed_precision",
    "apply_offload",
    "apply_tp",
    "pipeline_groups",
    "training_dtypes",
]


def apply_tp(stage: LLMStage, ps: ParallelState) -> None:
    """Shard every block of ``stage`` over the TP group (column-parallel Q/K/V and gate/up, row-parallel
    wo and w2: ``omni_parallel.tensor_parallel``). Block inputs and outputs stay replicated over TP, so the
    pipeline sends plain tensors, stage s TP rank t to stage s+1 TP rank t. No-op for ``tp = 1``."""
    if ps.size("tp") == 1:
        return
    tp_mesh = ps.device_mesh("tp")
    plan = llama_tp_plan(attention="attn", mlp="mlp")
    for block in stage.layers.values():
        apply_tensor_parallel(block, tp_mesh, plan)


def _blocks(stage: LLMStage, encoders: Encoders, families: Iterable[str]) -> list[nn.Module]:
    """The transformer blocks of the named families: ``llm`` (this stage's), ``image``, ``audio`` (each
    tower's encoder keeps its blocks in ``.blocks``)."""
    out: list[nn.Module] = []
    for family in families:
        if family == "llm":
            out.extend(stage.layers.values())
        elif family in encoders.towers:
            out.extend(encoders.towers[family].encoder.blocks)
    return out


def apply_ac(
    stage: LLMStage, encoders: Encoders, recompute: Iterable[str], modules: Iterable[str] = ()
) -> None:
    """Activation checkpointing per block of each family in ``recompute`` (``train.recompute``): a block
    keeps only its input for backward and recomputes the rest (non-reentrant ``torch.utils.checkpoint``
    through the composable ``checkpoint``, which leaves parameter names unchanged, so checkpoints and the
    optimizer state load either way). Recomputation is exact: gradients equal those without it.

    Selective recompute (``modules``, ``train.recompute_modules``: ``"attention"``, ``"mlp"``): only
    those residual branches of each block (``Block.attention_branch`` / ``mlp_branch``, the same on the
    encoders' ``EncoderBlock``) are checkpointed, the rest of the block keeps its activations
    (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022, §5).
    """
    kinds = list(modules)
    for block in _blocks(stage, encoders, recompute):
        if not kinds:
            checkpoint(block)
        for kind in kinds:
            name = f"{kind}_branch"
            setattr(block, name, _recomputed(getattr(block, name)))


def _recomputed(branch: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(branch)
    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(branch, *args, use_reentrant=False, **kwargs)

    return run


def _within(forward: Callable, context: Callable[[], contextlib.AbstractContextManager]) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with context():
            return forward(*args, **kwargs)

    return run


def apply_offload(
    stage: LLMStage, encoders: Encoders, offload: Iterable[str], memory: ActivationMemory
) -> None:
    """Every block of each family in ``offload`` (``train.offload``) keeps what it saves for backward in
    host memory (:meth:`ActivationMemory.offload` around its forward; MegaScale-Omni's selective
    offloading of encoder and LLM activations, its memory evaluation and 512K lesson). Call after :func:`apply_compile` (the hooks wrap the compiled forward). Exact: backward
    reads the same values back."""
    for block in _blocks(stage, encoders, offload):
        block.forward = _within(block.forward, memory.offload)


def training_dtypes(dtype: DType | str) -> tuple[torch.dtype, torch.dtype]:
    """``(parameter dtype, compute dtype)`` of ``train.dtype``: ``bfloat16`` keeps float32 master
    parameters and computes in bfloat16; float32 and float64 compute in their own dtype."""
    compute = getattr(torch, str(DType(dtype)))
    return (torch.float32 if compute == torch.bfloat16 else compute), compute


def apply_mixed_precision(stage: RankStages, encoders: Encoders, compute: torch.dtype) -> None:
    """Mixed precision over float32 master parameters, without FSDP (``train.dtype = "bfloat16"``).

    The parameters, their gradients, the gradient all-reduce, clipping and AdamW stay float32. Every
    stage's and the encoders' forward runs under ``torch.autocast(device, compute)`` (backward follows
    the forward's dtypes): matmuls and attention in ``compute`` (SDPA kernels accumulate the softmax in
    float32), while the residual stream stays float32 (embeddings and float32 residual additions), so
    RMSNorm / LayerNorm run in float32; the loss upcasts the logits (``omni_train.loss``). Pipeline
    transfers are in ``compute``: a stage that is not the last casts its output to ``compute`` for the
    wire, a stage that is not the first upcasts its input back to float32; encoder outputs go to stage 0
    in ``compute`` (``StepBuilder``'s dtype). No-op when ``compute`` is the parameters' dtype.

    Source: Micikevicius et al., "Mixed Precision Training" (2018), float32 master weights; PyTorch's
    ``torch.autocast`` recipe (bf16 needs no loss scaling).
    """
    first = next(stage.parameters())
    param, device_type = first.dtype, first.device.type
    if compute == param:
        return

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast(device_type, dtype=compute)

    for chunk in stage.chunks.values():
        chunk.forward = _wire_casts(_within(chunk.forward, autocast), chunk, param, compute)
    encoders.forward = _within(encoders.forward, autocast)


def _wire_casts(forward: Callable, chunk: LLMStage, param: torch.dtype, compute: torch.dtype) -> Callable:
    @functools.wraps(forward)
    def run(x: torch.Tensor, *args, **kwargs):
        y = forward(x if chunk.is_first else x.to(param), *args, **kwargs)
        return y if chunk.is_last else y.to(compute)

    return run


def apply_compile(stage: LLMStage, encoders: Encoders, enabled: bool, *, backend: str = "inductor") -> None:
    """``torch.compile`` every LLM and encoder block's forward (``train.compile``; off by default).

    Pack lengths change every step, so the token dimension is dynamic from the first call
    (``dynamic=True``): one compilation per block, none per pack length. Varlen attention runs outside the
    graph (``omni_parallel.varlen``). Parameter names do not change (the module is not wrapped).
    """
    if not enabled:
        return
    for block in _blocks(stage, encoders, RECOMPUTE):
        block.forward = torch.compile(block.forward, backend=backend, dynamic=True)


def apply_dp(stage: LLMStage, ps: ParallelState) -> Callable[[], None]:
    """The LLM's gradient sync: sum over this stage's data group (DP x Ulysses, group ``dp_cp``) with one
    all-reduce per bucket of flattened gradients (TP shards reduce their local part). Returns the hook."""
    group = ps.group("dp_cp") if ps.size("dp_cp") > 1 else None
    params = [p for p in stage.parameters() if p.requires_grad]
    return lambda: all_reduce_gradients(params, group)


@dataclass(frozen=True)
class EncoderGradientSync:
    """The encoders' gradient sync :func:`apply_encoder_zero` returns.

    ``sync(towers)``, on every rank after the step's last backward: ``towers`` names the towers that ran
    anywhere in the step (``StepInputs.media``), ``None`` all of them. ``sync.attach()``, after
    ``optimizer.zero_grad(set_to_none=True)`` and before the step's backwards: under ZeRO stage 0 the
    encoders' gradients become views of flat buffers the backwards accumulate into and the sync reduces
    with no copy (:class:`omni_parallel.data_parallel.FlatGradients`); under ZeRO 2/3 it does nothing.
    """

    reduce: Callable[[Collection[str] | None], None]
    attach: Callable[[], None] = lambda: None

    def __call__(self, towers: Collection[str] | None = None) -> None:
        self.reduce(towers)


def apply_encoder_zero(encoders: Encoders, ps: ParallelState, zero_stage: int = 0) -> EncoderGradientSync:
    """The encoders' layout and gradient sync (``parallel.encoder_zero``): see :class:`EncoderGradientSync`.

    ZeRO stage 0: every rank holds the encoders whole; their gradients are summed over every rank and
    divided by ``tp`` (see the module docstring). Each tower's gradients are views of a flat buffer of its
    own (encoder parameters in no tower, or in more than one, share another, always reduced), zeroed by
    ``attach``. A tower not in ``towers`` ran on no rank, so its gradients are those zeros on every rank
    and their sum is zeros too: it is not reduced (on an image-only step of ``omni-heavy`` that is the
    audio tower, 8 of the 18 MiB).

    ZeRO stages 2 and 3: each tower is FSDP2-sharded over every rank (``fully_shard`` per encoder block,
    then the tower: ``omni_parallel.EncoderState.shard``), so parameters (stage 3: also at rest),
    gradients and AdamW's moments are DTensor shards, ``1/world`` of them per rank. The towers run on the
    step-scoped schedule of :mod:`omni_parallel.encoder_zero`, which is what makes uneven encoder work
    safe: every rank all-gathers the parameters when the step starts (the pipeline executor calls
    ``EncoderAnchor.gather``), forwards and backwards issue no collective, and this hook, run on every
    rank after the step's last backward, sums the gradients with one reduce-scatter per bucket into
    sharded gradients (a plain sum, divided by ``tp`` as above: FSDP2's own reduction would average over
    the world) and reshards. A rank with fewer encoder microbatches, or none with media, joins both
    collectives all the same. Stage 2 keeps the gathered parameters' storage between steps, stage 3 frees
    it.

    Raises:
        ValueError: ``zero_stage`` other than 0, 2 or 3.
    """
    if zero_stage not in (0, 2, 3):
        raise ValueError(f"apply_encoder_zero: ZeRO stage {zero_stage} is not supported (0, 2 or 3)")
    tp = ps.size("tp")
    if zero_stage == 0:
        group = dist.group.WORLD if ps.world_size > 1 else None
        owners: dict[int, set[str]] = {}
        for n, t in encoders.towers.items():
            for p in t.parameters():
                owners.setdefault(id(p), set()).add(n)
        trainable = [p for p in encoders.parameters() if p.requires_grad]
        flats = {n: FlatGradients(p for p in trainable if owners.get(id(p)) == {n}) for n in encoders.towers}
        shared = FlatGradients(p for p in trainable if len(owners.get(id(p), ())) != 1)

        def reduce_replicated(towers: Collection[str] | None = None) -> None:
            shared.all_reduce(group, divide_by=tp)
            for n, flat in flats.items():
                if towers is None or n in towers:
                    flat.all_reduce(group, divide_by=tp)

        def attach() -> None:
            for flat in (shared, *flats.values()):
                flat.attach()

        return EncoderGradientSync(reduce_replicated, attach)
    state = ps.encoder_state(EncoderLayout(sp=1, fsdp=True, reshard_after_forward=zero_stage == 3))
    towers = list(encoders.towers.values())
    for tower in towers:
        state.shard(tower, blocks=list(tower.encoder.blocks))
    # sharded: every tower's reduce-scatter runs (FSDP2 reshards each after it), whatever ran
    return EncoderGradientSync(lambda _towers=None: reduce_scatter_gradients(towers, divide_by=tp))


def pipeline_groups(ps: ParallelState) -> PipelineGroups:
    """The executor's groups (collective: every rank calls it): the LLM's ``pp`` group and, for encoder
    outputs and their gradients, a second group over the same ranks in the same order, so encoder and
    LLM transfers between two ranks never share a communicator (NCCL ignores P2P tags). Gradient
    reduction is not the executor's (:func:`apply_dp`, :func:`apply_encoder_zero`)."""
    if ps.size("pp") == 1:
        return PipelineGroups()
    encoder_p2p, _ = dist.new_subgroups_by_enumeration(rank_groups(ps.world_size, ps.config, ps.order)["pp"])
    return PipelineGroups(pp=ps.group("pp"), encoder_p2p=encoder_p2p)
