"""Understanding with generation through the trainer (issue 30): discrete image tokens predicted by the LLM.

A tiny run over image captioning (ViT, understanding), text and text-to-image generation samples (the same
image shards read by a ``modality = "generation"`` source: caption, ``boi``, the image's codes from a
frozen VQ image tokenizer, ``eoi``; ``omni_data.image_generation``), float64, 3 steps:

* pp = 2 (1F1B), pp = 2 under GPipe with the ``planned`` placement and pp = 2 under interleaved 1F1B (2
  virtual stages per rank, 4 LLM layers), each on 2 gloo processes, against the one-process reference over
  the same packs (``train_reference``, <= 1e-10): every loss and every gradient, the LM head's rows of
  the image codes included (the LLM's vocabulary is ``V + 2 + K``).
* The generation loss is reported apart from the others (``loss_per_modality["generation"]`` in
  ``metrics.jsonl``, per modality first/last means in ``summary.json``) and equals a brute-force mean
  cross-entropy over the code and ``eoi`` targets: each generation sample rebuilt from its shard
  member by hand (PIL decode, the text tokenizer, ``letterbox``, the image tokenizer's ``encode``, the
  layout ``boi = V``, ``eoi = V + 1``, code ``c -> V + 2 + c``) and run alone through the one-process LLM
  (attention is per document, so a sample's logits do not depend on its pack).
* Generation samples are counted (``samples_per_modality["generation"]``) and trained on the codes only.
* Preflight names ``model.image_tokenizer.path`` for a missing or damaged tokenizer file, and the source
  of a generation source without ``[model.image_tokenizer]`` or with packs too short for its codes.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from train_fixtures import make_dataset, side_by_side, write_config
from train_reference import assert_runs_match, capture_run, reference_run, with_llm_layers, with_parallel

from omni_data import Modality, generation_targets
from omni_data.payload import to_rgb
from omni_parallel.testing import run_world
from omni_pipeline import PlacementPolicy, build_llm_microbatch, step_targets
from omni_pipeline.microbatch import IGNORE
from omni_train.binder import load_config
from omni_train.config import ConfigError, ImageTokenizerSection, MixturePhase, SourceConfig
from omni_train.models.image_tokenizer import ImageTokenizer, ImageTokenizerConfig, letterbox
from omni_train.preflight import validate

TOKENIZER_CFG = ImageTokenizerConfig(image_size=16, downsample=4, channels=8, code_dim=4, codebook_size=32)


@pytest.fixture(scope="module")
def gen_cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    data = make_dataset(tmp / "data", n_image=8, n_audio=2, n_text=8)
    ImageTokenizer(TOKENIZER_CFG, seed=3).save(tmp / "vq.safetensors")  # random init: real codes all the same
    path = write_config(tmp / "c.toml", data, steps=3, every=0, extra='dtype = "float64"')
    cfg = load_config(str(path))
    gen = SourceConfig(name="gen", modality="generation", urls=data["image"])
    mixture = [MixturePhase({"image": 0.3, "text": 0.2, "gen": 0.5})]
    data_cfg = dataclasses.replace(cfg.data, sources=[*cfg.data.sources, gen], mixture=mixture)
    model = dataclasses.replace(cfg.model, image_tokenizer=ImageTokenizerSection(str(tmp / "vq.safetensors")))
    return dataclasses.replace(cfg, data=data_cfg, model=model)


def _members(pattern: str) -> dict[str, dict[str, bytes]]:
    """Every sample of the image shards by key: member extension -> bytes (read with tarfile)."""
    out: dict[str, dict[str, bytes]] = {}
    for shard in sorted(Path(pattern).parent.glob(Path(pattern).name)):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                out.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return out


def _expected_ids(members, tokenizer, vq, text_vocab: int) -> torch.Tensor:
    """A generation sample's ids by hand: caption, boi = V, codes + V + 2 (raster order), eoi = V + 1."""
    caption = tokenizer.encode(members["txt"].decode()).ids
    with Image.open(io.BytesIO(members["png"])) as im:
        rgb = np.asarray(to_rgb(im), dtype=np.uint8).transpose(2, 0, 1)
    pixels = torch.from_numpy(rgb.astype(np.float32) / 255.0)
    codes = vq.encode(letterbox(pixels, TOKENIZER_CFG.image_size)[None]).reshape(-1)
    return torch.tensor([*caption, text_vocab, *(codes + text_vocab + 2).tolist(), text_vocab + 1])


