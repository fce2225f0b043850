"""Bytes a rank holds, by kind: measured from the tensors' storages, planned before the first step (on the
meta device, no allocation), and the analytic formula both agree with.

Kinds (:data:`KINDS`), between steps, per rank:

* ``parameters``: the parameters' local storage (a ``DTensor``'s local shard; an FSDP2 shard with its
  padding);
* ``gathered``: whole-parameter copies kept allocated between steps (FSDP2 units with
  ``set_keep_unsharded_storage(True)``: encoder ZeRO-2, LLM ZeRO-1/2); 0 under ZeRO-3;
* ``gradients``: the gradients' local storage (each storage once: flat buffers count once);
* ``optimizer``: the optimizer state tensors of these parameters (AdamW: ``exp_avg``, ``exp_avg_sq`` in
  the parameter's dtype and shape, one 0-dim ``step`` per parameter).

:func:`state_bytes` measures a built, trained model. :func:`planned_state_bytes` predicts the same
numbers for a model that has not stepped yet, e.g. one built on the ``meta`` device over torch's fake
process group (:func:`omni_parallel.testing.fake_world`): parameters and FSDP2's gathered buffers are
read from the model as built; gradients and AdamW state, which appear only at the first backward and
step, are computed from each parameter's local shard exactly as torch allocates them
(``torch.optim.AdamW._init_group``; FSDP2's ``FSDPParam.init_all_gather_outputs``).
:func:`planned_fsdp_bytes` gives the same numbers for modules FSDP2 would shard over a 1-D mesh of any
size, from their unsharded shapes by FSDP2's chunk-and-pad rule, without building that world (FSDP2 cuts
every parameter into one chunk per rank as it shards: minutes at thousands of fake ranks).
:func:`analytic_state_bytes` is the formula (per rank, ``S = P_tp / tp + P_rep`` parameters of a
pipeline stage: ``P_tp`` the ones TP splits, the blocks' projections, counted before TP, ``P_rep`` the
ones every TP rank holds whole, norms, embedding and LM head; ``b`` bytes per element, ``W`` ranks of the
ZeRO group)::

    parameters = S b / (W if zero >= 1 else 1) + X b / (ep V)    (ZeRO 1-3 keep FSDP2 shards as the parameters)
    gathered   = S g + X b / ep         if zero in (1, 2) else 0    (X b / ep only with V > 1)
    gradients  = S b / (W if zero >= 2 else 1) + X b / (ep (V if zero >= 2 else 1))
    optimizer  = 2 S b / (W if zero >= 1 else 1) + 2 X b / (ep V) + s * tensors   (s: bytes of AdamW's step)

(Rajbhandari et al., "ZeRO", SC'20, §5: ZeRO-1 and 2 hold the whole parameters too, here as the kept
``gathered`` copy beside the shard; FSDP2 pads uneven shards, which the formula leaves out.) ``g`` is
the bytes per element of the gathered copy: FSDP2 gathers in ``MixedPrecisionPolicy.param_dtype`` (2 for
bfloat16 compute over float32 masters, ``train.dtype = "bfloat16"``), else ``b``. ``X`` counts the routed
experts' parameters of the stage (all ``E`` experts; :mod:`omni_parallel.moe`): sharded over the ``ep``
ranks of the expert-parallel group at every ZeRO stage (they stay out of FSDP2), and at ZeRO 1-3 each EP
shard over its ``V = dp_cp / ep`` expert-data-parallel ranks with the same stage semantics as ``S``
(``V = 1`` at ZeRO-0 or with one holder per shard; :mod:`omni_parallel.llm_zero`); ``S`` then counts the
rest.

:func:`block_activation_bytes` counts what one pre-norm decoder block (RMSNorm, RoPE, GQA attention with
the fused or the reference varlen kernel, SwiGLU; TP with or without Megatron SP, autocast, selective
recompute) saves for backward per microbatch, term by term; times the layers and microbatches a
pipeline rank holds in flight it is the activation estimate of a plan. :func:`saved_activation_bytes`
counts what autograd saves while a function runs (distinct storages, parameters excluded), on any device
including ``meta``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from omni_parallel.encoder_zero import shard_rows, sharded_units

__all__ = [
    "ATTENTION_KERNELS",
    "KINDS",
    "adamw_state_bytes",
    "analytic_state_bytes",
    "block_activation_bytes",
    "planned_fsdp_bytes",
    "planned_state_bytes",
    "saved_activation_bytes",
    "state_bytes",
    "storage_bytes",
]

KINDS = ("parameters", "gathered", "gradients", "optimizer")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a ``DTensor``: its local shard's), each storage
    once (a view and its base, two parameters' gradients in one flat buffer), also across calls sharing
    ``seen``. Storages are told apart by identity, not address, so ``meta`` tensors (address 0) count
    too. ``None`` entries and empty storages count 0."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        st = _local(t).untyped_storage()
        key = st._cdata  # the StorageImpl's address: shared by views, distinct per storage, meta included
        if st.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def _params(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Trainable parameters of ``modules``, each once, in module order."""
    out: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m.parameters():
            if p.requires_grad:
                out.setdefault(id(p), p)
    return list(out.values())


