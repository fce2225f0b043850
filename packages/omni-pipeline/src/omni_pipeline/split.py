"""Layer splits: which contiguous layers of a model each pipeline stage holds.

One splitter for every caller (the executor's users, a trainer's LLM stages):
:func:`omni_pipeline.stage_balance.balance_stages`. The default split, :func:`stage_slices`, is its
equal-cost case: layers shared out as evenly as possible, the *first* stages taking the remainder (its
tie rule), because the last stage also runs the final norm, the LM head and the loss (with a 4K
vocabulary and a 128-wide model the head alone costs more than two blocks), while stage 0's embedding
lookup is a gather. :func:`split_layers` picks among the three kinds of split a config names: the
default, an explicit list of layers per stage (``explicit_stages``), or ``"auto"``: ``balance_stages``
over per-layer, embedding and head costs, modelled (:func:`layer_costs`, omni-parallel's FLOP model) or
measured (:func:`omni_pipeline.calibrate.calibrated_layer_costs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from omni_parallel.flops import TransformerShape, layer_flops_per_token
from omni_pipeline.stage_balance import balance_stages, explicit_stages

__all__ = ["LLMShape", "layer_costs", "split_layers", "stage_slices"]


@dataclass(frozen=True, slots=True)
class LLMShape:
    """The sizes of a decoder-only LLM (LLaMA / Qwen2 blocks: GQA attention, SwiGLU MLP, causal) that
    its pipeline stages' costs depend on.

    Args:
        dim: model width, features. n_layers: decoder blocks. n_heads, n_kv_heads: query and key/value
            heads (GQA). ffn_dim: SwiGLU hidden width, features.
        vocab_size: vocabulary (the LM head's width); ``None`` until a tokenizer gives it.

    Raises:
        ValueError: sizes the blocks cannot have (:class:`omni_parallel.flops.TransformerShape`), or a
            ``vocab_size`` < 1.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        _ = self.blocks  # checks the block sizes
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"LLMShape: vocab_size must be >= 1, got {self.vocab_size}")

    @property
    def blocks(self) -> TransformerShape:
        """The decoder blocks as omni-parallel's FLOP model sees them."""
        return TransformerShape(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=self.ffn_dim,
            gated_mlp=True,
        )


def layer_costs(shape: LLMShape, max_seq_len: int) -> tuple[float, float, float]:
    """Modelled forward FLOPs per token (2 per multiply-add) of ``(one block, the embedding, the final
    norm + LM head + loss)``.

    A block: :func:`omni_parallel.flops.layer_flops_per_token` (GQA Q/K/V/O and SwiGLU matmuls, plus
    attention over a whole ``max_seq_len``-token document, the most a pack holds, counted without the
    causal halving: the per-token bound the last token of such a document reaches, the cost the
    modelled ``"auto"`` splits have always been balanced on); the embedding
    a ``dim``-wide row gather (``dim``); the head its ``dim x vocab`` matmul plus about 5 operations per
    vocabulary entry for the log-softmax and the loss. Megatron-LM's account-for-embedding/loss split
    counts each as one layer instead.

    Raises:
        ValueError: ``shape.vocab_size`` is not set, or ``max_seq_len < 1``.
    """
    if shape.vocab_size is None:
        raise ValueError("layer_costs: LLMShape.vocab_size is not set (take it from the tokenizer)")
    block = layer_flops_per_token(shape.blocks, max_seq_len, causal=False)
    return block, float(shape.dim), 2.0 * shape.dim * shape.vocab_size + 5.0 * shape.vocab_size


def split_layers(
    shape: LLMShape,
    num_stages: int,
    stage_layers: Sequence[int] | Literal["auto"] | None = None,
    *,
    max_seq_len: int | None = None,
    costs: tuple[float, float, float] | None = None,
) -> list[range]:
    """The layers of each of ``num_stages`` LLM stages.

    Args:
        shape: the LLM.
        num_stages: stages (pipeline ranks times virtual stages per rank).
        stage_layers: ``None``: :func:`stage_slices` (the equal split); a list of layer counts per stage
            (:func:`~omni_pipeline.stage_balance.explicit_stages`); ``"auto"``: the split whose slowest
            stage is fastest (:func:`~omni_pipeline.stage_balance.balance_stages`) over ``costs``.
        max_seq_len: tokens per pack, for the modelled costs of ``"auto"`` without ``costs``.
        costs: ``(one block, the embedding, the final norm + LM head + loss)`` in any one unit (e.g.
            measured seconds, :func:`omni_pipeline.calibrate.calibrated_layer_costs`); default
            :func:`layer_costs`.

    Returns:
        ``[range(lo, hi)]`` per stage, covering ``0 .. shape.n_layers - 1`` in order.

    Raises:
        ValueError: counts that do not fit the layers or not ``num_stages`` of them, fewer layers than
            stages, ``"auto"`` with neither ``costs`` nor ``max_seq_len``, or as :func:`layer_costs`.
    """
    if stage_layers is None:
        return stage_slices(shape.n_layers, num_stages)
    if isinstance(stage_layers, str):
        if stage_layers != "auto":
            raise ValueError(
                f"split_layers: stage_layers must be a list of counts or 'auto', got {stage_layers!r}"
            )
        if costs is None:
            if max_seq_len is None:
                raise ValueError("split_layers: 'auto' needs costs or max_seq_len (for the modelled costs)")
            costs = layer_costs(shape, max_seq_len)
        block, first, last = costs
        return balance_stages(
            [block] * shape.n_layers, num_stages, first_stage_extra=first, last_stage_extra=last
        )
    split = explicit_stages(stage_layers, shape.n_layers)
    if len(split) != num_stages:
        raise ValueError(f"stage_layers: {len(split)} stages given, the pipeline has {num_stages}")
    return split


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
