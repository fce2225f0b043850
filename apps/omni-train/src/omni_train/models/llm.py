"""A LLaMA-style decoder (RMSNorm, RoPE, SwiGLU, GQA) over packed sequences, split into pipeline stages.

Touvron et al., "LLaMA" (2023): pre-norm blocks with RMSNorm, rotary position embeddings, a SwiGLU MLP and
grouped-query attention. Sequences are packs of documents: ``position_ids`` restart at 0 in each document
and attention stays inside each document (``cu_seqlens``), so a pack computes exactly what its documents
would compute one by one.

Hugging Face layouts (:mod:`omni_train.hf.llm`): with the defaults this is ``LlamaForCausalLM``
(``rope_theta``, ``norm_eps`` = ``rms_norm_eps``); ``qkv_bias=True`` gives ``Qwen2ForCausalLM``; both use
the same "rotate half" RoPE layout as :func:`~omni_train.models.attention.apply_rope`, so their Q/K
weights load unpermuted. ``tie_embeddings`` shares the LM head with the token embedding (one stage only).

Pipeline split (DESIGN.md §Glossary, *stage*): stage 0 holds the token embedding and the first layers, the last stage
the last layers, the final norm and the LM head (layers per stage: ``omni_pipeline.split.stage_slices``);
every layer is initialised from a generator seeded by ``(seed, layer index)``, so any split of the same
config holds the same weights as the unsplit model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omni_parallel.context_parallel import cp_layout
from omni_parallel.hybrid_cp import CPSequence, cp_sequence_attention
from omni_parallel.moe import MoE, MoEConfig, PackShard
from omni_parallel.ulysses import ulysses_attention
from omni_parallel.varlen import varlen_attention
from omni_pipeline.split import stage_slices
from omni_train.models.attention import apply_rope, mrope_angles, rope_angles

__all__ = [
    "LLMConfig",
    "LLMStage",
    "MoEFeedForward",
    "MoESpec",
    "RMSNorm",
    "moe_forwards_per_step",
    "moe_layer_count",
    "moe_step_metrics",
    "set_moe_loss_scale",
    "set_moe_pack_group",
]


@dataclass(frozen=True)
class MoESpec:
    """``[model.llm] moe``: mixture-of-experts feed-forward layers (Qwen3-MoE / DeepSeek-MoE style,
    :class:`omni_parallel.moe.MoE`), dropless unless ``capacity_factor`` is set.

    Attributes:
        experts: routed experts per MoE layer (divisible by ``parallel.ep``).
        top_k: experts each token is routed to (1 <= top_k <= experts).
        shared_experts: always-on experts, fused into one SwiGLU of ``shared_experts * expert_ffn_dim``
            features (DeepSeek-MoE); 0: none.
        every_n_layers: layer ``i`` (0-based) is an MoE layer when ``(i + 1) % every_n_layers == 0``
            (Qwen2-MoE's ``decoder_sparse_step``); the others keep the dense SwiGLU.
        expert_ffn_dim: each expert's SwiGLU width (features; Qwen-MoE ``moe_intermediate_size``);
            unset: ``model.llm.ffn_dim``.
        shared_expert_ffn_dim: width of the fused shared SwiGLU (features; Qwen2-MoE
            ``shared_expert_intermediate_size``); unset: ``shared_experts * expert_ffn_dim``.
        shared_gate: scale the shared experts' output by ``sigmoid(x w)`` (Qwen2-MoE ``shared_expert_gate``).
        norm_topk_prob: renormalise the top-k routing weights to sum 1 (Qwen3-MoE ``norm_topk_prob``).
        aux_loss_coef: weight of the Switch load-balancing loss (``omni_parallel.moe.load_balancing_loss``)
            in the objective, >= 0: the objective holds ``aux_loss_coef x`` its mean over the step's packs
            (forwards) and the model's MoE layers (:func:`set_moe_loss_scale`), so it does not change with
            ``parallel.dp`` / ``data.microbatches``; the scale of Qwen2-MoE's ``router_aux_loss_coef``.
        z_loss_coef: weight of the ST-MoE router z-loss, normalised the same way, >= 0.
        capacity_factor: unset: dropless (every token reaches its ``top_k`` experts); otherwise each
            expert takes at most ``ceil(capacity_factor * T * top_k / experts)`` of a forward's ``T``
            tokens, > 0.
        bias_update_rate: unset: no router bias. A number >= 0: each router keeps a per-expert bias added
            to the routing probabilities only to choose the top-k (DeepSeek-V3's auxiliary-loss-free load
            balancing, ``omni_parallel.moe.TopKRouter.expert_bias``; a buffer, in the checkpoint), moved
            after every optimizer step by ``rate * sign(mean load - load_e)`` with the loads summed over
            the stage's data ranks (``omni_parallel.moe.update_expert_bias``); 0 keeps it where it is. A
            step whose optimizer step is skipped (``train.on_nonfinite``) moves nothing: its loads count
            in the next update. Under CP / Ulysses / hybrid DP/CP the losses and loads are those of the
            whole packs (padding rows excluded, statistics summed over the ranks sharing a pack;
            :func:`set_moe_pack_group`), as in one process.
    """

    experts: int = 8
    top_k: int = 2
    shared_experts: int = 0
    every_n_layers: int = 1
    expert_ffn_dim: int | None = None
    shared_expert_ffn_dim: int | None = None
    shared_gate: bool = False
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    capacity_factor: float | None = None
    bias_update_rate: float | None = None

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (0-based) is an MoE layer."""
        return (i + 1) % self.every_n_layers == 0

    def layer_config(self, dim: int, ffn_dim: int) -> MoEConfig:
        """The package's :class:`~omni_parallel.moe.MoEConfig` of one MoE layer."""
        hidden = self.expert_ffn_dim if self.expert_ffn_dim is not None else ffn_dim
        return MoEConfig(
            dim, hidden, self.experts, self.top_k, shared_experts=self.shared_experts,
            shared_hidden=self.shared_expert_ffn_dim, shared_gate=self.shared_gate,
            norm_topk_prob=self.norm_topk_prob, aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef, capacity_factor=self.capacity_factor,
            bias_update_rate=self.bias_update_rate,
        )  # fmt: skip


@dataclass(frozen=True)
class LLMConfig:
    """LLM shape. ``dim`` and ``ffn_dim`` in features; ``n_heads % n_kv_heads == 0`` (GQA).

    ``qkv_bias``: biases on the Q/K/V projections (Qwen2); ``tie_embeddings``: the LM head is the token
    embedding matrix (needs the first and last stage on one rank). ``moe``: mixture-of-experts layers
    (:class:`MoESpec`); unset: every layer dense.

    ``vocab_size`` is ``None`` until the tokenizer is known: a run config's ``[model.llm]`` leaves it out
    and ``ModelConfig.llm_config`` sets it from ``data.tokenizer``.

    ``mrope_section``: multimodal RoPE (Qwen2-VL's M-RoPE, :func:`~omni_train.models.attention.mrope_angles`):
    3 counts of rotary frequencies (temporal, height, width) summing to ``head_dim / 2``; the LLM then takes
    ``[3, T]`` position ids (``omni_pipeline.mrope``). Unset: 1-D RoPE over ``[T]`` positions.
    """

    vocab_size: int | None = None
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False
    moe: MoESpec | None = None
    mrope_section: list[int] | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019): ``x / rms(x) * weight`` over the last dim."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal GQA self-attention with RoPE, per packed document.

    With ``sp_group`` (Ulysses sequence parallelism, size ``sp``) ``x`` is this rank's contiguous
    ``1/sp`` chunk of the packed sequence and ``cu_seqlens`` are the whole sequence's; attention runs
    through :func:`omni_parallel.ulysses.ulysses_attention` (all-to-all tokens <-> heads).

    Context parallelism: ``cu_seqlens`` is an :class:`omni_parallel.CPSequence` (this rank's tokens of a
    pack: whole documents and head-tail CP shares with their groups), attention runs through
    :func:`omni_parallel.cp_sequence_attention` (all-gather or ring K/V).
    """

    def __init__(self, cfg: LLMConfig, sp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.sp_group = sp_group
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor | CPSequence
    ) -> torch.Tensor:
        t = x.shape[0]
        # Head counts come from the projections' outputs, not the config: under tensor parallelism each
        # rank holds a column slice of wq/wk/wv, i.e. its local heads (omni_parallel.tensor_parallel).
        q = apply_rope(self.wq(x).view(t, -1, self.head_dim), *rope)
        k = apply_rope(self.wk(x).view(t, -1, self.head_dim), *rope)
        v = self.wv(x).view(t, -1, self.head_dim)
        if isinstance(cu_seqlens, CPSequence):
            out = cp_sequence_attention(q, k, v, cu_seqlens, causal=True)
        elif self.sp_group is not None:
            out = ulysses_attention(q, k, v, self.sp_group, cu_seqlens=cu_seqlens, causal=True)
        else:
            out = varlen_attention(q, k, v, cu_seqlens, causal=True)
        return self.wo(out.reshape(t, -1))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` (Shazeer, "GLU Variants Improve Transformer", 2020)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEFeedForward(nn.Module):
    """An MoE layer in place of the SwiGLU MLP: ``[T, dim] -> [T, dim]`` through
    :class:`omni_parallel.moe.MoE` (its aux and z losses attached to the output's backward).

    ``stats``: one float64 row per forward since the last :func:`moe_step_metrics` (forwards re-run by
    activation recompute inside the backward are not counted): ``[1, aux, z, routed, computed,
    tokens_per_expert (E)]``, ``routed`` this rank's (token, slot) assignments before any capacity drop
    (``T x top_k``, ``T`` its tokens, padding rows excluded), ``computed`` the rows its experts computed
    (after the senders' capacity drops). With a :attr:`pack_group`, ``aux`` and ``z`` are the whole pack's
    on each rank sharing it (every pack is shared by the same number of ranks, so their mean over the
    rows is the mean over packs).

    Forward: ``x [T, dim]``, ``shard`` (:class:`omni_parallel.moe.PackShard` without a group, optional:
    the rows that are tokens) -> ``[T, dim]``; the shard gets :attr:`pack_group` (``None``: packs whole).
    """

    def __init__(self, cfg: MoEConfig, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.moe = MoE(cfg, ep_group)
        self.stats: list[torch.Tensor] = []
        self.pack_group: dist.ProcessGroup | None = None  # the ranks sharing a pack (set_moe_pack_group)

    def forward(self, x: torch.Tensor, shard: PackShard | None = None) -> torch.Tensor:
        group = self.pack_group
        if group is not None or shard is not None:
            shard = PackShard(None, None, group) if shard is None else dataclasses.replace(shard, group=group)
        r = self.moe(x, shard)
        # a recompute (activation checkpointing) runs inside the autograd engine's graph task
        if torch._C._current_graph_task_id() == -1:
            head = torch.tensor(
                [1.0, float(r.aux.detach()), float(r.z.detach()), r.routed, r.received], dtype=torch.float64
            )
            self.stats.append(torch.cat([head, r.tokens_per_expert.detach().to("cpu", torch.float64)]))
        return r.out


def moe_layer_count(cfg: LLMConfig) -> int:
    """MoE layers of the whole model (all pipeline stages); 0 without ``cfg.moe``."""
    return 0 if cfg.moe is None else sum(cfg.moe.is_moe_layer(i) for i in range(cfg.n_layers))


def moe_forwards_per_step(microbatches: int, *, world: int, pp: int, tp: int, pack_ranks: int = 1) -> int:
    """Packs through one MoE layer per step over the world: each of a pipeline stage's ``world / (pp x tp)``
    ranks (DP, CP and Ulysses ranks; TP peers share a forward) runs it on ``microbatches`` packs or their
    shares, a pack shared by ``pack_ranks`` ranks (``cp`` or ``ulysses``; ``dp x cp`` under hybrid DP/CP)
    counting once: ``microbatches x world / (pp x tp x pack_ranks)``. With DP only: the step's global
    pack count, ``dp x microbatches``."""
    return microbatches * (world // (pp * tp * pack_ranks))


def set_moe_loss_scale(stages: nn.Module, cfg: LLMConfig, forwards: int) -> float:
    """Normalise the MoE aux / z losses against a cross-entropy that is a mean over the step's tokens:
    every MoE layer in ``stages`` gets :attr:`omni_parallel.moe.MoE.loss_scale` ``= 1 / (forwards x
    moe layers)``, so the objective holds ``aux_loss_coef x`` the mean of the per-forward load-balancing
    loss over the step's forwards and the model's MoE layers (likewise ``z_loss_coef``): the same at any
    ``parallel.dp`` / ``data.microbatches`` split of the same global batch.

    Args:
        stages: this rank's LLM stage(s).
        cfg: the LLM config (its MoE layer count).
        forwards: forwards of one MoE layer per step over the world: ``data.microbatches`` x the ranks
            of a pipeline stage that run them (``world / (pp x tp)``; with dp only: the step's global
            pack count, ``dp x microbatches``; Megatron-Core's ``MoEAuxLossAutoScaler`` scale is
            ``1 / num_microbatches``, with the DP mean on top).

    Layers are averaged, not summed: ``transformers``' Qwen2-MoE ``load_balancing_loss_func`` pools every
    layer's router rows into one loss of one layer's scale and adds ``router_aux_loss_coef`` times it
    once per batch, so an imported ``router_aux_loss_coef`` means the same here.

    Returns:
        The scale set (1.0 without MoE layers).

    Raises:
        ValueError: ``forwards`` < 1.
    """
    if forwards < 1:
        raise ValueError(f"forwards must be >= 1, got {forwards}")
    layers = moe_layer_count(cfg)
    if layers == 0:
        return 1.0
    scale = 1.0 / (forwards * layers)
    for m in stages.modules():
        if isinstance(m, MoEFeedForward):
            m.moe.loss_scale = scale
    return scale


def set_moe_pack_group(stages: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Every MoE layer in ``stages`` reduces its losses and loads over ``group``: the ranks that share one
    pack (the Ulysses group, the CP group, or the stage's ``dp_cp`` group under hybrid DP/CP; ``None``:
    packs whole on each rank). Returns the number of layers set."""
    n = 0
    for m in stages.modules():
        if isinstance(m, MoEFeedForward):
            m.pack_group = group
            n += 1
    return n


def moe_step_metrics(stages: nn.Module, cfg: LLMConfig, group: dist.ProcessGroup | None) -> dict:
    """The step's MoE load metrics for ``metrics.jsonl`` (collective over ``group``, every rank: the
    world), clearing every layer's :attr:`MoEFeedForward.stats`. Empty without ``cfg.moe``.

    Returns (sums over every rank and forward; TP peers are not deduplicated, MoE refuses TP; CP /
    Ulysses padding rows are in none, a pack shared by several ranks counts once):
        ``moe_aux``, ``moe_z``: the mean load-balancing and z-loss per layer forward (unscaled; under CP /
        Ulysses / hybrid DP/CP each forward reports its whole pack's, so the mean is over packs);
        ``moe_tokens_routed``: (token, slot) assignments before any capacity drop (``tokens x top_k`` per
        MoE layer); ``moe_tokens_computed``: rows the experts computed (after the drops);
        ``moe_tokens_dropped``: routed - computed (0 when dropless); ``moe_tokens_per_expert``:
        ``{"L<layer>/e<expert>": rows}``; ``moe_load_max_over_mean``: ``{"L<layer>": max_e / mean_e}``
        of the rows per expert (1 = balanced).
    """
    if cfg.moe is None:
        return {}
    layers = [i for i in range(cfg.n_layers) if cfg.moe.is_moe_layer(i)]
    table = torch.zeros(len(layers), 5 + cfg.moe.experts, dtype=torch.float64)
    for m in stages.modules():
        if isinstance(m, Block) and isinstance(m.mlp, MoEFeedForward):
            if m.mlp.stats:
                table[layers.index(m.index)] += torch.stack(m.mlp.stats).sum(0)
            m.mlp.stats.clear()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(table, group=group)
    forwards = max(float(table[:, 0].sum()), 1.0)
    out: dict = {
        "moe_aux": float(table[:, 1].sum()) / forwards,
        "moe_z": float(table[:, 2].sum()) / forwards,
        "moe_tokens_routed": int(table[:, 3].sum()),
        "moe_tokens_computed": int(table[:, 4].sum()),
        "moe_tokens_dropped": int(table[:, 3].sum()) - int(table[:, 4].sum()),
        "moe_tokens_per_expert": {},
        "moe_load_max_over_mean": {},
    }
    for row, i in zip(table, layers):
        counts = row[5:]
        for e, c in enumerate(counts.tolist()):
            out["moe_tokens_per_expert"][f"L{i}/e{e}"] = int(c)
        mean = float(counts.mean())
        out["moe_load_max_over_mean"][f"L{i}"] = float(counts.max()) / mean if mean > 0 else 0.0
    return out


class Block(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    The two residual branches are methods, :meth:`attention_branch` and :meth:`mlp_branch`, so selective
    recompute (``omni_parallel.parallelize.apply_ac``, ``train.recompute_modules``) can checkpoint either.
    """

    def __init__(
        self,
        cfg: LLMConfig,
        sp_group: dist.ProcessGroup | None = None,
        *,
        index: int = 0,
        ep_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.index = index  # the layer's index in the whole LLM
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, sp_group)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.moe is not None and cfg.moe.is_moe_layer(index):
            self.mlp: nn.Module = MoEFeedForward(cfg.moe.layer_config(cfg.dim, cfg.ffn_dim), ep_group)
        else:
            self.mlp = SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: torch.Tensor,
        shard: PackShard | None = None,
    ) -> torch.Tensor:
        x = x + self.attention_branch(x, rope, cu_seqlens)
        return x + self.mlp_branch(x, shard)

    def attention_branch(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        """``attn(attn_norm(x))``: ``[T, dim] -> [T, dim]``."""
        return self.attn(self.attn_norm(x), rope, cu_seqlens)

    def mlp_branch(self, x: torch.Tensor, shard: PackShard | None = None) -> torch.Tensor:
        """``mlp(mlp_norm(x))``: ``[T, dim] -> [T, dim]``; ``shard``: an MoE layer's valid rows."""
        h = self.mlp_norm(x)
        return self.mlp(h, shard) if isinstance(self.mlp, MoEFeedForward) else self.mlp(h)


def _init_(module: nn.Module, gen: torch.Generator, std: float) -> None:
    for name, p in module.named_parameters():
        with torch.no_grad():
            if p.is_meta:  # no values to draw (the memory plan builds on meta)
                continue
            elif name.endswith("weight") and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).mul_(std).to(p.dtype))
            elif name.endswith("bias"):
                p.zero_()  # not nn.Linear's draw from the global generator: splits must stay identical


class LLMStage(nn.Module):
    """Layers ``[lo, hi)`` of the LLM; the first stage embeds tokens, the last applies norm + LM head.

    ``layers``: the stage's layer range (``omni_train.pipeline.stage_split``); default: its share of
    ``omni_pipeline.split.stage_slices(n_layers, num_stages)``.

    Forward:
        x: first stage: token ids int64 ``[T]``; otherwise hidden states ``[T, dim]``.
        position_ids: int64 ``[T]``, restarting at 0 in each packed document; with
            ``cfg.mrope_section`` int64 ``[3, T]`` M-RoPE positions (temporal, height, width;
            ``omni_pipeline.mrope.mrope_position_ids``), or ``[T]`` for text only.
        cu_seqlens: int64 ``[num_docs + 1]``.
        media_embeds: first stage only, optional ``[M, dim]`` encoder embeddings (after their projector);
            they replace the embeddings of the placeholder tokens at ``media_positions`` (int64 ``[M]``,
            packed positions of ``<|image|>``/``<|audio|>`` tokens, in the order the embeddings come).
        pack_tokens: Ulysses only, optional: the unpadded pack's token count (MoE statistics skip the
            chunk's padding rows at or past it).

    Returns:
        last stage: logits ``[T, vocab_size]``; otherwise hidden states ``[T, dim]``.

    Ulysses (``sp_group`` of size ``sp``): ``T`` is this rank's chunk (``T_packed / sp`` tokens),
    ``position_ids`` its global positions, ``cu_seqlens`` the whole packed sequence's, and media
    positions local to the chunk. Megatron sequence parallelism (``parallel.sequence_parallel``, TP
    size ``tp``; plans in :func:`omni_train.parallelize.parallelize`): the inputs (token ids, positions,
    ``cu_seqlens``, media positions) are the whole pack's, padded to a multiple of ``tp``, on every TP
    rank; stage 0 embeds the whole pack and keeps its ``T / tp`` token shard (``embedded``), the hidden
    states between blocks and across stages are ``[T / tp, dim]``, attention and MLP see all ``T``
    tokens, and the last stage's norm runs on the shard and its LM head on all ``T`` tokens (logits
    ``[T, vocab_size]`` on every TP rank). CP: ``T`` is this rank's tokens, ``position_ids`` their in-document
    positions, ``cu_seqlens`` an :class:`omni_parallel.CPSequence`, media positions local rows.

    MoE (``cfg.moe``): the MoE layers' routed experts are sharded over ``ep_group`` (expert
    parallelism, :mod:`omni_parallel.expert_parallel`; every rank of it runs the same forwards); ``None``:
    every expert here. Their losses and loads count only this rank's tokens, not its padding rows (an
    :class:`omni_parallel.moe.PackShard` per forward): under CP (``cu_seqlens`` a ``CPSequence``) the
    rows the head-tail layout pads, under Ulysses (``sp_group``) the rows of the chunk at or past
    ``pack_tokens`` (the unpadded pack's token count; ``None``: the chunk holds no padding). The ranks
    sharing a pack are set by :func:`set_moe_pack_group`.

    Raises:
        ValueError: ``tie_embeddings`` with more than one stage (the embedding and the LM head would live
            on different ranks); an ``mrope_section`` that is not 3 counts summing to ``head_dim / 2``.
    """

    def __init__(
        self,
        cfg: LLMConfig,
        stage: int = 0,
        num_stages: int = 1,
        *,
        seed: int = 0,
        sp_group: dist.ProcessGroup | None = None,
        layers: range | None = None,
        ep_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.sp_group = sp_group
        if cfg.tie_embeddings and num_stages > 1:
            raise ValueError(
                f"tie_embeddings needs the embedding and the LM head on one stage, got {num_stages} stages"
            )
        self.cfg = cfg
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        if cfg.vocab_size is None:
            raise ValueError("LLMStage: LLMConfig.vocab_size is not set (take it from the tokenizer)")
        if cfg.mrope_section is not None:
            mrope_angles(
                torch.zeros(3, 0, dtype=torch.int64), cfg.head_dim, cfg.rope_theta, cfg.mrope_section
            )
        layers = stage_slices(cfg.n_layers, num_stages)[stage] if layers is None else layers
        self.lo, self.hi = layers.start, layers.stop
        std = 0.02
        if self.is_first:
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
            _init_(self.tok_embeddings, torch.Generator().manual_seed(seed * 1000 + 999), std)
            # The embedded pack, media rows in place: where Megatron sequence parallelism
            # (omni_parallel.tensor_parallel.sequence_parallel_plan) keeps this TP rank's token shard.
            self.embedded = nn.Identity()
        self.layers = nn.ModuleDict()
        for i in range(self.lo, self.hi):
            block = Block(cfg, sp_group, index=i, ep_group=ep_group)
            gen = torch.Generator().manual_seed(seed * 1000 + i)
            _init_(block, gen, std)
            # Scale residual-branch outputs down with depth (GPT-2 / torchtitan convention).
            scale = 1.0 / (2 * cfg.n_layers) ** 0.5
            with torch.no_grad():
                block.attn.wo.weight.mul_(scale)
                if isinstance(block.mlp, MoEFeedForward):
                    # every expert drawn in global order: any EP size holds the same weights
                    block.mlp.moe.init_weights(gen, std, out_std=std * scale)
                else:
                    block.mlp.w2.weight.mul_(scale)
            self.layers[str(i)] = block
        if self.is_last:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            _init_(self.output, torch.Generator().manual_seed(seed * 1000 + 998), std)
            if cfg.tie_embeddings:
                self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        media_embeds: torch.Tensor | None = None,
        media_positions: torch.Tensor | None = None,
        pack_tokens: int | None = None,
    ) -> torch.Tensor:
        shard = self._pack_shard(x.shape[0], cu_seqlens, pack_tokens, x.device)
        if self.is_first:
            h = self.tok_embeddings(x)
            # No numel() shortcut: under CP the embeddings come out of a collective (a resharding
            # all-reduce) whose backward every CP rank must join, also one whose tokens hold no media.
            if media_embeds is not None and media_positions is not None:
                if media_embeds.shape != (media_positions.numel(), self.cfg.dim):
                    raise ValueError(
                        f"media_embeds {tuple(media_embeds.shape)} does not match "
                        f"{media_positions.numel()} placeholder positions x dim {self.cfg.dim}"
                    )
                h = h.index_put((media_positions,), media_embeds.to(h.dtype))
            h = self.embedded(h)
        else:
            h = x
        if self.cfg.mrope_section is None:
            rope = rope_angles(position_ids, self.cfg.head_dim, self.cfg.rope_theta)
        else:
            rope = mrope_angles(position_ids, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.mrope_section)
        for block in self.layers.values():
            h = block(h, rope, cu_seqlens, shard)
        if self.is_last:
            h = self.output(self.norm(h))
        return h

    def _pack_shard(
        self, rows: int, cu_seqlens: torch.Tensor | CPSequence, pack_tokens: int | None, device: torch.device
    ) -> PackShard | None:
        """This forward's valid rows for the MoE layers (``None``: no MoE layer here, or every row valid)."""
        if not any(isinstance(b.mlp, MoEFeedForward) for b in self.layers.values()):
            return None
        if isinstance(cu_seqlens, CPSequence):
            valid: list[bool] = []
            for seg in cu_seqlens.segments:
                if seg.cp == 1:
                    valid.extend([True] * seg.rows)
                    continue
                rank = dist.get_rank(cu_seqlens.groups[(seg.cp, seg.first)])
                valid.extend(j >= 0 for j in cp_layout(seg.cu_seqlens, seg.cp).source[rank])
            if len(valid) != rows:
                raise ValueError(f"LLMStage: the CP sequence holds {len(valid)} rows, the input {rows}")
            return PackShard.from_rows(valid, None, device)
        if self.sp_group is not None and pack_tokens is not None:
            lo = dist.get_rank(self.sp_group) * rows  # the chunk's first row in the padded pack
            return PackShard.from_rows([lo + i < pack_tokens for i in range(rows)], None, device)
        return None