def _brute_force(gen_cfg, seen: list):
    """Reference-run hook: each step's generation samples rebuilt by hand, run alone through the LLM."""
    from tokenizers import Tokenizer

    from omni_train.data_files import tokenizer_path

    tokenizer = Tokenizer.from_file(str(tokenizer_path(gen_cfg.data)))
    vq = ImageTokenizer.load(gen_cfg.model.image_tokenizer.path)
    members = _members(next(s for s in gen_cfg.data.sources if s.name == "gen").urls)
    v = tokenizer.get_vocab_size()

    def on_inputs(trainer, step, inputs):
        ce, n, samples = 0.0, 0, 0
        with torch.no_grad():
            for k, pack in enumerate(inputs.packs, start=1):
                cu = inputs.microbatches[k].cu_seqlens
                for i, s in enumerate(pack.samples):
                    if s.modality is not Modality.GENERATION:
                        continue
                    ids = _expected_ids(members[s.key], tokenizer, vq, v)
                    got = inputs.microbatches[k].input_ids[cu[i] : cu[i + 1]]
                    assert torch.equal(got, ids), (step, s.key)  # the loader's ids are the layout's
                    t = ids.numel()
                    (llm,) = trainer.stage.chunks.values()  # one process: the whole LLM
                    logits = llm(ids, torch.arange(t), torch.tensor([0, t]))
                    first, count = generation_targets(s)
                    assert count == TOKENIZER_CFG.tokens + 1 and first == t - count - 1
                    pred, target = logits[first : first + count], ids[first + 1 : first + count + 1]
                    assert int(target.min()) > v  # codes and eoi: never a caption token
                    ce += float(F.cross_entropy(pred, target, reduction="sum"))
                    n, samples = n + count, samples + 1
        seen.append((ce / n if n else None, n, samples))

    return on_inputs


def _parallel(rank, world_size, cfg, root):
    pp2 = capture_run(with_parallel(cfg, pp=2), Path(root) / "pp2")
    # GPipe with the per-step planned placement (its step costs: generation samples have no encoder work)
    gpipe = capture_run(
        with_parallel(cfg, pp=2, schedule="gpipe", placement=PlacementPolicy.PLANNED), Path(root) / "gpipe"
    )
    # interleaved 1F1B over 2 virtual stages per rank (4 LLM layers: one per virtual stage)
    inter = capture_run(
        with_parallel(with_llm_layers(cfg, 4), pp=2, schedule="interleaved", virtual_stages=2),
        Path(root) / "inter",
    )
    return pp2, gpipe, inter


def _reference(rank, world_size, cfg, root):
    seen: list = []
    ref = reference_run(cfg, Path(root) / "ref", 1, on_inputs=_brute_force(cfg, seen))
    return ref, seen, reference_run(with_llm_layers(cfg, 4), Path(root) / "ref-4l", 1)


