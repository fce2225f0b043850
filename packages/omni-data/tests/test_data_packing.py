"""HybridPacker: never over max_seq_len (hypothesis), exact coverage, cu_seqlens, overlong policies, and
per-sample logits of a tiny attention model identical packed vs unpacked (float64)."""

import itertools

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchdata.nodes import IterableWrapper

from omni_data import HybridPacker, Modality, OverlongSampleError, SampleMeta, collate_packs


def _meta(i, modality, media, text):
    return SampleMeta(f"k{i}", "s", Modality(modality), media, text, float(media), (max(media + text, 1),))


samples_st = st.lists(
    st.tuples(st.sampled_from(["image", "audio", "text"]), st.integers(0, 300), st.integers(0, 300)).filter(
        lambda t: t[1] + t[2] > 0 and (t[0] != "text" or t[1] == 0)
    ),
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(samples_st, st.integers(16, 400), st.integers(1, 40), st.integers(1, 6))
def test_packing_properties(raw, max_len, buffer, max_open):
    metas = [_meta(i, m, med if m != "text" else 0, t) for i, (m, med, t) in enumerate(raw)]
    packer = HybridPacker(IterableWrapper(metas), max_len, buffer, overlong="split", max_open_packs=max_open)
    packs = list(packer)
    got: dict[str, list] = {}
    for p in packs:
        assert 0 < p.num_tokens <= max_len
        cu = p.cu_seqlens.tolist()
        assert cu == [sum(s.num_tokens for s in p.samples[:i]) for i in range(len(p.samples) + 1)]
        pos = p.position_ids.tolist()
        assert pos == [j for s in p.samples for j in range(s.num_tokens)]
        for sp in p.spans:
            assert sp.start == cu[sp.sample] and sp.length == p.samples[sp.sample].media_tokens
        for s in p.samples:
            got.setdefault(s.key, []).append(s)
    kept = [m for m in metas if m.modality is Modality.TEXT or m.num_tokens <= max_len]
    assert sorted(got) == sorted(m.key for m in kept)  # every sample exactly once (text may be in pieces)
    for m in kept:
        pieces = got[m.key]
        if m.num_tokens <= max_len:
            assert pieces == [m]
        else:  # split text: pieces tile [0, text_tokens)
            ranges = sorted(p.text_range for p in pieces)
            assert ranges[0][0] == 0 and ranges[-1][1] == m.text_tokens
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    dropped = sum(1 for m in metas if m.modality is not Modality.TEXT and m.num_tokens > max_len)
    assert packer.stats["dropped_overlong"] == dropped
    assert packer.stats["tokens"] == sum(p.num_tokens for p in packs)


def test_overlong_policies():
    metas = [_meta(0, "image", 50, 0), _meta(1, "text", 0, 25), _meta(2, "image", 5, 3)]
    with pytest.raises(ValueError, match="max_open_packs"):
        HybridPacker(IterableWrapper(metas), 20, 4, max_open_packs=-1)
    with pytest.raises(OverlongSampleError, match="s/k0"):
        list(HybridPacker(IterableWrapper(metas), 20, 4, overlong="error"))
    p = HybridPacker(IterableWrapper(metas), 20, 4, overlong="drop")
    assert [s.key for pk in p for s in pk.samples] == ["k2"] and p.stats["dropped_overlong"] == 2
    p = HybridPacker(IterableWrapper(metas), 20, 4, overlong="split")
    keys = sorted(s.uid for pk in p for s in pk.samples)
    assert keys == ["s/k1@0", "s/k1@20", "s/k2"] and p.stats == {**p.stats, "split": 1, "dropped_overlong": 1}


def test_collate_batch_cu_seqlens():
    metas = [_meta(i, "text", 0, n) for i, n in enumerate([5, 3, 7, 2, 6])]
    packs = list(HybridPacker(IterableWrapper(metas), 10, 8))
    out = collate_packs(packs, pad_to=10)
    lens = []
    for p in packs:
        lens += [s.num_tokens for s in p.samples] + ([10 - p.num_tokens] if p.num_tokens < 10 else [])
    assert out["cu_seqlens"].tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    assert out["pack_offsets"].tolist() == [10 * i for i in range(len(packs) + 1)]
    assert out["position_ids"].tolist() == [j for n in lens for j in range(n)]
    with pytest.raises(ValueError, match="pad_to=4"):
        collate_packs(packs, pad_to=4)


def test_packer_resume_mid_buffer():
    metas = [
        _meta(i, "image" if i % 3 else "text", (i * 37) % 90 if i % 3 else 0, 1 + (i * 11) % 70)
        for i in range(400)
    ]
    full = [p.keys for p in HybridPacker(IterableWrapper(metas), 128, 32, max_open_packs=3)]
    a = HybridPacker(IterableWrapper(metas), 128, 32, max_open_packs=3)
    head = [next(a).keys for _ in range(17)]
    state = msgpack.unpackb(msgpack.packb(a.state_dict()), strict_map_key=False)
    assert state["buffer"] or state["open"] or state["ready"]  # resume with non-empty packing buffers
    b = HybridPacker(IterableWrapper(metas), 128, 32, max_open_packs=3)
    b.load_state_dict(state)
    assert head + [p.keys for p in b] == full


class _TinyAttention(torch.nn.Module):
    """One causal attention layer with learned absolute positions, float64."""

    def __init__(self, vocab=50, d=16, max_pos=64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(vocab, d, generator=g, dtype=torch.float64))
        self.pos = torch.nn.Parameter(torch.randn(max_pos, d, generator=g, dtype=torch.float64))
        self.qkv = torch.nn.Parameter(torch.randn(d, 3 * d, generator=g, dtype=torch.float64) / d**0.5)
        self.out = torch.nn.Parameter(torch.randn(d, vocab, generator=g, dtype=torch.float64))

    def forward(self, ids, position_ids, cu_seqlens):
        x = self.emb[ids] + self.pos[position_ids]
        q, k, v = (x @ self.qkv).chunk(3, dim=-1)
        n = ids.shape[0]
        seg = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), torch.diff(cu_seqlens.long()))
        mask = (seg[:, None] == seg[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
        att = (q @ k.T / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1)
        return (x + att @ v) @ self.out


def test_packed_logits_equal_unpacked():
    lens = [9, 3, 14, 6, 1, 11, 7, 5, 2, 8]
    metas = [_meta(i, "text", 0, n) for i, n in enumerate(lens)]
    g = torch.Generator().manual_seed(1)
    ids = {f"k{i}": torch.randint(0, 50, (n,), generator=g) for i, n in enumerate(lens)}
    model = _TinyAttention()
    packs = list(HybridPacker(IterableWrapper(metas), 20, 10))
    assert len(packs) < len(lens)
    checked = 0
    for p in packs:
        tokens = torch.cat([ids[s.key] for s in p.samples])
        logits = model(tokens, p.position_ids, p.cu_seqlens)
        cu = p.cu_seqlens.tolist()
        for j, s in enumerate(p.samples):
            alone = model(ids[s.key], torch.arange(s.num_tokens), torch.tensor([0, s.num_tokens]))
            torch.testing.assert_close(logits[cu[j] : cu[j + 1]], alone, rtol=1e-12, atol=1e-12)
            checked += 1
    assert checked == len(lens)
