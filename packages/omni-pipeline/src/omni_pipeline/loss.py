"""The step-input bridge's objective: the mean next-token cross-entropy over every target token of the
step, on every DP replica.

* **Tokens**: microbatch ``k``'s loss on a rank is the *sum* of its token cross-entropies divided by ``N``,
  the number of target tokens in the whole step (all microbatches, all DP replicas, CP/Ulysses shares
  included), known from metadata before the step runs (:func:`omni_pipeline.microbatch.step_targets`,
  summed over DP by :meth:`omni_pipeline.step_inputs.StepBuilder.build`).
* **Microbatches**: the step's objective is the plain *sum* of the microbatch losses
  (``StepResult.loss``); nothing divides by the microbatch count.
* **DP and sequence ranks**: the objective is the plain sum of what the ranks compute, so every gradient
  reduction is a plain sum (the executor's ``reduce_gradients`` hook, whose default,
  :meth:`omni_pipeline.PipelineExecutor.reduce_over_groups`, sums too; it is the package's one
  objective): LLM gradients over the stage's data group (DP x CP/Ulysses ranks), encoder
  gradients over every rank holding an encoder replica, divided only by the number of ranks that run the
  *same* encoder work on the same data (TP peers).

The loss therefore equals the one-process mean over the step's tokens exactly, however the step is cut
into microbatches or placed on ranks (what makes layouts comparable to float tolerance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_pipeline.microbatch import IGNORE, MODALITIES, LLMMicrobatch

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
        ``[len(MODALITIES), 2]`` detached: per modality the CE sum (nats) and the target count. Logits in
        bfloat16 are upcast to float32 for the cross-entropy.

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
