"""omni_ckpt: offset-indexed sharded checkpoints with resharding load, plan cache, async save, atomic commit.

See the package README for the format and an example; MegaScale-Omni §7 for why each rank writes only
its own boxes and why the save plan is cached.
"""

from omni_ckpt.box import Box, flat_range_to_boxes
from omni_ckpt.interop import ExportFormat, ExportResult, export, import_dcp, read_full
from omni_ckpt.load import LoadResult, load, read_manifest
from omni_ckpt.manager import CheckpointManager
from omni_ckpt.optim import init_optimizer_state, load_optimizer_state_dict, optimizer_state_dict
from omni_ckpt.plan import PlanCache
from omni_ckpt.portable import (
    byte_rows,
    decode_row,
    load_object_rows,
    load_portable_optimizer_state_dict,
    object_rows,
    portable_optimizer_state_dict,
)
from omni_ckpt.save import AsyncSaveHandle, async_save, save, save_ranks
from omni_ckpt.sharding import BoxShard, FlatShard, describe, dtensor_box
from omni_ckpt.state import Placeholder
from omni_ckpt.storage import CheckpointError

__all__ = [
    "AsyncSaveHandle",
    "Box",
    "BoxShard",
    "CheckpointError",
    "CheckpointManager",
    "ExportFormat",
    "ExportResult",
    "FlatShard",
    "LoadResult",
    "Placeholder",
    "PlanCache",
    "async_save",
    "byte_rows",
    "decode_row",
    "describe",
    "dtensor_box",
    "export",
    "flat_range_to_boxes",
    "import_dcp",
    "init_optimizer_state",
    "load",
    "load_object_rows",
    "load_optimizer_state_dict",
    "load_portable_optimizer_state_dict",
    "object_rows",
    "optimizer_state_dict",
    "portable_optimizer_state_dict",
    "read_full",
    "read_manifest",
    "save",
    "save_ranks",
]
__version__ = "0.6.0"
