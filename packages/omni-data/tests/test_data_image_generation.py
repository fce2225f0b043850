"""Generation samples (issue 30, "understanding with generation"): the token layout, the metadata a
``modality="generation"`` source gives before any payload, and the ids the reader makes in its decode
workers, against brute force.

The image tokenizer here is a real one of the :class:`omni_data.ImageCodeEncoder` protocol (omni-data
holds no model): each code is the mean grey level of a ``4 x 4`` pixel block quantised to ``K`` levels,
computed with torch; the brute force recomputes it pixel by pixel in numpy from the PNG.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from omni_data import (
    GenerationVocab,
    ImageCodes,
    Modality,
    PayloadReader,
    SampleMeta,
    WebDatasetSource,
    ZeroRedundancyFilter,
    generation_targets,
    split_encoder_microbatches,
)
from omni_data.testing import image_samples, packed_loader, train_tiny_bpe, write_shards

S, BLOCK, K = 16, 4, 8  # input side, pixels per code side, codebook: a 4 x 4 grid


class BlockGrey:
    """Codes = the mean grey of each ``BLOCK x BLOCK`` block quantised to ``K`` levels."""

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        grey = pixels.mean(dim=1, keepdim=True)  # [n, 1, S, S]
        pooled = F.avg_pool2d(grey, BLOCK)[:, 0]  # [n, h, w]
        return (pooled * K).floor().clamp(0, K - 1).to(torch.int64)


def _to_input(pixels: torch.Tensor) -> torch.Tensor:
    """Top-left crop / white pad to ``S x S`` (any fixed rule: the reader hands the decoded image over)."""
    out = torch.ones(3, S, S)
    h, w = min(S, pixels.shape[1]), min(S, pixels.shape[2])
    out[:, :h, :w] = pixels[:, :h, :w]
    return out


@pytest.fixture(scope="module")
def tok():
    return train_tiny_bpe()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    samples = list(image_samples(12, sizes=(10, 30)))
    samples[3] = {k: v for k, v in samples[3].items() if k != "txt"}  # no caption: skipped, counted
    write_shards(f"{d}/img-%03d.tar", samples, per_shard=6)
    return d, {s["__key__"]: s for s in samples}


def test_layout_boi_eoi_and_codes():
    v = GenerationVocab(text_vocab=4096, codebook=512, grid=(8, 8))
    assert (v.boi, v.eoi, v.first_code, v.size, v.codes, v.tokens(10)) == (4096, 4097, 4098, 4610, 64, 76)
    codes = torch.arange(64).reshape(8, 8) * 8 % 512
    ids = v.sample_ids(torch.tensor([3, 4095]), codes)
    assert ids[:3].tolist() == [3, 4095, 4096] and ids[-1] == 4097
    assert ids[3:-1].tolist() == [4098 + c for c in codes.reshape(-1).tolist()]  # raster order
    assert torch.equal(v.codes_of(ids[3:-1]).reshape(8, 8), codes)
    with pytest.raises(ValueError, match=r"codes must be in 0\.\.511"):
        v.code_ids(torch.tensor([512]))
    with pytest.raises(ValueError, match=r"code ids must be in 4098\.\.4609"):
        v.codes_of(torch.tensor([4097]))
    with pytest.raises(ValueError, match=r"caption ids must be text ids"):
        v.sample_ids(torch.tensor([4096]), codes)
    with pytest.raises(ValueError, match=r"codes of shape \(4, 16\), the grid is \(8, 8\)"):
        v.sample_ids(torch.tensor([1]), codes.reshape(4, 16))
    meta = SampleMeta("k", "gen", Modality.GENERATION, 0, v.tokens(10), 0.0, (8, 8))
    assert generation_targets(meta) == (10, 65)  # the boi position, then 64 codes and eoi
    assert Modality.GENERATION.encoded is False and Modality.TEXT.encoded is False
    assert all(m.encoded for m in (Modality.IMAGE, Modality.AUDIO, Modality.VIDEO))


def _source(d, tok, vocab):
    return WebDatasetSource(
        f"{d}/img-{{000..001}}.tar", modality="generation", name="gen", tokenizer=tok, generation=vocab
    )


def test_metadata_then_ids_equal_brute_force(shards, tok):
    d, samples = shards
    vocab = GenerationVocab(tok.get_vocab_size(), K, (S // BLOCK, S // BLOCK))
    src = _source(d, tok, vocab)
    src.reset()
    metas = list(src)
    assert src.skipped == {"missing .txt": 1}
    reader = PayloadReader(tok, image_codes=ImageCodes(vocab, BlockGrey(), _to_input))
    assert len(metas) == 11
    for m in metas:
        raw = samples[m.key]
        caption = tok.encode(raw["txt"]).ids
        # planned from metadata alone: no encoder, caption + boi + 16 codes + eoi, shape = the grid
        assert (m.modality, m.media_tokens, m.encoder_flops) == (Modality.GENERATION, 0, 0.0)
        assert (m.text_tokens, m.shape) == (len(caption) + 2 + 16, (4, 4))
        with Image.open(io.BytesIO(raw["png"])) as im:
            rgb = np.asarray(im.convert("RGB"), dtype=np.float64) / 255.0
        padded = np.ones((S, S, 3))
        h, w = min(S, rgb.shape[0]), min(S, rgb.shape[1])
        padded[:h, :w] = rgb[:h, :w]
        want = []
        for by in range(S // BLOCK):
            for bx in range(S // BLOCK):
                block = padded[by * BLOCK : (by + 1) * BLOCK, bx * BLOCK : (bx + 1) * BLOCK]
                want.append(min(K - 1, int(np.floor(block.mean() * K + 1e-9))))
        ids = reader.read_text_ids(m)
        v = tok.get_vocab_size()  # the layout: boi = V, code c -> V + 2 + c, eoi = V + 1
        assert ids.tolist() == [*caption, v, *(v + 2 + c for c in want), v + 1]
        assert torch.equal(reader.read(m).text_ids, ids)
        assert [r.ext for r in reader.refs(m, media=False)] == ["png", "txt"]  # the image is part of its ids
        assert reader.refs(m, text=False) == []
    # each read of a generation sample's ids encodes its image once: counted where it happens
    assert reader.stats["image_code_encodes"] == 2 * len(metas)


def test_generation_samples_are_text_for_the_loader(tmp_path, tok):
    """Through the zero-redundancy filter: no encoder work, ids read with the text; a generation sample
    whose PNG body does not decode (its header does: planned from metadata) keeps its place as zeros,
    is named in ``FilteredStep.text_errors`` and counted once."""
    d = tmp_path
    samples = list(image_samples(12, sizes=(10, 30)))
    png = samples[5]["png"]
    samples[5]["png"] = png[:80] + bytes(b ^ 0x5A for b in png[80:])
    write_shards(f"{d}/img-%03d.tar", samples, per_shard=6)
    vocab = GenerationVocab(tok.get_vocab_size(), K, (S // BLOCK, S // BLOCK))
    kw = dict(tokenizer=tok, epochs=None)
    sources = {
        "gen": WebDatasetSource(
            f"{d}/img-{{000..001}}.tar", modality="generation", name="gen", generation=vocab, **kw
        ),
        "img": WebDatasetSource(f"{d}/img-{{000..001}}.tar", modality="image", name="img", **kw),
    }
    loader = packed_loader(
        sources, {"gen": 0.5, "img": 0.5}, max_seq_len=128, buffer_size=8, packs_per_step=4
    )
    codes = ImageCodes(vocab, BlockGrey(), _to_input)
    with ZeroRedundancyFilter(
        loader,
        consumes={1, 2, 3, 4},
        microbatches=2,
        slices=2,
        reader=PayloadReader(tok, image_codes=codes),
        read_text=True,
        prefetch=0,
    ) as f:
        f.reset()
        seen, bad = 0, 0
        for _ in range(4):
            fs = next(f)
            mbs = split_encoder_microbatches(fs.packs, 2, 2)
            encoded = {fs.packs[p].samples[i].modality for items in mbs.values() for p, i in items}
            assert Modality.GENERATION not in encoded  # no encoder work anywhere
            for p, pack in enumerate(fs.packs):
                for i, s in enumerate(pack.samples):
                    if s.modality is Modality.GENERATION and s.key == "img000005":
                        assert fs.text_errors[(p, i)].startswith("undecodable image payload: ")
                        assert torch.equal(fs.text_ids[p][i], torch.zeros(s.text_tokens, dtype=torch.int64))
                        bad += 1
                    elif s.modality is Modality.GENERATION:
                        assert (p, i) not in fs.text_errors
                        ids = fs.text_ids[p][i]
                        assert ids.numel() == s.text_tokens and int(ids[-1]) == vocab.eoi
                        assert torch.equal(ids, f.reader.read_text_ids(s))
                        seen += 1
        assert seen > 0 and bad > 0
        assert f.image_code_encodes == seen  # the images turned into codes, the undecodable one not
        assert f.ledger.counts["gen"] == {"undecodable image payload": bad}  # the image source counts its own


def test_a_generation_source_or_reader_without_its_parts_is_refused(shards, tok):
    d, _ = shards
    with pytest.raises(ValueError, match=r"'gen': a generation source needs a tokenizer .* GenerationVocab"):
        _source(d, tok, None)
    vocab = GenerationVocab(tok.get_vocab_size(), K, (4, 4))
    src = _source(d, tok, vocab)
    src.reset()
    meta = next(iter(src))
    from omni_data import PayloadError

    with pytest.raises(PayloadError, match="generation sample needs a tokenizer and image_codes"):
        PayloadReader(tok).read_text_ids(meta)
    other = ImageCodes(GenerationVocab(tok.get_vocab_size(), K, (2, 2)), BlockGrey(), _to_input)
    with pytest.raises(PayloadError, match=r"metadata grid \(4, 4\), the image tokenizer's is \(2, 2\)"):
        PayloadReader(tok, image_codes=other).read_text_ids(meta)


def test_a_generation_source_on_video_shards_says_what_it_found(tmp_path, tok):
    """Finding: a generation source pointed at video shards skips every sample; the skip reason and the
    error name the source, the shard, what the samples hold and what a generation sample needs."""
    samples = [{"__key__": f"v{i}", "mp4": b"not read", "txt": "a clip"} for i in range(3)]
    write_shards(f"{tmp_path}/video-%03d.tar", samples, per_shard=3)
    vocab = GenerationVocab(tok.get_vocab_size(), K, (4, 4))
    src = WebDatasetSource(
        f"{tmp_path}/video-000.tar",
        modality="generation",
        name="gen",
        tokenizer=tok,
        generation=vocab,
        epochs=None,  # cycling: a whole epoch without a usable sample is an error
    )
    src.reset()
    from omni_data import EmptySourceError

    with pytest.raises(EmptySourceError) as e:
        next(iter(src))
    msg = str(e.value)
    assert "source 'gen'" in msg and f"{tmp_path}/video-000.tar" in msg, msg
    assert "{'missing image member, has video': 3}" in msg and "and a .txt caption: image shards" in msg, msg
