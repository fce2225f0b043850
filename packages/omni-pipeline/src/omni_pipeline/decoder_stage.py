"""A contiguous slice of a decoder-only LLM's layers run as one pipeline stage over packed sequences.

:class:`~omni_pipeline.PipelineExecutor` runs stage modules and :class:`~omni_pipeline.StepBuilder` feeds
them packs (several documents back to back, omni-data's ``Pack``). :class:`DecoderStage` is that stage
module for a decoder whose layers follow the Hugging Face ``transformers`` calling convention of the
LLaMA family (LLaMA, Qwen2, Mistral): ``layer(hidden [1, T, D], attention_mask=[1, 1, T, T],
position_ids=[1, T], position_embeddings=(cos, sin))`` returning the new hidden states (or a tuple whose
first element they are), and a rotary module ``rotary(hidden [1, T, D], position_ids [1, T]) -> (cos,
sin)``. Nothing here imports ``transformers``: any modules with that convention work.

Packing without cross-contamination (Krell et al., "Efficient Sequence Packing without
Cross-contamination", 2021): a token attends causally within its own document only (the block-diagonal
causal mask of :func:`packed_causal_mask`, from the pack's ``cu_seqlens``) and its RoPE position restarts
at each document (the pack's ``position_ids``), so a pack trains exactly as its documents would one by
one.

Parameter names do not depend on the layout: layer ``i`` of the whole model is ``layers.<i>`` in whichever
stage holds it, the embedding ``embed``, the final norm ``norm``, the LM head ``head``; the stages of any
pipeline split together name the parameters as one stage holding every layer does, so state dicts (and
name-keyed optimizer state, :func:`omni_ckpt.portable_optimizer_state_dict`) move between layouts.

Limit: the mask is dense (``T x T`` per stage call), which suits tests and small packs; long packs want a
variable-length attention kernel inside the layers instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["DecoderStage", "packed_causal_mask"]


def packed_causal_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive attention mask of a pack: ``[1, 1, T, T]``, 0 where query ``t`` may attend key ``s``
    (same document, ``s <= t``), the dtype's lowest finite value elsewhere (what ``transformers``' eager
    and SDPA attention add to the scores).

    Args:
        cu_seqlens: int64 ``[documents + 1]`` token offsets of the documents, from 0 to ``T``.
        dtype, device: of the mask (the hidden states').

    Raises:
        ValueError: ``cu_seqlens`` not 1-D, not starting at 0, or decreasing.
    """
    cu = cu_seqlens.to(torch.int64).cpu()
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be 1-D, start at 0 and not decrease, got {cu.tolist()}")
    doc = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
    t = torch.arange(doc.numel())
    allowed = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


class DecoderStage(nn.Module):
    """Layers ``layers`` of a decoder-only LLM as one pipeline stage (see the module docstring).

    Args:
        layers: ``{layer index in the whole model: layer}``, this stage's contiguous slice.
        rotary: the rotary-embedding module, ``rotary(hidden, position_ids) -> (cos, sin)`` (held by every
            stage; it has no parameters).
        embed: the token embedding (first stage only): the stage then takes token ids.
        norm, head: the final norm and the LM head (last stage only, both or neither): the stage then
            returns logits.

    Forward (first stage): ``(input_ids [T], position_ids [T], cu_seqlens [docs + 1], media_embeds
    [R, D] | None, media_rows [R] | None)``: the embedded ids with rows ``media_rows`` replaced by
    ``media_embeds`` (encoder outputs, :class:`~omni_pipeline.StepBuilder`'s stage-0 input). Other
    stages: ``(hidden [T, D], position_ids=[T], cu_seqlens=[docs + 1])``.

    Returns:
        ``[T, vocab]`` logits on the last stage, else ``[T, D]`` hidden states.

    Raises:
        ValueError: no layers and no embedding or head, a ``norm`` without ``head`` (or the reverse), or
            (forward) missing ``position_ids`` / ``cu_seqlens``.
    """

    def __init__(
        self,
        layers: Mapping[int, nn.Module],
        rotary: nn.Module,
        *,
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        head: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if (norm is None) != (head is None):
            raise ValueError("DecoderStage: the last stage needs both the final norm and the LM head")
        if not layers and embed is None and head is None:
            raise ValueError("DecoderStage: a stage needs layers, the embedding or the LM head")
        self.embed, self.norm, self.head = embed, norm, head
        self.layers = nn.ModuleDict({str(i): layer for i, layer in sorted(layers.items())})
        self.rotary = rotary

    @classmethod
    def from_causal_lm(cls, lm: nn.Module, layers: range) -> DecoderStage:
        """The stage of ``layers`` of a ``transformers``-style causal LM: ``lm.model.embed_tokens``,
        ``lm.model.layers``, ``lm.model.norm``, ``lm.model.rotary_emb`` and ``lm.lm_head`` (LLaMA, Qwen2,
        Mistral). The first stage (``layers.start == 0``) gets the embedding, the last (``layers.stop``
        the layer count) the norm and head. The modules are shared with ``lm``, not copied.

        Raises:
            ValueError: ``lm`` lacks one of those attributes (naming it), or ``layers`` is not a non-empty
                ascending slice of the model's layers.
        """
        body = getattr(lm, "model", None)
        wanted = {"model.embed_tokens": "embed_tokens", "model.layers": "layers", "model.norm": "norm"}
        wanted["model.rotary_emb"] = "rotary_emb"
        missing = [name for name, attr in wanted.items() if not hasattr(body, attr)]
        missing += [] if hasattr(lm, "lm_head") else ["lm_head"]
        if missing:
            raise ValueError(
                f"DecoderStage.from_causal_lm: {type(lm).__name__} has no {', '.join(missing)} (expects the "
                "transformers causal-LM layout: model.embed_tokens, model.layers, model.norm, "
                "model.rotary_emb, lm_head)"
            )
        n = len(body.layers)
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= n:
            raise ValueError(f"DecoderStage.from_causal_lm: layers {layers} is not a slice of the {n} layers")
        last = layers.stop == n
        return cls(
            {i: body.layers[i] for i in layers},
            body.rotary_emb,
            embed=body.embed_tokens if layers.start == 0 else None,
            norm=body.norm if last else None,
            head=lm.lm_head if last else None,
        )

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        media_embeds: torch.Tensor | None = None,
        media_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is None or cu_seqlens is None:
            raise ValueError("DecoderStage: position_ids and cu_seqlens are required (the pack's layout)")
        h = x
        if self.embed is not None:
            h = self.embed(x)
            if media_embeds is not None and media_rows is not None:
                h = h.index_copy(0, media_rows.to(h.device), media_embeds.to(h.dtype))
        if self.layers:
            pos = position_ids.to(h.device)[None]
            mask = packed_causal_mask(cu_seqlens, h.dtype, h.device)
            cos_sin = self.rotary(h[None], pos)
            hidden = h[None]
            for layer in self.layers.values():
                out = layer(hidden, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
                hidden = out[0] if isinstance(out, tuple) else out
            h = hidden[0]
        if self.head is not None:
            assert self.norm is not None
            h = self.head(self.norm(h))
        return h
