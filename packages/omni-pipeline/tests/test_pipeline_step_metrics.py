"""The step metrics' encoder balance (``encoder_load``, ``encoder_imbalance``: the in-order split against
hand-computed FLOPs per rank), a step's time by phase (``step_phases`` against hand-summed seconds of a
timeline) and the spec's range check."""

import pytest

from omni_data import Modality, Pack, SampleMeta, split_encoder_microbatches
from omni_pipeline.executor import StepResult
from omni_pipeline.step_metrics import (
    PHASES,
    EncoderShape,
    StepMetricsSpec,
    encoder_imbalance,
    encoder_load,
    step_phases,
)
from omni_pipeline.trace import TimelineEvent


def _meta(key, modality, media, text, flops=0.0):
    shape = (3, 28, 28) if modality is Modality.IMAGE else (1600,) if modality is Modality.AUDIO else (text,)
    return SampleMeta(key, str(modality), modality, media, text, flops, shape)


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


def test_in_order_split_and_imbalance():
    packs = [_pack(), _pack()]
    mbs = split_encoder_microbatches(packs, 2, 2, balance=False)
    assert mbs == {1: [(0, 0)], 2: [(0, 2)], 3: [(1, 0)], 4: [(1, 2)]}
    load = encoder_load(packs, mbs, {1: 0, 2: 1, 3: 0, 4: 1}, 2)
    assert load == {1: [5.0, 1.0], 2: [5.0, 1.0]}
    assert abs(encoder_imbalance(load) - 5.0 / 3.0) < 1e-12
    assert encoder_imbalance({1: [0.0, 0.0]}) is None
    assert encoder_imbalance({1: [0.0, 0.0], 2: [0.0, 4.0]}) == 2.0


def test_the_spec_names_what_is_out_of_range():
    spec = StepMetricsSpec(2, 64, 16, 2, encoders={"image": EncoderShape(8, 2, 4)})
    assert spec.encoders["image"].tokens_per_media_token == 4
    with pytest.raises(ValueError, match="microbatches"):
        StepMetricsSpec(0, 64, 16, 2)
    with pytest.raises(ValueError, match="max_seq_len"):
        StepMetricsSpec(2, 0, 16, 2)


def test_a_steps_phases_are_its_actions_waits_and_measured_seconds_and_sum_to_its_wall_time():
    timeline = [
        TimelineEvent(0, "EF1", "EF", 0.0, 0.5),
        TimelineEvent(0, "0F0", "F", 0.5, 1.25),
        TimelineEvent(0, "0B0", "B", 1.5, 2.5),
        TimelineEvent(0, "EB1", "EB", 2.5, 2.75),
    ]
    result = StepResult({1: 2.0}, {1: {}}, timeline, waits={"0B0": 0.25}, reduce_s=0.5, reduce_wait_s=0.125)
    got = step_phases(result, 5.0, {"data": 0.75, "optimizer": 0.375, "checkpoint": 0.0625})
    assert got == {
        "data": 0.75,
        "encoder": 0.75,
        "llm": 1.75,
        "p2p_wait": 0.25,
        "reduce_wait": 0.125,
        "grad_reduce": 0.375,
        "optimizer": 0.375,
        "checkpoint": 0.0625,
        "other": 5.0 - (0.75 + 0.75 + 1.75 + 0.25 + 0.125 + 0.375 + 0.375 + 0.0625),
    }
    assert tuple(got) == PHASES and sum(got.values()) == 5.0
