"""MixtureSchedule / MixtureStream: realised shares within 0.5 pp of the schedule in every 10,000 window."""

import msgpack
import pytest
from torchdata.nodes import IterableWrapper

from omni_data import EmptySourceError, MixtureSchedule, MixtureStream, Modality, SampleMeta
from omni_data.testing import SyntheticSource


def _check_windows(picks, expected, window=10_000, stride=1_000, tol=0.005):
    names = sorted(set(expected[0]))
    for start in range(0, len(picks) - window + 1, stride):
        for n in names:
            share = sum(1 for p in picks[start : start + window] if p == n) / window
            want = sum(e[n] for e in expected[start : start + window]) / window
            assert abs(share - want) <= tol, (start, n, share, want)


@pytest.mark.parametrize("interpolate", [False, True])
def test_shares_track_schedule_by_step(interpolate):
    sched = MixtureSchedule(
        [
            (0, {"a": 0.5, "b": 0.3, "c": 0.2}),
            (30, {"a": 0.1, "b": 0.1, "c": 0.8}),
            (60, {"a": 1, "b": 1, "c": 1}),
        ],
        interpolate=interpolate,
    )
    mix = MixtureStream({n: SyntheticSource(n) for n in "abc"}, sched)
    picks, expected = [], []
    for step in range(80):
        mix.set_step(step)
        for _ in range(500):  # 500 samples per step
            picks.append(next(mix).source)
            expected.append(sched.weights(step))
    _check_windows(picks, expected)


def test_token_unit_and_resume():
    sched = MixtureSchedule([(0, {"a": 0.9, "b": 0.1}), (50_000, {"a": 0.2, "b": 0.8})], unit="token")

    def make():
        return MixtureStream(
            {"a": SyntheticSource("a", tokens=(10, 10)), "b": SyntheticSource("b", tokens=(30, 30))}, sched
        )

    full = [next(m).key for m in [make()] for _ in range(6000)]
    a = make()
    head = [next(a).key for _ in range(2500)]
    state = msgpack.unpackb(msgpack.packb(a.state_dict()), strict_map_key=False)
    b = make()
    b.load_state_dict(state)
    assert head + [next(b).key for _ in range(3500)] == full
    # before 50,000 tokens 90% a; after, 20%
    assert full[:100].count("a1") == 1 and sum(k.startswith("a") for k in full[:1000]) == 900


def test_schedule_errors_and_exhaustion():
    with pytest.raises(ValueError, match="first at position 0"):
        MixtureSchedule([(5, {"a": 1})])
    with pytest.raises(ValueError, match="increase"):
        MixtureSchedule([(0, {"a": 1}), (0, {"a": 1})])
    with pytest.raises(ValueError, match="names"):
        MixtureSchedule([(0, {"a": 1}), (3, {"b": 1})])
    with pytest.raises(ValueError, match="not all 0"):
        MixtureSchedule([(0, {"a": 0.0})])
    metas = [SampleMeta(f"x{i}", "x", Modality.TEXT, 0, 1, 0.0, (1,)) for i in range(3)]
    mix = MixtureStream(
        {"x": IterableWrapper(metas), "y": IterableWrapper([])}, MixtureSchedule.constant({"x": 1, "y": 1})
    )
    next(mix)
    with pytest.raises(EmptySourceError, match="'y'"):
        next(mix)
    mix = MixtureStream({"x": IterableWrapper(metas)}, MixtureSchedule.constant({"x": 1}))
    assert len(list(mix)) == 3  # an exhausted source ends the stream; its weight is never zeroed
