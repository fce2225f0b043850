"""A tiny dynamic-resolution ViT: 14-px patches, 2-D RoPE, packed images and videos, 2x2 patch merge.

Follows Qwen2-VL's vision encoder (Wang et al., 2024, §2.1) at toy scale: an image keeps its aspect ratio, is
resized so both sides are multiples of ``patch * merge`` pixels, cut into ``patch x patch`` patches
(ordered window by window, so the ``merge x merge`` patches that merge into one LLM token are contiguous),
and all images of a microbatch are packed into one sequence with ``cu_seqlens``; attention stays inside
each image. Positions are 2-D RoPE (half the rotary pairs rotate with the row, half with the column).

Videos (``ViTConfig.temporal_patch = 2``, Qwen2-VL's §2.1 "unified image and video understanding"): a patch
spans ``temporal_patch`` consecutive frames (features ``3 * temporal_patch * patch * patch``, ordered
channel, frame, row, column: the flattened ``Conv3d`` kernel), a clip of ``F`` frames is ``t = F /
temporal_patch`` temporal slices of ``grid_h x grid_w`` patches (:func:`patchify_video`); each slice
attends within itself and carries the 2-D RoPE rows and columns of an image (Qwen2-VL's
``cu_seqlens = repeat(h * w, t)`` and ``rot_pos_emb``). A still image is its one frame repeated over the
``temporal_patch`` frames, as Qwen2-VL's processor does, so images and videos share one set of weights.
``temporal_patch = 1`` (the default) is the image-only ViT, parameters and outputs unchanged.

With ``patch_bias=False, norm_eps=1e-6, act="quick_gelu"`` (and the image tower's projector as
``projector_norm=False, projector_hidden=merge**2 * dim``) this is exactly Qwen2-VL's vision tower
(``Qwen2VisionTransformerPretrainedModel``, patch merger included): the same patch order, the same rotary
layout (``rotate_half`` over ``[rows | cols]`` angles of ``head_dim // 4`` frequencies each), the same
blocks; on still images at any ``temporal_patch``, on videos at ``temporal_patch = 2``;
:mod:`omni_train.hf.vision` converts its checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from omni_train.models.attention import rope_angles
from omni_train.models.encoder_block import Activation, EncoderBlock, init_linear_

__all__ = ["ViTConfig", "VisionTransformer", "patchify", "patchify_video", "smart_resize"]


@dataclass(frozen=True)
class ViTConfig:
    """ViT shape. ``min_pixels``/``max_pixels`` bound the resized image area (pixels).

    ``mlp_ratio``, ``norm_eps`` (LayerNorm epsilon), ``act`` (MLP activation) and ``patch_bias`` (a bias in
    the patch embedding) shape the blocks; ``projector_norm``/``projector_hidden`` the image tower's
    projector (:class:`~omni_train.models.projector.Projector`; hidden default: the LLM width).
    ``temporal_patch``: frames per patch (1: images only, today's embedding; 2: Qwen2-VL's, videos and
    images, an image repeated over both frames).
    """

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    patch: int = 14
    merge: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    rope_theta: float = 10000.0
    mlp_ratio: int = 4
    norm_eps: float = 1e-5
    act: Activation = Activation.GELU
    patch_bias: bool = True
    projector_norm: bool = True
    projector_hidden: int | None = None
    temporal_patch: int = 1

    @property
    def patch_features(self) -> int:
        """Features per patch (``3 * temporal_patch * patch**2``), the patch embedding's input width."""
        return 3 * self.temporal_patch * self.patch * self.patch

    @property
    def out_dim(self) -> int:
        """Features per merged token (``merge**2 * dim``), the projector's input width."""
        return self.merge * self.merge * self.dim


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target ``(height, width)`` in pixels: multiples of ``factor``, area in ``[min_pixels, max_pixels]``,
    aspect ratio kept as closely as rounding allows (Qwen2-VL's ``smart_resize``).

    Raises:
        ValueError: a non-positive side.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def patchify(
    image: torch.Tensor, patch: int, merge: int, temporal_patch: int = 1
) -> tuple[torch.Tensor, tuple[int, int]]:
    """Cut an image into patches ordered merge-window by merge-window.

    Args:
        image: ``[3, H, W]`` float, H and W multiples of ``patch * merge``.
        temporal_patch: frames per patch (:attr:`ViTConfig.temporal_patch`); the image is its one frame
            repeated ``temporal_patch`` times (Qwen2-VL's image processor).

    Returns:
        ``(patches, (grid_h, grid_w))``: patches ``[grid_h * grid_w, 3 * temporal_patch * patch * patch]``
        (features ordered channel, frame, row, column); the grid in patches. Patches ``4j .. 4j+3`` (for
        merge 2) form merged token ``j``, windows in row-major order.

    Raises:
        ValueError: a side that is not a multiple of ``patch * merge``.
    """
    x, (_, gh, gw) = patchify_video(image[None], patch, merge, temporal_patch)
    return x, (gh, gw)


def patchify_video(
    frames: torch.Tensor, patch: int, merge: int, temporal_patch: int = 2
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Cut a clip into Qwen2-VL's video patches (``Qwen2VLVideoProcessor.patchify``'s layout).

    Args:
        frames: ``[F, 3, H, W]`` float, H and W multiples of ``patch * merge``; ``F`` not a multiple of
            ``temporal_patch`` is padded by repeating the last frame (as Qwen2-VL's processor does).
        patch, merge: patch side (pixels) and patch-merger side (patches).
        temporal_patch: frames per patch.

    Returns:
        ``(patches, (t, grid_h, grid_w))``: patches ``[t * grid_h * grid_w, 3 * temporal_patch * patch *
        patch]``, temporal slice after temporal slice (``t = ceil(F / temporal_patch)``), each slice's
        patches merge window by merge window (row-major) as :func:`patchify`; features ordered channel,
        frame, row, column.

    Raises:
        ValueError: no frames, not ``[F, C, H, W]``, or a side that is not a multiple of ``patch * merge``.
    """
    if frames.dim() != 4 or frames.shape[0] == 0:
        raise ValueError(f"frames must be [F, C, H, W] with F >= 1, got {tuple(frames.shape)}")
    n, c, h, w = frames.shape
    f = patch * merge
    if h % f or w % f:
        raise ValueError(f"image {h}x{w} px: both sides must be multiples of patch*merge = {f}")
    if pad := -n % temporal_patch:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    t, gh, gw = frames.shape[0] // temporal_patch, h // patch, w // patch
    x = frames.reshape(t, temporal_patch, c, gh // merge, merge, patch, gw // merge, merge, patch)
    # -> [t, win_row, win_col, in_row, in_col, c, frame, patch, patch]
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * gh * gw, c * temporal_patch * patch * patch)
    return x, (t, gh, gw)


def _thw(grids: torch.Tensor) -> torch.Tensor:
    """Grids as ``[n, 3]`` ``(t, h, w)`` (an ``[n, 2]`` image grid gets ``t = 1``)."""
    if grids.dim() != 2 or grids.shape[1] not in (2, 3):
        raise ValueError(f"grids must be [n, 2] (h, w) or [n, 3] (t, h, w), got {tuple(grids.shape)}")
    if grids.shape[1] == 2:
        grids = torch.cat([grids.new_ones(grids.shape[0], 1), grids], 1)
    return grids


def _patch_positions(grids: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch (``grids`` ``[n, 3]``), repeated over each clip's ``t`` slices
    (Qwen2-VL's ``rot_pos_emb``: the same 2-D positions in every temporal slice)."""
    rows, cols = [], []
    for t, gh, gw in grids.tolist():
        r = torch.arange(gh).view(gh // merge, merge, 1, 1).expand(-1, -1, gw // merge, merge)
        c = torch.arange(gw).view(1, 1, gw // merge, merge).expand(gh // merge, merge, -1, -1)
        rows.append(r.permute(0, 2, 1, 3).reshape(-1).repeat(t))
        cols.append(c.permute(0, 2, 1, 3).reshape(-1).repeat(t))
    return torch.cat(rows), torch.cat(cols)


class VisionTransformer(nn.Module):
    """Patch embedding, bidirectional blocks with 2-D RoPE over packed images and videos, final LayerNorm,
    2x2 merge.

    Forward:
        patches: ``[N, 3 * temporal_patch * patch * patch]`` patches of several images and clips, each
            image's from :func:`patchify`, each clip's from :func:`patchify_video`, concatenated.
        grids: int64 ``[num_media, 2]`` each image's ``(grid_h, grid_w)`` in patches, or ``[num_media,
            3]`` ``(t, grid_h, grid_w)`` (``t`` temporal slices; 1 for an image). Attention stays inside
            one temporal slice of one medium (Qwen2-VL's ``cu_seqlens``: ``grid_h * grid_w`` repeated
            ``t`` times).
        sp_group: long-short sequence parallelism (§ decoupled parallelism): the images form one packed
            sequence of ``L = N / merge**2`` merged tokens cut into ``sp`` contiguous chunks of
            ``c = ceil(L / sp)`` merged tokens (the last padded with a document of zero patches; the
            layout of ``omni_parallel.plan_long_short``); this rank (``u`` in the group) embeds only
            patches ``[u c m^2, (u + 1) c m^2)`` with their own 2-D RoPE rows and columns, the blocks run
            Ulysses attention over the group, and it returns its chunk's ``c`` merged tokens (padding
            rows included, last). ``None``: all images here.

    Returns:
        ``[N / merge**2, merge**2 * dim]`` merged tokens (one per LLM placeholder), media in order, a
        clip's slice by slice; with ``sp_group``: ``[c, merge**2 * dim]``.

    Raises:
        ValueError: the patch count does not match the grids, grids not ``[n, 2]`` / ``[n, 3]``, or
            patches not ``3 * temporal_patch * patch**2`` wide.
    """

    def __init__(self, cfg: ViTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.temporal_patch < 1:
            raise ValueError(f"model.vit.temporal_patch must be >= 1, got {cfg.temporal_patch}")
        self.patch_embed = nn.Linear(cfg.patch_features, cfg.dim, bias=cfg.patch_bias)
        self.blocks = nn.ModuleList(
            EncoderBlock(cfg.dim, cfg.n_heads, cfg.mlp_ratio, norm_eps=cfg.norm_eps, act=cfg.act)
            for _ in range(cfg.n_layers)
        )
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        init_linear_(self, torch.Generator().manual_seed(seed))

    def forward(
        self, patches: torch.Tensor, grids: torch.Tensor, sp_group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        thw = _thw(grids.cpu())
        sizes = thw[:, 1] * thw[:, 2]
        n = int((thw[:, 0] * sizes).sum())
        if n != patches.shape[0]:
            raise ValueError(f"{patches.shape[0]} patches but grids {grids.tolist()} need {n}")
        if patches.dim() != 2 or patches.shape[1] != self.cfg.patch_features:
            raise ValueError(
                f"patches {tuple(patches.shape)}: each must have 3 * temporal_patch * patch**2 = "
                f"{self.cfg.patch_features} features (model.vit.temporal_patch = {self.cfg.temporal_patch})"
            )
        slices = torch.repeat_interleave(sizes, thw[:, 0])  # one attention document per temporal slice
        cu = torch.zeros(slices.numel() + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(slices, 0)
        # Positions follow the patches' device (RoPE multiplies them in); cu stays on the host, where
        # varlen attention validates it.
        rows, cols = (p.to(patches.device) for p in _patch_positions(thw, self.cfg.merge))
        if sp_group is not None:
            patches, rows, cols, cu = self._chunk(patches, rows, cols, cu, sp_group)
        hd = self.cfg.dim // self.cfg.n_heads
        cr, sr = rope_angles(rows, hd // 2, self.cfg.rope_theta)
        cc, sc = rope_angles(cols, hd // 2, self.cfg.rope_theta)
        rope = (torch.cat([cr, cc], -1), torch.cat([sr, sc], -1))
        x = self.patch_embed(patches)
        for blk in self.blocks:
            x = blk(x, rope, cu, sp_group)
        x = self.norm(x)
        return x.reshape(-1, self.cfg.out_dim)

    def _chunk(
        self,
        patches: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        cu: torch.Tensor,
        group: dist.ProcessGroup,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's chunk of the packed images (see the class docstring), cut at merged-token
        boundaries (a merge window's patches are contiguous, so no merge window is split)."""
        sp, u = dist.get_world_size(group), dist.get_rank(group)
        m2 = self.cfg.merge**2
        n = patches.shape[0]
        chunk = -(-(n // m2) // sp) * m2
        pad = chunk * sp - n
        if pad:
            patches = torch.cat([patches, patches.new_zeros(pad, patches.shape[1])])
            rows = torch.cat([rows, rows.new_zeros(pad)])
            cols = torch.cat([cols, cols.new_zeros(pad)])
            cu = torch.cat([cu, cu.new_tensor([n + pad])])  # padding: a document of its own
        lo, hi = u * chunk, (u + 1) * chunk
        return patches[lo:hi], rows[lo:hi], cols[lo:hi], cu
