"""Activation offload and data loading in the whole-step model, against hand counts.

* Offload (``Layout.offload``, the trainer's ``train.offload``): an offloaded LLM block keeps nothing on
  the device (all it saves goes to pinned host memory), or under selective recompute only each
  recomputed branch's float32 input (the checkpoint holds it by reference); the last stage's log-softmax
  stays. Per-rank activations are counted here by hand over 1F1B's in-flight microbatches; the copied
  bytes are omni-parallel's block count less what stays; each copy is synchronous on the compute stream
  (``ActivationMemory._pack_offloaded``'s ``copy_``), so a pp = 1 step (its actions in sequence) grows by
  exactly ``2 * microbatches * layers * copied / host_Bps``, all of it in ``time_s["offload"]``. A whole
  block recomputed with offload is refused; ``tune`` finds an offload plan where nothing else fits.
* Data loading: at pp = 1 the one rank decodes every media sample of the step (its source's
  ``decode_ms``); with loader workers the step is ``max(compute, load / workers)``, without them
  ``compute + load``. At pp = 2 each rank decodes the images of the encoder microbatches it runs, and
  the step's decode is the busier rank's (counted by hand from the timeline). A bad ``decode_ms`` / ``loader_workers`` names the file and the key.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from omni_data import Modality
from omni_data.zero_redundancy import split_encoder_microbatches
from omni_parallel.memory import block_activation_bytes
from omni_pipeline.step_model import Device, Layout, offload_seconds, predict_step, rank_memory
from omni_pipeline.tune import tune
from omni_pipeline.workload import WorkloadError, parse_workload

DIM, LAYERS, HEADS, KV_HEADS, FFN, SEQ, VOCAB = 128, 4, 4, 2, 256, 1024, 1000


def _toml(*, image: bool = False, decode: str = "", workers: str = "", microbatches: int = 4) -> str:
    img = f"""
[[sources]]
name = "i"
modality = "image"
length = {{ fixed = 300 }}
text_tokens = 8
{decode}
""" if image else ""  # fmt: skip
    return f"""
name = "off"
max_seq_len = {SEQ}
microbatches = {microbatches}
{workers}
[model]
llm = {{ dim = {DIM}, n_layers = {LAYERS}, n_heads = {HEADS}, n_kv_heads = {KV_HEADS}, ffn_dim = {FFN}, gated_mlp = true }}
{"image = { dim = 64, n_layers = 2, n_heads = 2, mlp_ratio = 4 }" if image else ""}
[[sources]]
name = "t"
modality = "text"
length = {{ fixed = {SEQ} }}
{img}
[[phases]]
weights = {{ t = 1{", i = 1" if image else ""} }}
"""


def _block(recompute: bool = False, branches: tuple[str, ...] = ()) -> int:
    """omni-parallel's count of one LLM block at the pack length (bf16 over float32 masters, flash)."""
    return block_activation_bytes(
        SEQ, DIM, KV_HEADS * DIM // HEADS, FFN, heads=HEADS, bytes_per=2, master_bytes=4,
        recompute=recompute, recompute_branches=branches, kernel="flash",
    )  # fmt: skip


