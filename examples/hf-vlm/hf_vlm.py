"""A Hugging Face VLM (Qwen2-VL vision tower + Qwen2 LLM from configs, random weights) trained through the
OmniScale packages alone: omni-data's zero-redundancy loader, omni-pipeline's executor with grouped
reordering across DP and `planned` placement, omni-parallel's groups, gradient sums and clipping, omni-ckpt.

    torchrun --nproc-per-node 4 examples/hf-vlm/hf_vlm.py DATA OUT --pp 2 --steps 4 --save-at 2
    torchrun --nproc-per-node 2 examples/hf-vlm/hf_vlm.py DATA OUT --pp 1 --steps 4 --resume 2
"""

import argparse
import glob

import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

import omni_ckpt as ckpt
import omni_data as od
import omni_parallel as par
import omni_pipeline as pipe

PATCH, MERGE, MICROBATCHES, SEQ = 4, 2, 2, 64
LLM = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
)
VIT = dict(depth=1, embed_dim=16, num_heads=2, mlp_ratio=2, patch_size=PATCH, spatial_merge_size=MERGE)


class VisionTower(nn.Module):
    """HF's Qwen2-VL ViT and patch merger: `(patches, grid_thw) -> [merged tokens, LLM hidden]`."""

    def __init__(self) -> None:
        super().__init__()
        cfg = Qwen2VLVisionConfig(hidden_size=LLM["hidden_size"], **VIT)
        self.vit = Qwen2VisionTransformerPretrainedModel(cfg)

    def forward(self, patches, grid_thw):
        return self.vit(patches, grid_thw).pooler_output


def build_model(vocab, pp_rank, pp):
    """This pipeline rank's LLM stage and the towers; the same weights on every rank and layout."""
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, **LLM)).double()
    towers = {"image": VisionTower().double()}
    inputs = {"image": lambda ps: pipe.image_patches(ps, patch=PATCH, merge=MERGE, temporal_patch=2)}
    split = pipe.stage_slices(LLM["num_hidden_layers"], pp)
    encoders = pipe.ModalityRouter(towers, inputs, LLM["hidden_size"])
    return pipe.DecoderStage.from_causal_lm(lm, split[pp_rank]), encoders, split


def build_loader(data, tok, dp_rank, dp, slices, consumes, read_text, dp_group=None):
    """Image + text shards under `data`, packed, split over DP, read only where `consumes` says."""
    common = dict(tokenizer=tok, rank=dp_rank, world_size=dp, shuffle_shards=True, seed=0, epochs=None)
    image = dict(image_tokens=od.ImageTokens(PATCH, MERGE, 64, 576), encoder_cost=od.EncoderCost(16, 1))
    sources = {
        name: od.WebDatasetSource(sorted(glob.glob(f"{data}/{name}-*.tar")), modality=name, name=name, **kw)
        for name, kw in (("image", {**common, **image}), ("text", common))
    }
    mixture = od.MixtureStream(sources, od.MixtureSchedule([(0, {"image": 0.6, "text": 0.4})]))
    packer = od.HybridPacker(mixture, SEQ, 8)
    loader = od.PackedLoader(packer, MICROBATCHES, mixture=mixture, dp_group=dp_group)
    reader = od.PayloadReader(tok)
    options = dict(microbatches=MICROBATCHES, slices=slices, reader=reader, read_text=read_text)
    return od.ZeroRedundancyFilter(loader, consumes, **options)


