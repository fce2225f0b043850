"""The run config mapped to :class:`omni_pipeline.step_metrics.StepMetricsSpec`: the shapes the step's
metrics (one all-reduce per step, then rank 0's ``metrics.jsonl`` row; fields listed in the app README,
"Outputs") count FLOPs, packs and tokens with.
"""

from __future__ import annotations

from omni_pipeline.step_metrics import EncoderShape, StepMetricsSpec
from omni_train.config import RunConfig
from omni_train.models import LLMConfig

__all__ = ["step_metrics_spec"]


def step_metrics_spec(cfg: RunConfig, llm: LLMConfig) -> StepMetricsSpec:
    """``cfg`` (its ``data.microbatches`` per DP replica) and the LLM's config as the metrics' spec: each
    configured encoder tower's shape (an image's or video's sequence is ``merge**2`` patches per merged
    token; a video attends per ``temporal_patch`` frames)."""
    m = cfg.model
    encoders = {}
    if m.vit is not None:
        # videos run on the image tower, attention per temporal slice of temporal_patch frames
        encoders["image"] = EncoderShape(m.vit.dim, m.vit.n_layers, m.vit.merge**2, m.vit.temporal_patch)
    if m.audio is not None:
        encoders["audio"] = EncoderShape(m.audio.dim, m.audio.n_layers)
    return StepMetricsSpec(
        microbatches=cfg.data.microbatches,
        max_seq_len=cfg.data.max_seq_len,
        llm_dim=llm.dim,
        llm_layers=llm.n_layers,
        hybrid_cp=cfg.parallel.hybrid_cp,
        encoders=encoders,
    )
