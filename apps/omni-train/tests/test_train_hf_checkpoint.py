"""``import-hf`` / ``export-hf`` through omni-ckpt, any layout: Hugging Face folders built by ``transformers``
-> step 0 of a run -> loaded by a pp=2 and a tp=2 trainer layout (gloo, 2 processes) -> the same tensors
and ``transformers``' logits; checkpoints saved by those layouts export to the same folders as step 0; a
run resumed from an imported step 0 trains exactly like a fresh run (fresh optimizer and loader)."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from train_fixtures import make_dataset, write_config

from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.cli import main

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

# The tiny test config, shaped as the Hugging Face architectures (Qwen2 LLM, Qwen2-VL vision, Whisper).
HF_MODEL = {
    "llm": "qkv_bias = true\nnorm_eps = 1e-6",
    "vit": 'patch_bias = false\nnorm_eps = 1e-6\nact = "quick_gelu"\nprojector_norm = false\nprojector_hidden = 64',
    "audio": 'stem = "whisper"\npositions = "sinusoidal"\nsubsample = 2\nmel_scale = "slaney"\nmax_positions = 64',
}
TOL = 1e-5


def _hf_folders(root: Path, vocab: int) -> dict[str, Path]:
    """Random-init Qwen2 (tied head), Qwen2-VL vision tower and Whisper encoder of the test config's sizes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2VLVisionConfig, WhisperConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(0)
    models = {
        "llm": Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=vocab,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                rms_norm_eps=1e-6,
                tie_word_embeddings=True,
                initializer_range=0.1,
            )
        ),
        "vision": Qwen2VisionTransformerPretrainedModel(
            Qwen2VLVisionConfig(depth=1, embed_dim=16, hidden_size=32, num_heads=2, initializer_range=0.1)
        ),
        "audio": WhisperEncoder(
            WhisperConfig(
                d_model=16,
                encoder_layers=1,
                encoder_attention_heads=2,
                encoder_ffn_dim=64,
                num_mel_bins=16,
                max_source_positions=64,
            )
        ),
    }
    with torch.no_grad():  # non-trivial Q/K/V biases (Qwen2 initialises them to zero)
        for p in models["llm"].parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    folders = {}
    for family, model in models.items():
        model.save_pretrained(root / family)
        folders[family] = root / family
    return folders


def _hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import Qwen2ForCausalLM

    with torch.no_grad():
        return Qwen2ForCausalLM.from_pretrained(folder).eval()(input_ids=ids[None]).logits[0]


