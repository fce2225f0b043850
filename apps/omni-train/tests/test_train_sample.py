"""Text -> image sampling (``omni_train.generate``): greedy sampling from a pp=2 checkpoint read back as one
process equals a brute-force argmax loop over the whole model's full forward, one caption at a time;
sampled codes stay in the code range; the grid PNG has the size its layout says; the ``omni-gen`` recipe
passes preflight; a tiny trainer run with a generation source writes ``samples/step-N.png`` at each
checkpoint and ``omni-train sample`` draws the same pixels from the same step."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from train_fixtures import make_dataset, write_config

from omni_ckpt import save_ranks
from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.cli import main
from omni_train.config import ConfigError
from omni_train.generate import (
    GridRow,
    SampleSettings,
    grid_size,
    one_process_llm,
    read_llm_state,
    sample_codes,
    write_grid,
)
from omni_train.models.image_tokenizer import ImageTokenizer, ImageTokenizerConfig
from omni_train.models.llm import LLMConfig, LLMStage

V, K, L = 40, 12, 6  # text words, codebook size, codes per image (a 2 x 3 grid)
BOI, FIRST_CODE = V, V + 2
LLM = LLMConfig(vocab_size=V + 2 + K, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


class _Cfg:
    """The two fields of a run config :func:`one_process_llm` reads."""

    class model:
        seed = 3

        @staticmethod
        def llm_config(vocab: int) -> LLMConfig:
            assert vocab == LLM.vocab_size
            return LLM


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.cat([torch.randint(0, V, (n,), generator=g), torch.tensor([BOI])]) for n in (3, 7, 1)]


def _checkpoint_pp2(tmp_path) -> str:
    """The whole model saved as a pp=2 run saves it: two ranks, one stage each (layers split 1 + 1)."""
    root = tmp_path / "checkpoints"
    stages = [LLMStage(LLM, s, 2, seed=3).double() for s in range(2)]
    states = [{"model": {f"llm.{k}": v for k, v in st.state_dict().items()}} for st in stages]
    save_ranks(states, str(root / "step-00000004"))
    (root / "latest").write_text("step-00000004")
    return str(root)


def test_greedy_sampling_equals_brute_force_argmax_over_full_forwards(tmp_path):
    step, state = read_llm_state(_checkpoint_pp2(tmp_path))
    assert step == 4
    llm = one_process_llm(_Cfg, state).double()
    whole = LLMStage(LLM, 0, 1, seed=3).double().eval()  # the same seeded weights, never split
    prompts = _prompts()
    greedy = SampleSettings(temperature=0.0)
    codes = sample_codes(llm, prompts, first_code=FIRST_CODE, num_codes=K, length=L, settings=greedy)
    assert codes.shape == (len(prompts), L)
    with torch.no_grad():
        for p, got in zip(prompts, codes):
            seq = p.clone()
            for i in range(L):  # alone, a full forward per code, the best code id by a plain loop
                n = seq.numel()
                logits = whole(seq, torch.arange(n), torch.tensor([0, n]))[-1]
                best = max(range(FIRST_CODE, FIRST_CODE + K), key=lambda t: float(logits[t]))
                assert int(got[i]) == best - FIRST_CODE, (p.tolist(), i)
                seq = torch.cat([seq, torch.tensor([best])])


def test_sampled_codes_stay_in_the_code_range_and_follow_the_seed(tmp_path):
    llm = LLMStage(LLM, 0, 1, seed=7).eval()
    with torch.no_grad():  # a text word would win nearly every draw from the whole vocabulary
        llm.output.weight[:V] *= 20
    prompts = _prompts()
    runs = []
    for settings in (
        SampleSettings(temperature=1.0, seed=1),
        SampleSettings(temperature=2.0, top_k=3, seed=1),
    ):
        codes = sample_codes(llm, prompts, first_code=FIRST_CODE, num_codes=K, length=L, settings=settings)
        assert codes.dtype == torch.int64 and int(codes.min()) >= 0 and int(codes.max()) < K
        runs.append(codes)
    again = sample_codes(
        llm, prompts, first_code=FIRST_CODE, num_codes=K, length=L, settings=SampleSettings(seed=1)
    )
    assert torch.equal(again, runs[0])
    # top-k: each code drawn with top_k=3 is among the 3 largest code logits at its position (brute force:
    # one caption alone, a full forward of its prefix); at temperature 2 over 12 codes a broken mask
    # would draw outside them in nearly every one of the 18 draws
    with torch.no_grad():
        for p, got in zip(prompts, runs[1]):
            for i in range(L):
                seq = torch.cat([p, FIRST_CODE + got[:i]])
                n = seq.numel()
                logits = llm(seq, torch.arange(n), torch.tensor([0, n]))[-1, FIRST_CODE:]
                top3 = sorted(range(K), key=lambda c: -float(logits[c]))[:3]
                assert int(got[i]) in top3, (p.tolist(), i, int(got[i]), top3)


def test_one_process_llm_refuses_a_checkpoint_that_does_not_fit_the_config():
    state = LLMStage(LLM, 0, 1, seed=3).state_dict()
    assert isinstance(one_process_llm(_Cfg, dict(state)), LLMStage)
    wrong = {**state, "layers.1.mlp.w1.weight": torch.zeros(65, LLM.dim)}  # ffn_dim 65, not 64
    with pytest.raises(ConfigError, match=r"llm\.layers\.1\.mlp\.w1\.weight is \[65, 32\].*\[64, 32\]"):
        one_process_llm(_Cfg, wrong)
    with pytest.raises(ConfigError, match=r"no 2-D model\.llm\.tok_embeddings\.weight"):
        one_process_llm(_Cfg, {k: v for k, v in state.items() if k != "tok_embeddings.weight"})
    with pytest.raises(ConfigError, match=r"missing \['layers.0.attn"):
        one_process_llm(_Cfg, {k: v for k, v in state.items() if not k.startswith("layers.0.attn")})


def test_grid_png_has_the_layout_size(tmp_path):
    g = torch.Generator().manual_seed(0)

    def img() -> torch.Tensor:
        return torch.rand(3, 8, 8, generator=g)

    rows = [
        GridRow("a red circle on a very long caption that wraps over several lines", img(), img(),
                [img() for _ in range(3)]),
        GridRow("no real image", None, None, [img() for _ in range(3)]),
    ]  # fmt: skip
    path = write_grid(tmp_path / "samples" / "step-2.png", rows, cell=40)
    with Image.open(path) as im:
        assert im.format == "PNG" and im.mode == "RGB"
        # caption column 224 + pads 4, then real, tokenized + 3 generated cells of 40 + 4; an 18-pixel title
        assert im.size == (4 + 224 + 4 + 5 * (40 + 4), 18 + 2 * (40 + 4) + 4) == grid_size(2, 3, cell=40)
        # each image scaled up 5x by nearest neighbour into its cell: real, tokenized, generated 1..3
        for j, pixels in enumerate([rows[0].real, rows[0].reconstructed, *rows[0].generated]):
            x0, y0 = 4 + 224 + 4 + j * 44, 18
            for u, v in ((0, 0), (7, 3)):
                want = tuple(round(float(c) * 255) for c in pixels[:, v, u])
                assert im.getpixel((x0 + 5 * u + 2, y0 + 5 * v + 2)) == want, (j, u, v)


def test_omni_gen_recipe_passes_preflight_with_the_committed_image_tokenizer():
    from omni_train.data_pipeline import llm_vocab_size
    from omni_train.preflight import validate

    cfg = load_config("omni-gen")
    validate(cfg, 2)  # loads the committed weights (checksum, config, tensors) and checks the sources
    kinds = {s.name: s.modality for s in cfg.data.sources}
    assert kinds == {"image": "image", "generate": "generation", "text": "text"}
    assert llm_vocab_size(cfg, 4096) == 4096 + 2 + 512  # text, boi, eoi, the codebook


def _train(rank, world_size, runs):
    from omni_train.trainer import Trainer

    for cfg, out in runs:  # the variants one after the other in one world
        Trainer(cfg, Path(out), resume=False).run()


def _losses(run: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], json.dumps(r.get("loss_per_modality"), sort_keys=True)) for r in rows]


@pytest.mark.slow
def test_a_run_writes_samples_at_each_checkpoint_and_the_cli_redraws_them(tmp_path):
    data = make_dataset(tmp_path / "data", n_image=6, n_audio=2, n_text=6)
    vq = tmp_path / "vq.safetensors"  # random weights: 16 x 16 images, a 4 x 4 grid of 32 codes
    ImageTokenizer(ImageTokenizerConfig(image_size=16, channels=8, codebook_size=32), seed=1).save(vq)
    config = write_config(tmp_path / "c.toml", data, steps=2, every=1)
    text = (
        config.read_text()
        .replace(
            "[[data.mixture]]",
            f"""[[data.sources]]
