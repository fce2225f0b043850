"""Planned point-to-point transfers over ``torch.distributed`` (isend / irecv), with shape checks.

Every receive buffer is allocated from the plan (never inferred from data). Each payload is preceded by a
small int64 header carrying the sender's shape, so a receiver whose plan disagrees with the sender's fails
with an error naming both ranks, the action and both shapes instead of reading garbage or hanging.
Messages are matched by (peer, tag): callers give every transfer of a step its own tag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["P2PError", "PendingRecv", "PlannedP2P"]

_HEADER_LEN = 9  # ndim + up to 8 dims


class P2PError(RuntimeError):
    """A transfer's shape disagrees with the plan; the message names rank, action and shapes."""


def _header(shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    if len(shape) > _HEADER_LEN - 1:
        raise P2PError(
            f"tensors of more than {_HEADER_LEN - 1} dims are not supported, got shape {tuple(shape)}"
        )
    h = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    h[0] = len(shape)
    h[1 : 1 + len(shape)] = torch.tensor(list(shape), dtype=torch.int64)
    return h


@dataclass
class PendingRecv:
    """A posted receive: ``buffer`` of the planned shape, filled once :meth:`PlannedP2P.wait` returns."""

    what: str
    src: int
    shape: tuple[int, ...]
    buffer: torch.Tensor
    header: torch.Tensor
    works: list = field(default_factory=list)


class PlannedP2P:
    """isend / irecv on one process group with planned shapes.

    Args:
        group: the process group (``None``: the default group); peers are named by group rank.
        rank: this process's rank in ``group`` (for messages).
        device: where receive buffers live (headers always go through the same device).
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int, device: torch.device) -> None:
        self.group = group
        self.rank = rank
        self.device = device
        self._sends: list = []

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str, planned: tuple[int, ...]) -> None:
        """Send ``tensor`` (header first) to group rank ``dst`` asynchronously.

        Raises:
            P2PError: ``tensor``'s shape is not the planned one (checked before anything is sent).
        """
        if tuple(tensor.shape) != tuple(planned):
            raise P2PError(
                f"rank {self.rank}, {what}: produced shape {tuple(tensor.shape)} but the plan says "
                f"{tuple(planned)}; fix the plan's token counts or the module"
            )
        payload = tensor.detach().contiguous()
        header = _header(payload.shape).to(self.device)
        peer = self._global(dst)
        self._sends.append((dist.isend(header, peer, group=self.group, tag=2 * tag), header))
        self._sends.append((dist.isend(payload, peer, group=self.group, tag=2 * tag + 1), payload))

    def post_recv(
        self, src: int, tag: int, what: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> PendingRecv:
        """Post a receive from group rank ``src`` into a buffer of the planned ``shape``."""
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        peer = self._global(src)
        pending = PendingRecv(what, src, tuple(shape), buf, header)
        pending.works.append(dist.irecv(header, peer, group=self.group, tag=2 * tag))
        pending.works.append(dist.irecv(buf, peer, group=self.group, tag=2 * tag + 1))
        return pending

    def wait(self, pending: PendingRecv) -> torch.Tensor:
        """Wait for a posted receive and check the sender's shape against the plan.

        Raises:
            P2PError: the sender's shape differs from the planned one.
        """
        pending.works[0].wait()
        h = pending.header.cpu()
        sent = tuple(int(x) for x in h[1 : 1 + int(h[0])])
        if sent != pending.shape:
            raise P2PError(
                f"rank {self.rank}, {pending.what}: rank {pending.src} sent shape {sent} but this rank "
                f"planned {pending.shape}; the two ranks disagree on the plan"
            )
        pending.works[1].wait()
        return pending.buffer

    def wait_sends(self) -> None:
        """Wait for every send posted so far (call once per step, after the last action)."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
