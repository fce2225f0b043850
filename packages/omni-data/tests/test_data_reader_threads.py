"""PayloadReader shared between threads: the regression test for the seek/read race that made CI flaky.

Also two ZeroRedundancyFilters sharing one reader, iterated at once, each with its own decode pool.

Several threads read every member of the same two shards through one reader, many times over, in
different orders. Each read must give exactly the member's bytes as a single-threaded reader returns
them (the oracle: tarfile's own extraction). With one shared file handle, one thread's ``seek`` lands
between another's ``seek`` and ``read`` and the bytes come from the wrong member.
"""

import os
import random
import tarfile
import threading

import msgpack

from omni_data import PayloadReader, WebDatasetSource, ZeroRedundancyFilter
from omni_data.testing import (
    audio_samples,
    image_samples,
    packed_loader,
    train_tiny_bpe,
    webdataset_sources,
    write_shards,
)


def test_reader_shared_between_threads_reads_exact_bytes(tmp_path):
    write_shards(f"{tmp_path}/s-%03d.tar", image_samples(24, sizes=(16, 48)), per_shard=12)
    metas = list(WebDatasetSource(f"{tmp_path}/s-{{000..001}}.tar", modality="image"))
    assert len(metas) == 24
    refs = [ref for m in metas for ref in m.members.values()]
    truth = {}
    for ref in refs:
        with tarfile.open(ref.url.removeprefix("file://")) as tf:
            member = next(x for x in tf.getmembers() if x.offset_data == ref.offset)
            truth[(ref.url, ref.offset)] = tf.extractfile(member).read()
    reader = PayloadReader(max_open_files=1)  # fewer handles than the 2 shards: LRU evictions race too
    wrong: list[str] = []
    reads = [0]
    count_lock = threading.Lock()

    def work(seed: int) -> None:
        order = list(refs) * 20
        random.Random(seed).shuffle(order)
        for ref in order:
            if reader.read_bytes(ref) != truth[(ref.url, ref.offset)]:
                wrong.append(f"thread {seed}: {ref.url}@{ref.offset}")
            with count_lock:
                reads[0] += 1

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a reader thread did not finish within 120 s"
    reader.close()
    assert reads[0] == 4 * 20 * len(refs)
    assert not wrong, f"{len(wrong)} reads returned another member's bytes, e.g. {wrong[:3]}"
    assert reader.bytes_read == 20 * 4 * sum(len(b) for b in truth.values())


def _filter(d, tok, reader, seed, decode_workers=2):
    kw = dict(tokenizer=tok, epochs=None, shuffle_shards=True, seed=seed)
    sources = webdataset_sources(
        {"img": (f"{d}/s-{{000..001}}.tar", "image"), "aud": (f"{d}/a-000.tar", "audio")},
        **kw,
    )
    loader = packed_loader(sources, {"img": 0.6, "aud": 0.4}, 256, 16, 4, max_open_packs=2)
    return ZeroRedundancyFilter(
        loader,
        [1, 2],
        microbatches=2,
        slices=1,
        reader=reader,
        prefetch=2,
        read_text=True,
        decode_workers=decode_workers,
    )


def _payload_bytes(step):
    return [
        (
            p.meta.uid,
            (p.pixels if p.pixels is not None else p.waveform).numpy().tobytes(),
            p.text_ids.tolist(),
        )
        for e in sorted(step.payloads)
        for p in step.payloads[e]
    ]


def test_two_filters_over_one_reader_read_identical_payloads(tmp_path):
    """Two filters (each with a decode pool of 2 threads) share one PayloadReader and are iterated at the
    same time from two threads: every payload is byte-identical to a single-threaded read of its sample,
    and closing the filters stops every decode thread they started."""
    tok = train_tiny_bpe()
    write_shards(f"{tmp_path}/s-%03d.tar", image_samples(24, sizes=(16, 48)), per_shard=12)
    write_shards(f"{tmp_path}/a-%03d.tar", audio_samples(16, seconds=(0.05, 0.2)), per_shard=16)
    before = {t.ident for t in threading.enumerate()}
    reader = PayloadReader(tok, max_open_files=2)
    filters = [_filter(tmp_path, tok, reader, seed) for seed in (0, 1)]
    got: dict[int, list] = {0: [], 1: []}

    def work(i):
        for _ in range(12):
            step = next(filters[i])
            got[i].append((step, _payload_bytes(step)))

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for f in filters:
        f.close()
    started = [t for t in threading.enumerate() if t.ident not in before]
    assert not [t.name for t in started if t.name.startswith("omni-data-decode")]
    alone = PayloadReader(tok)
    compared = 0
    for i in (0, 1):
        assert len(got[i]) == 12
        for step, payloads in got[i]:
            metas = [
                step.packs[p].samples[j] for e in sorted(step.microbatches) for p, j in step.microbatches[e]
            ]
            want = [(m.uid, *_payload_bytes_one(alone.read(m))) for m in metas]
            assert payloads == want
            compared += len(want)
    assert compared > 100


def _payload_bytes_one(p):
    return (p.pixels if p.pixels is not None else p.waveform).numpy().tobytes(), p.text_ids.tolist()


def test_decode_workers_do_not_change_the_stream_and_resume_exactly(tmp_path):
    """1 decode thread vs 3, and a resume from a state saved with 3 into a filter with 2: the same
    payload bytes in the same order (results go back to their slots; the state holds no thread)."""
    tok = train_tiny_bpe()
    write_shards(f"{tmp_path}/s-%03d.tar", image_samples(24, sizes=(16, 48)), per_shard=12)
    write_shards(f"{tmp_path}/a-%03d.tar", audio_samples(16, seconds=(0.05, 0.2)), per_shard=16)

    def run(workers, steps, state=None):
        zr = _filter(tmp_path, tok, PayloadReader(tok), 0, decode_workers=workers)
        if state is not None:
            zr.load_state_dict(state)
        with zr:
            out = [_payload_bytes(next(zr)) for _ in range(steps)]
            return out, zr.state_dict()

    one, _ = run(1, 6)
    head, state = run(3, 3)
    tail, _ = run(2, 3, msgpack.unpackb(msgpack.packb(state), strict_map_key=False))
    assert head + tail == one and sum(len(s) for s in one) > 40


def test_remote_store_reads_a_step_in_one_batch():
    """memory:// shards (an fsspec filesystem other than the local one): each step's members come in one
    ``cat_ranges`` call, with the same bytes as one-by-one reads."""
    tok = train_tiny_bpe()
    root = f"memory://omni-data-batched-{os.getpid()}"
    write_shards(f"{root}/s-%03d.tar", image_samples(24, sizes=(16, 48)), per_shard=12)
    write_shards(f"{root}/a-%03d.tar", audio_samples(16, seconds=(0.05, 0.2)), per_shard=16)
    batched, single = PayloadReader(tok), PayloadReader(tok, batched="never")
    assert batched.uses_batches(f"{root}/s-000.tar") and not single.uses_batches(f"{root}/s-000.tar")
    runs = []
    for reader in (batched, single):
        with _filter(root, tok, reader, 0) as zr:
            runs.append([_payload_bytes(next(zr)) for _ in range(5)])
    assert runs[0] == runs[1] and sum(len(s) for s in runs[0]) > 30
    # one call per step read: the 5 taken, and those of the 2 prefetched steps that ran before close()
    calls = batched.stats["batched_calls"]
    assert 5 <= calls <= 7 and single.stats["batched_calls"] == 0
    assert batched.stats["batched_ranges"] >= 4 * calls
