"""Async tensor parallelism: the sequence-parallel all-gather and reduce-scatter of a TP region decomposed
into ring steps of point-to-point transfers, each overlapped with the matmul of the chunk in hand.

Wang et al., "Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
Models", ASPLOS'23 (the "collective matmul"); torchtitan's async TP (``torch._inductor`` micro-pipelined
``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` over symmetric memory) and Megatron-Core's
``tp_comm_overlap`` (Transformer Engine userbuffers) are the CUDA-only versions. Here the rings use
``torch.distributed.batch_isend_irecv`` only, so they run on gloo (CPU) and NCCL alike.

Under Megatron sequence parallelism (:mod:`omni_parallel.tensor_parallel`, ``llama_tp_plan(sequence_dim=0)``)
each TP rank holds ``T / tp`` tokens of the residual stream. A region (attention, MLP) all-gathers them,
multiplies by its column-parallel input projections (Q/K/V; gate/up) and reduce-scatters the output of
its row-parallel output projection (O; down). With ``tp`` ranks in a ring, rank ``r`` sending to
``r + 1`` and receiving from ``r - 1`` (mod ``tp``):

* :func:`all_gather_matmul`: ``tp`` steps; at step ``s`` rank ``r`` holds token chunk ``c = (r - s) mod
  tp``; it posts the send of chunk ``c`` and the receive of chunk ``c - 1`` *before* multiplying chunk
  ``c`` by every weight, then waits. ``tp - 1`` transfers, each hidden behind one chunk's matmuls.
* :func:`matmul_reduce_scatter`: ``tp`` steps; the partial sum for chunk ``c = (r - s - 1) mod tp``
  travels the ring. At step ``s >= 1`` rank ``r`` posts the send of the accumulator and the receive of
  its predecessor's before computing its own partial product for the next chunk, then adds the two;
  after ``tp - 1`` transfers rank ``r`` holds the whole sum of its own chunk ``r``.

The backward of each is the other ring: ``d x`` of the all-gather-matmul is a matmul-reduce-scatter of
``sum_i dY_i W_i``, ``d y`` of the matmul-reduce-scatter an all-gather-matmul of ``d out`` with ``W``;
the weight gradients use the gathered operand (``X`` saved in forward, ``d out`` gathered in backward).

Every transfer and matmul runs under a ``torch.profiler.record_function`` label
``async_tp.<ring>.<phase>.<step>`` (``ring``: ``ag`` all-gather-matmul or ``rs`` matmul-reduce-scatter;
``phase``: ``post`` the transfers posted, ``matmul`` the chunk's matmuls, ``wait`` waiting for the
transfers), so a profile shows the overlap (``tests/test_parallel_async_tp.py`` checks the order).

:class:`AsyncTPRegion` is the ``ParallelStyle`` that runs an attention or MLP module through these two
functions while keeping the plain sequence-parallel plan's parameter placements
(``llama_tp_plan(sequence_dim=0, async_tp=True)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.profiler import record_function

__all__ = ["AsyncTPRegion", "all_gather_matmul", "matmul_reduce_scatter"]


def _ring(group: dist.ProcessGroup) -> tuple[int, int, int, int]:
    """``(tp, rank in group, global rank of the next, global rank of the previous)``."""
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    return tp, r, dist.get_global_rank(group, (r + 1) % tp), dist.get_global_rank(group, (r - 1) % tp)


def _post(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group: dist.ProcessGroup) -> list:
    """Post one ring transfer (send to ``nxt``, receive from ``prv``) as one batch (one NCCL group: the
    send and the receive progress together, so a ring of them cannot deadlock); returns the works."""
    ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
    return dist.batch_isend_irecv(ops)


def _ag_ring(
    x: torch.Tensor, weights: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``x [Tl, d_in]`` this rank's chunk, ``weights`` ``[out_i, d_in]`` -> ``([Y_i [tp*Tl, out_i]],
    X_full [tp*Tl, d_in])``, ``Y_i = X_full @ W_i^T``, ``X_full`` the chunks in rank order."""
    tp, r, nxt, prv = _ring(group)
    tl = x.shape[0]
    x_full = x.new_empty((tp * tl, x.shape[1]))
    x_full[r * tl : (r + 1) * tl] = x
    ys = [x.new_empty((tp * tl, w.shape[0])) for w in weights]
    for s in range(tp):
        c, n = (r - s) % tp, (r - s - 1) % tp
        rows, works = slice(c * tl, (c + 1) * tl), []
        if s < tp - 1:  # the next chunk is in flight while this one is multiplied
            with record_function(f"async_tp.ag.post.{s}"):
                works = _post(x_full[rows], x_full[n * tl : (n + 1) * tl], nxt, prv, group)
        with record_function(f"async_tp.ag.matmul.{s}"):
            for w, y in zip(weights, ys):
                torch.mm(x_full[rows], w.t(), out=y[rows])
        if works:
            with record_function(f"async_tp.ag.wait.{s}"):
                for work in works:
                    work.wait()
    return ys, x_full


