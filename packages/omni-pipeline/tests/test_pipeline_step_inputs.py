"""Packs to tensors (``omni_pipeline.microbatch``, ``omni_pipeline.loss``): labels and targets against a
brute-force reading of the token layout; masking of samples whose payload did not decode; the loss
normalisation against a hand-computed cross-entropy; samples whose payload did not decode
(``undecodable_samples``); one step through ``StepBuilder`` and the executor against the model run by hand."""

import torch
from torch import nn

from omni_data import Modality, Pack, SampleMeta
from omni_data.payload import Payload
from omni_data.zero_redundancy import FilteredStep
from omni_pipeline import (
    IGNORE,
    MODALITIES,
    EncoderAnchor,
    ModalityRouter,
    PipelineExecutor,
    Schedule1F1B,
    StepBuilder,
    StepSpec,
    TowerBatch,
    build_llm_microbatch,
    microbatch_loss,
    step_targets,
    undecodable_samples,
    uniform_on_demand,
)

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
    assert stats[:, 1].tolist() == [2.0, 3.0, 3.0, 0.0, 0.0]  # image, audio, text, video, generation
    assert abs(stats[:, 0].sum().item() - sum(ce)) < 1e-12


def test_undecodable_samples_are_those_with_a_payload_error():
    pack = _pack()
    ok = Payload(pack.samples[0], pixels=torch.zeros(3, 28, 28))
    bad = Payload(pack.samples[2], waveform=torch.zeros(1600), sample_rate=16000, error="truncated flac")
    fs = FilteredStep(0, [pack, pack], {1: [(0, 0)], 2: [(0, 2)], 3: [(1, 2)]}, {1: [ok], 3: [bad]}, [])
    assert undecodable_samples(fs) == [(1, 2)]  # encoder microbatch 2 was not read on this rank


class _Stage(nn.Module):
    """Stage 0 = last stage: embed the ids, write the media rows over their placeholders, project."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.embed = nn.Parameter(torch.randn(64, 4, generator=g, dtype=torch.float64))
        self.head = nn.Parameter(torch.randn(4, 64, generator=g, dtype=torch.float64))

    def forward(self, ids, position_ids, cu_seqlens, media, rows):
        h = self.embed[ids]
        if media is not None:
            h = h.index_copy(0, rows, media)
        return h @ self.head


def test_step_builder_runs_a_step_equal_to_brute_force():
    """One process, a pack of image + text + audio samples: the executor's loss through the bridge equals
    the cross-entropy of the model run by hand on the same pack (float64, <= 1e-12)."""
    pack = _pack()
    g = torch.Generator().manual_seed(4)
    payloads = [
        Payload(pack.samples[0], pixels=torch.rand(3, 4, generator=g, dtype=torch.float64)),
        Payload(pack.samples[2], waveform=torch.rand(2, 4, generator=g, dtype=torch.float64)),
    ]
    tower = nn.Linear(4, 4, dtype=torch.float64)

    def inputs(ps):
        xs = [(p.pixels if p.pixels is not None else p.waveform).reshape(-1, 4) for p in ps]
        return TowerBatch((torch.cat(xs),), [x.shape[0] for x in xs])

    encoders = ModalityRouter({"image": tower, "audio": tower}, {"image": inputs, "audio": inputs}, 4)
    text = {k: v % 64 for k, v in _text_ids().items()}
    fs = FilteredStep(0, [pack], {1: [(0, 0), (0, 2)]}, {1: payloads}, [list(text.values())])
    schedule = Schedule1F1B(1, 1)
    flow = uniform_on_demand(schedule, {1: [1]})
    spec = StepSpec({Modality.IMAGE: IMG % 64, Modality.AUDIO: AUD % 64}, 4, torch.float64)
    builder = StepBuilder(spec, schedule=schedule, flow=flow, encoders=encoders)
    step = builder.build(fs)
    media = [sp.start + t for sp in pack.spans for t in range(sp.length)]
    assert step.media_positions[1].tolist() == media and step.targets == step_targets([pack]) == 8
    assert step.plan.llm_shapes == {1: (pack.num_tokens, 4)} and step.plan.encoder_shapes == {1: (5, 4)}
    stage = _Stage()
    executor = PipelineExecutor({0: stage}, EncoderAnchor({"t": tower}), None)
    result = executor.step(step.plan, step.encoder_work, functions=builder.functions(step))
    mb = build_llm_microbatch(pack, text, spec.placeholders)
    logits = stage(mb.input_ids, None, None, encoders(payloads), torch.tensor(media))
    want = nn.functional.cross_entropy(logits, mb.labels, ignore_index=IGNORE, reduction="sum") / 8
    assert abs(result.loss - float(want.detach())) <= 1e-12
