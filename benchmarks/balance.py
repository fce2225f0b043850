"""Load-balancing quality and speed: Karmarkar-Karp (ours) vs greedy LPT vs a plain heap-of-tuples LDM.

Costs are lognormal(7, 1.2) (heavy-tailed, like per-sample encoder FLOPs). Quality is the heaviest
part over the ideal ``sum / k`` and over a lower bound on the optimum: ``max(sum / k, max cost)``, and
with ``equal_size`` also ``max cost + the n // k - 1 smallest other costs`` (the part holding the
largest item holds at least n // k items). At n=256, k=64 one item alone is ~2.5x ``sum / k``, so the
issue's "1.01x of the ideal" can only be read against the bound there; the target check at the end
uses ``max/bound``. Time is the best of a few runs, in the same process; the speed ratio is
against the plain LDM baseline. Times are CPU seconds of this process (the machine is shared). Also: hybrid DP/CP modelled max/mean rank load on lognormal lengths
clipped to 1k-128k tokens, against round-robin placement.

Run: ``uv run python benchmarks/balance.py``; writes ``benchmarks/results/balance.json``.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import time
from pathlib import Path

from omni_parallel import hybrid_cp_load, karmarkar_karp, lpt, partition_loads, plan_hybrid_cp


def plain_ldm(costs: list[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Heap of k-tuples, one tuple per item (or per chunk of k items with equal_size), re-sorted and
    normalised on every merge: the straightforward version RL trainers ship."""
    order = sorted(range(len(costs)), key=lambda i: (costs[i], i))
    seeds: list[list[tuple[float, list[int]]]] = []
    if equal_size:
        for start in range(0, len(order), k):
            chunk = order[start : start + k]
            seeds.append([(costs[i], [i]) for i in chunk] + [(0.0, []) for _ in range(k - len(chunk))])
    else:
        seeds = [[(costs[i], [i])] + [(0.0, []) for _ in range(k - 1)] for i in order]
    heap = []
    for t, s in enumerate(seeds):
        s.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(s[0][0] - s[-1][0]), t, s))
    t = len(seeds)
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda p: -p[0])
        low = merged[-1][0]
        merged = [(s - low, items) for s, items in merged]
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), t, merged))
        t += 1
    return [items for _, items in heap[0][2]]


