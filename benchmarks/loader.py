"""Loader throughput: our metadata-first source + payload reader vs plain webdataset iteration, over the
same local shards and the same samples (images PNG + caption + json, audio FLAC + transcript).

Two levels, each as samples/s and the ratio against webdataset. The two sides alternate pass by pass
(A B A B ...) and each keeps its best pass, so a load change on a shared machine hits both alike; the
ratio is given on wall time and on process CPU time (``time.process_time``: what the loader itself
spends, blind to other processes taking the cores; the closer one on a busy machine):
- raw (I/O only): every sample's payload bytes in hand. webdataset: ``wds.WebDataset(urls)`` yields dicts
  of bytes; ours: ``WebDatasetSource`` metadata (header walk, json/txt inline, image header or FLAC
  STREAMINFO, token accounting, no tokenizer) plus ``PayloadReader.read_bytes`` of the payload by byte range.
- decoded (the same work on both sides): caption/transcript token ids and an RGB tensor resized to the
  dynamic-resolution grid, or a mono waveform. webdataset: its bytes decoded by the same PIL/soundfile
  steps; ours: ``WebDatasetSource(tokenizer=...)`` then ``PayloadReader.read``.

Parallel decode: decoded images/s through the whole two-phase pipeline (``WebDatasetSource`` ->
``MixtureStream`` -> ``HybridPacker`` -> ``PackedLoader`` -> ``ZeroRedundancyFilter`` reading every image)
with ``decode_workers`` 1, 2 and 4, against 1 in the same run (interleaved passes, best of each; wall time:
process CPU time sums the threads). The metadata pass stays on the calling thread, overlapped with the
decode pool by the filter's prefetch.

Run: ``uv run python benchmarks/loader.py`` (``OMNI_BENCH_SAMPLES=200`` for a smoke run); writes
``benchmarks/results/loader.json``.
"""

from __future__ import annotations

import io
import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile
import torch
import webdataset as wds
from PIL import Image

from omni_data import ImageTokens, PayloadReader, WebDatasetSource, ZeroRedundancyFilter
from omni_data.sample import Modality
from omni_data.testing import (
    audio_samples,
    image_samples,
    packed_loader,
    train_tiny_bpe,
    webdataset_sources,
    write_shards,
)


def best_interleaved(fns, repeats: int = 5) -> list[tuple[float, float, int]]:
    """Run ``fns`` in turn ``repeats`` times; per fn: best wall seconds, best CPU seconds, samples."""
    out = [[math.inf, math.inf, 0] for _ in fns]
    for _ in range(repeats):
        for fn, o in zip(fns, out):
            w0, c0 = time.perf_counter(), time.process_time()
            o[2] = fn()
            o[0] = min(o[0], time.perf_counter() - w0)
            o[1] = min(o[1], time.process_time() - c0)
    return [(w, c, n) for w, c, n in out]


