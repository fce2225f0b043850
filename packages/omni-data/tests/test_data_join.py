"""JoinDocuments (consecutive parts of one document joined into one long text sample) and the
zero-redundancy filter's ``share`` / ``text_share`` (a rank reads only its part), on real shards.

Oracles: the joined sample's token ids equal the concatenation of its parts' ids read one by one (the
plain reader on the unjoined samples); the narrowed filter's payloads equal the corresponding subset of
an unnarrowed filter's, read by the same code on the same step.
"""

import msgpack
import pytest

from omni_data import (
    JoinDocuments,
    PayloadReader,
    WebDatasetSource,
    ZeroRedundancyFilter,
    document_part,
    text_members,
)
from omni_data.testing import (
    image_samples,
    packed_loader,
    text_samples,
    train_tiny_bpe,
    webdataset_sources,
    write_shards,
)

# Interleaved parts (as the bundled Shakespeare shards store plays), a gap in docC, a key without a part
# index, and a long docD that max_tokens cuts into runs.
KEYS = ["docA-000", "docB-000", "docA-001", "loose", "docB-001", "docA-002", "docC-000", "docC-002"]
KEYS += [f"docD-{i:03d}" for i in range(6)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("join")
    texts = [dict(t, __key__=k) for t, k in zip(text_samples(len(KEYS), words=(5, 40)), KEYS)]
    write_shards(f"{d}/doc-%03d.tar", texts, per_shard=len(KEYS))
    write_shards(f"{d}/img-%03d.tar", image_samples(12, sizes=(16, 40)), per_shard=12)
    write_shards(f"{d}/txt-%03d.tar", text_samples(12, words=(5, 30)), per_shard=12)
    return str(d), train_tiny_bpe()


def _source(d, tok):
    return WebDatasetSource(f"{d}/doc-000.tar", modality="text", name="doc", tokenizer=tok, epochs=1)


def test_join_documents_joins_consecutive_parts_and_resumes(data):
    d, tok = data
    plain = _source(d, tok)
    plain.reset()
    parts = {s.key: s for s in plain}
    limit = sum(parts[f"docD-{i:03d}"].text_tokens for i in range(3))  # docD: runs of three parts
    join = JoinDocuments(_source(d, tok), limit, window=16)
    join.reset()
    out = list(join)
    keys = [s.key for s in out]
    assert keys[:2] == ["docA-000+3", "docB-000+2"]
    assert {"loose", "docC-000", "docC-002", "docD-000+3"} <= set(keys)  # the gap in docC stays apart
    # docD: maximal runs of consecutive parts, each within max_tokens
    runs = [s for s in out if s.key.startswith("docD")]
    tokens = [parts[f"docD-{i:03d}"].text_tokens for i in range(6)]
    at = 0
    for s in runs:
        n = int(s.key.split("+")[1]) if "+" in s.key else 1
        assert s.key.split("+")[0] == f"docD-{at:03d}" and s.text_tokens == sum(tokens[at : at + n]) <= limit
        assert at + n == 6 or s.text_tokens + tokens[at + n] > limit
        at += n
    assert at == 6
    reader = PayloadReader(tok)
    for s in out:
        stem = document_part(s.key.split("+")[0])
        n = int(s.key.split("+")[1]) if "+" in s.key else 1
        names = [s.key] if stem is None else [f"{stem[0]}-{stem[1] + i:03d}" for i in range(n)]
        assert len(text_members(s)) == n and s.text_tokens == sum(parts[k].text_tokens for k in names)
        want = [i for k in names for i in reader.read_text_ids(parts[k]).tolist()]
        assert reader.read_text_ids(s).tolist() == want
    assert join.stats["documents"] == sum("+" in k for k in keys)
    # resume after the first output: the rest come out the same
    again = JoinDocuments(_source(d, tok), limit, window=16)
    again.reset()
    next(again)
    state = msgpack.unpackb(msgpack.packb(again.state_dict()), strict_map_key=False)
    resumed = JoinDocuments(_source(d, tok), limit, window=16)
    resumed.load_state_dict(state)
    assert [s.key for s in resumed] == keys[1:]
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        JoinDocuments(_source(d, tok), 0)


def _filter(d, tok, **kw):
    src = webdataset_sources(
        {"img": (f"{d}/img-000.tar", "image"), "txt": (f"{d}/txt-000.tar", "text")},
        tokenizer=tok,
        epochs=None,
    )
    loader = packed_loader(src, {"img": 0.6, "txt": 0.4}, 96, 12, 2)
    zr = ZeroRedundancyFilter(
        loader, [1, 2], microbatches=2, slices=1, reader=PayloadReader(tok), read_text=True, **kw
    )
    zr.reset()
    return zr


def test_filter_share_and_text_share_read_only_this_ranks_part(data):
    d, tok = data

    def share(packs, mbs):  # keep every other sample of each encoder microbatch
        return {e: items[::2] for e, items in mbs.items()}

    def text_share(packs):
        return {(p, i) for p, pack in enumerate(packs) for i in range(len(pack.samples)) if i % 2 == 1}

    full, part = _filter(d, tok), _filter(d, tok, share=share, text_share=text_share)
    for _ in range(2):
        a, b = next(full), next(part)
        assert [p.to_dict() for p in a.packs] == [p.to_dict() for p in b.packs]
        for e, items in a.microbatches.items():
            assert b.microbatches[e] == items[::2]
            got = [(p.meta.uid, p.pixels.numpy().tobytes()) for p in b.payloads[e]]
            assert got == [(p.meta.uid, p.pixels.numpy().tobytes()) for p in a.payloads[e][::2]]
        for p, row in enumerate(b.text_ids):
            for i, ids in enumerate(row):
                if i % 2:
                    assert ids is None or ids.tolist() == a.text_ids[p][i].tolist()
                else:
                    assert ids is None  # not this rank's sample: never read
    assert 0 < part.samples_read < full.samples_read
    full.close()
    part.close()
