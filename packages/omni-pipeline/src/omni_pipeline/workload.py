"""Workloads as data: per-source sample-length distributions, mixture phases, pack length, batch and model
sizes, read from a TOML file, and the packs of any step drawn from them deterministically.

A workload stands in for a dataset at a scale the bundled data cannot reach (16K packs of OpenImages-sized
images, paper §2.2 and §6): it draws :class:`~omni_data.SampleMeta` metadata, never payloads, and packs
whole samples with omni-data's own :class:`~omni_data.HybridPacker`, so a simulated step holds the same
kind of packs a loader would give (no fractional encoder work: a sample's encoder cost goes to exactly one
encoder microbatch). Step ``s``'s samples come from a private RNG seeded by ``(seed, s)``, so any step is
reproducible alone, whatever steps were drawn before.

File format (every key checked; unknown keys refused)::

    name = "paper-vlm"
    seed = 0                      # RNG seed of the draws
    max_seq_len = 16384           # pack length, tokens (16 .. 2**21)
    microbatches = 32             # packs (LLM microbatches) per pipeline replica per step (1 .. 4096)
    packer_buffer = 256           # optional: HybridPacker look-ahead, samples (1 .. 65536)
    loader_workers = 1            # optional: loader workers per rank decoding payloads (0 .. 256; 0: inline)

    [model]                       # names of MODEL_SHAPES presets or {dim, n_layers, n_heads, ...} tables
    llm = "llama-12b"
    image = "vit-1b"              # a tower per media modality the sources use (video: the image tower)
    image_merge = 2               # optional: ViT patches per LLM token = image_merge ** 2
    temporal_patch = 2            # optional: frames per ViT patch of a video (Qwen2-VL: 2)
    moe = { experts = 64, top_k = 8, expert_ffn_dim = 1408 }   # optional: MoE LLM (MoEShape's keys)

    [[sources]]
    name = "openimages"
    modality = "image"            # "image", "audio", "video" or "text"
    text_tokens = 16              # optional (media): caption tokens inside each sample's length
    frames = 16                   # optional (video only, default 16): sampled frames per clip (1 .. 4096)
    decode_ms = 2.4               # optional (media only): ms to read and decode one sample's payload
    length = { lognormal = { median = 3340, sigma = 0.5 }, min = 64, max = 16384 }
    # or: length = { histogram = { edges = [64, 1024, 4096], weights = [3, 1] } }   (bins [lo, hi))
    # or: length = { fixed = 340 }

    [[phases]]                    # mixture phases in order: sample-count weights per source
    weights = { openimages = 1, bytedlong = 1 }
    until_step = 100              # this phase covers steps < 100; the last phase has none (open-ended)

``length`` is a sample's whole LLM length in tokens (media embeddings plus its text); ``min`` (default 1)
and ``max`` clip it (default ``max_seq_len``; a media sample cannot be longer than a pack, so ``max`` of a
media source may not exceed it; a longer text sample is split by the packer, as a loader's would be).
A lognormal's mean is ``median * exp(sigma**2 / 2)`` before clipping.

Data loading: ``decode_ms`` (0 .. 600000) is one loader worker's time to read and decode a sample of the
source (a media source only: a text sample's tokens come with the step's metadata). Defaults
(:data:`DEFAULT_DECODE_MS`): image 2.4 ms and audio 1.5 ms per sample, this repo's decode rate on one core
(``benchmarks/results/loader.json``: 421 images/s and 663 audio clips/s through the whole loader, the
bundled data's small images and short clips; larger payloads decode slower, give their own), a video
clip ``frames`` times the image's (each sampled frame decoded like an image: an assumption).
``loader_workers`` (0 .. 256, default 1: the trainer's ``data.decode_workers`` default) are each rank's
decode workers, which run ahead of the step; 0: decoded inline on the training thread
(:func:`omni_pipeline.step_model.predict_step`).

A video sample (Qwen2-VL's ViT, the image tower's weights) of ``frames`` sampled frames is
``t = ceil(frames / temporal_patch)`` temporal slices of equal grids: its drawn media tokens are rounded
down to a multiple of ``t`` (at least ``t``), and its metadata shape is ``(frames, 3, 14 m, 14 m k)`` for
``k`` merged tokens per slice (``m = image_merge``; 14-pixel patches): only ``frames`` and the media tokens
enter the cost model (:func:`omni_pipeline.step_costs.encoder_documents`: attention per slice).

Untrusted input: the file is at most 1 MiB, every count and size bounded; a bad value raises
:class:`WorkloadError` whose one-line message names the file and the key.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import tomllib
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omni_data import HybridPacker, Modality, Pack, SampleMeta
from omni_data.node import StatefulNode
from omni_parallel.flops import TransformerShape
from omni_pipeline.step_costs import MODEL_SHAPES, ModelScale, encoder_forward_flops, model_scale

__all__ = [
    "DEFAULT_DECODE_MS",
    "LengthDistribution",
    "MixturePhase",
    "MoEShape",
    "Workload",
    "WorkloadError",
    "WorkloadSource",
    "load_workload",
    "parse_workload",
]

MAX_FILE_BYTES = 1 << 20
MAX_SOURCES = 64
MAX_PHASES = 1024
MAX_BINS = 4096
MAX_SEQ_LEN = 1 << 21
MAX_SAMPLE_TOKENS = 1 << 24
MAX_MICROBATCHES = 4096
MAX_BUFFER = 1 << 16
MAX_SIGMA = 4.0
MAX_DECODE_MS = 600_000.0  # ten minutes per sample
MAX_LOADER_WORKERS = 256  # the trainer's data.decode_workers bound
# one loader worker's ms to read and decode a sample's payload, per modality (module docstring); read-only
DEFAULT_DECODE_MS = types.MappingProxyType({"image": 2.4, "audio": 1.5, "video": 2.4, "text": 0.0})
_SHAPE_KEYS = {"dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "mlp_ratio", "gated_mlp"}
_MOE_KEYS = {
    "experts",
    "top_k",
    "expert_ffn_dim",
    "shared_experts",
    "shared_expert_ffn_dim",
    "every_n_layers",
}


class WorkloadError(ValueError):
    """A workload file or value is malformed; the message is one line naming the file and the key."""


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """A sample-length distribution in LLM tokens, clipped to ``[low, high]``.

    ``kind``: ``"lognormal"`` (``median``, ``sigma``: ``median * exp(sigma * N(0, 1))``, rounded),
    ``"histogram"`` (a bin ``[edges[i], edges[i+1])`` drawn with probability ``weights[i] / sum``, then a
    whole number uniform inside it) or ``"fixed"`` (``median`` every time).

    Raises:
        ValueError: a parameter out of range (named).
    """

    kind: str
    median: float = 0.0
    sigma: float = 0.0
    edges: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    low: int = 1
    high: int = MAX_SEQ_LEN

    def __post_init__(self) -> None:
        if self.kind not in ("lognormal", "histogram", "fixed"):
            raise ValueError(f"kind must be lognormal, histogram or fixed, got {self.kind!r}")
        if not 1 <= self.low <= self.high <= MAX_SAMPLE_TOKENS:
            raise ValueError(
                f"min/max must satisfy 1 <= min <= max <= {MAX_SAMPLE_TOKENS}, got {self.low}, {self.high}"
            )
        if self.kind in ("lognormal", "fixed") and not 1 <= self.median <= MAX_SAMPLE_TOKENS:
            raise ValueError(f"median must be in [1, {MAX_SAMPLE_TOKENS}] tokens, got {self.median!r}")
        if self.kind == "lognormal" and not 0 < self.sigma <= MAX_SIGMA:
            raise ValueError(f"sigma must be in (0, {MAX_SIGMA}], got {self.sigma!r}")
        if self.kind == "histogram":
            e, w = self.edges, self.weights
            if not 2 <= len(e) <= MAX_BINS + 1 or len(w) != len(e) - 1:
                raise ValueError(
                    f"edges needs 2..{MAX_BINS + 1} values and weights one fewer, got {len(e)} and {len(w)}"
                )
            if any(not 1 <= a < b <= MAX_SAMPLE_TOKENS for a, b in itertools.pairwise(e)):
                raise ValueError(f"edges must rise strictly within [1, {MAX_SAMPLE_TOKENS}], got {list(e)}")
            if any(not (x >= 0 and math.isfinite(x)) for x in w) or not sum(w) > 0:
                raise ValueError(f"weights must be finite, >= 0 and not all 0, got {list(w)}")

    def sample(self, rng: random.Random) -> int:
        """One length, tokens, from ``rng``."""
        if self.kind == "fixed":
            n = round(self.median)
        elif self.kind == "lognormal":
            n = round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
        else:
            i = rng.choices(range(len(self.weights)), self.weights)[0]
            n = rng.randrange(self.edges[i], self.edges[i + 1])
        return min(self.high, max(self.low, n))


@dataclasses.dataclass(frozen=True)
class WorkloadSource:
    """One data source: its modality, its samples' lengths (LLM tokens, media and text together) and, for
    media, the text tokens (caption, transcript) inside each sample's length (at least one media token
    is kept); for video, the sampled ``frames`` per clip; ``decode_s``, seconds one loader worker spends
    reading and decoding a sample's payload (0 for text; the module docstring's defaults)."""

    name: str
    modality: Modality
    length: LengthDistribution
    text_tokens: int = 0
    frames: int = 16
    decode_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class MixturePhase:
    """Sample-count weights per source, for the steps before ``until_step`` (``None``: every later step)."""

    weights: Mapping[str, float]
    until_step: int | None = None


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The LLM's mixture-of-experts layers (``[model] moe`` of a workload; the trainer's
    ``[model.llm] moe``, ``omni_train.models.llm.MoESpec``): layer ``i`` (0-based) is an MoE layer when
    ``(i + 1) % every_n_layers == 0``; there the dense SwiGLU of ``ffn_dim`` gives way to a router
    (``experts x dim`` weights), ``experts`` routed SwiGLU experts of ``expert_ffn_dim`` features (each
    token computes ``top_k`` of them) and an always-on shared SwiGLU of ``shared_expert_ffn_dim`` features
    (default ``shared_experts * expert_ffn_dim``; 0: none). Qwen2-MoE / DeepSeek-MoE layout.

    Raises:
        ValueError: a size < 1 (``shared_*`` < 0), or ``top_k > experts`` (named).
    """

    experts: int
    top_k: int
    expert_ffn_dim: int
    shared_experts: int = 0
    shared_expert_ffn_dim: int | None = None
    every_n_layers: int = 1

    def __post_init__(self) -> None:
        for k in ("experts", "top_k", "expert_ffn_dim", "every_n_layers"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEShape.{k} must be an int >= 1, got {v!r}")
        if self.top_k > self.experts:
            raise ValueError(f"MoEShape.top_k {self.top_k} exceeds MoEShape.experts {self.experts}")
        if self.shared_experts < 0 or (
            self.shared_expert_ffn_dim is not None and self.shared_expert_ffn_dim < 0
        ):
            raise ValueError(f"MoEShape.shared_experts / shared_expert_ffn_dim must be >= 0: {self!r}")

    @property
    def shared_width(self) -> int:
        """Features of the fused shared SwiGLU (0: none)."""
        if self.shared_expert_ffn_dim is not None:
            return self.shared_expert_ffn_dim
        return self.shared_experts * self.expert_ffn_dim

    def is_moe_layer(self, i: int) -> bool:
        """Whether LLM layer ``i`` (0-based) is an MoE layer."""
        return (i + 1) % self.every_n_layers == 0

    def moe_layers(self, first: int, count: int) -> int:
        """MoE layers among LLM layers ``first .. first + count - 1``."""
        return sum(1 for i in range(first, first + count) if self.is_moe_layer(i))

    def expert_params(self, dim: int) -> float:
        """Routed-expert weights of one MoE layer: ``experts * 3 * dim * expert_ffn_dim`` (what EP shards)."""
        return float(self.experts * 3 * dim * self.expert_ffn_dim)

    def layer_params_delta(self, dim: int, ffn_dim: float) -> float:
        """Non-expert weights of one MoE layer minus the dense SwiGLU they replace: the router and the
        shared SwiGLU, less ``3 * dim * ffn_dim``."""
        return float(self.experts * dim + 3 * dim * self.shared_width - 3 * dim * ffn_dim)

    def active_params_delta(self, dim: int, ffn_dim: float) -> float:
        """Matmul weights one token computes through in an MoE layer minus the dense SwiGLU's: router,
        ``top_k`` experts and the shared SwiGLU, less ``3 * dim * ffn_dim`` (dropless, no capacity)."""
        return float(
            self.experts * dim
            + 3 * dim * (self.top_k * self.expert_ffn_dim + self.shared_width)
            - 3 * dim * ffn_dim
        )


@dataclasses.dataclass(frozen=True)
class Workload:
    """A workload (see the module docstring): sources, phases, pack length, batch, model sizes, seed.

    Attributes:
        microbatches: packs per pipeline replica per step, each one LLM microbatch.
        model: the sizes the cost model times (:class:`~omni_pipeline.step_costs.ModelScale`); also what a
            sample's ``encoder_flops`` (the encoder split's balance) is computed from.
        shapes: the block shapes ``model`` was made from, ``{"llm" | "image" | "audio": TransformerShape}``
            (what per-rank memory and collective sizes are computed from: widths, KV heads, MLP width).
        moe: the LLM's MoE layers (:class:`MoEShape`), ``None``: dense. With MoE, ``model.llm_params``
            counts the weights a token computes through (router, ``top_k`` experts, shared SwiGLU in the
            MoE layers), so the modelled LLM FLOPs are the active ones.
        loader_workers: decode workers per rank, running ahead of the step; 0: decoded inline.
    """

    name: str
    sources: tuple[WorkloadSource, ...]
    phases: tuple[MixturePhase, ...]
    max_seq_len: int
    microbatches: int
    model: ModelScale
    seed: int = 0
    packer_buffer: int = 256
    shapes: Mapping[str, TransformerShape] = dataclasses.field(default_factory=dict)
    moe: MoEShape | None = None
    loader_workers: int = 1

    def phase(self, step: int) -> MixturePhase:
        """The mixture phase of ``step`` (the first whose ``until_step`` is above it; else the last)."""
        for p in self.phases:
            if p.until_step is None or step < p.until_step:
                return p
        return self.phases[-1]

    def with_weights(self, weights: Mapping[str, float]) -> Workload:
        """This workload with one phase of ``weights`` (e.g. an image:text sweep).

        Raises:
            WorkloadError: an unknown source, a negative weight, or none above 0.
        """
        names = {s.name for s in self.sources}
        _check_weights(dict(weights), names, f"{self.name}: weights")
        return dataclasses.replace(self, phases=(MixturePhase(dict(weights)),))

    def samples(self, step: int) -> _Draws:
        """The endless stream of step ``step``'s sample metadata (a fresh RNG seeded by ``(seed, step)``)."""
        return _Draws(self, step)

    def step_packs(self, step: int, microbatches: int | None = None) -> list[Pack]:
        """Step ``step``'s packs: its samples packed whole by :class:`~omni_data.HybridPacker` (best-fit
        decreasing over ``packer_buffer`` samples, never over ``max_seq_len``), the first
        ``microbatches`` (default :attr:`microbatches`) packs it emits.

        Raises:
            ValueError: ``microbatches < 1``.
        """
        m = self.microbatches if microbatches is None else microbatches
        if m < 1:
            raise ValueError(f"Workload.step_packs: microbatches must be >= 1, got {m}")
        packer = HybridPacker(self.samples(step), self.max_seq_len, self.packer_buffer)
        packer.reset()
        return [next(packer) for _ in range(m)]


class _Draws(StatefulNode[SampleMeta]):
    """Endless sample metadata of one step of a workload, in draw order (a HybridPacker source)."""

    def __init__(self, workload: Workload, step: int) -> None:
        super().__init__()
        self.workload, self.step, self.i = workload, step, 0
        phase = workload.phase(step)
        by_name = {s.name: s for s in workload.sources}
        chosen = [(by_name[n], w) for n, w in phase.weights.items() if w > 0]
        self._sources = [s for s, _ in chosen]
        self._weights = [w for _, w in chosen]
        self._rng = random.Random(f"{workload.seed}/{step}")

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._rng = random.Random(f"{self.workload.seed}/{self.step}")
        self.i = 0
        for _ in range(0 if initial_state is None else int(initial_state["i"])):
            self._draw()

    def get_state(self) -> dict[str, Any]:
        return {"i": self.i}

    def _draw(self) -> SampleMeta:
        src = self._rng.choices(self._sources, self._weights)[0]
        n = src.length.sample(self._rng)
        self.i += 1
        key = f"{self.step}-{self.i}"
        if src.modality is Modality.TEXT:
            return SampleMeta(key, src.name, src.modality, 0, n, 0.0, (n,))
        text = min(src.text_tokens, n - 1)
        media = n - text
        shape: tuple[int, ...] = (media,)
        frames = None
        if src.modality is Modality.VIDEO:  # whole temporal slices of equal grids (module docstring)
            ms, frames = self.workload.model, src.frames
            t = -(-frames // ms.temporal_patch)
            media = max(t, media // t * t)
            side = 14 * ms.image_merge
            shape = (frames, 3, side, side * (media // t))
        flops = encoder_forward_flops(self.workload.model, src.modality, media, frames=frames)
        return SampleMeta(key, src.name, src.modality, media, text, flops, shape)

    def next(self) -> SampleMeta:
        return self._draw()


# -- parsing ------------------------------------------------------------------------------------------


def load_workload(path: str | Path) -> Workload:
    """Read a workload TOML file (see the module docstring).

    Raises:
        WorkloadError: the file is missing, larger than 1 MiB, not TOML, or a key is missing or bad
            (one line naming the file and the key).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise WorkloadError(f"{path}: {size} bytes, more than a workload may hold ({MAX_FILE_BYTES})")
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path}: cannot read the workload: {exc}") from None
    return parse_workload(text, str(path))


def parse_workload(text: str, where: str = "<workload>") -> Workload:
    """Parse a workload from TOML text; ``where`` names it in errors.

    Raises:
        WorkloadError: as :func:`load_workload`.
    """
    if len(text) > MAX_FILE_BYTES:
        raise WorkloadError(f"{where}: more than {MAX_FILE_BYTES} characters")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"{where}: not valid TOML: {exc}") from None
    p = _Reader(where)
    p.keys(
        doc,
        "",
        {"name", "seed", "max_seq_len", "microbatches", "packer_buffer", "loader_workers", "model", "sources",
         "phases"},
    )  # fmt: skip
    name = p.string(doc, "name", default=Path(where).stem)
    seed = p.integer(doc, "seed", 0, 2**63 - 1, default=0)
    max_seq_len = p.integer(doc, "max_seq_len", 16, MAX_SEQ_LEN)
    microbatches = p.integer(doc, "microbatches", 1, MAX_MICROBATCHES)
    buffer = p.integer(doc, "packer_buffer", 1, MAX_BUFFER, default=256)
    workers = p.integer(doc, "loader_workers", 0, MAX_LOADER_WORKERS, default=1)
    raw_sources = p.array(doc, "sources", MAX_SOURCES)
    sources: list[WorkloadSource] = []
    for i, raw in enumerate(raw_sources):
        sources.append(p.source(raw, f"sources[{i}]", max_seq_len))
    names = [s.name for s in sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        p.fail("sources", f"source names must be unique, {dup} repeated")
    media = {str(s.modality) for s in sources if s.modality is not Modality.TEXT}
    model, shapes, moe = p.model(p.table(doc, "model"), media)
    for i, s in enumerate(sources):
        slices = -(-s.frames // model.temporal_patch)  # a clip holds at least one token per slice
        if s.modality is Modality.VIDEO and slices + s.text_tokens > max_seq_len:
            p.fail(
                f"sources[{i}].frames",
                f"{s.frames} frames are {slices} temporal slices of at least one token each: with "
                f"{s.text_tokens} text tokens more than max_seq_len {max_seq_len}",
            )
    raw_phases = p.array(doc, "phases", MAX_PHASES)
    phases: list[MixturePhase] = []
    last = -1
    for i, raw in enumerate(raw_phases):
        key = f"phases[{i}]"
        if not isinstance(raw, dict):
            p.fail(key, "must be a table")
        p.keys(raw, key, {"weights", "until_step"})
        weights = p.table(raw, "weights", prefix=key)
        try:
            _check_weights(weights, set(names), f"{where}: {key}.weights")
        except WorkloadError:
            raise
        until = p.integer(raw, "until_step", 1, 2**62, default=None, prefix=key)
        if i < len(raw_phases) - 1 and until is None:
            p.fail(f"{key}.until_step", "only the last phase may omit until_step")
        if until is not None and until <= last:
            p.fail(f"{key}.until_step", f"must rise from phase to phase ({until} after {last})")
        last = until if until is not None else last
        phases.append(MixturePhase({k: float(v) for k, v in weights.items()}, until))
    return Workload(
        name,
        tuple(sources),
        tuple(phases),
        max_seq_len,
        microbatches,
        model,
        seed,
        buffer,
        shapes,
        moe,
        workers,
    )


def _check_weights(weights: dict, names: set[str], what: str) -> None:
    unknown = sorted(set(weights) - names)
    if unknown:
        raise WorkloadError(f"{what}: unknown source(s) {unknown} (sources: {sorted(names)})")
    for k, v in weights.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not (v >= 0 and math.isfinite(v)):
            raise WorkloadError(f"{what}.{k}: a weight must be a finite number >= 0, got {v!r}")
    if not any(v > 0 for v in weights.values()):
        raise WorkloadError(f"{what}: at least one weight must be > 0")


class _Reader:
    """Typed, bounded reads of a parsed TOML document; every failure names the file and the key."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, key: str, msg: str):
        raise WorkloadError(f"{self.where}: {key}: {msg}")

    @staticmethod
    def _k(prefix: str, key: str) -> str:
        return f"{prefix}.{key}" if prefix else key

    def keys(self, doc: dict, prefix: str, allowed: set[str]) -> None:
        unknown = sorted(set(doc) - allowed)
        if unknown:
            self.fail(self._k(prefix, unknown[0]), f"unknown key (expected one of {sorted(allowed)})")

    def get(self, doc: dict, key: str, default: Any, prefix: str) -> Any:
        if key not in doc:
            if default is _REQUIRED:
                self.fail(self._k(prefix, key), "missing")
            return default
        return doc[key]

    def string(self, doc, key, *, default=..., prefix="") -> str:
        v = self.get(doc, key, _REQUIRED if default is ... else default, prefix)
        if not isinstance(v, str) or not 1 <= len(v) <= 128:
            self.fail(self._k(prefix, key), f"must be a string of 1..128 characters, got {v!r}")
        return v

    def integer(self, doc, key, lo, hi, *, default=..., prefix="") -> Any:
        v = self.get(doc, key, _REQUIRED if default is ... else default, prefix)
        if v is None and default is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            self.fail(self._k(prefix, key), f"must be a whole number in [{lo}, {hi}], got {v!r}")
        return v

    def number(self, doc, key, lo, hi, *, default=..., prefix="") -> float:
        v = self.get(doc, key, _REQUIRED if default is ... else default, prefix)
        if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
            self.fail(self._k(prefix, key), f"must be a number in [{lo}, {hi}], got {v!r}")
        return float(v)

    def table(self, doc, key, *, prefix="") -> dict:
        v = self.get(doc, key, _REQUIRED, prefix)
        if not isinstance(v, dict):
            self.fail(self._k(prefix, key), f"must be a table, got {type(v).__name__}")
        return v

    def array(self, doc, key, bound) -> list:
        v = self.get(doc, key, _REQUIRED, "")
        if not isinstance(v, list) or not 1 <= len(v) <= bound:
            self.fail(key, f"must be an array of 1..{bound} tables, got {v!r:.60}")
        return v

    def source(self, raw: Any, key: str, max_seq_len: int) -> WorkloadSource:
        if not isinstance(raw, dict):
            self.fail(key, "must be a table")
        self.keys(raw, key, {"name", "modality", "length", "text_tokens", "frames", "decode_ms"})
        name = self.string(raw, "name", prefix=key)
        mod = self.get(raw, "modality", _REQUIRED, key)
        if mod not in {str(m) for m in Modality}:
            self.fail(f"{key}.modality", f"must be one of {[str(m) for m in Modality]}, got {mod!r}")
        modality = Modality(mod)
        if modality is Modality.GENERATION:  # no encoder work: only its LLM tokens cost
            self.fail(
                f"{key}.modality",
                "a generation source (caption + image codes) costs what a text source of as many tokens "
                'costs: give it as modality = "text"',
            )
        text = self.integer(raw, "text_tokens", 0, max_seq_len, default=0, prefix=key)
        if modality is Modality.TEXT and text:
            self.fail(
                f"{key}.text_tokens", "a text source's length is all text; give text_tokens only for media"
            )
        if "frames" in raw and modality is not Modality.VIDEO:
            self.fail(f"{key}.frames", "sampled frames are for video sources only")
        frames = self.integer(raw, "frames", 1, 4096, default=16, prefix=key)
        if "decode_ms" in raw and modality is Modality.TEXT:
            self.fail(
                f"{key}.decode_ms",
                "a text source has no payload to decode (its tokens come with the metadata)",
            )
        default_ms = DEFAULT_DECODE_MS[str(modality)] * (frames if modality is Modality.VIDEO else 1)
        decode_ms = self.number(raw, "decode_ms", 0, MAX_DECODE_MS, default=default_ms, prefix=key)
        length = self.length(self.table(raw, "length", prefix=key), f"{key}.length", modality, max_seq_len)
        return WorkloadSource(name, modality, length, text, frames, decode_ms * 1e-3)

    def length(self, raw: dict, key: str, modality: Modality, max_seq_len: int) -> LengthDistribution:
        self.keys(raw, key, {"lognormal", "histogram", "fixed", "min", "max"})
        kinds = [k for k in ("lognormal", "histogram", "fixed") if k in raw]
        if len(kinds) != 1:
            self.fail(key, f"give exactly one of lognormal, histogram or fixed, got {kinds or 'none'}")
        top = max_seq_len if modality is not Modality.TEXT else MAX_SAMPLE_TOKENS
        low = self.integer(raw, "min", 1, top, default=1, prefix=key)
        high = self.integer(raw, "max", low, top, default=max_seq_len, prefix=key)
        kind = kinds[0]
        sub = f"{key}.{kind}"
        args: dict[str, Any] = {}
        if kind == "fixed":
            args["median"] = float(self.integer(raw, "fixed", 1, top, prefix=key))
        else:
            body = self.table(raw, kind, prefix=key)
            if kind == "lognormal":
                self.keys(body, sub, {"median", "sigma"})
                args["median"] = self.number(body, "median", 1, MAX_SAMPLE_TOKENS, prefix=sub)
                args["sigma"] = self.number(body, "sigma", 1e-6, MAX_SIGMA, prefix=sub)
            else:
                self.keys(body, sub, {"edges", "weights"})
                edges, weights = body.get("edges"), body.get("weights")
                for k, v in (("edges", edges), ("weights", weights)):
                    if not isinstance(v, list) or len(v) > MAX_BINS + 1:
                        self.fail(f"{sub}.{k}", f"must be an array of at most {MAX_BINS + 1} numbers")
                if any(isinstance(x, bool) or not isinstance(x, int) for x in edges):
                    self.fail(f"{sub}.edges", "must be whole numbers of tokens")
                if any(isinstance(x, bool) or not isinstance(x, int | float) for x in weights):
                    self.fail(f"{sub}.weights", "must be numbers")
                if edges and edges[-1] - 1 > top:
                    self.fail(
                        f"{sub}.edges", f"a {modality} sample cannot exceed {top} tokens (the pack length)"
                    )
                args["edges"], args["weights"] = tuple(edges), tuple(float(w) for w in weights)
        try:
            return LengthDistribution(kind, low=low, high=high, **args)
        except ValueError as exc:
            self.fail(sub, str(exc))

    def model(
        self, raw: dict, media: set[str]
    ) -> tuple[ModelScale, dict[str, TransformerShape], MoEShape | None]:
        self.keys(raw, "model", {"llm", "image", "audio", "image_merge", "temporal_patch", "moe"})
        shapes = {}
        for part in ("llm", "image", "audio"):
            if part not in raw:
                if part == "llm" or part in media or (part == "image" and "video" in media):
                    kind = "video" if part == "image" and "video" in media else part
                    self.fail(
                        f"model.{part}", "missing" + ("" if part == "llm" else f" (a source is {kind})")
                    )
                continue
            v, key = raw[part], f"model.{part}"
            if isinstance(v, str):
                if v not in MODEL_SHAPES:
                    self.fail(key, f"unknown model {v!r} (presets: {sorted(MODEL_SHAPES)})")
                shapes[part] = MODEL_SHAPES[v]
            elif isinstance(v, dict):
                self.keys(v, key, _SHAPE_KEYS)
                for k, x in v.items():
                    number = int if k in ("dim", "n_layers", "n_heads", "n_kv_heads") else int | float
                    ok = (
                        isinstance(x, bool)
                        if k == "gated_mlp"
                        else (not isinstance(x, bool) and isinstance(x, number) and 0 < x <= 1 << 20)
                    )
                    if not ok:
                        self.fail(f"{key}.{k}", f"bad value {x!r}")
                try:
                    shapes[part] = TransformerShape(**v)
                except (TypeError, ValueError) as exc:
                    self.fail(key, str(exc))
            else:
                self.fail(key, f"must be a preset name or a shape table, got {v!r}")
        merge = self.integer(raw, "image_merge", 1, 64, default=2, prefix="model")
        tp = self.integer(raw, "temporal_patch", 1, 16, default=2, prefix="model")
        towers = {k: s for k, s in shapes.items() if k != "llm"}
        scale = model_scale(shapes["llm"], towers, image_merge=merge, temporal_patch=tp)
        moe = self.moe(raw["moe"], shapes["llm"]) if "moe" in raw else None
        if moe is not None:
            llm = shapes["llm"]
            if not llm.gated_mlp:
                self.fail("model.moe", "an MoE LLM needs a gated (SwiGLU) llm shape, gated_mlp = true")
            n = moe.moe_layers(0, llm.n_layers)
            active = llm.matmul_params + n * moe.active_params_delta(llm.dim, llm.mlp_dim)
            scale = dataclasses.replace(scale, llm_params=active)
        return scale, shapes, moe

    def moe(self, raw: Any, llm: TransformerShape) -> MoEShape:
        key = "model.moe"
        if not isinstance(raw, dict):
            self.fail(key, "must be a table {experts, top_k, expert_ffn_dim, ...}")
        self.keys(raw, key, _MOE_KEYS)
        args = {
            "experts": self.integer(raw, "experts", 1, 4096, prefix=key),
            "top_k": self.integer(raw, "top_k", 1, 64, prefix=key),
            "expert_ffn_dim": self.integer(
                raw, "expert_ffn_dim", 1, 1 << 20, default=int(llm.mlp_dim), prefix=key
            ),
            "shared_experts": self.integer(raw, "shared_experts", 0, 64, default=0, prefix=key),
            "shared_expert_ffn_dim": self.integer(
                raw, "shared_expert_ffn_dim", 0, 1 << 20, default=None, prefix=key
            ),
            "every_n_layers": self.integer(raw, "every_n_layers", 1, llm.n_layers, default=1, prefix=key),
        }
        try:
            return MoEShape(**args)
        except ValueError as exc:
            self.fail(key, str(exc))


_REQUIRED = object()
