"""The LLM <-> ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``.

Both architectures are our :class:`~omni_train.models.llm.LLMStage` (one stage, all layers): RMSNorm,
SwiGLU (``gate_proj`` = ``w1``, ``up_proj`` = ``w3``, ``down_proj`` = ``w2``), GQA, RoPE in the "rotate
half" layout that :func:`~omni_train.models.attention.apply_rope` uses, so Q and K weights are copied as
they are (the permutation torchtitan applies exists only for Meta's interleaved-pair checkpoints).
Qwen2 is LLaMA with biases on Q/K/V (``qkv_bias``) and, in its small sizes, a tied LM head.

Refused on import, naming the ``config.json`` key: RoPE scaling (``rope_type`` other than ``default``),
sliding-window attention, ``attention_bias``/``mlp_bias`` in a Llama config, an activation other than
SiLU, a ``head_dim`` other than ``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from omni_train.hf.adapter import StateDictAdapter, hf_field, rename, take
from omni_train.hf.folder import HFFolderError
from omni_train.models.llm import LLMConfig

__all__ = ["LlamaAdapter", "llm_config_from_hf"]

_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.mlp_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.attn.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attn.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attn.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attn.wq.bias": "model.layers.{}.self_attn.q_proj.bias",
    "layers.{}.attn.wk.bias": "model.layers.{}.self_attn.k_proj.bias",
    "layers.{}.attn.wv.bias": "model.layers.{}.self_attn.v_proj.bias",
    "layers.{}.attn.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.mlp.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.mlp.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.mlp.w2.weight": "model.layers.{}.mlp.down_proj.weight",
}


def llm_config_from_hf(hf: Mapping[str, Any], vocab_size: int | None = None, where: str = "llm") -> LLMConfig:
    """Our LLM config equal to a Llama or Qwen2 ``config.json``.

    Args:
        hf: the parsed ``config.json``.
        vocab_size: expected vocabulary (our tokenizer's); None takes the config's.
        where: names the folder in errors.

    Raises:
        HFFolderError: another ``model_type``, a feature our LLM does not have, a vocabulary that is not
            ``vocab_size``, or a malformed field (the key is named).
    """
    model_type = hf.get("model_type")
    if model_type not in LlamaAdapter.accepted_model_types:
        raise HFFolderError(
            f"{where}: model_type {model_type!r} is not one of {LlamaAdapter.accepted_model_types}"
        )
    dim = hf_field(hf, "hidden_size", int, where)
    heads = hf_field(hf, "num_attention_heads", int, where)
    kv = hf_field(hf, "num_key_value_heads", int, where, heads)
    head_dim = hf.get("head_dim") or dim // heads
    if dim % heads or head_dim != dim // heads:
        raise HFFolderError(f"{where}: head_dim {head_dim} must be hidden_size / num_attention_heads")
    if hf_field(hf, "hidden_act", str, where, "silu") != "silu":
        raise HFFolderError(f"{where}: hidden_act {hf['hidden_act']!r} is not silu (SwiGLU)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
        raise HFFolderError(f"{where}: rope scaling {rope!r} is not supported (rope_type must be default)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise HFFolderError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    if model_type == "qwen2":
        if hf.get("use_sliding_window"):
            raise HFFolderError(
                f"{where}: use_sliding_window is true; sliding-window attention is not supported"
            )
    else:
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise HFFolderError(f"{where}: {key} is true; only Qwen2's Q/K/V biases are supported")
    vocab = hf_field(hf, "vocab_size", int, where)
    if vocab_size is not None and vocab != vocab_size:
        raise HFFolderError(
            f"{where}: vocab_size {vocab} differs from the tokenizer's {vocab_size} (data.tokenizer)"
        )
    return LLMConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=hf_field(hf, "num_hidden_layers", int, where),
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=hf_field(hf, "intermediate_size", int, where),
        rope_theta=float(theta),
        norm_eps=hf_field(hf, "rms_norm_eps", float, where, 1e-6),
        qkv_bias=model_type == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


class LlamaAdapter(StateDictAdapter):
    """:class:`LLMStage` (one stage) <-> ``LlamaForCausalLM``, or ``Qwen2ForCausalLM`` when ``qkv_bias``.

    Args:
        cfg: our LLM config.
        max_position_embeddings: written to ``config.json`` (RoPE itself has no limit).
        bos_token_id, eos_token_id: written to ``config.json`` when given.
        hf_tied: on import, the checkpoint's ``tie_word_embeddings`` (its LM head is its embedding); an
            untied model of ours then starts with ``output = tok_embeddings``.
    """

    model_type = "llama"
    accepted_model_types = ("llama", "qwen2")
    prefixes = ("",)
    anchor = "model.embed_tokens.weight"

    def __init__(
        self,
        cfg: LLMConfig,
        *,
        max_position_embeddings: int = 4096,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        hf_tied: bool | None = None,
    ) -> None:
        self.cfg = cfg
        self.max_position_embeddings = max_position_embeddings
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.hf_tied = cfg.tie_embeddings if hf_tied is None else hf_tied

    @property
    def architecture(self) -> str:
        return "Qwen2ForCausalLM" if self.cfg.qkv_bias else "LlamaForCausalLM"

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state_dict.items():
            if name == "output.weight" and self.cfg.tie_embeddings:
                continue  # tie_word_embeddings: the embedding is the head
            target = rename(name, _TO_HF)
            if target is None:
                raise KeyError(f"llm: no Hugging Face name for parameter {name!r}")
            out[target] = t
        return out

    def our_names(self) -> list[str]:
        """Our state-dict names for ``cfg`` (the tied head included), in module order."""
        per_layer = ["attn_norm.weight", "attn.wq.weight", "attn.wk.weight", "attn.wv.weight"]
        if self.cfg.qkv_bias:
            per_layer += ["attn.wq.bias", "attn.wk.bias", "attn.wv.bias"]
        per_layer += ["attn.wo.weight", "mlp_norm.weight", "mlp.w1.weight", "mlp.w3.weight", "mlp.w2.weight"]
        layers = [f"layers.{i}.{n}" for i in range(self.cfg.n_layers) for n in per_layer]
        return ["tok_embeddings.weight", *layers, "norm.weight", "output.weight"]

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.cfg.tie_embeddings and not self.hf_tied:
            raise HFFolderError(
                "llm: the checkpoint has its own lm_head (tie_word_embeddings false) but "
                "model.llm.tie_embeddings is true"
            )
        out = {}
        for name in self.our_names():
            if name == "output.weight" and self.hf_tied:
                # A tied checkpoint's head is its embedding; an untied model of ours starts from it.
                out[name] = out["tok_embeddings.weight"]
            else:
                out[name] = take(hf_state_dict, rename(name, _TO_HF), "llm")
        return out

    def hf_config(self) -> dict[str, Any]:
        c = self.cfg
        config: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen2" if c.qkv_bias else "llama",
            "vocab_size": c.vocab_size,
            "hidden_size": c.dim,
            "intermediate_size": c.ffn_dim,
            "num_hidden_layers": c.n_layers,
            "num_attention_heads": c.n_heads,
            "num_key_value_heads": c.n_kv_heads,
            "head_dim": c.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": c.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
            "tie_word_embeddings": c.tie_embeddings,
            "attention_dropout": 0.0,
            "dtype": "float32",
        }
        if c.qkv_bias:
            config["use_sliding_window"] = False
        else:
            config.update(attention_bias=False, mlp_bias=False)
        if self.bos_token_id is not None:
            config["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            config["eos_token_id"] = self.eos_token_id
        return config
