"""``omni_parallel.activation_memory`` and the recompute/offload steps of ``omni_parallel.parallelize`` on the
app's model (its blocks by family: ``omni_train.parallelize.family_blocks``).

Reference for the measurement: the autograd graph itself. After a forward, every tensor autograd holds
for backward is an attribute ``_saved_*`` of some node of the graph; their distinct storages (parameters
excluded) summed are what :class:`ActivationMemory` must report as the peak (nothing is freed before
backward). Selective recompute and offload are checked, in float64, to give bit-identical outputs and
gradients, and to move or drop exactly the bytes they claim to.
"""

from __future__ import annotations

import torch

from omni_parallel.activation_memory import ActivationMemory
from omni_parallel.parallelize import apply_ac, apply_offload
from omni_parallel.testing import graph_saved_bytes
from omni_train.encoders import Encoders
from omni_train.models import AudioConfig, LLMConfig, LLMStage, ViTConfig
from omni_train.parallelize import BRANCHES, family_blocks

D = torch.float64
CFG = LLMConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=24)
LENGTHS = [5, 9, 2]


def _model() -> tuple[LLMStage, Encoders]:
    vit = ViTConfig(dim=16, n_layers=1, n_heads=2)
    audio = AudioConfig(dim=16, n_layers=1, n_heads=2, n_mels=16)
    return LLMStage(CFG, 0, 1, seed=2).to(D), Encoders(vit, audio, CFG.dim, seed=2).to(D)


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (sum(LENGTHS),), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return ids, pos, cu


def _step(stage: LLMStage, memory: ActivationMemory, *, walk_graph: bool = False):
    """Forward under ``memory.track()``, the graph's own count (``walk_graph``: reading a checkpointed
    node's saved tensors would recompute it), backward; logits and every gradient."""
    stage.zero_grad(set_to_none=True)
    memory.start_step()
    with memory.track():
        out = stage(*_inputs())
        loss = (out * torch.linspace(-1, 1, out.shape[-1], dtype=D)).sum()
        in_graph = graph_saved_bytes(loss, list(stage.parameters())) if walk_graph else None
        peaks = memory.peaks()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    return out.detach(), grads, in_graph, peaks


def test_peak_equals_what_the_autograd_graph_saved_and_is_released_by_backward():
    stage, _ = _model()
    memory = ActivationMemory([stage], torch.device("cpu"))
    _, _, in_graph, peaks = _step(stage, memory, walk_graph=True)
    assert in_graph > 0 and peaks.activation_bytes == in_graph
    assert peaks.offloaded_bytes == 0 and peaks.allocated_bytes is None
    memory.start_step()  # everything saved was freed by backward: nothing is live any more
    assert memory.peaks().activation_bytes == 0

    # one storage saved three times (x * x saves x twice, a view of x once) counts once
    x = torch.randn(1000, dtype=D, requires_grad=True)
    memory.start_step()
    with memory.track():
        y = (x * x).sum() + x.view(10, 100).sin().sum()
    assert memory.peaks().activation_bytes == 8000 == graph_saved_bytes(y, [])


def test_selective_recompute_and_offload_are_exact_and_move_the_bytes_they_claim():
    plain, _ = _model()
    out, grads, _, plain_peaks = _step(plain, ActivationMemory([plain], torch.device("cpu")))
    saved = plain_peaks.activation_bytes
    results = {}
    for name, modules, offload in (
        ("block", (), False),
        ("attention", ("attention",), False),
        ("mlp", ("mlp",), False),
        ("attention+offload", ("attention",), True),
        ("offload", None, True),
    ):
        stage, encoders = _model()
        names = [n for n, _ in stage.named_parameters()]
        memory = ActivationMemory([stage, encoders], torch.device("cpu"))
        if modules is not None:
            apply_ac(family_blocks(stage, encoders, ["llm", "image"]), [BRANCHES[m] for m in modules])
        if offload:
            apply_offload(family_blocks(stage, encoders, ["llm", "audio"]), memory)
        assert [n for n, _ in stage.named_parameters()] == names
        out_x, grads_x, _, peaks = _step(stage, memory)
        torch.testing.assert_close(out_x, out, rtol=0, atol=0, msg=name)
        for n, g in grads.items():
            torch.testing.assert_close(grads_x[n], g, rtol=0, atol=0, msg=f"{name}: {n}")
        results[name] = peaks
    kept = {k: p.activation_bytes for k, p in results.items()}
    # whole blocks keep least; each branch alone keeps less than nothing recomputed, more than blocks
    assert kept["block"] < kept["attention"] < saved and kept["block"] < kept["mlp"] < saved, (kept, saved)
    assert kept["attention"] + kept["mlp"] < saved + kept["block"] * 2
    # offload: block activations leave the kept count (on CPU, uncopied: the same bytes, now offloaded)
    off = results["offload"]
    assert off.offloaded_bytes > 0 and off.activation_bytes < saved / 2
    assert off.activation_bytes + off.offloaded_bytes >= saved
    both = results["attention+offload"]
    assert both.offloaded_bytes < off.offloaded_bytes and both.activation_bytes == off.activation_bytes


def test_encoder_blocks_recompute_and_offload_exactly():
    _, plain = _model()
    _, ac = _model()
    stage, _ = _model()
    memory = ActivationMemory([ac], torch.device("cpu"))
    apply_ac(family_blocks(stage, ac, ["image", "audio"]), ["attention_branch", "mlp_branch"])
    apply_offload(family_blocks(stage, ac, ["image", "audio"]), memory)
    g = torch.Generator().manual_seed(3)
    patches = torch.randn(32, 3 * 14 * 14, dtype=D, generator=g)
    grids = torch.tensor([[4, 4], [2, 8]])
    outs = []
    for enc in (plain, ac):
        tower = enc.towers["image"]
        memory.start_step()
        with memory.track():
            y = tower(patches, grids)
            y.pow(2).sum().backward()
        outs.append((y.detach(), {n: p.grad.clone() for n, p in tower.named_parameters()}))
    assert memory.peaks().offloaded_bytes > 0
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
    for n, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][n], grad, rtol=0, atol=0, msg=n)
