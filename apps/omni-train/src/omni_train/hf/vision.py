"""The image tower <-> Qwen2-VL's vision tower (``Qwen2VisionTransformerPretrainedModel``).

Why Qwen2-VL and not SigLIP: our ViT is Qwen2-VL's design (dynamic resolution, 14-px patches, 2-D RoPE,
per-image attention over packed images, 2x2 patch merge), so with ``patch_bias=False, norm_eps=1e-6``,
Qwen2-VL's activation and the merger-shaped projector (``projector_norm=False, projector_hidden = merge**2
* dim``) it computes exactly the same function. SigLIP has learned absolute position embeddings for one
fixed image size, a CLS-free pooling head and no merger: matching it would mean a second ViT.

Layout differences handled here:

* ``patch_embed.proj`` is a ``Conv3d`` over ``temporal_patch_size`` (2) frames with stride = kernel, i.e. a
  linear map of each flattened ``[3, T, p, p]`` patch. At ``model.vit.temporal_patch = T`` our patch
  embedding is that kernel, flattened and unchanged (import and export keep every weight: videos, whose
  frames differ, compute Qwen2-VL's function). At ``temporal_patch = 1`` (images only) Qwen2-VL's
  processor repeats a still image over the ``T`` frames, so the convolution is our linear patch embedding
  with the kernel summed over time (import), and a kernel split evenly over time reproduces ours
  (export); the per-frame difference of the kernel is lost on import.
* ``merger.ln_q`` (a LayerNorm per patch before the 2x2 merge) is our ViT's final norm; ``merger.mlp`` is
  the projector (``fc1`` = ``mlp.0``, ``fc2`` = ``mlp.2``).

Pixel preprocessing (resize, mean/std normalisation) belongs to the data pipeline, not to this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from omni_train.hf.adapter import StateDictAdapter, hf_field, rename, take
from omni_train.hf.folder import HFFolderError
from omni_train.models.encoder_block import Activation
from omni_train.models.vit import ViTConfig

__all__ = ["Qwen2VLVisionAdapter", "qwen2vl_vision_problems", "vit_config_from_hf"]

_ACT = {
    "quick_gelu": Activation.QUICK_GELU,
    "gelu": Activation.GELU,
    "gelu_pytorch_tanh": Activation.GELU_TANH,
}
_TO_HF = {
    "encoder.blocks.{}.ln1.weight": "blocks.{}.norm1.weight",
    "encoder.blocks.{}.ln1.bias": "blocks.{}.norm1.bias",
    "encoder.blocks.{}.qkv.weight": "blocks.{}.attn.qkv.weight",
    "encoder.blocks.{}.qkv.bias": "blocks.{}.attn.qkv.bias",
    "encoder.blocks.{}.proj.weight": "blocks.{}.attn.proj.weight",
    "encoder.blocks.{}.proj.bias": "blocks.{}.attn.proj.bias",
    "encoder.blocks.{}.ln2.weight": "blocks.{}.norm2.weight",
    "encoder.blocks.{}.ln2.bias": "blocks.{}.norm2.bias",
    "encoder.blocks.{}.fc1.weight": "blocks.{}.mlp.fc1.weight",
    "encoder.blocks.{}.fc1.bias": "blocks.{}.mlp.fc1.bias",
    "encoder.blocks.{}.fc2.weight": "blocks.{}.mlp.fc2.weight",
    "encoder.blocks.{}.fc2.bias": "blocks.{}.mlp.fc2.bias",
    "encoder.norm.weight": "merger.ln_q.weight",
    "encoder.norm.bias": "merger.ln_q.bias",
    "projector.fc1.weight": "merger.mlp.0.weight",
    "projector.fc1.bias": "merger.mlp.0.bias",
    "projector.fc2.weight": "merger.mlp.2.weight",
    "projector.fc2.bias": "merger.mlp.2.bias",
}
_PATCH = "encoder.patch_embed.weight"
_HF_PATCH = "patch_embed.proj.weight"
QWEN2VL_NORM_EPS = 1e-6  # hard-coded in Qwen2-VL's vision blocks and merger


def vit_config_from_hf(
    hf: Mapping[str, Any], base: ViTConfig | None = None, where: str = "vision"
) -> tuple[ViTConfig, int]:
    """Our ViT config equal to a Qwen2-VL vision ``config.json`` (a ``qwen2_vl_vision`` config, or the
    ``vision_config`` of a full ``qwen2_vl`` one), and its output width (the LLM's ``dim``).

    ``base`` supplies what the checkpoint does not fix (``min_pixels``, ``max_pixels``: preprocessing)
    and ``temporal_patch``: 1 (the default: images only, the kernel summed over time) or the checkpoint's
    ``temporal_patch_size`` (videos too, the full kernel).

    Raises:
        HFFolderError: another model type, an activation we lack, ``in_channels`` other than 3, a
            ``base.temporal_patch`` other than 1 or the checkpoint's ``temporal_patch_size``, or a
            malformed field (named).
    """
    if hf.get("model_type") == "qwen2_vl":
        hf = hf.get("vision_config")
        if not isinstance(hf, dict):
            raise HFFolderError(f"{where}: a qwen2_vl config.json needs a 'vision_config' object")
    elif hf.get("model_type") != "qwen2_vl_vision":
        raise HFFolderError(
            f"{where}: model_type {hf.get('model_type')!r} is not qwen2_vl_vision or qwen2_vl"
        )
    act = hf_field(hf, "hidden_act", str, where, "quick_gelu")
    if act not in _ACT:
        raise HFFolderError(f"{where}: hidden_act {act!r} is not one of {sorted(_ACT)}")
    if hf_field(hf, "in_channels", int, where, 3) != 3:
        raise HFFolderError(f"{where}: in_channels {hf['in_channels']} is not 3 (RGB)")
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else None
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise HFFolderError(f"{where}: rope_parameters.rope_theta must be a positive number, got {rope!r}")
    dim = hf_field(hf, "embed_dim", int, where)
    merge = hf_field(hf, "spatial_merge_size", int, where, 2)
    base = base or ViTConfig()
    frames = hf_field(hf, "temporal_patch_size", int, where, 2)
    if base.temporal_patch not in (1, frames):
        raise HFFolderError(
            f"{where}: model.vit.temporal_patch {base.temporal_patch} is neither 1 nor the checkpoint's "
            f"temporal_patch_size {frames}"
        )
    cfg = dataclasses.replace(
        base,
        dim=dim,
        n_layers=hf_field(hf, "depth", int, where),
        n_heads=hf_field(hf, "num_heads", int, where),
        patch=hf_field(hf, "patch_size", int, where, 14),
        merge=merge,
        rope_theta=float(theta),
        mlp_ratio=hf_field(hf, "mlp_ratio", int, where, 4),
        norm_eps=QWEN2VL_NORM_EPS,
        act=_ACT[act],
        patch_bias=False,
        projector_norm=False,
        projector_hidden=merge * merge * dim,
    )
    return cfg, hf_field(hf, "hidden_size", int, where)


def qwen2vl_vision_problems(cfg: ViTConfig) -> list[str]:
    """Why a ViT config is not exactly a Qwen2-VL vision tower (empty when it is), naming the fields."""
    problems = []
    if cfg.patch_bias:
        problems.append("model.vit.patch_bias must be false (Qwen2-VL's patch embedding has no bias)")
    if cfg.norm_eps != QWEN2VL_NORM_EPS:
        problems.append(f"model.vit.norm_eps must be {QWEN2VL_NORM_EPS} (got {cfg.norm_eps})")
    if cfg.projector_norm:
        problems.append(
            "model.vit.projector_norm must be false (the merger has no LayerNorm after the merge)"
        )
    if cfg.projector_hidden != cfg.out_dim:
        problems.append(
            f"model.vit.projector_hidden must be merge**2 * dim = {cfg.out_dim} (got {cfg.projector_hidden})"
        )
    return problems


class Qwen2VLVisionAdapter(StateDictAdapter):
    """:class:`~omni_train.models.multimodal.ImageTower` (ViT + projector) <-> the Qwen2-VL vision tower
    (patch merger included).

    Args:
        cfg: our ViT config (:func:`qwen2vl_vision_problems` must be empty to export).
        llm_dim: the projector's output width (Qwen2-VL's ``hidden_size``).
        temporal_patch_size: frames of the ``Conv3d`` patch embedding (import: the checkpoint's); with
            ``cfg.temporal_patch > 1`` it must equal it.

    Raises:
        ValueError: ``cfg.temporal_patch`` is neither 1 nor ``temporal_patch_size``.
    """

    model_type = "qwen2_vl_vision"
    accepted_model_types = ("qwen2_vl_vision", "qwen2_vl")
    prefixes = ("", "model.visual.", "visual.")
    anchor = _HF_PATCH

    def __init__(self, cfg: ViTConfig, llm_dim: int, *, temporal_patch_size: int = 2) -> None:
        if cfg.temporal_patch not in (1, temporal_patch_size):
            raise ValueError(
                f"vision: model.vit.temporal_patch {cfg.temporal_patch} is neither 1 nor the Conv3d's "
                f"temporal_patch_size {temporal_patch_size}"
            )
        self.cfg, self.llm_dim, self.temporal = cfg, llm_dim, temporal_patch_size

    def our_names(self) -> list[str]:
        per_block = [k.removeprefix("encoder.blocks.{}.") for k in _TO_HF if k.startswith("encoder.blocks.")]
        blocks = [f"encoder.blocks.{i}.{n}" for i in range(self.cfg.n_layers) for n in per_block]
        return [_PATCH, *blocks, *(k for k in _TO_HF if not k.startswith("encoder.blocks."))]

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state_dict.items():
            if name == _PATCH:
                p = self.cfg.patch
                if self.cfg.temporal_patch == self.temporal:  # [D, 3*T*p*p] -> [D, 3, T, p, p], as is
                    out[_HF_PATCH] = t.reshape(t.shape[0], 3, self.temporal, p, p).contiguous()
                    continue
                # [D, 3*p*p] -> [D, 3, T, p, p], split evenly over the T (identical) frames.
                w = t.reshape(t.shape[0], 3, 1, p, p) / self.temporal
                out[_HF_PATCH] = w.expand(-1, -1, self.temporal, -1, -1).contiguous()
                continue
            target = rename(name, _TO_HF)
            if target is None:
                raise KeyError(f"vision: no Qwen2-VL name for parameter {name!r}")
            out[target] = t
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.our_names():
            if name == _PATCH:
                w = take(hf_state_dict, _HF_PATCH, "vision")
                if w.dim() != 5 or w.shape[1] != 3:
                    raise HFFolderError(
                        f"vision: {_HF_PATCH} has shape {tuple(w.shape)}, not [D, 3, T, p, p]"
                    )
                if self.cfg.temporal_patch > 1:
                    if w.shape[2] != self.cfg.temporal_patch:
                        raise HFFolderError(
                            f"vision: {_HF_PATCH} spans {w.shape[2]} frames, model.vit.temporal_patch is "
                            f"{self.cfg.temporal_patch}"
                        )
                    out[name] = w.reshape(w.shape[0], -1)  # the whole kernel: (channel, frame, row, col)
                else:
                    out[name] = w.sum(dim=2).reshape(w.shape[0], -1)  # a still image repeats over T frames
            else:
                out[name] = take(hf_state_dict, rename(name, _TO_HF), "vision")
        return out

    def hf_config(self) -> dict[str, Any]:
        c = self.cfg
        act = {v: k for k, v in _ACT.items()}[Activation(c.act)]
        return {
            "architectures": ["Qwen2VisionTransformerPretrainedModel"],
            "model_type": self.model_type,
            "depth": c.n_layers,
            "embed_dim": c.dim,
            "hidden_size": self.llm_dim,
            "hidden_act": act,
            "mlp_ratio": c.mlp_ratio,
            "num_heads": c.n_heads,
            "in_channels": 3,
            "patch_size": c.patch,
            "spatial_merge_size": c.merge,
            "temporal_patch_size": self.temporal,
            "rope_parameters": {"rope_type": "axial", "rope_theta": c.rope_theta},
            "dtype": "float32",
        }
