"""ZeroRedundancyFilter with a per-step ``consumes`` function (a data flow planned per step) and with
background preparation of the next step's metadata.

Oracle: a filter that reads every encoder microbatch (static ``consumes``, no background thread) on the
same shards. Two "pipeline ranks" whose ``consumes`` functions split each step's encoder microbatches
between them by a rule that changes from step to step read, together, every media sample of every step
exactly once, with payloads byte-identical to the oracle's; with ``background=True`` the steps, the
payloads and a mid-run ``state_dict`` resume are the same as without it.
"""

import threading
import time

import msgpack
import pytest

from omni_data import PayloadReader, ZeroRedundancyFilter
from omni_data.testing import (
    audio_samples,
    image_samples,
    packed_loader,
    text_samples,
    train_tiny_bpe,
    webdataset_sources,
    write_shards,
)

MICRO, SLICES, STEPS = 3, 2, 6


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("consumes")
    write_shards(f"{d}/img-%03d.tar", image_samples(30, sizes=(16, 48)), per_shard=15)
    write_shards(f"{d}/aud-%03d.tar", audio_samples(30, seconds=(0.05, 0.2)), per_shard=15)
    write_shards(f"{d}/txt-%03d.tar", text_samples(30, words=(5, 40)), per_shard=15)
    return str(d)


def _loader(d, tok):
    kw = dict(tokenizer=tok, epochs=None)
    sources = webdataset_sources(
        {
            n: (f"{d}/{n}-{{000..001}}.tar", m)
            for n, m in (("img", "image"), ("aud", "audio"), ("txt", "text"))
        },
        **kw,
    )
    return packed_loader(sources, {"img": 0.4, "aud": 0.4, "txt": 0.2}, 160, 12, MICRO, max_open_packs=2)


def _rule(rank):
    """Rank ``rank``'s share of each step: which microbatches go where depends on the step and on the
    metadata (the sample count of each encoder microbatch), as a planner's choice would. On the
    preparation thread it is slow (as a planner is), so a ``state_dict`` taken right after ``next``
    finds the refill still running (it must wait for it, not save a half-made window)."""
    calls = []

    def consumes(step, packs, mbs):
        calls.append(step)
        if threading.current_thread().name.startswith("omni-data-prepare"):
            time.sleep(0.2)
        return {e for e, items in mbs.items() if (e + step + len(items)) % 2 == rank}

    return consumes, calls


def _payloads(fs):
    return {
        e: [(p.meta.uid, (p.pixels if p.pixels is not None else p.waveform).numpy().tobytes()) for p in ps]
        for e, ps in fs.payloads.items()
    }


def _filter(d, tok, reader, consumes, **kw):
    return ZeroRedundancyFilter(
        _loader(d, tok), consumes, microbatches=MICRO, slices=SLICES, reader=reader, prefetch=1, **kw
    )


def test_per_step_consumes_split_every_sample_once_and_match_the_full_read(shards):
    tok = train_tiny_bpe()
    reader = PayloadReader(tok)
    with _filter(shards, tok, reader, range(1, MICRO * SLICES + 1)) as full:
        oracle = [next(full) for _ in range(STEPS)]
    got = []
    for rank in (0, 1):
        fn, calls = _rule(rank)
        with _filter(shards, tok, reader, fn, background=True) as zr:
            got.append([next(zr) for _ in range(STEPS)])
        assert calls[:STEPS] == list(range(STEPS))  # called once per step, in order (plus the prefetched)
    moved = 0
    for s, want in enumerate(oracle):
        a, b = got[0][s], got[1][s]
        assert a.consumes.isdisjoint(b.consumes) and a.consumes | b.consumes == set(want.microbatches)
        assert set(a.payloads) == set(a.consumes) and set(b.payloads) == set(b.consumes)
        assert {**_payloads(a), **_payloads(b)} == _payloads(want)  # each read once, bytes as the full read
        moved += s > 0 and a.consumes != got[0][s - 1].consumes
    assert moved >= 2 and sum(len(v) for fs in oracle for v in fs.payloads.values()) >= 12


