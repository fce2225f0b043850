"""``DecoderStage`` (a slice of decoder layers as a pipeline stage over packed sequences) and
``image_patches`` (Qwen2-VL's patch layout), against brute force:

* the packed mask is, entry by entry, "same document and not in the future";
* a pack of three documents through a whole model equals each document run alone (float64, 1e-12), with
  media rows written over their placeholders;
* two stages built with ``from_causal_lm`` from a ``transformers``-style model (duck-typed here: any
  modules with the LLaMA-family calling convention) compose to the one-stage model, and together name
  its parameters exactly;
* every patch feature sits where the merge-window layout says it does.
"""

import pytest
import torch
from torch import nn

from omni_data import Modality, SampleMeta
from omni_data.payload import Payload
from omni_pipeline import DecoderStage, image_patches, packed_causal_mask

D, HEADS, VOCAB = 8, 2, 11


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class _Rotary(nn.Module):
    """``(x [1, T, D], position_ids [1, T]) -> (cos, sin) [1, T, head_dim]`` (RoPE, LLaMA's layout)."""

    def forward(self, x, position_ids):
        hd = D // HEADS
        inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class _Layer(nn.Module):
    """A pre-norm-free decoder layer with the ``transformers`` LLaMA-family calling convention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, dtype=torch.float64)
        self.o = nn.Linear(D, D, dtype=torch.float64)
        self.mlp = nn.Linear(D, D, dtype=torch.float64)

    def forward(self, h, attention_mask, position_ids, position_embeddings):
        _, t, _ = h.shape
        q, k, v = self.qkv(h).view(1, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        cos, sin = (x[:, None] for x in position_embeddings)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / (D // HEADS) ** 0.5 + attention_mask
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, t, D)
        h = h + self.o(out)
        return (h + torch.tanh(self.mlp(h)),)  # a tuple, as older transformers versions return


class _Body(nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D, dtype=torch.float64)
        self.layers = nn.ModuleList(_Layer() for _ in range(n_layers))
        self.norm = nn.LayerNorm(D, dtype=torch.float64)
        self.rotary_emb = _Rotary()


class _CausalLM(nn.Module):
    def __init__(self, n_layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _Body(n_layers)
        self.lm_head = nn.Linear(D, VOCAB, bias=False, dtype=torch.float64)


def test_packed_mask_is_same_document_and_causal():
    cu = torch.tensor([0, 2, 2, 5, 6])
    mask = packed_causal_mask(cu, torch.float64, torch.device("cpu"))[0, 0]
    doc = [0, 0, 2, 2, 2, 3]
    for t in range(6):
        for s in range(6):
            allowed = doc[t] == doc[s] and s <= t
            assert (mask[t, s] == 0) == allowed, (t, s)
            assert allowed or mask[t, s] == torch.finfo(torch.float64).min
    with pytest.raises(ValueError, match="start at 0"):
        packed_causal_mask(torch.tensor([1, 3]), torch.float64, torch.device("cpu"))


def test_a_pack_equals_its_documents_one_by_one():
    lm = _CausalLM()
    whole = DecoderStage.from_causal_lm(lm, range(0, 3))
    lengths = [4, 1, 5]
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, 4, 5, 10])
    rows = torch.tensor([1, 2, 6])
    media = torch.randn(3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = whole(ids, pos, cu, media, rows)
    assert got.shape == (10, VOCAB)
    embedded = lm.model.embed_tokens(ids).index_copy(0, rows, media)
    start = 0
    for n in lengths:  # brute force: each document alone, through the layers by hand
        h = embedded[start : start + n][None]
        p = torch.arange(n)[None]
        mask = torch.zeros(1, 1, n, n, dtype=torch.float64).masked_fill(
            torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")
        )
        for layer in lm.model.layers:
            h = layer(h, mask, p, lm.model.rotary_emb(h, p))[0]
        want = lm.lm_head(lm.model.norm(h[0]))
        assert torch.allclose(got[start : start + n], want, atol=1e-12, rtol=0)
        start += n


def test_rotary_and_layers_get_the_packs_per_document_positions():
    # RoPE alone is relative, so positions shifted by a document's offset would give the same outputs
    # above: check what the rotary module and each layer are given instead
    lm, seen = _CausalLM(2), []
    lm.model.rotary_emb.register_forward_pre_hook(lambda _m, args: seen.append(("rotary", args[1])))
    for layer in lm.model.layers:
        layer.register_forward_pre_hook(
            lambda _m, _a, kw: seen.append(("layer", kw["position_ids"])), with_kwargs=True
        )
    stage = DecoderStage.from_causal_lm(lm, range(0, 2))
    pos = torch.tensor([0, 1, 2, 0, 0, 1])
    stage(torch.arange(6), pos, torch.tensor([0, 3, 4, 6]))
    assert [name for name, _ in seen] == ["rotary", "layer", "layer"]
    for name, got in seen:
        assert torch.equal(got, pos[None]), name


def test_two_stages_compose_and_name_parameters_as_one():
    lm = _CausalLM()
    whole = DecoderStage.from_causal_lm(lm, range(0, 3))
    first, last = DecoderStage.from_causal_lm(lm, range(0, 2)), DecoderStage.from_causal_lm(lm, range(2, 3))
    assert first.head is None and last.embed is None
    names = {n for s in (first, last) for n, _ in s.named_parameters()}
    assert names == {n for n, _ in whole.named_parameters()}
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {"0", "1", "2"}
    ids, pos, cu = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 0, 1]), torch.tensor([0, 3, 5])
    h = first(ids, pos, cu, None, None)
    assert h.shape == (5, D)
    assert torch.equal(last(h, position_ids=pos, cu_seqlens=cu), whole(ids, pos, cu, None, None))
    with pytest.raises(ValueError, match="not a slice"):
        DecoderStage.from_causal_lm(lm, range(2, 4))
    with pytest.raises(ValueError, match="position_ids and cu_seqlens"):
        last(h)


def _image(uid: str, c: int, h: int, w: int, tokens: int, seed: int) -> Payload:
    meta = SampleMeta(uid, "image", Modality.IMAGE, tokens, 2, 0.0, (c, h, w))
    return Payload(meta, pixels=torch.rand(c, h, w, generator=torch.Generator().manual_seed(seed)))


def test_image_patches_follow_the_merge_window_layout():
    patch, merge, tp = 2, 2, 2
    images = [_image("a", 3, 8, 4, 2, 0), _image("b", 3, 4, 4, 1, 1)]
    batch = image_patches(images, patch=patch, merge=merge, temporal_patch=tp)
    patches, grid = batch.args
    assert grid.tolist() == [[1, 4, 2], [1, 2, 2]] and list(batch.rows) == [2, 1]
    assert patches.shape == (8 + 4, 3 * tp * patch * patch)
    n = 0
    for img, (_, gh, gw) in zip(images, grid.tolist()):
        for bh in range(gh // merge):
            for bw in range(gw // merge):
                for mh in range(merge):
                    for mw in range(merge):
                        y0, x0 = (bh * merge + mh) * patch, (bw * merge + mw) * patch
                        f = 0
                        for c in range(3):
                            for _t in range(tp):  # a still image: the same frame at every step
                                for py in range(patch):
                                    for px in range(patch):
                                        assert patches[n, f] == img.pixels[c, y0 + py, x0 + px]
                                        f += 1
                        n += 1
    assert n == patches.shape[0]
    with pytest.raises(ValueError, match="metadata says 3"):
        image_patches([_image("c", 3, 4, 4, 3, 2)], patch=patch, merge=merge)
    with pytest.raises(ValueError, match="not multiples"):
        image_patches([_image("d", 3, 6, 4, 1, 3)], patch=patch, merge=merge)
