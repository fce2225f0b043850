"""Hybrid packing fill and speed: HybridPacker (best-fit decreasing over a streaming buffer with carry-over)
vs first-fit over a shuffled window and windowed best-fit decreasing without carry-over.

Workload like the paper's (§2.2, §6): images ~3.8K expanded tokens on average (lognormal), audio ~0.34K,
long text documents up to 512K tokens (split into 16K pieces by every packer alike), short captions and
instructions. max_seq_len 16K. Fill = used tokens / (packs * max_seq_len). Time per input sample is the
best of a few runs, in the same process; the ratio column is against first-fit-shuffle.

Pack-age bound: the same workload through ``HybridPacker`` with ``max_pack_age`` 0, 1 (the default), 2, 4
and unbounded (the behaviour before the bound), buffer 1024: fill, time, and how long samples wait in
draws between being drawn and being emitted (max and 99.9th percentile); the bound guarantees at most
``(max_pack_age + 1) * buffer_size``.

Spread: the same workload through ``HybridPacker`` with ``spread=0`` (plain best-fit decreasing placement,
the behaviour before ``spread``) and the default, at buffers 8 to 1024: fill and time, the fill cost of
keeping each pack's per-source mix representative (omni-data README, "Mixture fidelity").

Run: ``uv run python benchmarks/packing.py``; writes ``benchmarks/results/packing.json``.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import random
import time
from pathlib import Path

from torchdata.nodes import IterableWrapper

from omni_data import HybridPacker, Modality, SampleMeta

MAX_LEN = 16384


def workload(n: int, seed: int = 0) -> list[SampleMeta]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        if r < 0.45:  # images: lognormal around 3.8K tokens (OpenImages-like), with a caption
            med = min(MAX_LEN - 64, max(16, int(rng.lognormvariate(math.log(3300), 0.55))))
            out.append(SampleMeta(f"i{i}", "img", Modality.IMAGE, med, rng.randint(8, 60), 0.0, (1,)))
        elif r < 0.80:  # audio: ~0.34K tokens (LibriSpeech-like), with a transcript
            med = max(8, int(rng.lognormvariate(math.log(300), 0.45)))
            out.append(SampleMeta(f"a{i}", "aud", Modality.AUDIO, med, rng.randint(10, 60), 0.0, (1,)))
        elif r < 0.97:  # short text
            out.append(
                SampleMeta(f"t{i}", "txt", Modality.TEXT, 0, int(rng.lognormvariate(6.0, 1.0)) + 1, 0.0, (1,))
            )
        else:  # long documents, up to 512K tokens
            t = min(512 * 1024, int(rng.lognormvariate(math.log(6000), 1.3)) + 1)
            out.append(SampleMeta(f"d{i}", "long", Modality.TEXT, 0, t, 0.0, (1,)))
    return out


def split_long(metas: list[SampleMeta]) -> list[int]:
    """Token counts after splitting text longer than MAX_LEN (what every packer packs)."""
    out = []
    for m in metas:
        n = m.num_tokens
        while n > MAX_LEN:
            out.append(MAX_LEN)
            n -= MAX_LEN
        out.append(n)
    return out


def first_fit_shuffle(sizes: list[int], window: int, seed: int = 0) -> list[int]:
    """Shuffle each window, first-fit into that window's packs, close them all at the window's end."""
    rng = random.Random(seed)
    loads: list[int] = []
    for start in range(0, len(sizes), window):
        chunk = sizes[start : start + window]
        rng.shuffle(chunk)
        packs: list[int] = []
        for s in chunk:
            for j, used in enumerate(packs):
                if used + s <= MAX_LEN:
                    packs[j] += s
                    break
            else:
                packs.append(s)
        loads += packs
    return loads


def windowed_bfd(sizes: list[int], window: int) -> list[int]:
    """Best-fit decreasing inside each window, every pack closed at the window's end (no carry-over)."""
    loads: list[int] = []
    for start in range(0, len(sizes), window):
        free: list[tuple[int, int]] = []
        packs: list[int] = []
        for s in sorted(sizes[start : start + window], reverse=True):
            j = bisect.bisect_left(free, (s, -1))
            if j < len(free):
                f, i = free.pop(j)
            else:
                packs.append(0)
                f, i = MAX_LEN, len(packs) - 1
            packs[i] += s
            bisect.insort(free, (f - s, i))
        loads += packs
    return loads


def ours(metas: list[SampleMeta], buffer: int, **kw: int) -> list[int]:
    return [p.num_tokens for p in HybridPacker(IterableWrapper(metas), MAX_LEN, buffer, **kw)]


