"""Qwen2-MoE <-> our MoE LLM (``omni_train.hf.llm``), ``transformers`` as the oracle, built from a small config.

A ``Qwen2MoeForCausalLM`` (4 experts, top-2, a gated shared expert, every second layer MoE) saved as a
sharded folder: ``llm_config_from_hf`` reads its ``[model.llm] moe``, the adapter stacks its per-expert
weights, and our packed logits equal ``transformers``' on each document alone (float32, 1e-5). Exported
from our seeded model, the folder loads with ``from_pretrained`` as a ``Qwen2MoeForCausalLM`` whose logits
equal ours; what Qwen2-MoE cannot represent is refused naming the key.

At ep = 2 (2 gloo processes, the trainer itself): ``omni-train import-hf`` of a Qwen2-MoE folder is loaded
by the trainer's ``--resume`` of step 0 with each rank holding its ``Shard(0)`` experts, and its EP forward
equals ``transformers``; the checkpoint the trainer saves at ep = 2 (one box per EP rank) exports with
``omni-train export-hf`` to a folder whose ``from_pretrained`` forward equals the trained ep = 2 forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
# The transformers models (and test_train_hf_models, which imports more of them) are imported inside
# the tests: the ep = 2 world's processes import this module, and would spend seconds on them.

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


def _perturbed(hf_model: torch.nn.Module) -> torch.nn.Module:
    """``hf_model`` in eval mode with its norms and biases away from their init and its router sharp
    enough to matter (seeded)."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in hf_model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif p.dim() == 1:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
    return hf_model.eval()


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape and ref.std() > 0.1
    torch.testing.assert_close(ours, ref, rtol=0, atol=TOL)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen2_moe_import_equals_transformers_and_export_loads(tmp_path, norm_topk_prob):
    from test_train_hf_models import _packed_vs_batched as _logits
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    hf_model = _perturbed(Qwen2MoeForCausalLM(Qwen2MoeConfig(**SIZES, norm_topk_prob=norm_topk_prob)))
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
    from transformers import Qwen2MoeConfig

    base = Qwen2MoeConfig(**SIZES).to_dict()
    with pytest.raises(HFFolderError, match="mlp_only_layers"):
        llm_config_from_hf({**base, "mlp_only_layers": [1]}, 97)
    with pytest.raises(HFFolderError, match="shared_expert_intermediate_size"):
        llm_config_from_hf({**base, "shared_expert_intermediate_size": 0}, 97)


# The trainer's tiny config (train_fixtures.write_config: dim 32, 2 layers, 4 heads, 2 KV heads, ffn 64)
# shaped as a Qwen2-MoE: every layer MoE, 4 experts top-2, a gated shared expert, Qwen2-MoE's defaults.
MOE_LLM = (
    "qkv_bias = true\nnorm_eps = 1e-6\nmoe = { experts = 4, top_k = 2, shared_experts = 1, expert_ffn_dim = 16, "
    "shared_expert_ffn_dim = 24, shared_gate = true, norm_topk_prob = false, aux_loss_coef = 0.001, "
    "z_loss_coef = 0.0 }"
)
EXPERTS = ("gate_up_proj", "down_proj")


def _forward(stage, ids: torch.Tensor) -> torch.Tensor:
    """``stage``'s logits ``[T, vocab]`` of one document ``ids`` (collective under EP: every rank the same
    ``ids``); the forward's MoE load statistics are dropped, so they never reach a step's metrics."""
    from omni_train.models.llm import MoEFeedForward

    with torch.no_grad():
        logits = stage(ids, torch.arange(ids.numel()), torch.tensor([0, ids.numel()]))
    for m in stage.modules():
        if isinstance(m, MoEFeedForward):
            m.stats.clear()
    return logits


