"""Hugging Face interop: ``StateDictAdapter`` per model family, folders, ``import-hf`` / ``export-hf``.

Families: the LLM (``LlamaForCausalLM``, ``Qwen2ForCausalLM``), the image tower (Qwen2-VL's vision tower),
the audio encoder (``WhisperEncoder``). ``transformers`` is not a dependency: folders are read and written
with ``json`` and ``safetensors``; the tests use ``transformers`` as the oracle.
"""

from omni_train.hf.adapter import StateDictAdapter
from omni_train.hf.audio import WhisperEncoderAdapter, audio_config_from_hf
from omni_train.hf.convert import ExportReport, ImportReport, build_model, export_hf, import_hf, read_family
from omni_train.hf.folder import HFFolderError, read_config, read_weights, write_folder
from omni_train.hf.llm import LlamaAdapter, llm_config_from_hf
from omni_train.hf.vision import Qwen2VLVisionAdapter, vit_config_from_hf

__all__ = [
    "ExportReport",
    "HFFolderError",
    "ImportReport",
    "LlamaAdapter",
    "Qwen2VLVisionAdapter",
    "StateDictAdapter",
    "WhisperEncoderAdapter",
    "audio_config_from_hf",
    "build_model",
    "export_hf",
    "import_hf",
    "llm_config_from_hf",
    "read_config",
    "read_family",
    "read_weights",
    "vit_config_from_hf",
    "write_folder",
]
