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
:func:`analytic_state_bytes` is the formula (per rank, ``P`` parameters of a pipeline stage before TP,
``b`` bytes per element, ``W`` ranks of the ZeRO group)::

    parameters = P b / tp / (W if zero >= 3 else 1)
    gathered   = P b / tp                 if zero in (1, 2) else 0
    gradients  = P b / tp / (W if zero >= 2 else 1)
    optimizer  = 2 P b / tp / (W if zero >= 1 else 1) + s * tensors      (s: bytes of AdamW's step)

(Rajbhandari et al., "ZeRO", SC'20, §5; TP divides the matmul weights only, so a TP rank holds a little
more than ``P / tp``: norms are replicated.)

:func:`block_activation_bytes` estimates what one pre-norm decoder block (RMSNorm, GQA attention with a
flash-style kernel, SwiGLU) saves for backward per microbatch; times the layers and microbatches a
pipeline rank holds in flight it is the activation estimate of a plan. :func:`saved_activation_bytes`
counts what autograd saves while a function runs (distinct storages, parameters excluded), on any device
including ``meta``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from omni_parallel.encoder_zero import sharded_units

__all__ = [
    "KINDS",
    "adamw_state_bytes",
    "analytic_state_bytes",
    "block_activation_bytes",
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
        ),
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
        whole_gradients: each gradient is the whole parameter's (ZeRO-1: gradients all-reduced whole,
            state sharded), not its local shard's.

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
    grads = sum((p if whole_gradients else _local(p)).numel() * p.element_size() for p in params)
    return {
        "parameters": storage_bytes(params),
        "gathered": gathered,
        "gradients": grads,
        "optimizer": 0 if optimizer is None else adamw_state_bytes(optimizer, params),
    }


def analytic_state_bytes(
    params: float, *, bytes_per: int = 4, tp: int = 1, zero: int = 0, shards: int = 1, tensors: int = 0
) -> dict[str, float]:
    """The module docstring's formula: bytes per rank of a stage of ``params`` parameters (before TP).

    Args:
        params: parameters of the rank's stage (all TP ranks together).
        bytes_per: bytes per element of parameters, gradients and AdamW moments (float32: 4).
        tp: TP ranks the parameters are split over.
        zero: ZeRO stage 0-3 over ``shards`` ranks.
        shards: ranks of the ZeRO group ``W`` (1: nothing to shard).
        tensors: parameter tensors (one 4-byte AdamW ``step`` each).

    Raises:
        ValueError: ``zero`` not in 0-3, or ``tp`` / ``shards`` < 1.
    """
    if zero not in (0, 1, 2, 3) or tp < 1 or shards < 1:
        raise ValueError(
            f"analytic_state_bytes: zero in 0-3, tp >= 1, shards >= 1; got {zero}, {tp}, {shards}"
        )
    whole = params * bytes_per / tp
    w = shards if shards > 1 else 1
    return {
        "parameters": whole / (w if zero >= 3 else 1),
        "gathered": whole if zero in (1, 2) and w > 1 else 0.0,
        "gradients": whole / (w if zero >= 2 else 1),
        "optimizer": 2 * whole / (w if zero >= 1 else 1) + 4 * tensors,
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


def block_activation_bytes(
    tokens: int,
    dim: int,
    kv_dim: int,
    ffn_dim: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    bytes_per: int = 4,
    recompute: bool = False,
) -> int:
    """Estimated bytes one pre-norm decoder block saves for backward on one rank for a microbatch of
    ``tokens`` tokens (this rank's: after CP / Ulysses splits). Counted per token, in elements:

    * replicated over TP (sharded by it with Megatron SP): both norms' inputs and outputs, ``4 dim``;
    * sharded by TP: ``q`` and the attention output (``2 dim``), ``k`` and ``v`` (``2 kv_dim``), the
      attention kernel's log-sum-exp (not counted: ``heads`` floats), SwiGLU's ``w1 x``, ``w3 x``,
      ``silu(w1 x)`` and their product (``4 ffn_dim``).

    With ``recompute`` only the block input (``dim``, replicated over TP) is kept. This is
    Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022) §4.1
    (``sbh(34 + 5as/h)`` for GPT blocks at fp16) redone for this block with a flash kernel (no
    ``s x s`` term) and without dropout.

    Args:
        tokens: tokens of the microbatch on this rank. dim, kv_dim, ffn_dim: widths (``kv_dim``:
            ``n_kv_heads * head_dim``). tp: TP ranks. sequence_parallel: Megatron SP.
        bytes_per: bytes per saved element (the compute dtype's: 2 for bf16 autocast, 4 float32).
        recompute: the block is checkpointed.

    Raises:
        ValueError: a size < 1.
    """
    if min(tokens, dim, kv_dim, ffn_dim, tp, bytes_per) < 1:
        raise ValueError("block_activation_bytes: sizes must be >= 1")
    replicated = dim if recompute else 4 * dim
    sharded = 0 if recompute else 2 * dim + 2 * kv_dim + 4 * ffn_dim
    per_token = replicated / (tp if sequence_parallel else 1) + sharded / tp
    return int(tokens * per_token * bytes_per)
