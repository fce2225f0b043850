"""omni_parallel: topology, process groups, sequence parallelism (Ulysses, CP), resharding, load balancing.

Imports only torch. See the package README for the API table.
"""

from omni_parallel.balance import karmarkar_karp, lpt, partition_loads
from omni_parallel.comm import all_gather_dim0, all_reduce_sum, all_to_all_dim0
from omni_parallel.context_parallel import (
    CPLayout,
    context_parallel_attention,
    cp_layout,
    shard_for_cp,
    unshard_from_cp,
)
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
from omni_parallel.long_short import LongShortPlan, Piece, plan_long_short
from omni_parallel.reshard import ReshardMode, ReshardPlan, reshard_to_llm
from omni_parallel.ring_attention import ring_attention
from omni_parallel.state import EncoderLayout, EncoderState, ParallelState, mesh_device_type
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
    "CPAttention",
    "CPLayout",
    "CPSequence",
    "EncoderLayout",
    "EncoderState",
    "HybridCPPlan",
    "HybridCPSlot",
    "LocalSegment",
    "LocalSequence",
    "LongShortPlan",
    "ParallelConfig",
    "ParallelState",
    "Piece",
    "ReshardMode",
    "ReshardPlan",
    "all_gather_dim0",
    "all_reduce_sum",
    "all_to_all_dim0",
    "as_cu_seqlens",
    "context_parallel_attention",
    "cp_layout",
    "cp_sequence_attention",
    "cu_seqlens_from_lengths",
    "hybrid_cp_blocks",
    "hybrid_cp_load",
    "karmarkar_karp",
    "local_sequence",
    "lpt",
    "masked_attention",
    "mesh_axes",
    "mesh_device_type",
    "padded_heads",
    "partition_loads",
    "plan_hybrid_cp",
    "plan_long_short",
    "rank_groups",
    "reshard_to_llm",
    "ring_attention",
    "shard_for_cp",
    "ulysses_attention",
    "unshard_from_cp",
    "uses_device_kernel",
    "varlen_attention",
]
__version__ = "0.3.0"
