"""Activations saved for backward: measured per step, and offloaded to host memory per block family.

One mechanism, PyTorch's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``), for both jobs:

* :meth:`ActivationMemory.track` (around a whole step) counts every tensor autograd saves for backward
  while it is alive, deduplicated by storage (a view and its base, or one tensor saved by two ops, count
  once), parameters excluded (their storage is the model's, not an activation). A saved tensor stops
  counting when autograd frees it (after the backward that used it). The peak of the live bytes over the
  step is :attr:`StepPeaks.activation_bytes`.
* :meth:`ActivationMemory.offload` (around one block's forward;
  :func:`omni_parallel.parallelize.apply_offload`) keeps what the block saves in host memory until backward:
  a pinned CPU copy of each accelerator tensor, moved back when backward unpacks it (what
  ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` does), counted as
  :attr:`StepPeaks.offloaded_bytes`. On a CPU run host memory is the compute device: the tensors stay
  where they are (no copy) and are counted as offloaded, so the two counts show what an accelerator run
  would keep on the device.

Hooks nest (the innermost pair applies), so inside an offloaded block the offload hooks take over from
:meth:`~ActivationMemory.track`, and inside a recomputed region (``torch.utils.checkpoint``) the
checkpoint's own hooks take over: what a checkpoint recomputes is not saved and not counted (its
recomputation in backward is transient), and neither is the input a checkpoint keeps by reference.

On CUDA :attr:`StepPeaks.allocated_bytes` is also the step's ``torch.cuda.max_memory_allocated`` (the
allocator's peak over everything: parameters, gradients, optimizer state, activations, temporaries).
The cost is one Python call per saved tensor (pack) and per release, no device synchronisation.

Source: PyTorch's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, the mechanism of
``save_on_cpu``); selective activation offloading as in MegaScale-Omni (its memory evaluation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ActivationMemory", "StepPeaks"]


@dataclass(frozen=True)
class StepPeaks:
    """Peaks of one step on one rank, in bytes.

    Attributes:
        activation_bytes: saved activations kept where they were made (the compute device).
        offloaded_bytes: saved activations of offloaded blocks (host memory).
        allocated_bytes: CUDA allocator peak (``torch.cuda.max_memory_allocated``); ``None`` off CUDA.
    """

    activation_bytes: int
    offloaded_bytes: int
    allocated_bytes: int | None


def _local(t: torch.Tensor) -> torch.Tensor:
    # the local shard itself (no autograd op inside a hook)
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage_key(t: torch.Tensor) -> tuple[str, int, int]:
    """``(device, storage address, storage bytes)`` of the storage ``t`` views."""
    s = _local(t).untyped_storage()
    return str(t.device), s.data_ptr(), s.nbytes()


_KEPT, _OFFLOADED = 0, 1  # the two counts: kept where made, offloaded


class _Saved:
    """One saved tensor as packed by the hooks; releases its bytes when autograd drops it."""

    __slots__ = ("device", "key", "kind", "owner", "tensor")

    def __init__(
        self, owner: ActivationMemory, kind: int, key: tuple, tensor: torch.Tensor, device: torch.device
    ) -> None:
        self.owner, self.kind, self.key, self.tensor, self.device = owner, kind, key, tensor, device
        owner._acquire(kind, key)

    def __del__(self) -> None:
        self.owner._release(self.kind, self.key)


class ActivationMemory:
    """Saved-activation accounting and offload for one rank (no global state: one object per training run).

    Args:
        modules: the rank's modules; their parameters' storages are not activations. They are read again
            at the first saved tensor of each step (after :meth:`start_step`), so parameters that FSDP2
            gathers for the step (LLM ZeRO, encoder ZeRO: new storages every step) are not counted; a
            saved ``nn.Parameter`` or view of one is never counted either (FSDP2 units gathered later in
            the step, e.g. LLM ZeRO-3 blocks resharded after each forward).
        device: the compute device (``cuda``: allocator peaks are read and offload copies to pinned host
            memory).
    """

    def __init__(self, modules: Iterable[nn.Module], device: torch.device) -> None:
        self.device = torch.device(device)
        self._modules = list(modules)
        self._params = self._param_keys()
        self._refs: list[dict[tuple, int]] = [{}, {}]
        self._live = [0, 0]
        self._peak = [0, 0]

    def _param_keys(self) -> set[tuple[str, int]]:
        return {_storage_key(p)[:2] for m in self._modules for p in m.parameters() if _local(p).numel() > 0}

    # -- the step ------------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Reset the peaks (the live counts carry on: nothing is saved between steps)."""
        self._params = None  # read again at the step's first saved tensor: after every FSDP2 gather
        self._peak = list(self._live)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peaks(self) -> StepPeaks:
        """The peaks since :meth:`start_step`."""
        allocated = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return StepPeaks(self._peak[_KEPT], self._peak[_OFFLOADED], allocated)

    def track(self) -> contextlib.AbstractContextManager:
        """Count what autograd saves inside (around a whole step)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack_kept, self._unpack)

    def offload(self) -> contextlib.AbstractContextManager:
        """Keep what autograd saves inside in host memory until backward (around one block's forward)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack_offloaded, self._unpack)

    # -- hooks ---------------------------------------------------------------------------------------------
    def _is_param(self, key: tuple, t: torch.Tensor) -> bool:
        # A parameter or a view of one (``w.t()`` saved by a linear): FSDP2 units gathered inside the step
        # (LLM ZeRO-3 with reshard after forward: each block's pre-forward hook) hold their whole
        # parameters in storages the step's first read did not see, freed after the forward and gathered
        # again for backward; they are the model's weights, not activations.
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return True
        if self._params is None:
            self._params = self._param_keys()
        return key[:2] in self._params

    def _pack_kept(self, t: torch.Tensor) -> object:
        key = _storage_key(t)
        if self._is_param(key, t):
            return t
        return _Saved(self, _KEPT, key, t, t.device)

    def _pack_offloaded(self, t: torch.Tensor) -> object:
        key = _storage_key(t)
        if self._is_param(key, t):
            return t
        if t.device.type == "cpu" or isinstance(t, DTensor):
            # Host memory already (or a DTensor, whose placement a plain copy would lose): kept as is.
            return _Saved(self, _OFFLOADED, key, t, t.device)
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
        host.copy_(t)
        return _Saved(self, _OFFLOADED, _storage_key(host), host, t.device)

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        t = packed.tensor  # a _Saved
        return t if t.device == packed.device else t.to(packed.device, non_blocking=True)

    def _acquire(self, kind: int, key: tuple) -> None:
        refs = self._refs[kind]
        n = refs.get(key, 0)
        refs[key] = n + 1
        if n == 0:
            self._live[kind] += key[2]
            self._peak[kind] = max(self._peak[kind], self._live[kind])

    def _release(self, kind: int, key: tuple) -> None:
        refs = self._refs[kind]
        n = refs[key] - 1
        if n:
            refs[key] = n
        else:
            del refs[key]
            self._live[kind] -= key[2]
