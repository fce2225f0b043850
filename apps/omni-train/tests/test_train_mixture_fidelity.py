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

from omni_data.testing import SyntheticSource, trained_sources
from omni_train.binder import config_from_dict
from omni_train.data_pipeline import build_step_stream

WINDOW, STRIDE, SAMPLES = 10_000, 500, 26_000
TOKENS = {"img": ("image", (64, 1500)), "aud": ("audio", (20, 300)), "txt": ("text", (10, 800))}


BUFFERS = [8, 64, 256, 1024]


def _config(mixture, *, interpolate=False, buffer_size=256):
    return config_from_dict(
        {
            "name": "fidelity",
            "model": {"vit": {}, "audio": {}},
            "data": {
                "sources": [{"name": n, "modality": m, "urls": f"{n}-*.tar"} for n, (m, _) in TOKENS.items()],
                "mixture": mixture,
                "max_seq_len": 4096,
                "microbatches": 8,
                "buffer_size": buffer_size,
                "mixture_interpolate": interpolate,
            },
            "parallel": {"pp": 2},
        }
    )


def _want(cfg, step):
    """The config's normalised weights at ``step``, computed from its phases directly."""
    phases, starts = cfg.data.mixture, [0] + [p.until_step for p in cfg.data.mixture[:-1]]
    i = max(j for j, s in enumerate(starts) if s <= step)

    def norm(ph):
        total = sum(ph.weights.values())
        return {n: ph.weights.get(n, 0.0) / total for n in TOKENS}

    w = norm(phases[i])
    if cfg.data.mixture_interpolate and i + 1 < len(phases):
        t = (step - starts[i]) / (starts[i + 1] - starts[i])
        w = {n: (1 - t) * w[n] + t * norm(phases[i + 1])[n] for n in TOKENS}
    return w


def _trained(cfg, samples):
    """``[(step, source)]`` of every sample in the packs the trainer's stream emits, in training order."""
    sources = {n: SyntheticSource(n, m, tok, seed=i + 1) for i, (n, (m, tok)) in enumerate(TOKENS.items())}
    stream = build_step_stream(
        cfg, None, dp_rank=0, dp_size=1, dp_group=None, consumes=set(), read_text=False, sources=sources
    )
    stream.reset()
    return trained_sources(stream, samples)


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
