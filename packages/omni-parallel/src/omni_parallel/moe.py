"""Mixture-of-experts layer: a top-k softmax router, SwiGLU experts stored as ``[experts, ...]`` tensors,
optional shared expert(s), the auxiliary load-balancing loss and the router z-loss. Dropless: every token
reaches its ``top_k`` experts (no capacity) unless a capacity is asked for.

Routing follows Qwen2-MoE / Qwen3-MoE (``transformers`` ``Qwen2MoeTopKRouter``): ``probs =
softmax(x W_g^T)`` in float32 or wider, the ``top_k`` largest per token, renormalised to sum 1 when
``norm_topk_prob`` (Qwen3-MoE's default). The expert weights keep ``transformers``' ``Qwen2MoeExperts``
layout (``gate_up_proj [E, 2*hidden, dim]``, ``down_proj [E, dim, hidden]``), so Hugging Face checkpoints
load without transposes.

Losses (one MoE layer, one forward over ``T`` tokens):

* **Load balancing** (Switch Transformer, Fedus et al. 2021, eqs. 4-6; the definition of ``transformers``'
  ``qwen2_moe.modeling_qwen2_moe.load_balancing_loss_func`` for one layer without attention mask):
  ``E * sum_e f_e * P_e`` with ``f_e = (number of (token, slot) pairs routed to e) / T`` (sums to
  ``top_k`` over experts; no gradient) and ``P_e = mean_t probs[t, e]``. Equal to ``top_k`` when the
  routing is perfectly uniform.
* **Router z-loss** (ST-MoE, Zoph et al. 2022, eq. 5): ``mean_t logsumexp_e(logits[t, e])^2``.

Both are returned unscaled; the coefficients (:attr:`MoEConfig.aux_loss_coef`,
:attr:`MoEConfig.z_loss_coef`) are applied by :func:`attach_aux_loss`, which adds
``loss_scale * (aux_loss_coef * aux + z_loss_coef * z)`` to the objective through the backward pass only
(Megatron-Core's ``MoEAuxLossAutoScaler``), so it works on any pipeline stage, where no loss tensor exists.
:attr:`MoE.loss_scale` (default 1) is the caller's normalisation: a trainer whose cross-entropy is a mean
over the step's tokens sets it to ``1 / (forwards of the layer per step x MoE layers)``, so the objective
holds ``coef x`` the mean over the step's packs and MoE layers (Megatron scales by ``1 / num_microbatches``
and averages over DP; ``transformers``' Qwen2-MoE pools all layers' router rows into one loss of one
layer's size, i.e. a layer mean, and adds ``router_aux_loss_coef`` times it once per batch).

Auxiliary-loss-free load balancing (DeepSeek-V3, Liu et al. 2024, §2.1.2; Wang et al. 2024,
"Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"): with
:attr:`MoEConfig.bias_update_rate` set, the router holds a per-expert bias ``b [E]`` (a persistent
buffer, not a parameter: in the checkpoint, no gradient) added to the routing probabilities *only to choose*
the top-k experts; the gate weights stay the unbiased probabilities of the chosen experts. After each
optimizer step :func:`update_expert_bias` moves it by ``b_e += rate * sign(mean_e' load_e' - load_e)``,
``load_e`` the (token, slot) assignments to expert ``e`` over the step's forwards, summed over the ranks
that route the layer's tokens (so every rank applies the same update). torchtitan calls the rate
``load_balance_coeff``, Megatron-Core ``moe_router_bias_update_rate``.

A pack sharded over ranks (context parallelism, Ulysses, hybrid DP/CP; :class:`PackShard`): both losses
and the loads are those of the whole pack, as one process computes them. Padding rows (CP's per-document
padding to ``2 cp`` chunks, Ulysses' padding to a multiple of ``sp``) are routed nowhere and counted in
nothing; ``T``, the counts ``C_e`` and the probability sums ``S_e`` are summed over the ranks holding the
pack (one ``all_reduce`` of ``2 E + 2`` numbers per forward; Megatron-Core likewise reduces
``tokens_per_expert`` over its TP x CP group); each rank backpropagates its own rows' share of the loss
(``E * sum_e C_e S^r_e / T^2``, ``sum_{t in r} lse_t^2 / T``), and those shares' gradients, summed over the
group by the data-parallel gradient sync, are one process's.

Capacity (:attr:`MoEConfig.capacity_factor`) is enforced per forward on the forward's own ``T`` tokens:
under expert parallelism, per *sending* rank, so an expert may receive up to ``ep x capacity`` rows from
the EP group (not GShard's capacity per expert over the group).

Expert compute: ``torch._grouped_mm`` on CUDA in bfloat16 on devices with compute capability 9.0 or more
(one kernel for all experts), a plain per-expert loop elsewhere (float64 on CPU always loops). Expert
parallelism (experts sharded over an EP group, tokens exchanged with all-to-alls) lives in
:mod:`omni_parallel.expert_parallel`; :class:`MoE` takes its group at construction and calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from omni_parallel.expert_parallel import combine, dispatch

__all__ = [
    "GroupedExperts",
    "MoE",
    "MoEConfig",
    "MoEOutput",
    "PackShard",
    "RouterOutput",
    "TopKRouter",
    "attach_aux_loss",
    "expert_parallel_sync",
    "expert_parameters",
    "load_balancing_loss",
    "moe_layers",
    "router_z_loss",
    "shard_experts",
    "update_expert_bias",
    "uses_grouped_mm",
]


@dataclass(frozen=True)
class MoEConfig:
    """Shape and losses of one MoE layer.

    Attributes:
        dim: model width (features).
        hidden: each routed expert's SwiGLU width (features; ``moe_intermediate_size`` in Qwen-MoE).
        experts: routed experts ``E`` (>= 1).
        top_k: experts per token (1 <= top_k <= experts).
        shared_experts: always-on experts, fused into one SwiGLU of width ``shared_experts * hidden``
            (DeepSeek-MoE); 0: none.
        shared_hidden: width of the fused shared SwiGLU (features); ``None``: ``shared_experts * hidden``.
            Qwen2-MoE's ``shared_expert_intermediate_size``.
        shared_gate: scale the shared output by ``sigmoid(x w_s)`` (Qwen2-MoE's ``shared_expert_gate``).
        norm_topk_prob: renormalise the top-k probabilities to sum 1 (Qwen3-MoE ``norm_topk_prob``).
        aux_loss_coef: weight of the load-balancing loss in the objective (Qwen-MoE
            ``router_aux_loss_coef``; 0: reported, no gradient).
        z_loss_coef: weight of the router z-loss in the objective (ST-MoE uses 1e-3).
        capacity_factor: ``None``: dropless. Otherwise each expert takes at most
            ``ceil(capacity_factor * T * top_k / E)`` of a forward's ``T`` tokens (first come, first
            served in token order); the rest of its assignments are dropped (their weight counts as 0).
            Under EP the capacity is enforced per sending rank: an expert may receive up to
            ``ep x capacity`` rows over the EP group.
        bias_update_rate: ``None``: no router bias (the routing of ``transformers``' Qwen2/3-MoE). A
            number >= 0: the router keeps a selection-only expert bias (:attr:`TopKRouter.expert_bias`,
            DeepSeek-V3's auxiliary-loss-free balancing), moved by this much per step by
            :func:`update_expert_bias` (0: held where it is set or loaded).

    Raises:
        ValueError: a size out of range, naming the field.
    """

    dim: int
    hidden: int
    experts: int
    top_k: int
    shared_experts: int = 0
    shared_hidden: int | None = None
    shared_gate: bool = False
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    capacity_factor: float | None = None
    bias_update_rate: float | None = None

    def __post_init__(self) -> None:
        for name in ("dim", "hidden", "experts", "top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {v!r}")
        if self.top_k > self.experts:
            raise ValueError(f"MoEConfig.top_k = {self.top_k} exceeds MoEConfig.experts = {self.experts}")
        if not isinstance(self.shared_experts, int) or self.shared_experts < 0:
            raise ValueError(f"MoEConfig.shared_experts must be an int >= 0, got {self.shared_experts!r}")
        if self.shared_hidden is not None and (
            not isinstance(self.shared_hidden, int) or self.shared_hidden < 1
        ):
            raise ValueError(
                f"MoEConfig.shared_hidden must be a positive int or None, got {self.shared_hidden!r}"
            )
        for name in ("aux_loss_coef", "z_loss_coef"):
            if not float(getattr(self, name)) >= 0.0:
                raise ValueError(f"MoEConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig.capacity_factor must be > 0 or None, got {self.capacity_factor!r}")
        if self.bias_update_rate is not None and not float(self.bias_update_rate) >= 0.0:
            raise ValueError(
                f"MoEConfig.bias_update_rate must be >= 0 or None, got {self.bias_update_rate!r}"
            )

    @property
    def shared_width(self) -> int:
        """Width of the fused shared SwiGLU (0: no shared expert)."""
        if self.shared_experts == 0:
            return 0
        return self.shared_hidden if self.shared_hidden is not None else self.shared_experts * self.hidden


class RouterOutput(NamedTuple):
    """``logits [T, E]`` (model dtype), ``probs [T, E]`` (softmax, float32 or float64), ``weights [T, k]``
    (top-k probabilities, renormalised if asked, in the model dtype) and ``indices [T, k]`` (int64 expert
    ids, descending probability; with an expert bias, descending ``probability + bias``)."""

    logits: torch.Tensor
    probs: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor


class TopKRouter(nn.Module):
    """Softmax top-k router (Qwen2-MoE / Qwen3-MoE ``TopKRouter``): ``weight [E, dim]``, no bias in the
    projection.

    With ``expert_bias=True`` it also holds ``expert_bias [E]`` (a persistent buffer in the model's dtype,
    zeros at construction; DeepSeek-V3's ``e_score_correction_bias``): the top-k are chosen on
    ``probs + expert_bias`` and weighted by ``probs`` alone (selection only, no gradient through it).

    Forward: ``x [T, dim]`` -> :class:`RouterOutput`.
    """

    expert_bias: torch.Tensor | None

    def __init__(
        self, dim: int, experts: int, top_k: int, *, norm_topk_prob: bool = True, expert_bias: bool = False
    ) -> None:
        super().__init__()
        self.experts, self.top_k, self.norm_topk_prob = experts, top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(experts, dim))
        self.register_buffer("expert_bias", torch.zeros(experts) if expert_bias else None)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        logits = F.linear(x, self.weight)
        wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
        probs = torch.softmax(logits, dim=-1, dtype=wide)
        if self.expert_bias is None:
            top, indices = torch.topk(probs, self.top_k, dim=-1)
        else:  # choose on the biased scores, weight by the unbiased probabilities
            _, indices = torch.topk(probs + self.expert_bias.to(wide), self.top_k, dim=-1)
            top = probs.gather(-1, indices)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return RouterOutput(logits, probs, top.to(x.dtype), indices)


def load_balancing_loss(probs: torch.Tensor, indices: torch.Tensor, experts: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss of one layer: ``E * sum_e f_e * P_e``.

    Args:
        probs: ``[T, E]`` router softmax.
        indices: ``[T, k]`` selected experts.
        experts: ``E``.

    Returns:
        A scalar in ``probs``' dtype; gradient through ``P_e`` only (``f_e`` is a count). 0 for ``T = 0``.

    Source: ``transformers`` ``models/qwen2_moe/modeling_qwen2_moe.py`` ``load_balancing_loss_func`` (one
    layer's logits, ``attention_mask=None``): ``tokens_per_expert = histc(selected) / T``,
    ``router_prob_per_expert = probs.sum(0) / T``, ``sum(tokens * probs) * E``.
    """
    t = probs.shape[0]
    if t == 0:
        return probs.sum() * 0.0
    f = torch.bincount(indices.reshape(-1), minlength=experts).to(probs.dtype) / t
    p = probs.mean(dim=0)
    return experts * (f * p).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022, eq. 5): ``mean_t logsumexp_e(logits[t, e])^2``.

    ``logits [T, E]``; computed in float32 or wider; 0 for ``T = 0``.
    """
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    wide = logits.double() if logits.dtype == torch.float64 else logits.float()
    return torch.logsumexp(wide, dim=-1).square().mean()


def uses_grouped_mm(x: torch.Tensor) -> bool:
    """Whether :class:`GroupedExperts` runs ``torch._grouped_mm`` for input ``x``: CUDA, bfloat16, compute
    capability >= 9.0 and a torch that has the op; otherwise the per-expert loop."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


class GroupedExperts(nn.Module):
    """``E_local`` SwiGLU experts as stacked tensors: ``gate_up_proj [E_local, 2*hidden, dim]`` (gate rows
    first, then up), ``down_proj [E_local, dim, hidden]`` (``transformers``' ``Qwen2MoeExperts`` layout).

    Forward: ``x [N, dim]`` sorted by expert, ``counts [E_local]`` (int, tokens per expert, summing to
    ``N``) -> ``[N, dim]``, expert ``e`` applied to its rows: ``down(silu(gate x) * up x)``.

    Expert-data-parallel sharding (LLM ZeRO 1-3 with ``ep > 1``, :mod:`omni_parallel.llm_zero`): the
    parameters are then ``[Shard(0), Shard(d)]`` DTensors over the 2-D ``(ep, edp)`` mesh (a slice of this
    rank's ``E_local`` experts), and the forward computes on :attr:`gathered` (``{name: [E_local, ...]}``,
    the slices all-gathered over ``edp`` by the LLM sync's ``attach``; autograd leaves whose ``.grad`` the
    sync reduces into the shards). :attr:`edp_dims` (``{name: d}``) is set while sharded.

    Raises:
        ValueError: ``counts`` has the wrong length, or (per-expert loop only: the ``torch._grouped_mm``
            path does not sync the host to check) does not sum to the rows of ``x``.
        RuntimeError: the parameters are expert-data-parallel shards and :attr:`gathered` is empty (the
            step's ``LLMGradientSync.attach()`` did not run).
    """

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.experts, self.dim, self.hidden = experts, dim, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(experts, dim, hidden))
        self.edp_dims: dict[str, int] | None = None  # set by the expert-data-parallel sharding
        self.gathered: dict[str, torch.Tensor] = {}

    def _weight(self, name: str) -> torch.Tensor:
        """This rank's ``[E_local, ...]`` weights: the gathered copy under expert-data-parallel sharding,
        else the local block of the EP ``Shard(0)`` DTensor (or the plain parameter)."""
        if self.edp_dims is not None:
            if name not in self.gathered:
                raise RuntimeError(
                    f"GroupedExperts.{name} is sharded over the expert-data-parallel ranks and not gathered: "
                    "call the LLM sync's attach() before the step's first forward"
                )
            return self.gathered[name]
        p = getattr(self, name)
        return p.to_local() if isinstance(p, DTensor) else p

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if counts.numel() != self.experts:
            raise ValueError(f"counts has {counts.numel()} entries, expected {self.experts} experts")
        # expert-parallel shards (omni_parallel.expert_parallel.shard_experts): compute on the local experts
        gate_up, down = self._weight("gate_up_proj"), self._weight("down_proj")
        if uses_grouped_mm(x) and x.shape[0] > 0:
            offs = torch.cumsum(counts.to(device=x.device, dtype=torch.int32), 0).to(torch.int32)
            h = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)
        sizes = [int(c) for c in counts.tolist()]  # the loop's split sizes: one host sync
        if sum(sizes) != x.shape[0]:
            raise ValueError(f"counts sum to {sum(sizes)}, x has {x.shape[0]} rows")
        outs = []
        for e, rows in enumerate(x.split(sizes)):
            gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, down[e]))
        if not outs:
            return x.new_zeros(0, self.dim)
        # An expert with no rows still joins the graph (an empty product), so its gradient is a zero
        # tensor rather than None on every rank, whatever the routing.
        return torch.cat(outs)


