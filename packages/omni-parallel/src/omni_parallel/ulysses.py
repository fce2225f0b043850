"""Ulysses sequence parallelism for packed varlen attention (DeepSpeed-Ulysses, Jacobs et al. 2023).

Each of the ``sp`` ranks holds a contiguous ``1/sp`` of the packed sequence with all heads. One
all-to-all turns that into the whole sequence with ``1/sp`` of the heads, attention runs per document
(``cu_seqlens``), and a second all-to-all turns it back.

Head counts that ``sp`` does not divide, and GQA, are handled by padding whole *KV groups*: the KV
heads are padded with zero heads to a multiple of ``sp`` and each KV head keeps its own
``heads_q // heads_kv`` query heads, so every rank runs GQA with the original ratio (q 28 / kv 7 at
sp 2 -> kv 8, q 32: 4 kv and 16 q heads per rank). Padded heads' outputs are dropped, so their
gradients are zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from omni_parallel.comm import all_to_all_dim0
from omni_parallel.varlen import _check_heads, as_cu_seqlens, varlen_attention

__all__ = ["padded_heads", "ulysses_attention"]


def padded_heads(heads_q: int, heads_kv: int, sp: int) -> tuple[int, int]:
    """``(heads_q, heads_kv)`` after padding KV groups to a multiple of ``sp`` (ratio unchanged).

    Example: ``padded_heads(28, 7, 2) == (32, 8)``. Raises ``ValueError`` unless all three are positive
    and ``heads_kv`` divides ``heads_q`` (GQA).
    """
    if heads_q < 1 or heads_kv < 1 or sp < 1:
        raise ValueError(
            f"padded_heads: heads_q ({heads_q}), heads_kv ({heads_kv}) and sp ({sp}) must be >= 1"
        )
    if heads_q % heads_kv:
        raise ValueError(f"heads_q = {heads_q} is not a multiple of heads_kv = {heads_kv} (GQA)")
    kv = -(-heads_kv // sp) * sp
    return kv * (heads_q // heads_kv), kv


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    if x.shape[1] == heads:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], heads - x.shape[1], x.shape[2])], dim=1)


def _seq_to_heads(x: torch.Tensor, sp: int, group: dist.ProcessGroup) -> torch.Tensor:
    # [t_local, H, D] -> [sp * t_local, H / sp, D]: chunk j of the heads goes to rank j.
    t, h, d = x.shape
    send = x.view(t, sp, h // sp, d).transpose(0, 1).reshape(sp * t, h // sp, d)
    return all_to_all_dim0(send, group)


def _heads_to_seq(x: torch.Tensor, sp: int, group: dist.ProcessGroup) -> torch.Tensor:
    # [sp * t_local, h, D] -> [t_local, sp * h, D]: token chunk j goes back to rank j.
    recv = all_to_all_dim0(x, group)
    t, h, d = x.shape[0] // sp, x.shape[1], x.shape[2]
    return recv.view(sp, t, h, d).transpose(0, 1).reshape(t, sp * h, d)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    cu_seqlens: torch.Tensor | Sequence[int],
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Ulysses attention over a packed sequence split evenly along tokens across ``group``.

    Args:
        q: ``[tokens_local, heads_q, head_dim]``: rank ``r``'s tokens are
            ``[r * tokens_local, (r + 1) * tokens_local)`` of the packed sequence.
        k, v: ``[tokens_local, heads_kv, head_dim]``; ``heads_q`` a multiple of ``heads_kv``.
        group: the Ulysses (SP) process group, size ``sp``.
        cu_seqlens: ``[docs + 1]`` boundaries of the *whole* packed sequence (``sp * tokens_local``).
        causal: causal mask inside each document.
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``[tokens_local, heads_q, head_dim]``, this rank's tokens of the attention output.

    Raises:
        ValueError: shapes, GQA ratio, or ``cu_seqlens`` not ending at ``sp * tokens_local``.

    Communication: two all-to-alls forward (q, k, v in one; the output in one), two backward.
    """
    _check_heads(q, k, v)
    sp = dist.get_world_size(group)
    t_local = q.shape[0]
    if k.shape[0] != t_local:
        raise ValueError(f"q has {t_local} local tokens but k/v have {k.shape[0]}")
    cu = as_cu_seqlens(cu_seqlens, sp * t_local)
    hq, hkv = q.shape[1], k.shape[1]
    phq, phkv = padded_heads(hq, hkv, sp)
    d = q.shape[2]
    if sp == 1:
        return varlen_attention(q, k, v, cu, causal=causal, scale=scale)
    # One all-to-all for q, k and v: per destination rank, its q heads then its k then its v heads.
    parts = [_pad_heads(x, n).view(t_local, sp, n // sp, d) for x, n in ((q, phq), (k, phkv), (v, phkv))]
    qkv = torch.cat(parts, dim=2).reshape(t_local, phq + 2 * phkv, d)
    full = _seq_to_heads(qkv, sp, group)
    lq, lkv = phq // sp, phkv // sp
    fq, fk, fv = full.split([lq, lkv, lkv], dim=1)
    out = varlen_attention(fq, fk, fv, cu, causal=causal, scale=scale)
    return _heads_to_seq(out, sp, group)[:, :hq]
