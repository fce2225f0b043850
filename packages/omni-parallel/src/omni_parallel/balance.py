"""Multi-way number partitioning: Karmarkar-Karp largest differencing (LDM) and greedy LPT.

Both are pure and deterministic: items are ordered by ``(-cost, index)`` and every tie after that is
broken by a creation counter, so every rank computing a plan from the same metadata gets the same answer
(§ decentralized grouped reordering).

Algorithm (Karmarkar & Karp 1982, "The differencing method of set partitioning"; multi-way form as in
Korf, "Multi-way number partitioning", IJCAI 2009): keep a heap of k-tuples of part sums keyed by their
spread (max - min). Repeatedly pop the two tuples with the largest spreads and merge them by pairing the
heaviest part of one with the lightest part of the other; the merged tuple goes back into the heap.

Implementation notes (why it is fast without numpy):
- Part sums are never normalised: pairing and spreads only depend on differences, so raw sums work.
- A tuple stores only its *used* parts, ascending; the missing ``k - m`` parts are empty (sum 0, no item).
  Merging a one-item tuple into a tuple is then one ``bisect.insort`` instead of an O(k) loop.
- One-item tuples never enter the heap: they are a descending array read by a pointer.
- Membership is a merge tree (node = item or pair of nodes), flattened once at the end.
- With ``equal_size`` the seeds are chunks of k consecutive items of the sorted order (one item per part),
  so every part receives one item per full chunk: n//k or n//k + 1 items. Chunks of small items have
  tiny spreads and cannot close the gaps the large ones leave (the plain version ends 1.05-1.4x off on
  heavy tails), so a size-preserving swap search between the heaviest and lighter parts follows.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence

__all__ = ["karmarkar_karp", "lpt", "partition_loads"]

# A tuple's used parts: ascending list of (part_sum, node_id). Node ids are unique, so sorting is total.
_Parts = list[tuple[float, int]]


def _check(costs: Sequence[float], k: int) -> list[float]:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"number of parts k must be a positive int, got {k!r}")
    values = [float(c) for c in costs]
    for i, c in enumerate(values):
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"costs[{i}] = {c!r}: costs must be finite and >= 0")
    return values


def partition_loads(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> list[float]:
    """Sum of ``costs`` per part, in part order (units of ``costs``)."""
    return [math.fsum(float(costs[i]) for i in p) for p in parts]


def karmarkar_karp(costs: Sequence[float], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Partition item indices into ``k`` parts of near-equal total cost (largest differencing method).

    Args:
        costs: ``[n]`` non-negative finite costs (any unit: tokens, FLOPs, seconds).
        k: number of parts, >= 1.
        equal_size: if True every part gets ``n // k`` or ``n // k + 1`` items (balanced LDM, then
            pairwise swaps that never raise the heaviest part).

    Returns:
        ``k`` lists of item indices (each ascending); every index in ``range(n)`` appears exactly once.
        Parts are ordered by descending load, ties by their smallest index. Deterministic: the same
        ``costs`` (in the same order) always give the same answer.

    Raises:
        ValueError: ``k < 1``, or a cost is negative, NaN or infinite.

    Source: Karmarkar & Karp (1982); multi-way LDM per Korf (2009). Quality on lognormal(7, 1.2) costs
    and timing are measured in ``benchmarks/balance.py`` against greedy LPT and a plain heap-of-tuples LDM.
    """
    values = _check(costs, k)
    n = len(values)
    if k == 1 or n <= 1:
        return _finish([[i for i in range(n)]] + [[] for _ in range(k - 1)], values, k)
    # Descending cost, ties by ascending index: a stable sort keeps equal items in index order even
    # when reversed, and a plain key is ~3x faster than a (-cost, index) tuple key.
    order = sorted(range(n), key=values.__getitem__, reverse=True)

    left: list[int] = []  # merge tree: node n + j has children (left[j], right[j])
    right: list[int] = []

    def join(a: int | None, b: int | None) -> int | None:
        if a is None:
            return b
        if b is None:
            return a
        left.append(a)
        right.append(b)
        return n + len(left) - 1

    def spread(parts: _Parts) -> float:
        low = parts[0][0] if len(parts) == k else 0.0
        return parts[-1][0] - low

    def merge(a: _Parts, b: _Parts) -> _Parts:
        # Pair a's heaviest with b's lightest. Missing parts are empty (sum 0, lightest).
        if len(a) == 1:
            a, b = b, a
        if len(b) == 1:
            # One item: it lands on a's lightest part, which is an empty one while a has any.
            if len(a) == k:
                s, node = a.pop(0)
                left.append(node)
                right.append(b[0][1])
                bisect.insort(a, (s + b[0][0], n + len(left) - 1))
            else:
                bisect.insort(a, b[0])
            return a
        if len(a) + len(b) <= k:
            return sorted(a + b)
        a_desc: list[tuple[float, int | None]] = [*reversed(a), *([(0.0, None)] * (k - len(a)))]
        b_asc: list[tuple[float, int | None]] = [*([(0.0, None)] * (k - len(b))), *b]
        out: _Parts = []
        for (sa, na), (sb, nb) in zip(a_desc, b_asc):
            node = join(na, nb)
            if node is not None:
                out.append((sa + sb, node))
        out.sort()
        return out

    heap: list[tuple[float, int, _Parts]] = []  # (-spread, tie counter, parts)
    counter = n
    singles: list[int] = []
    if equal_size:
        for start in range(0, n, k):
            chunk = order[start : start + k]
            parts = sorted((values[i], i) for i in chunk)
            heap.append((-spread(parts), start, parts))
        heapq.heapify(heap)
    else:
        singles = order
    pos = 0  # next unused single; its heap key would be (-values[order[pos]], pos)

    def pop() -> _Parts:
        nonlocal pos
        if pos < len(singles):
            i = singles[pos]
            if not heap or (-values[i], pos) < heap[0][:2]:
                pos += 1
                return [(values[i], i)]
        return heapq.heappop(heap)[2]

    n_singles = len(singles)
    while len(heap) + (n_singles - pos) > 1:
        if pos < n_singles and heap:
            # Fast path, most of the run without equal_size: the widest tuple is the first pick and
            # the next single the second. The item joins the tuple's lightest part (an empty one
            # while the tuple has fewer than k used parts), as merge() would; one heapreplace.
            i = singles[pos]
            key = (-values[i], pos)
            second = min(heap[1:3]) if len(heap) > 1 else None
            if heap[0][:2] < key and (second is None or key < second[:2]):
                parts = heap[0][2]
                if len(parts) == k:
                    s, node = parts.pop(0)
                    left.append(node)
                    right.append(i)
                    bisect.insort(parts, (s + values[i], n + len(left) - 1))
                    low = parts[0][0]
                else:
                    bisect.insort(parts, (values[i], i))
                    low = parts[0][0] if len(parts) == k else 0.0
                pos += 1
                heapq.heapreplace(heap, (low - parts[-1][0], counter, parts))
                counter += 1
                continue
        a = pop()
        b = pop()
        merged = merge(a, b)
        heapq.heappush(heap, (-spread(merged), counter, merged))
        counter += 1

    final = heap[0][2] if heap else [(values[singles[pos]], singles[pos])]
    result: list[list[int]] = []
    for _, node in final:
        items: list[int] = []
        stack = [node]
        while stack:
            x = stack.pop()
            if x < n:
                items.append(x)
            else:
                stack.append(right[x - n])
                stack.append(left[x - n])
        result.append(items)
    result.extend([] for _ in range(k - len(final)))
    if equal_size:
        _swap_refine(result, values)
    return _finish(result, values, k)