class _SharedSwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEOutput(NamedTuple):
    """One forward of :class:`MoE`: ``out [T, dim]``; ``aux`` and ``z`` the unscaled losses (scalars,
    differentiable; with a :class:`PackShard` the whole pack's values, gradients of this rank's share);
    ``tokens_per_expert [E]`` int64 (this forward's (token, slot) assignments per global expert, before any
    capacity, padding rows excluded); ``computed`` int (rows sent to the experts on this rank's behalf,
    after capacity drops: ``T * top_k`` when dropless, ``T`` the valid rows); ``received`` int (rows this
    rank's experts computed, from every rank of the EP group; summed over the group it equals the sum of
    ``computed``);
    ``routed`` int (the (token, slot) assignments before any capacity drop: ``T * top_k``; dropped rows
    are ``routed - computed``)."""

    out: torch.Tensor
    aux: torch.Tensor
    z: torch.Tensor
    tokens_per_expert: torch.Tensor
    computed: int
    received: int
    routed: int


@dataclass(frozen=True)
class PackShard:
    """Which rows of one :class:`MoE` forward are tokens of the pack, and which ranks hold the rest of it.

    Under context parallelism (head-tail CP, hybrid DP/CP) or Ulysses a pack's tokens are spread over
    several ranks, each forward holding its share plus padding rows (CP pads every document to a multiple
    of ``2 cp``, Ulysses pads the pack to a multiple of ``sp``). The load-balancing loss, the z-loss and the
    expert loads of one process are statistics of the whole pack; :class:`MoE` computes them from the
    ``valid`` rows only and sums the per-expert statistics over ``group``, so every rank of the group gets
    the pack's values (and the gradients of its own rows' share).

    Attributes:
        valid: ``[T]`` bool, the forward's rows that are tokens (False: padding; routed nowhere, in no
            statistic, output zero apart from the shared expert); ``None``: every row.
        tokens: the number of True rows of ``valid`` (``T`` when ``valid`` is ``None``); given on the
            host so no device sync reads it.
        group: the ranks holding the other rows of the same pack (the Ulysses group, the CP group, or a
            stage's ``dp_cp`` group under hybrid DP/CP); ``None``: the pack is whole here. Collective: every
            member runs the same forwards in the same order.

    Raises:
        ValueError: ``valid`` not 1-D bool, or ``tokens`` outside ``[0, T]``.
    """

    valid: torch.Tensor | None = None
    tokens: int | None = None
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.valid is not None and (self.valid.dim() != 1 or self.valid.dtype != torch.bool):
            raise ValueError(
                f"PackShard.valid must be a 1-D bool tensor, got {self.valid.dtype} {tuple(self.valid.shape)}"
            )
        if self.valid is not None and self.tokens is None:
            raise ValueError("PackShard.tokens: give the number of valid rows with PackShard.valid")
        if self.tokens is not None and self.valid is not None and not 0 <= self.tokens <= self.valid.numel():
            raise ValueError(f"PackShard.tokens = {self.tokens} outside [0, {self.valid.numel()}]")

    @classmethod
    def from_rows(
        cls, valid: Sequence[bool], group: dist.ProcessGroup | None, device: torch.device | str = "cpu"
    ) -> PackShard:
        """A shard from a host-side ``[T]`` list of valid flags (``valid`` all True: ``valid = None``)."""
        n = sum(bool(v) for v in valid)
        if n == len(valid):
            return cls(None, n, group)
        return cls(torch.tensor(list(valid), dtype=torch.bool, device=device), n, group)