def _best_time(fn, repeats: int) -> tuple[float, list[list[int]]]:
    best, out = math.inf, None
    for _ in range(repeats):
        # CPU time of this process: the benchmark shares its cores, wall time would measure neighbours.
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def lower_bound(costs: list[float], k: int, equal_size: bool) -> float:
    """A lower bound on the optimal heaviest part (units of ``costs``)."""
    bound = max(sum(costs) / k, max(costs))
    if equal_size and len(costs) >= k:
        rest = sorted(costs)
        rest.remove(max(costs))
        bound = max(bound, max(costs) + math.fsum(rest[: len(costs) // k - 1]))
    return bound


def balance_rows(seed: int = 0) -> list[dict]:
    rows = []
    rng = random.Random(seed)
    for n in (256, 1024, 16384):
        costs = [rng.lognormvariate(7, 1.2) for _ in range(n)]
        for k in (8, 64):
            ideal = sum(costs) / k
            for equal in (False, True):
                bound = lower_bound(costs, k, equal)
                methods = {
                    "karmarkar_karp": lambda c=costs, k=k, e=equal: karmarkar_karp(c, k, equal_size=e),
                    "lpt": lambda c=costs, k=k, e=equal: lpt(c, k, equal_size=e),
                    "plain_ldm": lambda c=costs, k=k, e=equal: plain_ldm(c, k, e),
                }
                times = {}
                for name, fn in methods.items():
                    repeats = 1 if (name == "plain_ldm" and n >= 16384) else 5
                    dt, parts = _best_time(fn, repeats)
                    loads = partition_loads(costs, parts)
                    times[name] = dt
                    rows.append(
                        {
                            "n": n,
                            "k": k,
                            "equal_size": equal,
                            "method": name,
                            "max_over_ideal": max(loads) / ideal,
                            "max_over_bound": max(loads) / bound,
                            "cpu_ms": dt * 1e3,
                        }
                    )
                for r in rows[-3:]:
                    r["speedup_vs_plain_ldm"] = times["plain_ldm"] / times[r["method"]]
    return rows


HYBRID_SETTINGS = ((8, 4, 32768), (16, 8, 32768), (32, 8, 65536))  # (dp_cp, microbatches, tokens per rank)


def lognormal_lengths(rng: random.Random, budget: float) -> list[int]:
    """Sample lengths (tokens), lognormal(9.0, 1.3) clipped to 1K-128K, drawn until they sum to ``budget``."""
    lengths: list[int] = []
    while sum(lengths) < budget:
        lengths.append(int(min(max(rng.lognormvariate(9.0, 1.3), 1024), 131072)))
    return lengths


def hybrid_rows(seed: int = 1) -> list[dict]:
    rows = []
    rng = random.Random(seed)
    for dp_cp, mbs, cap in HYBRID_SETTINGS:
        lengths = lognormal_lengths(rng, 0.6 * dp_cp * mbs * cap)
        t0 = time.perf_counter()
        plan = plan_hybrid_cp(lengths, dp_cp, cap, num_microbatches=mbs)
        dt = time.perf_counter() - t0
        # Baseline: arrival order, round-robin over (microbatch, rank) blocks, smallest CP that fits.
        slots = [[0.0] * dp_cp for _ in range(mbs)]
        cursor = 0
        for n in lengths:
            cp = next(
                c
                for c in (1, 2, 4, 8, 16, 32)
                if (dp_cp % c == 0 and -(-n // (2 * c)) * 2 <= cap) or (c == 1 and n <= cap)
            )
            m, first = divmod(cursor % (mbs * dp_cp), dp_cp)
            first -= first % cp
            for r in range(first, first + cp):
                slots[m][r] += hybrid_cp_load(n, cp)
            cursor += cp
        flat = [x for row in slots for x in row]
        rows.append(
            {
                "dp_cp": dp_cp,
                "microbatches": mbs,
                "max_tokens_per_rank": cap,
                "samples": len(lengths),
                "cp_sharded": sum(s.cp > 1 for s in plan.slots),
                "max_over_mean": plan.imbalance,
                "round_robin_max_over_mean": max(flat) / (sum(flat) / len(flat)),
                "plan_ms": dt * 1e3,
            }
        )
    return rows


def main() -> None:
    balance = balance_rows()
    print("Karmarkar-Karp vs LPT vs plain heap-of-tuples LDM, lognormal(7, 1.2) costs")
    print(
        f"{'n':>6} {'k':>3} {'equal':>5} {'method':>15} {'max/ideal':>9} {'max/bound':>9} {'cpu ms':>9} {'x plain':>8}"
    )
    for r in balance:
        print(
            f"{r['n']:>6} {r['k']:>3} {r['equal_size']!s:>5} {r['method']:>15} {r['max_over_ideal']:>9.4f} "
            f"{r['max_over_bound']:>9.4f} {r['cpu_ms']:>9.2f} {r['speedup_vs_plain_ldm']:>8.1f}"
        )
    print(
        "\nTargets (issue 3): Karmarkar-Karp max/bound <= 1.01 for n >= 256, k <= 64; n=16384, k=64 in <= 50 ms"
    )
    for r in balance:
        if r["method"] != "karmarkar_karp":
            continue
        ok = r["max_over_bound"] <= 1.01 and (r["n"] != 16384 or r["k"] != 64 or r["cpu_ms"] <= 50.0)
        print(
            f"  n={r['n']:>5} k={r['k']:>2} equal={r['equal_size']!s:>5}: max/bound {r['max_over_bound']:.4f}, "
            f"{r['cpu_ms']:.1f} ms  {'ok' if ok else 'MISSED'}"
        )
    hybrid = hybrid_rows()
    print("\nHybrid DP/CP modelled load, lognormal lengths 1k-128k tokens")
    print(
        f"{'dp_cp':>5} {'mbs':>4} {'cap':>6} {'samples':>7} {'cp>1':>5} {'max/mean':>8} {'round-robin':>11} {'ms':>7}"
    )
    for r in hybrid:
        r["target_ok"] = r["max_over_mean"] <= 1.05
        print(
            f"{r['dp_cp']:>5} {r['microbatches']:>4} {r['max_tokens_per_rank']:>6} {r['samples']:>7} "
            f"{r['cp_sharded']:>5} {r['max_over_mean']:>8.3f} {r['round_robin_max_over_mean']:>11.3f} {r['plan_ms']:>7.1f}"
            f"  {'ok' if r['target_ok'] else 'MISSED'} (target max/mean <= 1.05)"
        )
    out = Path(__file__).resolve().parent / "results" / "balance.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"balance": balance, "hybrid_cp": hybrid}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
