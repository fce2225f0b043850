"""PayloadReader shared between threads: the regression test for the seek/read race that made CI flaky.

Also two ZeroRedundancyFilters sharing one reader, iterated at once, each with its own decode pool.

Several threads read every member of the same two shards through one reader, many times over, in
different orders. Each read must give exactly the member's bytes as a single-threaded reader returns
them (the oracle: tarfile's own extraction). With one shared file handle, one thread's ``seek`` lands
between another's ``seek`` and ``read`` and the bytes come from the wrong member.
"""

import random
import tarfile
import threading

from omni_data import (
    HybridPacker,
    MixtureSchedule,
    MixtureStream,
    PackedLoader,
    PayloadReader,
    WebDatasetSource,
    ZeroRedundancyFilter,
)
from omni_data.testing import audio_samples, image_samples, train_tiny_bpe, write_shards


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
    reader = PayloadReader(max_open_files=2)  # fewer handles than shards: LRU evictions race too
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


def _filter(d, tok, reader, seed):
    kw = dict(tokenizer=tok, epochs=None, shuffle_shards=True, seed=seed)
    sources = {
        "img": WebDatasetSource(f"{d}/s-{{000..001}}.tar", modality="image", name="img", **kw),
        "aud": WebDatasetSource(f"{d}/a-000.tar", modality="audio", name="aud", **kw),
    }
    mix = MixtureStream(sources, MixtureSchedule.constant({"img": 0.6, "aud": 0.4}))
    loader = PackedLoader(HybridPacker(mix, 256, 16, max_open_packs=2), 4, mixture=mix)
    return ZeroRedundancyFilter(
        loader, [1, 2], microbatches=2, slices=1, reader=reader, prefetch=2, read_text=True, decode_workers=2
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