def _pack_statistics(
    probs: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor, experts: int, shard: PackShard | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pack's load-balancing loss and z-loss, and this forward's valid (token, slot) counts per expert.

    ``aux = E * sum_e (C_e / T) * (S_e / T)`` and ``z = sum_t lse_t^2 / T`` with ``T`` the pack's tokens,
    ``C_e`` its (token, slot) assignments to ``e`` and ``S_e`` its summed router probabilities, all over the
    valid rows of every rank of ``shard.group`` (one ``all_reduce`` of ``[2 E + 2]`` float64-or-float32
    values). Returned values are the pack's; their gradients are those of this rank's rows' share, the
    partial sums ``E * sum_e (C_e / T) * (S^r_e / T)`` and ``sum_{t in r} lse_t^2 / T`` (the shares of the
    group sum to the pack's loss, so the gradients summed over the group, as the data-parallel sync does,
    are one process's). ``C`` and ``T`` carry no gradient (counts), as in Switch.
    """
    valid = shard.valid if shard is not None else None
    if valid is not None:
        probs, logits, indices = probs[valid], logits[valid], indices[valid]
    counts = torch.bincount(indices.reshape(-1), minlength=experts)
    wide = logits.double() if logits.dtype == torch.float64 else logits.float()
    lse2 = torch.logsumexp(wide, dim=-1).square()
    psum, zsum = probs.sum(0), lse2.sum()
    rows = psum.new_full((1,), float(indices.shape[0]))
    stats = torch.cat([counts.to(psum.dtype), psum.detach(), zsum.detach().to(psum.dtype).view(1), rows])
    group = shard.group if shard is not None else None
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    c, s, z_all = stats[:experts], stats[experts : 2 * experts], stats[2 * experts]
    t = stats[2 * experts + 1].clamp(min=1.0)  # a pack without tokens: every sum is 0, so are the losses
    f = c / t
    aux_part = experts * (f * psum).sum() / t
    aux_pack = experts * (f * s).sum() / t
    z_part = zsum / t
    z_pack = z_all.to(z_part.dtype) / t
    return aux_part + (aux_pack - aux_part).detach(), z_part + (z_pack - z_part).detach(), counts


class _AttachAux(torch.autograd.Function):
    """Identity on ``out``; in backward, ``d(objective)/d(loss) = weight`` for the attached loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, weight: float) -> torch.Tensor:  # type: ignore[override]
        ctx.weight = weight
        ctx.save_for_backward(loss)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.weight), None


