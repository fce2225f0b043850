"""The trainer's models on a device other than the CPU.

* On the CPU (every run): each model's forward keeps its tensors on its inputs' device. Checked on the
  ``meta`` device, where mixing in a CPU tensor (RoPE angles built from CPU positions, as the ViT and the
  audio encoder did) raises exactly as it would on a GPU.
* Marked ``cuda`` (skipped with the reason without a GPU): compiled blocks in bfloat16 on CUDA, running
  the fused varlen kernel, match eager and compile once for every pack length.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from omni_parallel.parallelize import apply_compile
from omni_train.config import RECOMPUTE
from omni_train.encoders import Encoders
from omni_train.models import AudioConfig, LLMConfig, LLMStage, ViTConfig
from omni_train.models.audio import AudioEncoder
from omni_train.models.vit import VisionTransformer
from omni_train.parallelize import family_blocks


def test_models_keep_their_tensors_on_the_inputs_device():
    meta = torch.device("meta")
    vit = VisionTransformer(ViTConfig(dim=16, n_layers=1, n_heads=2)).to(meta)
    grids = torch.tensor(
        [[4, 4], [2, 6]]
    )  # grids and boundaries stay on the host, as the trainer passes them
    out = vit(torch.zeros(28, 3 * 14 * 14, device=meta), grids)
    assert out.device == meta and out.shape == (7, 64)
    audio = AudioEncoder(AudioConfig(dim=16, n_layers=1, n_heads=2, n_mels=16)).to(meta)
    out = audio(torch.zeros(30, 16, device=meta), torch.tensor([10, 20]))
    assert out.device == meta and out.shape == (8, 16)
    llm = LLMStage(LLMConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)).to(meta)
    out = llm(
        torch.zeros(10, dtype=torch.int64, device=meta),
        torch.arange(10, device=meta),
        torch.tensor([0, 4, 10]),
    )
    assert out.device == meta and out.shape == (10, 50)


def _pack(lengths: list[int], vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return ids.cuda(), pos.cuda(), cu  # boundaries on the host: no stream sync in attention


@pytest.mark.cuda
def test_compiled_bf16_blocks_on_cuda_match_eager_and_compile_once_per_block():
    cfg = LLMConfig(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256)
    eager = LLMStage(cfg, seed=3).to("cuda", torch.bfloat16)
    compiled = LLMStage(cfg, seed=3).to("cuda", torch.bfloat16)
    counter = CompileCounterWithBackend("inductor")
    apply_compile(family_blocks(compiled, Encoders(None, None, cfg.dim, seed=3), RECOMPUTE), backend=counter)
    frames = []
    for seed, lengths in enumerate(([40, 24], [300], [7, 129, 64, 33])):
        outs = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            logits = model(*_pack(lengths, cfg.vocab_size, seed))
            logits.float().square().mean().backward()
            outs.append((logits.float(), {n: p.grad.float() for n, p in model.named_parameters()}))
        (got, got_grads), (want, want_grads) = outs[1], outs[0]
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
        for n, g in want_grads.items():
            assert (got_grads[n] - g).abs().max() <= 5e-2 * g.abs().max() + 1e-3, n
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames == [frames[0]] * 3, frames  # no recompilation for a new pack length
