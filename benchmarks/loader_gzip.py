"""Loader throughput on gzip-compressed shards: omni-data vs webdataset's reader on the same ``.tar.gz``.

The shards are ``benchmarks/loader.py``'s (images PNG + caption + json, audio FLAC + transcript),
gzip-compressed whole (``gzip shard.tar``, level 6). Rows, each as samples/s and the ratio against
webdataset in the same run:
- raw: every sample's payload bytes in hand. webdataset: ``wds.WebDataset(urls)`` (``tarfile`` over
  ``gzip``: one sequential inflate); ours: ``WebDatasetSource`` metadata (one inflate of the shard by the
  header walk, small members inline) then ``PayloadReader.read_bytes`` of every payload by its offset in
  the decompressed tar (a second inflate, forward only: the reader's handle keeps its inflater between
  members).
- half (zero redundancy): ours reading the payloads of every other sample only, as a pipeline rank
  reading only the encoder microbatches it runs; webdataset still reads everything (it cannot skip).
- plain: ours on the uncompressed shards, for the price of compression on our side.

The sides run in rotated order every repeat (A B C, B C A, C A B, ...), each keeps its best pass, and
the ratio is given on wall time and on process CPU time (``time.process_time``, blind to other processes
on a shared machine).

Run: ``uv run python benchmarks/loader_gzip.py`` (``OMNI_BENCH_SAMPLES=100 OMNI_BENCH_REPEATS=1`` for a
smoke run); writes ``benchmarks/results/loader_gzip.json``.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import webdataset as wds

from omni_data import PayloadReader, WebDatasetSource
from omni_data.testing import audio_samples, image_samples, write_shards


def best_rotated(fns, repeats: int) -> list[tuple[float, float, int]]:
    """Run every fn ``repeats`` times, the order rotated by one each repeat; per fn: best wall seconds,
    best CPU seconds, samples of its last pass."""
    out = [[math.inf, math.inf, 0] for _ in fns]
    for r in range(repeats):
        for k in range(len(fns)):
            i = (k + r) % len(fns)
            w0, c0 = time.perf_counter(), time.process_time()
            out[i][2] = fns[i]()
            out[i][0] = min(out[i][0], time.perf_counter() - w0)
            out[i][1] = min(out[i][1], time.process_time() - c0)
    return [(w, c, n) for w, c, n in out]


def gzip_all(urls: list[str]) -> list[str]:
    out = []
    for u in urls:
        dst = u + ".gz"
        with open(u, "rb") as src, gzip.GzipFile(dst, "wb", compresslevel=6, mtime=0) as f:
            shutil.copyfileobj(src, f)
        out.append(dst)
    return out


def main() -> None:
    d = tempfile.mkdtemp(prefix="omni-loader-gzip-bench-")
    n = int(os.environ.get("OMNI_BENCH_SAMPLES", "1200"))
    repeats = int(os.environ.get("OMNI_BENCH_REPEATS", "5"))
    plain = {
        "image": write_shards(f"{d}/img-%03d.tar", image_samples(n, sizes=(64, 320)), per_shard=200),
        "audio": write_shards(
            f"{d}/aud-%03d.tar", audio_samples(n, rate=16000, seconds=(0.5, 4.0)), per_shard=200
        ),
    }
    gz = {m: gzip_all(urls) for m, urls in plain.items()}
    ext = {"image": "png", "audio": "flac"}

    def webdataset_raw(urls):
        return lambda: sum(1 for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False) if s)

    def ours(urls, modality, every=1):
        def run():
            reader, k = PayloadReader(), 0
            for i, m in enumerate(WebDatasetSource(urls, modality=modality)):
                if i % every == 0:
                    reader.read_bytes(m.members[ext[modality]])
                k += 1
            reader.close()
            return k

        return run

    rows = []
    for modality in plain:
        sides = {
            "webdataset_gzip": webdataset_raw(gz[modality]),
            "ours_gzip": ours(gz[modality], modality),
            "ours_gzip_half": ours(gz[modality], modality, every=2),
            "ours_plain": ours(plain[modality], modality),
        }
        timed = dict(zip(sides, best_rotated(list(sides.values()), repeats)))
        counts = {k: v[2] for k, v in timed.items()}
        assert len(set(counts.values())) == 1, counts
        tb, cb, nb = timed["webdataset_gzip"]
        row = {"modality": modality, "samples": nb, "webdataset_gzip_sps": nb / tb}
        for k in ("ours_gzip", "ours_gzip_half", "ours_plain"):
            t, c, _ = timed[k]
            row[f"{k}_sps"] = nb / t
            row[f"{k}_ratio"] = tb / t
            row[f"{k}_cpu_ratio"] = cb / c
        rows.append(row)
    sizes = {
        m: (sum(os.path.getsize(u) for u in plain[m]), sum(os.path.getsize(u) for u in gz[m])) for m in plain
    }
    print(
        f"{'modality':8s} {'samples':>7s} {'wds gz/s':>9s} {'ours gz':>8s} {'half':>6s} {'plain':>6s}  (ratios vs wds)"
    )
    for r in rows:
        print(
            f"{r['modality']:8s} {r['samples']:7d} {r['webdataset_gzip_sps']:9.0f} {r['ours_gzip_ratio']:8.2f} "
            f"{r['ours_gzip_half_ratio']:6.2f} {r['ours_plain_ratio']:6.2f}  "
            f"cpu: {r['ours_gzip_cpu_ratio']:.2f} {r['ours_gzip_half_cpu_ratio']:.2f} {r['ours_plain_cpu_ratio']:.2f}"
        )
    out = Path(__file__).parent / "results" / "loader_gzip.json"
    out.write_text(
        json.dumps(
            {"rows": rows, "bytes_plain_gzip": sizes, "repeats": repeats, "cores": os.cpu_count()}, indent=2
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