def _fsdp_params(modules: Iterable[nn.Module]) -> Iterator[Any]:
    """torch's ``FSDPParam`` of every FSDP2 unit inside ``modules`` (torch has no public accessor for
    the gathered buffers: they are read from each unit's state)."""
    for unit in sharded_units(modules):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            yield from group.fsdp_params


def state_bytes(
    modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes this rank holds for ``modules`` now, measured from the tensors' storages.

    Returns:
        ``{kind: bytes}`` over :data:`KINDS` (see the module docstring); each storage counted once.
    """
    modules = list(modules)
    seen: set[int] = set()
    params = _params(modules)
    out = {
        "parameters": storage_bytes(params, seen),
        "gathered": storage_bytes(
            (t for fp in _fsdp_params(modules) for t in getattr(fp, "all_gather_outputs", [])), seen
        )
        + storage_bytes((t for m in _edp_experts(modules) for t in m.gathered.values()), seen),
        "gradients": storage_bytes((p.grad for p in params), seen),
        "optimizer": 0,
    }
    if optimizer is not None:
        ids = {id(p) for p in params}
        out["optimizer"] = storage_bytes(
            (
                v
                for p, st in optimizer.state.items()
                if id(p) in ids
                for v in st.values()
                if torch.is_tensor(v)
            ),
            seen,
        )
    return out


def _edp_experts(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The :class:`~omni_parallel.moe.GroupedExperts` inside ``modules`` whose parameters are sharded over
    their expert-data-parallel ranks (:mod:`omni_parallel.llm_zero`), each once."""
    from omni_parallel.moe import GroupedExperts

    out: dict[int, nn.Module] = {}
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, GroupedExperts) and sub.edp_dims is not None:
                out.setdefault(id(sub), sub)
    return list(out.values())


def _step_bytes(group: dict[str, Any]) -> int:
    """Bytes of AdamW's 0-dim ``step`` tensor for a parameter of ``group`` (torch's ``_get_scalar_dtype``:
    float32 when fused, else float64 under a float64 default dtype)."""
    fused = bool(group.get("fused"))
    if fused or torch.get_default_dtype() != torch.float64:
        return 4
    return 8


def adamw_state_bytes(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor] | None = None) -> int:
    """Bytes of the state ``torch.optim.Adam`` / ``AdamW`` creates at its first step for ``params``
    (default: all of ``optimizer``'s), without stepping: per parameter ``exp_avg`` and ``exp_avg_sq`` of
    its local shard's shape and dtype (``max_exp_avg_sq`` too with ``amsgrad``) and a 0-dim ``step``.

    Raises:
        TypeError: ``optimizer`` is not Adam / AdamW (another optimizer's state is not modelled).
    """
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(f"adamw_state_bytes: Adam/AdamW only, got {type(optimizer).__name__}")
    wanted = None if params is None else {id(p) for p in params}
    total = 0
    for group in optimizer.param_groups:
        moments = 3 if group.get("amsgrad") else 2
        for p in group["params"]:
            if not p.requires_grad or (wanted is not None and id(p) not in wanted):
                continue
            local = _local(p)
            total += moments * local.numel() * local.element_size() + _step_bytes(group)
    return total