def waits(metas: list[SampleMeta], buffer: int, age: int) -> list[int]:
    """Draws between each sample's draw and the emission of its pack."""
    drawn_at = {m.key: i for i, m in enumerate(metas)}
    packer = HybridPacker(IterableWrapper(metas), MAX_LEN, buffer, max_pack_age=age)
    return sorted(packer.stats["samples"] - drawn_at[s.key] for p in packer for s in p.samples)


def best_time(fn, repeats: int = 3):
    best, out = math.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    metas = workload(int(os.environ.get("OMNI_BENCH_SAMPLES", "30000")))
    sizes = split_long(metas)
    total = sum(sizes)
    rows = []
    for buffer in (256, 1024):
        runs = {
            "first-fit-shuffle": lambda b=buffer: first_fit_shuffle(list(sizes), b),
            "windowed-bfd (no carry-over)": lambda b=buffer: windowed_bfd(sizes, b),
            "HybridPacker (ours)": lambda b=buffer: ours(metas, b),
        }
        base_us = None
        for name, fn in runs.items():
            t, loads = best_time(fn)
            assert sum(loads) == total and max(loads) <= MAX_LEN, name
            us = t / len(metas) * 1e6
            base_us = base_us or us
            rows.append(
                {
                    "packer": name,
                    "buffer": buffer,
                    "packs": len(loads),
                    "fill": total / (len(loads) * MAX_LEN),
                    "us_per_sample": us,
                    "time_vs_first_fit": us / base_us,
                }
            )
    age_rows = []
    for age in (0, 1, 2, 4, 10**9):
        t, loads = best_time(lambda a=age: ours(metas, 1024, max_pack_age=a))
        assert sum(loads) == total and max(loads) <= MAX_LEN
        w = waits(metas, 1024, age)
        age_rows.append(
            {
                "max_pack_age": "unbounded" if age == 10**9 else age,
                "buffer": 1024,
                "fill": total / (len(loads) * MAX_LEN),
                "us_per_sample": t / len(metas) * 1e6,
                "max_wait_draws": w[-1],
                "p999_wait_draws": w[int(0.999 * (len(w) - 1))],
            }
        )
    spread_rows = []
    for buffer in (8, 64, 256, 1024):
        for spread in (0.0, HybridPacker(IterableWrapper([]), MAX_LEN).spread):
            t, loads = best_time(lambda b=buffer, sp=spread: ours(metas, b, spread=sp))
            assert sum(loads) == total and max(loads) <= MAX_LEN
            spread_rows.append(
                {
                    "spread": spread,
                    "buffer": buffer,
                    "packs": len(loads),
                    "fill": total / (len(loads) * MAX_LEN),
                    "us_per_sample": t / len(metas) * 1e6,
                }
            )
    avg = {
        m: sum(x.num_tokens for x in metas if x.source == m) / max(1, sum(x.source == m for x in metas))
        for m in ("img", "aud", "txt", "long")
    }
    print(
        f"{len(metas)} samples, {total} tokens, max_seq_len {MAX_LEN}; mean tokens: "
        + ", ".join(f"{k} {v:.0f}" for k, v in avg.items())
    )
    print(f"{'packer':32s} {'buffer':>6s} {'packs':>6s} {'fill %':>8s} {'us/sample':>10s} {'x time':>7s}")
    for r in rows:
        print(
            f"{r['packer']:32s} {r['buffer']:6d} {r['packs']:6d} {100 * r['fill']:8.3f} {r['us_per_sample']:10.2f} "
            f"{r['time_vs_first_fit']:7.2f}"
        )
    print(
        f"{'max_pack_age':>12s} {'fill %':>8s} {'us/sample':>10s} {'max wait':>9s} {'p99.9 wait':>10s}  (draws)"
    )
    for r in age_rows:
        print(
            f"{r['max_pack_age']!s:>12s} {100 * r['fill']:8.3f} {r['us_per_sample']:10.2f} "
            f"{r['max_wait_draws']:9d} {r['p999_wait_draws']:10d}"
        )
    print(f"{'spread':>6s} {'buffer':>6s} {'packs':>6s} {'fill %':>8s} {'us/sample':>10s}")
    for r in spread_rows:
        print(
            f"{r['spread']:6.2f} {r['buffer']:6d} {r['packs']:6d} {100 * r['fill']:8.3f} {r['us_per_sample']:10.2f}"
        )
    out = Path(__file__).parent / "results" / "packing.json"
    out.write_text(
        json.dumps(
            {
                "max_seq_len": MAX_LEN,
                "samples": len(metas),
                "mean_tokens": avg,
                "rows": rows,
                "pack_age": age_rows,
                "spread": spread_rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
