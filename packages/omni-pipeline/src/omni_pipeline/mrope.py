"""Multimodal RoPE positions (M-RoPE) of a pack: three position ids per token (temporal, height, width).

Wang et al., "Qwen2-VL" (2024), §2.1 "Multimodal Rotary Position Embedding": the LLM's rotary angles are
split into a temporal, a height and a width part, each driven by its own position id. A vision token of
an image or video whose merged grid is ``t x h x w`` (``t`` temporal patches, ``h x w`` merged tokens per
slice) at start position ``s`` gets ``(s + i, s + j, s + k)`` for slice ``i``, row ``j``, column ``k``;
the text after it continues from the largest vision position + 1; text tokens get the same id on all
three axes (which is 1-D RoPE exactly). This is Qwen2-VL's ``get_rope_index`` (the released model's
reference code; ``transformers`` 4.x ``Qwen2VLModel.get_rope_index``: ``st_idx = llm_pos_ids.max() + 1``)
with Qwen2-VL's temporal step of one position per temporal patch (no Qwen2.5-VL ``second_per_grid_ts``
scaling).

Pack layout (``omni_pipeline.microbatch``): sample after sample, each its ``media_tokens`` placeholders
then its text; positions restart at 0 in every sample (each sample is its own attention document).
Non-vision media (audio) and text-only samples get 1-D positions repeated over the three axes.

``transformers`` >= 5 advances the text after a vision span by ``max(h, w)`` instead of ``max(t, h,
w)``: the two agree on every image and on every video with ``t <= max(h, w)``; for a longer video the
text here starts at ``s + t`` (the reference code's), there at ``s + max(h, w)`` (overlapping the video's
temporal positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omni_data.sample import SampleMeta

__all__ = [
    "MRopeDocument",
    "mrope_document_positions",
    "mrope_documents",
    "mrope_position_ids",
    "vision_positions",
]


@dataclass(frozen=True)
class MRopeDocument:
    """One packed sample as M-RoPE sees it.

    Attributes:
        media_tokens: placeholder slots before the text (merged vision tokens, or audio frames).
        text_tokens: text tokens after them.
        grid: the vision tower's patch grid ``(t, grid_h, grid_w)`` of the sample's image (``t = 1``) or
            video (``t`` temporal patches = frames / temporal_patch), in patches before the
            ``merge x merge`` merge; ``None``: no vision media (text, audio: 1-D positions).
    """

    media_tokens: int
    text_tokens: int
    grid: tuple[int, int, int] | None = None


def vision_positions(grid: tuple[int, int, int], merge: int, start: int = 0) -> torch.Tensor:
    """M-RoPE ids of one image's or video's merged tokens, in the vision tower's output order.

    Args:
        grid: ``(t, grid_h, grid_w)`` in patches (``grid_h``, ``grid_w`` multiples of ``merge``).
        merge: the patch merger's side (Qwen2-VL's ``spatial_merge_size``).
        start: the first position (0 at the start of a sample).

    Returns:
        int64 ``[3, t * (grid_h / merge) * (grid_w / merge)]``: rows temporal, height, width; tokens slice
        by slice, row-major (the merger's output order).

    Raises:
        ValueError: a non-positive grid or sides not multiples of ``merge``.
    """
    t, gh, gw = (int(v) for v in grid)
    if min(t, gh, gw) < 1 or gh % merge or gw % merge:
        raise ValueError(f"vision grid {grid}: t, h, w must be >= 1 and h, w multiples of merge {merge}")
    h, w = gh // merge, gw // merge
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_document_positions(doc: MRopeDocument, merge: int) -> torch.Tensor:
    """M-RoPE ids of one sample: its media first (from 0), then its text from the largest media id + 1.

    Returns:
        int64 ``[3, media_tokens + text_tokens]``.

    Raises:
        ValueError: a vision grid whose merged token count is not ``media_tokens``, or negative counts.
    """
    if doc.media_tokens < 0 or doc.text_tokens < 0:
        raise ValueError(f"{doc}: token counts must be >= 0")
    if doc.grid is None:
        return torch.arange(doc.media_tokens + doc.text_tokens)[None].expand(3, -1).clone()
    vis = vision_positions(doc.grid, merge)
    if vis.shape[1] != doc.media_tokens:
        raise ValueError(
            f"{doc}: the grid gives {vis.shape[1]} merged tokens (merge {merge}), the sample has "
            f"{doc.media_tokens} media tokens"
        )
    start = int(vis.max()) + 1 if vis.numel() else 0
    text = torch.arange(start, start + doc.text_tokens)[None].expand(3, -1)
    return torch.cat([vis, text], 1)


def mrope_position_ids(docs: Sequence[MRopeDocument], merge: int) -> torch.Tensor:
    """M-RoPE ids of a pack: every sample's :func:`mrope_document_positions`, concatenated.

    Args:
        docs: the pack's samples, in pack order.
        merge: the vision patch merger's side.

    Returns:
        int64 ``[3, T]`` (``T`` = the pack's tokens), the LLM's ``position_ids`` when
        ``model.llm.mrope_section`` is set; restarting at 0 in every sample as the 1-D ids do.

    Raises:
        ValueError: as :func:`mrope_document_positions` (the sample is named).
    """
    parts = [mrope_document_positions(d, merge) for d in docs]
    return torch.cat(parts, 1) if parts else torch.zeros(3, 0, dtype=torch.int64)


def mrope_documents(
    samples: Sequence[SampleMeta], *, patch: int, merge: int, temporal_patch: int
) -> list[MRopeDocument]:
    """A pack's samples as :class:`MRopeDocument`, the vision grids read from their metadata's decoded
    shape: an image ``(3, H, W)`` is ``(1, H / patch, W / patch)``, a video ``(F, 3, H, W)`` is
    ``(ceil(F / temporal_patch), H / patch, W / patch)`` (the last frame repeats up to a multiple, as
    the ViT's ``patchify_video``); audio and text have no grid.

    Args:
        samples: the pack's sample metadata, in pack order (``Pack.samples``).
        patch, merge, temporal_patch: the ViT's (``model.vit``).

    Raises:
        ValueError: an image or video whose shape is not ``(3, H, W)`` / ``(F, 3, H, W)`` with sides
            multiples of ``patch * merge``, or whose grid does not give its ``media_tokens`` (the sample
            is named).
    """
    docs = []
    for s in samples:
        grid = None
        kind = str(s.modality)
        if kind in ("image", "video"):
            shape = tuple(s.shape)
            frames, hw = (1, shape[1:]) if kind == "image" else (shape[0], shape[2:])
            ok = len(shape) == (3 if kind == "image" else 4) and frames >= 1
            if not ok or hw[0] % (patch * merge) or hw[1] % (patch * merge):
                raise ValueError(
                    f"sample {s.uid}: {kind} shape {shape} is not (3, H, W) / (F, 3, H, W) with sides "
                    f"multiples of patch * merge = {patch * merge}"
                )
            grid = (-(-frames // temporal_patch), hw[0] // patch, hw[1] // patch)
        try:
            docs.append(MRopeDocument(s.media_tokens, s.text_tokens, grid))
            mrope_document_positions(docs[-1], merge)  # checks the grid against media_tokens
        except ValueError as e:
            raise ValueError(f"sample {s.uid}: {e}") from None
    return docs