def planned_state_bytes(
    modules: Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    whole_gradients: bool = False,
) -> dict[str, int]:
    """What :func:`state_bytes` will measure for ``modules`` after their first training step, from the
    model as built (any device, ``meta`` included; nothing is allocated).

    Args:
        modules: the built, parallelised modules (FSDP2 / TP applied).
        optimizer: their optimizer (Adam/AdamW), not stepped yet; ``None``: ``optimizer`` is 0.
        whole_gradients: each FSDP2 unit's gradient is the whole parameter's (ZeRO-1: gradients
            all-reduced whole, state sharded), not its local shard's; parameters outside FSDP2 (e.g.
            EP-sharded experts) keep their local shard's.

    Returns:
        ``{kind: bytes}`` over :data:`KINDS`.
    """
    modules = list(modules)
    params = _params(modules)
    gathered = 0
    for fp in _fsdp_params(modules):
        if fp.keep_unsharded_storage:  # FSDPParam.init_all_gather_outputs: padded shard x shard ranks
            dtype = fp.mp_policy.param_dtype or fp.sharded_param.dtype  # FSDPParam.init_dtype_attrs
            numel = fp.padded_sharded_param_size.numel() * fp.mesh_info.shard_mesh_size
            gathered += numel * torch.empty((), dtype=dtype, device="meta").element_size()
    # experts sharded over their expert-data-parallel ranks: the kept gathered copy (ZeRO-1/2) of this
    # rank's EP block, and at ZeRO-1 its whole gradient (the shard's gradient a view of it)
    edp = _edp_experts(modules)
    gathered += sum(t.numel() * t.element_size() for m in edp for t in m.gathered.values())
    whole_edp = {
        id(p): p.to_local().numel() * p.device_mesh.size(1) for m in edp for p in m.parameters(recurse=False)
    }
    # ZeRO-1's whole gradients are the FSDP2 units' (parameters FSDP2 leaves out, e.g. EP-sharded experts,
    # keep gradients of their local shard unless sharded over their edp ranks)
    # (under TP the gathered tensor, whole over the data mesh, is the TP-local one: FSDPParam._orig_size)
    fsdp = {id(fp.sharded_param): math.prod(fp._orig_size) for fp in _fsdp_params(modules)}
    whole = {**fsdp, **whole_edp} if whole_gradients else {}
    grads = sum(whole.get(id(p), _local(p).numel()) * p.element_size() for p in params)
    return {
        "parameters": storage_bytes(params),
        "gathered": gathered,
        "gradients": grads,
        "optimizer": 0 if optimizer is None else adamw_state_bytes(optimizer, params),
    }


