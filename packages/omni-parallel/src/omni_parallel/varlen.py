"""Packed variable-length attention: the one entry point, :func:`varlen_attention`, for every model in the
repo (LLM, ViT, audio encoder) and the local kernel of Ulysses and CP.

A packed sequence holds several documents delimited by ``cu_seqlens``; no token attends across a document
boundary. Two kernels sit behind the entry point, chosen by :func:`uses_device_kernel`:

* on CUDA in float16/bfloat16 (head_dim a multiple of 8, at most 256): torch's fused varlen kernel,
  ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2's varlen interface, Dao 2023, or cuDNN's),
  one launch for the whole pack, ``O(T)`` memory;
* everywhere else (CPU, float32/float64): the reference kernel, one ``scaled_dot_product_attention`` per
  document (``O(sum L_d^2)`` work and memory, not ``O(T^2)``); it is also the single-process oracle of
  the distributed tests and of the device kernel (``tests/test_parallel_varlen_cuda.py``).

Both stay out of ``torch.compile`` graphs (``torch.compiler.disable``): the reference loop over documents
would specialise a compiled block on every ``cu_seqlens``, and the device kernel needs the longest
document as a Python int. ``cu_seqlens`` is validated on the host: pass it as a CPU tensor or a list to
keep the GPU stream free of synchronisations (a CUDA tensor is read back once per call).

Conventions: packed tensors are ``[tokens, heads, head_dim]``; ``cu_seqlens`` is ``[docs + 1]`` int64
cumulative lengths starting at 0 (FlashAttention's varlen convention). GQA: query head ``h`` uses
key/value head ``h // (heads_q // heads_kv)``.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "as_cu_seqlens",
    "cu_seqlens_from_lengths",
    "masked_attention",
    "uses_device_kernel",
    "varlen_attention",
]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def cu_seqlens_from_lengths(lengths: Sequence[int]) -> torch.Tensor:
    """``[docs]`` lengths (tokens) -> ``[docs + 1]`` int64 ``cu_seqlens``. Raises ``ValueError`` on a
    negative or non-integer length."""
    values = [_tokens(f"lengths[{i}]", n) for i, n in enumerate(lengths)]
    for i, n in enumerate(values):
        if n < 0:
            raise ValueError(f"lengths[{i}] = {n} is negative")
    out = torch.zeros(len(values) + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(torch.as_tensor(values, dtype=torch.int64), 0)
    return out


def _tokens(what: str, c: object) -> int:
    # int(2.5) would silently move a document boundary: only integral values are accepted.
    try:
        return operator.index(c)  # type: ignore[arg-type]
    except TypeError:
        if isinstance(c, float) and c.is_integer():
            return int(c)
        raise ValueError(f"{what} = {c!r} is not an integer number of tokens") from None


def as_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], total: int | None = None) -> list[int]:
    """Validate ``cu_seqlens`` and return it as a Python list.

    Raises:
        ValueError: not 1-D, not integers, not starting at 0, decreasing, or (if ``total`` is given)
            not ending at ``total``.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [docs + 1], got shape {tuple(cu_seqlens.shape)}")
        raw = cu_seqlens.tolist()
    else:
        raw = list(cu_seqlens)
    cu = [_tokens(f"cu_seqlens[{i}]", c) for i, c in enumerate(raw)]
    if not cu or cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[:3]}...")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(f"cu_seqlens must be non-decreasing; cu_seqlens[{i}] = {cu[i]} < {cu[i - 1]}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but the packed sequence has {total} tokens")
    return cu


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"expected q [T, Hq, D] and k, v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} != k/v head_dim {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"heads_q = {q.shape[1]} is not a multiple of heads_kv = {k.shape[1]} (GQA)")
    return q.shape[1] // k.shape[1]


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of one document's queries over its keys.

    Args:
        q: ``[tokens_q, heads_q, head_dim]``.
        k, v: ``[tokens_k, heads_kv, head_dim]``; ``heads_q`` a multiple of ``heads_kv`` (GQA).
        mask: optional ``[tokens_q, tokens_k]`` bool, True = may attend. Every row needs one True.
        causal: top-left causal mask (needs ``mask is None``).
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``[tokens_q, heads_q, head_dim]``.
    """
    rep = _check_heads(q, k, v)
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=causal, scale=scale
    )
    return out.transpose(0, 1)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over a packed sequence, separately per document.

    Args:
        q: ``[tokens, heads_q, head_dim]``.
        k, v: ``[tokens, heads_kv, head_dim]``.
        cu_seqlens: ``[docs + 1]`` boundaries; must end at ``tokens``.
        causal: causal mask inside each document.
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``[tokens, heads_q, head_dim]``.

    Raises:
        ValueError: bad shapes, heads_q not a multiple of heads_kv, or bad ``cu_seqlens``.
    """
    return _attend(q, k, v, cu_seqlens, causal, scale)


def uses_device_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`varlen_attention` runs torch's fused varlen kernel for these inputs: CUDA tensors of
    one dtype, float16 or bfloat16, head_dim a multiple of 8 and at most 256 (FlashAttention's limits);
    otherwise it runs the reference kernel."""
    return (
        q.is_cuda
        and q.dtype in _KERNEL_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
    )


@torch.compiler.disable
def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    rep = _check_heads(q, k, v)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens but k/v have {k.shape[0]}")
    cu = as_cu_seqlens(cu_seqlens, q.shape[0])
    if uses_device_kernel(q, k, v):
        return _fused(q, k, v, cu, rep > 1, causal, scale)
    outs = [
        masked_attention(q[a:b], k[a:b], v[a:b], causal=causal, scale=scale)
        for a, b in itertools.pairwise(cu)
        if b > a
    ]
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def _fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: list[int],
    gqa: bool,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cu = [c for i, c in enumerate(cu) if i == 0 or c != cu[i - 1]]  # empty documents attend to nothing
    if len(cu) < 2:
        return q.new_zeros(q.shape)
    longest = max(b - a for a, b in itertools.pairwise(cu))
    # Pinned and non-blocking: the host-validated boundaries reach the GPU without a stream sync.
    bounds = torch.tensor(cu, dtype=torch.int32).pin_memory().to(q.device, non_blocking=True)
    q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
    # One tensor for queries and keys: cuDNN's causal varlen needs them to be the same object.
    return varlen_attn(
        q,
        k,
        v,
        bounds,
        bounds,
        longest,
        longest,
        scale=scale,
        window_size=(-1, 0) if causal else (-1, -1),
        enable_gqa=gqa,
    )