@pytest.mark.parametrize("mods", [(), ("attention",), ("attention", "mlp")])
def test_offload_memory_is_what_stays_on_the_device(mods):
    w = parse_workload(_toml())
    pp, m = 2, w.microbatches
    recompute = bool(mods)
    base = Layout(pp=pp, recompute=recompute, recompute_modules=mods)
    off = dataclasses.replace(base, offload=("llm",))
    kept_block = len(mods) * SEQ * DIM * 4  # each recomputed branch's float32 input, by reference
    logsoftmax = SEQ * VOCAB * 4
    for r, row in rank_memory(w, off, vocab=VOCAB).items():
        in_flight = min(pp - r, m)  # 1F1B: stage r holds pp - r microbatches
        hand = in_flight * ((LAYERS // pp) * kept_block + (logsoftmax if r == pp - 1 else 0))
        assert row["activations"] == hand, (r, row["activations"], hand)
    # without offload: omni-parallel's whole count (what omni-train memory plans), well above
    full = _block(recompute, mods)
    for r, row in rank_memory(w, base, vocab=VOCAB).items():
        hand = min(pp - r, m) * ((LAYERS // pp) * full + (logsoftmax if r == pp - 1 else 0))
        assert row["activations"] == hand
    # the simulated peak with offload: the same hand count (stage 0 holds its whole warm-up)
    p = predict_step(w, off, vocab=VOCAB)
    assert p.memory[0]["activations"] == pytest.approx(pp * (LAYERS // pp) * kept_block)


@pytest.mark.parametrize("mods", [(), ("mlp",)])
def test_offload_time_is_the_copies_on_the_compute_stream(mods):
    w = parse_workload(_toml())
    dev = Device(host_Bps=7e9)
    base = Layout(pp=1, recompute=bool(mods), recompute_modules=mods)
    off = dataclasses.replace(base, offload=("llm",))
    a = predict_step(w, base, device=dev, vocab=VOCAB)
    b = predict_step(w, off, device=dev, vocab=VOCAB)
    copied = _block(bool(mods), mods) - len(mods) * SEQ * DIM * 4  # per block and microbatch, each way
    hand = 2 * w.microbatches * LAYERS * copied / dev.host_Bps  # out in forward, back in backward
    assert b.step_time_s - a.step_time_s == pytest.approx(hand, rel=1e-9)
    assert b.time_s["offload"] == pytest.approx(hand, rel=1e-9) and a.time_s["offload"] == 0
    # tune's lower bound of an offload layout's step: the same copies, without simulating
    assert offload_seconds(w, off, device=dev, vocab=VOCAB) == pytest.approx(hand, rel=1e-12)
    assert sum(b.time_s.values()) == pytest.approx(b.step_time_s, rel=1e-12)
    assert b.time_s["llm_compute"] == pytest.approx(a.time_s["llm_compute"], rel=1e-9)


def test_encoder_offload_leaves_the_device_and_costs_its_copies():
    w = parse_workload(_toml(image=True, decode="decode_ms = 0"))  # no loading: the compute step alone
    base = Layout(pp=1)
    a = predict_step(w, base, vocab=VOCAB)
    b = predict_step(w, dataclasses.replace(base, offload=("image",)), vocab=VOCAB)
    # the encoders' stored activations leave the device; the LLM's stay
    assert b.memory[0]["activations"] < a.memory[0]["activations"]
    # at pp = 1 the actions run in sequence: the step grows by exactly the copies, out of encoder compute
    assert b.time_s["offload"] > 0 and a.time_s["offload"] == 0
    assert b.step_time_s - a.step_time_s == pytest.approx(b.time_s["offload"], rel=1e-9)
    assert b.time_s["encoder_compute"] == pytest.approx(a.time_s["encoder_compute"], rel=1e-9)
    assert b.time_s["llm_compute"] == pytest.approx(a.time_s["llm_compute"], rel=1e-9)


def test_offload_with_whole_block_recompute_is_refused():
    with pytest.raises(ValueError, match="offload"):
        Layout(recompute=True, offload=("llm",))
    with pytest.raises(ValueError, match="offload"):
        Layout(offload=("vision",))
    Layout(recompute=True, recompute_modules=("attention",), offload=("llm", "image"))  # accepted


def test_tune_offloads_when_nothing_else_fits():
    w = parse_workload(_toml(microbatches=2))
    lay = dict(pp=1, recompute=True)  # whole-block recompute: the least a non-offload plan keeps
    need = rank_memory(w, Layout(**lay), vocab=VOCAB)[0]["total"]
    with_off = rank_memory(w, Layout(pp=1, offload=("llm",)), vocab=VOCAB)[0]["total"]
    assert with_off < need
    dev = Device(memory_bytes=(need + with_off) / 2)
    res = tune(w, 1, device=dev, global_batch=2, vocab=VOCAB, top=3, refine=0)
    assert res.plans and all(p.layout.offload == ("llm",) for p in res.plans)
    assert all(not p.layout.recompute or p.layout.recompute_modules for p in res.plans)


def _images(w, m: int) -> int:
    return sum(s.modality is Modality.IMAGE for p in w.step_packs(0, m) for s in p.samples)


def test_loader_time_is_hidden_by_workers_up_to_the_compute_step():
    slow = Device(peak_flops=2e11)  # a step of tens of ms, of the order of the decode below
    ref = predict_step(
        parse_workload(_toml(image=True, decode="decode_ms = 0")), Layout(), device=slow, vocab=VOCAB
    )
    compute = ref.step_time_s
    n = _images(parse_workload(_toml(image=True)), 4)
    assert n > 0 and ref.loader_s == 0 and ref.time_s["data_loading"] == 0
    decode_ms = 3e3 * compute / n  # the step's decode takes 3 compute steps on one worker
    load = n * decode_ms * 1e-3
    for workers, want in ((0, compute + load), (1, load), (2, load / 2), (4, compute), (8, compute)):
        w = parse_workload(
            _toml(image=True, decode=f"decode_ms = {decode_ms!r}", workers=f"loader_workers = {workers}")
        )
        p = predict_step(w, Layout(), device=slow, vocab=VOCAB)
        assert p.loader_s == pytest.approx(load, rel=1e-12)
        assert p.step_time_s == pytest.approx(want, rel=1e-12), workers
        assert p.time_s["data_loading"] == pytest.approx(want - compute, rel=1e-9, abs=1e-15)
        assert sum(p.time_s.values()) == pytest.approx(p.step_time_s, rel=1e-12)
    # the default decode (image: 2.4 ms per sample) with the default one worker
    w = parse_workload(_toml(image=True))
    assert w.loader_workers == 1 and w.sources[1].decode_s == pytest.approx(2.4e-3)
    assert predict_step(w, Layout(), device=slow, vocab=VOCAB).loader_s == pytest.approx(n * 2.4e-3)


def test_loader_time_is_the_busiest_ranks_decode_at_pp2():
    """pp 2, ``uniform_on_demand``: each rank decodes the images of the encoder microbatches it runs (the
    simulated timeline's ``EF`` events; encoder microbatch ``e``'s samples from the data split), counted by
    hand; the step's ``loader_s`` is the busier rank's count times ``decode_ms``."""
    decode_ms, m = 7.0, 4
    w = parse_workload(_toml(image=True, decode=f"decode_ms = {decode_ms}", microbatches=m))
    p = predict_step(w, Layout(pp=2, placement="uniform_on_demand"), device=Device(), vocab=VOCAB)
    packs = w.step_packs(0, m)
    images = {
        e: sum(packs[pi].samples[i].modality is Modality.IMAGE for pi, i in items)
        for e, items in split_encoder_microbatches(packs, m, 2).items()
    }
    per_rank = [
        sum(images[int(ev.action[ev.action.index("EF") + 2 :])] for ev in evs if ev.kind == "EF")
        for evs in p.simulation.timelines.values()
    ]
    assert len(per_rank) == 2 and sum(per_rank) == _images(w, m)  # every image decoded once
    assert per_rank[0] != per_rank[1]  # not vacuous: the images land unevenly
    assert p.loader_s == pytest.approx(max(per_rank) * decode_ms * 1e-3, rel=1e-12)


@pytest.mark.parametrize(
    ("decode", "workers", "key"),
    [
        ("decode_ms = -1", "", "sources[1].decode_ms"),
        ('decode_ms = "fast"', "", "sources[1].decode_ms"),
        ("", "loader_workers = 1000", "loader_workers"),
        ("", "loader_workers = 1.5", "loader_workers"),
    ],
)
def test_bad_loader_fields_name_the_file_and_key(decode, workers, key):
    with pytest.raises(WorkloadError, match="^" + re.escape(f"w.toml: {key}: ")):
        parse_workload(_toml(image=True, decode=decode, workers=workers), "w.toml")


def test_decode_ms_on_a_text_source_is_refused():
    text = _toml().replace('modality = "text"', 'modality = "text"\ndecode_ms = 1')
    with pytest.raises(WorkloadError, match=r"sources\[0\]\.decode_ms: a text source"):
        parse_workload(text, "w.toml")
