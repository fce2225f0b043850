"""The bundled byte-level BPE tokenizer: exact round trip over all bundled text, stable special ids."""

from __future__ import annotations

import json
import re
from pathlib import Path

import webdataset as wds
from tokenizers import Tokenizer

from omni_train.data import MANIFEST_PATH, TOKENIZER_PATH, shard_paths
from omni_train.prepare.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE, train_tokenizer

APP_README = Path(__file__).resolve().parents[1] / "README.md"


def _bundled_texts() -> list[str]:
    paths = [str(p) for m in ("image", "audio", "text") for p in shard_paths(m)]
    return [s["txt"].decode("utf-8") for s in wds.WebDataset(paths, shardshuffle=False, empty_check=False)]


def test_round_trip_over_all_bundled_text():
    tok = Tokenizer.from_file(str(TOKENIZER_PATH))
    texts = _bundled_texts()
    assert len(texts) >= 1000
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    decoded = tok.decode_batch([e.ids for e in encodings], skip_special_tokens=False)
    bad = [t[:60] for t, d in zip(texts, decoded, strict=True) if t != d]
    assert not bad, f"{len(bad)} texts do not round-trip, e.g. {bad[:3]}"
    # text unseen in training, outside ASCII, still round-trips byte for byte
    for text in ("naïve café — 日本語 🎭\ttabs\n\n  spaces ", "", "<|image|> is special"):
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    ratio = sum(len(e.ids) for e in encodings) / sum(len(t.encode()) for t in texts)
    assert ratio < 0.35, f"{ratio:.3f} tokens per byte: BPE merges are not being used"


def test_special_tokens_and_vocab_size():
    tok = Tokenizer.from_file(str(TOKENIZER_PATH))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert SPECIAL_TOKENS == ("<|pad|>", "<|bos|>", "<|eos|>", "<|image|>", "<|audio|>")
    assert (
        tok.get_vocab_size() == VOCAB_SIZE == json.loads(MANIFEST_PATH.read_text())["tokenizer"]["vocab_size"]
    )
    assert tok.encode("<|image|><|audio|>").ids == [3, 4]
    stated = re.findall(r"vocabulary size\W*(\d+)", APP_README.read_text(), re.IGNORECASE)
    assert stated and {int(n) for n in stated} == {tok.get_vocab_size()}, (
        f"app README states vocabulary size {stated}, the tokenizer has {tok.get_vocab_size()}"
    )


def test_training_is_deterministic(tmp_path):
    corpus = _bundled_texts()[::7]
    a = train_tokenizer(corpus, tmp_path / "a.json", vocab_size=600)
    b = train_tokenizer(corpus, tmp_path / "b.json", vocab_size=600)
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert a.get_vocab_size() == 600 and [a.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert b.decode(b.encode(corpus[0]).ids) == corpus[0]
