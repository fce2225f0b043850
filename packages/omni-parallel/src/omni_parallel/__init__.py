"""omni_parallel: topology, process groups, sequence parallelism (Ulysses, CP), resharding, load balancing.

Imports only torch. See the package README for the API table.
"""

from omni_parallel.activation_memory import ActivationMemory, StepPeaks
from omni_parallel.balance import karmarkar_karp, lpt, partition_loads
from omni_parallel.comm import all_gather_dim0, all_reduce_sum, all_to_all_dim0
from omni_parallel.context_parallel import (
    CPLayout,
    context_parallel_attention,
    cp_layout,
    shard_for_cp,
    unshard_from_cp,
)
from omni_parallel.flops import (
    TransformerShape,
    attention_flops,
    forward_flops,
    layer_flops_per_token,
    matmul_params,
    measure_peak_flops,
    model_flops,
)
from omni_parallel.grad_clip import clip_grad_norm_
from omni_parallel.hybrid_cp import (
    CPAttention,
    CPSequence,
    HybridCPPlan,
    HybridCPSlot,
    LocalSegment,
    LocalSequence,
    cp_sequence_attention,
    hybrid_cp_blocks,
    hybrid_cp_load,
    local_sequence,
    plan_hybrid_cp,
)
from omni_parallel.llm_zero import LLMGradientSync, apply_llm_zero
from omni_parallel.long_short import LongShortPlan, Piece, plan_long_short
from omni_parallel.numerics import NonFiniteError, NumericsGuard, NumericsSpec, OnNonFinite, StepVerdict
from omni_parallel.parallelize import (
    TRAINING_DTYPES,
    EncoderGradientSync,
    apply_ac,
    apply_compile,
    apply_dp,
    apply_encoder_zero,
    apply_mixed_precision,
    apply_offload,
    apply_tp,
    training_dtypes,
)
from omni_parallel.reshard import ReshardMode, ReshardPlan, reshard_to_llm
from omni_parallel.ring_attention import ring_attention
from omni_parallel.state import (
    EncoderLayout,
    EncoderState,
    GroupSpec,
    ParallelState,
    default_reorder_group_size,
    mesh_device_type,
)
from omni_parallel.topology import GROUP_NAMES, ParallelConfig, mesh_axes, rank_groups
from omni_parallel.ulysses import padded_heads, ulysses_attention
from omni_parallel.varlen import (
    as_cu_seqlens,
    cu_seqlens_from_lengths,
    masked_attention,
    uses_device_kernel,
    varlen_attention,
)

__all__ = [
    "GROUP_NAMES",
    "TRAINING_DTYPES",
    "ActivationMemory",
    "CPAttention",
    "CPLayout",
    "CPSequence",
    "EncoderGradientSync",
    "EncoderLayout",
    "EncoderState",
    "GroupSpec",
    "HybridCPPlan",
    "HybridCPSlot",
    "LLMGradientSync",
    "LocalSegment",
    "LocalSequence",
    "LongShortPlan",
    "NonFiniteError",
    "NumericsGuard",
    "NumericsSpec",
    "OnNonFinite",
    "ParallelConfig",
    "ParallelState",
    "Piece",
    "ReshardMode",
    "ReshardPlan",
    "StepPeaks",
    "StepVerdict",
    "TransformerShape",
    "all_gather_dim0",
    "all_reduce_sum",
    "all_to_all_dim0",
    "apply_ac",
    "apply_compile",
    "apply_dp",
    "apply_encoder_zero",
    "apply_llm_zero",
    "apply_mixed_precision",
    "apply_offload",
    "apply_tp",
    "as_cu_seqlens",
    "attention_flops",
    "clip_grad_norm_",
    "context_parallel_attention",
    "cp_layout",
    "cp_sequence_attention",
    "cu_seqlens_from_lengths",
    "default_reorder_group_size",
    "forward_flops",
    "hybrid_cp_blocks",
    "hybrid_cp_load",
    "karmarkar_karp",
    "layer_flops_per_token",
    "local_sequence",
    "lpt",
    "masked_attention",
    "matmul_params",
    "measure_peak_flops",
    "mesh_axes",
    "mesh_device_type",
    "model_flops",
    "padded_heads",
    "partition_loads",
    "plan_hybrid_cp",
    "plan_long_short",
    "rank_groups",
    "reshard_to_llm",
    "ring_attention",
    "shard_for_cp",
    "training_dtypes",
    "ulysses_attention",
    "unshard_from_cp",
    "uses_device_kernel",
    "varlen_attention",
]
__version__ = "0.13.0"
