"""Context parallelism for packed varlen causal attention with head-tail (zigzag) load balancing.

Layout (as Megatron-LM CP / Llama 3's all-gather CP): each document of length ``L`` is padded to
``Lp = ceil(L / (2 cp)) * 2 cp`` and cut into ``2 cp`` chunks of ``Lp / (2 cp)`` tokens; CP rank ``r``
holds chunks ``r`` and ``2 cp - 1 - r`` (a head and a tail chunk), so under a causal mask every rank
does the same attention work. A rank's local sequence is, document by document, its head chunk then its
tail chunk.

Attention: K and V are all-gathered over the CP group (backward: reduce-scatter), and each rank
attends its local queries to the whole document under a mask built from global positions. Padding never
leaks: padded keys are masked out, padded query rows are zeroed, and :func:`unshard_from_cp` drops them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from omni_parallel.comm import all_gather_dim0
from omni_parallel.varlen import _check_heads, as_cu_seqlens, masked_attention

__all__ = ["CPLayout", "context_parallel_attention", "cp_layout", "shard_for_cp", "unshard_from_cp"]


@dataclass(frozen=True)
class CPLayout:
    """Where every local token of every CP rank comes from.

    Attributes:
        cp: CP size.
        cu_seqlens: ``[docs + 1]`` boundaries of the unpadded packed sequence.
        chunk: ``[docs]`` chunk length per document (tokens), ``Lp / (2 cp)``.
        local_cu_seqlens: ``[docs + 1]`` boundaries of each rank's local sequence (``2 * chunk``).
        source: ``[cp][tokens_local]`` global packed index of each local token, -1 for padding.
        position: ``[cp][tokens_local]`` position of each local token inside its document (padding
            continues past the document's end).
    """

    cp: int
    cu_seqlens: tuple[int, ...]
    chunk: tuple[int, ...]
    local_cu_seqlens: tuple[int, ...]
    source: tuple[tuple[int, ...], ...]
    position: tuple[tuple[int, ...], ...]

    @property
    def tokens_local(self) -> int:
        """Tokens each CP rank holds, padding included."""
        return self.local_cu_seqlens[-1]


def cp_layout(cu_seqlens: torch.Tensor | Sequence[int], cp: int) -> CPLayout:
    """Head-tail layout of a packed sequence over ``cp`` ranks. Pure; raises ``ValueError`` on bad input."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"cp must be a positive int, got {cp!r}")
    cu = as_cu_seqlens(cu_seqlens)
    chunks, local_cu = [], [0]
    source: list[list[int]] = [[] for _ in range(cp)]
    position: list[list[int]] = [[] for _ in range(cp)]
    for a, b in itertools.pairwise(cu):
        c = -(-(b - a) // (2 * cp))
        chunks.append(c)
        local_cu.append(local_cu[-1] + 2 * c)
        for r in range(cp):
            for j in (r, 2 * cp - 1 - r):
                for p in range(j * c, (j + 1) * c):
                    position[r].append(p)
                    source[r].append(a + p if a + p < b else -1)
    return CPLayout(
        cp=cp,
        cu_seqlens=tuple(cu),
        chunk=tuple(chunks),
        local_cu_seqlens=tuple(local_cu),
        source=tuple(tuple(s) for s in source),
        position=tuple(tuple(p) for p in position),
    )


def _rank_and_size(
    group: dist.ProcessGroup | None, cp_rank: int | None, cp_size: int | None
) -> tuple[int, int]:
    if group is not None:
        return dist.get_rank(group), dist.get_world_size(group)
    if cp_rank is None or cp_size is None:
        raise ValueError("pass either a CP group or both cp_rank and cp_size")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range for cp_size {cp_size}")
    return cp_rank, cp_size


def shard_for_cp(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    cp_rank: int | None = None,
    cp_size: int | None = None,
) -> torch.Tensor:
    """This CP rank's head-tail share of a packed tensor (differentiable; no communication).

    Args:
        x: ``[tokens, *rest]`` packed along dim 0.
        cu_seqlens: ``[docs + 1]`` boundaries, ending at ``tokens``.
        group: the CP group (gives rank and size), or pass ``cp_rank`` and ``cp_size``.

    Returns:
        ``[tokens_local, *rest]`` (see :class:`CPLayout`); padding rows are zero.
    """
    rank, size = _rank_and_size(group, cp_rank, cp_size)
    as_cu_seqlens(cu_seqlens, x.shape[0])
    layout = cp_layout(cu_seqlens, size)
    src = torch.tensor(layout.source[rank], dtype=torch.int64, device=x.device)
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    return padded.index_select(0, torch.where(src < 0, x.shape[0], src))


def unshard_from_cp(
    local: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Inverse of :func:`shard_for_cp`: all-gather every rank's share, restore global order, drop padding.

    Args:
        local: ``[tokens_local, *rest]``.
        cu_seqlens: ``[docs + 1]`` boundaries of the unpadded packed sequence.
        group: the CP group.

    Returns:
        ``[tokens, *rest]`` on every rank. Backward reduce-scatters, so if every rank back-propagates the
        same loss the local gradients are ``cp`` times that loss's.
    """
    cp = dist.get_world_size(group)
    layout = cp_layout(cu_seqlens, cp)
    if local.shape[0] != layout.tokens_local:
        raise ValueError(f"local has {local.shape[0]} tokens, the CP layout expects {layout.tokens_local}")
    gathered = all_gather_dim0(local, group)
    src = torch.tensor([s for r in range(cp) for s in layout.source[r]], dtype=torch.int64)
    keep = torch.nonzero(src >= 0).squeeze(1)
    order = torch.empty(layout.cu_seqlens[-1], dtype=torch.int64)
    order[src[keep]] = keep
    return gathered.index_select(0, order.to(local.device))


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    cu_seqlens: torch.Tensor | Sequence[int],
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention on CP-sharded packed input (all-gather KV, head-tail causal balancing).

    Args:
        q: ``[tokens_local, heads_q, head_dim]`` as produced by :func:`shard_for_cp`.
        k, v: ``[tokens_local, heads_kv, head_dim]``.
        group: the CP group, size ``cp``.
        cu_seqlens: ``[docs + 1]`` boundaries of the *unpadded global* packed sequence.
        causal: causal mask inside each document (by global position).
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``[tokens_local, heads_q, head_dim]``; padded rows are zero.

    Raises:
        ValueError: shapes disagree with the CP layout of ``cu_seqlens``.

    Communication: one all-gather of K and V forward, one reduce-scatter backward.
    """
    _check_heads(q, k, v)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = cp_layout(cu_seqlens, cp)
    t = layout.tokens_local
    if q.shape[0] != t or k.shape[0] != t:
        raise ValueError(f"q/k have {q.shape[0]}/{k.shape[0]} local tokens, the CP layout expects {t}")
    kv = all_gather_dim0(torch.cat([k, v], dim=1), group)  # [cp * t, 2 Hkv, D]
    gk, gv = kv.chunk(2, dim=1)
    device = q.device
    outs = []
    for d, (a, b) in enumerate(zip(layout.local_cu_seqlens[:-1], layout.local_cu_seqlens[1:])):
        length = layout.cu_seqlens[d + 1] - layout.cu_seqlens[d]
        if b == a:
            continue
        # Keys of document d from every rank, with their positions.
        k_idx = torch.cat([torch.arange(r * t + a, r * t + b) for r in range(cp)]).to(device)
        k_pos = torch.tensor([p for r in range(cp) for p in layout.position[r][a:b]], device=device)
        q_pos = torch.tensor(layout.position[rank][a:b], device=device)
        mask = (k_pos < length).unsqueeze(0).expand(b - a, -1)
        if causal:
            mask = mask & (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1))
        # Every row keeps at least one key (position 0 <= any query position), so softmax stays finite.
        out = masked_attention(
            q[a:b], gk.index_select(0, k_idx), gv.index_select(0, k_idx), mask=mask, scale=scale
        )
        valid = (q_pos < length).to(out.dtype).view(-1, 1, 1)
        outs.append(out * valid)
    return torch.cat(outs) if outs else q.new_zeros(q.shape)
