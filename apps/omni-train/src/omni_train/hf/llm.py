"""The LLM <-> ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen2MoeForCausalLM``.

Both architectures are our :class:`~omni_train.models.llm.LLMStage` (one stage, all layers): RMSNorm,
SwiGLU (``gate_proj`` = ``w1``, ``up_proj`` = ``w3``, ``down_proj`` = ``w2``), GQA, RoPE in the "rotate
half" layout that :func:`~omni_train.models.attention.apply_rope` uses, so Q and K weights are copied as
they are (the permutation torchtitan applies exists only for Meta's interleaved-pair checkpoints).
Qwen2 is LLaMA with biases on Q/K/V (``qkv_bias``) and, in its small sizes, a tied LM head.
Qwen2-MoE is Qwen2 whose every ``decoder_sparse_step``-th MLP is an MoE layer (``[model.llm] moe``,
:class:`omni_parallel.moe.MoE`): router ``mlp.gate``, per-expert ``mlp.experts.<e>.{gate,up,down}_proj`` on
disk (stacked into our ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``), a gated shared expert.
The adapter works on whole tensors, so any expert-parallel size goes through it: under ``parallel.ep`` the
trainer's stacked experts are ``Shard(0)`` DTensors, i.e. boxes of rows ``[r E/ep, (r+1) E/ep)`` of these
tensors in omni-ckpt, loaded from an imported step 0 and gathered whole for export by box intersection
(``omni_train.hf.convert``).

Qwen2-VL's language model (inside a full ``qwen2_vl`` checkpoint: ``text_config``; on disk its tensors
carry Qwen2's names, ``model.layers.*``, next to ``visual.*``) is Qwen2 with multimodal RoPE: its ``rope_parameters.mrope_section`` becomes
``[model.llm] mrope_section`` (:func:`~omni_train.models.attention.mrope_angles`); export of an M-RoPE
LLM is refused (it would be a full Qwen2-VL checkpoint, not a Qwen2 one).

Refused on import, naming the ``config.json`` key: RoPE scaling (``rope_type`` other than ``default``),
sliding-window attention, ``attention_bias``/``mlp_bias`` in a Llama config, an activation other than
SiLU, a ``head_dim`` other than ``hidden_size / num_attention_heads``; for Qwen2-MoE also
``mlp_only_layers`` and a model without a shared expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from omni_train.hf.adapter import StateDictAdapter, hf_field, rename, take
from omni_train.hf.folder import HFFolderError
from omni_train.models.llm import LLMConfig, MoESpec

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
    """Our LLM config equal to a Llama, Qwen2, Qwen2-MoE or Qwen2-VL (its ``text_config``) ``config.json``.

    Args:
        hf: the parsed ``config.json``.
        vocab_size: expected vocabulary (our tokenizer's); None takes the config's.
        where: names the folder in errors.

    Raises:
        HFFolderError: another ``model_type``, a feature our LLM does not have, a vocabulary that is not
            ``vocab_size``, or a malformed field (the key is named).
    """
    model_type = hf.get("model_type")
    mrope = None
    if model_type == "qwen2_vl":  # the language model of a full Qwen2-VL checkpoint
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise HFFolderError(f"{where}: a qwen2_vl config.json needs a 'text_config' object")
        tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        hf = {**text, "model_type": "qwen2", "tie_word_embeddings": tied}
        model_type = "qwen2"
        rope_parameters = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        mrope = rope_parameters.get("mrope_section") if isinstance(rope_parameters, dict) else None
        if not (
            isinstance(mrope, list) and len(mrope) == 3 and all(type(v) is int and v >= 0 for v in mrope)
        ):
            raise HFFolderError(
                f"{where}: text_config.rope_parameters.mrope_section must be 3 non-negative integers, "
                f"got {mrope!r}"
            )
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
    if model_type in ("qwen2", "qwen2_moe"):
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
    moe = _moe_from_hf(hf, where) if model_type == "qwen2_moe" else None
    return LLMConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=hf_field(hf, "num_hidden_layers", int, where),
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=hf_field(hf, "intermediate_size", int, where),
        rope_theta=float(theta),
        norm_eps=hf_field(hf, "rms_norm_eps", float, where, 1e-6),
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=moe,
        mrope_section=mrope,
    )


def _moe_from_hf(hf: Mapping[str, Any], where: str) -> MoESpec:
    """``[model.llm] moe`` of a Qwen2-MoE ``config.json`` (``transformers`` ``Qwen2MoeConfig``)."""
    if hf.get("mlp_only_layers"):
        raise HFFolderError(
            f"{where}: mlp_only_layers {hf['mlp_only_layers']!r} is not supported (must be [])"
        )
    shared = hf_field(hf, "shared_expert_intermediate_size", int, where)
    if shared < 1:
        raise HFFolderError(f"{where}: shared_expert_intermediate_size must be >= 1, got {shared}")
    return MoESpec(
        experts=hf_field(hf, "num_experts", int, where),
        top_k=hf_field(hf, "num_experts_per_tok", int, where),
        shared_experts=1,
        every_n_layers=hf_field(hf, "decoder_sparse_step", int, where, 1),
        expert_ffn_dim=hf_field(hf, "moe_intermediate_size", int, where),
        shared_expert_ffn_dim=shared,
        shared_gate=True,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        # verbatim: transformers adds router_aux_loss_coef x (one loss over all layers' router rows pooled,
        # a layer mean in scale) per batch; the trainer's aux term is coef x its mean over the step's
        # packs and MoE layers (omni_train.models.llm.set_moe_loss_scale): the same weight
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        z_loss_coef=0.0,
    )


# our MoE layer's names -> Qwen2-MoE's (the routed experts are stacked: handled apart)
_MOE_TO_HF = {
    "router.weight": "gate.weight",
    "shared_expert.gate_proj.weight": "shared_expert.gate_proj.weight",
    "shared_expert.up_proj.weight": "shared_expert.up_proj.weight",
    "shared_expert.down_proj.weight": "shared_expert.down_proj.weight",
    "shared_expert_gate.weight": "shared_expert_gate.weight",
}


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
    accepted_model_types = ("llama", "qwen2", "qwen2_moe")
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
        if self.cfg.moe is not None:
            return "Qwen2MoeForCausalLM"
        return "Qwen2ForCausalLM" if self.cfg.qkv_bias else "LlamaForCausalLM"

    def _moe_layer(self, i: int) -> bool:
        return self.cfg.moe is not None and self.cfg.moe.is_moe_layer(i)

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state_dict.items():
            if name == "output.weight" and self.cfg.tie_embeddings:
                continue  # tie_word_embeddings: the embedding is the head
            if ".mlp.moe." in name:
                out.update(self._moe_to_hf(name, t))
                continue
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
        per_layer += ["attn.wo.weight", "mlp_norm.weight"]
        dense = ["mlp.w1.weight", "mlp.w3.weight", "mlp.w2.weight"]
        moe = ["mlp.moe.router.weight", "mlp.moe.experts.gate_up_proj", "mlp.moe.experts.down_proj"]
        moe += [f"mlp.moe.{n}" for n in list(_MOE_TO_HF)[1:]]
        layers = [
            f"layers.{i}.{n}"
            for i in range(self.cfg.n_layers)
            for n in per_layer + (moe if self._moe_layer(i) else dense)
        ]
        return ["tok_embeddings.weight", *layers, "norm.weight", "output.weight"]

    def _moe_to_hf(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """One MoE parameter of ours as Qwen2-MoE's on-disk tensors (the stacked experts one per expert)."""
        layer, rest = name.split(".mlp.moe.")
        prefix = f"model.{layer}.mlp."
        if rest == "experts.gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            return {
                f"{prefix}experts.{e}.{kind}.weight": w[e].contiguous()
                for e in range(t.shape[0])
                for kind, w in (("gate_proj", gate), ("up_proj", up))
            }
        if rest == "experts.down_proj":
            return {f"{prefix}experts.{e}.down_proj.weight": t[e].contiguous() for e in range(t.shape[0])}
        if rest not in _MOE_TO_HF:
            raise KeyError(f"llm: no Hugging Face name for parameter {name!r}")
        return {prefix + _MOE_TO_HF[rest]: t}

    def _moe_from_hf(self, name: str, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
        layer, rest = name.split(".mlp.moe.")
        prefix = f"model.{layer}.mlp."
        experts = self.cfg.moe.experts if self.cfg.moe is not None else 0
        if rest == "experts.gate_up_proj":
            return torch.stack(
                [
                    torch.cat(
                        [take(hf, f"{prefix}experts.{e}.{k}.weight", "llm") for k in ("gate_proj", "up_proj")]
                    )
                    for e in range(experts)
                ]
            )
        if rest == "experts.down_proj":
            return torch.stack(
                [take(hf, f"{prefix}experts.{e}.down_proj.weight", "llm") for e in range(experts)]
            )
        return take(hf, prefix + _MOE_TO_HF[rest], "llm")

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
            elif ".mlp.moe." in name:
                out[name] = self._moe_from_hf(name, hf_state_dict)
            else:
                out[name] = take(hf_state_dict, rename(name, _TO_HF), "llm")
        return out

    def hf_config(self) -> dict[str, Any]:
        c = self.cfg
        if c.mrope_section is not None:
            raise ValueError(
                "llm: export of an M-RoPE LLM (model.llm.mrope_section) is not supported: it is Qwen2-VL's "
                "language model, not a Qwen2ForCausalLM"
            )
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
        if c.moe is not None:
            m = c.moe
            if not (m.shared_experts and m.shared_gate):
                raise ValueError("llm: Qwen2-MoE export needs a gated shared expert (moe.shared_gate = true)")
            config.update(
                architectures=[self.architecture],
                model_type="qwen2_moe",
                num_experts=m.experts,
                num_experts_per_tok=m.top_k,
                decoder_sparse_step=m.every_n_layers,
                moe_intermediate_size=m.expert_ffn_dim if m.expert_ffn_dim is not None else c.ffn_dim,
                shared_expert_intermediate_size=m.layer_config(c.dim, c.ffn_dim).shared_width,
                norm_topk_prob=m.norm_topk_prob,
                router_aux_loss_coef=m.aux_loss_coef,
                mlp_only_layers=[],
                qkv_bias=c.qkv_bias,
            )
        if c.qkv_bias:
            config["use_sliding_window"] = False
        else:
            config.update(attention_bias=False, mlp_bias=False)
        if self.bos_token_id is not None:
            config["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            config["eos_token_id"] = self.eos_token_id
        return config