def test_background_preparation_gives_the_same_steps_and_an_exact_resume(shards):
    tok = train_tiny_bpe()
    reader = PayloadReader(tok)
    runs = {}
    # on request: prepared in the background after the steps whose number is even, inline in next() after
    # the others (the caller did not ask), so both paths meet the same stream
    modes = {
        "off": {},
        "on": {"background": True},
        "on request": {"background": True, "prepare_on_request": True},
    }

    def pull(zr, n):
        out = []
        for _ in range(n):
            out.append(next(zr))
            if zr.prepare_on_request:
                assert zr._refilling is None  # nothing started before the caller asks
                if out[-1].step % 2 == 0:
                    zr.prepare()
                    assert zr._refilling is not None
        return out

    for mode, kw in modes.items():
        fn, _ = _rule(0)
        with _filter(shards, tok, reader, fn, read_text=True, **kw) as zr:
            first = pull(zr, 2)
            state = msgpack.packb(zr.state_dict())
            rest = pull(zr, 3)
        fn, _ = _rule(0)
        with _filter(shards, tok, reader, fn, read_text=True, **kw) as resumed:
            resumed.load_state_dict(msgpack.unpackb(state, strict_map_key=False))
            again = pull(resumed, 3)
        summary = [
            (
                fs.step,
                [p.to_dict() for p in fs.packs],
                sorted(fs.consumes),
                _payloads(fs),
                [[None if t is None else t.tolist() for t in row] for row in fs.text_ids],
            )
            for fs in first + rest
        ]
        assert [x[:4] for x in summary[2:]] == [
            (fs.step, [p.to_dict() for p in fs.packs], sorted(fs.consumes), _payloads(fs)) for fs in again
        ]
        runs[mode] = summary
    assert runs["on"] == runs["off"] and runs["on request"] == runs["off"]


def test_a_requested_preparation_is_waited_for_by_state_reset_and_close(shards):
    """The trainer's order (``next``, then ``prepare()``): a state taken and a ``reset`` made while the
    requested preparation runs (the rule is slow on that thread) give the foreground filter's steps; a
    filter closed while one runs then refuses ``prepare`` and ``next`` by name."""
    tok = train_tiny_bpe()
    reader = PayloadReader(tok)
    fn, _ = _rule(0)
    with _filter(shards, tok, reader, fn) as ref:
        want = [(fs.step, sorted(fs.consumes), _payloads(fs)) for fs in (next(ref) for _ in range(4))]
    fn, _ = _rule(0)
    with _filter(shards, tok, reader, fn, background=True, prepare_on_request=True) as zr:
        first = next(zr)
        zr.prepare()
        state = msgpack.unpackb(msgpack.packb(zr.state_dict()), strict_map_key=False)
        next(zr)
        zr.prepare()
        zr.reset(state)  # back to after step 0, while step 2 is being prepared
        got = [first, *(next(zr) for _ in range(3))]
        zr.prepare()  # still running when the block closes the filter
    assert [(fs.step, sorted(fs.consumes), _payloads(fs)) for fs in got] == want
    for call in (zr.prepare, lambda: next(zr)):
        with pytest.raises(RuntimeError, match=r"ZeroRedundancyFilter: closed"):
            call()


def test_a_consumes_function_returning_an_unknown_microbatch_is_named(shards):
    tok = train_tiny_bpe()
    zr = _filter(shards, tok, PayloadReader(tok), lambda step, packs, mbs: {MICRO * SLICES + 1})
    with (
        zr,
        pytest.raises(ValueError, match=r"consumes \[7\] \(returned by the consumes function for step 0\)"),
    ):
        next(zr)


def test_an_error_on_the_preparation_thread_reaches_the_caller(shards):
    tok = train_tiny_bpe()
    threads = {}

    def fails_on_step_2(step, packs, mbs):
        threads[step] = threading.current_thread().name
        if step == 2:
            raise RuntimeError("planner failed for step 2")
        return set(mbs)

    with _filter(shards, tok, PayloadReader(tok), fails_on_step_2, background=True) as zr:
        assert [next(zr).step for _ in range(2)] == [0, 1]  # step 2 is being prepared meanwhile
        with pytest.raises(RuntimeError, match="planner failed for step 2"):
            next(zr)
    # step 0 is made by the first call; every later step on the preparation thread, while the caller ran
    assert threads[0] == threading.current_thread().name
    assert threads[1].startswith("omni-data-prepare") and threads[2].startswith("omni-data-prepare")
