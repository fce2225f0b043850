"""omni_data: WebDataset sources, mixture schedules, hybrid packing, grouped reordering, zero-redundancy loaders.

Pipeline (two phases): sources -> :class:`MixtureStream` -> :class:`HybridPacker` -> :class:`PackedLoader`
give every rank of a DP rank the same step *metadata*; :class:`ZeroRedundancyFilter` then reads and decodes
only the payloads this pipeline rank encodes, and :class:`GroupedReorderer` balances them across a group.
"""

from omni_data.image_generation import GenerationVocab, ImageCodeEncoder, ImageCodes, generation_targets
from omni_data.join import JoinDocuments, document_part, text_members
from omni_data.loader import LoaderSnapshot, PackedLoader, StepBatch, snapshot_async
from omni_data.media_checks import DEFAULT_MAX_IMAGE_PIXELS, MediaRefusedError
from omni_data.mixture import MixtureSchedule, MixtureStream, ScheduleUnit
from omni_data.node import StatefulNode
from omni_data.packing import HybridPacker, ModalitySpan, Overlong, OverlongSampleError, Pack, collate_packs
from omni_data.payload import (
    Payload,
    PayloadError,
    PayloadReader,
    RefusedPayloadError,
    SkippedPayloadError,
    UndecodablePayloadError,
    UnreadablePayloadError,
    to_rgb,
)
from omni_data.reorder import (
    GroupedReorderer,
    PlanMismatchError,
    ReorderPlan,
    encoder_flops,
    reorder_destinations,
)
from omni_data.replicas import ReplicaMerge, hand_over_replicas, replica_ids
from omni_data.sample import MemberRef, Modality, SampleMeta
from omni_data.skip_metrics import SkipMetrics, merge_skip_reports
from omni_data.skips import SkipLedger, skip_report
from omni_data.source import (
    EmptySourceError,
    LayoutMismatchError,
    UnsupportedCompressionError,
    WebDatasetSource,
)
from omni_data.tokens import (
    AudioTokens,
    EncoderCost,
    ImageTokens,
    VideoTokens,
    count_text_tokens,
    resampled_length,
    sampled_frame_indices,
)
from omni_data.video import VIDEO_EXTS, VideoInfo
from omni_data.workers import RoundRobinWorkers
from omni_data.zero_redundancy import (
    ConsumesFn,
    FilteredStep,
    SampleIndex,
    ZeroRedundancyFilter,
    encoder_microbatch_id,
    encoder_microbatch_ids,
    split_encoder_microbatches,
)

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "VIDEO_EXTS",
    "AudioTokens",
    "ConsumesFn",
    "EmptySourceError",
    "EncoderCost",
    "FilteredStep",
    "GenerationVocab",
    "GroupedReorderer",
    "HybridPacker",
    "ImageCodeEncoder",
    "ImageCodes",
    "ImageTokens",
    "JoinDocuments",
    "LayoutMismatchError",
    "LoaderSnapshot",
    "MediaRefusedError",
    "MemberRef",
    "MixtureSchedule",
    "MixtureStream",
    "Modality",
    "ModalitySpan",
    "Overlong",
    "OverlongSampleError",
    "Pack",
    "PackedLoader",
    "Payload",
    "PayloadError",
    "PayloadReader",
    "PlanMismatchError",
    "RefusedPayloadError",
    "ReorderPlan",
    "ReplicaMerge",
    "RoundRobinWorkers",
    "SampleIndex",
    "SampleMeta",
    "ScheduleUnit",
    "SkipLedger",
    "SkipMetrics",
    "SkippedPayloadError",
    "StatefulNode",
    "StepBatch",
    "UndecodablePayloadError",
    "UnreadablePayloadError",
    "UnsupportedCompressionError",
    "VideoInfo",
    "VideoTokens",
    "WebDatasetSource",
    "ZeroRedundancyFilter",
    "collate_packs",
    "count_text_tokens",
    "document_part",
    "encoder_flops",
    "encoder_microbatch_id",
    "encoder_microbatch_ids",
    "generation_targets",
    "hand_over_replicas",
    "merge_skip_reports",
    "reorder_destinations",
    "replica_ids",
    "resampled_length",
    "sampled_frame_indices",
    "skip_report",
    "snapshot_async",
    "split_encoder_microbatches",
    "text_members",
    "to_rgb",
]
__version__ = "0.8.0"
