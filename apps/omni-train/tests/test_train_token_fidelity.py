"""Token-unit mixture phases (``[[data.mixture]] until_tokens``) at the trainer's input: the per-source
share of the samples in the packs of the steps ``build_step_stream`` emits, against the config's weights at
the *trained-token position* of each sample (the tokens of every sample trained before it), over sliding
10,000-sample windows: within 0.5 percentage points for two phases and for a smooth (interpolated)
schedule, as the step-unit schedules are (``test_train_mixture_fidelity.py``); after a sharp 1 -> 0
switch the old source is not trained past the switch's token count by more than one step. Metadata only
(``SyntheticSource``), no model, no shards.

The oracle reads the weights straight from the config (phase table, linear interpolation written out
here), not through the trainer's ``mixture_schedule``.
"""

import pytest
from mixture_oracle import TOKENS, fidelity_config, scheduled_weights, synthetic_stream

WINDOW, STRIDE, SAMPLES = 10_000, 500, 26_000
STEP_TOKENS = 4096 * 8  # at most, per step (max_seq_len x microbatches)


def _config(mixture, *, interpolate=False, buffer_size=256):
    return fidelity_config("token-fidelity", mixture, interpolate=interpolate, buffer_size=buffer_size)


def _want(cfg, position):
    """The config's normalised weights at token ``position``, computed from its phases directly."""
    return scheduled_weights(cfg, position, "until_tokens")


def _trained(cfg, samples):
    """``[(trained tokens before the sample, its source, its step)]`` in training order."""
    stream = synthetic_stream(cfg)
    out, seen = [], 0
    with stream:
        while len(out) < samples:
            fs = next(stream)
            for p in fs.packs:
                for s in p.samples:
                    out.append((seen, s.source, fs.step))
                    seen += s.num_tokens
    return out


def _worst_window_error(cfg, trained):
    worst, windows = 0.0, 0
    want = [_want(cfg, pos) for pos, _, _ in trained]
    for name in TOKENS:
        got, exp = [0], [0.0]
        for (_, s, _), w in zip(trained, want):
            got.append(got[-1] + (s == name))
            exp.append(exp[-1] + w[name])
        starts = range(0, len(trained) - WINDOW + 1, STRIDE)
        windows = len(starts)
        for a in starts:
            share = (got[a + WINDOW] - got[a]) / WINDOW
            worst = max(worst, abs(share - (exp[a + WINDOW] - exp[a]) / WINDOW))
    assert windows >= 30
    return worst


SWITCH = 3_000_000  # tokens: about a third of the 26,000 samples
TWO_PHASE = [
    {"until_tokens": SWITCH, "weights": {"img": 0.6, "aud": 0.3, "txt": 0.1}},
    {"weights": {"img": 0.2, "aud": 0.4, "txt": 0.4}},
]
SMOOTH = [
    {"until_tokens": 2 * SWITCH, "weights": {"img": 0.6, "aud": 0.3, "txt": 0.1}},
    {"weights": {"img": 0.1, "aud": 0.3, "txt": 0.6}},
]
SHARP = [{"until_tokens": SWITCH, "weights": {"img": 0.5, "aud": 0.5}}, {"weights": {"aud": 0.5, "txt": 0.5}}]


@pytest.mark.parametrize("buffer_size", [8, 256, 1024])
@pytest.mark.parametrize(
    ("mixture", "interpolate"), [(TWO_PHASE, False), (SMOOTH, True)], ids=["phases", "smooth"]
)
def test_trained_share_tracks_the_token_schedule(mixture, interpolate, buffer_size):
    cfg = _config(mixture, interpolate=interpolate, buffer_size=buffer_size)
    trained = _trained(cfg, SAMPLES)
    assert trained[-1][0] > (2 if interpolate else 1) * SWITCH  # past the schedule change
    assert _worst_window_error(cfg, trained) <= 0.005


@pytest.mark.parametrize("buffer_size", [8, 1024])
def test_old_source_stops_at_the_token_switch(buffer_size):
    trained = _trained(_config(SHARP, buffer_size=buffer_size), 16_000)
    img = [pos for pos, s, _ in trained if s == "img"]
    txt = [pos for pos, s, _ in trained if s == "txt"]
    assert img and txt and trained[-1][0] > SWITCH + 10 * STEP_TOKENS  # well past the switch
    # every image sample drawn before the switch is trained before any text sample drawn after it, and
    # the last one is trained within one step's tokens of the switch
    assert max(img) < min(txt) and SWITCH - STEP_TOKENS <= max(img) < SWITCH + STEP_TOKENS
    assert abs(min(txt) - SWITCH) < STEP_TOKENS
