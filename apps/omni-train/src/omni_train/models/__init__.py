"""Tiny but real models: a dynamic-resolution ViT, a log-mel speech encoder, projectors, a LLaMA-style LLM."""

from omni_train.models.audio import AudioConfig, AudioEncoder, log_mel, num_mel_frames, num_output_frames
from omni_train.models.llm import LLMConfig, LLMStage
from omni_train.models.multimodal import AudioTower, ImageTower
from omni_train.models.projector import Projector
from omni_train.models.vit import VisionTransformer, ViTConfig, patchify, smart_resize

__all__ = [
    "AudioConfig",
    "AudioEncoder",
    "AudioTower",
    "ImageTower",
    "LLMConfig",
    "LLMStage",
    "Projector",
    "ViTConfig",
    "VisionTransformer",
    "log_mel",
    "num_mel_frames",
    "num_output_frames",
    "patchify",
    "smart_resize",
]