def _rs_ring(partial: Callable[[slice], torch.Tensor], tl: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the group of ``partial(rows)`` (this rank's ``[Tl, d]`` contribution to the token chunk
    ``rows`` of ``Tl`` rows), keeping this rank's chunk: ``[Tl, d]``."""
    tp, r, nxt, prv = _ring(group)
    c = (r - 1) % tp
    with record_function("async_tp.rs.matmul.0"):
        acc = partial(slice(c * tl, (c + 1) * tl))
    for s in range(1, tp):
        c = (r - s - 1) % tp
        recv = torch.empty_like(acc)
        with record_function(f"async_tp.rs.post.{s}"):
            works = _post(acc, recv, nxt, prv, group)
        with record_function(f"async_tp.rs.matmul.{s}"):
            mine = partial(slice(c * tl, (c + 1) * tl))
        with record_function(f"async_tp.rs.wait.{s}"):
            for work in works:
                work.wait()
        acc = recv.add_(mine)
    return acc


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, *weights):
        # x in its own dtype, the weights in the compute dtype (autocast's): x is cast here, so dX is
        # summed (over the weights and the ranks) in x's dtype, as F.linear's casts would
        ys, x_full = _ag_ring(x.to(weights[0].dtype).contiguous(), weights, group)
        ctx.group, ctx.x_dtype = group, x.dtype
        ctx.save_for_backward(x_full, *weights)
        ctx.mark_non_differentiable(x_full)
        return (*ys, x_full)

    @staticmethod
    def backward(ctx, *grads):
        x_full, *weights = ctx.saved_tensors
        dys = [
            x_full.new_zeros((x_full.shape[0], w.shape[0])) if g is None else g
            for g, w in zip(grads[:-1], weights)
        ]
        tp = dist.get_world_size(ctx.group)
        tl = x_full.shape[0] // tp

        def partial(rows: slice) -> torch.Tensor:
            if x_full.dtype == ctx.x_dtype:
                acc = dys[0][rows] @ weights[0]
                for dy, w in zip(dys[1:], weights[1:]):
                    acc.addmm_(dy[rows], w)
                return acc
            return sum((dy[rows] @ w).to(ctx.x_dtype) for dy, w in zip(dys, weights))

        dx = _rs_ring(partial, tl, ctx.group) if ctx.needs_input_grad[1] else None
        dws = [dy.t() @ x_full if ctx.needs_input_grad[2 + i] else None for i, dy in enumerate(dys)]
        return (None, dx, *dws)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, y, w):
        y = y.contiguous()
        tl = y.shape[0] // dist.get_world_size(group)
        ctx.group = group
        ctx.save_for_backward(y, w)
        return _rs_ring(lambda rows: y[rows] @ w.t(), tl, group)

    @staticmethod
    def backward(ctx, dout):
        y, w = ctx.saved_tensors
        (dy,), dout_full = _ag_ring(dout.contiguous(), [w.t()], ctx.group)
        dw = dout_full.t() @ y if ctx.needs_input_grad[2] else None
        return None, dy, dw


def _compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``F.linear`` would compute in here: autocast's, if enabled on ``device``, else ``dtype``."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


def _check(
    name: str,
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    d_in: int,
    labels: Sequence[str] | None = None,
) -> None:
    """``labels``: how the errors name each weight (default ``weights[i]``)."""
    if x.dim() != 2:
        raise ValueError(f"{name}: the input must be 2-D [tokens, features], got shape {tuple(x.shape)}")
    if not weights:
        raise ValueError(f"{name}: weights is empty")
    for i, w in enumerate(weights):
        label = labels[i] if labels else f"weights[{i}]"
        if isinstance(w, DTensor):
            raise TypeError(f"{name}: {label} is a DTensor; pass its local shard (to_local())")
        if w.dim() != 2 or w.shape[1] != d_in:
            raise ValueError(
                f"{name}: {label} must be [out, {d_in}] (the input's features), got {tuple(w.shape)}"
            )


