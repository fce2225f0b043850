"""``gather_step_records``: every pipeline rank's records of a step reach the pipeline's first rank.

Reference: the records each rank builds by hand from its own timeline (``action_records``, its receives,
a ``StepRecord``), concatenated in pipeline-rank order, on 2 gloo processes; the flow record only where
it is given; ``None`` on the other rank. Then written and read back through ``RecordWriter`` /
``read_records``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch.distributed as dist

from omni_parallel.testing import run_world
from omni_pipeline import (
    ActionTokens,
    DataFlow,
    P2PRecord,
    RecordWriter,
    StepRecord,
    TimelineEvent,
    action_records,
    gather_step_records,
    read_records,
)


def _result(rank: int):
    timeline = [TimelineEvent(rank, f"{rank}F0", "F", 0.1 * rank, 0.1 * rank + 0.05)]
    if rank == 0:
        timeline.append(TimelineEvent(0, "EF1", "EF", 0.0, 0.02))
    p2p = [P2PRecord(7, rank, 1 - rank, "activation", 0, 64 * (rank + 1), 0.01, None)]
    return SimpleNamespace(timeline=timeline, waits={f"{rank}F0": 0.001 * (rank + 1)}, p2p=p2p)


def _flow() -> DataFlow:
    return DataFlow({1: (0, (0, 1)), -1: (0, (-1, 0))}, {1: [1]})


TOKENS = ({1: ActionTokens.single("llm", 12)}, {1: ActionTokens.single("image", 8)})


def _expected(rank: int):
    r = _result(rank)
    out = action_records(7, r.timeline, *TOKENS, r.waits) + r.p2p
    out.append(StepRecord(7, rank, 1.5, max(ev.end_s for ev in r.timeline)))
    return out


def _world(rank: int, world_size: int):
    group = dist.new_group([0, 1])
    flow = _flow() if rank == 0 else None
    return gather_step_records(7, _result(rank), *TOKENS, wall_s=1.5, pp_rank=rank, pp_group=group, flow=flow)


def test_records_of_both_ranks_reach_the_first_in_order(tmp_path):
    got = run_world(_world, 2, timeout_s=120)
    assert got[1] is None
    flow = _flow()
    want = _expected(0)
    assert got[0][: len(want)] == want
    assert got[0][len(want)].flow == flow.to_json()
    assert got[0][len(want) + 1 :] == _expected(1)
    writer = RecordWriter(tmp_path / "actions.jsonl")
    writer.write(got[0])
    writer.close()
    back = read_records(tmp_path / "actions.jsonl")
    assert len(back.actions) == 3 and len(back.p2p) == 2 and len(back.steps) == 2 and len(back.flows) == 1


def test_one_rank_keeps_its_own_records():
    got = gather_step_records(7, _result(0), *TOKENS, wall_s=1.5, pp_rank=0, pp_group=None)
    assert got == _expected(0)
