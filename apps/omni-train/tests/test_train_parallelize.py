"""``omni_parallel.parallelize`` over the app's model (``omni_train.parallelize.family_blocks``): activation checkpointing and ``torch.compile`` per block leave the model's
numbers and names unchanged (float64, against the same model without them), checkpointing keeps fewer
activations, compiled blocks compile once whatever the pack length; the trainer's encoder transfers have a group of
their own, so it computes the same on a backend that ignores P2P tags."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounter
from train_fixtures import make_dataset, write_config

from omni_parallel.parallelize import apply_ac, apply_compile
from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.config import RECOMPUTE
from omni_train.encoders import Encoders
from omni_train.models import AudioConfig, LLMConfig, LLMStage, ViTConfig
from omni_train.parallelize import family_blocks

D = torch.float64
CFG = LLMConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=24)


def _model() -> tuple[LLMStage, Encoders]:
    vit = ViTConfig(dim=16, n_layers=1, n_heads=2)
    audio = AudioConfig(dim=16, n_layers=1, n_heads=2, n_mels=16)
    return LLMStage(CFG, 0, 1, seed=2).to(D), Encoders(vit, audio, CFG.dim, seed=2).to(D)


def _pack(lengths: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return ids, pos, cu


def _step(stage: LLMStage, lengths: list[int], seed: int):
    """Logits, every gradient, and the elements autograd saved outside any checkpointed region."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel()
        return t

    stage.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(*_pack(lengths, seed))
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=D)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in stage.named_parameters()}, saved[0]


def test_activation_checkpointing_is_exact_keeps_names_and_saves_less():
    plain, _ = _model()
    ac, encoders = _model()
    names = [n for n, _ in ac.named_parameters()]
    apply_ac(family_blocks(ac, encoders, ["llm", "image"]))
    assert [n for n, _ in ac.named_parameters()] == names
    out, grads, saved = _step(plain, [5, 9, 2], 0)
    out_ac, grads_ac, saved_ac = _step(ac, [5, 9, 2], 0)
    torch.testing.assert_close(out_ac, out, rtol=0, atol=0)
    for n, g in grads.items():
        torch.testing.assert_close(grads_ac[n], g, rtol=0, atol=0, msg=n)
    assert saved_ac < saved / 2, (saved_ac, saved)


def test_compiled_blocks_match_eager_and_compile_once_for_every_pack_length():
    eager, _ = _model()
    compiled, encoders = _model()
    counter = CompileCounter()
    apply_compile(family_blocks(compiled, encoders, RECOMPUTE), backend=counter)
    seen = []
    # the first pack's cu_seqlens has 4 entries, as many as the RoPE table's columns (head_dim / 2): with
    # duck sizing dynamo gave both one symbol and compiled every block again for the next pack
    assert CFG.head_dim // 2 == 4
    for seed, lengths in enumerate(([5, 5, 7], [13], [4, 6])):
        out, grads, _ = _step(eager, lengths, seed)
        out_c, grads_c, _ = _step(compiled, lengths, seed)
        torch.testing.assert_close(out_c, out, rtol=0, atol=1e-12)
        for n, g in grads.items():
            torch.testing.assert_close(grads_c[n], g, rtol=0, atol=1e-12, msg=n)
        seen.append(counter.frame_count)
    assert seen[0] > 0 and seen == [seen[0]] * 3, seen  # no recompilation for a new pack length
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]


def _train_tag_blind(rank: int, world_size: int, cfg, root: str):
    """The same run twice: as is, then with every isend/irecv tagged 0, as NCCL (which ignores P2P tags)
    would match them: in posting order per pair of ranks and group."""
    from omni_train.trainer import Trainer

    isend, irecv = dist.isend, dist.irecv
    out = []
    for name in ("tags", "tag-blind"):
        if name == "tag-blind":
            dist.isend = lambda tensor, dst, group=None, tag=0: isend(tensor, dst, group=group, tag=0)
            dist.irecv = lambda tensor, src, group=None, tag=0: irecv(tensor, src, group=group, tag=0)
        trainer = Trainer(cfg, Path(root) / name, resume=False)
        trainer.run()
        rows = (Path(root) / name / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
        pp, enc = trainer.groups.pp, trainer.groups.encoder_p2p
        ranks = (dist.get_process_group_ranks(pp), dist.get_process_group_ranks(enc), enc is not pp)
        out.append(([json.loads(r)["loss"] for r in rows], ranks))
    return out


def test_trainer_encoder_transfers_do_not_rely_on_tags(tmp_path):
    """The trainer gives encoder transfers their own group over the pp ranks, in pp order, so a run whose
    P2P ignores tags computes the same losses (on a shared group it mismatches messages and aborts)."""
    data = make_dataset(tmp_path / "data", n_image=8, n_audio=4, n_text=8)
    cfg = load_config(str(write_config(tmp_path / "c.toml", data, steps=2, every=0)))
    results = run_world(_train_tag_blind, 2, args=(cfg, str(tmp_path / "runs")), timeout_s=300)
    (tags, _), (blind, _) = results[0]
    assert len(tags) == 2 and blind == tags
    for rank_results in results:
        for _, (pp, enc, own) in rank_results:
            assert own and enc == pp == [0, 1]