name = "generate"
modality = "generation"
urls = "{data["image"]}"

[[data.mixture]]""",
            1,
        )
        .replace("weights = {", "weights = { generate = 0.4,")
    )
    config.write_text(text + f'\n[model.image_tokenizer]\npath = "{vq}"\n')
    cfg = load_config(str(config))
    assert cfg.checkpoint.sample_rows == 4
    off = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, sample_rows=0))
    out, out_off = tmp_path / "run", tmp_path / "run-off"
    run_world(_train, 2, timeout_s=300, args=([(cfg, str(out)), (off, str(out_off))],))
    # the grids' child processes touch no training state: the same losses, bit for bit, without them
    assert _losses(out) == _losses(out_off) and len(_losses(out)) == 2
    assert not (out_off / "samples").exists()  # sample_rows = 0: no grids
    # one child at a time: step 1's grid, unless step 2 was committed before step 1's child could start
    report = json.loads((out / "summary.json").read_text())["samples"]
    assert report["failed"] == []
    drawn = sorted(Path(p).name for p in report["written"])
    assert drawn in (["step-1.png", "step-2.png"], ["step-2.png"]) and report["superseded"] == (
        [] if len(drawn) == 2 else [1]
    )
    hook = out / "samples" / "step-2.png"
    with Image.open(hook) as im:  # 4 captions of the 6 images, 2 drawn each
        assert im.size == grid_size(4, 2)
        hook_pixels = im.tobytes()
    # the command line draws the same images from the same committed step, and any caption
    again = tmp_path / "again.png"
    assert main(["sample", "--run", str(out), "--step", "2", "--out", str(again)]) == 0
    with Image.open(again) as im:
        assert im.tobytes() == hook_pixels
    assert main(["sample", "--run", str(out), "--caption", "a red circle", "--per-caption", "3"]) == 0
    with Image.open(out / "samples" / "step-2-sample.png") as im:  # the run's own grid left alone
        assert im.size == grid_size(1, 3)
    with Image.open(hook) as im:
        assert im.tobytes() == hook_pixels
    assert main(["sample", "--run", str(out), "--step", "7"]) == 2  # not a committed step: refused


def test_sample_and_export_hf_find_the_checkpoints_where_the_run_put_them(tmp_path):
    from omni_train.checkpointing import checkpoints_root
    from omni_train.generate import sample_run

    cfg = load_config("omni-gen")
    assert checkpoints_root(cfg, tmp_path) == tmp_path / "checkpoints"
    elsewhere = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, url="memory://c/k"))
    assert checkpoints_root(elsewhere, tmp_path) == "memory://c/k"
    # a run that does not generate is refused before any checkpoint is looked for (there is none here)
    plain = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, image_tokenizer=None))
    (tmp_path / "config.json").write_text(json.dumps(plain.to_dict()))
    with pytest.raises(ConfigError, match=r"no \[model.image_tokenizer\]"):
        sample_run(tmp_path)
