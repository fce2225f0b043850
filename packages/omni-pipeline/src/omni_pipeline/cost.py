"""Cost model for the pipeline simulator: seconds per action, bytes per transfer and per stored activation."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from omni_pipeline.actions import Action, ActionKind

__all__ = ["CostModel"]


def _per_stage(value: float | Sequence[float], stage: int, name: str) -> float:
    if isinstance(value, int | float):
        return float(value)
    if stage >= len(value):
        raise ValueError(f"CostModel.{name} has {len(value)} per-stage values but stage {stage} needs one")
    return float(value[stage])


@dataclass
class CostModel:
    """Durations and sizes of one training step's actions.

    Attributes:
        llm_forward_s: seconds of one LLM microbatch forward, one number or one per stage.
        llm_backward_s: seconds of one LLM microbatch backward, one number or one per stage.
        encoder_forward_s: ``{e: seconds}`` per encoder microbatch (missing e: 0).
        encoder_backward_s: ``{e: seconds}``; ``None`` means twice the forward (the usual 2x rule).
        p2p_latency_s: seconds of latency per point-to-point message.
        p2p_bandwidth_Bps: point-to-point bandwidth in bytes/s (``inf``: size does not matter).
        llm_activation_bytes: bytes of one LLM microbatch's stage-boundary activation (sent F, grad sent B).
        llm_stored_bytes: bytes one stage holds for one microbatch from its forward to its backward
            (one number or one per stage).
        encoder_output_bytes: ``{e: bytes}`` of encoder output sent to stage 0 (and its gradient back);
            stage 0 holds it from arrival until its backward of the consuming microbatch.
        encoder_stored_bytes: ``{e: bytes}`` the encoder holds from its forward to its backward.
        tokens_per_microbatch: LLM tokens in one microbatch (for throughput in tokens/s).
        data_parallel: DP replicas running the same pipeline; throughput is scaled by it.

    Raises:
        ValueError: a negative duration, size or latency, a bandwidth <= 0, or ``data_parallel < 1``
            (named); a per-stage sequence too short for a stage (when that stage is costed).
    """

    llm_forward_s: float | Sequence[float] = 1.0
    llm_backward_s: float | Sequence[float] = 2.0
    encoder_forward_s: Mapping[int, float] = field(default_factory=dict)
    encoder_backward_s: Mapping[int, float] | None = None
    p2p_latency_s: float = 0.0
    p2p_bandwidth_Bps: float = math.inf
    llm_activation_bytes: float = 0.0
    llm_stored_bytes: float | Sequence[float] = 0.0
    encoder_output_bytes: Mapping[int, float] = field(default_factory=dict)
    encoder_stored_bytes: Mapping[int, float] = field(default_factory=dict)
    tokens_per_microbatch: float = 0.0
    data_parallel: int = 1

    def __post_init__(self) -> None:
        errors: list[str] = []
        for name in ("llm_forward_s", "llm_backward_s", "llm_stored_bytes"):
            value = getattr(self, name)
            values = [value] if isinstance(value, int | float) else list(value)
            if not values or any(not v >= 0 for v in values):
                errors.append(f"{name} must be >= 0 (one number or one per stage), got {value!r}")
        for name in (
            "encoder_forward_s",
            "encoder_backward_s",
            "encoder_output_bytes",
            "encoder_stored_bytes",
        ):
            bad = {e: v for e, v in (getattr(self, name) or {}).items() if not v >= 0}
            if bad:
                errors.append(f"{name} must be >= 0, got {bad}")
        for name in ("p2p_latency_s", "llm_activation_bytes", "tokens_per_microbatch"):
            if not getattr(self, name) >= 0:
                errors.append(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.p2p_bandwidth_Bps > 0:
            errors.append(f"p2p_bandwidth_Bps must be > 0 (inf: free), got {self.p2p_bandwidth_Bps!r}")
        if not (isinstance(self.data_parallel, int) and self.data_parallel >= 1):
            errors.append(f"data_parallel must be an int >= 1, got {self.data_parallel!r}")
        if errors:
            raise ValueError("CostModel: " + "; ".join(errors))

    def duration(self, a: Action) -> float:
        """Seconds ``a`` computes."""
        if a.kind == ActionKind.FORWARD:
            return _per_stage(self.llm_forward_s, a.stage, "llm_forward_s")
        if a.kind == ActionKind.BACKWARD:
            return _per_stage(self.llm_backward_s, a.stage, "llm_backward_s")
        if a.kind == ActionKind.ENCODER_FORWARD:
            return float(self.encoder_forward_s.get(a.microbatch, 0.0))
        if a.kind == ActionKind.ENCODER_BACKWARD:
            if self.encoder_backward_s is None:
                return 2.0 * float(self.encoder_forward_s.get(a.microbatch, 0.0))
            return float(self.encoder_backward_s.get(a.microbatch, 0.0))
        raise ValueError(f"{a} is not a compute action")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` point-to-point: latency + bytes / bandwidth."""
        return self.p2p_latency_s + (
            0.0 if math.isinf(self.p2p_bandwidth_Bps) else nbytes / self.p2p_bandwidth_Bps
        )

    def message_bytes(self, src: Action, dst: Action) -> float:
        """Bytes sent from ``src`` (a dependency) to ``dst`` when they run on different ranks."""
        if src.kind.is_encoder or dst.kind.is_encoder:
            e = src.microbatch if src.kind.is_encoder else dst.microbatch
            return float(self.encoder_output_bytes.get(e, 0.0))
        return float(self.llm_activation_bytes)

    def stored_bytes(self, a: Action) -> float:
        """Bytes of activations a forward action leaves stored until its backward."""
        if a.kind == ActionKind.FORWARD:
            return _per_stage(self.llm_stored_bytes, a.stage, "llm_stored_bytes")
        if a.kind == ActionKind.ENCODER_FORWARD:
            return float(self.encoder_stored_bytes.get(a.microbatch, 0.0))
        return 0.0
