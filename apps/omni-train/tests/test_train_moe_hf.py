"""Qwen2-MoE <-> our MoE LLM (``omni_train.hf.llm``), ``transformers`` as the oracle, built from a small config.

A ``Qwen2MoeForCausalLM`` (4 experts, top-2, a gated shared expert, every second layer MoE) saved as a
sharded folder: ``llm_config_from_hf`` reads its ``[model.llm] moe``, the adapter stacks its per-expert
weights, and our packed logits equal ``transformers``' on each document alone (float32, 1e-5). Exported
from our seeded model, the folder loads with ``from_pretrained`` as a ``Qwen2MoeForCausalLM`` whose logits
equal ours; what Qwen2-MoE cannot represent is refused naming the key.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_train_hf_models import _packed_vs_batched as _logits  # noqa: E402
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM  # noqa: E402

from omni_train.hf import (  # noqa: E402
    HFFolderError,
    LlamaAdapter,
    llm_config_from_hf,
    read_config,
    read_weights,
    write_folder,
)
from omni_train.models import LLMStage  # noqa: E402

TOL = 1e-5
SIZES = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
    num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, initializer_range=0.1, rms_norm_eps=1e-6,
)  # fmt: skip


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape and ref.std() > 0.1
    torch.testing.assert_close(ours, ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen2_moe_import_equals_transformers_and_export_loads(tmp_path, norm_topk_prob):
    torch.manual_seed(0)
    hf_model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**SIZES, norm_topk_prob=norm_topk_prob)).eval()
    with torch.no_grad():  # norms and biases away from their init, the router sharp enough to matter
        g = torch.Generator().manual_seed(1)
        for name, p in hf_model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif p.dim() == 1:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")

    cfg = llm_config_from_hf(read_config(tmp_path / "hf"), vocab_size=97)
    moe = cfg.moe
    assert moe is not None and (moe.experts, moe.top_k, moe.every_n_layers) == (4, 2, 2)
    assert (moe.expert_ffn_dim, moe.shared_expert_ffn_dim, moe.shared_gate) == (32, 48, True)
    assert moe.norm_topk_prob == norm_topk_prob and cfg.qkv_bias
    ours = LLMStage(cfg)
    adapter = LlamaAdapter(cfg)
    ours.load_state_dict(adapter.from_hf(read_weights(tmp_path / "hf")), strict=True)
    _close(*_logits(ours, hf_model, 2))

    # export: our seeded model -> folder -> from_pretrained
    mine = LLMStage(cfg, seed=7)
    write_folder(
        tmp_path / "out", adapter.hf_config(), adapter.to_hf(mine.state_dict()), max_shard_bytes=60_000
    )
    loaded = Qwen2MoeForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(loaded) is Qwen2MoeForCausalLM and loaded.config.num_experts == 4
    _close(*_logits(mine, loaded, 4))


def test_qwen2_moe_import_refuses_what_it_cannot_represent():
    base = Qwen2MoeConfig(**SIZES).to_dict()
    with pytest.raises(HFFolderError, match="mlp_only_layers"):
        llm_config_from_hf({**base, "mlp_only_layers": [1]}, 97)
    with pytest.raises(HFFolderError, match="shared_expert_intermediate_size"):
        llm_config_from_hf({**base, "shared_expert_intermediate_size": 0}, 97)
