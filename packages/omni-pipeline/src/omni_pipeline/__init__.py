"""omni_pipeline: pipeline schedules, encoder anchors, data-flow plans, placement policies, simulator and
executor for encoder + LLM training (MegaScale-Omni's unified encoder representation and uniform
on-demand insertion)."""

from omni_pipeline.actions import Action, ActionKind, ScheduleError, flow_index, torch_index
from omni_pipeline.anchor import EncoderAnchor, EncoderDataConfig, EncoderParallelConfig
from omni_pipeline.calibrate import calibrated_layer_costs, fit_cost_model, fit_run, fitted_cost_model
from omni_pipeline.cost import ActionTokens, CostModel, TokenCost, cost_key
from omni_pipeline.cp_delivery import CPSharding, CPSpec, build_cp_sharding
from omni_pipeline.dataflow import DataFlow, DataFlowError
from omni_pipeline.decoder_stage import DecoderStage, packed_causal_mask
from omni_pipeline.encoder_parallel import EncoderParallel, EncoderWork, SequenceLayout
from omni_pipeline.executor import (
    PipelineExecutor,
    PipelineGroups,
    StepFunctions,
    StepPlan,
    StepResult,
)
from omni_pipeline.graph import Deadlock
from omni_pipeline.loss import microbatch_loss
from omni_pipeline.microbatch import (
    IGNORE,
    MODALITIES,
    LLMMicrobatch,
    build_llm_microbatch,
    step_targets,
    ulysses_chunk,
    ulysses_layout,
)
from omni_pipeline.p2p import P2PError
from omni_pipeline.placement import (
    PlacementPolicy,
    disaggregated_programs,
    encoder_ranks_for,
    feasible_slots,
    isolated,
    optimus_static,
    prepend_first_stage,
    simulate_disaggregated,
    split_over_ranks,
    uniform_on_demand,
)
from omni_pipeline.planner import PlanResult, plan_placement, planned
from omni_pipeline.policy import place
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
    gather_step_records,
    read_records,
)
from omni_pipeline.schedules import (
    Schedule,
    Schedule1F1B,
    ScheduleFromActions,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleKind,
    build_schedule,
    validate_comms,
)
from omni_pipeline.simulator import SimulationResult, simulate, simulate_programs
from omni_pipeline.split import LLMShape, layer_costs, split_layers, stage_slices
from omni_pipeline.stage_balance import balance_stages, explicit_stages, fit_layer_costs, stage_costs
from omni_pipeline.step_costs import (
    MODEL_SCALES,
    MODEL_SHAPES,
    P2P_BANDWIDTH_BPS,
    P2P_LATENCY_S,
    ModelScale,
    action_tokens,
    calibrated_step_costs,
    encoder_forward_flops,
    model_scale,
    modelled_step_costs,
)
from omni_pipeline.step_inputs import StepBuilder, StepInputs, StepSpec, undecodable_samples
from omni_pipeline.step_plan import PlannerSpec, StepPlanner, stage_weights, static_flow
from omni_pipeline.tower_inputs import image_patches
from omni_pipeline.towers import ModalityRouter, TowerBatch, TowerInputs
from omni_pipeline.trace import TimelineEvent, plot_timeline, write_chrome_trace
from omni_pipeline.workload import (
    LengthDistribution,
    MixturePhase,
    Workload,
    WorkloadError,
    WorkloadSource,
    load_workload,
    parse_workload,
)

__all__ = [
    "IGNORE",
    "MODALITIES",
    "MODEL_SCALES",
    "MODEL_SHAPES",
    "P2P_BANDWIDTH_BPS",
    "P2P_LATENCY_S",
    "RECORDS_FILE",
    "Action",
    "ActionKind",
    "ActionRecord",
    "ActionTokens",
    "CPSharding",
    "CPSpec",
    "CostModel",
    "DataFlow",
    "DataFlowError",
    "Deadlock",
    "DecoderStage",
    "EncoderAnchor",
    "EncoderDataConfig",
    "EncoderParallel",
    "EncoderParallelConfig",
    "EncoderWork",
    "FlowRecord",
    "LLMMicrobatch",
    "LLMShape",
    "LengthDistribution",
    "MixturePhase",
    "ModalityRouter",
    "ModelScale",
    "P2PError",
    "P2PRecord",
    "PipelineExecutor",
    "PipelineGroups",
    "PlacementPolicy",
    "PlanResult",
    "PlannerSpec",
    "RecordError",
    "RecordWriter",
    "RunRecords",
    "Schedule",
    "Schedule1F1B",
    "ScheduleError",
    "ScheduleFromActions",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleKind",
    "SequenceLayout",
    "SimulationResult",
    "StepBuilder",
    "StepFunctions",
    "StepInputs",
    "StepPlan",
    "StepPlanner",
    "StepRecord",
    "StepResult",
    "StepSpec",
    "TimelineEvent",
    "TokenCost",
    "TowerBatch",
    "TowerInputs",
    "Workload",
    "WorkloadError",
    "WorkloadSource",
    "action_records",
    "action_tokens",
    "balance_stages",
    "build_cp_sharding",
    "build_llm_microbatch",
    "build_schedule",
    "calibrated_layer_costs",
    "calibrated_step_costs",
    "cost_key",
    "disaggregated_programs",
    "encoder_forward_flops",
    "encoder_ranks_for",
    "explicit_stages",
    "feasible_slots",
    "fit_cost_model",
    "fit_layer_costs",
    "fit_run",
    "fitted_cost_model",
    "flow_index",
    "gather_step_records",
    "image_patches",
    "isolated",
    "layer_costs",
    "load_workload",
    "microbatch_loss",
    "model_scale",
    "modelled_step_costs",
    "optimus_static",
    "packed_causal_mask",
    "parse_workload",
    "place",
    "plan_placement",
    "planned",
    "plot_timeline",
    "prepend_first_stage",
    "read_records",
    "simulate",
    "simulate_disaggregated",
    "simulate_programs",
    "split_layers",
    "split_over_ranks",
    "stage_costs",
    "stage_slices",
    "stage_weights",
    "static_flow",
    "step_targets",
    "torch_index",
    "ulysses_chunk",
    "ulysses_layout",
    "undecodable_samples",
    "uniform_on_demand",
    "validate_comms",
    "write_chrome_trace",
]
__version__ = "0.7.0"
