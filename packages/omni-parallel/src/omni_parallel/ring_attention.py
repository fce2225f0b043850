"""Ring attention for context parallelism: K and V travel around the CP ring, one block per step.

Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers" (2023), with the causal zigzag
(head-tail) load balance of Megatron-LM CP and zhuzilin/ring-flash-attention, over packed varlen
documents. The layout is :func:`omni_parallel.context_parallel.cp_layout`'s: every document is padded to
a multiple of ``2 cp`` and CP rank ``r`` holds its chunks ``r`` and ``2 cp - 1 - r``.

Forward: at step ``i`` rank ``r`` holds the K/V block of rank ``(r - i) mod cp``; it posts the block's
transfer to rank ``r + 1`` (and the next block's receive from ``r - 1``) *before* computing on it, so the
transfer overlaps the compute. Partial results are merged with their log-sum-exp (the online softmax of
FlashAttention). Causal balance: against a block from an earlier rank every local query sees only that
rank's head chunk; against a later rank only the local tail chunk sees anything; so each step costs half
a diagonal block's work on every rank and no rank waits for another.

Backward (recomputing the probabilities from the saved log-sum-exp, as FlashAttention does): the K/V
blocks travel the ring again; each rank adds its contribution to the K/V gradient of the block it holds
and passes that partial gradient on with it, so after ``cp`` steps every block's gradient is back on its
owner. Memory per rank: two K/V blocks in flight and ``O(tokens_local)`` saved state, against the
all-gather variant's whole-sequence K/V (:func:`omni_parallel.context_parallel.context_parallel_attention`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from omni_parallel.context_parallel import CPLayout, cp_layout
from omni_parallel.varlen import _check_heads

__all__ = ["ring_attention"]


@dataclass(frozen=True)
class _Tile:
    """Queries ``[qa, qb)`` of this rank against rows ``[ka, kb)`` of a source rank's K/V block, with a
    top-left causal mask (``causal``, equal lengths) or none: every pair of the tile may attend."""

    qa: int
    qb: int
    ka: int
    kb: int
    causal: bool


def _tiles(layout: CPLayout, rank: int, src: int, causal: bool) -> list[_Tile]:
    """The non-empty (query rows, key rows) pairs of every document for the block of rank ``src``.

    A rank's real tokens of a document are a prefix of its rows (head chunk before tail chunk, padding
    is a suffix in position order), so tiles are cut to real rows and need no padding mask; under
    ``causal`` a diagonal block is three tiles (head/head and tail/tail causal, tail/head full), a block
    of an earlier rank one full tile (all my queries, its head chunk), of a later rank one full tile (my
    tail chunk, all its keys)."""
    out = []
    for d, (a, b) in enumerate(itertools.pairwise(layout.local_cu_seqlens)):
        if b == a:
            continue
        length = layout.cu_seqlens[d + 1] - layout.cu_seqlens[d]
        c = (b - a) // 2
        nq = sum(p < length for p in layout.position[rank][a:b])
        nk = sum(p < length for p in layout.position[src][a:b])
        if not causal:
            spans = [(a, a + nq, a, a + nk, False)]
        elif src == rank:
            head = min(c, nq)
            spans = [(a, a + head, a, a + head, True), (a + c, a + nq, a, a + head, False)]
            spans.append((a + c, a + nq, a + c, a + nq, True))
        elif src < rank:  # an earlier rank's tail chunk lies after both of my chunks
            spans = [(a, a + nq, a, a + min(c, nk), False)]
        else:  # my head chunk lies before both of a later rank's chunks
            spans = [(a + c, a + nq, a, a + nk, False)]
        out += [_Tile(*t) for t in spans if t[1] > t[0] and t[3] > t[2]]
    return out


def _as_bhtd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [t, h, d] -> [1, h, t, d]


def _tile_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, fused: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [tq, h, d], lse [h, tq])`` of one tile (heads already matched). ``fused`` (default: on
    CPU): torch's fused flash kernel, which also returns the log-sum-exp; else plain tensor ops."""
    if q.device.type == "cpu" if fused is None else fused:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _as_bhtd(q), _as_bhtd(k), _as_bhtd(v), 0.0, causal, scale=scale
        )
        return o[0].transpose(0, 1), lse[0]
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", torch.exp(s - lse.unsqueeze(-1)), v), lse


