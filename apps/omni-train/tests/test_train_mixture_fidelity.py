"""The mixture the trainer trains on: the per-source share of the samples in the packs of the steps the
trainer's own loader stream emits (``build_step_stream`` from a run config: its mixture phases, packer
and loader settings), against the config's weights at the step each sample is trained in, over sliding
10,000-sample windows. Two phases and a smooth (interpolated) schedule stay within 0.5 percentage points;
after a sharp 1 -> 0 switch the old source is trained at the switch step at the latest (omni-data README,
"Mixture fidelity"). At packer buffers 8 to 1024 (the trainer's configs use 8-64; 1024 is where plain
best-fit decreasing left packs of only small samples, 0.6-1.1 pp off). Metadata only (``SyntheticSource``),
no model, no shards.

The oracle reads the weights straight from the config (phase table, linear interpolation written out
here), not through the trainer's ``mixture_schedule``.
"""

import pytest
from mixture_oracle import TOKENS, fidelity_config, scheduled_weights, synthetic_stream

from omni_data.testing import trained_sources

WINDOW, STRIDE, SAMPLES = 10_000, 500, 26_000
BUFFERS = [8, 64, 256, 1024]


def _config(mixture, *, interpolate=False, buffer_size=256):
    return fidelity_config("fidelity", mixture, interpolate=interpolate, buffer_size=buffer_size)


def _want(cfg, step):
    """The config's normalised weights at ``step``, computed from its phases directly."""
    return scheduled_weights(cfg, step, "until_step")


def _trained(cfg, samples):
    """``[(step, source)]`` of every sample in the packs the trainer's stream emits, in training order."""
    return trained_sources(synthetic_stream(cfg), samples)


def _worst_window_error(cfg, trained):
    """Largest ``|realised share - scheduled weight|`` of any source over windows of ``WINDOW`` samples."""
    want = {step: _want(cfg, step) for step in {s for s, _ in trained}}
    worst, windows = 0.0, 0
    for name in TOKENS:
        got, exp = [0], [0.0]  # prefix sums over the trained order
        for step, s in trained:
            got.append(got[-1] + (s == name))
            exp.append(exp[-1] + want[step][name])
        starts = range(0, len(trained) - WINDOW + 1, STRIDE)
        windows = len(starts)
        for a in starts:
            share = (got[a + WINDOW] - got[a]) / WINDOW
            worst = max(worst, abs(share - (exp[a + WINDOW] - exp[a]) / WINDOW))
    assert windows >= 30  # the windows cover both sides of the schedule change
    return worst


TWO_PHASE = [
    {"until_step": 40, "weights": {"img": 0.6, "aud": 0.3, "txt": 0.1}},
    {"weights": {"img": 0.2, "aud": 0.4, "txt": 0.4}},
]
SMOOTH_POINTS = [
    {"until_step": 80, "weights": {"img": 0.6, "aud": 0.3, "txt": 0.1}},
    {"weights": {"img": 0.1, "aud": 0.3, "txt": 0.6}},
]
SHARP = [{"until_step": 40, "weights": {"img": 0.5, "aud": 0.5}}, {"weights": {"aud": 0.5, "txt": 0.5}}]


@pytest.mark.parametrize("buffer_size", BUFFERS)
@pytest.mark.parametrize(
    ("mixture", "interpolate"), [(TWO_PHASE, False), (SMOOTH_POINTS, True)], ids=["two-phase", "smooth"]
)
def test_trained_share_tracks_the_config_schedule(mixture, interpolate, buffer_size):
    cfg = _config(mixture, interpolate=interpolate, buffer_size=buffer_size)
    trained = _trained(cfg, SAMPLES)
    assert max(s for s, _ in trained) > (80 if interpolate else 40)  # past the schedule change
    assert _worst_window_error(cfg, trained) <= 0.005


@pytest.mark.parametrize("buffer_size", BUFFERS)
def test_old_source_stops_at_the_switch(buffer_size):
    trained = _trained(_config(SHARP, buffer_size=buffer_size), 12_000)
    img = [step for step, s in trained if s == "img"]
    assert img and max(img) <= 40 and sum(1 for step in img if step == 40) < 20  # a few stragglers at most
    assert min(step for step, s in trained if s == "txt") >= 39
    assert max(step for step, _ in trained) >= 60  # the run went well past the switch
