"""PayloadReader shared between threads: the regression test for the seek/read race that made CI flaky.

Several threads read every member of the same two shards through one reader, many times over, in
different orders. Each read must give exactly the member's bytes as a single-threaded reader returns
them (the oracle: tarfile's own extraction). With one shared file handle, one thread's ``seek`` lands
between another's ``seek`` and ``read`` and the bytes come from the wrong member.
"""

import random
import tarfile
import threading

from omni_data import PayloadReader, WebDatasetSource
from omni_data.testing import image_samples, write_shards


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