def planned_fsdp_bytes(
    modules: Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    world: int,
    rank: int,
    keep_gathered: bool,
    param_dtype: torch.dtype | None = None,
) -> tuple[dict[str, int], dict[str, int]]:
    """What ``fully_shard`` over a 1-D mesh of ``world`` ranks (FSDP2's default ``Shard(0)``; every
    unit on the same mesh, as :meth:`omni_parallel.EncoderState.shard` does for encoder ZeRO 2/3) gives
    rank ``rank`` for ``modules``, computed from the unsharded modules' parameter shapes (any device,
    ``meta`` included) without building the world: the bytes :func:`planned_state_bytes` would read from
    the sharded build, and what the units hold whole inside a step.

    FSDP2's rule (``FSDPParam._init_sharded_param``, ``_chunk_with_empty``): a parameter of shape
    ``[rows, *rest]`` is cut as ``torch.chunk`` cuts dim 0, chunks of ``c = ceil(rows / world)`` rows, the
    trailing ones short or empty (:func:`omni_parallel.encoder_zero.shard_rows`); every rank's shard
    lives in a zero-padded storage of ``c`` rows (an empty shard too), its parameter a view of its own
    rows. Per trainable parameter, ``e`` its element size, ``n`` the rank's rows times ``prod(rest)``::

        parameters = c prod(rest) e                      (the padded storage)
        gathered   = c world prod(rest) g   if keep_gathered (every managed parameter, frozen included)
        gradients  = n e
        optimizer  = moments n e + s                     (AdamW's exp_avg, exp_avg_sq; step of s bytes)

    ``g`` is the element size of ``param_dtype`` (FSDP2's ``MixedPrecisionPolicy.param_dtype``), else of
    the parameter's dtype.

    Args:
        modules: the modules as they will be sharded (unsharded; their parameters, each once).
        optimizer: an Adam/AdamW holding these parameters (unsharded): its groups give ``amsgrad``'s third
            moment and the step tensor's bytes (:func:`adamw_state_bytes`); ``None``: ``optimizer`` 0.
            An optimizer over the sharded parameters may differ only in ``fused`` (torch's fused kernel
            takes no DTensor), which changes the step's bytes only under a float64 default dtype.
        world: ranks of the FSDP2 mesh. rank: this rank's index in it.
        keep_gathered: the units keep their gathered storage between steps (ZeRO-2,
            ``set_keep_unsharded_storage(True)``); False: ZeRO-3.
        param_dtype: FSDP2's mixed-precision gather dtype; ``None``: none.

    Returns:
        ``(state, unsharded)``: ``state`` as :func:`planned_state_bytes` (:data:`KINDS`); ``unsharded`` =
        ``{"gradients": whole gradients in the shards' dtype, "gathered": the all-gather outputs (padded
        shard x world, in ``g``)}`` over every managed parameter, frozen ones included: what
        ``omni_train.memory_plan.in_step_bytes`` reads from the units.

    Raises:
        ValueError: ``world`` < 1, ``rank`` outside ``[0, world)``, or a 0-dim parameter (FSDP2 shards
            dim 0; names the parameter).
        TypeError: ``optimizer`` is not Adam / AdamW (another optimizer's state is not modelled).
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"planned_fsdp_bytes: world must be an int >= 1, got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"planned_fsdp_bytes: rank must be in [0, {world}), got {rank!r}")
    groups = {}
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
            raise TypeError(f"planned_fsdp_bytes: Adam/AdamW only, got {type(optimizer).__name__}")
        groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    gathered_size = None if param_dtype is None else torch.empty((), dtype=param_dtype).element_size()
    state = dict.fromkeys(KINDS, 0)
    whole = {"gradients": 0, "gathered": 0}
    seen: set[int] = set()
    for root in modules:
        for name, p in root.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.dim() == 0:
                raise ValueError(f"planned_fsdp_bytes: {name} is 0-dim; FSDP2 shards dim 0")
            rows, rest, size = p.shape[0], math.prod(p.shape[1:]), p.element_size()
            chunk = -(-rows // world)
            gathered = chunk * world * rest * (size if gathered_size is None else gathered_size)
            whole["gradients"] += p.numel() * size
            whole["gathered"] += gathered
            if keep_gathered:
                state["gathered"] += gathered
            if not p.requires_grad:
                continue
            local = shard_rows(rows, world, rank)[1] * rest
            state["parameters"] += chunk * rest * size
            state["gradients"] += local * size
            g = groups.get(id(p))
            if g is not None:
                state["optimizer"] += (3 if g.get("amsgrad") else 2) * local * size + _step_bytes(g)
    return state, whole


def analytic_state_bytes(
    params: float,
    *,
    replicated: float = 0,
    bytes_per: int = 4,
    tp: int = 1,
    zero: int = 0,
    shards: int = 1,
    tensors: int = 0,
    step_bytes: int = 4,
    gathered_bytes_per: int | None = None,
    experts: float = 0,
    ep: int = 1,
    expert_shards: int = 1,
) -> dict[str, float]:
    """The module docstring's formula: bytes per rank of a stage whose TP-sharded parameters number
    ``params`` (before TP) and whose TP-replicated ones ``replicated`` (and routed-expert ones ``experts``).

    Args:
        params: parameters of the rank's stage that TP splits (the blocks' projections), all TP ranks
            together.
        replicated: parameters every TP rank holds whole (norms, embedding, LM head: the app's TP plan,
            ``omni_parallel.tensor_parallel.llama_tp_plan``, shards the blocks' projections only).
        bytes_per: bytes per element of parameters, gradients and AdamW moments (float32: 4).
        tp: TP ranks ``params`` are split over.
        zero: ZeRO stage 0-3 over ``shards`` ranks.
        shards: ranks of the ZeRO group ``W`` (1: nothing to shard).
        tensors: parameter tensors (one AdamW ``step`` each).
        step_bytes: bytes of one AdamW ``step`` (4; 8 unfused under a float64 default dtype).
        gathered_bytes_per: bytes per element of ZeRO-1/2's kept gathered copy: the
            ``MixedPrecisionPolicy.param_dtype``'s (2 for ``train.dtype = "bfloat16"`` over float32
            masters, :func:`omni_parallel.llm_zero.apply_llm_zero`); ``None``: ``bytes_per`` (no cast).
        experts: routed-expert parameters of the stage, all ``E`` experts (0: no MoE); not in
            ``params`` / ``replicated``.
        ep: expert-parallel ranks ``experts`` are split over (every ZeRO stage).
        expert_shards: expert-data-parallel ranks ``V`` each EP shard is further split over at ZeRO 1-3
            (``dp_cp / ep``; :mod:`omni_parallel.llm_zero`): the experts' term as ``S``'s with ``W = V``,
            their kept gathered copy counted in ``b`` (they are never cast).

    Returns:
        ``{kind: bytes}`` over :data:`KINDS`; FSDP2's padding of uneven shards is not counted.

    Raises:
        ValueError: ``zero`` not in 0-3, ``tp`` / ``shards`` / ``ep`` < 1, or ``gathered_bytes_per`` < 1.
    """
    if zero not in (0, 1, 2, 3) or tp < 1 or shards < 1 or ep < 1 or expert_shards < 1:
        raise ValueError(
            "analytic_state_bytes: zero in 0-3, tp >= 1, shards >= 1, ep >= 1, expert_shards >= 1; "
            f"got {zero}, {tp}, {shards}, {ep}, {expert_shards}"
        )
    if gathered_bytes_per is not None and gathered_bytes_per < 1:
        raise ValueError(f"analytic_state_bytes: gathered_bytes_per must be >= 1, got {gathered_bytes_per}")
    elements = params / tp + replicated
    whole = elements * bytes_per
    gathered = elements * (bytes_per if gathered_bytes_per is None else gathered_bytes_per)
    local_experts = experts / ep * bytes_per
    w = shards
    v = expert_shards if zero >= 1 and w > 1 else 1  # the experts' edp sharding rides on LLM ZeRO 1-3
    return {
        "parameters": whole / (w if zero >= 1 else 1) + local_experts / v,
        "gathered": (gathered + (local_experts if v > 1 else 0.0)) if zero in (1, 2) and w > 1 else 0.0,
        "gradients": whole / (w if zero >= 2 else 1) + local_experts / (v if zero >= 2 else 1),
        "optimizer": 2 * whole / (w if zero >= 1 else 1) + 2 * local_experts / v + step_bytes * tensors,
    }


def saved_activation_bytes(fn: Callable[[], Any], params: Iterable[torch.Tensor] = ()) -> tuple[int, Any]:
    """Run ``fn()`` and count the bytes autograd saves for backward while it runs: distinct storages
    (:func:`storage_bytes`), the storages of ``params`` left out (they are the model's). Works on the
    ``meta`` device (no allocation), so it can size blocks of any width.

    Returns:
        ``(bytes saved, fn's result)``; keep the result alive until the count is read (it holds the graph).
    """
    skip = set()
    storage_bytes(params, skip)
    seen = set(skip)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return storage_bytes(saved, seen), out


ATTENTION_KERNELS = ("flash", "reference")
BRANCHES = ("attention", "mlp")  # the residual branches of the block, in forward order


def block_activation_bytes(
    tokens: int,
    dim: int,
    kv_dim: int,
    ffn_dim: int,
    *,
    heads: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
    async_tp: bool = False,
    bytes_per: int = 4,
    master_bytes: int | None = None,
    recompute: bool = False,
    recompute_branches: Sequence[str] = (),
    kernel: str = "flash",
) -> int:
    """Bytes one pre-norm decoder block of the app's LLM (``omni_train.models.llm.Block``: RMSNorm, RoPE,
    GQA attention through :func:`omni_parallel.varlen.varlen_attention`, SwiGLU) saves for backward on
    one rank for a microbatch of ``tokens`` tokens (this rank's: after CP / Ulysses splits), counted from
    what autograd keeps for each op of that code (distinct storages, parameters excluded, as
    :class:`~omni_parallel.activation_memory.ActivationMemory` measures). Per token, with ``b_m`` the
    residual stream's bytes (the master dtype's), ``b_c`` the compute dtype's, ``s = tp`` with Megatron
    SP else 1:

    * each RMSNorm ``x * rsqrt(mean(x^2) + eps) * w``: its input ``x``, ``x * rsqrt`` and the ``rsqrt``
      (one float), ``(2 dim + 1) b_m / s``; two norms per block;
    * the norms' outputs as the projections see them, never split by TP: replicated without SP, and
      with SP all-gathered over the TP group before the projections (``PrepareModuleInput``; the
      gathered tensor is what the projections save, not the shard Megatron-LM keeps and re-gathers in
      backward): ``2 dim b_m``; under autocast (``b_c != b_m``) every projection saves its own cast
      copy, ``(3 + 2) dim b_c``; with ``async_tp`` (:mod:`omni_parallel.async_tp`) each region's
      all-gather-matmul casts the shard once and keeps the one gathered ``[T, dim]`` compute-dtype
      input for its backward, ``(1 + 1) dim b_c`` (``2 dim b_m`` without autocast, as plain SP);
    * attention, over TP: ``q`` (after RoPE), ``k``, ``v``, the output (``2 dim + 2 kv_dim``), the
      log-sum-exp (``heads`` float32), all ``/ tp``. ``kernel = "reference"`` (CPU, and CUDA outside
      float16 / bfloat16, :func:`~omni_parallel.varlen.uses_device_kernel`): ``k`` and ``v`` repeated to
      the query heads (GQA) and the documents' outputs concatenated into one more tensor,
      ``5 dim / tp`` instead of ``2 dim + 2 kv_dim``;
    * RoPE: the float64 ``cos`` / ``sin`` tables cast to the compute dtype for ``q`` and for ``k``,
      ``2 head_dim b_c`` (none at float64), over all tokens;
    * SwiGLU: ``w1 x``, ``silu(w1 x)``, ``w3 x`` and their product, ``4 ffn_dim b_c / tp``;
    * once per block, under autocast: the compute-dtype copies of the matmul weights,
      ``(2 dim^2 + 2 dim kv_dim + 3 dim ffn_dim) b_c / tp`` (autocast's cache lives for the microbatch's
      forward; the copies stay saved until its backward).

    With ``recompute`` (the whole block checkpointed) only the block input is kept, ``dim b_m / s``;
    with ``recompute_branches`` too (selective recompute, ``omni_parallel.parallelize.apply_ac``'s
    branches: ``"attention"`` = ``attn(attn_norm(x))``, ``"mlp"`` = ``mlp(mlp_norm(x))``) each named
    branch keeps its input only and the other keeps all of its terms.
    Linear biases (``qkv_bias``) are not counted. This is the accounting of Korthikanti et al., "Reducing
    Activation Recomputation in Large Transformer Models" (2022) §4 redone for this code: a flash-style
    kernel (no ``s x s`` term), no dropout, and SP as this repo implements it (above).

    Args:
        tokens: tokens of the microbatch on this rank. dim, kv_dim, ffn_dim: widths (``kv_dim``:
            ``n_kv_heads * head_dim``).
        heads: query heads (the log-sum-exp and RoPE's ``head_dim = dim / heads``); ``None``: those two
            terms left out.
        tp: TP ranks. sequence_parallel: Megatron SP.
        async_tp: SP run as :class:`~omni_parallel.async_tp.AsyncTPRegion` s (needs ``sequence_parallel``
            and ``tp > 1``).
        bytes_per: bytes of the compute dtype (2 for bf16 autocast, 4 float32, 8 float64).
        master_bytes: bytes of the parameters' (and residual stream's) dtype; ``None``: ``bytes_per``
            (no autocast).
        recompute: the block is checkpointed (its ``recompute_branches`` only, when given).
        recompute_branches: ``"attention"``, ``"mlp"`` (see above).
        kernel: ``"flash"`` (the fused varlen kernel on CUDA at float16 / bfloat16) or ``"reference"``.

    Raises:
        ValueError: a size < 1, ``heads`` not dividing ``dim``, an unknown ``kernel``, or ``async_tp``
            without ``sequence_parallel`` and ``tp > 1``.
    """
    master = bytes_per if master_bytes is None else master_bytes
    if min(tokens, dim, kv_dim, ffn_dim, tp, bytes_per, master) < 1:
        raise ValueError("block_activation_bytes: sizes must be >= 1")
    if heads is not None and (heads < 1 or dim % heads):
        raise ValueError(f"block_activation_bytes: heads {heads} does not divide dim {dim}")
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"block_activation_bytes: kernel must be one of {ATTENTION_KERNELS}, got {kernel!r}")
    unknown = set(recompute_branches) - set(BRANCHES)
    if unknown:
        raise ValueError(
            f"block_activation_bytes: recompute_branches must be in {BRANCHES}, got {sorted(unknown)}"
        )
    if async_tp and not (sequence_parallel and tp > 1):
        raise ValueError(
            f"block_activation_bytes: async_tp needs sequence_parallel and tp > 1, got "
            f"sequence_parallel={sequence_parallel}, tp={tp}"
        )
    s = tp if sequence_parallel else 1
    if recompute and not recompute_branches:
        return tokens * dim * master // s
    autocast = bytes_per != master
    norm = (2 * dim + 1) * master / s  # one RMSNorm: its input, x * rsqrt, rsqrt
    # the projections' saved inputs: one gathered copy per region under async TP (in the compute dtype,
    # which is the master's without autocast), else one autocast copy per projection
    attn = norm + (dim * bytes_per if async_tp else 3 * dim * bytes_per if autocast else dim * master)
    attn += (5 * dim if kernel == "reference" else 2 * dim + 2 * kv_dim) * bytes_per / tp
    if heads is not None:
        attn += heads * 4 / tp + (0 if bytes_per == 8 else 2 * (dim // heads) * bytes_per)
    mlp = (
        norm
        + (dim * bytes_per if async_tp else 2 * dim * bytes_per if autocast else dim * master)
        + 4 * ffn_dim * bytes_per / tp
    )
    kept = dim * master / s  # a checkpointed branch keeps its input only
    per_token = {"attention": attn, "mlp": mlp}
    weights = {"attention": 2 * dim * (dim + kv_dim), "mlp": 3 * dim * ffn_dim}
    total = 0.0
    for branch in BRANCHES:
        if recompute and branch in recompute_branches:
            total += tokens * kept
        else:
            total += tokens * per_token[branch] + (weights[branch] * bytes_per / tp if autocast else 0)
    return round(total)