@pytest.mark.slow
def test_generation_with_understanding_at_pp2_matches_one_process(gen_cfg, tmp_path):
    cfg = gen_cfg
    validate(with_parallel(cfg, pp=2), 2)
    parallel, reference = side_by_side(  # other run folders: the reference runs on the pipeline's idle core
        lambda: run_world(_parallel, 2, args=(cfg, str(tmp_path)), timeout_s=300),
        lambda: run_world(_reference, 1, args=(cfg, str(tmp_path)), timeout_s=300),
    )
    pp2, gpipe, inter = parallel[0]
    ref, seen, ref_4l = reference[0]
    assert_runs_match(pp2, ref, "pp=2 with generation and understanding")
    assert_runs_match(gpipe, ref, "pp=2, GPipe, planned placement, with generation and understanding")
    assert_runs_match(inter, ref_4l, "pp=2, interleaved 1F1B (2 virtual stages), with generation")
    rows = [json.loads(x) for x in (tmp_path / "pp2" / "metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert len(seen) == len(rows) == 3
    for row, ref_row, (loss, n, samples) in zip(rows, ref_rows, seen):
        # both objectives in the same steps' packs: image captions (ViT) and generation samples
        assert row["targets_per_modality"]["image"] > 0 and n > 0
        assert row["targets_per_modality"]["generation"] == n
        assert row["samples_per_modality"]["generation"] == samples
        # both stages read the generation samples' ids, so both encode their images (counted per rank)
        assert row["image_code_encodes_per_rank"] == [samples, samples], row
        assert row["image_code_encodes"] == 2 * samples and ref_row["image_code_encodes"] == samples
        # the generation loss apart from the others, equal to the brute force over the code targets
        assert abs(ref_row["loss_per_modality"]["generation"] - loss) <= 1e-10, (ref_row, loss)
        assert abs(row["loss_per_modality"]["generation"] - loss) <= 1e-10, (row, loss)
    summary = json.loads((tmp_path / "pp2" / "summary.json").read_text())
    assert summary["samples_per_modality"]["generation"] == sum(s for *_, s in seen)
    assert summary["image_code_encodes_per_rank"] == [sum(s for *_, s in seen)] * 2
    assert summary["first_mean_loss_per_modality"]["generation"] == pytest.approx(seen[0][0], abs=1e-10)
    assert summary["last_mean_loss_per_modality"]["generation"] == pytest.approx(seen[-1][0], abs=1e-10)


def test_generation_labels_are_the_codes_and_eoi():
    """``build_llm_microbatch`` / ``step_targets`` of a pack with a text and a generation sample."""
    from omni_data import GenerationVocab, Pack, SampleMeta

    vocab = GenerationVocab(text_vocab=50, codebook=7, grid=(2, 3))
    caption = torch.tensor([5, 6, 7])
    codes = torch.tensor([[0, 6, 2], [3, 3, 1]])
    ids = vocab.sample_ids(caption, codes)
    gen = SampleMeta("g", "gen", Modality.GENERATION, 0, vocab.tokens(3), 0.0, (2, 3))
    text = SampleMeta("t", "text", Modality.TEXT, 0, 4, 0.0, (4,))
    pack = Pack([text, gen], 32)
    mb = build_llm_microbatch(pack, {"text/t": torch.tensor([1, 2, 3, 4]), "gen/g": ids}, {})
    want = [2, 3, 4, IGNORE] + [IGNORE] * 3 + [52, 58, 54, 55, 55, 53, 51] + [IGNORE]
    assert mb.labels.tolist() == want
    assert ids.tolist() == [5, 6, 7, 50, 52, 58, 54, 55, 55, 53, 51]
    assert step_targets([pack]) == 3 + 7 and step_targets([pack], {(0, 1)}) == 3
    masked = build_llm_microbatch(pack, {"text/t": torch.tensor([1, 2, 3, 4]), "gen/g": ids}, {}, {1})
    assert (masked.labels[4:] == IGNORE).all()
    # a generation sample whose image did not decode where its ids were read is masked like a payload
    from omni_data.zero_redundancy import FilteredStep
    from omni_pipeline.step_inputs import undecodable_samples

    fs = FilteredStep(0, [pack], {}, {}, [[None, None]], frozenset(), {(0, 1): "undecodable image payload"})
    assert undecodable_samples(fs) == [(0, 1)]


def test_preflight_names_the_image_tokenizer_and_the_generation_source(gen_cfg, tmp_path):
    cfg = gen_cfg
    validate(cfg, 2)
    missing = dataclasses.replace(
        cfg.model, image_tokenizer=ImageTokenizerSection(str(tmp_path / "no.safetensors"))
    )
    with pytest.raises(ConfigError, match=r"^model.image_tokenizer.path: .*no.safetensors"):
        validate(dataclasses.replace(cfg, model=missing), 2)
    # a damaged weights file (its sha256 no longer the sidecar's) is refused naming the file
    src = Path(cfg.model.image_tokenizer.path)
    bad = tmp_path / "bad.safetensors"
    data = bytearray(src.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    bad.with_suffix(".json").write_text(src.with_suffix(".json").read_text())
    damaged = dataclasses.replace(cfg.model, image_tokenizer=ImageTokenizerSection(str(bad)))
    with pytest.raises(ConfigError, match=r"^model.image_tokenizer.path: .*bad.safetensors.*sha256"):
        validate(dataclasses.replace(cfg, model=damaged), 2)
    without = dataclasses.replace(cfg.model, image_tokenizer=None)
    with pytest.raises(ConfigError, match=r"^data.sources\[3\].modality: generation source 'gen' but no"):
        validate(dataclasses.replace(cfg, model=without), 2)
    short = dataclasses.replace(cfg.data, max_seq_len=TOKENIZER_CFG.tokens + 2)
    with pytest.raises(ConfigError, match=r"^data.max_seq_len: 18 tokens cannot hold a generation sample"):
        validate(dataclasses.replace(cfg, data=short), 2)
    typo = dataclasses.replace(
        cfg.data,
        sources=[*cfg.data.sources[:3], dataclasses.replace(cfg.data.sources[3], modality="generate")],
    )
    with pytest.raises(ConfigError, match=r"^data.sources\[3\].modality: 'generate' is not"):
        validate(dataclasses.replace(cfg, data=typo), 2)
    audio = next(s.urls for s in cfg.data.sources if s.modality == "audio")
    on_audio = dataclasses.replace(
        cfg.data, sources=[*cfg.data.sources[:3], dataclasses.replace(cfg.data.sources[3], urls=audio)]
    )
    with pytest.raises(
        ConfigError,
        match=r"^data.sources\[3\].urls: .*audio.*tar holds \.\w+ members and no image .* a "
        r"generation source reads image shards \(source 'gen'\)",
    ):
        validate(dataclasses.replace(cfg, data=on_audio), 2)
    # the LLM's vocabulary is V + 2 + K: a model.llm.vocab_size of V is refused, saying so
    text_only = dataclasses.replace(cfg.model.llm, vocab_size=300)
    with pytest.raises(ConfigError, match=r"^model.llm.vocab_size: 300 differs from the vocabulary the run "):
        validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, llm=text_only)), 2)