def _swap_refine(parts: list[list[int]], values: list[float], partners: int | None = None) -> None:
    """Size-preserving local search: swap one item of the heaviest part with one of a light part.

    Chunk-seeded differencing leaves a residual spread that chunks of small items cannot close (their
    spreads are tiny), so equal-size partitions come out 1.05-1.2x off on heavy-tailed costs. A swap of
    items with cost difference d, 0 < d < gap, strictly lowers the sum of squared loads, so the search
    terminates; each round picks d closest to gap / 2 against the lightest part that allows a swap
    (``partners`` limits how many are tried; default all). It stops early once the heaviest part is
    within 1e-6 (relative) of the mean, or after 64 k rounds.
    """
    k = len(parts)
    loads = [math.fsum(values[i] for i in p) for p in parts]
    # Per part: items ascending by (cost, index), and their costs, for bisection.
    members = [sorted(p, key=lambda i: (values[i], i)) for p in parts]
    keys = [[values[i] for i in m] for m in members]
    target = math.fsum(loads) / k * (1 + 1e-6)
    for _ in range(64 * k):
        h = max(range(k), key=lambda j: (loads[j], -j))
        if loads[h] <= target:
            break
        by_load = sorted(range(k), key=lambda j: (loads[j], j))[: k - 1 if partners is None else partners]
        best: tuple[float, int, int, int] | None = None
        for low in by_load:
            gap = loads[h] - loads[low]
            if gap <= 0:
                break
            cl = keys[low]
            for a, ci in enumerate(keys[h]):
                t = bisect.bisect_left(cl, ci - gap / 2)
                for b in (t - 1, t):
                    if 0 <= b < len(cl):
                        d = ci - cl[b]
                        if 0 < d < gap:
                            score = abs(gap / 2 - d)
                            if best is None or score < best[0]:
                                best = (score, low, a, b)
            if best is not None:
                break
        if best is None:
            break
        _, low, a, b = best
        i, j = members[h].pop(a), members[low].pop(b)
        keys[h].pop(a)
        keys[low].pop(b)
        d = values[i] - values[j]
        loads[h] -= d
        loads[low] += d
        for part, item in ((h, j), (low, i)):
            pos = bisect.bisect_left(keys[part], values[item])
            members[part].insert(pos, item)
            keys[part].insert(pos, values[item])
    for j in range(k):
        parts[j] = members[j]