def _ep2_import_then_train(rank, world_size, run, ids, ref, whole):
    """The trainer at ep = 2 (dp = 2) resumes the imported step 0: each rank's experts are the ``Shard(0)``
    rows of the Hugging Face experts it holds and the EP forward equals ``transformers``; then it trains
    2 steps and saves step 2 (the experts as one box per EP rank). Rank 0 returns the trained logits."""
    from torch.distributed.tensor import DTensor, Shard

    from omni_train.binder import load_config
    from omni_train.trainer import Trainer

    trainer = Trainer(load_config(f"{run}.toml"), Path(run), resume=True)
    assert trainer.checkpoint.restore() == 0
    stage = trainer.model["llm"].chunks[0]
    sharded = 0
    for name, p in stage.named_parameters():
        if name.rsplit(".", 1)[-1] in EXPERTS:
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
            rows = whole[name].shape[0] // world_size
            assert torch.equal(p.to_local(), whole[name][rank * rows : (rank + 1) * rows]), name
            sharded += 1
        else:
            assert torch.equal(p.detach(), whole[name]), name
    assert sharded == 2 * len(stage.layers)
    torch.testing.assert_close(_forward(stage, ids), ref, rtol=0, atol=TOL)
    trainer.run()
    trained = _forward(stage, ids)
    return trained if rank == 0 else None


@pytest.mark.slow
def test_qwen2_moe_import_into_ep2_trainer_and_export_of_its_checkpoint(tmp_path):
    """``omni-train import-hf`` of a ``Qwen2MoeForCausalLM`` folder -> the trainer at ep = 2 on 2 gloo
    processes loads step 0 by box intersection (each rank its experts) and its EP forward equals
    ``transformers`` (float32, 1e-5) -> 2 trained steps, checkpoint saved at ep = 2 -> ``export-hf``
    gathers the experts into the per-expert layout -> ``from_pretrained`` equals the ep = 2 forward."""
    from tokenizers import Tokenizer
    from train_fixtures import make_dataset, write_config
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from omni_ckpt import read_manifest
    from omni_parallel.testing import run_world
    from omni_train.binder import load_config
    from omni_train.cli import main

    data = make_dataset(tmp_path / "data", n_image=4, n_audio=2, n_text=8)
    run = tmp_path / "run"
    toml = write_config(
        Path(f"{run}.toml"), data, steps=2, every=2, pp=1, model={"llm": MOE_LLM}, parallel="dp = 2\nep = 2"
    )
    vocab = Tokenizer.from_file(data["tokenizer"]).get_vocab_size()
    torch.manual_seed(0)
    hf_config = Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, initializer_range=0.1, rms_norm_eps=1e-6,
    )  # fmt: skip
    hf_model = _perturbed(Qwen2MoeForCausalLM(hf_config))
    hf_model.save_pretrained(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "--config", str(toml), "--out", str(run)]) == 0

    ids = torch.randint(0, vocab, (13,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(input_ids=ids[None]).logits[0]
    assert ref.std() > 0.1
    cfg = load_config(str(toml)).model.llm_config(vocab)
    whole = LlamaAdapter(cfg).from_hf(read_weights(tmp_path / "hf"))
    trained = run_world(_ep2_import_then_train, 2, args=(str(run), ids, ref, whole), timeout_s=300)[0]
    assert (trained - ref).abs().max() > 1e-3  # the export below is of the trained weights

    step2 = run / "checkpoints" / "step-00000002"
    boxes = read_manifest(str(step2))["tensors"]
    for i in range(2):  # saved at ep = 2: each EP rank wrote its experts
        for kind in EXPERTS:
            assert len(boxes[f"model.llm.layers.{i}.mlp.moe.experts.{kind}"][2]) == 2
    assert main(["export-hf", str(run), str(tmp_path / "out")]) == 0
    loaded = Qwen2MoeForCausalLM.from_pretrained(tmp_path / "out" / "llm").eval()
    assert loaded.config.num_experts == 4 and "model.layers.1.mlp.experts.3.up_proj.weight" in read_weights(
        tmp_path / "out" / "llm"
    )
    with torch.no_grad():
        exported = loaded(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(exported, trained, rtol=0, atol=TOL)
