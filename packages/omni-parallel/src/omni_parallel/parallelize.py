"""Parallelising a model in torchtitan's style: small ``apply_*`` steps over plain ``nn.Module``s.

Each step takes what it needs explicitly (the modules, their transformer blocks, a TP plan, the
:class:`~omni_parallel.state.ParallelState`), never a trainer's config or model classes. The order a
trainer calls them in:

1. :func:`apply_tp`: Megatron-style tensor parallelism of transformer blocks (a plan from
   :mod:`omni_parallel.tensor_parallel`);
2. :func:`apply_ac`: activation checkpointing per block, or of chosen residual branches of each block
   (selective recompute);
3. :func:`apply_compile`: ``torch.compile`` per block;
4. :func:`apply_offload`: saved activations of chosen blocks kept in host memory
   (:class:`~omni_parallel.activation_memory.ActivationMemory`);
5. :func:`apply_mixed_precision`: autocast forwards over float32 master parameters
   (:func:`training_dtypes`);
6. :func:`apply_dp` and :func:`apply_encoder_zero`: the gradient synchronisation of the LLM and of the
   encoders, returned as hooks a pipeline executor calls once per step after the last backward.

Gradient reduction. The objective these hooks assume is the plain *sum* of what the ranks compute (each
rank's loss is its own cross-entropy sum divided by the step's global target count), so every reduction
is a plain sum of the parts the ranks hold (no averaging, no compensating scale):

* LLM gradients are summed over the stage's data group: its DP replicas times its Ulysses ranks (each SP
  rank saw one chunk of every pack), i.e. ``ParallelState`` group ``dp_cp``;
* encoder gradients are summed over every rank (each runs a slice of the encoder work: encoder data
  parallelism spans the pipeline ranks); the TP ranks of a stage run the same encoder work on the same
  data, so the sum is divided by ``tp`` to count that work once. Under encoder ZeRO-2/3 the same sum is
  a reduce-scatter into sharded gradients (:func:`apply_encoder_zero`), never FSDP2's mean over its mesh.

Source: torchtitan ``parallelize_llama`` (apply_tp / apply_ac / apply_compile / apply_fsdp steps);
MegaScale-Omni's decoupled encoder parallelism.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.tensor.parallel import ParallelStyle

from omni_parallel.activation_memory import ActivationMemory
from omni_parallel.data_parallel import FlatGradients, all_reduce_gradients
from omni_parallel.encoder_zero import PendingReduction, TowerSync, reduce_scatter_gradients
from omni_parallel.state import EncoderLayout, ParallelState
from omni_parallel.tensor_parallel import apply_tensor_parallel, reduce_partial_gradients

__all__ = [
    "TRAINING_DTYPES",
    "EncoderGradientSync",
    "apply_ac",
    "apply_compile",
    "apply_dp",
    "apply_encoder_zero",
    "apply_mixed_precision",
    "apply_offload",
    "apply_tp",
    "training_dtypes",
]

TRAINING_DTYPES = ("float32", "float64", "bfloat16")  # the names training_dtypes accepts


def apply_tp(
    blocks: Iterable[nn.Module],
    ps: ParallelState,
    plan: Mapping[str, ParallelStyle],
    *,
    model: nn.Module | None = None,
    model_plan: Mapping[str, ParallelStyle] | None = None,
) -> None:
    """Shard every block in ``blocks`` over ``ps``'s TP group with ``plan`` (e.g.
    :func:`omni_parallel.tensor_parallel.llama_tp_plan`: column-parallel Q/K/V and gate/up, row-parallel
    output and down projections), then ``model`` (holding the blocks) with ``model_plan`` (its modules
    outside the blocks). Without sequence parallelism block inputs and outputs stay replicated over TP,
    so a pipeline sends plain tensors, stage s TP rank t to stage s+1 TP rank t. With it
    (``llama_tp_plan(sequence_dim=0)`` and
    :func:`~omni_parallel.tensor_parallel.sequence_parallel_plan` as ``model_plan``) they are plain
    tensors holding TP rank t's token shard, sent the same way. No-op for ``tp = 1``.

    Raises:
        ValueError: a plan key names no submodule of a block (or of ``model``).
    """
    if ps.size("tp") == 1:
        return
    tp_mesh = ps.device_mesh("tp")
    for block in blocks:
        apply_tensor_parallel(block, tp_mesh, dict(plan))
    if model is not None and model_plan:
        apply_tensor_parallel(model, tp_mesh, dict(model_plan))


def apply_ac(blocks: Iterable[nn.Module], branches: Iterable[str] = ()) -> None:
    """Activation checkpointing of each block in ``blocks``: a block keeps only its input for backward and
    recomputes the rest (non-reentrant ``torch.utils.checkpoint`` through the composable ``checkpoint``,
    which leaves parameter names unchanged, so checkpoints and the optimizer state load either way).
    Recomputation is exact: gradients equal those without it.

    Selective recompute (``branches`` not empty): only those methods of each block (its residual
    branches, e.g. ``"attention_branch"``, ``"mlp_branch"``) are checkpointed; the rest of the block keeps
    its activations (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
    Models", 2022, §5).

    Raises:
        ValueError: a block has no callable attribute named as one of ``branches``.
    """
    names = list(branches)
    for block in blocks:
        if not names:
            checkpoint(block)
        for name in names:
            branch = getattr(block, name, None)
            if not callable(branch):
                raise ValueError(f"apply_ac: {type(block).__name__} has no residual branch method {name!r}")
            setattr(block, name, _recomputed(branch))


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


def apply_offload(blocks: Iterable[nn.Module], memory: ActivationMemory) -> None:
    """Every block in ``blocks`` keeps what it saves for backward in host memory
    (:meth:`ActivationMemory.offload` around its forward; MegaScale-Omni's selective offloading of
    encoder and LLM activations). Call after :func:`apply_compile` (the hooks wrap the compiled
    forward). Exact: backward reads the same values back."""
    for block in blocks:
        block.forward = _within(block.forward, memory.offload)


def training_dtypes(dtype: str | torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """``(parameter dtype, compute dtype)`` of a training dtype (a name in :data:`TRAINING_DTYPES` or the
    torch dtype): ``bfloat16`` keeps float32 master parameters and computes in bfloat16; float32 and
    float64 compute in their own dtype.

    Raises:
        ValueError: a dtype other than float32, float64 or bfloat16.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in TRAINING_DTYPES:
        raise ValueError(f"training_dtypes: {dtype!r} is not a training dtype (one of {TRAINING_DTYPES})")
    compute = getattr(torch, name)
    return (torch.float32 if compute == torch.bfloat16 else compute), compute


def apply_mixed_precision(
    stages: Mapping[int, nn.Module],
    num_stages: int,
    compute: torch.dtype,
    *,
    modules: Iterable[nn.Module] = (),
) -> None:
    """Mixed precision over float32 master parameters, without FSDP.

    The parameters, their gradients, the gradient reduction, clipping and the optimizer stay in the
    parameters' dtype. Every stage's forward and each of ``modules``' (e.g. the encoders) runs under
    ``torch.autocast(device, compute)`` (backward follows the forward's dtypes): matmuls and attention in
    ``compute``, while what autocast leaves alone (embeddings, residual additions, norms) stays in the
    parameters' dtype. Pipeline transfers are in ``compute``: a stage that is not the last
    (``num_stages - 1``) casts its output to ``compute`` for the wire, a stage that is not the first
    (``0``) casts its input back to the parameters' dtype. The last stage's output (logits) is left as
    autocast makes it: the loss upcasts. No-op when ``compute`` is the parameters' dtype.

    Args:
        stages: this pipeline rank's stage modules, ``{global stage index: module}``; each module's
            forward takes the stage input (token ids on stage 0, hidden states ``[T, dim]`` otherwise)
            as its first argument.
        num_stages: stages of the whole pipeline.
        compute: the forward/backward dtype (:func:`training_dtypes`).
        modules: further modules whose forward runs under autocast, with no wire casts.

    Raises:
        ValueError: no stages, a stage index outside ``[0, num_stages)``, or stages without parameters.

    Source: Micikevicius et al., "Mixed Precision Training" (2018), float32 master weights; PyTorch's
    ``torch.autocast`` recipe (bf16 needs no loss scaling).
    """
    if not stages:
        raise ValueError("apply_mixed_precision: no stages")
    bad = sorted(s for s in stages if not 0 <= s < num_stages)
    if bad:
        raise ValueError(f"apply_mixed_precision: stage indices {bad} outside [0, {num_stages})")
    first = next((p for m in stages.values() for p in m.parameters()), None)
    if first is None:
        raise ValueError(
            "apply_mixed_precision: the stages hold no parameters (their dtype is the master dtype)"
        )
    param, device_type = first.dtype, first.device.type
    if compute == param:
        return

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast(device_type, dtype=compute)

    for s, stage in stages.items():
        wired = _wire_casts(_within(stage.forward, autocast), s == 0, s == num_stages - 1, param, compute)
        stage.forward = wired
    for module in modules:
        module.forward = _within(module.forward, autocast)


def _wire_casts(
    forward: Callable, is_first: bool, is_last: bool, param: torch.dtype, compute: torch.dtype
) -> Callable:
    @functools.wraps(forward)
    def run(x: torch.Tensor, *args, **kwargs):
        y = forward(x if is_first else x.to(param), *args, **kwargs)
        return y if is_last else y.to(compute)

    return run


def apply_compile(blocks: Iterable[nn.Module], *, backend: str | Callable = "inductor") -> None:
    """``torch.compile`` the forward of every block in ``blocks``.

    Pack lengths change every step, so the token dimension is dynamic from the first call
    (``dynamic=True``): one compilation per block, none per pack length. Varlen attention runs outside the
    graph (:mod:`omni_parallel.varlen`). Parameter names do not change (the module is not wrapped).

    Duck sizing is off while a compiled block runs (``torch.fx.experimental._config.use_duck_shape``):
    with it, dynamo gives sizes that are equal on the first call one symbol, so a ``cu_seqlens`` of as many
    boundaries as the RoPE table has columns (``head_dim / 2``), or as a block has heads, got guarded equal
    to them and the next pack with another document count compiled the block again.
    """
    for block in blocks:
        block.forward = _without_duck_sizing(torch.compile(block.forward, backend=backend, dynamic=True))


def _without_duck_sizing(compiled: Callable) -> Callable:
    """``compiled`` run with ``use_duck_shape = False`` (read when dynamo builds a frame's shape
    environment, so every frame and graph-break continuation it compiles is covered)."""
    from torch.fx.experimental import _config as fx_config

    @functools.wraps(compiled)
    def run(*args, **kwargs):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return run


def apply_dp(modules: Iterable[nn.Module], ps: ParallelState) -> Callable[[], None]:
    """The LLM's gradient sync: a plain sum over this stage's data group (DP x Ulysses, ``ps`` group
    ``dp_cp``) with one all-reduce per bucket of flattened gradients
    (:func:`omni_parallel.data_parallel.all_reduce_gradients`; TP shards reduce their local part). Under
    sequence parallelism the norms' partial weight gradients are first summed over TP
    (:func:`omni_parallel.tensor_parallel.reduce_partial_gradients`).

    Returns:
        The hook: call it on every rank of the group after the step's last backward (collective).
    """
    group = ps.group("dp_cp") if ps.size("dp_cp") > 1 else None
    params = [p for m in modules for p in m.parameters() if p.requires_grad]

    def sync() -> None:
        reduce_partial_gradients(params)
        all_reduce_gradients(params, group)

    return sync


@dataclass(frozen=True)
class EncoderGradientSync:
    """The encoders' gradient sync :func:`apply_encoder_zero` returns.

    ``sync.attach()``, after ``optimizer.zero_grad(set_to_none=True)`` and before the step's backwards:
    under ZeRO stage 0 the encoders' gradients become views of flat buffers the backwards accumulate into
    and the sync reduces with no copy (:class:`omni_parallel.data_parallel.FlatGradients`); under ZeRO
    2/3 it only starts the step's overlap state. ``sync.ready(done, towers)``, on every rank, any number
    of times during the step: the towers ``done`` have had their last backward of the step on this rank;
    each tower's collectives are then issued with ``async_op=True`` in one fixed order, the same on every
    rank (the step's towers in name order, a tower never before the ones ahead of it: see
    :class:`omni_parallel.encoder_zero.TowerSync`), so they overlap the backward actions that follow
    (the LLM's, another tower's). ``sync(towers)``, on every rank after the step's last backward: issues
    what is left, in the same order, and waits for it all. ``towers`` (at ``ready`` and at the sync alike)
    names the towers that ran anywhere in the step, ``None`` all of them. Without ``ready`` calls the sync
    reduces everything, as before the overlap.

    Attributes:
        reduce: the sync, ``reduce(towers)``.
        attach: see above.
        ready: see above; ``ready(done, towers)``.
    """

    reduce: Callable[[Collection[str] | None], None]
    attach: Callable[[], None] = lambda: None
    ready: Callable[[Collection[str], Collection[str] | None], None] = lambda done, towers=None: None

    def __call__(self, towers: Collection[str] | None = None) -> None:
        self.reduce(towers)


def apply_encoder_zero(
    encoders: nn.Module,
    towers: Mapping[str, nn.Module],
    ps: ParallelState,
    zero_stage: int = 0,
    *,
    blocks: Mapping[str, Sequence[nn.Module]] | None = None,
) -> EncoderGradientSync:
    """The encoders' layout and gradient sync: see :class:`EncoderGradientSync`. Collective with more than
    one rank (every rank calls it, with the same towers). The encoders' reductions run on
    ``ps.encoder_sync_group`` (``GroupSpec(encoder_sync=True)``), which no other collective uses, so that
    their issue points inside the step (:meth:`EncoderGradientSync.ready`) never interleave with another
    collective of the same group differently on different ranks.

    ZeRO stage 0: every rank holds ``encoders`` whole; their gradients are summed over every rank and
    divided by ``tp`` (see the module docstring). Each tower's gradients are views of a flat buffer of its
    own (parameters of ``encoders`` in no tower, or in more than one, share another, always reduced, after
    the towers once every tower is done on this rank), zeroed by ``attach``; a tower's sum is one async
    all-reduce per buffer, in place. A tower not in the sync's ``towers`` ran on no rank, so its gradients
    are those zeros on every rank and their sum is zeros too: it is not reduced.

    ZeRO stages 2 and 3: each tower is FSDP2-sharded over every rank (``fully_shard`` per block of
    ``blocks[name]``, then the tower: :meth:`omni_parallel.EncoderState.shard`), so parameters (stage 3:
    also at rest), gradients and AdamW's moments are DTensor shards, ``1/world`` of them per rank. The
    towers run on the step-scoped schedule of :mod:`omni_parallel.encoder_zero`, which is what makes
    uneven encoder work safe: every rank all-gathers the parameters when the step starts
    (``encoder_zero.gather_parameters``), forwards and backwards issue no collective, and each tower's
    gradients are summed with one reduce-scatter per bucket into sharded gradients (a plain sum, divided
    by ``tp`` as above: FSDP2's own reduction would average over the world), issued once the tower is done
    on this rank (``ready``) or at the sync, the tower resharded then. Every tower is reduced every step,
    whatever ran. A rank with fewer encoder microbatches, or none, joins both collectives all the same.
    Stage 2 keeps the gathered parameters' storage between steps, stage 3 frees it.

    Args:
        encoders: the module holding every encoder parameter (the towers and anything shared).
        towers: the towers by name (submodules of ``encoders``).
        ps: the parallel state (its world and ``tp`` size).
        zero_stage: 0, 2 or 3.
        blocks: ZeRO 2/3: each tower's transformer blocks, one FSDP2 unit each (default: none, the tower
            is one unit).

    Raises:
        ValueError: ``zero_stage`` other than 0, 2 or 3, ``blocks`` naming a tower not in ``towers``, or
            more than one rank and ``ps`` built without ``GroupSpec(encoder_sync=True)``.
    """
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, int) or zero_stage not in (0, 2, 3):
        raise ValueError(
            f"apply_encoder_zero: ZeRO stage {zero_stage!r} is not supported (zero_stage: 0, 2 or 3)"
        )
    blocks = dict(blocks or {})
    unknown = sorted(set(blocks) - set(towers))
    if unknown:
        raise ValueError(f"apply_encoder_zero: blocks given for towers {unknown} not in {sorted(towers)}")
    tp = ps.size("tp")
    # the encoders' reductions on a communicator of their own (the class docstring's issue order)
    group = ps.encoder_sync_group
    if group is None and ps.world_size > 1:
        raise ValueError(
            "apply_encoder_zero: the encoders' reductions need a group of their own: build the ParallelState "
            "with GroupSpec(encoder_sync=True)"
        )
    if zero_stage == 0:
        owners: dict[int, set[str]] = {}
        for n, t in towers.items():
            for p in t.parameters():
                owners.setdefault(id(p), set()).add(n)
        trainable = [p for p in encoders.parameters() if p.requires_grad]
        flats = {n: FlatGradients(p for p in trainable if owners.get(id(p)) == {n}) for n in towers}
        shared = FlatGradients(p for p in trainable if len(owners.get(id(p), ())) != 1)
        overlap = TowerSync(
            {n: functools.partial(_all_reduce_flat, flat, group, tp) for n, flat in flats.items()},
            lambda n: towers[n].parameters(),
            skip_idle=True,
            tail={"": functools.partial(_all_reduce_flat, shared, group, tp)},
        )

        def attach() -> None:
            overlap.reset()
            for flat in (shared, *flats.values()):
                flat.attach()

        return EncoderGradientSync(overlap, attach, overlap.ready)
    state = ps.encoder_state(EncoderLayout(sp=1, fsdp=True, reshard_after_forward=zero_stage == 3))
    for name, tower in towers.items():
        state.shard(tower, blocks=list(blocks.get(name, ())))

    def reduce_scatter(name: str) -> PendingReduction | None:
        return reduce_scatter_gradients([towers[name]], divide_by=tp, group=group, async_op=True)

    # sharded: every tower's reduce-scatter runs (FSDP2 reshards each after it), whatever ran
    overlap = TowerSync(
        {n: functools.partial(reduce_scatter, n) for n in towers},
        lambda n: towers[n].parameters(),
        skip_idle=False,
    )
    return EncoderGradientSync(overlap, overlap.reset, overlap.ready)


def _all_reduce_flat(
    flat: FlatGradients, group: dist.ProcessGroup | None, divide_by: float
) -> PendingReduction | None:
    """ZeRO 0's sum of one tower's flat gradient buffers over ``group``, issued async, in place (divided
    by ``divide_by`` once done); ``None`` without a group of more than one rank (nothing to sum)."""
    flat.all_reduce(None)  # local: a gradient set aside from its view copied in (FlatGradients.all_reduce)
    if group is None:
        return None
    buffers = list(flat.buffers.values())
    works = tuple(dist.all_reduce(b, op=dist.ReduceOp.SUM, group=group, async_op=True) for b in buffers)

    def then() -> None:
        if divide_by != 1:
            for b in buffers:
                b.div_(divide_by)

    return PendingReduction(works, then)
