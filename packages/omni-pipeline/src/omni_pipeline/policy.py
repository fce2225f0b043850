"""A placement policy run by its name (:class:`~omni_pipeline.placement.PlacementPolicy`), for configs and
command lines.

It sits above both the paper's baselines (:mod:`omni_pipeline.placement`) and the search that starts from
them (:mod:`omni_pipeline.planner`), so neither of those imports the other's caller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from omni_pipeline.cost import CostModel
from omni_pipeline.dataflow import DataFlow
from omni_pipeline.placement import PlacementPolicy, isolated, prepend_first_stage, uniform_on_demand
from omni_pipeline.planner import planned
from omni_pipeline.schedules import Schedule

__all__ = ["place"]


def place(
    policy: PlacementPolicy | str,
    schedule: Schedule,
    encoder_inputs: Mapping[int, Sequence[int]],
    costs: CostModel | None = None,
    *,
    fixed_ranks: bool = False,
    memory_cap_bytes: float | Mapping[int, float] | None = None,
) -> DataFlow:
    """Run the named placement policy; ``fixed_ranks`` goes to ``isolated`` / ``uniform_on_demand`` /
    ``planned`` (``prepend_first_stage`` always runs every encoder microbatch on rank 0);
    ``memory_cap_bytes`` (per-rank peak stored activations) only to ``planned``
    (:func:`omni_pipeline.planner.planned`).

    Raises:
        ValueError: unknown policy name.
        DataFlowError: as the policy raises it (bad ``encoder_inputs``).
    """
    policy = PlacementPolicy(policy)
    if policy == PlacementPolicy.PLANNED:
        return planned(
            schedule, encoder_inputs, costs, memory_cap_bytes=memory_cap_bytes, fixed_ranks=fixed_ranks
        )
    if policy == PlacementPolicy.PREPEND_FIRST_STAGE:
        return prepend_first_stage(schedule, encoder_inputs)
    if policy == PlacementPolicy.ISOLATED:
        return isolated(
            schedule, encoder_inputs, costs.encoder_forward_s if costs else None, fixed_ranks=fixed_ranks
        )
    return uniform_on_demand(schedule, encoder_inputs, costs, fixed_ranks=fixed_ranks)