def main() -> None:
    d = tempfile.mkdtemp(prefix="omni-loader-bench-")
    n_img = n_aud = int(os.environ.get("OMNI_BENCH_SAMPLES", "1200"))
    img = write_shards(f"{d}/img-%03d.tar", image_samples(n_img, sizes=(64, 320)), per_shard=200)
    aud = write_shards(
        f"{d}/aud-%03d.tar", audio_samples(n_aud, rate=16000, seconds=(0.5, 4.0)), per_shard=200
    )
    tok = train_tiny_bpe()
    sets = {"image": img, "audio": aud}

    it = ImageTokens()

    def wds_raw(urls):
        return lambda: sum(1 for s in wds.WebDataset(urls, shardshuffle=False) if s)

    def ours_raw(urls, modality):
        def run():
            reader, n = PayloadReader(), 0
            ext = "png" if modality == "image" else "flac"
            for m in WebDatasetSource(urls, modality=modality):
                reader.read_bytes(m.members[ext])
                n += 1
            return n

        return run

    def wds_decoded(urls, modality):
        """The same decoding work as PayloadReader.read, on webdataset's bytes."""

        def run():
            n = 0
            for s in wds.WebDataset(urls, shardshuffle=False):
                ids = torch.tensor(tok.encode(s["txt"].decode()).ids, dtype=torch.int64)
                if modality == "image":
                    with Image.open(io.BytesIO(s["png"])) as im:
                        h, w = it.resize(im.height, im.width)
                        rgb = im.convert("RGB").resize((w, h), Image.Resampling.BICUBIC)
                    chw = np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1))
                    x = torch.from_numpy(chw.astype(np.float32) * np.float32(1 / 255))
                else:
                    data, _ = soundfile.read(io.BytesIO(s["flac"]), dtype="float32", always_2d=True)
                    x = torch.from_numpy(data.mean(axis=1))
                assert x.numel() and ids.numel()
                n += 1
            return n

        return run

    def ours_decoded(urls, modality):
        def run():
            reader, n = PayloadReader(tok), 0
            for m in WebDatasetSource(urls, modality=modality, tokenizer=tok):
                p = reader.read(m)
                assert (p.pixels if m.modality is Modality.IMAGE else p.waveform) is not None
                n += 1
            return n

        return run

    def through_filter(urls, workers):
        """Decoded images per pass through the full pipeline with ``workers`` decode threads."""

        def run():
            src = webdataset_sources({"img": (urls, "image")}, tokenizer=tok)
            loader = packed_loader(src, {"img": 1.0}, 4096, 64, 4)
            n = 0
            with ZeroRedundancyFilter(
                loader,
                [1, 2, 3, 4],
                microbatches=4,
                slices=1,
                reader=PayloadReader(tok),
                prefetch=2,
                decode_workers=workers,
            ) as zr:
                for step in zr:
                    n += sum(1 for ps in step.payloads.values() for p in ps if p.pixels is not None)
            return n

        return run

    workers = (1, 2, 4)
    timed = best_interleaved([through_filter(img, w) for w in workers], repeats=3)
    assert len({n for _, _, n in timed}) == 1, timed
    decode_rows = [
        {"decode_workers": w, "images": n, "images_per_s": n / t, "speedup_vs_1": timed[0][0] / t}
        for w, (t, _, n) in zip(workers, timed)
    ]

    rows = []
    for modality, urls in sets.items():
        for level, base, mine in (
            ("raw", wds_raw(urls), ours_raw(urls, modality)),
            ("decoded", wds_decoded(urls, modality), ours_decoded(urls, modality)),
        ):
            (tb, cb, nb), (to, co, no) = best_interleaved([base, mine])
            assert nb == no, (modality, level, nb, no)
            rows.append(
                {
                    "modality": modality,
                    "level": level,
                    "samples": no,
                    "webdataset_sps": nb / tb,
                    "ours_sps": no / to,
                    "ratio": tb / to,
                    "webdataset_cpu_sps": nb / cb,
                    "ours_cpu_sps": no / co,
                    "cpu_ratio": cb / co,
                }
            )
    print(
        f"{'modality':8s} {'level':8s} {'samples':>7s} {'webdataset/s':>13s} {'ours/s':>10s} {'ratio':>6s} "
        f"{'cpu ratio':>9s}"
    )
    for r in rows:
        print(
            f"{r['modality']:8s} {r['level']:8s} {r['samples']:7d} {r['webdataset_sps']:13.0f} {r['ours_sps']:10.0f} "
            f"{r['ratio']:6.2f} {r['cpu_ratio']:9.2f}"
        )
    print(
        f"\n{'decode workers':>14s} {'images':>7s} {'images/s':>9s} {'vs 1':>6s}  (full pipeline, {os.cpu_count()} cores)"
    )
    for r in decode_rows:
        print(f"{r['decode_workers']:14d} {r['images']:7d} {r['images_per_s']:9.0f} {r['speedup_vs_1']:6.2f}")
    out = Path(__file__).parent / "results" / "loader.json"
    out.write_text(
        json.dumps({"rows": rows, "decode_workers": decode_rows, "cores": os.cpu_count()}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
