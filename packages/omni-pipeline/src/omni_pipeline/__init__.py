"""omni_pipeline: pipeline schedules, encoder anchors, data-flow plans, placement policies, simulator and
executor for encoder + LLM training (MegaScale-Omni's unified encoder representation and uniform
on-demand insertion)."""

from omni_pipeline.actions import Action, ActionKind, ScheduleError, flow_index, torch_index
from omni_pipeline.anchor import EncoderAnchor, EncoderDataConfig, EncoderParallelConfig
from omni_pipeline.calibrate import fit_cost_model
from omni_pipeline.cost import ActionTokens, CostModel, TokenCost, cost_key
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
    feasible_slots,
    isolated,
    place,
    prepend_first_stage,
    split_over_ranks,
    uniform_on_demand,
)
from omni_pipeline.planner import PlanResult, plan_placement, planned
from omni_pipeline.records import (
    RECORDS_FILE,
    ActionRecord,
    FlowRecord,
    P2PRecord,
    RecordError,
    RecordWriter,
    RunRecords,
    StepRecord,
    action_records,
    read_records,
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
from omni_pipeline.stage_balance import balance_stages, explicit_stages, fit_layer_costs, stage_costs
from omni_pipeline.trace import TimelineEvent, plot_timeline, write_chrome_trace

__all__ = [
    "RECORDS_FILE",
    "Action",
    "ActionKind",
    "ActionRecord",
    "ActionTokens",
    "CostModel",
    "DataFlow",
    "DataFlowError",
    "Deadlock",
    "EncoderAnchor",
    "EncoderDataConfig",
    "EncoderParallelConfig",
    "FlowRecord",
    "P2PError",
    "P2PRecord",
    "PipelineExecutor",
    "PipelineGroups",
    "PlacementPolicy",
    "PlanResult",
    "RecordError",
    "RecordWriter",
    "RunRecords",
    "Schedule",
    "Schedule1F1B",
    "ScheduleError",
    "ScheduleFromActions",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "SimulationResult",
    "StepFunctions",
    "StepPlan",
    "StepRecord",
    "StepResult",
    "TimelineEvent",
    "TokenCost",
    "action_records",
    "balance_stages",
    "cost_key",
    "explicit_stages",
    "feasible_slots",
    "fit_cost_model",
    "fit_layer_costs",
    "flow_index",
    "isolated",
    "place",
    "plan_placement",
    "planned",
    "plot_timeline",
    "prepend_first_stage",
    "read_records",
    "simulate",
    "split_over_ranks",
    "stage_costs",
    "stage_slices",
    "torch_index",
    "uniform_on_demand",
    "validate_comms",
    "write_chrome_trace",
]
__version__ = "0.3.0"
