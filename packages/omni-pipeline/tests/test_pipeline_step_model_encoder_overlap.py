"""The encoders' gradient reduction overlapped with the backward actions after each rank's last encoder
backward (:meth:`omni_parallel.parallelize.EncoderGradientSync.ready`): priced as the part that ends
after the step's last backward, the collective over every rank starting once the last rank has issued
it. Hand windows, and through :func:`predict_step` on packs whose last microbatches carry no media
(hidden, partly hidden), against the simulated timeline read directly."""

from __future__ import annotations

import math

import pytest

from omni_data import Modality, Pack, SampleMeta
from omni_pipeline.cost import Network, all_reduce_s, reduce_scatter_s
from omni_pipeline.step_model import Device, Layout, predict_step, step_collectives
from omni_pipeline.workload import parse_workload

W = parse_workload(
    """
name = "enc"
max_seq_len = 2048
microbatches = 4
[model]
llm = { dim = 256, n_layers = 4, n_heads = 4, n_kv_heads = 2, ffn_dim = 512, gated_mlp = true }
image = { dim = 128, n_layers = 2, n_heads = 2, mlp_ratio = 4 }
[[sources]]
name = "t"
modality = "text"
length = { fixed = 700 }
[[phases]]
weights = { t = 1 }
"""
)
ENC_PARAMS = 2 * (4 * 128 * 128 + 8 * 128 * 128 + 4 * 128)  # ViT blocks: attention, MLP, two LayerNorms


def _packs(media: int) -> list[Pack]:
    """Four packs, the first ``media`` with an image (256 patches after merge) beside their text."""
    out = []
    for k in range(4):
        samples = [SampleMeta(f"t{k}", "t", Modality.TEXT, 0, 1500, 0.0, (1500,))]
        if k < media:
            samples.append(SampleMeta(f"i{k}", "i", Modality.IMAGE, 256, 8, 1.0, (3, 448, 448)))
        out.append(Pack(samples=samples, max_seq_len=2048))
    return out


def test_step_collectives_expose_only_what_ends_after_the_last_backward():
    net, dev = Network(intra_bandwidth_Bps=1e9, intra_latency_s=1e-6), Device()
    lay = Layout(pp=2, dp=4, encoder_zero=2)
    whole = reduce_scatter_s(4 * ENC_PARAMS, 8, 1e9, 1e-6)
    kw = dict(tokens=1.0, microbatches=4)
    llm = {0: (0.0, 9.0), 1: (0.0, 8.0)}
    # the last rank to issue, rank 1, at 9 - whole / 2: half of it after the step's last backward (9)
    _, step = step_collectives(W, lay, net, dev, last_backward=llm, encoder_last_backward={0: (0.0, 1.0),
                               1: (2.0, 9.0 - whole / 2)}, **kw)  # fmt: skip
    assert math.isclose(step["encoder_reduce_scatter"], whole / 2, rel_tol=1e-9)
    # issued early enough: hidden; no encoder backward at all: issued when the step starts
    _, step = step_collectives(W, lay, net, dev, last_backward={0: (0.0, 9.0)},
                               encoder_last_backward={0: (0.0, 1.0)}, **kw)  # fmt: skip
    assert step["encoder_reduce_scatter"] == 0.0
    _, step = step_collectives(
        W, lay, net, dev, last_backward={0: (0.0, whole / 4)}, encoder_last_backward={}, **kw
    )
    assert math.isclose(step["encoder_reduce_scatter"], 0.75 * whole, rel_tol=1e-9)
    # no timeline (the tuner's bounds): the least any step leaves; the all-gather stays whole
    _, step = step_collectives(W, lay, net, dev, **kw)
    assert step["encoder_reduce_scatter"] == 0.0 and step["encoder_all_gather"] == pytest.approx(whole)


@pytest.mark.parametrize("zero", [0, 2])
def test_predict_step_hides_the_reduction_behind_the_backwards_after_the_last_encoder_backward(zero):
    lay = Layout(pp=2, dp=4, encoder_zero=zero)
    reduce = all_reduce_s if zero == 0 else reduce_scatter_s
    key = "encoder_all_reduce" if zero == 0 else "encoder_reduce_scatter"
    first = predict_step(W, lay, packs=_packs(1))  # only the first microbatch encodes
    tl = first.simulation.timelines
    last_eb = max(ev.end_s for evs in tl.values() for ev in evs if ev.kind == "EB" and ev.end_s > ev.start_s)
    end = first.simulation.makespan_s
    gap = end - last_eb
    assert gap > 0  # the later microbatches' LLM backwards run after the last encoder backward
    for scale, want in ((0.5, 0.0), (1.5, 0.5 * gap)):
        # a link whose whole reduction takes scale x the gap (no latency): the pipeline is the same
        bw = (2 if zero == 0 else 1) * 7 / 8 * 4 * ENC_PARAMS / (scale * gap)
        net = Network(intra_bandwidth_Bps=bw, intra_latency_s=0.0)
        p = predict_step(W, lay, packs=_packs(1), network=net)
        assert p.simulation.makespan_s == end
        assert math.isclose(reduce(4 * ENC_PARAMS, 8, bw, 0.0), scale * gap, rel_tol=1e-9)
        assert math.isclose(p.time_s[key], want, rel_tol=1e-9, abs_tol=1e-15), (scale, p.time_s[key], want)
        assert math.isclose(p.step_time_s, sum(p.time_s.values()), rel_tol=1e-12)
    # every microbatch encodes: the last encoder backward is the step's last action, all of it exposed
    full = predict_step(W, lay, packs=_packs(4), network=net)
    eb = max(ev.end_s for evs in full.simulation.timelines.values() for ev in evs if ev.kind == "EB")
    assert eb == full.simulation.makespan_s
    assert math.isclose(full.time_s[key], reduce(4 * ENC_PARAMS, 8, bw, 0.0), rel_tol=1e-9)
