"""PayloadReader's cache of split documents: every piece of a text longer than a pack gets exactly its
slice of the whole document's ids (oracle: the tokenizer run on the member's bytes as tarfile extracts
them), while the document is tokenized once instead of once per piece, within the cache's bound."""

import tarfile
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from torchdata.nodes import IterableWrapper

from omni_data import HybridPacker, PayloadError, PayloadReader, WebDatasetSource
from omni_data.testing import text_samples, train_tiny_bpe, write_shards


class CountingTokenizer:
    """The real tokenizer, counting ``encode`` calls."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def encode(self, text):
        self.calls += 1
        return self.tok.encode(text)


def _pieces(tmp_path, tok, max_len=32, words=(60, 160)):
    write_shards(f"{tmp_path}/t-%03d.tar", text_samples(6, seed=3, words=words), per_shard=6)
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


def test_a_cached_document_is_not_fetched_again(tmp_path):
    """Batched reads (remote stores): ``refs`` leaves out the txt of a document whose ids are cached, so
    its bytes are read once; the oracle is the members' sizes, one per document."""
    tok = train_tiny_bpe()
    metas, pieces = _pieces(tmp_path, tok)
    reader = PayloadReader(tok, batched="always")
    for s in pieces:
        refs = reader.refs(s, media=False)
        reader.read_text_ids(s, reader.fetch(refs) if refs else None)
    assert reader.stats["bytes"] == sum(r.size for m in metas for r in reader.refs(m, media=False))
    assert reader.stats["batched_ranges"] == len(metas)


def test_lru_order_and_a_document_over_the_bound(tmp_path):
    tok = train_tiny_bpe()
    metas, pieces = _pieces(tmp_path, tok, words=(20, 500))  # one document far longer than the rest
    by_len = sorted(metas, key=lambda m: m.text_tokens)
    a, b, c, big = (next(s for s in pieces if s.key == m.key) for m in (*by_len[:3], by_len[-1]))
    n = {m.key: m.text_tokens for m in metas}
    assert n[big.key] > n[b.key] + n[c.key]
    counting = CountingTokenizer(tok)
    reader = PayloadReader(counting, split_cache_tokens=n[b.key] + n[c.key])  # room for two of a, b, c
    for s in (a, b, a, c):  # the hit on a makes b the least recently used: c evicts b, not a
        reader.read_text_ids(s)
    assert counting.calls == 3
    reader.read_text_ids(big)  # more than the bound: read, not kept, and evicts nothing
    for s in (a, c):
        reader.read_text_ids(s)
    assert counting.calls == 4 and reader.stats["split_text_hits"] == 3
    reader.read_text_ids(b)
    assert counting.calls == 5


def test_returned_ids_are_not_the_cached_ones(tmp_path):
    tok = train_tiny_bpe()
    _, pieces = _pieces(tmp_path, tok)
    s = pieces[0]
    reader = PayloadReader(tok)
    first = reader.read_text_ids(s)
    want = first.tolist()
    first.fill_(-1)  # a consumer writing into its batch must not change what the next piece reads
    again = reader.read_text_ids(s)
    assert again.tolist() == want and reader.stats["split_text_hits"] == 1
    again.fill_(-1)
    assert reader.read_text_ids(s).tolist() == want


def test_two_threads_missing_the_same_document_hold_it_once(tmp_path):
    """Two decode threads that both miss a document both tokenize it (the barrier makes them meet
    inside ``encode``); the cache keeps one copy and counts its ids once, so the bound still holds."""
    tok = train_tiny_bpe()
    metas, pieces = _pieces(tmp_path, tok)
    m = min(metas, key=lambda m: m.text_tokens)
    two = [s for s in pieces if s.key == m.key][:2]
    barrier = threading.Barrier(2, timeout=30)

    class Meeting(CountingTokenizer):
        def encode(self, text):
            barrier.wait()
            return super().encode(text)

    reader = PayloadReader(Meeting(tok), split_cache_tokens=m.text_tokens)
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(reader.read_text_ids, two))
    truth = _truth(tok, m)
    assert [g.tolist() for g in got] == [truth[slice(*s.text_range)] for s in two]
    # held once: another document does not fit beside it, and the one held still serves a hit
    assert reader._split_held == m.text_tokens == sum(len(v) for v in reader._split_ids.values())
    barrier = threading.Barrier(1)
    reader.read_text_ids(two[0])
    assert reader.stats["split_text_hits"] == 1


def test_an_empty_document_is_not_kept_when_the_cache_is_off(tmp_path):
    tok = train_tiny_bpe()
    _, pieces = _pieces(tmp_path, tok)

    class Empty:  # another tokenizer than the metadata's: every text gives no ids
        def encode(self, text):
            return tok.encode("")

    reader = PayloadReader(Empty(), split_cache_tokens=0)
    for _ in range(2):
        with pytest.raises(PayloadError, match="text gives 0 tokens"):
            reader.read_text_ids(pieces[0])
    assert reader.stats["split_text_hits"] == 0 and not reader._split_ids
