"""Input builders for :class:`~omni_pipeline.ModalityRouter` towers: decoded payloads to a tower's inputs.

:func:`image_patches` is the input of a Qwen2-VL-style vision tower (a ViT over flattened patches with a
``merge x merge`` patch merger, e.g. ``transformers``' ``Qwen2VisionTransformerPretrainedModel``): the
layout of ``Qwen2VLImageProcessor`` (Wang et al., "Qwen2-VL", 2024, §2.1 naive dynamic resolution), so
the merger's groups of ``merge**2`` consecutive patches are the ``merge x merge`` windows of the image.
omni-data's reader already resized each image to its metadata's shape, multiples of ``patch * merge``
(``omni_data.ImageTokens``, Qwen2-VL's ``smart_resize``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omni_data.payload import Payload
from omni_pipeline.towers import TowerBatch

__all__ = ["image_patches"]


def image_patches(
    payloads: Sequence[Payload], *, patch: int, merge: int, temporal_patch: int = 1
) -> TowerBatch:
    """Flattened patches of every image in merge-window order and their grids, as one :class:`TowerBatch`.

    Args:
        payloads: decoded images (``pixels [C, H, W]``), in order.
        patch: patch side, pixels.
        merge: patch-merger side (``merge x merge`` patches make one LLM token).
        temporal_patch: frames per patch (Qwen2-VL: 2); a still image is its one frame repeated.

    Returns:
        ``args = (patches [sum_i h_i * w_i, C * temporal_patch * patch * patch], grid_thw int64 [n, 3])``,
        ``grid_thw[i] = (1, h_i, w_i)`` in patches; patch features ordered ``(channel, frame, row,
        column)``; patches ordered by merge window (row-major), then row-major inside the window.
        ``rows[i] = h_i * w_i / merge**2``.

    Raises:
        ValueError: an image whose sides are not multiples of ``patch * merge``, or whose merged token
            count is not its metadata's ``media_tokens`` (the sample is named).
    """
    patches, grids, rows = [], [], []
    for p in payloads:
        x = p.pixels
        if x is None:
            raise ValueError(f"sample {p.meta.uid}: not an image (no pixels)")
        c, height, width = x.shape
        if height % (patch * merge) or width % (patch * merge):
            raise ValueError(
                f"sample {p.meta.uid}: {height}x{width} pixels are not multiples of patch * merge = "
                f"{patch * merge}"
            )
        h, w = height // patch, width // patch
        if h * w // merge**2 != p.meta.media_tokens:
            raise ValueError(
                f"sample {p.meta.uid}: a {h}x{w} patch grid gives {h * w // merge**2} tokens, its metadata "
                f"says {p.meta.media_tokens}"
            )
        frames = x[None].expand(temporal_patch, c, height, width)
        grid = frames.reshape(temporal_patch, c, h // merge, merge, patch, w // merge, merge, patch)
        # (window row, window column, row in window, column in window, channel, frame, pixel row, column)
        grid = grid.permute(2, 5, 3, 6, 1, 0, 4, 7)
        patches.append(grid.reshape(h * w, c * temporal_patch * patch * patch))
        grids.append((1, h, w))
        rows.append(h * w // merge**2)
    if not patches:
        return TowerBatch((torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.int64)), [])
    return TowerBatch((torch.cat(patches), torch.tensor(grids, dtype=torch.int64)), rows)