def train(data, out, *, pp, steps, save_at=None, resume=None, microbatches=MICROBATCHES, **hooks):
    """Train on this world (every rank calls it); returns the global loss of each step it ran. Hooks: `stream`
    (a loader in place of this rank's own), `on_step(step, model, inputs)` (gradients summed, not clipped)."""
    # reorder: a node's replicas; encoder_sync: the encoders' reductions' own group
    spec = par.GroupSpec(encoder_p2p=True, reorder_group_size=None, checkpoint=True, encoder_sync=True)
    ps = par.ParallelState.build(par.ParallelConfig(pp=pp), groups=spec)
    pp_rank, dp_rank, dp = ps.local_rank("pp"), ps.local_rank("dp"), ps.size("dp")
    pp_group, dp_group = ps.group("pp") if pp > 1 else None, ps.group("dp") if dp > 1 else None
    tok = Tokenizer.from_file(f"{data}/tokenizer.json")
    image_id, text_rank = tok.get_vocab_size(), pp_rank in (0, pp - 1)  # placeholder: past the text ids
    stage, encoders, split = build_model(image_id + 1, pp_rank, pp)
    model = nn.ModuleDict({"llm": stage, "encoders": encoders})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = pipe.build_schedule("1f1b", pp, microbatches)
    shape = pipe.LLMShape(*LLM.values(), image_id + 1)  # LLM lists the sizes in LLMShape's order
    weights = pipe.stage_weights(shape, split, SEQ)
    ids = od.encoder_microbatch_ids(microbatches, pp)
    flow = pipe.static_flow("planned", schedule, ids, weights, encoder_forward_share=0.5)
    consumes = set(flow.encoders_on(pp_rank))  # zero redundancy: read only what this rank encodes
    stream = hooks.get("stream") or build_loader(data, tok, dp_rank, dp, pp, consumes, text_rank, dp_group)
    builder = pipe.StepBuilder(
        pipe.StepSpec(
            {od.Modality.IMAGE: image_id}, LLM["hidden_size"], torch.float64, builds_text=text_rank
        ),
        schedule=schedule,
        flow=flow,
        encoders=encoders,
        pp_group=pp_group,
        dp_group=dp_group,
        parallel=pipe.EncoderParallel(pipe.SequenceLayout(), reorder_group=ps.reorder_group),
    )
    # the step's objective is a plain sum over ranks: LLM gradients summed over DP, encoders over all
    sync_llm, sync_encoders = par.apply_dp([stage], ps), par.apply_encoder_zero(encoders, encoders.towers, ps)
    groups = pipe.PipelineGroups.from_state(ps)
    anchor, reduce = pipe.EncoderAnchor(dict(encoders.towers)), lambda: sync_llm() or sync_encoders()
    executor = pipe.PipelineExecutor({pp_rank: stage}, anchor, None, groups, reduce_gradients=reduce)
    manager = ckpt.CheckpointManager(out, process_group=ps.checkpoint_group)  # save(): staged on return

    def state():
        return {"model": model.state_dict(), "optim": ckpt.portable_optimizer_state_dict(model, optimizer)}

    if resume is not None:
        manager.load(resume, loaded := state())
        ckpt.load_portable_optimizer_state_dict(model, optimizer, loaded["optim"])
        stream.reset(ckpt.load_object_rows(manager.step_url(resume), "loader", [(dp_rank,)])[0])
    else:
        stream.reset()
    losses = []
    for step in range(resume or 0, steps):
        optimizer.zero_grad(set_to_none=True)
        sync_encoders.attach()
        inputs = builder.build(next(stream))
        result = executor.step(inputs.plan, inputs.encoder_work, functions=builder.functions(inputs))
        if "on_step" in hooks:
            hooks["on_step"](step, model, inputs)
        par.clip_grad_norm_(stage.parameters(), encoders.parameters(), 0.5, pp_group)
        optimizer.step()
        loss = torch.tensor([result.loss], dtype=torch.float64)
        if dp_group is not None:  # each replica's loss is its share of the global objective
            dist.all_reduce(loss, group=dp_group)
        losses.append(float(loss))
        if step + 1 == save_at:
            loader = ckpt.object_rows(stream.state_dict(), (dp_rank,), (dp,))
            manager.save(step + 1, {**state(), "loader": loader})
    manager.close()
    stream.close()
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("data", help="folder with image-*.tar, text-*.tar and tokenizer.json")
    parser.add_argument("out", help="checkpoint folder")
    for flag, default in (("--pp", 2), ("--steps", 4), ("--save-at", None), ("--resume", None)):
        parser.add_argument(flag, type=int, default=default)
    a = parser.parse_args()
    dist.init_process_group("gloo")
    losses = train(a.data, a.out, pp=a.pp, steps=a.steps, save_at=a.save_at, resume=a.resume)
    if dist.get_rank() == 0:
        print("losses", losses)
    dist.destroy_process_group()