def _finish(parts: list[list[int]], values: list[float], k: int) -> list[list[int]]:
    for p in parts:
        p.sort()
    loads = partition_loads(values, parts)
    idx = sorted(range(k), key=lambda j: (-loads[j], parts[j][0] if parts[j] else math.inf, j))
    return [parts[j] for j in idx]


def lpt(costs: Sequence[float], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Greedy longest-processing-time-first: each item, heaviest first, goes to the lightest part.

    With ``equal_size`` a part stops taking items once it holds ``ceil(n / k)`` items and, once the
    ``n % k`` larger parts are filled, the rest stop at ``n // k``. A baseline for :func:`karmarkar_karp`.

    Args:
        costs: ``[n]`` non-negative finite costs.
        k: number of parts, >= 1.
        equal_size: cap every part at ``n // k`` or ``n // k + 1`` items.

    Returns:
        ``k`` ascending lists of item indices, ordered as in :func:`karmarkar_karp`.

    Raises:
        ValueError: ``k < 1``, or a cost is negative, NaN or infinite.

    Source: Graham (1969), "Bounds on multiprocessing timing anomalies" (4/3 - 1/(3k) bound).
    """
    values = _check(costs, k)
    n = len(values)
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0.0, j) for j in range(k)]
    big_left = n % k  # parts allowed n // k + 1 items
    full = n // k
    for i in sorted(range(n), key=values.__getitem__, reverse=True):  # stable: ties by index
        while True:
            load, j = heapq.heappop(heap)
            size = len(parts[j])
            # A part popped while no longer open is dropped: big_left never grows back.
            if not equal_size or size < full or (size == full and big_left > 0):
                break
        parts[j].append(i)
        if equal_size and len(parts[j]) == full + 1:
            big_left -= 1
            continue
        heapq.heappush(heap, (load + values[i], j))
    return _finish(parts, values, k)
