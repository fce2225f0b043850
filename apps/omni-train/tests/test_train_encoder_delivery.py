"""Encoder-output delivery (``omni_pipeline.EncoderParallel``) over the app's encoders, 2 gloo ranks as the
LLM's sequence group, against one float64 process encoding every image whole.

Long-short SP: the long image (6 merged tokens > threshold 3) is split over both ranks (Ulysses attention
inside the ViT, each chunk with its own 2-D RoPE rows and columns), the short ones go whole to one rank.
Then the rows reach the LLM layout through ``reshard_to_llm``: Ulysses (contiguous chunks, one
all-to-all) and CP (head-tail chunks per document, the reused zero buffer and one all-reduce, Figure 12).
Each rank must get exactly the media rows of its LLM-local slots, and the encoder gradients summed over
the ranks must equal the one-process gradients (loss: a fixed weight per pack position). The default
reordering group (the DP replicas on one node) is tested in omni-parallel's
``test_parallel_state_groups.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_data import Modality, Pack, SampleMeta
from omni_data.payload import Payload
from omni_data.zero_redundancy import FilteredStep
from omni_parallel import ReshardMode
from omni_parallel.testing import run_world
from omni_pipeline import EncoderParallel, SequenceLayout
from omni_train.encoders import Encoders
from omni_train.models import ViTConfig

VIT = ViTConfig(dim=16, n_layers=2, n_heads=2, min_pixels=28 * 28, max_pixels=112 * 112)
DIM = 12
# (height, width) px of each image sample (None: a text sample), in pack order
LAYOUT = [(28, 56), None, (56, 84), (28, 28), None, (56, 28)]


def _step() -> tuple[FilteredStep, list[Payload]]:
    samples, payloads, g = [], [], torch.Generator().manual_seed(3)
    for i, hw in enumerate(LAYOUT):
        if hw is None:
            samples.append(SampleMeta(f"t{i}", "text", Modality.TEXT, 0, 5 + i, 0.0, (5 + i,)))
            continue
        tokens = (hw[0] // 28) * (hw[1] // 28)
        meta = SampleMeta(f"i{i}", "img", Modality.IMAGE, tokens, 3, 10.0 * tokens**1.5, (3, *hw))
        samples.append(meta)
        payloads.append(Payload(meta, pixels=torch.rand((3, *hw), generator=g)))
    pack = Pack(samples, 128)
    items = [(0, i) for i, hw in enumerate(LAYOUT) if hw is not None]
    return FilteredStep(0, [pack], {1: items}, {1: payloads}, []), payloads


def _weights(n: int) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


def _reference():
    fs, payloads = _step()
    pack = fs.packs[0]
    enc = Encoders(VIT, None, DIM, seed=4).double()
    out = enc(payloads)
    pos = torch.tensor([sp.start + t for sp in pack.spans for t in range(sp.length)])
    full = torch.zeros(pack.num_tokens, DIM, dtype=torch.float64).index_copy(0, pos, out)
    (full * _weights(pack.num_tokens)).sum().backward()
    return full.detach(), {n: p.grad for n, p in enc.named_parameters()}


def _world(rank: int, world_size: int, mode: str):
    fs, _ = _step()
    pack = fs.packs[0]
    layout = SequenceLayout(ReshardMode(mode), world_size)
    par = EncoderParallel(layout, sp_group=dist.group.WORLD, sp_rank=rank, encoder_sp=2, long_threshold=3)
    work = par.plan(fs, 1, 0)
    enc = Encoders(VIT, None, DIM, seed=4).double()
    rows = par.encode(enc, work, torch.float64)
    src = layout.sources(pack)[rank]
    global_pos = torch.tensor([src[s] for s in work.slots])
    (rows * _weights(pack.num_tokens)[global_pos]).sum().backward()
    grads = {}
    for n, p in enc.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[n] = g
    return rows.detach(), global_pos, grads, [len(w) for w in (work.long, work.short)]


@pytest.mark.parametrize("mode", ["ulysses", "cp"])
def test_long_short_sp_then_reshard_matches_one_process(mode):
    full, ref_grads = _reference()
    results = run_world(_world, 2, args=(mode,), timeout_s=240)
    seen = []
    for rank, (rows, pos, grads, (n_long, _)) in enumerate(results):
        assert n_long == 1, f"rank {rank}: the 6-token image must be long, split over both ranks"
        torch.testing.assert_close(rows, full[pos], rtol=0, atol=1e-10, msg=f"rank {rank} rows")
        seen += pos.tolist()
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=0, atol=1e-10, msg=f"rank {rank}: {n}")
    fs, _ = _step()
    media = sorted(sp.start + t for sp in fs.packs[0].spans for t in range(sp.length))
    assert sorted(seen) == media  # every media row delivered to exactly one LLM rank