def attach_aux_loss(out: torch.Tensor, loss: torch.Tensor, weight: float) -> torch.Tensor:
    """Return ``out`` unchanged, such that backward through it also backpropagates ``weight * loss``.

    What Megatron-Core's ``MoEAuxLossAutoScaler`` does: the auxiliary losses of an MoE layer reach the
    optimizer on every pipeline stage, where the stage's backward starts from the received gradient and
    no loss tensor exists. ``loss`` a scalar in the graph; ``weight`` its coefficient in the objective.
    """
    if weight == 0.0 or not loss.requires_grad:
        return out
    return _AttachAux.apply(out, loss, float(weight))


class MoE(nn.Module):
    """Router + routed experts (+ shared expert), dropless unless :attr:`MoEConfig.capacity_factor`.

    Args:
        cfg: the layer's shape and losses.
        ep_group: expert-parallel group (size ``ep`` dividing ``cfg.experts``): this rank holds experts
            ``[r * E/ep, (r+1) * E/ep)`` (``r`` its rank in the group) and exchanges tokens with
            :func:`omni_parallel.expert_parallel.dispatch` / :func:`~omni_parallel.expert_parallel.combine`;
            every rank of the group must call forward the same number of times. ``None``: all experts here.

    Forward: ``x [T, dim]``, ``shard`` (:class:`PackShard`, optional: the rows that are tokens and the ranks
    holding the rest of the pack under CP / Ulysses / hybrid DP/CP; default: ``x`` is a whole pack) ->
    :class:`MoEOutput`, the losses and loads those of the whole pack's tokens (padding rows excluded, the
    per-expert statistics summed over ``shard.group``). The aux losses are attached to ``out`` with
    :func:`attach_aux_loss` with weights ``loss_scale * coef`` (:attr:`loss_scale`, default 1: the caller's
    normalisation, e.g. ``1 / (forwards of the layer per step x MoE layers)``; module docstring).

    With :attr:`MoEConfig.bias_update_rate` set, each forward run with autograd on (not a recompute inside
    the backward) adds its ``tokens_per_expert`` to :attr:`pending_load` (``[E]`` int64, ``None`` after an
    update), which :func:`update_expert_bias` consumes.

    Host syncs per forward: dropless, one in :func:`~omni_parallel.expert_parallel.dispatch` under EP (the
    split sizes of the all-to-all) and one in :class:`GroupedExperts` on the per-expert loop (its split
    sizes; none on the ``torch._grouped_mm`` path); with a capacity, one more for the kept row count.

    Raises:
        ValueError: ``ep`` does not divide ``cfg.experts``; (forward) ``shard.valid`` not of ``T`` rows, or
            ``shard.tokens`` not ``T`` without ``shard.valid``.
    """

    def __init__(self, cfg: MoEConfig, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ep_group = ep_group
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        if cfg.experts % ep:
            raise ValueError(f"MoEConfig.experts = {cfg.experts} is not divisible by the EP size {ep}")
        self.ep = ep
        self.loss_scale = 1.0  # the objective's weight of the attached losses is loss_scale * coef
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.local_experts = cfg.experts // ep
        self.router = TopKRouter(
            cfg.dim, cfg.experts, cfg.top_k, norm_topk_prob=cfg.norm_topk_prob,
            expert_bias=cfg.bias_update_rate is not None,
        )  # fmt: skip
        # (token, slot) assignments per expert since the last update_expert_bias (forwards run by
        # activation recompute inside the backward are not counted); only with a router bias
        self.pending_load: torch.Tensor | None = None
        self.experts = GroupedExperts(self.local_experts, cfg.dim, cfg.hidden)
        self.shared_expert = _SharedSwiGLU(cfg.dim, cfg.shared_width) if cfg.shared_width else None
        self.shared_expert_gate = (
            nn.Linear(cfg.dim, 1, bias=False) if cfg.shared_gate and cfg.shared_width else None
        )

    @property
    def expert_range(self) -> range:
        """Global ids of the experts held here."""
        return range(self.ep_rank * self.local_experts, (self.ep_rank + 1) * self.local_experts)

    @torch.no_grad()
    def init_weights(self, gen: torch.Generator, std: float, out_std: float | None = None) -> None:
        """Draw every weight from ``gen`` (float64 normal, ``std``; ``out_std`` for the down projections,
        default ``std``), the routed experts for all ``E`` experts in global order and this rank keeping
        its shard: any EP size holds the same weights as ``ep = 1`` for the same generator state."""
        if self.router.weight.is_meta:  # no values to draw (a memory plan builds on meta)
            return
        out_std = std if out_std is None else out_std
        cfg = self.cfg

        def draw(shape: tuple[int, ...], s: float) -> torch.Tensor:
            return torch.randn(shape, generator=gen, dtype=torch.float64).mul_(s)

        self.router.weight.copy_(draw(tuple(self.router.weight.shape), std))
        lo, hi = self.expert_range.start, self.expert_range.stop
        gate_up = draw((cfg.experts, 2 * cfg.hidden, cfg.dim), std)[lo:hi]
        down = draw((cfg.experts, cfg.dim, cfg.hidden), out_std)[lo:hi]
        self.experts.gate_up_proj.copy_(gate_up)
        self.experts.down_proj.copy_(down)
        if self.shared_expert is not None:
            for lin, s in (
                (self.shared_expert.gate_proj, std),
                (self.shared_expert.up_proj, std),
                (self.shared_expert.down_proj, out_std),
            ):
                lin.weight.copy_(draw(tuple(lin.weight.shape), s))
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.weight.copy_(draw(tuple(self.shared_expert_gate.weight.shape), std))

    def forward(self, x: torch.Tensor, shard: PackShard | None = None) -> MoEOutput:
        cfg = self.cfg
        if shard is not None and shard.valid is not None and shard.valid.numel() != x.shape[0]:
            raise ValueError(f"PackShard.valid has {shard.valid.numel()} rows, x has {x.shape[0]}")
        if shard is not None and shard.valid is None and shard.tokens not in (None, x.shape[0]):
            raise ValueError(
                f"PackShard.tokens = {shard.tokens} without PackShard.valid, x has {x.shape[0]} rows"
            )
        t = x.shape[0] if shard is None or shard.tokens is None else shard.tokens  # valid tokens
        r = self.router(x)
        aux, z, counts = _pack_statistics(r.probs, r.logits, r.indices, cfg.experts, shard)
        flat = r.indices.reshape(-1)  # [T*k], slot j of token i at i*k + j
        if shard is not None and shard.valid is not None:  # padding rows sort last and are not sent
            flat = torch.where(shard.valid.repeat_interleave(cfg.top_k), flat, cfg.experts)
        if self.router.expert_bias is not None and _counts_toward_load():
            self.pending_load = counts if self.pending_load is None else self.pending_load + counts
        weights = r.weights.reshape(-1)
        n = t * cfg.top_k  # dropless: every valid (token, slot) row is sent, no host sync
        routed = counts
        if cfg.capacity_factor is not None:
            keep = _within_capacity(flat, cfg.experts, cfg.capacity_factor, t * cfg.top_k)
            flat = torch.where(keep, flat, cfg.experts)  # dropped slots sort last and are not sent
            routed = torch.bincount(flat, minlength=cfg.experts + 1)[: cfg.experts]
            n = int((flat < cfg.experts).sum())  # the one extra host sync of a capacity: the kept rows
        # Stable sort by expert: the rows for expert e are contiguous, in token order.
        order = torch.argsort(flat, stable=True)[:n]
        rows = x[order // cfg.top_k]  # [n, dim]
        if self.ep_group is None:
            y, received = self.experts(rows, routed), n
        else:
            recv, plan = dispatch(rows, routed, self.ep_group)
            y, received = combine(self.experts(recv, plan.local_counts), plan), recv.shape[0]
        # weight each row by its slot's routing weight, then sum the k slots of each token
        y = y * weights[order].unsqueeze(-1)
        out = torch.zeros_like(x).index_add(0, order // cfg.top_k, y)
        if self.shared_expert is not None:
            s = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            out = out + s
        out = attach_aux_loss(out, aux, self.loss_scale * cfg.aux_loss_coef)
        out = attach_aux_loss(out, z, self.loss_scale * cfg.z_loss_coef)
        return MoEOutput(out, aux, z, counts, n, received, t * cfg.top_k)


def _within_capacity(flat: torch.Tensor, experts: int, factor: float, slots: int) -> torch.Tensor:
    """``[T*k]`` bool: the assignment fits its expert's capacity ``ceil(factor * slots / E)`` (first come,
    first served in (token, slot) order); a padding row (id ``experts``) counts toward none."""
    import math

    cap = math.ceil(factor * slots / experts)
    one_hot = F.one_hot(flat, experts + 1)[:, :experts]  # id ``experts``: a padding row, in no expert
    rank_in_expert = (torch.cumsum(one_hot, 0) * one_hot).sum(-1) - 1
    return rank_in_expert < cap


def _counts_toward_load() -> bool:
    """Whether a forward running now counts toward the expert loads: with autograd on, and not a
    recompute (activation checkpointing re-runs forwards inside the autograd engine's graph task)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def moe_layers(modules: Iterable[nn.Module]) -> list[MoE]:
    """Every :class:`MoE` in ``modules``, each once, in module order."""
    seen: dict[int, MoE] = {}
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, MoE):
                seen.setdefault(id(sub), sub)
    return list(seen.values())


@torch.no_grad()
def update_expert_bias(modules: Iterable[nn.Module], group: dist.ProcessGroup | None) -> int:
    """Move every router's expert bias by the loads since the last call, then forget those loads:
    ``b_e += rate * sign(mean_e' load_e' - load_e)`` (DeepSeek-V3 §2.1.2; Megatron-Core's
    ``moe_router_bias_update_rate``, torchtitan's ``load_balance_coeff``): under-loaded experts become
    likelier, over-loaded ones less, by a fixed step; the gate weights are untouched.

    Args:
        modules: this rank's modules holding :class:`MoE` layers (one pipeline stage's chunks).
        group: the ranks that route the same layers' tokens (a stage's ``dp_cp`` ranks: data replicas,
            CP / Ulysses shards and EP ranks); their loads are summed (one ``all_reduce`` of ``[layers, E]``
            int64) so every member applies the same update. ``None``: this rank alone.

    Returns:
        The number of layers updated (those built with :attr:`MoEConfig.bias_update_rate`; collective over
        ``group`` when > 0: every member must hold the same layers, as a stage's ranks do).

    Call it once per optimizer step, after the step's last backward, on every rank of ``group``. A layer
    with rate 0 keeps its bias; one that saw no token (loads all 0) too (``sign(0) = 0``).
    """
    layers = [m for m in moe_layers(modules) if m.router.expert_bias is not None]
    if not layers:
        return 0
    device = layers[0].router.expert_bias.device
    loads = torch.stack(
        [
            m.pending_load.to(device, torch.int64)
            if m.pending_load is not None
            else torch.zeros(m.cfg.experts, dtype=torch.int64, device=device)
            for m in layers
        ]
    )
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    for m, load in zip(layers, loads):
        m.pending_load = None
        bias = m.router.expert_bias
        wide = load.to(torch.float64)
        step = float(m.cfg.bias_update_rate) * torch.sign(wide.mean() - wide)
        bias.copy_((bias.to(torch.float64) + step).to(bias.dtype))
    return len(layers)


def expert_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The routed experts' parameters (those of every :class:`~omni_parallel.moe.GroupedExperts`) in
    ``modules``, each once, in module order."""
    seen: dict[int, nn.Parameter] = {}
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, GroupedExperts):
                for p in sub.parameters():
                    seen.setdefault(id(p), p)
    return list(seen.values())


def shard_experts(modules: Iterable[nn.Module], mesh: DeviceMesh) -> None:
    """Make every routed expert parameter in ``modules`` a DTensor ``Shard(0)`` over the 1-D EP ``mesh``
    (its local tensor: this rank's ``E/ep`` experts, as :class:`~omni_parallel.moe.MoE` built them), in
    place. Their gradients are then ``Shard(0)`` DTensors too, so a global gradient norm
    (:func:`omni_parallel.clip_grad_norm_`), a checkpoint's boxes and ``full_tensor`` see all ``E``
    experts. Call after moving the modules to their device and dtype, before building the optimizer."""
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, GroupedExperts):
                for name, p in list(sub.named_parameters(recurse=False)):
                    if isinstance(p, DTensor):
                        continue
                    d = DTensor.from_local(p.data, mesh, [Shard(0)], run_check=False)
                    setattr(sub, name, nn.Parameter(d, requires_grad=p.requires_grad))


def expert_parallel_sync(
    modules: Iterable[nn.Module],
    dense_group: dist.ProcessGroup | None,
    expert_group: dist.ProcessGroup | None,
) -> Callable[[], None]:
    """The gradient sync of a model with routed experts: a plain sum of the non-expert gradients over
    ``dense_group`` (a stage's ``dp_cp`` ranks, as :func:`omni_parallel.apply_dp`; TP partial gradients
    first) and of the expert gradients over ``expert_group`` only (the expert-data-parallel ranks holding
    the same shard, :attr:`omni_parallel.ParallelState.expert_dp_group`; ``None``: one holder, nothing to
    sum). The EP ranks need no sum: dispatch's backward already brought every token's gradient to the
    rank holding its expert.

    Returns:
        The hook, to call on every rank after the step's last backward (collective over both groups).
    """
    from omni_parallel.data_parallel import all_reduce_gradients
    from omni_parallel.tensor_parallel import reduce_partial_gradients

    modules = list(modules)
    experts = expert_parameters(modules)
    ids = {id(p) for p in experts}
    dense = [p for m in modules for p in m.parameters() if p.requires_grad and id(p) not in ids]

    def sync() -> None:
        reduce_partial_gradients(dense)
        all_reduce_gradients(dense, dense_group)
        all_reduce_gradients(experts, expert_group)

    return sync
