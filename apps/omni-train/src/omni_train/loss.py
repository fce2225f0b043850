"""Next-token cross-entropy over a step's packs, normalised by the step's target count.

Each microbatch's loss is ``sum of token cross-entropies / N`` where ``N`` is the number of target tokens
in the whole step (all microbatches, all DP ranks), known from metadata before the step runs. Summing the
microbatch losses (and the DP gradients) therefore gives the mean over the step's tokens exactly, however
the step is cut into microbatches or placed on ranks: this is what makes the loss of different placements
and pipeline sizes comparable to float tolerance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_train.batch import IGNORE, MODALITIES, LLMMicrobatch

__all__ = ["microbatch_loss"]


def microbatch_loss(
    logits: torch.Tensor, mb: LLMMicrobatch, step_targets: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss of one microbatch and its per-modality statistics.

    Args:
        logits: ``[T, vocab]`` from the last stage.
        mb: the microbatch (labels ``[T]``, ``label_modality`` ``[T]``).
        step_targets: target tokens in the whole step (> 0).

    Returns:
        ``(loss, stats)``: ``loss`` a scalar (``sum CE / step_targets``, differentiable); ``stats`` float64
        ``[len(MODALITIES), 2]`` detached: per modality the CE sum (nats) and the target count.

    Raises:
        ValueError: ``step_targets < 1`` or logits/labels length mismatch.
    """
    if step_targets < 1:
        raise ValueError(f"step_targets must be >= 1, got {step_targets}")
    if logits.shape[0] != mb.labels.shape[0]:
        raise ValueError(f"logits have {logits.shape[0]} positions, labels {mb.labels.shape[0]}")
    ce = F.cross_entropy(
        logits.float() if logits.dtype == torch.bfloat16 else logits,
        mb.labels,
        ignore_index=IGNORE,
        reduction="none",
    )
    loss = ce.sum() / step_targets
    valid = mb.labels != IGNORE
    stats = torch.zeros(len(MODALITIES), 2, dtype=torch.float64)
    ced = ce.detach().to(torch.float64)
    for i in range(len(MODALITIES)):
        sel = valid & (mb.label_modality == i)
        stats[i, 0] = ced[sel].sum()
        stats[i, 1] = sel.sum()
    return loss, stats
