"""M-RoPE positions of a pack (``omni_pipeline.mrope``) against hand-written ids: Qwen2-VL's example in
its ``get_rope_index`` docstring and the rule "text continues at the largest vision id + 1". Equality
with ``transformers``' own ``get_rope_index``: ``apps/omni-train/tests/test_train_hf_video.py``."""

import pytest
import torch

from omni_pipeline.mrope import MRopeDocument, mrope_documents, mrope_position_ids, vision_positions


def test_a_video_then_text_is_qwen2vls_example():
    # 3 temporal patches of 2 x 2 merged tokens (a 3 x 4 x 4 patch grid, merge 2), then 5 text tokens
    pos = mrope_position_ids([MRopeDocument(12, 5, (3, 4, 4))], merge=2)
    assert pos[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 4, 5, 6, 7]
    assert pos[1].tolist() == [0, 0, 1, 1] * 3 + [3, 4, 5, 6, 7]
    assert pos[2].tolist() == [0, 1, 0, 1] * 3 + [3, 4, 5, 6, 7]


def test_a_pack_restarts_per_sample_and_text_and_audio_are_1d():
    docs = [
        MRopeDocument(6, 2, (1, 4, 6)),  # an image: 2 x 3 merged tokens, text from max(2, 3) = 3
        MRopeDocument(0, 4),  # text
        MRopeDocument(3, 1),  # audio: 1-D over its frames and text
        MRopeDocument(4, 1, (4, 2, 2)),  # a long clip at one token per slice: text from t = 4
    ]
    pos = mrope_position_ids(docs, merge=2)
    assert pos.shape == (3, 8 + 4 + 4 + 5)
    assert pos[:, :8].tolist() == [
        [0, 0, 0, 0, 0, 0, 3, 4],
        [0, 0, 0, 1, 1, 1, 3, 4],
        [0, 1, 2, 0, 1, 2, 3, 4],
    ]
    assert all(r == [0, 1, 2, 3] for r in pos[:, 8:12].tolist())
    assert all(r == [0, 1, 2, 3] for r in pos[:, 12:16].tolist())
    assert pos[:, 16:].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 4], [0, 0, 0, 0, 4]]


def test_vision_positions_follow_the_merger_order():
    got = vision_positions((2, 2, 4), merge=2, start=7)
    want = [(7 + t, 7 + 0, 7 + w) for t in range(2) for w in range(2)]
    assert [tuple(c) for c in got.T.tolist()] == want


def test_bad_documents_are_refused_naming_them():
    with pytest.raises(ValueError, match="gives 6 merged tokens"):
        mrope_position_ids([MRopeDocument(5, 1, (1, 4, 6))], merge=2)
    with pytest.raises(ValueError, match="multiples of merge 2"):
        vision_positions((1, 3, 4), merge=2)
    assert mrope_position_ids([], merge=2).shape == (3, 0)
    assert mrope_position_ids([MRopeDocument(0, 3)], merge=2).dtype == torch.int64


def test_documents_from_pack_metadata():
    from omni_data.sample import Modality, SampleMeta

    image = SampleMeta("a", "img", Modality.IMAGE, 6, 2, 0.0, (3, 56, 84))
    text = SampleMeta("b", "txt", Modality.TEXT, 0, 4, 0.0, (4,))
    # a video's metadata, as omni-data writes it: (frames, 3, H, W); 5 frames -> 3 temporal patches
    video = SampleMeta("c", "vid", Modality.VIDEO, 3, 1, 0.0, (5, 3, 28, 28))
    docs = mrope_documents([image, text, video], patch=14, merge=2, temporal_patch=2)
    assert docs == [MRopeDocument(6, 2, (1, 4, 6)), MRopeDocument(0, 4), MRopeDocument(3, 1, (3, 2, 2))]
    bad = SampleMeta("d", "img", Modality.IMAGE, 5, 2, 0.0, (3, 56, 84))
    with pytest.raises(ValueError, match=r"sample img/d: .* gives 6 merged tokens"):
        mrope_documents([bad], patch=14, merge=2, temporal_patch=2)
    odd = SampleMeta("e", "img", Modality.IMAGE, 6, 2, 0.0, (3, 56, 70))
    with pytest.raises(ValueError, match="sample img/e: image shape"):
        mrope_documents([odd], patch=14, merge=2, temporal_patch=2)