@torch.compiler.disable
def all_gather_matmul(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    return_gathered: bool = False,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], torch.Tensor]:
    """``Y_i = all_gather(x) @ W_i^T`` for every weight, the all-gather decomposed into a ring overlapped
    with the matmuls (module docstring). Differentiable in ``x`` and every ``W_i``.

    Args:
        x: ``[T / tp, d_in]``: this rank's token chunk (rank ``r`` of the group holds rows
            ``r * T / tp ..``, the all-gather's order).
        weights: ``[out_i, d_in]`` each (``nn.Linear`` weights: this rank's column shards; ``out_i`` may
            differ), plain tensors, all of ``x``'s dtype and device.
        group: the TP process group; ``None`` or one rank: plain matmuls.
        return_gathered: also return ``X_full [T, d_in]`` (the gathered input, not differentiable).

    Returns:
        ``[Y_i [T, out_i]]`` (and ``X_full``). Under ``torch.autocast`` the inputs are cast to the autocast
        dtype first, as ``F.linear`` would, and the outputs are in it. Backward: ``dX`` by a
        matmul-reduce-scatter ring of ``sum_i dY_i W_i``, ``dW_i = dY_i^T X_full``.

    Raises:
        ValueError: ``x`` not 2-D, ``weights`` empty or a weight not ``[out, d_in]``.
        TypeError: a weight is a DTensor.

    Collective over ``group``: every rank calls it with the same weight shapes and ``T / tp``.
    """
    _check("all_gather_matmul", x, weights, x.shape[-1] if x.dim() else 0)
    dt = _compute_dtype(x.device, x.dtype)
    weights = [w.to(dt) for w in weights]
    if group is None or dist.get_world_size(group) == 1:
        x = x.to(dt)
        ys = [x @ w.t() for w in weights]
        return (ys, x.detach()) if return_gathered else ys
    with torch.autocast(x.device.type, enabled=False):
        *ys, x_full = _AllGatherMatmul.apply(group, x, *weights)
    return (list(ys), x_full) if return_gathered else list(ys)


