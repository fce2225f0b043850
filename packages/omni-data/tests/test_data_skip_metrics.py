"""Skips reduced over a parallel run (:class:`omni_data.SkipMetrics`), on 2 gloo processes.

Each rank runs a real packer (:class:`~omni_data.HybridPacker` over :class:`~omni_data.testing.SyntheticSource`,
``overlong="drop"``) that drops over-long samples into its metadata ledger. The reference is brute force:
every rank's own :func:`omni_data.skip_report`, all-gathered, and the ranks that count metadata chosen by
hand. Two layouts in one world:

* ``pp=2``: both ranks are one DP rank holding the same metadata stream (same seed), so the world's count
  is rank 0's alone (the pipeline rank 1 counts the same skips and must not add them);
* ``dp=2``: two DP ranks with their own streams (seeds differ): the world's count is the sum of both, and
  the keys are named in rank order. Rank 0 alone says, once per source, that it skipped.
"""

from __future__ import annotations

import torch.distributed as dist

from omni_data import HybridPacker, SkipMetrics, merge_skip_reports, skip_report
from omni_data.testing import SyntheticSource
from omni_parallel import ParallelConfig, ParallelState
from omni_parallel.testing import run_world


def _packer(seed: int) -> HybridPacker:
    # tokens log-uniform in [4, 64] against packs of 32: roughly a quarter of the samples are dropped
    return HybridPacker(SyntheticSource("img", "image", (4, 64), seed=seed), 32, 8, overlong="drop")


def _run(ps: ParallelState, seed: int, steps: int) -> dict:
    packer = _packer(seed)
    said: list[str] = []
    skips = SkipMetrics(packer, ps, notice=said.append)
    skips.start()
    deltas = []
    for _ in range(steps):
        for _ in range(3):
            next(packer)
        deltas.append(skips.step())
    mine = skip_report(packer, max_keys=20)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"deltas": deltas, "summary": skips.summary(), "said": said, "reports": everyone}


def _world(rank: int, world_size: int) -> dict:
    pp = ParallelState.build(ParallelConfig(pp=2))
    dp = ParallelState.build(ParallelConfig(dp=2))
    return {"pp": _run(pp, seed=1, steps=2), "dp": _run(dp, seed=rank, steps=2)}


def test_skips_are_counted_once_per_dp_rank_and_summed_over_dp_ranks():
    results = run_world(_world, 2, timeout_s=120)
    for layout, counting in (("pp", [0]), ("dp", [0, 1])):
        reports = results[0][layout]["reports"]
        expected = merge_skip_reports([reports[r] for r in counting], 20)
        assert expected["total"] > 0, "the packers dropped nothing: the test tests nothing"
        for rank, r in enumerate(results):
            got = r[layout]
            assert got["summary"] == expected, (layout, rank)
            # the steps' deltas add up to the totals; the same on every rank
            summed: dict[str, int] = {}
            for d in got["deltas"]:
                for k, n in d["skipped"].items():
                    summed[k] = summed.get(k, 0) + n
            assert summed == {f"img/{reason}": n for reason, n in expected["metadata"]["img"].items()}
            assert got["deltas"] == results[0][layout]["deltas"]
            assert len(got["said"]) == (1 if rank == 0 else 0), (layout, rank, got["said"])
        first = results[0][layout]["said"][0]
        assert first.startswith("source 'img' skipped ") and " over-long image " in first, first
