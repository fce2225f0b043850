"""Layer splits: which contiguous layers of a model each pipeline stage holds.

One splitter for every caller (the executor's users, the trainer's ``LLMStage``):
:func:`omni_pipeline.stage_balance.balance_stages`. The default split, :func:`stage_slices`, is its
equal-cost case: layers shared out as evenly as possible, the *first* stages taking the remainder (its
tie rule), because the last stage also runs the final norm, the LM head and the loss (with a 4K
vocabulary and a 128-wide model the head alone costs more than two blocks), while stage 0's embedding
lookup is a gather. Costed splits (``parallel.stage_layers = "auto"``) call ``balance_stages`` with
per-layer, embedding and head costs; explicit ones ``explicit_stages``.
"""

from __future__ import annotations

from omni_pipeline.stage_balance import balance_stages

__all__ = ["stage_slices"]


def stage_slices(num_layers: int, num_stages: int) -> list[range]:
    """Layer ranges per stage: ``num_layers // num_stages`` each, one more for the first
    ``num_layers % num_stages`` stages (e.g. 5 layers over 3 stages: ``[0, 1], [2, 3], [4]``):
    :func:`~omni_pipeline.stage_balance.balance_stages` with every layer costing the same.

    Args:
        num_layers: layers of the model (``n_layers``).
        num_stages: pipeline stages (virtual stages under interleaving).

    Returns:
        ``[range(lo, hi)]`` per stage, covering ``0 .. num_layers - 1`` in order.

    Raises:
        ValueError: ``num_stages < 1``, or fewer layers than stages (a stage would hold no layer).
    """
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(
            f"stage_slices: n_layers={num_layers}: {num_layers} layers cannot fill {num_stages} stages "
            "(need 1 <= stages <= layers)"
        )
    return balance_stages([1.0] * num_layers, num_stages)