@torch.compiler.disable
def matmul_reduce_scatter(y: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``reduce_scatter(y @ W^T)`` over ``group`` along the tokens, the reduce-scatter decomposed into a
    ring overlapped with the matmuls (module docstring). Differentiable in ``y`` and ``W``.

    Args:
        y: ``[T, f_local]``: every token, this rank's slice of the features (a row-parallel input).
        w: ``[d_out, f_local]``: this rank's row-parallel shard (``nn.Linear`` weight ``Shard(1)``), a
            plain tensor of ``y``'s dtype and device.
        group: the TP process group; ``None`` or one rank: a plain matmul.

    Returns:
        ``[T / tp, d_out]``: rows ``r * T / tp ..`` (``r`` this rank's index in the group) of
        ``sum over ranks of y @ W^T``. Under ``torch.autocast``: in the autocast dtype. Backward:
        ``dy`` by an all-gather-matmul ring of ``d out`` with ``W``, ``dW = d out_full^T y``.

    Raises:
        ValueError: ``y`` not 2-D, ``w`` not ``[d_out, f_local]``, or ``T`` not divisible by the group size.
        TypeError: ``w`` is a DTensor.

    Collective over ``group``.
    """
    _check("matmul_reduce_scatter", y, [w], y.shape[-1] if y.dim() else 0, labels=["w"])
    dt = _compute_dtype(y.device, y.dtype)
    y, w = y.to(dt), w.to(dt)
    if group is None or dist.get_world_size(group) == 1:
        return y @ w.t()
    tp = dist.get_world_size(group)
    if y.shape[0] % tp:
        raise ValueError(
            f"matmul_reduce_scatter: the token count {y.shape[0]} must be divisible by the group size {tp} "
            "(sequence parallelism pads each pack to a multiple of tp)"
        )
    with torch.autocast(y.device.type, enabled=False):
        return _MatmulReduceScatter.apply(group, y, w)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


class AsyncTPRegion(ParallelStyle):
    """Async TP of one attention or MLP region under sequence parallelism (``ParallelStyle`` of the region
    module, e.g. ``attention`` or ``feed_forward``): the parameter placements of the plain sequence-parallel
    plan (the ``column`` ``nn.Linear`` s' weights and biases ``Shard(0)``, the ``row`` one's weight
    ``Shard(1)``), so checkpoints, FSDP2 over the TP DTensors and state dicts are unchanged, and the region
    run as one :func:`all_gather_matmul` over its column projections and one :func:`matmul_reduce_scatter`
    for its row projection, on the weights' local shards (``DTensor.to_local``: gradients reach the DTensor
    parameters with their placements).

    The region's forward input ``input_index`` is this rank's ``[T / tp, dim]`` token shard (a plain tensor
    or a ``Shard(0)`` DTensor from a ``SequenceParallel`` norm); a forward pre-hook runs the
    all-gather-matmul and hands the region the gathered ``[T, dim]`` input (not differentiable), and each
    column projection, called on exactly that tensor, returns its precomputed ``[T, out_local]`` output
    (bias added). The region must use its input only for those calls (and its shape); calling a column
    projection on anything else raises ``RuntimeError``. The row projection returns this rank's
    ``[T / tp, dim]`` rows of the summed output (a plain tensor, as ``RowwiseParallel(output_layouts=Shard(0),
    use_local_output=True)``). Recompute (``torch.utils.checkpoint``) re-runs the hook with the region.

    Args:
        column: the input projections' paths in the region (e.g. ``("wq", "wk", "wv")``).
        row: the output projection's path (e.g. ``"wo"``), without bias.
        input_index: the position of the hidden states in the region's forward arguments.

    Raises (when applied):
        ValueError: a path names no ``nn.Linear``, the row projection has a bias, or the mesh is not 1-D.
    """

    def __init__(self, column: Sequence[str], row: str, *, input_index: int = 0) -> None:
        super().__init__()
        if not column or input_index < 0:
            raise ValueError(f"AsyncTPRegion: column must not be empty and input_index >= 0, got {column!r}")
        self.column, self.row, self.input_index = tuple(column), row, input_index

    def _linear(self, module: nn.Module, path: str) -> nn.Linear:
        sub = module.get_submodule(path) if path in dict(module.named_modules()) else None
        if not isinstance(sub, nn.Linear):
            raise ValueError(
                f"AsyncTPRegion: {type(module).__name__} has no nn.Linear {path!r} (column {self.column}, "
                f"row {self.row!r})"
            )
        return sub

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"AsyncTPRegion: needs a 1-D TP mesh, got {device_mesh.ndim}-D")
        cols = {path: self._linear(module, path) for path in self.column}
        row = self._linear(module, self.row)
        if row.bias is not None:
            raise ValueError(f"AsyncTPRegion: the row projection {self.row!r} has a bias (not supported)")
        for lin in cols.values():
            _distribute(lin, device_mesh, Shard(0))
        _distribute(row, device_mesh, Shard(1))
        group = device_mesh.get_group()
        outputs: dict[str, Any] = {}  # this call's: "input" and one output per column path

        def pre_hook(mod: nn.Module, args: tuple) -> tuple:
            if len(args) <= self.input_index:
                raise TypeError(
                    f"AsyncTPRegion: {type(mod).__name__} called with {len(args)} positional arguments; the "
                    f"hidden states are argument {self.input_index}"
                )
            x = args[self.input_index]
            if isinstance(x, DTensor):
                if tuple(x.placements) != (Shard(0),):
                    raise ValueError(f"AsyncTPRegion: input placements {x.placements}, expected (Shard(0),)")
                x = x.to_local()
            ws = [_local(lin.weight) for lin in cols.values()]
            ys, x_full = all_gather_matmul(x, ws, group, return_gathered=True)
            outputs.clear()
            outputs["input"] = x_full
            for (path, lin), y in zip(cols.items(), ys):
                outputs[path] = y if lin.bias is None else y + _local(lin.bias).to(y.dtype)
            return (*args[: self.input_index], x_full, *args[self.input_index + 1 :])

        def post_hook(mod: nn.Module, args: tuple, out: Any) -> None:
            unused = sorted(k for k in outputs if k != "input")
            outputs.clear()
            if unused:
                raise RuntimeError(f"AsyncTPRegion: {type(mod).__name__} did not call {unused}")

        for path, lin in cols.items():
            lin.forward = _column_forward(path, outputs)
        row.forward = _row_forward(row, group)
        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(post_hook)
        return module


def _distribute(lin: nn.Linear, mesh: DeviceMesh, placement: Shard) -> None:
    """``lin``'s parameters as DTensors over ``mesh``, as ``ColwiseParallel`` (``Shard(0)``) /
    ``RowwiseParallel`` (``Shard(1)``, no bias) distribute them."""
    for name, p in list(lin.named_parameters(recurse=False)):
        dt = distribute_tensor(p, mesh, [placement if name == "weight" else Shard(0)])
        lin.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _column_forward(path: str, outputs: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x is not outputs.get("input") or path not in outputs:
            raise RuntimeError(
                f"AsyncTPRegion: column projection {path!r} called outside its region's forward or on a "
                "tensor other than the region's input (async TP computes it from the region's input only)"
            )
        y = outputs.pop(path)
        if len(outputs) == 1:
            # the last column output handed out: drop the gathered input here, not in the forward hook,
            # which a non-reentrant checkpoint's recompute never reaches (it stops the region's forward
            # once it has every saved tensor, inside the row projection), and which would keep a
            # [T, dim] tensor per recomputed region alive until the block's next forward
            outputs.clear()
        return y

    return forward


def _row_forward(lin: nn.Linear, group: dist.ProcessGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(y: torch.Tensor) -> torch.Tensor:
        return matmul_reduce_scatter(y, _local(lin.weight), group)

    return forward
