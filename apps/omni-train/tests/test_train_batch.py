"""Packs to tensors: labels and targets against a brute-force reading of the token layout; masking of
samples whose payload did not decode; the in-order split's imbalance; the loss normalisation."""

import torch

from omni_data import Modality, Pack, SampleMeta, split_encoder_microbatches
from omni_train.batch import IGNORE, MODALITIES, build_llm_microbatch, step_targets
from omni_train.data_pipeline import encoder_imbalance, encoder_load, mixture_schedule
from omni_train.loss import microbatch_loss

IMG, AUD = 900, 901


def _meta(key, modality, media, text, flops=0.0):
    shape = (3, 28, 28) if modality is Modality.IMAGE else (1600,) if modality is Modality.AUDIO else (text,)
    return SampleMeta(key, str(modality), modality, media, text, flops, shape)


def _text_ids() -> dict[str, torch.Tensor]:
    """Token ids of each sample of :func:`_pack` (caption, passage, transcript, passage)."""
    return {
        "image/a": torch.tensor([11, 12]),
        "text/b": torch.tensor([21, 22, 23, 24]),
        "audio/c": torch.tensor([31, 32, 33]),
        "text/d": torch.tensor([41]),
    }


def _pack():
    return Pack(
        [
            _meta("a", Modality.IMAGE, 3, 2, 5.0),
            _meta("b", Modality.TEXT, 0, 4),
            _meta("c", Modality.AUDIO, 2, 3, 1.0),
            _meta("d", Modality.TEXT, 0, 1),
        ],
        32,
    )


def test_labels_match_brute_force():
    pack = _pack()
    text = _text_ids()
    mb = build_llm_microbatch(pack, text, {Modality.IMAGE: IMG, Modality.AUDIO: AUD})
    want_ids = [IMG] * 3 + [11, 12] + [21, 22, 23, 24] + [AUD] * 2 + [31, 32, 33] + [41]
    assert mb.input_ids.tolist() == want_ids
    # brute force: position t predicts t+1 if t+1 is in the same sample and is a text token
    bounds = mb.cu_seqlens.tolist()
    media = {0: 3, 1: 0, 2: 2, 3: 0}
    want = []
    for t in range(len(want_ids)):
        d = max(i for i in range(4) if bounds[i] <= t)
        nxt = t + 1
        ok = nxt < bounds[d + 1] and nxt - bounds[d] >= media[d]
        want.append(want_ids[nxt] if ok else IGNORE)
    assert mb.labels.tolist() == want
    assert mb.num_targets == step_targets([pack]) == 2 + 3 + 3 + 0
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 4, 0]
    assert [sp.start for sp in mb.spans] == [0, 9]
    assert mb.label_modality.tolist()[:5] == [MODALITIES.index(Modality.IMAGE)] * 5


def test_masked_sample_has_no_targets_and_leaves_the_rest_alone():
    pack = _pack()
    text = _text_ids()
    ph = {Modality.IMAGE: IMG, Modality.AUDIO: AUD}
    full = build_llm_microbatch(pack, text, ph)
    for j in range(4):  # mask each sample in turn: its positions lose their labels, nothing else changes
        mb = build_llm_microbatch(pack, text, ph, masked={j})
        lo, hi = full.cu_seqlens[j].item(), full.cu_seqlens[j + 1].item()
        want = full.labels.clone()
        want[lo:hi] = IGNORE
        assert mb.labels.tolist() == want.tolist() and mb.input_ids.tolist() == full.input_ids.tolist()
        assert mb.num_targets == step_targets([pack, pack], masked={(1, j)}) - step_targets([pack])
    assert step_targets([pack, pack], masked={(0, 0), (1, 2)}) == 2 * 8 - 2 - 3


def test_loss_is_mean_over_step_targets_and_splits_by_modality():
    pack = _pack()
    text = {
        "image/a": torch.tensor([1, 2]),
        "text/b": torch.tensor([3, 4, 5, 6]),
        "audio/c": torch.tensor([7, 8, 9]),
        "text/d": torch.tensor([1]),
    }
    mb = build_llm_microbatch(pack, text, {Modality.IMAGE: 0, Modality.AUDIO: 0})
    logits = torch.randn(mb.num_tokens, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    loss, stats = microbatch_loss(logits, mb, step_targets=16)
    ce = [
        -torch.log_softmax(logits[t], -1)[y].item() for t, y in enumerate(mb.labels.tolist()) if y != IGNORE
    ]
    assert abs(loss.item() - sum(ce) / 16) < 1e-12
    assert stats[:, 1].tolist() == [2.0, 3.0, 3.0]
    assert abs(stats[:, 0].sum().item() - sum(ce)) < 1e-12


def test_in_order_split_and_imbalance():
    packs = [_pack(), _pack()]
    mbs = split_encoder_microbatches(packs, 2, 2, balance=False)
    assert mbs == {1: [(0, 0)], 2: [(0, 2)], 3: [(1, 0)], 4: [(1, 2)]}
    load = encoder_load(packs, mbs, {1: 0, 2: 1, 3: 0, 4: 1}, 2)
    assert load == {1: [5.0, 1.0], 2: [5.0, 1.0]}
    assert abs(encoder_imbalance(load) - 5.0 / 3.0) < 1e-12
    assert encoder_imbalance({1: [0.0, 0.0]}) is None
    assert encoder_imbalance({1: [0.0, 0.0], 2: [0.0, 4.0]}) == 2.0


def test_mixture_phases_become_schedule_points(tmp_path):
    from train_fixtures import make_dataset, write_config

    from omni_train.config import load_config

    d = make_dataset(tmp_path, n_image=2, n_audio=2, n_text=2)
    sched = mixture_schedule(load_config(str(write_config(tmp_path / "c.toml", d))))
    assert sched.positions == [0, 3]
    assert sched.weights(2) == {"image": 0.5, "audio": 0.2, "text": 0.3}
    assert sched.weights(3) == {"image": 0.3, "audio": 0.4, "text": 0.3}
