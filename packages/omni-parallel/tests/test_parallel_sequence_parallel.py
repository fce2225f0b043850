"""Megatron sequence parallelism (``llama_tp_plan(sequence_dim=0)`` + ``sequence_parallel_plan``) on 2 gloo
processes against one float64 process: a small model (embedding, two pre-norm blocks, final norm, LM head)
over packed ``[T, dim]`` tokens; loss and every gradient equal (<= 1e-10) once the norms' partial weight
gradients are summed over TP (``reduce_partial_gradients``), and the hidden states between blocks hold
``T / tp`` tokens per rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from parallel_blocks import blocks
from torch import nn
from torch.distributed.tensor import DTensor

from omni_parallel import ParallelConfig, ParallelState
from omni_parallel.tensor_parallel import (
    apply_tensor_parallel,
    llama_tp_plan,
    reduce_partial_gradients,
    sequence_parallel_plan,
)
from omni_parallel.testing import run_world

VOCAB, DIM, T = 11, 16, 12


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.tok = nn.Embedding(VOCAB, DIM)
        self.embedded = nn.Identity()  # where the embedded sequence becomes the rank's shard
        self.layers = blocks(2)
        self.norm, self.output = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            for m in (self.tok, self.norm, self.output):
                for p in m.parameters():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3 + (p.dim() == 1))
        self.to(torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(self.layers(self.embedded(self.tok(ids)))))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (T,), generator=g), torch.randint(0, VOCAB, (T,), generator=g)


def _is_partial(g: torch.Tensor) -> bool:
    return isinstance(g, DTensor) and any(x.is_partial() for x in g.placements)


def _sp_world(rank, world_size, reduce):
    ps = ParallelState.build(ParallelConfig(tp=world_size, pp=1))
    ids, labels = _data()
    ref = _Model()
    ref_loss = F.cross_entropy(ref(ids), labels, reduction="sum")
    ref_loss.backward()

    model = _Model()
    mesh = ps.device_mesh("tp")
    for block in model.layers:
        apply_tensor_parallel(block, mesh, llama_tp_plan(sequence_dim=0))
    ends = sequence_parallel_plan(embeddings="embedded", norm="norm", output="output")
    apply_tensor_parallel(model, mesh, ends)
    shapes = []
    model.layers[0].register_forward_hook(lambda m, i, o: shapes.append((tuple(i[0].shape), tuple(o.shape))))
    loss = F.cross_entropy(model(ids), labels, reduction="sum")
    loss.backward()
    partial = sorted(n for n, p in model.named_parameters() if _is_partial(p.grad))
    if reduce:
        reduce_partial_gradients(model.parameters())
    diffs = {"loss": abs(loss.item() - ref_loss.item())}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad  # a partial gradient counts as this rank's own part; the embedding and head are plain
        whole = g.to_local() if _is_partial(g) else g.full_tensor() if isinstance(g, DTensor) else g
        diffs[name] = (whole - ref_params[name].grad).abs().max().item()
    return diffs, shapes, partial


def test_sequence_parallel_matches_one_process():
    results = run_world(_sp_world, 2, args=(True,), timeout_s=180)
    for diffs, shapes, partial in results:
        assert shapes == [((T // 2, DIM), (T // 2, DIM))]  # block input and output: this rank's T/2 tokens
        # every norm's weight and bias gradient is a partial sum before the reduction
        assert partial == sorted(
            f"{m}.{w}"
            for m in ("layers.0.attention_norm", "layers.0.ffn_norm", "layers.1.attention_norm",
                      "layers.1.ffn_norm", "norm")
            for w in ("weight", "bias")
        )  # fmt: skip
        for name, d in diffs.items():
            assert d <= 1e-10, (name, d)
