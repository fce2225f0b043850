"""Routing of an encoder microbatch's samples to the encoder towers, one tower per modality.

An encoder microbatch may mix modalities (images and audio of one LLM microbatch's slice, in the loader's
order). :class:`ModalityRouter` groups its decoded payloads by tower (a modality's own, or the one it is
routed to: videos to the image tower), has each tower's input builder
turn that group's payloads into the tower's inputs (model-specific preprocessing: patchifying,
log-mel spectrograms, an HF processor...), runs each tower once on its whole group, and puts the output
rows back in the samples' order. The towers are plain ``nn.Module``s; nothing here knows a model.

Long-short SP (:mod:`omni_pipeline.encoder_parallel`): the long images of a rank's SP group are packed
into one sequence and each SP rank encodes its ``1/sp`` chunk; the router then calls the image tower with
``sp_group=`` that group (the tower splits its packed sequence itself, e.g. Ulysses attention inside a
ViT).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from omni_data.payload import Payload
from omni_data.sample import Modality

__all__ = ["ModalityRouter", "TowerBatch", "TowerInputs"]


@dataclass(frozen=True)
class TowerBatch:
    """One tower's inputs for a group of samples, and the output rows each sample yields.

    Attributes:
        args: positional arguments of the tower's forward. Floating-point tensors are moved to the
            tower's device and dtype by the router; other tensors (shapes, lengths) are passed as built.
        rows: output rows (LLM tokens) of each sample, in the order the payloads were given; they must
            add up to the tower output's first dimension.
    """

    args: tuple[torch.Tensor, ...]
    rows: Sequence[int]


# ``payloads`` (all of one modality, in order) -> the tower's inputs. Raise ``ValueError`` naming a sample
# whose payload does not give its metadata's ``media_tokens`` rows.
TowerInputs = Callable[[Sequence[Payload]], TowerBatch]


class ModalityRouter(nn.Module):
    """Encoder towers keyed by modality (``"image"``, ``"audio"``...) and the input builder of each.

    Args:
        towers: ``{modality: module}``; each forward takes its :class:`TowerBatch` ``args`` and returns
            ``[rows, llm_dim]``; a tower used for long-short SP also takes ``sp_group=``.
        inputs: ``{modality: builder}`` (:data:`TowerInputs`), one per tower.
        llm_dim: width of every tower's output (the LLM's hidden size).
        routes: ``{modality: tower}`` for a modality encoded by another modality's tower (Qwen2-VL,
            Wang et al. 2024 §2.1: ``{"video": "image"}``, one ViT for images and videos); that tower's
            input builder then gets both modalities' samples together, in order, and the tower runs
            once over them. Default: every modality its own tower.

    Forward:
        payloads: the decoded samples of one encoder microbatch, any mix of modalities, in output order.
        long: ``(images, sp_group)`` for long-short SP: the long samples of this rank's SP group, packed in
            this order (every rank of the group passes the same ones), encoded by ``sp_group``'s ranks
            together, after ``payloads``.

    Returns:
        ``[sum rows, llm_dim]``: each sample's rows, samples in the given order; with ``long``, then this
        rank's chunk of the long samples' rows (``ceil(L / sp)``; padding rows last on the last ranks).

    Raises:
        ValueError: a modality without a tower or without an input builder, or a route to a tower that
            does not exist (at construction), a sample whose modality has no tower, or a builder whose
            ``rows`` do not add up to its tower's output.
    """

    def __init__(
        self,
        towers: Mapping[str, nn.Module],
        inputs: Mapping[str, TowerInputs],
        llm_dim: int,
        *,
        routes: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        missing = sorted(set(towers) ^ set(inputs))
        if missing:
            raise ValueError(f"ModalityRouter: towers and input builders differ in modalities {missing}")
        self.routes = dict(routes or {})
        bad = sorted(m for m, t in self.routes.items() if t not in towers)
        if bad:
            raise ValueError(f"ModalityRouter: routes {bad} lead to no tower (towers: {sorted(towers)})")
        self.towers = nn.ModuleDict(dict(towers))
        self.inputs = dict(inputs)
        self.llm_dim = llm_dim

    def tower_of(self, modality: str) -> str:
        """The tower that encodes ``modality``'s samples (its route, else the modality's own)."""
        return self.routes.get(str(modality), str(modality))

    def forward(
        self, payloads: Sequence[Payload], long: tuple[Sequence[Payload], dist.ProcessGroup] | None = None
    ) -> torch.Tensor:
        p0 = next(self.parameters(), None)
        dtype = p0.dtype if p0 is not None else torch.get_default_dtype()
        dev = p0.device if p0 is not None else torch.device("cpu")
        out = torch.zeros(0, self.llm_dim, dtype=dtype, device=dev)
        if payloads:
            out = self._whole(payloads, dtype, dev)
        if long is not None:
            samples, group = long
            name = self._modality(samples[0]) if samples else str(Modality.IMAGE)
            batch = self.inputs[name](samples)
            out = torch.cat([out, self.towers[name](*_moved(batch.args, dev, dtype), sp_group=group)])
        return out

    def _modality(self, p: Payload) -> str:
        """The tower of ``p``'s modality (a route's target, e.g. ``image`` for a video)."""
        name = self.tower_of(p.meta.modality)
        if name not in self.towers:
            raise ValueError(f"sample {p.meta.uid}: no {name} tower (towers: {sorted(self.towers)})")
        return name

    def _whole(self, payloads: Sequence[Payload], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
        """Each tower once over its modality's samples (towers in their order), rows back in sample order."""
        groups: dict[str, list[int]] = {name: [] for name in self.towers}
        for i, p in enumerate(payloads):
            groups[self._modality(p)].append(i)
        pieces: dict[int, torch.Tensor] = {}
        for name, idx in groups.items():
            if not idx:
                continue
            batch = self.inputs[name]([payloads[i] for i in idx])
            y = self.towers[name](*_moved(batch.args, dev, dtype))
            if sum(batch.rows) != y.shape[0]:
                raise ValueError(
                    f"{name} tower: {y.shape[0]} output rows, its input builder says {sum(batch.rows)}"
                )
            pieces.update(zip(idx, y.split(list(batch.rows))))
        return torch.cat([pieces[i] for i in range(len(payloads))])


def _moved(args: Sequence[torch.Tensor], dev: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    return [a.to(dev, dtype) if torch.is_floating_point(a) else a for a in args]
