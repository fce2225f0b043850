"""Cost model for the pipeline simulator: seconds per action, bytes per transfer and per stored activation.

Two layers: a :class:`CostModel` holds the seconds of one step's actions (per stage, per LLM action or
per encoder microbatch) and the P2P and memory sizes; optionally it also holds :class:`TokenCost`
coefficients (``coefficients``, e.g. fitted from a run's records by :func:`omni_pipeline.calibrate.
fit_cost_model`) from which :meth:`CostModel.for_step` predicts the seconds of a new step's actions from
their token counts (:class:`ActionTokens`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from omni_pipeline.actions import Action, ActionKind

__all__ = [
    "ActionTokens",
    "CostModel",
    "Network",
    "TokenCost",
    "all_gather_s",
    "all_reduce_s",
    "all_to_all_s",
    "cost_key",
    "reduce_scatter_s",
]


def cost_key(kind: ActionKind | str, stage: int | None, module: str) -> str:
    """Key of a :class:`TokenCost` in ``CostModel.coefficients``: ``"F0:llm"`` (stage 0 forward of the
    LLM), ``"B1:llm"``, ``"EF:image"`` (encoder forward of the image tower), ``"EB:audio"``."""
    return f"{ActionKind(kind)}{'' if stage is None else stage}:{module}"


@dataclass(frozen=True)
class TokenCost:
    """Seconds of one module's share of an action from its token counts:
    ``base_s + per_token_s * tokens + per_token_sq_s * tokens_sq`` when the module has tokens, else 0.

    ``tokens_sq`` is the quadratic (attention) term's token count, e.g. ``T**2`` for dense masked attention
    over a pack of ``T`` tokens, or the sum of squared document lengths for varlen attention; whoever
    records and whoever predicts must use the same definition (see :class:`ActionTokens`).

    Raises:
        ValueError: a negative or non-finite coefficient.
    """

    base_s: float = 0.0
    per_token_s: float = 0.0
    per_token_sq_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_s", "per_token_s", "per_token_sq_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"TokenCost.{name} must be finite and >= 0, got {v!r}")

    def seconds(self, tokens: float, tokens_sq: float) -> float:
        """Predicted seconds for ``tokens`` tokens and ``tokens_sq`` quadratic-term tokens (0 if no tokens)."""
        if tokens <= 0:
            return 0.0
        return self.base_s + self.per_token_s * tokens + self.per_token_sq_s * tokens_sq


@dataclass(frozen=True)
class ActionTokens:
    """Token counts of one action, per module: ``{module: (tokens, tokens_sq)}``.

    LLM actions have one module, ``"llm"`` (tokens of the microbatch's pack on that stage); encoder
    actions one per tower that ran (``"image"``: ViT patches before the merge, ``"audio"``: frames after
    subsampling, or whatever unit the recorder used). ``tokens_sq``: see :class:`TokenCost`.
    """

    modules: Mapping[str, tuple[float, float]]

    @classmethod
    def single(cls, module: str, tokens: float, tokens_sq: float | None = None) -> ActionTokens:
        """One module; ``tokens_sq`` defaults to ``tokens**2`` (dense attention over one sequence)."""
        return cls({module: (float(tokens), float(tokens**2 if tokens_sq is None else tokens_sq))})


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
        llm_action_s: ``{Action: seconds}`` of individual LLM actions (F/B of one stage and microbatch),
            overriding ``llm_forward_s`` / ``llm_backward_s`` for those actions (per-microbatch token
            counts differ; :meth:`for_step` fills it).
        dispatch_s: seconds a rank spends between two consecutive actions outside any compute or P2P
            wait (Python dispatch, posting receives); an action starts no earlier than the previous
            action's end plus this.
        step_overhead_s: seconds per step outside the pipeline's actions (data preparation not overlapped,
            gradient reduction, optimizer); added to the makespan in ``SimulationResult.step_time_s``.
        coefficients: ``{cost_key(kind, stage, module): TokenCost}`` for :meth:`predict` / :meth:`for_step`.

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
    llm_action_s: Mapping[Action, float] = field(default_factory=dict)
    dispatch_s: float = 0.0
    step_overhead_s: float = 0.0
    coefficients: Mapping[str, TokenCost] = field(default_factory=dict)

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
            "llm_action_s",
        ):
            bad = {e: v for e, v in (getattr(self, name) or {}).items() if not v >= 0}
            if bad:
                errors.append(f"{name} must be >= 0, got {bad}")
        bad_llm = [a for a in self.llm_action_s if a.kind not in (ActionKind.FORWARD, ActionKind.BACKWARD)]
        if bad_llm:
            errors.append(f"llm_action_s holds only LLM F/B actions, got {[str(a) for a in bad_llm]}")
        for name in (
            "p2p_latency_s",
            "llm_activation_bytes",
            "tokens_per_microbatch",
            "dispatch_s",
            "step_overhead_s",
        ):
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
        if a in self.llm_action_s:
            return float(self.llm_action_s[a])
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

    def predict(self, kind: ActionKind | str, stage: int | None, tokens: ActionTokens) -> float:
        """Seconds of an action of ``kind`` on ``stage`` (``None`` for encoder actions) from its token
        counts: the sum over its modules of ``coefficients[cost_key(kind, stage, module)].seconds(...)``.

        Raises:
            KeyError: a module with tokens has no coefficients for this kind and stage (names the key and
                the keys there are).
        """
        total = 0.0
        for module, (n, n_sq) in tokens.modules.items():
            if n <= 0:
                continue
            key = cost_key(kind, stage, module)
            if key not in self.coefficients:
                raise KeyError(
                    f"CostModel.predict: no coefficients for {key!r} (have {sorted(self.coefficients)})"
                )
            total += self.coefficients[key].seconds(n, n_sq)
        return total

    def for_step(
        self,
        num_stages: int,
        llm_tokens: Mapping[int, ActionTokens],
        encoder_tokens: Mapping[int, ActionTokens],
        **sizes,
    ) -> CostModel:
        """This model with every action of one step timed from its token counts.

        Args:
            num_stages: LLM stages.
            llm_tokens: ``{k: ActionTokens}`` per LLM microbatch ``k`` (from 1); every stage's F and B of
                ``k`` are predicted from it.
            encoder_tokens: ``{e: ActionTokens}`` per encoder microbatch.
            **sizes: other :class:`CostModel` fields to replace as well (byte sizes, ``tokens_per_microbatch``).

        Returns:
            a :class:`CostModel` with ``llm_action_s``, ``encoder_forward_s`` and ``encoder_backward_s``
            filled (the coefficients kept).

        Raises:
            KeyError: as :meth:`predict`.
        """
        F, B = ActionKind.FORWARD, ActionKind.BACKWARD
        llm = {
            Action(kind, k - 1, s): self.predict(kind, s, toks)
            for k, toks in llm_tokens.items()
            for s in range(num_stages)
            for kind in (F, B)
        }
        ef = {e: self.predict(ActionKind.ENCODER_FORWARD, None, t) for e, t in encoder_tokens.items()}
        eb = {e: self.predict(ActionKind.ENCODER_BACKWARD, None, t) for e, t in encoder_tokens.items()}
        return dataclasses.replace(
            self, llm_action_s=llm, encoder_forward_s=ef, encoder_backward_s=eb, **sizes
        )


@dataclass(frozen=True)
class Network:
    """A two-tier interconnect: ``gpus_per_node`` GPUs share a node whose links (NVLink) carry
    ``intra_bandwidth_Bps`` per GPU at ``intra_latency_s`` per message; between nodes each GPU has
    ``inter_bandwidth_Bps`` (its NIC) at ``inter_latency_s``.

    A group of ranks is *inside a node* when all its ranks share one node; a ring over a group that spans
    nodes runs at the slowest link it crosses (every GPU's NIC, ``inter_*``). Defaults: an H100 HGX node
    (8 GPUs, NVLink 4: 450 GB/s per direction per GPU, NVIDIA H100 datasheet) and the paper's Cluster-A NICs
    (§6: "8*400 Infiniband" per 8-GPU node, 50 GB/s per GPU); the latencies are assumptions (NCCL's
    small-message latencies are a few us inside a node, tens of us between nodes).

    Raises:
        ValueError: a bandwidth <= 0, a negative latency or ``gpus_per_node < 1`` (named).
    """

    gpus_per_node: int = 8
    intra_bandwidth_Bps: float = 450e9
    intra_latency_s: float = 5e-6
    inter_bandwidth_Bps: float = 50e9
    inter_latency_s: float = 20e-6

    def __post_init__(self) -> None:
        errors = [
            f"{k} must be > 0, got {getattr(self, k)!r}"
            for k in ("intra_bandwidth_Bps", "inter_bandwidth_Bps")
            if not getattr(self, k) > 0
        ]
        errors += [
            f"{k} must be >= 0, got {getattr(self, k)!r}"
            for k in ("intra_latency_s", "inter_latency_s")
            if not getattr(self, k) >= 0
        ]
        if not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1):
            errors.append(f"gpus_per_node must be an int >= 1, got {self.gpus_per_node!r}")
        if errors:
            raise ValueError("Network: " + "; ".join(errors))

    def within_node(self, size: int, stride: int) -> bool:
        """Whether a group of ``size`` ranks ``stride`` apart (global ranks ``base + i * stride``, ``base``
        a multiple of ``size * stride`` when that is below a node, as ``ParallelState``'s tp-cp-ep-dp-pp
        order gives) lies inside one node: ``size * stride <= gpus_per_node``."""
        return size * stride <= self.gpus_per_node

    def link(self, size: int, stride: int) -> tuple[float, float]:
        """``(bandwidth B/s, latency s)`` a ring over that group runs at (see :meth:`within_node`)."""
        if self.within_node(size, stride):
            return self.intra_bandwidth_Bps, self.intra_latency_s
        return self.inter_bandwidth_Bps, self.inter_latency_s


def _ring(nbytes: float, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    if n < 1 or nbytes < 0:
        raise ValueError(f"collective: need n >= 1 and bytes >= 0, got n={n}, bytes={nbytes}")
    if n == 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth_Bps + (n - 1) * latency_s


def all_gather_s(nbytes: float, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    """Seconds of a ring all-gather over ``n`` ranks whose gathered result is ``nbytes`` bytes (each rank
    contributes ``nbytes / n``): ``n - 1`` steps, each rank sending one ``nbytes / n`` chunk to its
    neighbour per step, ``(n - 1) / n * nbytes / bandwidth + (n - 1) * latency``; 0 for ``n = 1``.
    Source: Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
    MPICH" (IJHPCA 2005), §4 (ring allgather, ``(p-1) alpha + (p-1)/p n beta``); NCCL's
    ``nccl-tests`` PERFORMANCE.md (bus bandwidth of AllGather / ReduceScatter: ``(n-1)/n``).

    Raises:
        ValueError: ``n < 1`` or ``nbytes < 0``.
    """
    return _ring(nbytes, n, bandwidth_Bps, latency_s)


def reduce_scatter_s(nbytes: float, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    """Seconds of a ring reduce-scatter of an ``nbytes`` input per rank (each rank keeps ``nbytes / n``
    reduced): the same step count and volume as :func:`all_gather_s` (Thakur et al. 2005, §4; the
    reduction's arithmetic is not timed).

    Raises:
        ValueError: ``n < 1`` or ``nbytes < 0``.
    """
    return _ring(nbytes, n, bandwidth_Bps, latency_s)


def all_reduce_s(nbytes: float, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes``: a reduce-scatter then an all-gather,
    ``2 (n - 1) / n * nbytes / bandwidth + 2 (n - 1) * latency`` (Patarasuk and Yuan, "Bandwidth optimal
    all-reduce algorithms for clusters of workstations", JPDC 2009; Thakur et al. 2005 §4.4, Rabenseifner's
    algorithm; NCCL's bus bandwidth ``2 (n-1)/n``).

    Raises:
        ValueError: ``n < 1`` or ``nbytes < 0``.
    """
    return 2.0 * _ring(nbytes, n, bandwidth_Bps, latency_s)


def all_to_all_s(nbytes: float, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    """Seconds of an all-to-all where each rank holds ``nbytes`` split into ``n`` equal parts, one per
    rank (its own part stays): pairwise exchange in ``n - 1`` steps of ``nbytes / n`` each,
    ``(n - 1) / n * nbytes / bandwidth + (n - 1) * latency`` (Thakur et al. 2005, §5, pairwise exchange;
    NCCL's AlltoAll bus bandwidth ``(n-1)/n``).

    Raises:
        ValueError: ``n < 1`` or ``nbytes < 0``.
    """
    return _ring(nbytes, n, bandwidth_Bps, latency_s)
