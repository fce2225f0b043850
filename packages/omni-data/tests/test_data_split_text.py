"""PayloadReader's cache of split documents: every piece of a text longer than a pack gets exactly its
slice of the whole document's ids (oracle: the tokenizer run on the member's bytes as tarfile extracts
them), while the document is tokenized once instead of once per piece, within the cache's bound."""

import tarfile

import pytest
from torchdata.nodes import IterableWrapper

from omni_data import HybridPacker, PayloadReader, WebDatasetSource
from omni_data.testing import text_samples, train_tiny_bpe, write_shards


class CountingTokenizer:
    """The real tokenizer, counting ``encode`` calls."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def encode(self, text):
        self.calls += 1
        return self.tok.encode(text)


def _pieces(tmp_path, tok, max_len=32):
    write_shards(f"{tmp_path}/t-%03d.tar", text_samples(6, seed=3, words=(60, 160)), per_shard=6)
    metas = list(WebDatasetSource(f"{tmp_path}/t-000.tar", modality="text", tokenizer=tok))
    packs = list(HybridPacker(IterableWrapper(metas), max_len, 4, overlong="split"))
    pieces = [s for p in packs for s in p.samples]
    assert all(s.text_range is not None for s in pieces)  # every document here is longer than a pack
    return metas, pieces


def _truth(tok, meta):
    (ref,) = [r for ext, r in meta.members.items() if ext == "txt"]
    with tarfile.open(ref.url.removeprefix("file://")) as tf:
        member = next(x for x in tf.getmembers() if x.offset_data == ref.offset)
        return tok.encode(tf.extractfile(member).read().decode("utf-8")).ids


def test_every_piece_gets_its_slice_and_each_document_is_tokenized_once(tmp_path):
    tok = train_tiny_bpe()
    metas, pieces = _pieces(tmp_path, tok)
    truth = {m.key: _truth(tok, m) for m in metas}
    counting = CountingTokenizer(tok)
    reader = PayloadReader(counting)
    for s in pieces:  # in the order the packs hold them: pieces of several documents interleave
        a, b = s.text_range
        assert reader.read_text_ids(s).tolist() == truth[s.key][a:b], s.uid
    assert counting.calls == len(metas) < len(pieces)
    assert reader.stats["split_text_hits"] == len(pieces) - len(metas)

    off = CountingTokenizer(tok)  # the cache off: the old cost, one tokenization per piece
    reader = PayloadReader(off, split_cache_tokens=0)
    for s in pieces:
        a, b = s.text_range
        assert reader.read_text_ids(s).tolist() == truth[s.key][a:b], s.uid
    assert off.calls == len(pieces) and reader.stats["split_text_hits"] == 0


def test_cache_keeps_at_most_its_token_bound(tmp_path):
    tok = train_tiny_bpe()
    metas, pieces = _pieces(tmp_path, tok)
    lengths = {m.key: m.text_tokens for m in metas}
    first, second = sorted(lengths, key=lengths.get)[:2]
    a = [s for s in pieces if s.key == first][:2]
    b = [s for s in pieces if s.key == second][:2]
    order = [a[0], b[0], a[1], b[1]]  # A B A B
    # room for the larger of the two but not both: each read evicts the other document
    counting = CountingTokenizer(tok)
    reader = PayloadReader(counting, split_cache_tokens=lengths[second])
    for s in order:
        reader.read_text_ids(s)
    assert counting.calls == 4 and reader.stats["split_text_hits"] == 0
    # room for both: the second pieces come from the cache
    counting = CountingTokenizer(tok)
    reader = PayloadReader(counting, split_cache_tokens=lengths[first] + lengths[second])
    for s in order:
        reader.read_text_ids(s)
    assert counting.calls == 2 and reader.stats["split_text_hits"] == 2
    with pytest.raises(ValueError, match="split_cache_tokens"):
        PayloadReader(tok, split_cache_tokens=-1)
