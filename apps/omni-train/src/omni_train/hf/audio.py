"""The audio encoder <-> Whisper's encoder (``WhisperEncoder``; the encoder half of ``WhisperModel``).

With ``stem="whisper", positions="sinusoidal", subsample=2, mel_scale="slaney"`` our
:class:`~omni_train.models.audio.AudioEncoder` is Whisper's encoder: ``conv1``/``conv2`` are our two
convolutions, ``embed_positions`` our ``pos_embed`` table, each layer our encoder block with Q/K/V fused
into one projection. Whisper's ``k_proj`` has no bias: import fills the key third of our fused bias with
zeros, export drops it (a key bias adds ``q . b`` to every score of a query, which softmax ignores, so
the function is the same whatever its value). The audio projector (to the LLM width) has no Whisper
counterpart: it keeps its own initialisation on import and is not exported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from omni_train.hf.adapter import StateDictAdapter, hf_field, rename, take
from omni_train.hf.folder import HFFolderError
from omni_train.models.audio import AudioConfig, AudioPositions, AudioStem, MelScale
from omni_train.models.encoder_block import Activation

__all__ = ["WhisperEncoderAdapter", "audio_config_from_hf", "whisper_encoder_problems"]

_ACT = {
    "gelu": Activation.GELU,
    "quick_gelu": Activation.QUICK_GELU,
    "gelu_pytorch_tanh": Activation.GELU_TANH,
}
_TO_HF = {
    "convs.0.weight": "conv1.weight",
    "convs.0.bias": "conv1.bias",
    "convs.1.weight": "conv2.weight",
    "convs.1.bias": "conv2.bias",
    "pos_embed": "embed_positions.weight",
    "norm.weight": "layer_norm.weight",
    "norm.bias": "layer_norm.bias",
    "blocks.{}.ln1.weight": "layers.{}.self_attn_layer_norm.weight",
    "blocks.{}.ln1.bias": "layers.{}.self_attn_layer_norm.bias",
    "blocks.{}.proj.weight": "layers.{}.self_attn.out_proj.weight",
    "blocks.{}.proj.bias": "layers.{}.self_attn.out_proj.bias",
    "blocks.{}.ln2.weight": "layers.{}.final_layer_norm.weight",
    "blocks.{}.ln2.bias": "layers.{}.final_layer_norm.bias",
    "blocks.{}.fc1.weight": "layers.{}.fc1.weight",
    "blocks.{}.fc1.bias": "layers.{}.fc1.bias",
    "blocks.{}.fc2.weight": "layers.{}.fc2.weight",
    "blocks.{}.fc2.bias": "layers.{}.fc2.bias",
}
_QKV = ("q_proj", "k_proj", "v_proj")
WHISPER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which Whisper uses


def audio_config_from_hf(
    hf: Mapping[str, Any], base: AudioConfig | None = None, where: str = "audio"
) -> AudioConfig:
    """Our audio encoder config equal to a Whisper ``config.json``'s encoder.

    ``base`` supplies what the checkpoint does not fix (``sample_rate``, ``n_fft``, ``hop``: Whisper's
    feature extractor uses 16 kHz, 400, 160, our defaults).

    Raises:
        HFFolderError: another model type, an activation we lack, an FFN width that is not a whole
            multiple of ``d_model``, or a malformed field (named).
    """
    if hf.get("model_type") != "whisper":
        raise HFFolderError(f"{where}: model_type {hf.get('model_type')!r} is not whisper")
    dim = hf_field(hf, "d_model", int, where)
    ffn = hf_field(hf, "encoder_ffn_dim", int, where)
    if ffn % dim:
        raise HFFolderError(f"{where}: encoder_ffn_dim {ffn} is not a multiple of d_model {dim}")
    act = hf_field(hf, "activation_function", str, where, "gelu")
    if act not in _ACT:
        raise HFFolderError(f"{where}: activation_function {act!r} is not one of {sorted(_ACT)}")
    return dataclasses.replace(
        base or AudioConfig(),
        dim=dim,
        n_layers=hf_field(hf, "encoder_layers", int, where),
        n_heads=hf_field(hf, "encoder_attention_heads", int, where),
        n_mels=hf_field(hf, "num_mel_bins", int, where),
        subsample=2,
        mlp_ratio=ffn // dim,
        norm_eps=WHISPER_NORM_EPS,
        act=_ACT[act],
        stem=AudioStem.WHISPER,
        positions=AudioPositions.SINUSOIDAL,
        max_positions=hf_field(hf, "max_source_positions", int, where),
        mel_scale=MelScale.SLANEY,
    )


def whisper_encoder_problems(cfg: AudioConfig) -> list[str]:
    """Why an audio config is not exactly a Whisper encoder (empty when it is), naming the fields."""
    want = {
        "stem": AudioStem.WHISPER,
        "positions": AudioPositions.SINUSOIDAL,
        "subsample": 2,
        "norm_eps": WHISPER_NORM_EPS,
        "mel_scale": MelScale.SLANEY,
    }
    return [
        f"model.audio.{k} must be {v!s} (got {getattr(cfg, k)!s})"
        for k, v in want.items()
        if getattr(cfg, k) != v
    ]


class WhisperEncoderAdapter(StateDictAdapter):
    """:class:`~omni_train.models.audio.AudioEncoder` <-> ``WhisperEncoder``."""

    model_type = "whisper"
    accepted_model_types = ("whisper",)
    prefixes = ("", "model.encoder.", "encoder.")
    anchor = "conv1.weight"

    def __init__(self, cfg: AudioConfig) -> None:
        self.cfg = cfg

    def our_names(self) -> list[str]:
        per_block = ["ln1.weight", "ln1.bias", "qkv.weight", "qkv.bias", "proj.weight", "proj.bias"]
        per_block += ["ln2.weight", "ln2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        blocks = [f"blocks.{i}.{n}" for i in range(self.cfg.n_layers) for n in per_block]
        return ["convs.0.weight", "convs.0.bias", "convs.1.weight", "convs.1.bias", *blocks, "norm.weight",
                "norm.bias", "pos_embed"]  # fmt: skip

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state_dict.items():
            if name.endswith((".qkv.weight", ".qkv.bias")):
                layer = name.split(".")[1]
                for proj, part in zip(_QKV, t.chunk(3, dim=0)):
                    if proj == "k_proj" and name.endswith("bias"):
                        continue  # no key bias in Whisper: softmax cancels it (module docstring)
                    out[f"layers.{layer}.self_attn.{proj}.{name.rsplit('.', 1)[1]}"] = part
                continue
            target = rename(name, _TO_HF)
            if target is None:
                raise KeyError(f"audio: no Whisper name for parameter {name!r}")
            out[target] = t
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.our_names():
            if name.endswith(".qkv.weight"):
                layer = name.split(".")[1]
                parts = [take(hf_state_dict, f"layers.{layer}.self_attn.{p}.weight", "audio") for p in _QKV]
                out[name] = torch.cat(parts)
            elif name.endswith(".qkv.bias"):
                layer = name.split(".")[1]
                q = take(hf_state_dict, f"layers.{layer}.self_attn.q_proj.bias", "audio")
                v = take(hf_state_dict, f"layers.{layer}.self_attn.v_proj.bias", "audio")
                out[name] = torch.cat([q, torch.zeros_like(q), v])
            else:
                out[name] = take(hf_state_dict, rename(name, _TO_HF), "audio")
        return out

    def hf_config(self) -> dict[str, Any]:
        c = self.cfg
        act = {v: k for k, v in _ACT.items()}[Activation(c.act)]
        return {
            "architectures": ["WhisperEncoder"],
            "model_type": self.model_type,
            "d_model": c.dim,
            "encoder_layers": c.n_layers,
            "encoder_attention_heads": c.n_heads,
            "encoder_ffn_dim": c.mlp_ratio * c.dim,
            "num_mel_bins": c.n_mels,
            "max_source_positions": c.max_positions,
            "activation_function": act,
            "scale_embedding": False,
            "dtype": "float32",
        }