def _tile_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` of one tile given the *final* output and log-sum-exp of its query rows (so the
    probabilities are those of the whole softmax, FlashAttention's backward); ``fused`` as in
    :func:`_tile_forward`."""
    if q.device.type == "cpu" if fused is None else fused:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _as_bhtd(dout), _as_bhtd(q), _as_bhtd(k), _as_bhtd(v), _as_bhtd(out), lse.unsqueeze(0),
            0.0, causal, scale=scale,
        )  # fmt: skip
        return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    delta = (dout * out).sum(-1).transpose(0, 1)  # rowsum(dO * O), FlashAttention's D
    ds = p * (torch.einsum("qhd,khd->hqk", dout, v) - delta.unsqueeze(-1))
    dq = torch.einsum("hqk,khd->qhd", ds, k) * scale
    return dq, torch.einsum("hqk,qhd->khd", ds, q) * scale, torch.einsum("hqk,qhd->khd", p, dout)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        keep = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _finite(x: torch.Tensor) -> torch.Tensor:
    # A row no tile reached keeps lse = -inf; merge with 0 in its place so its weights are 0, not NaN.
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


class _Ring:
    """One ring exchange: send ``x`` to the next CP rank, receive the previous rank's into a new buffer."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.cp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.cp)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.cp)

    def start(self, x: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        buf = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, self.next, self.group, tag),
            dist.P2POp(dist.irecv, buf, self.prev, self.group, tag),
        ]
        return buf, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending: tuple[torch.Tensor, list]) -> torch.Tensor:
        buf, works = pending
        for w in works:
            w.wait()
        return buf


_KV, _DKV = 0, 1  # P2P tags: K/V blocks and the travelling K/V gradients (both in flight in backward)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal, scale):  # type: ignore[override]
        with torch.autocast(q.device.type, enabled=False):  # the scores and softmax stay in `acc`
            return _RingAttention._forward(ctx, q, k, v, group, layout, causal, scale)

    @staticmethod
    def _forward(ctx, q, k, v, group, layout, causal, scale):
        ring = _Ring(group)
        hkv, rep = k.shape[1], q.shape[1] // k.shape[1]
        acc = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
        qf = q.to(acc)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
        block = torch.cat([k, v], dim=1).contiguous()
        for i in range(ring.cp):
            src = (ring.rank - i) % ring.cp
            pending = ring.start(block, _KV) if i < ring.cp - 1 else None
            kf = block[:, :hkv].to(acc).repeat_interleave(rep, dim=1)
            vf = block[:, hkv:].to(acc).repeat_interleave(rep, dim=1)
            for t in _tiles(layout, ring.rank, src, causal):
                o, blk = _tile_forward(qf[t.qa : t.qb], kf[t.ka : t.kb], vf[t.ka : t.kb], t.causal, scale)
                old = lse[:, t.qa : t.qb]
                new = torch.logaddexp(old, blk)
                a = torch.exp(old - _finite(new)).transpose(0, 1).unsqueeze(-1)
                b = torch.exp(blk - _finite(new)).transpose(0, 1).unsqueeze(-1)
                out[t.qa : t.qb] = out[t.qa : t.qb] * a + o * b
                lse[:, t.qa : t.qb] = new
            if pending is not None:
                block = _Ring.finish(pending)
        valid = torch.tensor([p >= 0 for p in layout.source[ring.rank]], dtype=acc, device=q.device)
        valid = valid.view(-1, 1, 1)
        ctx.save_for_backward(q, k, v, out, lse, valid)
        ctx.group, ctx.layout, ctx.causal, ctx.scale = group, layout, causal, scale
        return (out * valid).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        with torch.autocast(grad.device.type, enabled=False):
            return _RingAttention._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        q, k, v, out, lse, valid = ctx.saved_tensors
        ring, layout, scale = _Ring(ctx.group), ctx.layout, ctx.scale
        hkv, rep = k.shape[1], q.shape[1] // k.shape[1]
        acc = out.dtype
        qf, dout = q.to(acc), grad.to(acc) * valid
        lse = _finite(lse)
        dq = torch.zeros_like(qf)
        block = torch.cat([k, v], dim=1).contiguous()
        incoming = None  # the K/V gradient of the block I hold, summed by the ranks that held it before
        for i in range(ring.cp):
            src = (ring.rank - i) % ring.cp
            pending = ring.start(block, _KV) if i < ring.cp - 1 else None
            kf = block[:, :hkv].to(acc).repeat_interleave(rep, dim=1)
            vf = block[:, hkv:].to(acc).repeat_interleave(rep, dim=1)
            dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
            for t in _tiles(layout, ring.rank, src, ctx.causal):
                q_, k_ = slice(t.qa, t.qb), slice(t.ka, t.kb)
                g = _tile_backward(dout[q_], qf[q_], kf[k_], vf[k_], out[q_], lse[:, q_], t.causal, scale)
                dq[q_] += g[0]
                dk[k_] += g[1]
                dv[k_] += g[2]
            tk = dk.shape[0]
            mine = torch.cat([dk.view(tk, hkv, rep, -1).sum(2), dv.view(tk, hkv, rep, -1).sum(2)], dim=1)
            if incoming is not None:
                mine = mine + _Ring.finish(incoming)
            if ring.cp == 1:
                incoming = None
                break
            incoming = ring.start(mine.contiguous(), _DKV)  # on to the next holder (the last: the owner)
            if pending is not None:
                block = _Ring.finish(pending)
        dkv = mine if incoming is None else _Ring.finish(incoming)
        dk_own, dv_own = dkv.to(k.dtype).split(hkv, dim=1)
        return dq.to(q.dtype), dk_own, dv_own, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    cu_seqlens: torch.Tensor | Sequence[int],
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention on CP-sharded packed input, K/V passed around the ring (head-tail causal balance).

    The same contract as :func:`omni_parallel.context_parallel.context_parallel_attention` (its
    all-gather twin): inputs laid out by :func:`~omni_parallel.context_parallel.shard_for_cp`.

    Args:
        q: ``[tokens_local, heads_q, head_dim]``.
        k, v: ``[tokens_local, heads_kv, head_dim]``; ``heads_q`` a multiple of ``heads_kv`` (GQA).
        group: the CP group, size ``cp``; every rank of it calls with the same ``cu_seqlens``.
        cu_seqlens: ``[docs + 1]`` boundaries of the *unpadded global* packed sequence.
        causal: causal mask inside each document (by global position).
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``[tokens_local, heads_q, head_dim]``; padded rows are zero. Scores and the softmax run in
        float32 for bfloat16/float16 inputs, else in the input dtype.

    Raises:
        ValueError: shapes disagree with the CP layout of ``cu_seqlens``, or with each other (GQA).

    Communication: ``cp - 1`` ring steps forward (one K/V block each, overlapped with compute);
    backward ``cp - 1`` K/V steps plus ``cp`` steps of the travelling K/V gradient.
    """
    _check_heads(q, k, v)
    layout = cp_layout(cu_seqlens, dist.get_world_size(group))
    t = layout.tokens_local
    if q.shape[0] != t or k.shape[0] != t:
        raise ValueError(f"q/k have {q.shape[0]}/{k.shape[0]} local tokens, the CP layout expects {t}")
    if t == 0:
        return q.new_zeros(q.shape)
    s = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, group, layout, causal, s)