def _layouts(rank, world_size, cfg, run, ids, ref_logits, saves):
    """pp=2 and tp=2 load step 0 by box intersection: same tensors as pp=1, transformers' logits; then
    each layout saves the model as step 1 of its own run directory (collectively)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from omni_ckpt import load, save
    from omni_parallel.tensor_parallel import apply_tensor_parallel, llama_tp_plan
    from omni_train.encoders import Encoders
    from omni_train.hf import build_model
    from omni_train.models import LLMStage

    step0 = f"{run}/checkpoints/step-00000000"
    whole = build_model(cfg, ref_logits.shape[1])
    load({"model": whole.state_dict()}, step0, process_group=None)
    whole_sd = whole.state_dict()
    m, llm_cfg = cfg.model, cfg.model.llm_config(ref_logits.shape[1])
    pos, cu = torch.arange(ids.numel()), torch.tensor([0, ids.numel()])

    # pp = 2: each rank holds one stage
    stage = LLMStage(llm_cfg, rank, 2, seed=m.seed)
    model = torch.nn.ModuleDict({"llm": stage, "encoders": Encoders(m.vit, m.audio, m.llm.dim, seed=m.seed)})
    load({"model": model.state_dict()}, step0)
    for name, t in model.state_dict().items():
        assert torch.equal(t, whole_sd[name]), name
    with torch.no_grad():
        if rank == 0:
            torch.distributed.send(stage(ids, pos, cu), dst=1)
        else:
            h = torch.empty(ids.numel(), m.llm.dim)
            torch.distributed.recv(h, src=0)
            torch.testing.assert_close(stage(h, pos, cu), ref_logits, rtol=0, atol=TOL)
    save({"model": model.state_dict()}, f"{saves}/pp2/checkpoints/step-00000001")

    # the trainer itself (pp=2): `--resume` of step 0 loads these weights, not its seeded ones
    from omni_train.trainer import Trainer

    trainer = Trainer(cfg, Path(run), resume=True)
    assert trainer.checkpoint.restore() == 0
    for name, t in trainer.model.state_dict().items():
        assert torch.equal(t, whole_sd[name]), name
    assert not trainer.optimizer.state  # fresh

    # tp = 2: Megatron layout of every block (DTensor shards, Q/K/V biases sharded with their columns)
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    stage = LLMStage(llm_cfg, 0, 1, seed=m.seed)
    for block in stage.layers.values():
        apply_tensor_parallel(block, tp_mesh, llama_tp_plan(attention="attn", mlp="mlp"))
    model = torch.nn.ModuleDict({"llm": stage, "encoders": Encoders(m.vit, m.audio, m.llm.dim, seed=m.seed)})
    load({"model": model.state_dict()}, step0)
    bias = stage.layers["0"].attn.wq.bias
    assert isinstance(bias, DTensor) and bias.to_local().shape[0] == bias.shape[0] // 2
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        assert torch.equal(full, whole_sd[name]), name
    with torch.no_grad():
        torch.testing.assert_close(stage(ids, pos, cu), ref_logits, rtol=0, atol=TOL)
    save({"model": model.state_dict()}, f"{saves}/tp2/checkpoints/step-00000001")


def _folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from omni_train.hf import read_weights

    return read_weights(folder)


def test_import_loads_into_pp2_and_tp2_and_any_layout_exports_the_same(tmp_path, capsys):
    data = make_dataset(tmp_path / "data", n_image=4, n_audio=2, n_text=8)
    toml = write_config(tmp_path / "c.toml", data, model=HF_MODEL)
    cfg = load_config(str(toml))
    vocab = Tokenizer.from_file(data["tokenizer"]).get_vocab_size()
    hf = _hf_folders(tmp_path / "hf", vocab)
    run = tmp_path / "run"
    argv = ["import-hf", *map(str, hf.values()), "--config", str(toml), "--out", str(run)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "starts as a copy" in err and "audio.projector" in err  # untied head; the projector kept its init
    assert main(argv) == 2  # a second import into the same run directory is refused
    assert "already holds checkpoints" in capsys.readouterr().err

    ids = torch.randint(0, vocab, (13,), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(hf["llm"], ids)
    assert ref.std() > 0.1
    run_world(_layouts, 2, args=(cfg, str(run), ids, ref, str(tmp_path / "saves")), timeout_s=240)

    # export: step 0 of the import, and step 1 saved by pp=2 and by tp=2, give the same folders
    exports = {}
    for name, run_dir in [("import", run), ("pp2", tmp_path / "saves/pp2"), ("tp2", tmp_path / "saves/tp2")]:
        (run_dir / "config.json").write_text((run / "config.json").read_text())
        assert (
            main(["export-hf", str(run_dir), str(tmp_path / "out" / name), "--max-shard-bytes", "20000"]) == 0
        )
        exports[name] = {f: _folder_tensors(tmp_path / "out" / name / f) for f in ("llm", "vision", "audio")}
    assert "audio.projector" in capsys.readouterr().err  # named, not silently dropped
    for name in ("pp2", "tp2"):
        for family, tensors in exports["import"].items():
            assert tensors.keys() == exports[name][family].keys()
            for k, t in tensors.items():
                assert torch.equal(t, exports[name][family][k]), (name, family, k)
    # ... and they are the transformers models' tensors (the tied head now written out; Whisper exactly)
    original = {f: _folder_tensors(hf[f]) for f in ("llm", "audio")}
    assert exports["import"]["audio"].keys() == original["audio"].keys()
    assert set(exports["import"]["llm"]) == set(original["llm"]) | {"lm_head.weight"}
    for family, tensors in original.items():
        for k, t in tensors.items():
            assert torch.equal(exports["import"][family][k], t), (family, k)
    assert torch.equal(
        exports["import"]["llm"]["lm_head.weight"], original["llm"]["model.embed_tokens.weight"]
    )
    assert len(list((tmp_path / "out/import/llm").glob("model-*-of-*.safetensors"))) > 1
    from transformers import Qwen2ForCausalLM

    with torch.no_grad():
        again = (
            Qwen2ForCausalLM.from_pretrained(tmp_path / "out/import/llm")
            .eval()(input_ids=ids[None])
            .logits[0]
        )
    torch.testing.assert_close(again, ref, rtol=0, atol=TOL)


def test_import_mismatch_and_unexportable_config_are_named(tmp_path, capsys):
    data = make_dataset(tmp_path / "data", n_image=4, n_audio=2, n_text=8)
    vocab = Tokenizer.from_file(data["tokenizer"]).get_vocab_size()
    hf = _hf_folders(tmp_path / "hf", vocab)
    plain = write_config(tmp_path / "plain.toml", data)  # today's defaults: LLaVA projector, stride-2 audio
    assert (
        main(
            [
                "import-hf",
                str(hf["llm"]),
                str(hf["audio"]),
                "--config",
                str(plain),
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "model.llm.qkv_bias: the config has False" in err and "model.audio.stem" in err
    assert not (tmp_path / "x" / "checkpoints").exists()  # nothing written before the checks pass

    from omni_train.hf import export_hf, import_hf

    # no folders: step 0 holds the seeded initialisation; the plain config exports only the LLM
    import_hf([], load_config(str(plain)), tmp_path / "seeded")
    report = export_hf(tmp_path / "seeded", tmp_path / "out")
    assert set(report.folders) == {"llm"}
    assert any("projector_norm" in r for r in report.skipped["vision"])
    assert any("model.audio.stem" in r for r in report.skipped["audio"])
    assert any(n.startswith("encoders.towers.image.") for n in report.not_exported)

    # an output naming a file (or lying under one) is refused by name, exit 2, not a NotADirectoryError
    (tmp_path / "f").write_text("x")
    assert main(["export-hf", str(tmp_path / "seeded"), str(tmp_path / "f")]) == 2
    assert f"export-hf OUT: {tmp_path / 'f'} is a file, not a directory" in capsys.readouterr().err
    assert (
        main(["import-hf", str(hf["llm"]), "--config", str(plain), "--out", str(tmp_path / "f" / "run")]) == 2
    )
    assert f"--out: {tmp_path / 'f'} is a file, not a directory" in capsys.readouterr().err


def _fresh_and_resumed(rank, world_size, cfg, fresh, resumed):
    from omni_train.trainer import Trainer

    Trainer(cfg, Path(fresh), resume=False).run()
    summary = Trainer(cfg, Path(resumed), resume=True).run()
    if rank != 0:
        return None
    losses = [
        [json.loads(line)["loss"] for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        for d in (fresh, resumed)
    ]
    return losses, summary


@pytest.mark.slow
def test_resume_from_imported_step0_trains_exactly_like_a_fresh_run(tmp_path):
    """The seeded initialisation, exported to Hugging Face folders and imported back, then trained with
    ``--resume`` at pp=2: the losses of a fresh run, bit for bit (the weights round-trip exactly, the
    optimizer and the loader start fresh). That ``checkpoint.restore`` loads step 0's weights at all is checked
    on weights that differ from the seeded ones in the layout test above."""
    from omni_train.hf import export_hf, import_hf

    data = make_dataset(tmp_path / "data")
    toml = write_config(tmp_path / "c.toml", data, steps=3, every=0, model=HF_MODEL)
    cfg = load_config(str(toml))
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, async_save=False))
    import_hf([], cfg, tmp_path / "seeded")
    report = export_hf(tmp_path / "seeded", tmp_path / "hf")
    assert set(report.folders) == {"llm", "vision", "audio"}
    assert main(["import-hf", str(tmp_path / "hf"), "--config", str(toml), "--out", str(tmp_path / "b")]) == 0
    (losses, summary) = run_world(
        _fresh_and_resumed, 2, args=(cfg, str(tmp_path / "a"), str(tmp_path / "b")), timeout_s=300
    )[0]
    fresh, resumed = losses
    assert len(fresh) == 3 and fresh[-1] < fresh[0]
    assert resumed == fresh
    assert summary["resumed_from"] == 0 and summary["checkpoints"][-1] == 3
