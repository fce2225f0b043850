"""omni_pipeline: pipeline schedules, encoder anchors, data-flow plans, placement policies, simulator and
executor for encoder + LLM training (MegaScale-Omni's unified encoder representation and uniform
on-demand insertion)."""

from omni_pipeline.actions import Action, ActionKind, ScheduleError, flow_index, torch_index
from omni_pipeline.anchor import EncoderAnchor, EncoderDataConfig, EncoderParallelConfig
from omni_pipeline.cost import CostModel
from omni_pipeline.dataflow import DataFlow, DataFlowError
from omni_pipeline.executor import (
    PipelineExecutor,
    PipelineGroups,
    StepFunctions,
    StepPlan,
    StepResult,
)
from omni_pipeline.graph import Deadlock
from omni_pipeline.p2p import P2PError
from omni_pipeline.placement import (
    PlacementPolicy,
    isolated,
    place,
    prepend_first_stage,
    split_over_ranks,
    uniform_on_demand,
)
from omni_pipeline.schedules import (
    Schedule,
    Schedule1F1B,
    ScheduleFromActions,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    validate_comms,
)
from omni_pipeline.simulator import SimulationResult, simulate
from omni_pipeline.split import stage_slices
from omni_pipeline.trace import TimelineEvent, plot_timeline, write_chrome_trace

__all__ = [
    "Action",
    "ActionKind",
    "CostModel",
    "DataFlow",
    "DataFlowError",
    "Deadlock",
    "EncoderAnchor",
    "EncoderDataConfig",
    "EncoderParallelConfig",
    "P2PError",
    "PipelineExecutor",
    "PipelineGroups",
    "PlacementPolicy",
    "Schedule",
    "Schedule1F1B",
    "ScheduleError",
    "ScheduleFromActions",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "SimulationResult",
    "StepFunctions",
    "StepPlan",
    "StepResult",
    "TimelineEvent",
    "flow_index",
    "isolated",
    "place",
    "plot_timeline",
    "prepend_first_stage",
    "simulate",
    "split_over_ranks",
    "stage_slices",
    "torch_index",
    "uniform_on_demand",
    "validate_comms",
    "write_chrome_trace",
]
__version__ = "0.2.0"
